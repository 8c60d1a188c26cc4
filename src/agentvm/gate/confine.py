"""Confining a gate worker: the process that parses what sandboxes send holds no privilege.

A gate worker (:mod:`agentvm.gate.workers`) is started by the daemon as root, because it is
the daemon's child. Once it has opened what it needs - its channel to the daemon, its CA
loaded in memory - it confines itself with :func:`confine`, in this order, each step with its
own error (:class:`ConfineError`, ``step`` names it) and no way back:

1. ``mount-namespace`` - a mount namespace of its own whose root is a small read-only tmpfs
   holding only what the worker must read (the interpreter, its libraries, the Python code,
   a few files of ``/etc`` for DNS and TLS, ``/dev/null``/``urandom``), its leaf-certificate
   cache and ``/tmp`` as private tmpfs directories it owns, and the decision-log directory
   (read-write). The daemon's state - the state db, the vault and its key, the audit chain,
   ``/root``, every workspace - is not in it at all (``pivot_root``, old root detached).
2. ``identity`` - a dedicated unprivileged uid/gid (:func:`gate_uid`), no supplementary
   groups, every capability dropped from the bounding, ambient, inheritable, permitted and
   effective sets, the securebits locked (no way back to root), not dumpable (no other
   process of its uid may ptrace it or read its memory through ``/proc``).
3. ``no-new-privs``.
4. ``landlock`` - files: read-only where the namespace's root binds them, writes only to the
   decision logs (existing files: the daemon creates each one owned by the worker's uid) and
   its private directories; no ``execute`` right anywhere. Scoped (ABI >= 6): no signal to a
   process outside the domain, no connection to an abstract unix socket outside it.
5. ``seccomp`` - an allowlist of the system calls an asyncio network proxy makes (everything
   else fails with EPERM) and a kill list (``SECCOMP_RET_KILL_PROCESS``) of what only an
   attacker calls: ``execve``/``execveat``, ``ptrace``, ``process_vm_*``, the mount API,
   ``unshare``, ``setns``, ``clone``/``clone3`` with a namespace flag, ``bpf``, ``keyctl``,
   ``perf_event_open``, ``userfaultfd``, ``io_uring``, module loading, identity changes,
   TIOCSTI. The daemon sees such a death (SIGSYS) and writes it on the audit chain as a
   security alert (``gate.worker-killed``, see :mod:`agentvm.gate.workers`).

Identity: each worker slot ``i`` of an installation runs as uid/gid ``gate_uid(home, i)``, the
top of the installation's agent uid range (agents are allocated from its bottom), so two
workers - serving two agents - never share a uid: neither can signal, trace or read the other's
files. ``AGENTVM_GATE_UID_BASE`` sets the base explicitly. No passwd entry is needed.

Only :func:`confine` changes the process; :func:`plan` is pure data (what will be bound,
allowed and killed), shown by ``python -m agentvm.gate.confine --plan`` and used by tests.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agentvm.errors import AgentVMError
from agentvm.identity import GATE_UIDS as MAX_GATE_UIDS  # worker slots with a uid of their own; never an agent's

# ---------------------------------------------------------------------------------- errors
STEPS = ("validate", "mount-namespace", "identity", "no-new-privs", "landlock", "seccomp")


class ConfineError(AgentVMError):
    code = "gate.confine-failed"

    def __init__(self, step: str, message: str, *, hint: str | None = None) -> None:
        assert step in STEPS, step
        self.step = step
        super().__init__(f"gate worker confinement, step {step}: {message}",
                         hint=hint or "the worker does not serve unconfined: see docs/threat-model.md (gate workers)")


# ---------------------------------------------------------------------------------- identity
def gate_uid(home: Path, index: int) -> int:
    """The uid (and gid) of gate worker slot ``index`` of the installation at ``home``."""
    if not 0 <= index < MAX_GATE_UIDS:
        raise ConfineError("validate", f"worker slot {index} is not between 0 and {MAX_GATE_UIDS - 1}")
    env = os.environ.get("AGENTVM_GATE_UID_BASE")
    if env:
        try:
            base = int(env)
        except ValueError:
            raise ConfineError("validate", f"AGENTVM_GATE_UID_BASE={env!r} is not a number") from None
    else:
        from agentvm.identity import AGENT_RANGE, uid_base

        base = uid_base(Path(home)) + AGENT_RANGE - MAX_GATE_UIDS
    if base < 65536:
        raise ConfineError("validate", f"the gate uid base {base} is below 65536 (ordinary accounts live there)")
    return base + index


# ---------------------------------------------------------------------------------- the plan
# /etc entries a proxy reads: name resolution and TLS trust (nothing with a secret in it)
ETC = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf", "/etc/host.conf",
       "/etc/services", "/etc/protocols", "/etc/localtime", "/etc/ssl", "/etc/ca-certificates",
       "/etc/ld.so.cache")
SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


@dataclass(frozen=True)
class Plan:
    uid: int
    gid: int
    root: str  # the (empty) directory the new root is mounted on, in the daemon's filesystem
    readonly: tuple[str, ...]  # bound read-only at the same path
    logs: tuple[str, ...]  # bound read-write at the same path (existing files written, nothing created)
    private: tuple[str, ...]  # fresh tmpfs directories owned by the worker (leaf cache, /tmp)
    devices: tuple[str, ...] = DEVICES
    symlinks: tuple[tuple[str, str], ...] = ()  # (path, target) recreated in the new root
    kill: tuple[str, ...] = field(default_factory=lambda: KILL)
    allow: tuple[str, ...] = field(default_factory=lambda: ALLOW)


def _python_dirs() -> list[str]:
    """The interpreter's own directories, its site-packages and agent-vm's code: not the rest of
    sys.path (its first entry is the daemon's working directory, which may be anything)."""
    import site

    import agentvm

    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}

    dirs.add(str(Path(agentvm.__file__).resolve().parent.parent))
    return sorted(os.path.realpath(d) for d in dirs if d and os.path.isdir(d))


def _outermost(paths) -> tuple[str, ...]:
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return tuple(out)


def plan(uid: int, gid: int, *, state_dir: Path, log_dir: Path, extra_readonly: tuple[str, ...] = ()) -> Plan:
    """What :func:`confine` will do for a worker of ``state_dir``'s gate writing ``log_dir``."""
    if uid <= 0 or gid <= 0:
        raise ConfineError("validate", f"uid {uid}/gid {gid}: a gate worker never runs as root")
    symlinks, ro = [], []
    for p in SYSTEM:
        if os.path.islink(p):
            symlinks.append((p, os.readlink(p)))
        elif os.path.isdir(p):
            ro.append(p)
    ro += [p for p in ETC if os.path.exists(p)]
    ro += _python_dirs()
    ro += [str(Path(p)) for p in extra_readonly]
    state_dir, log_dir = Path(state_dir).resolve(), Path(log_dir).resolve()
    # the interpreter may live under /root (pyenv) or the state dir's parents: only the
    # directories it needs are bound there, never the state itself
    home = state_dir.parent  # (the state db, the vault, the audit chain, the workspaces)
    for p in ro:
        rp = Path(p).resolve()
        if rp == home or rp in home.parents or home in rp.parents:
            raise ConfineError("validate", f"{p} would bind agent-vm's state ({home}) into the worker's namespace",
                               hint="keep AGENTVM_HOME out of the interpreter's and the system's directories")
    return Plan(uid=uid, gid=gid, root=str(state_dir / ".confine-root"), readonly=_outermost(ro),
                logs=(str(log_dir),), private=(str(state_dir / "ca" / "leaves"),),
                symlinks=tuple(symlinks))


# ---------------------------------------------------------------------------------- libc
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 4, 24, 28, 38
PR_GET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 39, 47, 4
# SECBIT_NOROOT | _LOCKED, SECBIT_NO_SETUID_FIXUP_LOCKED (the fixup itself stays: a switch away
# from uid 0 clears the capabilities), SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE | _LOCKED
SECUREBITS = 0x01 | 0x02 | 0x08 | 0x20 | 0x40 | 0x80
CAP_LAST = 63  # every capability a kernel may have (unknown ones: EINVAL, ignored)
NR = {"x86_64": {"pivot_root": 155, "capset": 126, "capget": 125},
      "aarch64": {"pivot_root": 41, "capset": 91, "capget": 90}}
NR_LANDLOCK_CREATE, NR_LANDLOCK_ADD, NR_LANDLOCK_RESTRICT = 444, 445, 446


def _nr(name: str) -> int:
    return NR[os.uname().machine][name]


def _check(rc: int, step: str, what: str) -> None:
    if rc < 0:
        e = ctypes.get_errno()
        raise ConfineError(step, f"{what}: {os.strerror(e)}")


def _mount(src, dst, fstype, flags, data, step="mount-namespace") -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), step, f"mount {src} on {dst}")


# ---------------------------------------------------------------------------------- 1. mounts
def _mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _mount_namespace(p: Plan) -> None:
    step = "mount-namespace"
    os.makedirs(p.root, mode=0o700, exist_ok=True)
    _check(_libc.unshare(CLONE_NEWNS), step, "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    new = p.root
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")

    def inside(path: str) -> str:
        return new + path

    # the private directories first (/tmp may hold the others, in tests)
    for path in sorted(p.private, key=len):
        dst = inside(path)
        _mkdirs(dst)
        _mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size=16m,mode=0700,uid={p.uid},gid={p.gid}")
    for src in p.readonly:
        dst = inside(src)
        if os.path.isdir(src):
            _mkdirs(dst)
        else:
            _mkdirs(os.path.dirname(dst))
            open(dst, "a").close()
        _mount(src, dst, None, MS_BIND | MS_REC, None)
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    for src in p.logs:
        dst = inside(src)
        _mkdirs(dst)
        _mount(src, dst, None, MS_BIND, None)
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for dev in p.devices:
        if os.path.exists(dev):
            dst = inside(dev)
            _mkdirs(os.path.dirname(dst))
            open(dst, "a").close()
            _mount(dev, dst, None, MS_BIND, None)
            _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC, None)
    for path, target in p.symlinks:
        if not os.path.lexists(inside(path)):
            os.symlink(target, inside(path))
    old = inside("/.old-root")
    os.mkdir(old, 0o700)
    _check(_libc.syscall(_nr("pivot_root"), os.fsencode(new), os.fsencode(old)), step, "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), step, "detaching the old root")
    os.rmdir("/.old-root")
    # the root itself read-only: nothing may be created outside the private directories
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


# ---------------------------------------------------------------------------------- 2. identity
class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capabilities() -> tuple[int, int, int]:
    """(effective, permitted, inheritable) of this thread, as 64-bit masks."""
    hdr = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(_nr("capget"), ctypes.byref(hdr), data), "identity", "capget")
    join = (lambda f: getattr(data[0], f) | getattr(data[1], f) << 32)
    return join("effective"), join("permitted"), join("inheritable")


def _identity(p: Plan) -> None:
    step = "identity"
    for cap in range(CAP_LAST + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, step, f"dropping capability {cap} from the bounding set")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), step, "clearing the ambient set")
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), step, "locking the securebits")
    try:
        os.setgroups([])
        os.setresgid(p.gid, p.gid, p.gid)
        os.setresuid(p.uid, p.uid, p.uid)
    except OSError as exc:
        raise ConfineError(step, f"switching to uid {p.uid}/gid {p.gid}: {exc.strerror}") from None
    hdr = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(_nr("capset"), ctypes.byref(hdr), data), step, "clearing every capability")
    if any(capabilities()) or os.getresuid() != (p.uid,) * 3 or os.getresgid() != (p.gid,) * 3 or os.getgroups():
        raise ConfineError(step, f"after the switch: caps {capabilities()}, uids {os.getresuid()}, gids {os.getresgid()}")
    try:  # (back to root would need a capability, and there is none left: checked)
        os.setuid(0)
    except OSError:
        pass
    else:
        raise ConfineError(step, "setuid(0) still works")
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), step, "PR_SET_DUMPABLE 0")


def _no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no-new-privs", "PR_SET_NO_NEW_PRIVS")
    if _libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1:
        raise ConfineError("no-new-privs", "not set after PR_SET_NO_NEW_PRIVS")


# ---------------------------------------------------------------------------------- 4. landlock
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    rc = _libc.syscall(NR_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(rc), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def landlock_rules(p: Plan, abi: int) -> list[tuple[str, int]]:
    """(path, rights) Landlock allows in the new root (every other access is refused)."""
    handled = _handled_fs(abi)
    ro = FS_READ_FILE | FS_READ_DIR
    rules = [(path, ro) for path in p.readonly]
    rules += [(path, FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE) for path in p.logs]  # no READ_DIR: no listing
    rules += [(path, FS_READ_FILE | FS_WRITE_FILE | FS_READ_DIR | FS_MAKE_REG | FS_REMOVE_FILE | FS_TRUNCATE | FS_REFER)
              for path in p.private]
    rules += [(dev, FS_READ_FILE | FS_WRITE_FILE) for dev in p.devices if os.path.exists(dev)]
    return [(path, rights & handled) for path, rights in rules]


def _landlock(p: Plan) -> int:
    step = "landlock"
    abi = landlock_abi()
    if abi < 1:
        raise ConfineError(step, "the kernel has no Landlock", hint="a kernel >= 5.13 with Landlock enabled (lsm=landlock)")
    attr = _RulesetAttr(_handled_fs(abi), 0, (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr)  # (an older kernel takes it: the fields it does not know are 0)
    fd = _libc.syscall(NR_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    _check(fd, step, "landlock_create_ruleset")
    try:
        for path, rights in landlock_rules(p, abi):
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                    rights &= FILE_RIGHTS
                rule = _PathBeneath(rights, pfd)
                _check(_libc.syscall(NR_LANDLOCK_ADD, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule),
                                     ctypes.c_uint32(0)), step, f"a rule for {path}")
            finally:
                os.close(pfd)
        _check(_libc.syscall(NR_LANDLOCK_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)), step, "landlock_restrict_self")
    finally:
        os.close(fd)
    return abi


# ---------------------------------------------------------------------------------- 5. seccomp
# what only an attacker calls: the process is killed (SIGSYS), and the daemon reports it
KILL = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "unshare", "setns", "bpf", "keyctl", "add_key", "request_key",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
    "capset", "personality", "name_to_handle_at", "open_by_handle_at", "swapon", "swapoff", "acct",
    "iopl", "ioperm", "quotactl", "syslog", "vhangup", "uselib", "lookup_dcookie",
    # a new process: one could outlive its worker as the slot's uid and meet the next agent's
    # worker there (its decision logs, its signals); a worker only ever starts threads
    "fork", "vfork",
)
# what an asyncio network proxy (CPython, uvloop, OpenSSL, zlib/brotli/zstd) calls; anything
# else fails with EPERM
ALLOW = (
    # files and descriptors (Landlock and the namespace decide which files)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "open", "openat", "close", "close_range", "creat", "fstat", "stat", "lstat", "newfstatat", "statx", "fstatfs",
    "statfs", "lseek", "access", "faccessat", "faccessat2", "getdents64", "getcwd", "chdir", "fchdir",
    "readlink", "readlinkat", "unlink", "unlinkat", "rename", "renameat", "renameat2", "mkdir", "mkdirat",
    "rmdir", "fsync", "fdatasync", "ftruncate", "truncate", "fcntl", "flock", "dup", "dup2", "dup3", "pipe",
    "pipe2", "chmod", "fchmod", "fchmodat", "umask", "utimensat", "fadvise64", "sendfile", "splice",
    "copy_file_range", "memfd_create",
    # memory
    "mmap", "munmap", "mprotect", "mremap", "madvise", "brk", "msync", "mincore", "mlock", "munlock",
    # waiting
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll",
    "select", "pselect6", "eventfd", "eventfd2", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    "signalfd", "signalfd4", "futex", "futex_waitv", "nanosleep", "clock_nanosleep", "sched_yield",
    # sockets (families filtered below)
    "socketpair", "connect", "accept", "accept4", "bind", "listen", "getsockname", "getpeername",
    "setsockopt", "getsockopt", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown",
    # threads and the process itself
    "set_robust_list", "get_robust_list", "rseq", "set_tid_address", "exit", "exit_group", "wait4", "waitid",
    "arch_prctl", "prctl", "membarrier", "getpid", "gettid", "getppid", "getpgrp", "getpgid", "getsid",
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "uname", "getrlimit",
    "prlimit64", "getrusage", "sysinfo", "times", "getcpu", "sched_getaffinity", "sched_getparam",
    "sched_getscheduler", "getpriority", "capget", "seccomp", "landlock_create_ruleset", "landlock_add_rule",
    "landlock_restrict_self",
    # time, randomness, signals
    "clock_gettime", "clock_getres", "gettimeofday", "time", "getrandom", "rt_sigaction", "rt_sigprocmask",
    "rt_sigreturn", "rt_sigtimedwait", "rt_sigpending", "rt_sigsuspend", "sigaltstack", "tgkill", "tkill", "kill",
    "restart_syscall", "alarm", "setitimer", "getitimer",
)
CLONE_NS_BITS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
CLONE_NS_ALL = sum(CLONE_NS_BITS)
CLONE_THREAD = 0x00010000
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCK_TYPE_MASK, SOCK_RAW, SOCK_PACKET = 0xF, 3, 10
TIOCSTI, TIOCLINUX = 0x5412, 0x541C


def seccomp_filter(kill: tuple[str, ...] = KILL, allow: tuple[str, ...] = ALLOW):
    """The worker's filter (a pyseccomp SyscallFilter, not loaded)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    try:  # a binary tree of the ~200 rules, not a linear scan: it runs on every system call
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    except Exception:  # noqa: BLE001 - (libseccomp < 2.5: linear, still correct)
        pass
    for name in allow:
        try:
            f.add_rule(sc.ALLOW, name)
        except Exception:  # noqa: BLE001 - a call this architecture does not have cannot be made
            pass
    for name in kill:
        try:
            f.add_rule(sc.KILL_PROCESS, name)
        except Exception:  # noqa: BLE001 - (idem)
            pass
    # threads only: clone with CLONE_THREAD and no CLONE_NEW* flag; a new process (no
    # CLONE_THREAD) or a namespace: killed. clone3 hides its flags in a struct: ENOSYS (glibc
    # falls back to clone)
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NS_ALL | CLONE_THREAD, CLONE_THREAD))
    f.add_rule(sc.KILL_PROCESS, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    for bit in CLONE_NS_BITS:
        f.add_rule(sc.KILL_PROCESS, "clone", sc.Arg(0, sc.MASKED_EQ, bit | CLONE_THREAD, bit | CLONE_THREAD))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # sockets: unix, IP (no raw, no packet), netlink route only (getaddrinfo's AI_ADDRCONFIG)
    f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, AF_UNIX))
    for fam in (AF_INET, AF_INET6):
        for typ in (1, 2, 5):  # STREAM, DGRAM, SEQPACKET (flags are in the high bits)
            f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, fam), sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, typ))
    f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, 0))
    # ioctl: the few a proxy makes; terminal injection into the daemon's terminal (stderr is
    # inherited) is killed
    f.add_rule(sc.KILL_PROCESS, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    f.add_rule(sc.KILL_PROCESS, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCLINUX))
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 0x5421))  # FIONBIO
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 0x5451))  # FIOCLEX
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 0x541B))  # FIONREAD
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 0x5401))  # TCGETS (isatty)
    return f


def refuse_io_uring() -> None:
    """A first filter (everything allowed but io_uring_setup: ENOSYS), loaded before the event
    loop is made so that libuv never holds a ring the worker's filter would kill it for using."""
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        f.add_rule(sc.ERRNO(errno.ENOSYS), "io_uring_setup")
        f.load()
    except Exception as exc:  # noqa: BLE001 - named, fail closed
        raise ConfineError("seccomp", f"refusing io_uring before the loop: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------- all
@dataclass
class Report:
    uid: int
    gid: int
    landlock_abi: int
    steps: list[str] = field(default_factory=list)


def confine(p: Plan, *, skip: tuple[str, ...] = ()) -> Report:
    """Confine this process (see the module's doc). Irreversible. ``skip`` names steps left out:
    only the selftest's weakenings and the benchmark's baselines pass it."""
    if os.geteuid() != 0 and not {"mount-namespace", "identity"} <= set(skip):
        raise ConfineError("validate", f"the worker runs as uid {os.geteuid()}, not root: it cannot switch to the "
                           "gate's uid nor make its namespace", hint="start the daemon as root, or run the gate "
                           "workers unconfined (--gate-workers without confinement: see docs/threat-model.md)")
    if os.uname().machine not in NR:
        raise ConfineError("validate", f"no system call table for {os.uname().machine}")
    unknown = set(skip) - set(STEPS)
    if unknown:
        raise ConfineError("validate", f"unknown steps {sorted(unknown)}")
    # Landlock, no_new_privs and seccomp bind the calling thread (and those it starts later):
    # a thread already running would stay unconfined. The worker confines itself first.
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 0
    if threads != 1:
        raise ConfineError("validate", f"{threads or 'an unknown number of'} threads run in this process: only a "
                           "single-threaded process can be confined whole")
    r = Report(p.uid, p.gid, 0)
    try:
        import pyseccomp  # noqa: F401 - imported (and libseccomp loaded) before the root changes
    except Exception as exc:  # noqa: BLE001
        if "seccomp" not in skip:
            raise ConfineError("seccomp", f"pyseccomp: {exc}") from None
    if "seccomp" not in skip:
        filt = seccomp_filter(p.kill, p.allow)  # built before: libseccomp reads nothing after
    if "mount-namespace" not in skip:
        _mount_namespace(p)
        r.steps.append("mount-namespace")
    if "identity" not in skip:
        _identity(p)
        r.steps.append("identity")
    if "no-new-privs" not in skip:
        _no_new_privs()
        r.steps.append("no-new-privs")
    if "landlock" not in skip:
        r.landlock_abi = _landlock(p)
        r.steps.append("landlock")
    if "seccomp" not in skip:
        try:
            filt.load()
        except Exception as exc:  # noqa: BLE001
            raise ConfineError("seccomp", f"loading the filter: {type(exc).__name__}: {exc}") from None
        r.steps.append("seccomp")
    return r


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from dataclasses import asdict

    ap = argparse.ArgumentParser(prog="python -m agentvm.gate.confine", description="show a gate worker's confinement plan")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--uid", type=int, default=65534 * 40)
    ns = ap.parse_args(argv)
    p = plan(ns.uid, ns.uid, state_dir=Path(ns.state_dir), log_dir=Path(ns.log_dir))
    d = asdict(p)
    d["landlock"] = [(path, hex(r)) for path, r in landlock_rules(p, landlock_abi())]
    print(json.dumps(d, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
