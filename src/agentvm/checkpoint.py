"""Checkpoints of suspended sandboxes (issue 37): where they live, and how each is bound to
its sandbox.

A checkpoint (``runsc checkpoint``'s image) lives under ``<home>/checkpoints/<agent>/<sandbox>``:
root-only (0700 at every level agent-vm creates), outside every sandbox (no substrate mounts
the agent-vm home into one). It is bound to what it was taken from by

    binding = sha256("agentvm-checkpoint-v1" \\0 image-digest \\0 policy-digest \\0 sandbox-id)

where ``image-digest`` is a sha256 over every file of the image (names, modes, sizes,
contents, in order). The binding and its parts are kept in the daemon's state database (a
table of this module's own, not next to the image) and on the audit chain; ``verify`` recomputes
them at resume: an image edited, swapped for another sandbox's or replaced, or a policy
changed since, is refused (``checkpoint.tampered`` / ``checkpoint.policy-changed``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import AgentVMError

DOMAIN = b"agentvm-checkpoint-v1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    name TEXT PRIMARY KEY,          -- the agent
    sandbox_id TEXT NOT NULL,       -- the sandbox checkpointed
    substrate TEXT NOT NULL,
    policy_digest TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    binding TEXT NOT NULL,
    dir TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    placeholders TEXT NOT NULL DEFAULT '{}'  -- the session's credential placeholders (JSON), which its memory holds
);
"""
COLUMNS = "name, sandbox_id, substrate, policy_digest, image_digest, binding, dir, bytes, created, placeholders"


def root(home: Path) -> Path:
    return Path(home) / "checkpoints"


def make_private_dir(path: Path) -> Path:
    """``path`` and its parents up to the agent-vm home, each 0700 (root-only)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    p = path
    while p.name and p.name != "checkpoints" and p.name != "snapshots":
        os.chmod(p, 0o700)
        p = p.parent
    os.chmod(p, 0o700)
    return path


def new_dir(home: Path, name: str, sandbox_id: str) -> Path:
    """A fresh, empty, root-only directory for ``name``'s checkpoint (earlier ones removed)."""
    base = root(home) / name
    if base.exists():
        shutil.rmtree(base)
    return make_private_dir(base / sandbox_id)


def image_digest(directory: Path) -> tuple[str, int]:
    """sha256 over every file under ``directory`` (relative name, type, mode, size, content),
    and the bytes it holds. Symlinks and special files are refused: an image has none."""
    h = hashlib.sha256()
    total = 0
    directory = Path(directory)
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        dirnames.sort()
        for fn in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, fn)
            st = os.lstat(p)
            rel = os.path.relpath(p, directory).encode()
            if not stat.S_ISREG(st.st_mode):
                raise AgentVMError(f"the checkpoint holds a non-regular file: {rel.decode()!r}",
                                   code="checkpoint.tampered", hint="the image was changed: stop the agent and start it again")
            h.update(b"F\0" + rel + b"\0" + f"{stat.S_IMODE(st.st_mode):o}:{st.st_size}".encode() + b"\0")
            with open(p, "rb", buffering=0) as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    h.update(b)
            total += st.st_size
    return h.hexdigest(), total


def binding(image: str, policy_digest: str, sandbox_id: str) -> str:
    return hashlib.sha256(b"\0".join([DOMAIN, image.encode(), policy_digest.encode(), sandbox_id.encode()])).hexdigest()


@dataclass
class Checkpoint:
    name: str
    sandbox_id: str
    substrate: str
    policy_digest: str
    image_digest: str
    binding: str
    dir: str
    bytes: int
    created: float
    # {credential: placeholder} of the session checkpointed: its processes hold these, so a
    # resume must bind the same ones (agentvm.sessioncreds), or their requests go out unswapped
    placeholders: str = "{}"

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def placeholder_map(self) -> dict[str, str]:
        import json

        try:
            d = json.loads(self.placeholders or "{}")
        except ValueError:
            return {}
        return {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) else {}


class CheckpointStore:
    """The bindings, in the daemon's state database (its own table)."""

    def __init__(self, db: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db), check_same_thread=False, timeout=5.0, isolation_level=None)
        from agentvm.statedb import init_schema

        init_schema(self._db, db, _SCHEMA)
        if "placeholders" not in {r[1] for r in self._db.execute("PRAGMA table_info(checkpoints)")}:
            try:  # (a database from before)
                self._db.execute("ALTER TABLE checkpoints ADD COLUMN placeholders TEXT NOT NULL DEFAULT '{}'")
            except sqlite3.OperationalError:  # (added by another process meanwhile)
                pass

    def put(self, cp: Checkpoint) -> None:
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO checkpoints ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                             (cp.name, cp.sandbox_id, cp.substrate, cp.policy_digest, cp.image_digest, cp.binding,
                              cp.dir, cp.bytes, cp.created, cp.placeholders))

    def get(self, name: str) -> Checkpoint | None:
        with self._lock:
            r = self._db.execute(f"SELECT {COLUMNS} FROM checkpoints WHERE name=?", (name,)).fetchone()
        return Checkpoint(*r) if r else None

    def all(self) -> list[Checkpoint]:
        with self._lock:
            return [Checkpoint(*r) for r in self._db.execute(f"SELECT {COLUMNS} FROM checkpoints ORDER BY name")]

    def drop(self, name: str) -> None:
        """Forget ``name``'s checkpoint and remove its files."""
        cp = self.get(name)
        with self._lock:
            self._db.execute("DELETE FROM checkpoints WHERE name=?", (name,))
        if cp is not None:
            shutil.rmtree(Path(cp.dir).parent, ignore_errors=True)


def seal(name: str, sandbox_id: str, substrate: str, policy_digest: str, directory: Path) -> Checkpoint:
    """The binding of a just-written image (its files made root-only first)."""
    for dirpath, dirnames, filenames in os.walk(directory):
        os.chmod(dirpath, 0o700)
        for fn in filenames:
            os.chmod(os.path.join(dirpath, fn), 0o600)
    img, size = image_digest(directory)
    return Checkpoint(name, sandbox_id, substrate, policy_digest, img, binding(img, policy_digest, sandbox_id),
                      str(directory), size, time.time())


def verify(cp: Checkpoint | None, name: str, policy_digest: str) -> Checkpoint:
    """Refuse a checkpoint that is gone, edited, swapped, or taken under another policy."""
    if cp is None or not Path(cp.dir).is_dir():
        raise AgentVMError(f"{name} has no checkpoint to resume from", code="checkpoint.missing",
                           hint=f"start it afresh: `agentvm stop {name} && agentvm start {name}`")
    if policy_digest != cp.policy_digest:
        raise AgentVMError(f"{name}'s policy changed since it was suspended ({cp.policy_digest[:12]} -> "
                           f"{policy_digest[:12]}): a checkpoint resumes only on the policy it was taken under",
                           code="checkpoint.policy-changed",
                           hint=f"restore the agent file, or drop the checkpoint: `agentvm stop {name}`, then start it")
    img, _ = image_digest(Path(cp.dir))
    if img != cp.image_digest or binding(img, policy_digest, cp.sandbox_id) != cp.binding:
        raise AgentVMError(f"{name}'s checkpoint does not match the digest recorded when it was taken "
                           f"(recorded {cp.image_digest[:16]}, found {img[:16]}): it was edited or replaced; refused",
                           code="checkpoint.tampered",
                           hint=f"the checkpoint cannot be trusted: `agentvm stop {name}` drops it, then start it afresh")
    return cp
