"""The workspace pool: one filesystem for every named agent's workspace, a quota per agent.

One btrfs filesystem in one image, ``<home>/workspaces/.pool.img``, loop-mounted once at
``<runtime>/ws/.pool`` (one loop device in all). Each agent's workspace is a subvolume
``<runtime>/ws/.pool/NAME`` with a qgroup limit of its ``limits.disk``: writing past it gives
the agent ``EDQUOT`` inside, and no other agent notices. A workspace costs what it holds (thin),
while every byte an admitted running agent may still write is reserved on the host:

- the image is ``fallocate``d in full (never sparse: a full host could otherwise eat writes the
  agent was told are saved), and grown (``fallocate`` first, then the loop device's capacity,
  then an online resize) when an agent is admitted and the pool's free space is short;
- the admission rule (:meth:`Pool.admit`): the sum over running agents (this one included) of
  what each may still write (limit - used) must fit in the pool's free space times the
  operator's overcommit factor (``AGENTVM_WORKSPACE_OVERCOMMIT``, default 1: no overcommit, so
  a running agent never meets a full pool); past it, ``start``/``run`` is refused with the
  numbers (``workspace.overcommit``). The pool grows up to ``AGENTVM_WORKSPACE_POOL`` (default:
  whatever the host can give while keeping :func:`host_reserve` free for the daemon's state
  and audit).

Why btrfs and not ext4/XFS project quotas: the kernel this was built on has neither
(``CONFIG_QFMT_V2`` and ``CONFIG_XFS_QUOTA`` are off: an ext4 with the ``quota`` feature does
not even mount), while btrfs quota groups are part of btrfs. See docs/workspaces.md.

Locks: ``<home>/workspaces/.pool.lock`` is held shared by every user of the mounted pool (a
running sandbox, a listing) - the runtime's stale-mount sweep takes it exclusively before it
unmounts an idle pool; ``<runtime>/wspool.admit`` (exclusive) orders mounting, admission,
growth and removal. An empty pool is removed (a host without workspaces reserves nothing).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import ConfigError, LaunchError, PolicyDenied

POOL = ".pool"  # not an agent name (names start with a letter or digit)
INITIAL = 64 << 20  # a new pool's size (less on a host with less room, down to MIN_POOL); grown on demand
MIN_POOL = 48 << 20  # with single metadata, btrfs makes a usable filesystem from 48M
STEP = 64 << 20  # growth is rounded up to this
MIN_RESIZE = 256 << 20  # btrfs refuses to resize a filesystem to less (EINVAL): a grown pool is at least this
SLACK = 16 << 20  # metadata: kept free beyond what the admitted agents may write
HOST_RESERVE_MIN = 64 << 20  # the pool never takes the host's last 64M (a quarter of a smaller disk) or 2%:
HOST_RESERVE_FRAC = 0.02  # the daemon's state and audit
LOCK_WAIT = 30.0
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # an agent's name (spec.models.NAME_RE)

_MKFS = ("/usr/sbin/mkfs.btrfs", "/sbin/mkfs.btrfs", "/usr/bin/mkfs.btrfs", "/bin/mkfs.btrfs")

# btrfs ioctls (include/uapi/linux/btrfs.h)
_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
_SNAP_DESTROY = 0x5000940F  # _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
_RESIZE = 0x50009403  # _IOW(0x94, 3, struct btrfs_ioctl_vol_args)
_INO_LOOKUP = 0xD0009412  # _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
_FS_INFO = 0x8400941F  # _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
_QUOTA_CTL = 0xC0109428  # _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
_QGROUP_CREATE = 0x4010942A  # _IOW(0x94, 42, struct btrfs_ioctl_qgroup_create_args)
_QGROUP_ASSIGN = 0x40189429  # _IOW(0x94, 41, struct btrfs_ioctl_qgroup_assign_args)
_LEVEL1 = 1 << 48  # qgroup id 1/N: the agent's group, holding its subvolume and any it creates inside
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_LIMIT_MAX_RFER = 1
_LOOP_SET_CAPACITY = 0x4C07
_SYNC = 0x9408  # _IO(0x94, 8): commit the transaction (quota groups count at commit)
_TREE_SEARCH = 0xD0009411  # _IOWR(0x94, 17, struct btrfs_ioctl_search_args)
_ROOT_TREE, _ROOT_REF_KEY = 1, 156  # the root tree; (parent id, ROOT_REF, child id): a subvolume inside another
_INODE_ITEM_KEY = 1
_FILEID_BTRFS_WITHOUT_PARENT = 0x4D  # a btrfs file handle: objectid, root objectid, generation


def _vol_args(name: str = "") -> bytearray:
    b = bytearray(4096)
    raw = name.encode()
    b[8:8 + len(raw)] = raw
    return b


def mkfs() -> str | None:
    return next((p for p in _MKFS if os.path.exists(p)), None)


def _filesystems() -> str:
    try:
        with open("/proc/filesystems") as fh:
            return fh.read()
    except OSError:
        return ""


def supported() -> tuple[bool, str]:
    """Whether this host can run the pool (root, btrfs in the kernel, mkfs.btrfs, loop devices)."""
    if os.geteuid() != 0:
        return False, "mounting the workspace pool needs root"
    if "\tbtrfs" not in _filesystems():
        return False, "the kernel has no btrfs (modprobe btrfs, or AGENTVM_WORKSPACE_BACKEND=image)"
    if mkfs() is None:
        return False, "mkfs.btrfs missing (apt-get install -y btrfs-progs)"
    if not os.path.exists("/dev/loop-control"):
        return False, "no /dev/loop-control (loop devices unavailable)"
    if _kernel() < (6, 7):
        # simple quotas put a subvolume the agent creates inside its workspace in the agent's
        # group; with full quota groups it would be a group of its own, outside the limit
        return False, f"btrfs simple quotas need kernel 6.7 or later (this is {os.uname().release})"
    return True, "btrfs pool with a quota group per agent (one loop device in all)"


def _kernel() -> tuple[int, int]:
    try:
        a, b = os.uname().release.split(".")[:2]
        return int(a), int("".join(c for c in b if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def project_quota_route() -> str:
    """Why the filesystem holding the workspaces is not used directly with project quotas
    (ext4/XFS ``prjquota``): what ``doctor`` says about the route not taken."""
    cfg = ""
    try:
        import gzip

        with gzip.open("/proc/config.gz", "rt") as fh:
            cfg = fh.read()
    except OSError:
        pass
    missing = [o for o in ("CONFIG_QFMT_V2", "CONFIG_XFS_QUOTA") if cfg and f"{o}=y" not in cfg]
    if missing:
        return f"ext4/XFS project quotas: the kernel lacks {' and '.join(missing)}"
    return "ext4/XFS project quotas on the home filesystem: not implemented yet (the pool is used)"


def overcommit() -> float:
    raw = os.environ.get("AGENTVM_WORKSPACE_OVERCOMMIT", "1")
    try:
        f = float(raw)
    except ValueError:
        f = -1.0
    if not f >= 1.0:
        raise ConfigError(f"AGENTVM_WORKSPACE_OVERCOMMIT={raw!r}: a factor of at least 1 (1: no overcommit)",
                          hint="e.g. AGENTVM_WORKSPACE_OVERCOMMIT=2 lets running agents' limits be twice the pool's free space")
    return f


def max_size() -> int | None:
    """``AGENTVM_WORKSPACE_POOL``: the most the pool may reserve on the host (None: as much as the
    host can give above its reserve)."""
    raw = os.environ.get("AGENTVM_WORKSPACE_POOL", "").strip()
    if not raw or raw == "auto":
        return None
    from agentvm.units import parse_size

    try:
        n = parse_size(raw)
    except Exception:  # noqa: BLE001
        n = 0
    if n < MIN_RESIZE:
        raise ConfigError(f"AGENTVM_WORKSPACE_POOL={raw!r}: a size of at least {MIN_RESIZE >> 20}M (e.g. 64G)")
    return n


def human(n: int) -> str:
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= mult:
            return f"{n / mult:.1f}{unit}"
    return f"{n}B"


def _mountinfo() -> dict[str, str]:
    """mount point -> source device."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                f = right.split()
                out[left.split()[4]] = f[1] if len(f) > 1 else ""
    except OSError:
        pass
    return out


def same_file(fd: int, path: Path) -> bool:
    """``fd`` is the file at ``path`` now (not one removed, or replaced, since it was opened)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _flock(path: Path, mode: int, *, wait: float = LOCK_WAIT, what: str = "") -> int:
    """Open ``path`` (created) and flock it; retried until ``wait`` (0: once). The file is
    re-checked after the lock is taken (a remover unlinks it while holding it)."""
    deadline = time.monotonic() + wait
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() >= deadline:
                raise LaunchError("workspace", f"the workspace pool is busy ({what or path}) for {wait:.0f} s") from None
            time.sleep(0.02)
            continue
        if same_file(fd, path):
            return fd
        os.close(fd)


@dataclass
class Entry:
    """One workspace in the pool: its quota and use."""
    name: str
    limit: int  # the quota group's max referenced (0: none)
    used: int  # referenced bytes
    last_use: float
    subvol: int


class Pool:
    def __init__(self, home_ws: Path, runtime: Path) -> None:
        self.home_ws = Path(home_ws)
        self.runtime = Path(runtime)
        self.img = self.home_ws / f"{POOL}.img"
        self.lock = self.home_ws / f"{POOL}.lock"
        self.mnt = self.runtime / "ws" / POOL
        self.admit_lock = self.runtime / "wspool.admit"

    # ------------------------------------------------------------------ state
    def exists(self) -> bool:
        return self.img.exists()

    def mounted(self) -> bool:
        return str(self.mnt) in _mountinfo()

    def loop_device(self) -> str | None:
        src = _mountinfo().get(str(self.mnt))
        return src if src and src.startswith("/dev/loop") else None

    def path(self, name: str) -> Path:
        return self.mnt / name

    # ------------------------------------------------------------------ locks
    def hold(self) -> int:
        """Shared hold on the mounted pool (the runtime's sweep does not unmount it meanwhile)."""
        self.home_ws.mkdir(parents=True, exist_ok=True)
        return _flock(self.lock, fcntl.LOCK_SH, what="being unmounted or removed")

    def admitting(self) -> int:
        self.runtime.mkdir(parents=True, exist_ok=True)
        return _flock(self.admit_lock, fcntl.LOCK_EX, what="another agent is being admitted")

    # ------------------------------------------------------------------ mount / create
    def ensure(self, *, create: bool) -> bool:
        """Mount the pool (creating it when ``create``); call with :meth:`hold` and
        :meth:`admitting` held. False: there is no pool (and ``create`` was not asked)."""
        if self.mounted():
            return True
        if not self.img.exists():
            if not create:
                return False
            self._create()
        self.mnt.mkdir(parents=True, exist_ok=True)
        os.chmod(self.mnt.parent, 0o711)
        try:
            r = subprocess.run(["mount", "-t", "btrfs", "-o", "loop,nodev,nosuid,noatime,nodiscard",
                                str(self.img), str(self.mnt)], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise LaunchError("workspace", f"mounting the workspace pool {self.img} did not finish in 60 s") from None
        if r.returncode != 0:
            raise LaunchError("workspace", f"cannot mount the workspace pool {self.img}: {r.stderr.strip()}",
                              hint="check it with `btrfs check --readonly` " + str(self.img))
        os.chmod(self.mnt, 0o711)
        return True

    def _create(self, size: int = INITIAL) -> None:
        tmp = self.img.with_name(f"{POOL}.img.tmp")
        self.home_ws.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _reserve_fd(fd, size, self.home_ws)
        finally:
            os.close(fd)
        # -K: no discard (it would punch holes in the reservation); quotas are enabled once mounted
        # -m single: metadata twice in one image file guards nothing the host's disk does not
        r = subprocess.run([mkfs() or "mkfs.btrfs", "-q", "-f", "-K", "-m", "single", "-L", "agentvm-ws", str(tmp)],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise LaunchError("workspace", f"mkfs.btrfs failed: {r.stderr.strip()}")
        mnt = self.mnt
        mnt.mkdir(parents=True, exist_ok=True)
        os.chmod(mnt.parent, 0o711)
        r = subprocess.run(["mount", "-t", "btrfs", "-o", "loop,nodev,nosuid,noatime,nodiscard", str(tmp), str(mnt)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise LaunchError("workspace", f"cannot mount the new workspace pool: {r.stderr.strip()}")
        try:
            fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # simple quotas (kernel >= 6.7): a subvolume made inside a workspace joins the
                # workspace's level-1 group, so it counts against the agent's limit
                fcntl.ioctl(fd, _QUOTA_CTL, struct.pack("QQ", _QUOTA_ENABLE_SIMPLE, 0))
            finally:
                os.close(fd)
        except OSError as exc:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            tmp.unlink(missing_ok=True)
            raise LaunchError("workspace", f"cannot enable quotas on the workspace pool: {exc.strerror}") from None
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)
        os.replace(tmp, self.img)

    def quota_mode(self) -> str:
        try:
            return Path(f"/sys/fs/btrfs/{self._fsid()}/qgroups/mode").read_text().strip()
        except OSError:
            return "?"

    # ------------------------------------------------------------------ workspaces
    def names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.mnt) if NAME_RE.match(n))
        except OSError:
            return []

    def create(self, name: str, uid: int, gid: int) -> Path:
        p = self.path(name)
        if not p.exists():
            fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, _SUBVOL_CREATE, _vol_args(name))
            except OSError as exc:
                raise LaunchError("workspace", f"cannot create the workspace {name!r} in the pool: {exc.strerror}") from None
            finally:
                os.close(fd)
        sid = self.subvol_id(name)
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # the agent's group 1/sid: its subvolume, and any subvolume made inside (auto-inherited)
            for req, args in ((_QGROUP_CREATE, struct.pack("QQ", 1, _LEVEL1 | sid)),
                              (_QGROUP_ASSIGN, struct.pack("QQQ", 1, sid, _LEVEL1 | sid))):
                try:
                    fcntl.ioctl(fd, req, args)
                except OSError as exc:
                    if exc.errno != errno.EEXIST:  # (made by an earlier start that stopped half-way)
                        raise LaunchError("workspace", f"cannot make the quota group of workspace {name!r}: "
                                          f"{exc.strerror}") from None
        finally:
            os.close(fd)
        os.chown(p, uid, gid)
        os.chmod(p, 0o700)
        return p

    def set_limit(self, name: str, limit: int) -> None:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sid = self.subvol_id(name)
            fcntl.ioctl(fd, _QGROUP_LIMIT, struct.pack("QQQQQQ", _LEVEL1 | sid, _LIMIT_MAX_RFER, limit, 0, 0, 0))
        except OSError as exc:
            raise LaunchError("workspace", f"cannot set the disk limit of workspace {name!r}: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _nested(self, name: str) -> list[tuple[int, int, int, bytes]]:
        """The subvolumes the agent made inside its workspace, children before their parents:
        (id, parent id, folder inode in the parent, name). Found in the filesystem's root tree
        (ROOT_REF items), not by walking paths: one made past PATH_MAX or in a folder a walk
        could not open is found all the same (a path walk skipped it, and the workspace then
        could not be removed)."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            order, queue = [], [self.subvol_id(name)]
            while queue:
                parent = queue.pop()
                for child, dirid, nm in _child_subvolumes(fd, parent):
                    order.append((child, parent, dirid, nm))
                    queue.append(child)
        finally:
            os.close(fd)
        return order[::-1]

    def destroy(self, name: str) -> None:
        """The workspace's subvolume (and any the agent made inside it) and its quota group."""
        top = self.path(name)
        if not top.exists():
            return
        sid = self.subvol_id(name)
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # no limit first: deleting takes metadata, which a full group would refuse (EDQUOT)
            fcntl.ioctl(fd, _QGROUP_LIMIT, struct.pack("QQQQQQ", _LEVEL1 | sid, _LIMIT_MAX_RFER, (1 << 64) - 1, 0, 0, 0))
        except OSError:
            pass
        finally:
            os.close(fd)
        members = [sid]
        for nid, parent, dirid, nm in self._nested(name):
            members.append(nid)
            _destroy_in(self.mnt, parent, dirid, nm, nid)
        _destroy_at(top)
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # 0/N go by themselves once cleaned (a commit or two later); 1/sid is ours to remove
            for m in members:
                try:
                    fcntl.ioctl(fd, _QGROUP_ASSIGN, struct.pack("QQQ", 0, m, _LEVEL1 | sid))
                except OSError:
                    pass
            try:
                fcntl.ioctl(fd, _QGROUP_CREATE, struct.pack("QQ", 0, _LEVEL1 | sid))
            except OSError:
                pass  # removed at the next sweep (stale_groups)
        finally:
            os.close(fd)

    def subvol_id(self, name: str) -> int:
        return self._subvol_id_at(self.path(name))

    def _subvol_id_at(self, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            buf = bytearray(4096)
            struct.pack_into("QQ", buf, 0, 0, 256)
            fcntl.ioctl(fd, _INO_LOOKUP, buf)
            return struct.unpack_from("Q", buf, 0)[0]
        finally:
            os.close(fd)

    def _fsid(self) -> str:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            buf = bytearray(1024)
            fcntl.ioctl(fd, _FS_INFO, buf)
            h = bytes(buf[16:32]).hex()
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        finally:
            os.close(fd)

    def entries(self) -> list[Entry]:
        """Every workspace in the (mounted) pool: its limit and use, from sysfs (no lock)."""
        out = []
        try:
            q = Path(f"/sys/fs/btrfs/{self._fsid()}/qgroups")
        except OSError:
            return out
        for n in self.names():
            try:
                sid = self.subvol_id(n)
                st = os.stat(self.path(n))
            except OSError:
                continue
            d = q / f"1_{sid}"
            out.append(Entry(n, _int(d / "max_referenced"), _int(d / "referenced"), st.st_mtime, sid))
        return out

    def sync(self) -> None:
        """Commit: the quota groups' numbers are those of the last commit (btrfs commits every
        30 s by itself)."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _SYNC, 0)
        finally:
            os.close(fd)

    def entry(self, name: str) -> Entry | None:
        try:
            sid = self.subvol_id(name)
            st = os.stat(self.path(name))
            d = Path(f"/sys/fs/btrfs/{self._fsid()}/qgroups/1_{sid}")
        except OSError:
            return None
        return Entry(name, _int(d / "max_referenced"), _int(d / "referenced"), st.st_mtime, sid)

    def totals(self) -> tuple[int, int, int]:
        """(workspaces, the sum of their limits, the sum of their use): the quota groups in sysfs,
        without a lookup per workspace (a subvolume removed moments ago may still count)."""
        n = len(self.names())
        lim = used = 0
        try:
            q = Path(f"/sys/fs/btrfs/{self._fsid()}/qgroups")
            groups = os.listdir(q)
        except OSError:
            return n, 0, 0
        for g in groups:
            if g.startswith("1_"):
                lim += _int(q / g / "max_referenced")
                used += _int(q / g / "referenced")
        return n, lim, used

    @classmethod
    def located(cls, home_ws: Path) -> "Pool | None":
        """The pool of ``home_ws`` where it is mounted now (else at its default place); None: none."""
        img = Path(home_ws) / f"{POOL}.img"
        if not img.exists():
            return None
        return cls(Path(home_ws), runtime_for(Path(home_ws)))

    # ------------------------------------------------------------------ space
    def space(self) -> tuple[int, int]:
        """(size, free) of the pool's filesystem."""
        v = os.statvfs(self.mnt)
        return v.f_blocks * v.f_frsize, v.f_bavail * v.f_frsize

    def host_room(self) -> tuple[int, int, int]:
        """(bytes the pool may still grow by, host free, host reserve)."""
        self.home_ws.mkdir(parents=True, exist_ok=True)
        v = os.statvfs(self.home_ws)
        free = v.f_bavail * v.f_frsize
        reserve = host_reserve(v.f_blocks * v.f_frsize)
        room = max(0, free - reserve)
        cap = max_size()
        if cap is not None:
            room = min(room, max(0, cap - (self.img.stat().st_size if self.img.exists() else 0)))
        return room, free, reserve

    def grow(self, by: int) -> None:
        """Reserve ``by`` more bytes on the host, then hand them to the filesystem (online)."""
        by = -(-by // STEP) * STEP
        size = self.img.stat().st_size
        by = max(by, MIN_RESIZE - size)  # btrfs resizes to 256M or more only
        fd = os.open(self.img, os.O_RDWR | os.O_CLOEXEC)
        try:
            _reserve_fd(fd, size + by, self.home_ws)
        finally:
            os.close(fd)
        dev = self.loop_device()
        if dev is None:
            raise LaunchError("workspace", "the workspace pool is not mounted on a loop device: cannot grow it")
        lfd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(lfd, _LOOP_SET_CAPACITY, 0)
        finally:
            os.close(lfd)
        mfd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(mfd, _RESIZE, _vol_args("max"))
        except OSError as exc:
            raise LaunchError("workspace", f"cannot grow the workspace pool: {exc.strerror}") from None
        finally:
            os.close(mfd)

    def admit(self, name: str, limit: int, running: set[str]) -> dict:
        """The admission rule, under :meth:`hold` and :meth:`admitting`; mounts the pool, making
        it when there is none. ``running``: the names of the agents whose sandbox runs (besides
        this one). Grows the pool when that makes room; refuses with the numbers otherwise.
        Returns the numbers it decided on."""
        factor = overcommit()
        made = False
        if not self.exists():
            room, host_free, reserve = self.host_room()
            if room < MIN_POOL:
                self._refuse(name, limit, factor, limit, 1, 0, 0, room, host_free, reserve,
                             why=f"there is no pool yet, and making one takes {human(MIN_POOL)} at least")
            self._create(min(INITIAL, room // (1 << 20) * (1 << 20)))
            made = True
        self.ensure(create=False)
        headroom, n = 0, 0
        for r in running | {name}:
            e = self.entry(r)
            lim = limit if r == name else (e.limit if e else 0)
            if lim and lim < (1 << 62):
                headroom += max(0, lim - (e.used if e else 0))
                n += 1
        need = int(headroom / factor) + SLACK
        size, free = self.space()
        free = usable(size, free)
        grown = 0
        if free < need:
            room, host_free, reserve = self.host_room()
            want = max(-(-(need - free) // STEP) * STEP, MIN_RESIZE - size)
            if want <= room:
                self.grow(want)
                grown = want
                size, free = self.space()
                free = usable(size, free)
            if free < need:
                if made and not self.names():
                    self.teardown()  # nothing of it was used: a refused start reserves nothing
                self._refuse(name, limit, factor, headroom, n, size, free, room, host_free, reserve)
        return {"running": n, "headroom": headroom, "factor": factor, "pool_size": size, "pool_free": free,
                "grown": grown, "made": made}

    def _refuse(self, name, limit, factor, headroom, n, size, free, room, host_free, reserve, why: str = ""):
        from agentvm.units import format_size

        need = int(headroom / factor) + SLACK
        cap = max_size()
        raise PolicyDenied(
            f"workspace admission refused for {name!r} (it needs {format_size(limit)}): "
            + (f"{why}; " if why else "") + f"the {n} running agent(s) with "
            f"a workspace, this one included, may still write {human(headroom)} (limits minus use); with overcommit "
            f"factor {factor:g} that needs {human(need)} free in the workspace pool ({human(SLACK)} of it for "
            f"metadata), and the pool has {human(free)} free of {human(size)} and can grow by {human(room)} (host: "
            f"{human(host_free)} free, {human(reserve)} of it kept for the daemon's state and audit"
            + (f"; pool capped at {human(cap)} by AGENTVM_WORKSPACE_POOL" if cap else "") + ")",
            hint="stop an agent, lower limits.disk, free space on the host, raise AGENTVM_WORKSPACE_POOL, or allow "
                 "overcommit (AGENTVM_WORKSPACE_OVERCOMMIT=2: a full pool then fails the writing agent)",
            code="workspace.overcommit")

    def unmount_if_idle(self) -> bool:
        """Unmount the pool when nobody holds it (call without :meth:`hold`): an idle host holds
        no mount and no loop device. The data stays in the image; the next user mounts it."""
        if not self.mounted():
            return False
        try:
            fd = _flock(self.lock, fcntl.LOCK_EX, wait=0)
        except (LaunchError, OSError):
            return False  # in use
        try:
            return self._unmount()
        finally:
            os.close(fd)

    def _unmount(self) -> bool:
        """Unmount the pool and remove its mount point (False: umount refused)."""
        r = subprocess.run(["umount", str(self.mnt)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return False
        try:
            self.mnt.rmdir()
        except OSError:
            pass
        return True

    # ------------------------------------------------------------------ removal
    def remove_if_empty(self) -> bool:
        """Unmount and delete the pool when it holds no workspace and nobody holds it.
        Call without :meth:`hold`; takes :meth:`admitting`."""
        afd = self.admitting()
        try:
            try:
                fd = _flock(self.lock, fcntl.LOCK_EX, wait=0)
            except LaunchError:
                return False  # in use
            try:
                if self.mounted():
                    if self.names() or not self._unmount():
                        return False
                elif self.img.exists() and not self._empty_offline():
                    return False
                self.img.unlink(missing_ok=True)
                self.lock.unlink(missing_ok=True)
                return True
            finally:
                os.close(fd)
        finally:
            os.close(afd)

    def _empty_offline(self) -> bool:
        """An unmounted pool: mount it to look (it is removed only when empty)."""
        try:
            self.ensure(create=False)
        except LaunchError:
            return False
        empty = not self.names()
        subprocess.run(["umount", str(self.mnt)], capture_output=True, timeout=60)
        return empty

    def teardown(self) -> None:
        """Unmount (lazily if busy) and delete the whole pool, whatever it holds: tests and benches."""
        if self.mounted():
            r = subprocess.run(["umount", str(self.mnt)], capture_output=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        self.img.unlink(missing_ok=True)
        self.img.with_name(f"{POOL}.img.tmp").unlink(missing_ok=True)
        self.lock.unlink(missing_ok=True)


SMALL_META = 24 << 20  # what a 64M pool's statfs free overstates the writable data by (measured), 0 from 256M


def usable(size: int, free: int) -> int:
    """What admission counts as the pool's free space. Under MIN_RESIZE, btrfs allocates
    metadata chunks out of proportion to the data, and ``statfs`` overstates what can be
    written: a new 64M pool with quotas showed 52M free and took 29.7M of 1M-fsync'd writes
    (33M of one large write); from 256M on, statfs is exact. So a small pool counts
    ``SMALL_META`` less (scaled to 0 at 256M), beyond the SLACK every admission keeps, and grows
    before it admits an agent that would meet ENOSPC under its own limit (the admission's
    promise at overcommit 1)."""
    if size >= MIN_RESIZE:
        return free
    extra = SMALL_META * (MIN_RESIZE - size) // (MIN_RESIZE - INITIAL) - SLACK
    return max(0, free - max(0, extra))


def host_reserve(fs_size: int) -> int:
    """What the pool leaves free on the host's filesystem for agent-vm's own state and audit."""
    return max(min(HOST_RESERVE_MIN, fs_size // 4), int(fs_size * HOST_RESERVE_FRAC))


def _mounted_at(img: Path) -> Path | None:
    """Where the image is mounted (through the loop device that backs it), if it is."""
    devs = set()
    try:
        for n in os.listdir("/sys/block"):
            if n.startswith("loop"):
                try:
                    b = Path(f"/sys/block/{n}/loop/backing_file").read_text().strip()
                except OSError:
                    continue
                if b.removesuffix(" (deleted)") == str(img):
                    devs.add(f"/dev/{n}")
    except OSError:
        return None
    for mnt, src in _mountinfo().items():
        if src in devs and mnt.endswith(f"/ws/{POOL}"):
            return Path(mnt)
    return None


def runtime_for(home_ws: Path) -> Path:
    """The runtime directory whose ``ws/.pool`` mounts this home's pool: where it is mounted
    now, else this installation's (``default_paths``) when it is the same home, else
    ``<home>/run`` (as ``AGENTVM_HOME`` without ``AGENTVM_RUNTIME_DIR`` has it)."""
    at = _mounted_at(Path(home_ws) / f"{POOL}.img")
    if at is not None:
        return at.parent.parent
    from agentvm.paths import default_paths

    d = default_paths()
    if Path(d.workspaces) == Path(home_ws):
        return Path(d.runtime)
    return Path(home_ws).parent / "run"


def _destroy_at(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(path.name))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise LaunchError("workspace", f"cannot remove the subvolume {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _tree_items(fd: int, tree: int, objectid: int, typ: int):
    """(offset, data) of every item (objectid, typ, *) of btrfs tree ``tree``
    (BTRFS_IOC_TREE_SEARCH; root only)."""
    offset = 0
    while True:
        args = bytearray(4096)  # the search key (104 bytes), then the kernel's answer
        struct.pack_into("QQQQQQQIIII", args, 0, tree, objectid, objectid, offset, (1 << 64) - 1, 0, (1 << 64) - 1,
                         typ, typ, 512, 0)
        fcntl.ioctl(fd, _TREE_SEARCH, args)
        n = struct.unpack_from("I", args, 64)[0]  # nr_items: how many it wrote
        if not n:
            return
        pos = 104
        for _ in range(n):
            _transid, obj, off, t, length = struct.unpack_from("QQQII", args, pos)
            data = bytes(args[pos + 32: pos + 32 + length])
            pos += 32 + length
            if t == typ and obj == objectid:
                yield off, data
            offset = off + 1
        if offset == 0 or offset > (1 << 64) - 1:
            return


def _child_subvolumes(fd: int, parent: int) -> list[tuple[int, int, bytes]]:
    """The subvolumes directly inside subvolume ``parent``: (id, the inode of the folder holding
    it in the parent, its name there), from the root tree's ROOT_REF items - kept by the kernel,
    found however deep the folder is."""
    out = []
    for child, data in _tree_items(fd, _ROOT_TREE, parent, _ROOT_REF_KEY):
        dirid, _seq, name_len = struct.unpack_from("QQH", data, 0)
        out.append((child, dirid, data[18:18 + name_len]))
    return out


def _destroy_in(mnt: Path, parent: int, dirid: int, name: bytes, subvol: int) -> None:
    """Delete subvolume ``name`` in folder ``dirid`` of subvolume ``parent``: the folder opened
    by its file handle (no path: a folder past PATH_MAX opens the same), then SNAP_DESTROY in it."""
    import ctypes  # (only here: not on a start's import path)

    class _Handle(ctypes.Structure):
        _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 20)]

    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    dfd = -1
    try:
        gen = next((struct.unpack_from("Q", d, 0)[0] for _, d in _tree_items(fd, parent, dirid, _INODE_ITEM_KEY)), None)
        if gen is None:
            return  # gone meanwhile
        h = _Handle(20, _FILEID_BTRFS_WITHOUT_PARENT)
        ctypes.memmove(h.f_handle, struct.pack("QQI", dirid, parent, gen & 0xFFFFFFFF), 20)
        libc = ctypes.CDLL(None, use_errno=True)
        dfd = libc.open_by_handle_at(fd, ctypes.byref(h), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if dfd < 0:
            e = ctypes.get_errno()
            if e in (errno.ENOENT, errno.ESTALE):
                return
            raise OSError(e, os.strerror(e))
        fcntl.ioctl(dfd, _SNAP_DESTROY, _vol_args(name.decode("utf-8", "surrogateescape")))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise LaunchError("workspace", f"cannot remove the subvolume {subvol} an agent made in its workspace: "
                              f"{exc.strerror}") from None
    finally:
        if dfd >= 0:
            os.close(dfd)
        os.close(fd)


def _int(p: Path) -> int:
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return 0


def _reserve_fd(fd: int, size: int, where: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        v = os.statvfs(where)
        raise LaunchError(
            "workspace",
            f"the workspace pool needs {human(size)} reserved on the host and the filesystem holding {where} has "
            f"{human(v.f_bavail * v.f_frsize)} free: refusing rather than overcommit the host",
            hint="free space on that filesystem or move AGENTVM_HOME to a larger one") from None
