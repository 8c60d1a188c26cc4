"""Snapshots of an agent's workspace, and what fork and restore do with them (issue 37).

A snapshot is the agent's workspace as a tar stream (folders and regular files, read through
directory fds with O_NOFOLLOW while the sandbox is paused: a link is never followed, and
counted as left out), stored content-addressed like images::

    <home>/snapshots/<id>/workspace.tar     0600, the folders 0700 (root-only, outside every sandbox)
    id = sha256("agentvm-snapshot-v1" \\0 sha256(workspace.tar) \\0 policy digest \\0 image)

with the policy digest and image (digest) it ran on; ``policy.json`` beside it keeps the agent
file and live changes that digest was computed from (a fork is judged against it). The index
(agent, tag, digests, size) is a table of the daemon's state database; ``load`` recomputes the
tar's digest and the id before a fork or restore uses it, and ``untar_into`` again as it
extracts: an edited or swapped snapshot is refused (``checkpoint.tampered``).

A memory snapshot (gVisor, ``agentvm snapshot NAME --memory``) also holds the sandbox's
checkpoint image under ``<id>/memory`` (root-only), whose digest is part of the id
(:func:`snapshot_id`) and is checked by :meth:`SnapshotStore.load_memory` before a fork
restores it; ``extra.json`` keeps the placeholders the memory holds (the fork's gate refuses
them as leaks). The workspace tar is staged while the sandbox is paused (:meth:`SnapshotStore.
stage`) and committed with the image once the checkpoint is written (:meth:`SnapshotStore.commit`).

Size (docs/concepts.md "Snapshots"): the tar is streamed to a root-only file under
``<home>/snapshots`` (never held in memory), hashed as it is written. A file is stored at its
full length - Python's tarfile writes no sparse members - so the files' lengths together may
not exceed the agent's ``limits.disk`` (``snapshot.too-large``, before anything is written past
it): a restore writes them back at that length, into the same limit. The tar may not eat into
the host's reserve for agent-vm's state (``wspool.host_reserve``: ``snapshot.no-room``).
A restore extracts into a fresh folder inside the workspace and swaps it in only when all of
it was written and its digest checked: on a failure (the limit, a full disk, a tampered tar)
the workspace is as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
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
MAX_BYTES = 1 << 30  # a snapshot's content where the agent has no disk limit, at most (1 GiB)
HEADER_SLACK = 32 << 20  # the tar's headers beyond its files' content, at most (~64k members)
CHUNK = 1 << 20
STAGING = ".agentvm-restore-"  # a restore's fresh folder inside the workspace (swapped in on success)

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
    memory_digest: str | None = None  # a memory snapshot (gVisor): its checkpoint image's digest

    def to_dict(self) -> dict:
        return dict(self.__dict__)


COLUMNS = ("id, agent, tag, workspace_digest, policy_digest, image, bytes, files, skipped, created, memory_digest")


def root(home: Path) -> Path:
    return Path(home) / "snapshots"


def snapshot_id(workspace_digest: str, policy_digest: str, image: str, memory_digest: str | None = None) -> str:
    parts = [DOMAIN, workspace_digest.encode(), policy_digest.encode(), image.encode()]
    if memory_digest:  # (a memory snapshot: its checkpoint image is part of what it is)
        parts.append(b"memory:" + memory_digest.encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


class _Sink:
    """The tar's bytes to a file, hashed and counted as they go; past ``cap`` refused."""

    def __init__(self, f, cap: int, on_cap) -> None:
        self.f, self.cap, self.on_cap = f, cap, on_cap
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, b) -> int:
        self.n += len(b)
        if self.n > self.cap:
            raise self.on_cap(self.n)
        self.h.update(b)
        self.f.write(b)
        return len(b)


def host_room(path: Path) -> int:
    """Bytes a snapshot may still take on the disk holding ``path`` (agent-vm's state): its free
    space less what the workspace pool keeps free there for the daemon's state and audit."""
    from agentvm.wspool import host_reserve

    v = os.statvfs(path)
    return max(0, v.f_bavail * v.f_frsize - host_reserve(v.f_blocks * v.f_frsize))


def tar_workspace(host_dir: Path, out, *, limit: int, room: int | None = None) -> tuple[str, int, int, int]:
    """The workspace as a tar (folders and regular files, walked by fd, never following a link),
    streamed to the binary file ``out``: (its sha256, bytes, files, members left out). Refused
    (``snapshot.too-large``) once the files' lengths pass ``limit`` (the agent's disk limit: a
    sparse file counts at its length), or (``snapshot.no-room``) once the tar passes ``room``."""
    counts = {"files": 0, "skipped": 0, "bytes": 0, "limit": limit}

    def on_cap(n):
        if room is not None and n > room:
            return AgentVMError(f"no room for the snapshot on the host: {room >> 20} MiB free above the reserve kept "
                                "for agent-vm's state and audit", code="snapshot.no-room",
                                hint="free space on the disk holding the agent-vm home (`agentvm snapshot rm` old ones)")
        return AgentVMError(f"the snapshot's tar passes {(limit + HEADER_SLACK) >> 20} MiB (its files' headers too)",
                            code="snapshot.too-large", hint="remove files the agent need not keep, then snapshot again")

    cap = limit + HEADER_SLACK if room is None else min(limit + HEADER_SLACK, room)
    sink = _Sink(out, cap, on_cap)
    top = os.open(host_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK) as tf:
            _walk(top, "", tf, counts)
    finally:
        os.close(top)
    return sink.h.hexdigest(), sink.n, counts["files"], counts["skipped"]


# a snapshot walks at most MAX_DEPTH folder levels (one open fd each) and members of paths up to
# MAX_NAME bytes: a restore extracts by path (PATH_MAX less its staging folder) and clears a
# workspace with shutil.rmtree (a Python frame per level), so a deeper tree would snapshot but
# not restore: refused at snapshot time instead (snapshot.too-deep)
MAX_DEPTH = 512
MAX_NAME = 3584


def _walk(top: int, prefix: str, tf: tarfile.TarFile, counts: dict) -> None:
    """Depth-first, names sorted, a folder before its entries; iterative (an explicit stack of
    dir fds, no Python frame per level): past MAX_DEPTH / MAX_NAME a clear ``snapshot.too-deep``,
    never RecursionError."""
    stack: list[tuple[int, str, list[str]]] = [(os.dup(top), prefix, [])]
    try:
        stack[0] = (stack[0][0], prefix, sorted(os.listdir(top), reverse=True))
        while stack:
            dfd, pre, names = stack[-1]
            if not names:
                os.close(dfd)
                stack.pop()
                continue
            name = names.pop()  # (sorted backwards: the first name last)
            rel = f"{pre}{name}"
            if len(stack) > MAX_DEPTH or len(rel.encode()) > MAX_NAME:
                raise AgentVMError(f"the workspace holds folders nested too deep to snapshot and restore "
                                   f"({len(stack)} levels, a path of {len(rel.encode())} bytes: at most {MAX_DEPTH} "
                                   f"levels and {MAX_NAME} bytes): {rel[:120]!r}...", code="snapshot.too-deep",
                                   hint="move or remove the deep folder inside the sandbox, then snapshot again")
            _walk_one(dfd, name, rel, tf, counts, stack)
    finally:
        for dfd, _, _ in stack:
            os.close(dfd)


def _walk_one(dfd: int, name: str, rel: str, tf: tarfile.TarFile, counts: dict, stack: list) -> None:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            ti = tarfile.TarInfo(rel)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, stat.S_IMODE(st.st_mode) & 0o777, int(st.st_mtime)
            tf.addfile(ti)
            names = sorted(os.listdir(fd), reverse=True)
        except BaseException:
            os.close(fd)
            raise
        stack.append((fd, rel + "/", names))  # walked next (closed by _walk)
    elif stat.S_ISREG(st.st_mode):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):  # (swapped meanwhile: left out)
                counts["skipped"] += 1
                return
            counts["bytes"] += fst.st_size
            if counts["bytes"] > counts["limit"]:
                alloc = fst.st_blocks * 512
                sparse = (f" ({rel} is sparse: {fst.st_size} bytes long, {alloc} allocated)"
                          if alloc < fst.st_size else "")
                raise AgentVMError(
                    f"the workspace's files are longer than its disk limit ({counts['limit'] >> 20} MiB) together"
                    f"{sparse}: a snapshot stores each file at its full length, and a restore writes it back "
                    "at that length into the same limit", code="snapshot.too-large",
                    hint="remove (or shorten) the files the agent need not keep, then snapshot again")
            ti = tarfile.TarInfo(rel)
            ti.size, ti.mode, ti.mtime = fst.st_size, stat.S_IMODE(fst.st_mode) & 0o777, int(fst.st_mtime)
            with os.fdopen(os.dup(fd), "rb") as f:
                tf.addfile(ti, f)
            counts["files"] += 1
        finally:
            os.close(fd)
    else:  # a link, FIFO, socket or device: never followed, never copied
        counts["skipped"] += 1


class _HashReader:
    def __init__(self, f) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.h.update(b)
        return b

    def drain(self) -> str:
        while b := self.read(CHUNK):
            pass
        return self.h.hexdigest()


def _no_room(exc: OSError) -> bool:
    return exc.errno in (errno.EDQUOT, errno.ENOSPC, errno.EFBIG)


def untar_into(tar: Path, digest: str, host_dir: Path, uid: int | None, gid: int | None, *,
               replace: bool) -> None:
    """Unpack a snapshot (streamed from ``tar``, its sha256 checked against ``digest`` as it is
    read) into a workspace that nothing runs in (a fork before its launch, a restore after its
    stop): folders and regular files only, no setuid/setgid, owned by the sandbox's uid. It is
    extracted into a fresh folder inside the workspace first; only when all of it is there
    (and the digest matched) is the workspace's content (``replace``) removed and the new one
    moved in - on any failure the workspace is as it was (``snapshot.no-room`` for its disk
    limit or a full disk, ``checkpoint.tampered`` for a tar that is not the one recorded)."""
    host_dir = Path(host_dir)
    staging = host_dir / f"{STAGING}{secrets.token_hex(6)}"
    os.mkdir(staging, 0o700)
    try:
        with open(tar, "rb") as raw:
            hr = _HashReader(raw)
            with tarfile.open(fileobj=hr, mode="r|", bufsize=CHUNK) as tf:
                tf.extractall(staging, members=_checked(tf), filter="data")
            got = hr.drain()
        if got != digest:
            raise AgentVMError(f"the snapshot's tar does not match the digest recorded for it (found {got[:16]}): "
                               "edited or replaced; nothing was changed", code="checkpoint.tampered")
        if uid is not None:
            _chown_all(staging, uid, gid if gid is not None else uid)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _no_room(exc):
            raise AgentVMError(
                f"the snapshot does not fit in the workspace ({os.strerror(exc.errno)}): the workspace's current "
                "content and the snapshot's must fit its disk limit together while it is restored; nothing was "
                "changed", code="snapshot.no-room",
                hint="remove files from the workspace (or raise limits.disk), then restore again") from exc
        raise
    except tarfile.TarError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise AgentVMError(f"the snapshot's tar cannot be read ({exc}); nothing was changed",
                           code="checkpoint.tampered") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # all of it is there: the swap (removals and renames inside one filesystem, no new data);
    # without ``replace`` (a fork's new workspace: empty, unless a kept one of that name) the
    # snapshot's entries win over what is there by the same name
    if replace:
        clear(host_dir, keep=staging.name)
    for e in os.scandir(staging):
        dest = host_dir / e.name
        if not replace and (dest.exists() or dest.is_symlink()):
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            else:
                dest.unlink()
        os.rename(e.path, dest)
    os.rmdir(staging)


def _checked(tf: tarfile.TarFile):
    for m in tf:
        if not (m.isdir() or m.isreg()) or m.name.startswith("/") or ".." in m.name.split("/"):
            raise AgentVMError(f"the snapshot holds a member it cannot: {m.name!r}", code="checkpoint.tampered")
        yield m


def _chown_all(top: Path, uid: int, gid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(top):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


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
        if own is None or ph in creds.placeholders.values() or ph in extra_p.values():
            continue
        # one name per placeholder: a credential may have several ancestors' (a parent's now, the
        # one its memory snapshot holds, a grandparent's) - NAME.parent, NAME.parent-2, ...
        key, i = name, 1
        while key in extra_p or key in creds.placeholders:
            i += 1
            key = f"{name}-{i}"
        extra_b.append(dataclasses.replace(own, name=key, hosts=(), env=f"AGENTVM_ANCESTOR_{len(extra_b)}", file=None))
        extra_p[key] = ph
    if not extra_b:
        return creds
    return vault_credentials(tuple(bindings) + tuple(extra_b), {**creds.placeholders, **extra_p}, vault_dir, sandbox_id)


def clear(host_dir: Path, keep: str | None = None) -> None:
    """Empty a workspace (nothing runs in it): its contents (but ``keep``), never following a link."""
    for e in os.scandir(host_dir):
        if e.name == keep:
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)


class SnapshotStore:
    def __init__(self, home: Path, db: Path) -> None:
        self.home = Path(home)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db), check_same_thread=False, timeout=5.0, isolation_level=None)
        from agentvm.statedb import init_schema

        init_schema(self._db, db, _SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(snapshots)")}
        if "memory_digest" not in cols:  # (a store from before memory snapshots)
            try:
                self._db.execute("ALTER TABLE snapshots ADD COLUMN memory_digest TEXT")
            except sqlite3.OperationalError:  # (another process added it meanwhile)
                pass

    def path(self, sid: str) -> Path:
        return root(self.home) / sid / "workspace.tar"

    def take(self, agent: str, tag: str | None, host_dir: Path, *, policy_digest: str, image: str, limit: int,
             policy_doc: dict) -> Snapshot:
        """Tar ``host_dir`` into the store (streamed to a root-only file, hashed as it is written;
        see :func:`tar_workspace` for what is refused) and index it. ``policy_doc``: the agent
        file and live changes ``policy_digest`` was computed from (kept as policy.json)."""
        return self.commit(agent, tag, self.stage(host_dir, limit=limit), policy_digest=policy_digest, image=image,
                           policy_doc=policy_doc)

    def stage(self, host_dir: Path, *, limit: int) -> tuple[Path, str, int, int, int]:
        """The workspace's tar, written to a root-only file in the store not indexed yet:
        (its path, digest, bytes, files, left out). :meth:`commit` indexes it, :meth:`unstage`
        drops it."""
        top = root(self.home)
        top.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(top, 0o700)
        tmp = top / f".taking-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                try:
                    wd, size, files, skipped = tar_workspace(Path(host_dir), f, limit=limit, room=host_room(top))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as exc:
                    if _no_room(exc):
                        raise AgentVMError(f"no room for the snapshot on the host ({os.strerror(exc.errno)})",
                                           code="snapshot.no-room", hint="free space on the disk holding the "
                                           "agent-vm home (`agentvm snapshot rm` old ones)") from exc
                    raise
        except BaseException:
            self.unstage((tmp,))
            raise
        return tmp, wd, size, files, skipped

    @staticmethod
    def unstage(staged) -> None:
        try:
            os.unlink(staged[0])
        except FileNotFoundError:
            pass

    def commit(self, agent: str, tag: str | None, staged, *, policy_digest: str, image: str, policy_doc: dict,
               memory: Path | None = None, memory_digest: str | None = None, extra: dict | None = None) -> Snapshot:
        """Index a staged tar. A memory snapshot also gets ``memory`` (a sealed checkpoint image
        whose digest is ``memory_digest``), linked (or copied) into ``<id>/memory`` root-only and
        checked against that digest there; ``extra``: JSON kept beside it (``extra.json``)."""
        from agentvm import checkpoint

        tmp, wd, size, files, skipped = staged
        top = root(self.home)
        sid = snapshot_id(wd, policy_digest, image, memory_digest)
        d = top / sid
        try:
            d.mkdir(exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
            pfd = os.open(d / ".policy.json.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(pfd, "w") as pf:
                json.dump(policy_doc, pf)
            os.replace(d / ".policy.json.tmp", d / "policy.json")
            if extra is not None:
                efd = os.open(d / "extra.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                with os.fdopen(efd, "w") as ef:
                    json.dump(extra, ef)
            if memory is not None:
                mem = d / "memory"
                shutil.rmtree(mem, ignore_errors=True)
                checkpoint.make_private_dir(mem)
                for dirpath, dirnames, filenames in os.walk(memory):
                    rel = os.path.relpath(dirpath, memory)
                    for dn in dirnames:
                        os.mkdir(mem / rel / dn, 0o700)
                    for fn in filenames:
                        src, dst = os.path.join(dirpath, fn), mem / rel / fn
                        try:  # the image is never written again: a link costs nothing
                            os.link(src, dst, follow_symlinks=False)
                        except OSError:
                            shutil.copyfile(src, dst, follow_symlinks=False)
                        os.chmod(dst, 0o600)
                got, _ = checkpoint.image_digest(mem)
                if got != memory_digest:
                    raise AgentVMError("the memory image changed while it was stored in the snapshot", code="checkpoint.tampered")
            os.replace(tmp, d / "workspace.tar")
        except BaseException:
            self.unstage(staged)
            raise
        snap = Snapshot(sid, agent, tag, wd, policy_digest, image, size, files, skipped, time.time(), memory_digest)
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO snapshots ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                             (snap.id, snap.agent, snap.tag, snap.workspace_digest, snap.policy_digest, snap.image,
                              snap.bytes, snap.files, snap.skipped, snap.created, snap.memory_digest))
        return snap

    def extra(self, snap: Snapshot) -> dict:
        try:
            doc = json.loads((root(self.home) / snap.id / "extra.json").read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def memory_dir(self, snap: Snapshot) -> Path:
        return root(self.home) / snap.id / "memory"

    def load_memory(self, snap: Snapshot) -> tuple[Path, int]:
        """A memory snapshot's checkpoint image (its folder, bytes), checked against the digest
        recorded for it (which the id covers): an edited, added or swapped file is refused."""
        from agentvm import checkpoint

        d = self.memory_dir(snap)
        if not snap.memory_digest:
            raise AgentVMError(f"snapshot {snap.id[:16]} holds no memory", code="snapshot.not-found")
        if not d.is_dir():
            raise AgentVMError(f"snapshot {snap.id[:16]}'s memory image is gone", code="checkpoint.missing",
                               hint="`agentvm snapshot ls` lists what is there")
        got, size = checkpoint.image_digest(d)
        if got != snap.memory_digest or snapshot_id(snap.workspace_digest, snap.policy_digest, snap.image,
                                                    got) != snap.id:
            raise AgentVMError(f"snapshot {snap.id[:16]}'s memory image does not match the digest recorded when it "
                               f"was taken (found {got[:16]}): it was edited or replaced; refused",
                               code="checkpoint.tampered", hint=f"remove it: `agentvm snapshot rm {snap.id[:16]}`")
        return d, size

    def policy_doc(self, snap: Snapshot) -> dict | None:
        """The agent file and live changes the snapshot's policy digest was computed from (None:
        a snapshot taken before they were kept, or unreadable). The caller checks the digest."""
        try:
            doc = json.loads((root(self.home) / snap.id / "policy.json").read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("spec_text"), str) else None

    def all(self, agent: str | None = None) -> list[Snapshot]:
        q, args = f"SELECT {COLUMNS} FROM snapshots", ()
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
            return list(self._db.execute("SELECT name, placeholder FROM lineage WHERE child=? ORDER BY rowid", (child,)))

    def drop_lineage(self, child: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM lineage WHERE child=?", (child,))

    def load(self, snap: Snapshot) -> Path:
        """The snapshot's tar (its path), checked against its recorded digest and id (else
        refused), read in chunks; :func:`untar_into` checks the digest again as it extracts."""
        p = self.path(snap.id)
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:
                while b := f.read(CHUNK):
                    h.update(b)
        except FileNotFoundError:
            raise AgentVMError(f"snapshot {snap.id[:16]}'s files are gone", code="checkpoint.missing",
                               hint="`agentvm snapshot ls` lists what is there") from None
        wd = h.hexdigest()
        if wd != snap.workspace_digest or snapshot_id(wd, snap.policy_digest, snap.image, snap.memory_digest) != snap.id:
            raise AgentVMError(f"snapshot {snap.id[:16]} does not match the digest recorded when it was taken "
                               f"(found {wd[:16]}): it was edited or replaced; refused", code="checkpoint.tampered",
                               hint=f"remove it: `agentvm snapshot rm {snap.id[:16]}`")
        return p
