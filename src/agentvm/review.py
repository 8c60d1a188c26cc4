"""Review-mode grants: the agent edits a granted folder, its writes land in a layer outside it.

``mode: review`` on a grant gives the agent the folder as ``rw`` does, but the sandbox sees an
overlay: the host folder (staged read-only, idmapped, nosuid, nodev - as every grant) is the
lower layer, and every write lands in an upper directory agent-vm keeps outside the folder,
under ``<home>/reviews/``. Nothing reaches the host until the operator looks
(``agentvm diff NAME``) and applies (``agentvm accept NAME [PATHS...]``), or drops it
(``agentvm discard NAME``).

One layer per agent (``reviews/agents/NAME``: a persistent worker's later runs continue it) or
per anonymous run (``reviews/runs/RUN-ID``), kept after the run until accepted or discarded;
in it, one directory per review grant (``g<N>``: the grant's index in the policy)::

    reviews/agents/NAME/          root 0711
      lock                        flock held by the sandbox using the layer (running)
      meta.json                   root 0600: the grants (host folder, its dev:ino, owner...)
      g0/                         root 0711
        baseline.json             root 0600: the host folder as it was when the layer began
        upper/ work/              the agent's uid, 0700: overlayfs upper and work directories

Accept is written against a hostile layer: every path is walked from a directory fd, one
component at a time, never following a link, on both sides (the layer and the host folder);
a layer entry is read through an fd opened ``O_NOFOLLOW`` whose type is checked after the
open; only regular files, directories, symbolic links that stay inside the folder, and
deletions are applied - FIFOs, sockets, devices, links out of the folder and the host-trusted
names (``agentvm.grants.HOST_TRUSTED``, unless the grant's ``writableTrusted`` lists them) are
refused, and setuid/setgid bits are dropped. Files are written to a temporary name beside
their target, owned by the folder's owner, fsync'd, and renamed into place. Before anything
is renamed, every selected change is checked against the baseline: a path the host changed
since the layer began is a conflict, and then nothing is applied.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentvm.errors import AgentVMError, PolicyDenied

KINDS = ("agents", "runs")
TEXT_LIMIT = 1 << 20  # larger files are compared and listed, not shown as a unified diff
OPAQUE_XATTRS = ("user.overlay.opaque", "trusted.overlay.opaque")
TMP_PREFIX = ".agentvm-accept-"
# reads of a layer never move its atime: a running agent that polls stat() of its own file
# would otherwise see when the host reads it (and swap the content between two reads).
# Root may (CAP_FOWNER); anyone else opening another uid's file would get EPERM.
_NOATIME = getattr(os, "O_NOATIME", 0) if os.geteuid() == 0 else 0


def _refuse(code: str, message: str, hint: str = "") -> AgentVMError:
    """An error with a registered code (its exit code and status come from agentvm.errorcodes)."""
    return AgentVMError(message, hint=hint, code=code)


def is_review(m) -> bool:
    """A grant in review mode (``MountGrant.review``)."""
    return bool(getattr(m, "review", False))


def review_mount(host: str, path: str, writable_trusted: tuple[str, ...] = ()):
    """A review-mode ``MountGrant`` (writable, with ``review`` set)."""
    from agentvm.policy import MountGrant

    return MountGrant(host, path, True, tuple(writable_trusted), review=True)


# ---------------------------------------------------------------- where layers live
def reviews_root(home: Path) -> Path:
    return Path(home) / "reviews"


def layer_key(policy, sandbox_id: str) -> tuple[str, str]:
    """(kind, name) of the layer a sandbox of ``policy`` writes: its agent's, else its run's."""
    return ("agents", policy.name) if policy.agent else ("runs", sandbox_id)


def layer_dir(home: Path, kind: str, name: str) -> Path:
    if kind not in KINDS or not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise _refuse("config.invalid", f"not a review layer name: {name!r}")
    return reviews_root(home) / kind / name


def grant_dir(home: Path, kind: str, name: str, index: int) -> Path:
    return layer_dir(home, kind, name) / f"g{int(index)}"


def find_layer(home: Path, name: str) -> Path:
    """The layer of agent ``name``, or of run ``name``; refused when there is none (or both)."""
    found = []
    for kind in KINDS:
        try:
            d = layer_dir(home, kind, name)
        except AgentVMError:
            continue
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            found.append(d)
    if not found:
        raise _refuse("review.not-found", f"no review layer named {name!r}",
                   "`agentvm diff` takes the agent's name, or the run's id for an `agentvm run` without -f; "
                   "`agentvm reviews` lists them")
    if len(found) > 1:
        raise _refuse("config.invalid", f"{name!r} names both an agent's and a run's review layer",
                   f"remove one by its path: {found[0]} or {found[1]}")
    return found[0]


def list_layers(home: Path) -> list[dict]:
    out = []
    for kind in KINDS:
        base = reviews_root(home) / kind
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for n in names:
            d = base / n
            meta = _read_json(d / "meta.json") or {}
            out.append({"name": n, "kind": kind[:-1], "running": is_running(d),
                        "grants": [g.get("host") for g in (meta.get("grants") or {}).values()],
                        "created": meta.get("created")})
    return out


def _read_json(p: Path):
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            return json.loads(fh.read())
    except ValueError:
        return None


def _write_json(p: Path, data) -> None:
    from agentvm.fsutil import write_atomic

    write_atomic(p, json.dumps(data, sort_keys=True).encode(), 0o600)


def _mkdir_owned(p: Path, mode: int, uid: int, gid: int) -> None:
    """``p`` exists as a real directory (not a link) owned by uid:gid with ``mode``."""
    try:
        os.mkdir(p, mode)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse("review.mismatch", f"{p} is not a directory: refusing to use it as a review layer",
                   f"remove {p}")
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(p, uid, gid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(p, mode)  # its parent is root's (0711): nobody else can swap it for a link


def is_running(layer: Path) -> bool:
    """A sandbox holds the layer (its lock)."""
    import fcntl

    try:
        fd = os.open(layer / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the baseline
def _stamp(st: os.stat_result) -> list:
    kind = "d" if stat.S_ISDIR(st.st_mode) else "l" if stat.S_ISLNK(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "o"
    return [kind, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IMODE(st.st_mode)]


def snapshot(host_fd: int) -> dict[str, list]:
    """Every entry of the folder (``host_fd``, a directory fd) -> its stamp: type, inode, size,
    mtime, ctime, mode. Nothing followed, no mount crossed."""
    out: dict[str, list] = {}
    dev = os.fstat(host_fd).st_dev
    stack = [("", os.dup(host_fd))]
    while stack:
        rel, dfd = stack.pop()
        try:
            for name in os.listdir(dfd):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                r = f"{rel}/{name}" if rel else name
                out[r] = _stamp(st)
                if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                    try:
                        stack.append((r, os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)))
                    except OSError:
                        pass
        finally:
            os.close(dfd)
    return out


# ---------------------------------------------------------------- launch: open / close a layer
@dataclass
class LayerHold:
    layer: str
    lock_fd: int


def open_layer(home: Path, kind: str, name: str, grants: list[dict], grant_fds: dict[str, int],
               uid: int, gid: int, sandbox_id: str = "") -> LayerHold:
    """Make (or continue) the layer of ``kind/name`` for a starting sandbox and hold it for the
    sandbox's lifetime. ``grants``: per review grant ``{"fd": fd name, "index", "host", "path",
    "writable_trusted", "protect"}``; the upper/work directories are the agent's (uid:gid).
    A layer already held (a sandbox of it runs) or holding changes of another folder is refused."""
    import fcntl

    root = reviews_root(home)
    for d in (root, root / kind):
        _mkdir_owned(d, 0o711, os.geteuid(), os.getegid())
    layer = layer_dir(home, kind, name)
    _mkdir_owned(layer, 0o711, os.geteuid(), os.getegid())
    lock = os.open(layer / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refuse("review.running", f"the review layer {kind[:-1]} {name!r} is in use by a running sandbox",
                       f"stop it first (agentvm stop {name})") from None
        meta = _read_json(layer / "meta.json") or {}
        recorded = meta.get("grants") or {}
        now = {}
        for g in grants:
            fd = grant_fds[g["fd"]]
            st = os.fstat(fd)
            key = str(g["index"])
            entry = {"host": g["host"], "path": g["path"], "dev": st.st_dev, "ino": st.st_ino,
                     "owner": [st.st_uid, st.st_gid], "mode": stat.S_IMODE(st.st_mode),
                     "writable_trusted": list(g.get("writable_trusted") or ()),
                     "protect": sorted({p.split("/", 1)[0] for p in g.get("protect") or ()})}
            old = recorded.get(key)
            if old is not None and (old.get("dev"), old.get("ino")) != (st.st_dev, st.st_ino):
                raise _refuse("review.mismatch",
                           f"the review layer {name!r} holds changes to {old.get('host')} (grant {key}), not to {g['host']}",
                           f"accept or discard them first (agentvm diff {name}; agentvm accept/discard {name})")
            now[key] = entry
            gd = layer / f"g{key}"
            _mkdir_owned(gd, 0o711, os.geteuid(), os.getegid())
            fresh = not os.path.lexists(gd / "upper")
            upper_mode = stat.S_IMODE(st.st_mode) & 0o777 if fresh else 0o700
            _mkdir_owned(gd / "upper", upper_mode if fresh else stat.S_IMODE(os.lstat(gd / "upper").st_mode), uid, gid)
            _mkdir_owned(gd / "work", 0o700, uid, gid)
            _chown_tree_if_needed(gd / "upper", uid, gid)
            if _read_json(gd / "baseline.json") is None:
                dfd = os.open(g["host"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    if (os.fstat(dfd).st_dev, os.fstat(dfd).st_ino) != (st.st_dev, st.st_ino):
                        raise _refuse("review.mismatch", f"{g['host']} changed while the sandbox was starting: refused")
                    _write_json(gd / "baseline.json", {"taken": time.time(), "entries": snapshot(dfd)})
                finally:
                    os.close(dfd)
        meta = {"kind": kind[:-1], "name": name, "created": meta.get("created") or time.time(),
                "last_sandbox": sandbox_id, "grants": {**recorded, **now}}
        _write_json(layer / "meta.json", meta)
    except BaseException:
        os.close(lock)
        raise
    return LayerHold(str(layer), lock)


def _chown_tree_if_needed(upper: Path, uid: int, gid: int) -> None:
    """A layer continued by a run with another uid (a lease): its entries become that uid's
    (walked by fd, links not followed)."""
    if os.geteuid() != 0:
        return
    st = os.lstat(upper)
    if (st.st_uid, st.st_gid) == (uid, gid):
        return
    for _root, dirs, files, rootfd in os.fwalk(upper, follow_symlinks=False):
        for n in dirs + files:
            try:
                os.chown(n, uid, gid, dir_fd=rootfd, follow_symlinks=False)
            except OSError:
                pass
    os.chown(upper, uid, gid, follow_symlinks=False)


def close_layer(hold: LayerHold | None) -> None:
    if hold is not None and hold.lock_fd >= 0:
        os.close(hold.lock_fd)
        hold.lock_fd = -1


# ---------------------------------------------------------------- fd walking
def _open_dir(base_fd: int, rel: str, *, create: bool = False, mode: int = 0o755,
              owner: tuple[int, int] | None = None, made: list | None = None) -> int:
    """A directory fd for ``rel`` under ``base_fd``, one component at a time, never following a
    link (a link on the way: ELOOP/ENOTDIR). ``create``: make missing components."""
    fd = os.dup(base_fd)
    try:
        for part in [p for p in rel.split("/") if p]:
            if part in (".", ".."):
                raise OSError(errno.EINVAL, f"{part!r} in a path")
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o700, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME, dir_fd=fd)
                if owner is not None and os.geteuid() == 0:
                    os.fchown(nfd, *owner)
                os.fchmod(nfd, mode)
                if made is not None:
                    made.append((os.dup(fd), part))
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lstat_at(base_fd: int, rel: str) -> os.stat_result | None:
    parent, _, name = rel.rpartition("/")
    try:
        dfd = _open_dir(base_fd, parent)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def _host_path_is_linked(base_fd: int, rel: str) -> str | None:
    """The first component of ``rel``'s parents that is not a real directory on the host (a
    link, a file), or None."""
    parts = [p for p in rel.split("/") if p][:-1]
    fd = os.dup(base_fd)
    try:
        for i, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return "/".join(parts[:i + 1])
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return None
    finally:
        os.close(fd)


def _in_parent(base_fd: int, rel: str, op):
    """``op(dfd, name)`` on ``rel``'s parent directory under ``base_fd`` (reached one component at
    a time, no link followed) and its last name, or None when either fails (OSError)."""
    parent, _, name = rel.rpartition("/")
    try:
        dfd = _open_dir(base_fd, parent)
    except OSError:
        return None
    try:
        return op(dfd, name)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _open_file_at(base_fd: int, rel: str) -> int | None:
    """A read fd of the regular file ``rel`` under ``base_fd`` (no link followed on the way or
    at the end; the type checked after the open), or None. The caller closes it."""
    fd = _in_parent(base_fd, rel, lambda dfd, name: os.open(
        name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | _NOATIME, dir_fd=dfd))
    if fd is None:
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _read_file_at(base_fd: int, rel: str, limit: int | None = None) -> bytes | None:
    fd = _open_file_at(base_fd, rel)
    if fd is None:
        return None
    try:
        chunks, n = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if limit is not None and n > limit:
                break
        return b"".join(chunks)
    finally:
        os.close(fd)


def _hash_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        h.update(b)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()


def _file_hash_at(base_fd: int, rel: str) -> str | None:
    fd = _open_file_at(base_fd, rel)
    if fd is None:
        return None
    try:
        return _hash_fd(fd)
    finally:
        os.close(fd)


def _opaque(dfd: int, name: str) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME, dir_fd=dfd)
    except OSError:
        return False
    try:
        for x in OPAQUE_XATTRS:
            try:
                if os.getxattr(fd, x) in (b"y", b"x"):
                    return True
            except OSError:
                continue
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------- what changed
@dataclass
class Change:
    grant: str  # the grant's index (as in meta.json)
    rel: str  # relative to the granted folder
    action: str  # add | modify | delete | mode | symlink | mkdir | refuse
    layer: str = ""  # file | dir | symlink | whiteout | fifo | socket | device
    host: str = ""  # what the host has now: "" (nothing) | file | dir | symlink | other
    old_mode: int | None = None
    new_mode: int | None = None
    target: str | None = None  # a symlink's target in the layer
    old_target: str | None = None
    reason: str = ""  # why refused / notes
    notes: list[str] = field(default_factory=list)
    content_hash: str = ""  # a file's content in the layer (sha256)
    under_opaque: bool = False

    def key(self) -> list:
        return [self.grant, self.rel, self.action, self.new_mode, self.target, self.content_hash]


def _kind_of(st: os.stat_result | None) -> str:
    if st is None:
        return ""
    m = st.st_mode
    if stat.S_ISREG(m):
        return "file"
    if stat.S_ISDIR(m):
        return "dir"
    if stat.S_ISLNK(m):
        return "symlink"
    if stat.S_ISCHR(m) and st.st_rdev == 0:
        return "whiteout"
    if stat.S_ISFIFO(m):
        return "fifo"
    if stat.S_ISSOCK(m):
        return "socket"
    return "device"


def _link_escapes(rel: str, target: str) -> bool:
    """A link at ``rel`` whose target is absolute or climbs out of the folder."""
    if target.startswith("/") or not target:
        return True
    depth = len([p for p in rel.split("/") if p]) - 1
    for part in target.split("/"):
        if part in ("", "."):
            continue
        depth = depth - 1 if part == ".." else depth + 1
        if depth < 0:
            return True
    return False


LINK_HOPS = 40  # the kernel's own limit on symbolic links followed in one lookup


def _link_at(fd: int, path: str) -> tuple[str, str | None]:
    """What ``path`` (every parent already known not to be a link in this tree) is under ``fd``:
    ("link", target) | ("whiteout", None) | ("other", None) | ("none", None)."""
    try:
        st = os.stat(path, dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return "none", None
    if stat.S_ISLNK(st.st_mode):
        return "link", os.readlink(path, dir_fd=fd)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "whiteout", None
    return "other", None


def _link_resolves_out(rel: str, target: str, upper_fd: int | None, host_fd: int | None,
                       applied=None) -> str | None:
    """Why the link at ``rel`` -> ``target`` may lead out of the folder once applied, or None.

    Conservative: it must stay inside under every way the folder may look once it is applied -
    the whole layer over the host (a full accept), the host alone (the layer's other entries not
    applied: a partial accept, or a whiteout of a host link that is not accepted with it), and,
    for a partial accept (``applied(rel)``: the layer's entry at ``rel`` is in the selection),
    the host with only the selected changes."""
    why = _resolve_out(rel, target, upper_fd, host_fd)
    if why is None and applied is not None and upper_fd is not None:
        why = _resolve_out(rel, target, upper_fd, host_fd, applied)
        if why:
            why += " (with only the selected changes applied)"
    if why is None and upper_fd is not None and host_fd is not None:
        why = _resolve_out(rel, target, None, host_fd)
        if why:
            why += " (with the host's entries as they are now)"
    return why


def _resolve_out(rel: str, target: str, upper_fd: int | None, host_fd: int | None, applied=None) -> str | None:
    """Why the link at ``rel`` -> ``target`` leads out of the folder, resolved against one view
    of it (``_link_resolves_out``): the layer's entries (those ``applied`` accepts, if given)
    over the host's.

    Resolved as the kernel would, against the folder as it will be - the layer's entries over
    the host's - following every symbolic link on the way (a chain ``x/l -> ..``, ``esc -> x/l/..``
    is each "inside" as text alone, and leads out together; so does ``e -> vendor/..`` when the
    host's ``vendor`` is a link out). A name that is a link on the host but not in the layer is
    refused (which one wins depends on how it is applied); a loop or more than ``LINK_HOPS``
    links is refused."""
    if not target or target.startswith("/"):
        return f"a symbolic link out of the folder (-> {target})"
    cur = [p for p in rel.split("/") if p][:-1]
    todo = target.split("/")
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not cur:
                return f"a symbolic link out of the folder (-> {target})"
            cur.pop()
            continue
        path = "/".join(cur + [part])
        lk, lt = (_link_at(upper_fd, path) if upper_fd is not None and (applied is None or applied(path))
                  else ("none", None))
        hk, ht = _link_at(host_fd, path) if host_fd is not None and lk != "whiteout" else ("none", None)
        if lk == "link":
            t = lt
        elif hk == "link" and lk == "none":
            t = ht
        elif hk == "link":
            return f"a symbolic link through {path}, a symbolic link on the host (-> {ht}) (-> {target})"
        else:
            cur.append(part)
            continue
        hops += 1
        if hops > LINK_HOPS:
            return f"a symbolic link through too many links (-> {target})"
        if not t or t.startswith("/"):
            return f"a symbolic link out of the folder through {path} -> {t} (-> {target})"
        todo = t.split("/") + todo
    return None


def _trusted_refusal(rel: str, ginfo: dict) -> str | None:
    from agentvm.grants import TRUSTED_NAMES

    top = rel.split("/", 1)[0]
    writable = set(ginfo.get("writable_trusted") or ())
    protected = (set(TRUSTED_NAMES) | set(ginfo.get("protect") or ())) - writable
    if top in protected:
        return f"{top} is a host-trusted name (the host's tools run or obey it): never applied from a review layer"
    return None


_UPPER = threading.local()  # .fd: the upper directory of the layer being walked (this thread)
_UPPER.fd = None  # .applied: None (all of it is applied) or which of its paths a partial accept selects
_UPPER.applied = None


def changes(layer: Path, grant: str, ginfo: dict, host_fd: int, applied=None) -> list[Change]:
    """What the layer of grant ``grant`` changes in the host folder (``host_fd``), path by path.
    ``applied(rel)``: for a partial accept, whether the layer's entry at ``rel`` is selected
    (links are then judged against the host with only those changes too)."""
    upper = layer / f"g{grant}" / "upper"
    try:
        ufd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME)
    except FileNotFoundError:
        return []
    out: list[Change] = []
    try:
        root_st = os.fstat(ufd)
        host_st = os.fstat(host_fd)
        if stat.S_IMODE(root_st.st_mode) != stat.S_IMODE(host_st.st_mode):
            out.append(Change(grant, "", "mode", "dir", "dir", stat.S_IMODE(host_st.st_mode), _safe_mode(root_st.st_mode, True)))
        _UPPER.fd = ufd  # links are resolved against the whole layer, the host, the selection
        _UPPER.applied = applied  # (_link_resolves_out)
        try:
            _walk(ufd, "", grant, ginfo, host_fd, out, opaque=False)
        finally:
            _UPPER.fd = None
            _UPPER.applied = None
    finally:
        os.close(ufd)
    out.sort(key=lambda c: c.rel)
    return out


def _safe_mode(mode: int, is_dir: bool) -> int:
    return stat.S_IMODE(mode) & (0o777 if not is_dir else 0o1777) & ~(stat.S_ISUID | stat.S_ISGID)


MAX_DEPTH = 512  # folder levels of a layer walked (one open fd each); deeper: a refused entry


def _walk(ufd: int, rel: str, grant: str, ginfo: dict, host_fd: int, out: list[Change], opaque: bool) -> None:
    """Every entry of the layer below ``ufd`` (the folder ``rel``) into ``out``. Iterative (one
    dir fd per level on an explicit stack, no Python frame per level): a folder nested past
    MAX_DEPTH is a refused entry (accept applies nothing of it), never a RecursionError that
    would keep the operator from reviewing the rest."""
    stack: list[tuple[int, str, bool, list[str]]] = [(os.dup(ufd), rel, opaque, [])]
    try:
        stack[0] = (stack[0][0], rel, opaque, _enter(stack[0][0], rel, grant, ginfo, host_fd, out, opaque))
        while stack:
            dfd, r, op, names = stack[-1]
            if not names:
                os.close(dfd)
                stack.pop()
                continue
            name = names.pop()
            try:
                sub = _walk_entry(dfd, r, name, grant, ginfo, host_fd, out, op)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone or changed while read (a running sandbox): the next diff shows it as it is then
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                continue
            if sub is None:
                continue
            sfd, sr, sop = sub
            if len(stack) >= MAX_DEPTH:
                os.close(sfd)
                while out and out[-1].rel == sr:
                    out.pop()
                out.append(Change(grant, sr, "refuse", "dir", reason=f"folders nested over {MAX_DEPTH} deep (not "
                                  "walked: nothing in it is applied)"))
                continue
            try:
                subnames = _enter(sfd, sr, grant, ginfo, host_fd, out, sop)
            except (FileNotFoundError, NotADirectoryError):
                os.close(sfd)
                continue
            except BaseException:
                os.close(sfd)
                raise
            stack.append((sfd, sr, sop, subnames))
    finally:
        for dfd, _, _, _ in stack:
            os.close(dfd)


def _enter(ufd: int, rel: str, grant: str, ginfo: dict, host_fd: int, out: list[Change], opaque: bool) -> list[str]:
    """A layer folder's names (sorted backwards: popped first to last); an opaque one's hidden
    host entries recorded as deletions."""
    names = sorted(os.listdir(ufd))
    if opaque:  # the host's entries this directory hides are deleted
        try:
            hfd = _open_dir(host_fd, rel)
        except OSError:
            hfd = -1
        if hfd >= 0:
            try:
                for hn in sorted(os.listdir(hfd)):
                    if hn not in names:
                        r = f"{rel}/{hn}" if rel else hn
                        hst = _lstat_at(host_fd, r)
                        out.append(_refuse_trusted(Change(grant, r, "delete", "whiteout", _kind_of(hst),
                                                          under_opaque=True), ginfo))
            finally:
                os.close(hfd)
    return names[::-1]


def _walk_entry(ufd: int, rel: str, name: str, grant: str, ginfo: dict, host_fd: int, out: list[Change],
                opaque: bool) -> tuple[int, str, bool] | None:
    """One layer entry into ``out``; for a folder, (its fd, its rel, opaque) to walk next."""
    r = f"{rel}/{name}" if rel else name
    st = os.stat(name, dir_fd=ufd, follow_symlinks=False)
    if name.startswith(TMP_PREFIX):  # accept's own temporary names: never the agent's to use
        out.append(Change(grant, r, "refuse", _kind_of(st), reason=f"a name accept reserves ({TMP_PREFIX}*)"))
        return
    lk = _kind_of(st)
    hst = _lstat_at(host_fd, r)
    hk = _kind_of(hst)
    c = Change(grant, r, "", lk, hk, under_opaque=opaque)
    if lk == "whiteout":
        if hk == "":
            return  # deleted what it had made itself
        c.action = "delete"
    elif lk == "dir":
        op = _opaque(ufd, name)
        if hk != "dir":
            c.action, c.new_mode = "mkdir", _safe_mode(st.st_mode, True)
            out.append(_refuse_trusted(c, ginfo))
        elif stat.S_IMODE(st.st_mode) != stat.S_IMODE(hst.st_mode):
            c.action, c.old_mode, c.new_mode = "mode", stat.S_IMODE(hst.st_mode), _safe_mode(st.st_mode, True)
            out.append(_refuse_trusted(c, ginfo))
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME, dir_fd=ufd)
        return sub, r, op and hk == "dir"
    elif lk == "symlink":
        c.target = os.readlink(name, dir_fd=ufd)
        if hk == "symlink":
            c.old_target = _readlink_at(host_fd, r)
            if c.old_target == c.target:
                return
        c.action = "symlink"
        why = _link_resolves_out(r, c.target, getattr(_UPPER, "fd", None), host_fd, getattr(_UPPER, "applied", None))
        if _link_escapes(r, c.target) or why:
            c.action, c.reason = "refuse", why or f"a symbolic link out of the folder (-> {c.target})"
    elif lk == "file":
        c.new_mode = _safe_mode(st.st_mode, False)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            c.notes.append("setuid/setgid bit dropped")
        if st.st_nlink > 1:
            c.notes.append(f"{st.st_nlink} links in the layer: applied as a copy")
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | _NOATIME, dir_fd=ufd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                c.action, c.reason = "refuse", "changed type while read"
                out.append(c)
                return
            c.content_hash = _hash_fd(fd)
        finally:
            os.close(fd)
        if hk == "file":
            c.old_mode = stat.S_IMODE(hst.st_mode)
            same = _file_hash_at(host_fd, r) == c.content_hash
            if same and c.old_mode == c.new_mode:
                return  # copied up, not changed
            c.action = "mode" if same else "modify"
        else:
            c.action = "add"
    else:
        c.action, c.reason = "refuse", f"a {lk} (only files, folders and links inside the folder are applied)"
    out.append(_refuse_trusted(c, ginfo))


def _refuse_trusted(c: Change, ginfo: dict) -> Change:
    if c.action != "refuse":
        why = _trusted_refusal(c.rel, ginfo)
        if why:
            c.action, c.reason = "refuse", why
    return c


def _readlink_at(base_fd: int, rel: str) -> str | None:
    return _in_parent(base_fd, rel, lambda dfd, name: os.readlink(name, dir_fd=dfd))


# ---------------------------------------------------------------- the layer as a whole
@dataclass
class Review:
    layer: Path
    name: str
    meta: dict
    changes: list[Change]
    conflicts: dict[str, str]  # "grant:rel" -> why
    running: bool
    changed_while_shown: list[str] = field(default_factory=list)  # "grant:rel" render() found rewritten

    @property
    def review_id(self) -> str:
        """One digest of the change set (what `accept --expect` checks)."""
        blob = json.dumps([c.key() for c in self.changes], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def open_host(ginfo: dict) -> int:
    """The granted folder, opened as it was recorded (same dev:ino), no link on the way that
    someone other than root could re-point."""
    from agentvm.fsutil import untrusted_symlink

    host = ginfo["host"]
    bad = untrusted_symlink(host)
    if bad is not None:
        raise _refuse("review.mismatch", f"the path to {host} goes through a link a non-root user can change ({bad})")
    try:
        fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse("review.mismatch", f"cannot open the granted folder {host}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (ginfo.get("dev"), ginfo.get("ino")):
        os.close(fd)
        raise _refuse("review.mismatch", f"{host} is no longer the folder that was granted (it was replaced)",
                   "discard the layer (agentvm discard NAME), or put the folder back")
    return fd


def _conflict(host_fd: int, baseline: dict, c: Change) -> str | None:
    """Why the host's version of ``c.rel`` is not the one the layer began from, or None."""
    base = baseline.get(c.rel)
    now = _lstat_at(host_fd, c.rel)
    linked = _host_path_is_linked(host_fd, c.rel)
    if linked is not None:
        return f"{linked} on the host is not a folder (a link or a file)"
    if base is None:
        if now is not None:
            return "created on the host since the sandbox started"
    elif now is None:
        return "deleted on the host since the sandbox started"
    elif _stamp(now)[:5] != base[:5] or _stamp(now)[5] != base[5]:
        if not (base[0] == "d" and _stamp(now)[0] == "d" and now.st_ino == base[1] and c.action != "mode"):
            return "changed on the host since the sandbox started"
    if c.action in ("delete", "add", "symlink") and now is not None and stat.S_ISDIR(now.st_mode):
        # a host folder this change removes (or replaces): everything in it as it was
        prefix = c.rel + "/"
        try:
            sub = _open_dir(host_fd, c.rel)
        except OSError:
            return "cannot be read on the host"
        try:
            for r, st in snapshot(sub).items():
                b = baseline.get(prefix + r)
                if b is None:
                    return f"{prefix + r} was created on the host since the sandbox started"
                if st[0] != "d" and st[:5] != b[:5]:
                    return f"{prefix + r} changed on the host since the sandbox started"
        finally:
            os.close(sub)
    return None


def load(home: Path, name: str, paths_filter: tuple[str, ...] = ()) -> Review:
    layer = find_layer(home, name)
    meta = _read_json(layer / "meta.json")
    if not isinstance(meta, dict):
        raise _refuse("review.not-found", f"the review layer {name!r} has no readable meta.json", f"discard it: agentvm discard {name}")
    allc: list[Change] = []
    conflicts: dict[str, str] = {}
    for g, ginfo in sorted((meta.get("grants") or {}).items()):
        hfd = open_host(ginfo)
        try:
            applied = None
            if paths_filter:
                def applied(rel: str, _g=g, _gi=ginfo) -> bool:
                    return _selected(Change(_g, rel, ""), _gi, paths_filter)
            cs = [c for c in changes(layer, g, ginfo, hfd, applied) if _selected(c, ginfo, paths_filter)]
            baseline = (_read_json(layer / f"g{g}" / "baseline.json") or {}).get("entries") or {}
            new_dirs = {c.rel for c in cs if c.action == "mkdir"}
            for c in cs:
                if c.action == "refuse" or any(c.rel.startswith(d + "/") for d in new_dirs):
                    continue  # inside a folder the layer makes: nothing of the host's there
                why = _conflict(hfd, baseline, c)
                if why:
                    conflicts[f"{g}:{c.rel}"] = why
            allc += cs
        finally:
            os.close(hfd)
    return Review(layer, name, meta, allc, conflicts, is_running(layer))


def _selected(c: Change, ginfo: dict, wanted: tuple[str, ...]) -> bool:
    if not wanted:
        return True
    for w in wanted:
        for base in (ginfo.get("path", ""), ginfo.get("host", "")):
            if base and (w == base or w.startswith(base.rstrip("/") + "/")):
                w = w[len(base.rstrip("/")):].lstrip("/")
                break
        w = w.strip("/")
        if not w or c.rel == w or c.rel.startswith(w + "/"):
            return True
    return False


# ---------------------------------------------------------------- rendering
def render(rv: Review, *, home_fd_cache: dict | None = None) -> str:
    """The diff as text: a unified diff for text files, a line for everything else."""
    lines: list[str] = []
    grants = rv.meta.get("grants") or {}
    for c in rv.changes:
        ginfo = grants.get(c.grant, {})
        shown = f"{ginfo.get('path', '?').rstrip('/')}/{c.rel}" if c.rel else ginfo.get("path", "?")
        hostp = f"{ginfo.get('host', '?').rstrip('/')}/{c.rel}" if c.rel else ginfo.get("host", "?")
        flag = f"  CONFLICT: {rv.conflicts[f'{c.grant}:{c.rel}']}" if f"{c.grant}:{c.rel}" in rv.conflicts else ""
        notes = f"  ({'; '.join(c.notes)})" if c.notes else ""
        if c.action == "refuse":
            lines.append(f"REFUSED {shown}: {c.reason}")
            continue
        if c.action == "delete":
            lines.append(f"deleted {shown} ({c.host or 'entry'}){flag}")
            continue
        if c.action == "mkdir":
            lines.append(f"new folder {shown} mode {c.new_mode:04o}" + (f" (replaces a {c.host})" if c.host else "") + flag)
            continue
        if c.action == "symlink":
            was = f" (was -> {c.old_target})" if c.old_target is not None else (f" (replaces a {c.host})" if c.host else "")
            lines.append(f"symlink {shown} -> {c.target}{was}{flag}")
            continue
        if c.action == "mode":
            lines.append(f"mode {shown}: {c.old_mode:04o} -> {c.new_mode:04o}{notes}{flag}")
            continue
        # add / modify: a unified diff when both sides are text
        new, same = _layer_bytes(rv.layer, c)
        if not same:
            rv.changed_while_shown.append(f"{c.grant}:{c.rel}")
            lines.append(f"{'new file' if c.action == 'add' else 'modified'} {shown}: CHANGED WHILE SHOWN (the layer's "
                         f"file is no longer the one hashed for the review id: not shown){flag}")
            continue
        old = b""
        if c.action == "modify":
            try:
                hfd = open_host(ginfo)
                try:
                    old = _read_file_at(hfd, c.rel, TEXT_LIMIT) or b""
                finally:
                    os.close(hfd)
            except AgentVMError:
                old = b""
        head = ("new file" if c.action == "add" else "modified") + f" {shown}"
        if c.action == "add":
            head += f" mode {c.new_mode:04o}" + (f" (replaces a {c.host})" if c.host else "")
        elif c.old_mode != c.new_mode:
            head += f" mode {c.old_mode:04o} -> {c.new_mode:04o}"
        if _is_text(old) and _is_text(new):
            import difflib

            a = _lines(old.decode())
            b = _lines(new.decode())
            body: list[str] = []
            for ln in difflib.unified_diff(a, b, "a/" + hostp.lstrip("/") if c.action == "modify" else "/dev/null",
                                           "b/" + hostp.lstrip("/"), n=3):
                body.append(ln[:-1] if ln.endswith("\n") else ln)
                if not ln.endswith("\n"):
                    body.append("\\ No newline at end of file")
            if any(_visible(x) != x for x in body):
                head += "  (control or bidirectional characters, shown escaped)"
            lines.append(head + notes + flag)
            lines += body
        else:
            lines.append(head + notes + flag)
            big = max(len(old), len(new)) > TEXT_LIMIT
            lines.append(f"{'Large' if big else 'Binary'} files differ (not shown; sha256 {c.content_hash[:16]}; the "
                         f"layer's copy: {rv.layer}/g{c.grant}/upper/{c.rel})")
    if not rv.changes:
        lines.append("no changes")
    if rv.changed_while_shown:  # the id would bind content this diff did not show
        lines.append(f"review id: withheld ({len(rv.changed_while_shown)} file(s) changed in the layer while this diff "
                     f"read them: the sandbox is writing; look again, or stop it first: agentvm stop {rv.name})")
    else:
        lines.append(f"review id: {rv.review_id}" + (" (the sandbox is running: accept with --expect this id)" if rv.running else ""))
    # every line as plain text: a name or a line of the agent's cannot move the cursor, erase
    # or reorder what the reviewer sees (terminal escapes, CR, bidi overrides: shown escaped)
    return "\n".join(_visible(x) for x in lines) + "\n"


# shown escaped in a diff: C0 controls but TAB, DEL, C1 controls, the bidirectional and
# zero-width format characters ("Trojan Source"), line and paragraph separators
_INVISIBLE = frozenset([*range(0x00, 0x09), *range(0x0a, 0x20), *range(0x7f, 0xa0), 0x061c, 0x200b, 0x200c, 0x200d,
                        0x200e, 0x200f, *range(0x202a, 0x202f), *range(0x2060, 0x2065), *range(0x2066, 0x206a),
                        0x2028, 0x2029, 0xfeff])


def _visible(text: str) -> str:
    if not any(ord(ch) in _INVISIBLE for ch in text):
        return text
    return "".join((f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{{{ord(ch):04x}}}") if ord(ch) in _INVISIBLE
                   else ch for ch in text)


def _lines(text: str) -> list[str]:
    """Lines split at LF only (a CR or form feed stays inside its line, shown escaped)."""
    out = text.split("\n")
    last = out.pop()
    return [x + "\n" for x in out] + ([last] if last else [])


def _is_text(b: bytes | None) -> bool:
    """UTF-8 within TEXT_LIMIT: shown as a diff. A NUL does not make it binary (a shell runs a
    script with one; it is shown escaped, never hidden behind "binary")."""
    if b is None or len(b) > TEXT_LIMIT:
        return False
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _layer_bytes(layer: Path, c: Change) -> tuple[bytes, bool]:
    """The layer's file as shown, and whether it is the content ``c.content_hash`` (the review
    id) binds: read once, through one fd, and hashed as read. A file the agent rewrote since
    load() hashed it (a running sandbox) is reported changed, so a diff never shows one content
    under the id of another. A file past TEXT_LIMIT is not shown (only its hash is)."""
    try:
        ufd = os.open(layer / f"g{c.grant}" / "upper", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME)
    except OSError:
        return b"", False
    try:
        fd = _open_file_at(ufd, c.rel)
    finally:
        os.close(ufd)
    if fd is None:
        return b"", False
    try:
        h = hashlib.sha256()
        chunks, n = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
            n += len(b)
            if n > TEXT_LIMIT:
                return b"".join(chunks) + b, True  # too large to show: what is shown is the hash
            chunks.append(b)
        return b"".join(chunks), h.hexdigest() == c.content_hash
    finally:
        os.close(fd)


def to_json(rv: Review) -> dict:
    return {"name": rv.name, "layer": str(rv.layer), "running": rv.running, "review_id": rv.review_id,
            "changes": [{"grant": c.grant, "path": c.rel, "action": c.action, "layer": c.layer, "host": c.host,
                         "old_mode": c.old_mode, "new_mode": c.new_mode, "target": c.target,
                         "old_target": c.old_target, "reason": c.reason, "notes": c.notes,
                         "sha256": c.content_hash or None,
                         "conflict": rv.conflicts.get(f"{c.grant}:{c.rel}")} for c in rv.changes]}


# ---------------------------------------------------------------- accept
@dataclass
class _Staged:
    dfd: int  # the target's directory on the host
    name: str
    tmp: str | None  # the staged entry's name beside it (None: a deletion or a mode change)
    change: Change


def accept(home: Path, name: str, paths_filter: tuple[str, ...] = (), *, expect: str | None = None,
           record=None) -> dict:
    """Apply the layer's changes (all, or those under ``paths_filter``) to the host folders.
    All or nothing: refused entries or conflicts in the selection refuse the whole accept,
    before anything is written. ``record(kind, data)`` puts ``review.accepted`` on the audit
    chain before the first rename (a change that cannot be recorded is not applied)."""
    rv = load(home, name, paths_filter)
    if rv.running and expect is None:
        raise _refuse("review.running", f"the sandbox using the review layer {name!r} is running: its agent can change "
                   "the layer after you looked",
                   f"stop it first, or accept exactly what `agentvm diff {name}` showed: --expect {rv.review_id}")
    if expect is not None and expect != rv.review_id:
        raise _refuse("review.changed", f"the review layer {name!r} changed since the diff you expect (now {rv.review_id})",
                   f"look again: agentvm diff {name}")
    refused = [c for c in rv.changes if c.action == "refuse"]
    if refused:
        raise _refuse("review.refused", "the layer holds entries agent-vm never applies; nothing was applied:\n"
                   + "\n".join(f"  {_visible(c.rel)}: {_visible(c.reason)}" for c in refused),
                   f"accept the other paths by naming them (agentvm accept {name} PATH...), or discard the layer")
    if rv.conflicts:
        raise _refuse("review.conflict", "changed on the host since the sandbox started (nothing was applied):\n"
                   + "\n".join(f"  {_show(rv, k)}: {v}" for k, v in sorted(rv.conflicts.items())),
                   f"merge by hand, or accept the other paths by naming them (agentvm accept {name} PATH...)")
    if not rv.changes:
        return {"name": name, "applied": [], "review_id": rv.review_id}
    grants = rv.meta.get("grants") or {}
    applied: list[str] = []
    by_grant: dict[str, list[Change]] = {}
    for c in rv.changes:
        by_grant.setdefault(c.grant, []).append(c)
    # stage everything first (every grant), then check the host again, record, rename: nothing
    # half-applied. What is applied is what was reviewed: a file's content is checked against
    # the hash the review showed as it is copied; links and modes are taken from the review.
    staged: list[_Staged] = []
    made: list[tuple[int, str]] = []
    host_fds: dict[str, int] = {}
    try:
        for g, cs in sorted(by_grant.items()):
            ginfo = grants[g]
            hfd = host_fds[g] = open_host(ginfo)
            owner = tuple(ginfo.get("owner") or (os.fstat(hfd).st_uid, os.fstat(hfd).st_gid))
            ufd = os.open(rv.layer / f"g{g}" / "upper", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME)
            tmpdirs: dict[str, str] = {}
            try:
                for c in cs:
                    staged.append(_stage(ufd, hfd, c, owner, made, tmpdirs))
            finally:
                os.close(ufd)
        # the host again, now that everything is staged: a path changed meanwhile refuses it all
        late: dict[str, str] = {}
        for g, cs in sorted(by_grant.items()):
            baseline = (_read_json(rv.layer / f"g{g}" / "baseline.json") or {}).get("entries") or {}
            new_dirs = {c.rel for c in cs if c.action == "mkdir"}
            for c in cs:
                if (c.rel in new_dirs and not c.host) or any(c.rel.startswith(d + "/") for d in new_dirs):
                    continue  # made by this accept (nothing of the host's was there)
                why = _conflict(host_fds[g], baseline, c)
                if why:
                    late[f"{g}:{c.rel}"] = why
        if late:
            raise _refuse("review.conflict", "changed on the host while accept staged it (nothing was applied):\n"
                          + "\n".join(f"  {_show(rv, k)}: {v}" for k, v in sorted(late.items())),
                          f"look again: agentvm diff {name}")
        if record is not None:
            record("review.accepted", {"name": name, "review_id": rv.review_id, "layer": str(rv.layer),
                                       "paths": [_show(rv, f"{c.grant}:{c.rel}") + f" ({c.action})" for c in rv.changes]})
        for s in staged:
            _commit(s)
            applied.append(_show(rv, f"{s.change.grant}:{s.change.rel}"))
    except BaseException:
        for s in staged:
            if s.tmp is not None:
                try:
                    _remove_tree_at(s.dfd, s.tmp)
                except OSError:
                    pass
        if not applied:
            for dfd, part in reversed(made):
                try:
                    os.rmdir(part, dir_fd=dfd)
                except OSError:
                    pass
        raise
    finally:
        for s in staged:
            os.close(s.dfd)
        for dfd, _ in made:
            os.close(dfd)
        for fd in host_fds.values():
            os.close(fd)
    _after_accept(rv, paths_filter)
    return {"name": name, "applied": applied, "review_id": rv.review_id}


def _show(rv: Review, key: str) -> str:
    g, _, rel = key.partition(":")
    host = ((rv.meta.get("grants") or {}).get(g) or {}).get("host", "?")
    return _visible(f"{host.rstrip('/')}/{rel}" if rel else host)


def _staged_parent(rel: str, tmpdirs: dict[str, str]) -> str:
    """``rel``'s parent as staged: under the temporary name of a folder that replaces a file."""
    parent = rel.rpartition("/")[0]
    for d in sorted(tmpdirs, key=len, reverse=True):
        if parent == d or parent.startswith(d + "/"):
            return tmpdirs[d] + parent[len(d):]
    return parent


def _stage(ufd: int, hfd: int, c: Change, owner: tuple, made: list, tmpdirs: dict[str, str]) -> _Staged:
    name = c.rel.rpartition("/")[2]
    if c.rel == "":  # the folder's own mode
        return _Staged(os.dup(hfd), "", None, c)
    if c.action == "delete":
        return _Staged(_open_dir(hfd, c.rel.rpartition("/")[0]), name, None, c)
    parent = _staged_parent(c.rel, tmpdirs)
    dfd = _open_dir(hfd, parent, create=True, mode=0o755, owner=owner, made=made)
    tmp = f"{TMP_PREFIX}{secrets.token_hex(6)}"
    try:
        if c.action == "mode" and c.layer == "dir":
            return _Staged(dfd, name, None, c)
        if c.action == "mkdir":
            # a new folder where there was nothing is made now (removed again if accept fails);
            # one that replaces a file or link is staged under a temporary name
            target = name if not c.host else tmp
            os.mkdir(target, 0o700, dir_fd=dfd)
            if not c.host:
                made.append((os.dup(dfd), name))
            else:
                tmpdirs[c.rel] = f"{parent}/{tmp}" if parent else tmp
            nfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                if os.geteuid() == 0:
                    os.fchown(nfd, *owner)
                os.fchmod(nfd, c.new_mode & 0o777)
            finally:
                os.close(nfd)
            return _Staged(dfd, name, tmp if c.host else None, c)
        if c.action == "symlink":
            os.symlink(c.target, tmp, dir_fd=dfd)
            if os.geteuid() == 0:
                os.chown(tmp, *owner, dir_fd=dfd, follow_symlinks=False)
            return _Staged(dfd, name, tmp, c)
        # add / modify / mode of a file: a copy of the layer's file, read through one fd
        lparent, _, lname = c.rel.rpartition("/")
        ldfd = _open_dir(ufd, lparent)
        try:
            src = os.open(lname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | _NOATIME, dir_fd=ldfd)
        finally:
            os.close(ldfd)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise _refuse("review.refused", f"{c.rel} in the layer is no longer a regular file: nothing was applied")
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                h = hashlib.sha256()
                while True:
                    b = os.read(src, 1 << 20)
                    if not b:
                        break
                    h.update(b)
                    view = memoryview(b)
                    while view:
                        view = view[os.write(dst, view):]
                if h.hexdigest() != c.content_hash:
                    raise _refuse("review.changed", f"{c.rel} changed in the layer while accept read it: nothing was applied")
                if os.geteuid() == 0:
                    os.fchown(dst, *owner)
                os.fchmod(dst, c.new_mode & 0o777)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return _Staged(dfd, name, tmp, c)
    except BaseException:
        try:
            _remove_tree_at(dfd, tmp)
        except OSError:
            pass
        os.close(dfd)
        raise


def _remove_tree_at(dfd: int, name: str) -> None:
    """Remove ``name`` under ``dfd`` (a whole tree for a directory), links never followed."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    # any depth, two fds and no recursion: each folder inside is emptied by moving its folders
    # up into the top one (renames inside the doomed tree only) and unlinking the rest
    top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if os.fstat(top).st_dev != st.st_dev:
            raise OSError(errno.EXDEV, f"{name} is a mount point")
        tag = secrets.token_hex(4)
        moved = 0
        while names := os.listdir(top):
            for n in names:
                if not stat.S_ISDIR(os.stat(n, dir_fd=top, follow_symlinks=False).st_mode):
                    os.unlink(n, dir_fd=top)
                    continue
                sub = os.open(n, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
                try:
                    if os.fstat(sub).st_dev != st.st_dev:
                        raise OSError(errno.EXDEV, f"{n} is a mount point")
                    for x in os.listdir(sub):
                        if stat.S_ISDIR(os.stat(x, dir_fd=sub, follow_symlinks=False).st_mode):
                            moved += 1
                            os.rename(x, f"{TMP_PREFIX}rm-{tag}-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                        else:
                            os.unlink(x, dir_fd=sub)
                finally:
                    os.close(sub)
                os.rmdir(n, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=dfd)


def _commit(s: _Staged) -> None:
    c = s.change
    if c.action == "delete":
        _remove_tree_at(s.dfd, s.name)
        return
    if c.action == "mode" and c.layer == "dir":
        fd = s.dfd if c.rel == "" else os.open(s.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=s.dfd)
        try:
            os.fchmod(fd, c.new_mode & 0o777)
        finally:
            if fd != s.dfd:
                os.close(fd)
        return
    try:
        cur = os.stat(s.name, dir_fd=s.dfd, follow_symlinks=False)
    except FileNotFoundError:
        cur = None
    if c.action == "mkdir":
        if s.tmp is None:
            return  # made while staging
        if cur is not None:
            _remove_tree_at(s.dfd, s.name)  # the file (or link) the folder replaces
        os.rename(s.tmp, s.name, src_dir_fd=s.dfd, dst_dir_fd=s.dfd)
        return
    if cur is not None and stat.S_ISDIR(cur.st_mode):
        _remove_tree_at(s.dfd, s.name)  # a folder a file or link replaces
    os.rename(s.tmp, s.name, src_dir_fd=s.dfd, dst_dir_fd=s.dfd)  # atomic for a file or link


def _after_accept(rv: Review, paths_filter: tuple[str, ...]) -> None:
    """The baseline follows what was applied; with the sandbox stopped, applied entries leave
    the layer (all of it when everything was accepted)."""
    grants = rv.meta.get("grants") or {}
    for g, ginfo in grants.items():
        gd = rv.layer / f"g{g}"
        mine = [c for c in rv.changes if c.grant == g]
        if not mine:
            continue
        base = _read_json(gd / "baseline.json") or {"entries": {}}
        entries = base.get("entries") or {}
        try:
            hfd = open_host(ginfo)
        except AgentVMError:
            continue
        try:
            for c in mine:
                for k in [k for k in entries if k == c.rel or k.startswith(c.rel + "/")] if c.action == "delete" else []:
                    entries.pop(k, None)
                st = _lstat_at(hfd, c.rel)
                if st is not None:
                    entries[c.rel] = _stamp(st)
                    if stat.S_ISDIR(st.st_mode) and c.action == "mkdir":
                        sub = _open_dir(hfd, c.rel)
                        try:
                            entries.update({f"{c.rel}/{r}": v for r, v in snapshot(sub).items()})
                        finally:
                            os.close(sub)
                parent = c.rel.rpartition("/")[0]
                while parent:
                    pst = _lstat_at(hfd, parent)
                    if pst is not None:
                        entries[parent] = _stamp(pst)
                    parent = parent.rpartition("/")[0]
            if not rv.running:
                if not paths_filter:
                    # everything of this grant was applied: the layer starts over from the host
                    _clear_dir(gd / "upper")
                    (gd / "baseline.json").unlink(missing_ok=True)
                    continue
                ufd = os.open(gd / "upper", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | _NOATIME)
                try:
                    for c in mine:
                        if c.action in ("add", "modify", "mode", "symlink", "delete") and c.layer != "dir" \
                                and not c.under_opaque:
                            _in_parent(ufd, c.rel, lambda dfd, nm: os.unlink(nm, dir_fd=dfd))  # (gone already: fine)
                finally:
                    os.close(ufd)
            base["entries"] = entries
            _write_json(gd / "baseline.json", base)
        finally:
            os.close(hfd)


def _clear_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        for n in os.listdir(fd):
            _remove_tree_at(fd, n)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- discard
def discard(home: Path, name: str, *, record=None) -> dict:
    layer = find_layer(home, name)
    if is_running(layer):
        raise _refuse("review.running", f"the sandbox using the review layer {name!r} is running",
                   f"stop it first (agentvm stop {name}), then discard")
    if record is not None:
        record("review.discarded", {"name": name, "layer": str(layer)})
    parent = os.open(layer.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _remove_tree_at(parent, layer.name)
    finally:
        os.close(parent)
    return {"name": name, "discarded": str(layer)}


def check_substrate(policy, substrate: str) -> None:
    """A substrate that cannot give review-mode grants refuses them (never a plain rw grant)."""
    if any(is_review(m) for m in policy.mounts):
        raise PolicyDenied(
            f"the {substrate} substrate cannot give review-mode grants yet (its file system gofer has no "
            "overlay whose upper layer agent-vm keeps): refused rather than granting read-write",
            hint="run the agent on the bwrap substrate, or use mode: rw / ro for this grant",
            code="policy.review-unsupported")
