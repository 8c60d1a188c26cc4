"""Host identities for sandboxes: a dedicated unprivileged uid per agent.

* A declared agent gets a uid of its own, allocated once and recorded in the state database,
  so its workspace files are owned by that uid and no other agent can touch them.
* An anonymous ``agentvm run`` leases a uid from a separate pool for the life of the run
  (an ``flock``-ed file, so a crashed supervisor never leaks it); the lease is released only
  after teardown verified that no process of that uid remains.

The ranges are above the usual subuid allocations and configurable with
``AGENTVM_UID_BASE``. ``agentvm doctor`` checks that no local account uses them.
"""

from __future__ import annotations

import os
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import BackendError

AGENT_RANGE = 60000  # uids for named agents: base .. base+AGENT_RANGE-GATE_UIDS-1
# the top of the agent range: one uid per confined gate worker slot (agentvm.gate.confine), so at
# most this many agents run at once with egress (each one worker). Was 64 (a 65th running agent
# was refused); an installation's identities never reached this band (58,976 agents ever made),
# and one that did is refused by agent_identity rather than share a uid with a gate worker.
GATE_UIDS = 1024
LEASE_RANGE = 60000  # uids for anonymous runs: base+AGENT_RANGE ..


DEFAULT_BASE = 2100000
SLOT = AGENT_RANGE + LEASE_RANGE  # one installation's whole range
MAX_SLOTS = 64


def registry_dir() -> Path:
    """Host-wide: which installation (home) holds which uid range."""
    return Path(os.environ.get("AGENTVM_UID_REGISTRY", "/var/lib/agentvm-uid-ranges"))


def uid_base(home: Path) -> int:
    """The first uid of this installation's range. ``AGENTVM_UID_BASE`` sets it explicitly;
    otherwise the range is claimed once, host-wide, for this home (``<registry>/<base>`` holds
    the home's path, ``<home>/uid-range`` the base) and kept: two installations on one host
    never hand out the same uids, so one's teardown sweep cannot kill the other's processes."""
    env = os.environ.get("AGENTVM_UID_BASE")
    if env:
        try:
            base = int(env)
        except ValueError:
            raise BackendError(f"AGENTVM_UID_BASE={env!r} is not a number") from None
        if base < 65536:
            raise BackendError(f"AGENTVM_UID_BASE={base} is below 65536 (ordinary accounts live there)")
        return base
    mine = Path(home) / "uid-range"
    try:
        return int(mine.read_text().split()[0])
    except FileNotFoundError:
        pass
    except (ValueError, IndexError):
        raise BackendError(f"{mine} is damaged", hint=f"it holds this installation's uid base (see {registry_dir()})") from None
    return _claim(Path(home), mine)


def _claim(home: Path, mine: Path) -> int:
    import fcntl

    reg = registry_dir()
    reg.mkdir(mode=0o755, parents=True, exist_ok=True)
    real = os.path.realpath(home)
    lock = os.open(reg / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if mine.exists():  # another process of this installation claimed it meanwhile
            return int(mine.read_text().split()[0])
        slots = [(DEFAULT_BASE + k * SLOT, reg / str(DEFAULT_BASE + k * SLOT)) for k in range(MAX_SLOTS)]
        # ours already (the home's own record was lost): keep it, wherever it is
        found = next((b for b, sl in slots if sl.exists() and _owner(sl) == real), None)
        if found is None:
            for b, slot in slots:
                try:
                    fd = os.open(slot, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                except FileExistsError:
                    if _abandoned(_owner(slot), b):
                        _write_atomic(slot, real + "\n")  # its installation is gone, and nothing runs in its range
                        found = b
                        break
                    continue
                os.write(fd, (real + "\n").encode())
                os.close(fd)
                found = b
                break
        if found is None:
            raise BackendError(f"no free uid range left in {reg} ({MAX_SLOTS} installations)",
                               hint="remove the entries of installations that no longer exist")
        base = found
        mine.parent.mkdir(parents=True, exist_ok=True)
        tmp = mine.with_suffix(".tmp")
        tmp.write_text(f"{base}\n")
        os.replace(tmp, mine)
        return base
    finally:
        os.close(lock)


def _owner(slot: Path) -> str:
    try:
        return slot.read_text().strip()
    except OSError:
        return ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _abandoned(owner_home: str, base: int) -> bool:
    """A registered range whose installation certainly no longer exists: its home path is an
    absolute path that is *absent* (its parent is there and says so - not unreadable, not an
    unmounted disk, not another mount namespace's) and no process runs in its range. Anything
    less certain keeps the range taken."""
    if not owner_home or not os.path.isabs(owner_home):
        return False  # not a record agent-vm wrote: leave it alone
    try:
        os.lstat(owner_home)
        return False  # the home is there (whatever its record says, it may still run sandboxes)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    # the nearest ancestor that exists must answer (a listable folder without the next part of
    # the path): then the home's absence is real. A test's temporary home goes with its whole
    # temporary folder, so its parent is gone too - the ancestor above says so.
    parent = os.path.dirname(owner_home.rstrip("/")) or "/"
    while True:
        try:
            os.lstat(parent)
            break
        except FileNotFoundError:
            parent = os.path.dirname(parent) or "/"
        except OSError:
            return False
    try:
        os.listdir(parent)
    except OSError:
        return False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if base <= entry.stat(follow_symlinks=False).st_uid < base + SLOT:
                    return False
                with open(f"/proc/{entry.name}/status") as fh:
                    for line in fh:
                        if line.startswith("Uid:"):
                            if any(base <= int(u) < base + SLOT for u in line.split()[1:]):
                                return False
                            break
            except (OSError, ValueError):
                continue
    return True


@dataclass(frozen=True)
class Identity:
    """The host uid/gid a sandbox runs as, and the lease that keeps it its own."""
    uid: int
    gid: int
    leased: bool  # True for an anonymous-run lease, released at teardown
    lease_fd: int | None = None
    lease_path: str = ""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS identities (
    name TEXT PRIMARY KEY,
    uid INTEGER UNIQUE NOT NULL,
    created REAL NOT NULL
);
"""


SCHEMA_VERSION = 1


def _connect(db: Path):
    from agentvm import statedb  # lazy: anonymous runs never touch the database

    conn = statedb.connect(db, "identities", _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};")
    return conn


def uid_processes(uid: int) -> list[tuple[int, int, str]]:
    """``(pid, ppid, state)`` of every host process whose real uid is ``uid``.

    Part of every verified teardown, so it is kept cheap: one ``stat`` per process, and one
    raw read of ``status`` (bytes, no text layer) only for those that can be the uid's."""
    out = []
    for entry in os.scandir("/proc"):
        name = entry.name
        if not name.isdigit():
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
            # /proc/<pid> belongs to the euid - or to root when the process made itself
            # non-dumpable, so root-owned entries must be read too.
            if owner != uid and owner != 0:
                continue
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, 4096)  # State, PPid and Uid are in the first few hundred bytes
            finally:
                os.close(fd)
            real_uid = int(_status_field(data, b"\nUid:"))
            if real_uid == uid:
                out.append((int(name), int(_status_field(data, b"\nPPid:")), _status_field(data, b"\nState:").decode()))
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
            continue
    return out


def _status_field(data: bytes, key: bytes) -> bytes:
    """The first word after ``key`` in a /proc/PID/status text (ValueError if absent)."""
    i = data.find(key)
    if i < 0:
        raise ValueError(key)
    return data[i + len(key):].split(None, 1)[0]


def uid_has_processes(uid: int) -> list[int]:
    """Live (non-zombie) host pids of ``uid``: teardown verification."""
    return [pid for pid, _, state in uid_processes(uid) if state not in ("Z", "X")]


def agent_identity(db: Path, name: str) -> Identity:
    base = uid_base(db.parent)
    with closing(_connect(db)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("SELECT uid FROM identities WHERE name=?", (name,)).fetchone()
        if row is None:
            used = {r[0] for r in conn.execute("SELECT uid FROM identities")}
            uid = next((u for u in range(base, base + AGENT_RANGE - GATE_UIDS) if u not in used), None)
            if uid is None:
                conn.execute("ROLLBACK")
                raise BackendError("no free agent uid left", hint="remove unused agents or raise AGENTVM_UID_BASE")
            conn.execute("INSERT INTO identities(name, uid, created) VALUES (?,?,?)", (name, uid, time.time()))
            conn.execute("COMMIT")
        else:
            uid = row[0]
            conn.execute("COMMIT")
            if uid >= base + AGENT_RANGE - GATE_UIDS and not os.environ.get("AGENTVM_GATE_UID_BASE"):
                # made when the gate band was narrower: never share a uid with a gate worker
                raise BackendError(
                    f"agent {name!r} has uid {uid}, which is now a confined gate worker's "
                    f"(the top {GATE_UIDS} of the installation's agent uids): refusing to run it as that uid",
                    hint="move the agent to a new name (its workspace is owned by the old uid), or set "
                    "AGENTVM_GATE_UID_BASE to a range no agent uses")
    return Identity(uid=uid, gid=uid, leased=False)


def lease_identity(lease_dir: Path, sandbox_id: str, home: Path) -> Identity:
    """Lease an anonymous-run uid: ``<lease_dir>/<uid>.lock`` held with ``flock`` for the
    life of the run. A lock left by a dead supervisor is free again once no process of that
    uid is alive (the sandbox dies with its supervisor, but we check rather than assume)."""
    import fcntl

    lease_dir.mkdir(parents=True, exist_ok=True)
    base = uid_base(home) + AGENT_RANGE
    start = int.from_bytes(os.urandom(4), "little") % LEASE_RANGE
    for i in range(LEASE_RANGE):
        uid = base + (start + i) % LEASE_RANGE
        path = lease_dir / f"{uid}.lock"
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            # the holder released (unlinked) it between our open and our lock: the lock we
            # hold is on a dead inode, and a newcomer may lock a fresh file of that name
            os.close(fd)
            continue
        if existed and uid_has_processes(uid):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {sandbox_id}\n".encode())
        return Identity(uid=uid, gid=uid, leased=True, lease_fd=fd, lease_path=str(path))
    raise BackendError("no free sandbox uid left for an anonymous run")


def release_lease(ident: Identity) -> None:
    """Give the uid back (call only after teardown verified no process of it remains)."""
    if ident.lease_fd is None:
        return
    try:
        os.unlink(ident.lease_path)
    except OSError:
        pass
    os.close(ident.lease_fd)
