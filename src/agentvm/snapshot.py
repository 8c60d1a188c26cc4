"""Snapshots of an agent's workspace, and what fork and restore do with them (issue 37).

A snapshot is the agent's workspace as a tar stream (folders and regular files, read through
directory fds with O_NOFOLLOW while the sandbox is paused: a link is never followed, and
counted as left out), stored content-addressed like images::

    <home>/snapshots/<id>/workspace.tar     0600, the folders 0700 (root-only, outside every sandbox)
    id = sha256("agentvm-snapshot-v1" \\0 sha256(workspace.tar) \\0 policy digest \\0 image)

with the policy digest and image (digest) it ran on. The index (agent, tag, digests, size) is
a table of the daemon's state database; ``verify`` recomputes the tar's digest and the id
before a fork or restore uses it: an edited or swapped snapshot is refused
(``checkpoint.tampered``). Memory is not captured (see docs/concepts.md: a memory fork would
carry the parent's credential placeholders into the child).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sqlite3
import stat
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import AgentVMError

DOMAIN = b"agentvm-snapshot-v1"
MAX_BYTES = 1 << 30  # a workspace snapshot's content, at most (1 GiB)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    tag TEXT,
    workspace_digest TEXT NOT NULL,
    policy_digest TEXT NOT NULL,
    image TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    files INTEGER NOT NULL,
    skipped INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lineage (
    child TEXT NOT NULL,            -- a forked agent
    name TEXT NOT NULL,             -- an ancestor's credential, as the child's gate knows it (NAME.parent)
    placeholder TEXT NOT NULL,      -- the ancestor's placeholder (random, worthless outside its session)
    PRIMARY KEY (child, name, placeholder)
);
"""


@dataclass
class Snapshot:
    id: str
    agent: str
    tag: str | None
    workspace_digest: str
    policy_digest: str
    image: str
    bytes: int
    files: int
    skipped: int
    created: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def root(home: Path) -> Path:
    return Path(home) / "snapshots"


def snapshot_id(workspace_digest: str, policy_digest: str, image: str) -> str:
    return hashlib.sha256(b"\0".join([DOMAIN, workspace_digest.encode(), policy_digest.encode(),
                                      image.encode()])).hexdigest()


def tar_workspace(host_dir: Path) -> tuple[bytes, int, int]:
    """The workspace as a tar (folders and regular files, walked by fd, never following a link):
    (tar bytes, files, members left out)."""
    buf = io.BytesIO()
    counts = {"files": 0, "skipped": 0, "bytes": 0}
    top = os.open(host_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tf:
        try:
            _walk(top, "", tf, counts)
        finally:
            os.close(top)
    return buf.getvalue(), counts["files"], counts["skipped"]


def _walk(dfd: int, prefix: str, tf: tarfile.TarFile, counts: dict) -> None:
    for name in sorted(os.listdir(dfd)):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        rel = f"{prefix}{name}"
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                ti = tarfile.TarInfo(rel)
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, stat.S_IMODE(st.st_mode) & 0o777, int(st.st_mtime)
                tf.addfile(ti)
                _walk(fd, rel + "/", tf, counts)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            try:
                fst = os.fstat(fd)
                if not stat.S_ISREG(fst.st_mode):  # (swapped meanwhile: left out)
                    counts["skipped"] += 1
                    continue
                counts["bytes"] += fst.st_size
                if counts["bytes"] > MAX_BYTES:
                    raise AgentVMError(f"the workspace holds more than {MAX_BYTES >> 20} MiB: too large to snapshot",
                                       code="config.invalid", hint="remove what it need not keep, then snapshot again")
                ti = tarfile.TarInfo(rel)
                ti.size, ti.mode, ti.mtime = fst.st_size, stat.S_IMODE(fst.st_mode) & 0o777, int(fst.st_mtime)
                with os.fdopen(os.dup(fd), "rb") as f:
                    tf.addfile(ti, f)
                counts["files"] += 1
            finally:
                os.close(fd)
        else:  # a link, FIFO, socket or device: never followed, never copied
            counts["skipped"] += 1


def untar_into(data: bytes, host_dir: Path, uid: int | None, gid: int | None) -> None:
    """Unpack a snapshot into an empty workspace that nothing runs in (a fork before its launch,
    a restore after its stop): folders and regular files only, no setuid/setgid, owned by
    the sandbox's uid."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        members = tf.getmembers()
        for m in members:
            if not (m.isdir() or m.isreg()) or m.name.startswith("/") or ".." in m.name.split("/"):
                raise AgentVMError(f"the snapshot holds a member it cannot: {m.name!r}", code="checkpoint.tampered")
        tf.extractall(host_dir, members=members, filter="data")
    if uid is not None:
        for dirpath, dirnames, filenames in os.walk(host_dir):
            for n in dirnames + filenames:
                os.lchown(os.path.join(dirpath, n), uid, gid if gid is not None else uid)


def with_ancestors(creds, bindings: tuple, ancestors: list[tuple[str, str]], vault_dir, sandbox_id: str):
    """A fork's CredentialSet with its ancestors' placeholders added as credentials bound to no
    host: the parent's placeholder replayed in the child is a ``credential:leak:NAME.parent``
    (refused, alerted), never swapped. ``ancestors``: (NAME.parent, placeholder)."""
    import dataclasses

    from agentvm.sessioncreds import vault_credentials

    by = {b.name: b for b in bindings}
    extra_b, extra_p = [], {}
    for name, ph in ancestors:
        own = by.get(name.split(".", 1)[0])
        if own is None or ph in creds.placeholders.values():
            continue
        extra_b.append(dataclasses.replace(own, name=name, hosts=(), env=f"AGENTVM_ANCESTOR_{len(extra_b)}", file=None))
        extra_p[name] = ph
    if not extra_b:
        return creds
    return vault_credentials(tuple(bindings) + tuple(extra_b), {**creds.placeholders, **extra_p}, vault_dir, sandbox_id)


def clear(host_dir: Path) -> None:
    """Empty a workspace (nothing runs in it): its contents, never following a link."""
    for e in os.scandir(host_dir):
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)


class SnapshotStore:
    def __init__(self, home: Path, db: Path) -> None:
        self.home = Path(home)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db), check_same_thread=False, timeout=5.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def path(self, sid: str) -> Path:
        return root(self.home) / sid / "workspace.tar"

    def put(self, agent: str, tag: str | None, data: bytes, policy_digest: str, image: str, files: int,
            skipped: int) -> Snapshot:
        wd = hashlib.sha256(data).hexdigest()
        sid = snapshot_id(wd, policy_digest, image)
        d = root(self.home) / sid
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root(self.home), 0o700)
        os.chmod(d, 0o700)
        tmp = d / ".workspace.tar.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / "workspace.tar")
        snap = Snapshot(sid, agent, tag, wd, policy_digest, image, len(data), files, skipped, time.time())
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO snapshots VALUES (?,?,?,?,?,?,?,?,?,?)",
                             (snap.id, snap.agent, snap.tag, snap.workspace_digest, snap.policy_digest, snap.image,
                              snap.bytes, snap.files, snap.skipped, snap.created))
        return snap

    def all(self, agent: str | None = None) -> list[Snapshot]:
        q, args = "SELECT * FROM snapshots", ()
        if agent is not None:
            q, args = q + " WHERE agent=?", (agent,)
        with self._lock:
            return [Snapshot(*r) for r in self._db.execute(q + " ORDER BY created", args)]

    def find(self, ref: str) -> Snapshot | None:
        """By id (or a unique prefix of 8+ hex), or by ``AGENT:TAG`` / a tag (the newest)."""
        rows = self.all()
        if len(ref) >= 8 and all(c in "0123456789abcdef" for c in ref):
            hit = [s for s in rows if s.id.startswith(ref)]
            if len(hit) == 1:
                return hit[0]
        agent, _, tag = ref.rpartition(":")
        hit = [s for s in rows if s.tag == tag and (not agent or s.agent == agent)]
        return hit[-1] if hit else None

    def remove(self, sid: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM snapshots WHERE id=?", (sid,))
        shutil.rmtree(root(self.home) / sid, ignore_errors=True)

    def add_lineage(self, child: str, placeholders: list[tuple[str, str]]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR IGNORE INTO lineage VALUES (?,?,?)",
                                 [(child, n, p) for n, p in placeholders])

    def lineage(self, child: str) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._db.execute("SELECT name, placeholder FROM lineage WHERE child=?", (child,)))

    def drop_lineage(self, child: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM lineage WHERE child=?", (child,))

    def load(self, snap: Snapshot) -> bytes:
        """The snapshot's tar, checked against its recorded digest and id (else refused)."""
        try:
            data = self.path(snap.id).read_bytes()
        except FileNotFoundError:
            raise AgentVMError(f"snapshot {snap.id[:16]}'s files are gone", code="checkpoint.missing",
                               hint="`agentvm snapshot ls` lists what is there") from None
        wd = hashlib.sha256(data).hexdigest()
        if wd != snap.workspace_digest or snapshot_id(wd, snap.policy_digest, snap.image) != snap.id:
            raise AgentVMError(f"snapshot {snap.id[:16]} does not match the digest recorded when it was taken "
                               f"(found {wd[:16]}): it was edited or replaced; refused", code="checkpoint.tampered",
                               hint=f"remove it: `agentvm snapshot rm {snap.id[:16]}`")
        return data
