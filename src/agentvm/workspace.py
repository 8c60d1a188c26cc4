"""Durable per-agent workspaces with a real size limit.

A declared agent's workspace is an ext4 filesystem image (sparse file) at
``<home>/workspaces/<name>.img``, loop-mounted at ``<runtime>/ws/<name>`` while a sandbox of
that agent runs and unmounted at teardown. Its root directory is owned by the agent's uid and
mode 0700. Filling it gives the agent ``ENOSPC``; the host's disk is never at risk.

Without root (no loop mounts) the workspace is a plain directory and the disk limit cannot be
enforced: that needs the explicit ``--degrade disk-quota``.

Only one sandbox of an agent uses its workspace at a time (an exclusive ``flock``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import BackendError, LaunchError, PolicyDenied

_MKFS = ("/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4")


@dataclass
class WorkspaceLease:
    name: str
    host_dir: Path  # what is bind-mounted into the sandbox
    mounted: bool  # True when we loop-mounted it and must unmount at teardown
    lock_fd: int
    notes: tuple[str, ...] = ()  # what the operator should hear (a repaired filesystem)

    def release(self) -> list[str]:
        """Unmount (if mounted) and drop the lock. Returns what could not be cleaned."""
        left: list[str] = []
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


def quota_supported() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "loop-mounting a workspace filesystem needs root"
    if _mkfs() is None:
        return False, "mkfs.ext4 missing (apt-get install -y e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return False, "no /dev/loop-control (loop devices unavailable)"
    used, limit = loop_capacity()
    cap = f"{used} of {limit} loop devices in use" if limit else f"{used} loop devices in use"
    return True, f"ext4 image, loop-mounted ({cap}: one per running agent with a workspace)"


def lock_agent(home_ws: Path, name: str, why: str, hint: str) -> int:
    """Hold ``<workspaces>/<name>.lock`` (an exclusive ``flock``): one sandbox of an agent at
    a time. Returns the fd (closing it releases the lock); refuses if another holds it."""
    home_ws.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(home_ws / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(lock_fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise PolicyDenied(f"agent {name!r} is already running: {why}", hint=hint) from exc
        raise
    return lock_fd


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
            return WorkspaceLease(name, d, False, lock_fd)
        img = home_ws / f"{name}.img"
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
        return WorkspaceLease(name, mnt, True, lock_fd, notes)
    except BaseException:
        os.close(lock_fd)
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


def remove(home_ws: Path, name: str) -> None:
    for p in (home_ws / f"{name}.img", home_ws / f"{name}.lock"):
        p.unlink(missing_ok=True)
    d = home_ws / name
    if d.is_dir():
        import shutil

        shutil.rmtree(d)
