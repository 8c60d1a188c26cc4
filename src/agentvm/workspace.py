"""Durable per-agent workspaces with a real size limit.

Two backends (:func:`backend`; ``AGENTVM_WORKSPACE_BACKEND=auto|pool|image``):

- ``pool`` (the default where it works): every workspace is a subvolume of one btrfs
  filesystem, ``<home>/workspaces/.pool.img``, mounted once at ``<runtime>/ws/.pool``, with a
  quota group of the agent's ``limits.disk`` (:mod:`agentvm.wspool`). Thin: a workspace costs
  what it holds; the pool's image is reserved in full on the host and grown on admission; the
  admission rule refuses a start whose agents could write more than the pool has free (times
  the overcommit factor). One loop device in all.
- ``image``: an ext4 filesystem image per agent, ``<home>/workspaces/<name>.img``, fully
  reserved, loop-mounted at ``<runtime>/ws/<name>`` while a sandbox of that agent runs. An
  agent that already has an image keeps it (its data is not moved).

Either way the root directory is owned by the agent's uid, mode 0700, and filling it gives the
agent ``EDQUOT``/``ENOSPC``; the host's disk is never at risk.

Without root (no loop mounts) the workspace is a plain directory and the disk limit cannot be
enforced: that needs the explicit ``--degrade disk-quota``.

Only one sandbox of an agent uses its workspace at a time (an exclusive ``flock`` on
``<home>/workspaces/<name>.lock``): the same lock tells :func:`remove_workspace` that a
workspace is in use, and it is never removed then (nor while its image is mounted or attached
to a loop device).

Lifecycle: ``agentvm rm NAME`` removes the agent's workspace unless it is kept
(``--keep-workspace`` or ``workspace: {keep: true}``: :func:`on_agent_removed`); kept ones are
listed (:func:`list_workspaces`) and removed one by one (:func:`remove_workspace`) or by age
(:func:`prune`; the last use is the image's mtime, set when a sandbox takes and releases it).
:func:`usage` sums them for ``doctor``, ``up`` and ``/metrics`` (one ``scandir``, no lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from agentvm.errors import BackendError, ConfigError, LaunchError, PolicyDenied

from agentvm.wspool import NAME_RE as _NAME_RE  # an agent's name (spec.models.NAME_RE)
from agentvm.wspool import same_file as _same_file

_MKFS = ("/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4")
WARN_USE = 0.90  # doctor and `up` warn when the filesystem holding the workspaces is fuller than this
_NEAR = 1 << 20  # within this of its limit counts as having hit it
_POOL_LOW = 16 << 20  # wspool.SLACK: admission keeps this free beyond every running agent's limit, so a
# pool with less free while the agent is under its own limit ran out under it (overcommit): btrfs gives
# back some reserved space after the failed writes (a full pool shows 1-15M free moments later)
BACKENDS = ("auto", "pool", "image")


@dataclass
class WorkspaceLease:
    """A workspace held for one sandbox: what is mounted, and the lock that keeps it exclusive."""
    name: str
    host_dir: Path  # what is bind-mounted into the sandbox
    mounted: bool  # True when we loop-mounted it and must unmount at teardown
    lock_fd: int
    notes: tuple[str, ...] = ()  # what the operator should hear (a repaired filesystem)
    image: Path | None = None  # the image (or plain directory): its mtime is the workspace's last use
    kind: str = "image"  # "pool", "image" or "dir"
    pool_fd: int = -1  # a pool workspace: the shared hold on the mounted pool
    limit: int = 0
    disk: dict | None = None  # set by release(): the disk at the end (see disk_state)
    pool: object = None  # a pool workspace: its wspool.Pool

    def disk_state(self) -> dict | None:
        """A pool workspace's disk now: ``{"used", "limit", "limit_hit", "pool_free", "pool_size", "pool_full"}``;
        ``pool_full``: the agent is under its own limit and the pool has less free than the
        admission keeps spare - its writes failed (ENOSPC) for want of pool, not of its own limit
        (possible only with overcommit). None for the other backends."""
        if self.kind != "pool" or self.pool_fd < 0:
            return None
        pool = self.pool
        try:
            pool.sync()  # (the agent's writes are on the disk at its stop, and counted)
            e = pool.entry(self.name)
            size, free = pool.space()
        except OSError:
            return None
        used = e.used if e else 0
        lim = (e.limit if e else 0) or self.limit
        return {"used": used, "limit": lim, "limit_hit": bool(lim) and used >= lim - _NEAR,
                "pool_free": free, "pool_size": size,
                "pool_full": free < _POOL_LOW and not (bool(lim) and used >= lim - _NEAR)}

    def release(self) -> list[str]:
        """Unmount (if mounted) and drop the lock. Returns what could not be cleaned. A pool
        workspace: the pool is unmounted when this was its last user (an idle host holds no
        mount and no loop device; the runtime's sweep of ``<runtime>/ws`` does the same for a
        pool whose users died)."""
        left: list[str] = []
        if self.lock_fd >= 0 and self.image is not None:
            _touch(self.image)
        if self.pool_fd >= 0:
            try:
                self.disk = self.disk_state()
            except Exception:  # noqa: BLE001 - a report, never a failed release
                self.disk = None
            os.close(self.pool_fd)
            self.pool_fd = -1
            if self.pool is not None:
                self.pool.unmount_if_idle()
        if self.mounted:
            r = subprocess.run(["umount", str(self.host_dir)], capture_output=True, text=True)
            if r.returncode != 0 and is_mounted(self.host_dir):
                # busy: a lazy unmount still detaches it from the tree
                subprocess.run(["umount", "-l", str(self.host_dir)], capture_output=True)
            if is_mounted(self.host_dir):
                left.append(str(self.host_dir))
            else:
                try:
                    self.host_dir.rmdir()
                except OSError:
                    pass
            self.mounted = False
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        return left


def is_mounted(path: Path) -> bool:
    target = str(path)
    try:
        with open("/proc/self/mountinfo") as fh:
            return any(line.split()[4] == target for line in fh)
    except OSError:
        return False


def free_loop_device() -> int:
    """Ask the kernel for a free loop device (creating one when it may). Fails clearly when the
    host's loop devices are exhausted (e.g. ``loop.max_loop=8``): every running agent with a
    size-limited workspace holds one."""
    import fcntl

    try:
        fd = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise LaunchError("workspace", f"/dev/loop-control: {exc.strerror}") from None
    try:
        n = fcntl.ioctl(fd, 0x4C82)  # LOOP_CTL_GET_FREE
    except OSError as exc:
        limit = _read("/sys/module/loop/parameters/max_loop")
        raise LaunchError(
            "workspace",
            f"no free loop device for the workspace filesystem ({exc.strerror}; loop.max_loop={limit or '?'})",
            hint="stop other agents, or raise the host's loop device limit (loop.max_loop=N on the kernel command line)",
        ) from None
    finally:
        os.close(fd)
    dev = f"/dev/loop{n}"
    if not os.path.exists(dev):  # a /dev without devtmpfs/udev: make the node the kernel created
        os.mknod(dev, 0o600 | 0o060000, os.makedev(7, n))
    return n


def loop_capacity() -> tuple[int, int]:
    """(loop devices in use, host limit or 0 for unlimited)."""
    used = 0
    try:
        for entry in os.listdir("/sys/block"):
            if entry.startswith("loop") and os.path.exists(f"/sys/block/{entry}/loop/backing_file"):
                used += 1
    except OSError:
        pass
    try:
        limit = int(_read("/sys/module/loop/parameters/max_loop") or 0)
    except ValueError:
        limit = 0
    return used, limit


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _mkfs() -> str | None:
    return next((p for p in _MKFS if os.path.exists(p)), None)


def _image_supported() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "loop-mounting a workspace filesystem needs root"
    if _mkfs() is None:
        return False, "mkfs.ext4 missing (apt-get install -y e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return False, "no /dev/loop-control (loop devices unavailable)"
    used, limit = loop_capacity()
    cap = f"{used} of {limit} loop devices in use" if limit else f"{used} loop devices in use"
    return True, f"ext4 image per agent, fully reserved, loop-mounted ({cap}: one per running agent with a workspace)"


def backend() -> tuple[str, str]:
    """(the backend new workspaces get, why): ``pool`` or ``image`` (``none``: neither works).
    ``AGENTVM_WORKSPACE_BACKEND``: ``auto`` (default: the pool where it works, else images),
    ``pool`` or ``image`` (an explicit choice: not falling back)."""
    from agentvm import wspool

    choice = (os.environ.get("AGENTVM_WORKSPACE_BACKEND") or "auto").strip().lower()
    if choice not in BACKENDS:
        raise ConfigError(f"AGENTVM_WORKSPACE_BACKEND={choice!r}: one of {', '.join(BACKENDS)}")
    if choice in ("auto", "pool"):
        ok, why = wspool.supported()
        if ok:
            return "pool", f"{why}; {wspool.project_quota_route()}" + (
                "" if choice == "pool" else " (AGENTVM_WORKSPACE_BACKEND=image: an ext4 image per agent instead)")
        if choice == "pool":
            return "none", f"AGENTVM_WORKSPACE_BACKEND=pool, and the pool cannot run here: {why}"
        ok_i, why_i = _image_supported()
        return ("image" if ok_i else "none"), f"{why_i} (the pool cannot run here: {why})"
    ok_i, why_i = _image_supported()
    return ("image" if ok_i else "none"), f"{why_i} (AGENTVM_WORKSPACE_BACKEND=image)"


def quota_supported() -> tuple[bool, str]:
    """The ``disk-quota`` primitive: whether workspaces get a real size limit, and how."""
    try:
        name, why = backend()
    except ConfigError as exc:
        return False, exc.message
    return name != "none", (f"{name}: {why}" if name != "none" else why)


def lock_agent(home_ws: Path, name: str, why: str, hint: str, *, message: str | None = None,
               code: str | None = None) -> int:
    """Hold ``<workspaces>/<name>.lock`` (an exclusive ``flock``): one sandbox of an agent at
    a time. Returns the fd (closing it releases the lock); refuses if another holds it (with
    ``message``/``code`` when given)."""
    home_ws.mkdir(parents=True, exist_ok=True)
    path = home_ws / f"{name}.lock"
    while True:
        lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise PolicyDenied(message or f"agent {name!r} is already running: {why}", hint=hint,
                                   code=code) from None
            raise
        if _same_file(lock_fd, path):
            return lock_fd
        # removed (remove_workspace unlinks the lock while holding it) between our open and
        # our flock: that lock guards nothing now - take the one at the path
        os.close(lock_fd)


def _touch(p: Path) -> None:
    try:
        os.utime(p)
    except OSError:
        pass


def acquire(
    home_ws: Path, runtime: Path, name: str, *, uid: int, gid: int, size: int, enforce_quota: bool
) -> WorkspaceLease:
    lock_fd = lock_agent(home_ws, name, "its workspace is in use",
                         "wait for the other run to finish (one sandbox per agent workspace)")
    try:
        if not enforce_quota:
            d = home_ws / name
            d.mkdir(mode=0o700, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(d, uid, gid)
            _touch(d)
            return WorkspaceLease(name, d, False, lock_fd, image=d)
        img = home_ws / f"{name}.img"
        if not img.exists() and backend()[0] == "pool":  # an agent that has an image keeps it
            return _acquire_pool(home_ws, runtime, name, uid, gid, size, lock_fd)
        if not img.exists():
            _create_image(img, size)
        elif img.stat().st_size < size:
            _grow_image(img, size)
        _reserve(img, max(size, img.stat().st_size))
        mnt = runtime / "ws" / name
        mnt.mkdir(parents=True, exist_ok=True)
        os.chmod(mnt.parent, 0o711)
        notes: tuple[str, ...] = ()
        if not is_mounted(mnt):
            notes = _check(img)
            free_loop_device()
            try:
                r = subprocess.run(
                    # noinit_itable: the kernel's lazy inode-table init zeroes with WRITE_ZEROES,
                    # which the loop device turns into holes punched in the image - undoing the
                    # reservation (the image was fallocated: its unwritten blocks read as zeros)
                    ["mount", "-o", "loop,nodev,nosuid,noinit_itable", "-t", "ext4", str(img), str(mnt)],
                    capture_output=True, text=True,
                    timeout=30,
                )
            except subprocess.TimeoutExpired:
                raise LaunchError("workspace", f"mounting {img} did not finish in 30 s") from None
            if r.returncode != 0:
                raise LaunchError("workspace", f"cannot mount {img}: {r.stderr.strip()}")
        os.chown(mnt, uid, gid)
        os.chmod(mnt, 0o700)
        lost = mnt / "lost+found"
        if lost.is_dir():
            try:
                lost.rmdir()
            except OSError:
                pass
        _touch(img)
        return WorkspaceLease(name, mnt, True, lock_fd, notes, image=img)
    except BaseException:
        os.close(lock_fd)
        raise


def _acquire_pool(home_ws: Path, runtime: Path, name: str, uid: int, gid: int, size: int,
                  lock_fd: int) -> WorkspaceLease:
    """The agent's subvolume in the pool, admitted (or refused with the numbers) and limited."""
    from agentvm import wspool

    pool = wspool.Pool(home_ws, runtime)
    hold = pool.hold()
    try:
        admit = pool.admitting()
        try:
            if pool.exists():
                pool.ensure(create=False)
            held = _held_locks()
            running = {n for n in pool.names() if n != name and _in_use_by_lock(home_ws, n, held)}
            pool.admit(name, size, running)  # (makes the pool when there is none and it fits)
            path = pool.create(name, uid, gid)
            pool.set_limit(name, size)
        finally:
            os.close(admit)
        _touch(path)
        k = _keeper(home_ws)
        if k is not None and k.fd < 0:
            k.take()  # (a pool this start made, or re-made: the daemon holds it from now on)
        return WorkspaceLease(name, path, False, lock_fd, image=path, kind="pool", pool_fd=hold, limit=size,
                              pool=pool)
    except BaseException:
        os.close(hold)
        if not pool.exists():  # refused before any pool was made: leave no lock file either
            pool.lock.unlink(missing_ok=True)
        raise


def _reserve(img: Path, size: int) -> None:
    """Allocate the whole image on the host's disk now: a sparse image overcommits, and when
    the host's filesystem fills up the agent's "saved" (even fsync'd) writes are lost as the
    image goes read-only with errors. Already-allocated extents cost nothing."""
    fd = os.open(img, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        st = os.statvfs(img.parent)
        from agentvm.units import format_size

        raise LaunchError(
            "workspace",
            f"the workspace image {img} needs {format_size(size)} on the host, and the filesystem holding it has "
            f"{st.f_bavail * st.f_frsize // (1024 * 1024)}M free: refusing rather than overcommit (writes the agent "
            "was told are saved would be lost when the disk fills)",
            hint="free space on that filesystem, lower limits.disk, or move AGENTVM_HOME to a larger one",
        ) from None
    finally:
        os.close(fd)


def _check(img: Path) -> tuple[str, ...]:
    """Check the image before mounting it (``e2fsck -p``: quick when it is clean). A repaired
    filesystem is said; one e2fsck cannot repair unattended is refused, not mounted with errors."""
    fsck = next((p for p in ("/usr/sbin/e2fsck", "/sbin/e2fsck") if os.path.exists(p)), "e2fsck")
    try:
        r = subprocess.run([fsck, "-p", str(img)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise LaunchError("workspace", f"checking {img} did not finish in 300 s") from None
    if r.returncode == 0:
        return ()
    if r.returncode in (1, 2):
        return (f"the workspace filesystem {img} was not cleanly unmounted and had errors; e2fsck repaired it "
                f"({(r.stdout or r.stderr).strip().splitlines()[-1][:200] if (r.stdout or r.stderr).strip() else 'repaired'})",)
    raise LaunchError("workspace", f"the workspace filesystem {img} has errors e2fsck cannot repair unattended "
                      f"(exit {r.returncode}): not mounting it", hint=f"repair it by hand: e2fsck -f {img}")


def _create_image(img: Path, size: int) -> None:
    tmp = img.with_suffix(".img.tmp")
    with open(tmp, "wb") as fh:
        fh.truncate(size)
    os.chmod(tmp, 0o600)
    try:
        _reserve(tmp, size)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    r = subprocess.run(
        [_mkfs() or "mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(tmp)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LaunchError("workspace", f"mkfs.ext4 failed: {r.stderr.strip()}")
    os.replace(tmp, img)


def _grow_image(img: Path, size: int) -> None:
    with open(img, "r+b") as fh:
        fh.truncate(size)
    r = subprocess.run(["resize2fs", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        raise BackendError(f"could not grow workspace image {img}: {r.stderr.strip()}")


# ------------------------------------------------------------------------ lifecycle and usage


@dataclass
class WorkspaceInfo:
    """One workspace under ``<home>/workspaces``, as ``agentvm workspace ls`` shows it."""

    name: str
    kind: str  # "pool" (a subvolume of the pool), "image" (ext4, loop-mounted) or "dir" (--degrade disk-quota)
    size: int  # its limit (the pool's quota, the image's length; 0 for a plain directory)
    used: int  # bytes it holds (its quota group's; the image's blocks on the host)
    last_use: float  # mtime: set when a sandbox takes and releases it
    in_use: bool  # its lock is held (a sandbox runs) or its image is mounted
    owner: str | None = None  # the agent registered with the daemon under this name, None: none is

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "size": self.size, "used": self.used,
                "last_use": self.last_use, "in_use": self.in_use, "owner": self.owner}


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"{name!r} is not an agent name (lowercase letters, digits and '-', at most 63)",
                          code="workspace.bad-name")


def _entries(home_ws: Path) -> dict[str, tuple[str, os.stat_result, Path]]:
    """name -> (kind, lstat, path) of the workspaces (``NAME.img`` and ``NAME/``) in ``home_ws``;
    lock files alone (an agent without a workspace) and half-made images are not workspaces."""
    out: dict[str, tuple[str, os.stat_result, Path]] = {}
    try:
        it = os.scandir(home_ws)
    except FileNotFoundError:
        return out
    with it:
        for e in it:
            n = e.name
            try:
                if n.endswith(".img") and _NAME_RE.match(n[:-4]) and e.is_file(follow_symlinks=False):
                    out[n[:-4]] = ("image", e.stat(follow_symlinks=False), Path(e.path))
                elif _NAME_RE.match(n) and e.is_dir(follow_symlinks=False) and n not in out:
                    out.setdefault(n, ("dir", e.stat(follow_symlinks=False), Path(e.path)))
            except OSError:  # removed while we looked
                continue
    return out


def _dir_blocks(path: Path) -> int:
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


def _attached() -> set[str]:
    """The files backing a loop device now (a mounted image is one of them)."""
    out: set[str] = set()
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return out
    for n in names:
        if n.startswith("loop"):
            b = _read(f"/sys/block/{n}/loop/backing_file")
            if b:
                out.add(b.removesuffix(" (deleted)"))
    return out


def _lock_free(home_ws: Path, name: str) -> bool:
    """True when no sandbox holds ``name``'s lock (checked and dropped at once: only where
    the lock is about to be taken anyway - a look alone reads /proc/locks, see _held_locks)."""
    try:
        fd = os.open(home_ws / f"{name}.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _held_locks() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file an flock is held on, from /proc/locks: whether a
    workspace is in use, seen without taking its lock (a listing that took it, even for a
    moment, could make a sandbox starting then fail with "already running"). None: unreadable."""
    out: set[tuple[int, int, int]] = set()
    try:
        with open("/proc/locks") as fh:
            for line in fh:
                f = line.split()
                if len(f) >= 6 and f[1] == "FLOCK" and not f[0].endswith("->"):  # "->": a waiter
                    try:
                        maj, mnr, ino = f[5].split(":")
                        out.add((int(maj, 16), int(mnr, 16), int(ino)))
                    except ValueError:
                        continue
    except OSError:
        return None
    return out


def _in_use_by_lock(home_ws: Path, name: str, held: set[tuple[int, int, int]] | None) -> bool:
    if held is None:
        return not _lock_free(home_ws, name)
    try:
        st = os.stat(home_ws / f"{name}.lock")
    except FileNotFoundError:
        return False
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held


def registered_agents(home: Path) -> set[str] | None:
    """The names of the agents registered with the daemon (its state, ``<home>/daemon.db``,
    read-only); an empty set when there is none; None when it cannot be read."""
    state_db = home / "daemon.db"
    import sqlite3

    if not state_db.exists():
        return set()
    try:
        con = sqlite3.connect(f"file:{state_db}?mode=ro", uri=True, timeout=2)
        try:
            if con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='sandboxes'").fetchone() is None:
                return set()  # agent-vm's state without a daemon's table: nothing was ever registered
            return {r[0] for r in con.execute("SELECT name FROM sandboxes")}
        finally:
            con.close()
    except sqlite3.Error:
        return None


def list_workspaces(home_ws: Path, *, runtime: Path | None = None, owners: set[str] | None = None) -> list[WorkspaceInfo]:
    """Every workspace, by name. ``owners``: the registered agents' names (``registered_agents``)."""
    attached = _attached()
    mounted = _mount_points() if runtime is not None else set()
    held = _held_locks()
    out = []
    for name, (kind, st, path) in sorted(_entries(home_ws).items()):
        used = st.st_blocks * 512 + (_dir_blocks(path) if kind == "dir" else 0)
        in_use = (_in_use_by_lock(home_ws, name, held) or str(path) in attached
                  or (runtime is not None and str(runtime / "ws" / name) in mounted))
        out.append(WorkspaceInfo(name, kind, st.st_size if kind == "image" else 0, used, st.st_mtime, in_use,
                                 name if owners is not None and name in owners else None))
    seen = {w.name for w in out}
    with pool_open(home_ws, runtime) as pool:
        if pool is not None:
            for e in pool.entries():
                if e.name in seen:  # an image of the same name is the one its agent uses
                    continue
                out.append(WorkspaceInfo(e.name, "pool", e.limit, e.used, e.last_use,
                                         _in_use_by_lock(home_ws, e.name, held),
                                         e.name if owners is not None and e.name in owners else None))
            out.sort(key=lambda w: w.name)
    return out


def _pool(home_ws: Path, runtime: Path | None = None):
    from agentvm import wspool

    return wspool.Pool(home_ws, runtime if runtime is not None else wspool.runtime_for(home_ws))


@contextlib.contextmanager
def pool_open(home_ws: Path, runtime: Path | None = None):
    """The pool, mounted and held (the runtime's sweep does not unmount it meanwhile), or None:
    there is none, or this is not root (it cannot be mounted)."""
    pool = _pool(home_ws, runtime)
    if not pool.exists() or os.geteuid() != 0:
        yield None
        return
    hold = pool.hold()
    try:
        if not pool.mounted():
            admit = pool.admitting()
            try:
                pool.ensure(create=False)
            finally:
                os.close(admit)
        yield pool
    finally:
        os.close(hold)
        pool.unmount_if_idle()


class _Keeper:
    """A long-lived process's (the daemon's) own hold on the pool: mounted for as long as it runs,
    so no start or removal through it pays for a btrfs mount and unmount. Taken when the pool
    exists (at entry, or once an admitted start makes it), dropped when the last workspace is
    removed (an empty pool is then removed: a host without workspaces reserves nothing)."""

    def __init__(self, home_ws: Path, runtime: Path) -> None:
        self.pool = _pool(home_ws, runtime)
        self.fd = -1
        self.lock = threading.Lock()

    def take(self) -> None:
        with self.lock:
            if self.fd >= 0 or os.geteuid() != 0 or not self.pool.exists():
                return
            fd = self.pool.hold()
            try:
                if not self.pool.mounted():
                    admit = self.pool.admitting()
                    try:
                        self.pool.ensure(create=False)
                    finally:
                        os.close(admit)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd

    def drop(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


_keepers: dict[str, _Keeper] = {}


def _keeper(home_ws: Path) -> _Keeper | None:
    return _keepers.get(str(Path(home_ws)))


@contextlib.contextmanager
def keep_pool(home_ws: Path, runtime: Path):
    """Hold the workspace pool mounted while the ``with`` body runs (the daemon: its lifetime),
    including a pool the body's first admitted start makes. At exit the hold goes, and the pool
    is removed when empty, else unmounted when nobody else uses it (an idle host holds no mount
    and no loop device). Failing to mount it now is not fatal: each start then mounts it itself."""
    k = _Keeper(home_ws, runtime)
    _keepers[str(Path(home_ws))] = k
    try:
        try:
            k.take()
        except (LaunchError, OSError):
            pass
        yield k
    finally:
        if _keepers.get(str(Path(home_ws))) is k:
            del _keepers[str(Path(home_ws))]
        k.drop()
        if k.pool.exists() and os.geteuid() == 0:
            try:
                if not k.pool.remove_if_empty():
                    k.pool.unmount_if_idle()
            except (LaunchError, OSError):
                pass


def _in_pool(home_ws: Path, name: str, runtime: Path | None) -> bool:
    with pool_open(home_ws, runtime) as pool:
        return pool is not None and pool.path(name).is_dir()


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mountinfo") as fh:
            return {line.split()[4] for line in fh}
    except OSError:
        return set()


def remove_workspace(home_ws: Path, name: str, *, runtime: Path | None = None,
                     record: Callable[[str, dict], None] | None = None) -> int:
    """Remove ``name``'s workspace (image or directory) and its lock; returns the bytes it held
    on the host's disk. Refused while it is in use - a sandbox holds its lock, or its image is
    mounted or attached to a loop device: a removed image would stay allocated (and written)
    behind the mount. The lock is held during the removal, so no sandbox can take it meanwhile.
    ``record(kind, data)`` puts ``workspace.removed`` on the audit chain."""
    _check_name(name)
    img, d = home_ws / f"{name}.img", home_ws / name
    with pool_open(home_ws, runtime) as pool:  # (held throughout: not unmounted under us)
        in_pool = pool is not None and pool.path(name).is_dir()
        if not img.exists() and not d.is_dir() and not in_pool:
            raise ConfigError(f"there is no workspace named {name!r}", hint="`agentvm workspace ls` lists them",
                              code="workspace.not-found")
        freed, data, late, emptied = _remove_locked(home_ws, name, runtime, record, img, d, pool if in_pool else None)
    _cache_clear()
    if emptied:
        k = _keeper(home_ws)
        if k is not None:
            k.drop()  # (the daemon's hold: an empty pool is not kept mounted; the next start takes it again)
        _pool(home_ws, runtime).remove_if_empty()  # a host without workspaces reserves nothing
    if late:
        record("workspace.removed", dict(data, recorded="after the removal: the disk was full"))
    return freed


def _remove_locked(home_ws, name, runtime, record, img, d, pool):
    lock = home_ws / f"{name}.lock"
    fd = lock_agent(home_ws, name, "", f"stop it first (`agentvm stop {name}`, or let its `agentvm run` end), then retry",
                    message=f"the workspace {name!r} is in use: a sandbox of agent {name!r} is running",
                    code="workspace.in-use")
    emptied = False
    try:
        where = runtime / "ws" / name if runtime is not None else None
        if str(img) in _attached() or (where is not None and is_mounted(where)):
            raise PolicyDenied(f"the workspace {name!r} is still mounted (its sandbox's supervisor died without "
                               "cleaning up): not removing a mounted filesystem",
                               hint="the next `agentvm run` or daemon start unmounts it (stale-state GC); then retry",
                               code="workspace.in-use")
        freed = size = 0
        if img.exists():
            st = img.stat()
            freed, size = st.st_blocks * 512, st.st_size
        if d.is_dir():
            freed += _dir_blocks(d) + d.stat().st_blocks * 512
        e = None
        if pool is not None:
            pool.sync()
            e = pool.entry(name)
        if e is not None:
            freed += e.used
            size = size or e.limit
        data = {"name": name, "bytes": freed, "size": size}
        if e is not None:
            data["backend"] = "pool"
        late = False
        if record is not None:  # first: a removal that cannot be recorded does not happen...
            try:
                record("workspace.removed", data)
            except Exception as exc:  # noqa: BLE001
                if not _disk_full(exc):
                    raise
                late = True  # ...except for want of space, which is what removing it gives back
        if pool is not None:
            pool.destroy(name)  # the subvolume, any inside it, its quota group
            emptied = not pool.names()
        img.unlink(missing_ok=True)
        if d.is_dir():
            import shutil

            shutil.rmtree(d)
        img.with_suffix(".img.tmp").unlink(missing_ok=True)
        lock.unlink(missing_ok=True)  # while held: a sandbox starting now takes a new lock (lock_agent)
    finally:
        os.close(fd)
    return freed, data, late, emptied


def _disk_full(exc: BaseException | None) -> bool:
    """The failure (or one it happened while handling: a rollback after a full disk) is a
    full disk."""
    import sqlite3

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc).lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _drop_lock_file(lock: Path) -> None:
    """Unlink a lock file nobody holds, holding it meanwhile (a sandbox starting then takes a new one)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, lock):
            lock.unlink(missing_ok=True)
    except OSError:
        pass  # held: its sandbox runs
    finally:
        os.close(fd)


def spec_keeps(spec_text: str, file: str = "<state>") -> bool:
    """``workspace.keep`` of an agent file's text (False when it no longer loads)."""
    try:
        from agentvm.spec.loader import load_agent_text

        return bool(load_agent_text(spec_text, file).spec.spec.workspace.keep)
    except Exception:  # noqa: BLE001 - a stored spec that no longer loads keeps nothing by itself
        return False


def on_agent_removed(home_ws: Path, name: str, *, keep: bool = False, spec_text: str | None = None,
                     runtime: Path | None = None, record: Callable[[str, dict], None] | None = None) -> dict:
    """What ``agentvm rm NAME`` does to the agent's workspace, once its sandbox is stopped:
    removed, unless ``keep`` (``--keep-workspace``) or the agent file's ``workspace.keep``.
    Returns ``{"removed": bool, "kept": bool, "bytes": freed}`` (the daemon's answer)."""
    _check_name(name)
    if keep or (spec_text is not None and spec_keeps(spec_text)):
        if (home_ws / f"{name}.img").exists() or (home_ws / name).is_dir() or _in_pool(home_ws, name, runtime):
            return {"removed": False, "kept": True, "bytes": 0}
    else:
        try:  # (one look into the pool, not two)
            return {"removed": True, "kept": False,
                    "bytes": remove_workspace(home_ws, name, runtime=runtime, record=record)}
        except ConfigError as exc:
            if exc.code != "workspace.not-found":
                raise
    _drop_lock_file(home_ws / f"{name}.lock")  # an agent without a workspace leaves its lock only
    return {"removed": False, "kept": False, "bytes": 0}


def prune(home_ws: Path, unused_for: float, *, now: float | None = None, runtime: Path | None = None,
          owners: set[str] | None = None, dry_run: bool = False,
          record: Callable[[str, dict], None] | None = None) -> list[tuple[str, int]]:
    """Remove the workspaces last used more than ``unused_for`` seconds ago that no sandbox
    uses and no registered agent owns (``owners``; None: the owners are unknown - nothing is
    pruned). Returns (name, bytes) of each removed (with ``dry_run``: that would be)."""
    if owners is None:
        raise PolicyDenied("the daemon's state cannot be read, so which workspaces belong to an agent is unknown: "
                           "not pruning", code="workspace.owners-unknown")
    cutoff = (time.time() if now is None else now) - unused_for
    out = []
    for w in list_workspaces(home_ws, runtime=runtime, owners=owners):
        if w.in_use or w.owner is not None or w.last_use > cutoff:
            continue
        if dry_run:
            out.append((w.name, w.used))
            continue
        try:
            out.append((w.name, remove_workspace(home_ws, w.name, runtime=runtime, record=record)))
        except PolicyDenied:  # taken since we looked
            continue
    return out


@dataclass
class Usage:
    """The workspaces' disk, summed: what ``doctor``, ``up`` and ``/metrics`` show."""

    count: int
    committed: int  # the sum of their limits (images: their sizes, each fully reserved; pool: quotas)
    used: int  # what they hold (images: blocks on the host; pool: their quota groups' bytes)
    fs_free: int  # free space (for unprivileged users) on the filesystem holding them
    fs_size: int
    fs_use: float  # that filesystem's use, 0-1 (as df computes it)
    path: str = ""
    warnings: list[str] = field(default_factory=list)
    backend: str = ""  # what new workspaces get ("pool", "image", "none") and why
    backend_why: str = ""
    pool: dict | None = None  # {"size", "free", "reserved" (on the host), "mounted", "count", "committed", "used"}; None: no pool

    def to_dict(self) -> dict:
        return {"count": self.count, "committed": self.committed, "used": self.used, "fs_free": self.fs_free,
                "fs_size": self.fs_size, "fs_use": round(self.fs_use, 4), "path": self.path,
                "warnings": list(self.warnings), "backend": self.backend, "backend_why": self.backend_why,
                "pool": self.pool}


def usage(home_ws: Path) -> Usage:
    """One ``scandir``, a ``statvfs`` and the pool's quota groups from sysfs: no lock, no walk
    (a plain-directory workspace counts its directory only), nothing mounted."""
    committed = used = count = 0
    for _name, (kind, st, _path) in _entries(home_ws).items():
        count += 1
        used += st.st_blocks * 512
        if kind == "image":
            committed += st.st_size
    probe = home_ws if home_ws.exists() else next((p for p in home_ws.parents if p.exists()), Path("/"))
    try:
        vfs = os.statvfs(probe)
        size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        taken = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        use = taken / (taken + free) if taken + free else 0.0
    except OSError:
        size = free = 0
        use = 0.0
    u = Usage(count, committed, used, free, size, use, str(home_ws))
    try:
        u.backend, u.backend_why = backend()
    except ConfigError as exc:
        u.backend, u.backend_why = "none", exc.message
    from agentvm import wspool

    located = wspool.Pool.located(home_ws)
    if located is not None:
        st = located.img.stat()
        info = {"size": st.st_size, "reserved": st.st_blocks * 512, "mounted": located.mounted(), "free": None,
                "count": None, "committed": None, "used": None}
        with contextlib.ExitStack() as stack:
            # (mounted for the look when no agent uses it, and unmounted again; not as another user)
            pool = located if info["mounted"] else stack.enter_context(pool_open(home_ws, located.runtime))
            if pool is not None and pool.mounted():
                n, lim, held = pool.totals()
                psize, pfree = pool.space()
                info.update(size=psize, free=pfree, count=n, committed=lim, used=held)
            else:
                pool = None
        if pool is not None:
            u.count, u.committed, u.used = u.count + n, u.committed + lim, u.used + held
            if psize and (psize - pfree) / psize > WARN_USE:
                u.warnings.append(
                    f"the workspace pool is {(psize - pfree) / psize:.0%} full ({human(pfree)} free of {human(psize)}; "
                    f"{n} workspaces, {human(lim)} committed, {human(held)} used): it grows when an agent is admitted "
                    "and the host has room; `agentvm workspace prune --unused-for 7d` removes unused workspaces")
        u.pool = info
    if use > WARN_USE:
        u.warnings.append(
            f"the filesystem holding {home_ws} is {use:.0%} full ({human(free)} free; workspaces: "
            f"{u.count}, {human(u.committed)} committed, {human(u.used)} used): new workspaces will be refused "
            "when it is full - `agentvm workspace ls` lists them, `agentvm workspace prune --unused-for 7d` "
            "removes the unused ones")
    return u


def human(n: int) -> str:
    """1536 -> '1.5K', 16777216 -> '16.0M' (binary multiples, as limits take them)."""
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return f"{n}B"


_cache_lock = threading.Lock()
_cache: dict[str, tuple[float, Usage]] = {}


def cached_usage(home_ws: Path, max_age: float = 5.0) -> Usage:
    """``usage``, computed at most once per ``max_age`` seconds per directory (a scrape every
    few seconds of 5,000 workspaces costs one scandir per ``max_age``)."""
    key = str(home_ws)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < max_age:
            return hit[1]
        u = usage(home_ws)
        _cache[key] = (now, u)
        return u


def _cache_clear() -> None:
    with _cache_lock:
        _cache.clear()
