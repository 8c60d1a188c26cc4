"""The sandbox's seccomp filter: a deny list over the native ABI, compiled with libseccomp.

Default action is *allow*: the namespaces, Landlock and the dropped capabilities are the
primary boundary; this filter removes kernel attack surface that an unprivileged process
still reaches (io_uring, bpf, perf, keyrings, userfaultfd, namespace creation, mount API...).
Non-native ABIs (32-bit ``int 0x80``, x32) are killed outright: libseccomp emits the arch
check and, on x86_64, rejects x32 syscall numbers.

The filter is pure data given the options; the compiled BPF is cached in memory and on disk
(``<libexec>/seccomp-<hash>.bpf``) so a launch does not pay for compilation.

Every rule is one :class:`Rule` of :func:`rules` (its id, syscall, argument conditions and
errno): the BPF is compiled from that list, and :mod:`agentvm.sysaudit` classifies a
notification with the same list. With ``SeccompOptions(notify=True)`` the rules that deny an
escape probe return ``SECCOMP_RET_USER_NOTIF`` instead of their errno, and the *watched*
rules (allowed but rare) are added: the in-sandbox helper loads that program with
``SECCOMP_FILTER_FLAG_NEW_LISTENER`` and hands the listener to the supervisor
(``agentvm.sysaudit``), which answers each denied call with the rule's errno and records it.
Compatibility rules (``clone3``/``openat2``/``statx`` -> ENOSYS, so libc falls back) and the
chown prefix are never notified: they are not probes. Neither is ``seccomp:seccomp-listener``
(``seccomp()`` with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` -> EBUSY): it must be an ERRNO, which
outranks the USER_NOTIF of any filter the agent loads, so the agent can never hold a listener
that answers its own notifications with CONTINUE. Arguments the kernel reads as ``int`` are
compared on their low 32 bits (:func:`int_eq`). See docs/syscall-audit.md.
"""

from __future__ import annotations

import errno
import stat
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agentvm.errors import PrimitiveMissing

FILTER_VERSION = 7

# Syscalls denied with EPERM, grouped by why. Documented in docs/threat-model.md.
DENY_GROUPS: dict[str, tuple[str, ...]] = {
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "bpf": ("bpf",),
    "perf": ("perf_event_open",),
    "keyring": ("keyctl", "add_key", "request_key"),
    "userfaultfd": ("userfaultfd",),
    "kernel-modules": ("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    "mount": (
        "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
        "open_tree", "mount_setattr", "chroot",
    ),
    "namespaces": ("setns", "unshare"),
    "host-admin": (
        "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
        "syslog", "iopl", "ioperm", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup", "uselib",
        "sethostname", "setdomainname", "pciconfig_read", "pciconfig_write",
    ),
    "handles": ("name_to_handle_at", "open_by_handle_at"),
    "obsolete": ("_sysctl", "nfsservctl"),
}
DEBUG_GROUP: tuple[str, ...] = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd")

# CLONE_NEW* flags: creating namespaces through clone() is denied (clone3 -> ENOSYS so libc
# falls back to clone, whose flags seccomp can see). NEWNS, NEWCGROUP, NEWUTS, NEWIPC,
# NEWUSER, NEWPID, NEWNET, NEWTIME.
CLONE_NS_BITS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
# Socket constants (x86_64/arm64 Linux), spelled out so importing this module stays cheap.
AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_KEY, AF_VSOCK = 2, 10, 16, 17, 15, 40
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
NETLINK_ROUTE = 0
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 8
SOCK_TYPE_MASK = 0xF
SOCK_RAW = 3
SOCK_PACKET = 10
S_ISUID, S_ISGID = 0o4000, 0o2000
O_CREAT, O_TMPFILE_BIT = 0o100, 0o20000000
# (syscall, index of its mode argument, index of its flags argument or None): every way to give
# a file a mode. A setuid/setgid bit is refused: inside the sandbox it is inert (no_new_privs),
# but a file made in an idmapped grant lands on the host owned by the folder's owner (root...).
MODE_SETTERS: tuple[tuple[str, int, int | None], ...] = (
    ("chmod", 1, None), ("fchmod", 1, None), ("fchmodat", 2, None), ("fchmodat2", 2, None),
    ("creat", 1, None), ("mknod", 1, None), ("mknodat", 2, None),
    ("open", 2, 1), ("openat", 3, 2),
)


@dataclass(frozen=True)
class SeccompOptions:
    """The choices that shape the sandbox's seccomp filter."""
    allow_ptrace: bool = False
    # gVisor (this Debian build) answers statx(AT_NO_AUTOMOUNT) with EINVAL, which breaks
    # coreutils (`ls`, `stat`): ENOSYS instead makes glibc fall back to fstatat, which works
    statx_fallback: bool = False
    # (uid, gid) mapped in the sandbox's user namespace (bwrap maps exactly one of each): a
    # chown to any other id fails with EPERM, as on a host without CAP_CHOWN, instead of the
    # kernel's EINVAL for an id it cannot map - fakeroot, tar, cp -p, rsync, pip tolerate EPERM
    chown_mapped: tuple[int, int] | None = None
    # the denials that are escape probes go to a supervisor (SECCOMP_RET_USER_NOTIF), which
    # answers with the same errno and records them; ``watch``: the ids of WATCH_RULES added
    # (allowed, but recorded). Without ``notify``, ``watch`` is ignored.
    notify: bool = False
    watch: tuple[str, ...] = ()

    def key(self) -> str:
        return (f"v{FILTER_VERSION}-ptrace{int(self.allow_ptrace)}" + ("-statx" if self.statx_fallback else "")
                + (f"-ids{self.chown_mapped[0]}.{self.chown_mapped[1]}" if self.chown_mapped else "")
                + (("-notify" + "".join("." + w.split(":", 1)[1] for w in sorted(self.watch))) if self.notify else ""))


AT_NO_AUTOMOUNT = 0x800


def denied_syscalls(opts: SeccompOptions) -> list[str]:
    names = [n for g in DENY_GROUPS.values() for n in g]
    if not opts.allow_ptrace:
        names += list(DEBUG_GROUP)
    return sorted(set(names))


# ------------------------------------------------------------------ the rules, as data
# A condition on one argument: (index, "eq", value) | (index, "ne", value) |
# (index, "masked_eq", mask, value) - libseccomp's comparisons, over the full 64-bit argument.
# An argument the kernel reads as an ``int`` (socket's family/type/protocol, prctl's option,
# seccomp's op) drops its upper 32 bits, so it is compared with :func:`int_eq` (masked to the
# low word): a plain "eq" would let ``AF_VSOCK | 1 << 32`` through. "ne" over 64 bits fails
# closed for such an argument (high bits set -> "not equal" -> refused).
Cond = tuple
INT_MASK = 0xFFFFFFFF


def int_eq(index: int, value: int) -> Cond:
    """``args[index]`` as the kernel's ``int`` equals ``value`` (the high word ignored)."""
    return (index, "masked_eq", INT_MASK, value & INT_MASK)


@dataclass(frozen=True)
class Rule:
    """One rule of the filter. ``action``: "deny" (an escape probe: errno, or a notification
    answered with that errno), "refuse" (an escape probe answered by the errno in the BPF
    itself, never notified: ERRNO outranks every USER_NOTIF, the agent's own filters' included),
    "compat" (errno, never notified: libc falls back), "watch" (allowed; only in a notify
    filter, and then recorded)."""

    id: str  # rule id: "seccomp:<group>" for denials, "watch:<name>" for watched calls
    syscall: str
    conds: tuple[Cond, ...] = ()
    errno: int = errno.EPERM
    action: str = "deny"
    strict: bool = False  # a libseccomp that cannot name the syscall is an error, not a skip

    def matches(self, args) -> bool:
        """Whether the 64-bit ``args`` meet every condition (what the BPF compares)."""
        for c in self.conds:
            a = int(args[c[0]]) & 0xFFFFFFFFFFFFFFFF
            if c[1] == "eq" and a != c[2]:
                return False
            if c[1] == "ne" and a == c[2]:
                return False
            if c[1] == "masked_eq" and (a & c[2]) != c[3]:
                return False
        return True


PR_SET_MM, PR_SET_PTRACER = 35, 0x59616D61
# Allowed but rare calls a notify filter can record ("watched"); a policy picks among them.
# Each costs a round trip to the supervisor (~26 us) when it happens, nothing otherwise. With
# the supervisor gone they fail with ENOSYS (fail closed), so none is on a common path.
WATCH_RULES: tuple[Rule, ...] = (
    Rule("watch:memfd-create", "memfd_create", action="watch"),  # fileless payloads
    Rule("watch:execveat", "execveat", action="watch"),  # fexecve of a memfd
    Rule("watch:prctl-mm", "prctl", (int_eq(0, PR_SET_MM),), action="watch"),  # rewriting /proc/PID/cmdline, exe
    Rule("watch:prctl-ptracer", "prctl", (int_eq(0, PR_SET_PTRACER),), action="watch"),
)
DEFAULT_WATCH: tuple[str, ...] = tuple(r.id for r in WATCH_RULES)


def rules(opts: SeccompOptions) -> list[Rule]:
    """Every rule of the filter for ``opts``, in order (the chown prefix aside)."""
    out: list[Rule] = []
    groups = dict(DENY_GROUPS)
    if not opts.allow_ptrace:
        groups["debug"] = DEBUG_GROUP
    for group, names in groups.items():
        for name in sorted(set(names)):
            out.append(Rule(f"seccomp:{group}", name))
    # Namespace creation through clone(): any CLONE_NEW* bit -> EPERM; clone3 -> ENOSYS so
    # libc falls back to clone, whose flags seccomp can see.
    for bit in CLONE_NS_BITS:
        out.append(Rule("seccomp:namespaces", "clone", ((0, "masked_eq", bit, bit),)))
    out.append(Rule("seccomp:compat-clone3", "clone3", errno=errno.ENOSYS, action="compat"))
    # No setuid/setgid bits (see MODE_SETTERS); open/openat only when they create a file.
    # Unlike the deny list above, a setter this libseccomp cannot name is not skipped: it would
    # be a way around the rule (fchmodat2 is 452 on every architecture with the unified table).
    for name, mode_arg, flags_arg in MODE_SETTERS:
        for bit in (S_ISUID, S_ISGID):
            mode = (mode_arg, "masked_eq", bit, bit)
            if flags_arg is None:
                out.append(Rule("seccomp:setuid-bit", name, (mode,), strict=True))
            else:
                for create in (O_CREAT, O_TMPFILE_BIT):
                    out.append(Rule("seccomp:setuid-bit", name, ((flags_arg, "masked_eq", create, create), mode),
                                    strict=True))
    # openat2 hides its mode in a struct seccomp cannot read: ENOSYS, so libc falls back.
    out.append(Rule("seccomp:compat-openat2", "openat2", errno=errno.ENOSYS, action="compat"))
    # No device nodes: mknod of a character or block device (the capability-free 0:0
    # overlayfs whiteout included) is refused here as well as by Landlock - a substrate
    # without Landlock (gVisor) relies on this rule; FIFOs and sockets stay possible.
    for name, mode_arg in (("mknod", 1), ("mknodat", 2)):
        for kind in (stat.S_IFCHR, stat.S_IFBLK):
            out.append(Rule("seccomp:device-node", name, ((mode_arg, "masked_eq", 0o170000, kind),), strict=True))
    if opts.statx_fallback:
        out.append(Rule("seccomp:compat-statx", "statx", ((2, "masked_eq", AT_NO_AUTOMOUNT, AT_NO_AUTOMOUNT),),
                        errno=errno.ENOSYS, action="compat"))
    # Terminal injection: TIOCSTI / TIOCLINUX on any fd.
    for cmd in (TIOCSTI, TIOCLINUX):
        out.append(Rule("seccomp:terminal-injection", "ioctl", ((1, "masked_eq", 0xFFFFFFFF, cmd),)))
    # Sockets: no packet sockets, no raw IP sockets, netlink only for NETLINK_ROUTE.
    # family, type and protocol are ints to the kernel: compared on the low word only (int_eq);
    # the protocol's "ne" is over 64 bits, which fails closed (ROUTE | 1 << 32 is refused).
    out.append(Rule("seccomp:socket-packet", "socket", (int_eq(0, AF_PACKET),)))
    for fam in (AF_INET, AF_INET6):
        out.append(Rule("seccomp:socket-raw", "socket", (int_eq(0, fam), (1, "masked_eq", SOCK_TYPE_MASK, SOCK_RAW))))
        out.append(Rule("seccomp:socket-packet", "socket",
                        (int_eq(0, fam), (1, "masked_eq", SOCK_TYPE_MASK, SOCK_PACKET))))
    out.append(Rule("seccomp:socket-netlink", "socket", (int_eq(0, AF_NETLINK), (2, "ne", NETLINK_ROUTE))))
    for fam, what in ((AF_KEY, "key"), (AF_VSOCK, "vsock")):  # IPsec keys, the host channel of VMs
        out.append(Rule(f"seccomp:socket-{what}", "socket", (int_eq(0, fam),)))
    # No seccomp listener of the agent's own: seccomp(SECCOMP_SET_MODE_FILTER, flags with
    # SECCOMP_FILTER_FLAG_NEW_LISTENER) -> EBUSY (the kernel's own answer while agent-vm's
    # listener is there), in the BPF itself (never a notification: an
    # ERRNO outranks any filter's USER_NOTIF). A listener would let the agent answer its own
    # USER_NOTIF rules - which win over the audit's on a tie (the newest filter's) - with
    # CONTINUE, i.e. run every call the deny list notifies. Ordinary filters (Chromium's, no
    # listener) stay allowed; a USER_NOTIF without a listener is ENOSYS - refused.
    out.append(Rule("seccomp:seccomp-listener", "seccomp",
                    (int_eq(0, SECCOMP_SET_MODE_FILTER),
                     (1, "masked_eq", SECCOMP_FILTER_FLAG_NEW_LISTENER, SECCOMP_FILTER_FLAG_NEW_LISTENER)),
                    errno=errno.EBUSY, action="refuse", strict=True))
    if opts.notify:
        chosen = set(opts.watch)
        unknown = chosen - set(DEFAULT_WATCH)
        if unknown:
            raise ValueError(f"unknown watched syscall rule(s): {', '.join(sorted(unknown))}")
        out += [r for r in WATCH_RULES if r.id in chosen]
    return out


def _build(opts: SeccompOptions) -> bytes:
    import tempfile

    try:
        import pyseccomp as sc
    except Exception as exc:  # pragma: no cover - depends on host
        raise PrimitiveMissing(
            "libseccomp is not usable (pyseccomp failed to load)", hint="apt-get install -y libseccomp2"
        ) from exc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    # Non-native architectures (i386 via int 0x80, x32) hit the bad-arch action: kill.
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    ops = {"eq": sc.EQ, "ne": sc.NE, "masked_eq": sc.MASKED_EQ}

    for r in rules(opts):
        if r.action in ("compat", "refuse") or (r.action == "deny" and not opts.notify):
            action = sc.ERRNO(r.errno)
        else:
            action = sc.NOTIFY
        args = [sc.Arg(c[0], ops[c[1]], *c[2:]) for c in r.conds]
        try:
            f.add_rule(action, r.syscall, *args)
        except Exception:
            if not r.strict:
                # A syscall this architecture/libseccomp does not know cannot be called either.
                continue
            if r.syscall != "fchmodat2":
                raise PrimitiveMissing(f"libseccomp cannot filter {r.syscall}: rule {r.id} could not be applied",
                                       hint="upgrade libseccomp") from None
            f.add_rule(action, 452, *args)

    with tempfile.TemporaryFile() as tmp:
        f.export_bpf(tmp)
        tmp.seek(0)
        bpf = tmp.read()
    if opts.chown_mapped is not None:
        bpf = chown_prefix(*opts.chown_mapped) + bpf
    return bpf


# ------------------------------------------------------------------ chown to unmapped ids
# libseccomp allows one comparison per argument in a rule, so "the id is neither the mapped one
# nor -1" cannot be said with it. It is a few instructions of classic BPF, put *in front of*
# libseccomp's program: it either returns EPERM or falls through to the first instruction of
# libseccomp's program (BPF jumps only forward, so the rest is untouched). Only the low 32 bits
# of an id argument are compared, as the kernel itself truncates uid_t (Go passes -1 as a 64-bit -1).
AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64 = 0xC000003E, 0xC00000B7
# (arch, {syscall number: index of its uid argument (the gid is the next one)})
CHOWN_SYSCALLS: tuple[tuple[int, dict[int, int]], ...] = (
    (AUDIT_ARCH_X86_64, {92: 1, 93: 1, 94: 1, 260: 2}),  # chown, fchown, lchown, fchownat
    (AUDIT_ARCH_AARCH64, {55: 1, 54: 2}),  # fchown, fchownat (no chown/lchown there)
)
_LD_W_ABS, _JEQ_K, _JA, _RET_K = 0x20, 0x15, 0x05, 0x06
SECCOMP_RET_ERRNO = 0x00050000
NO_CHANGE = 0xFFFFFFFF  # (uid_t)-1: leave this id as it is


def _arg_lo(i: int) -> int:
    return 16 + 8 * i  # offsetof(struct seccomp_data, args[i]), its low word on little-endian


def chown_prefix(uid: int, gid: int) -> bytes:
    """Classic BPF: on this machine's native architecture, chown/fchown/lchown/fchownat whose
    owner is neither ``uid`` nor -1, or whose group is neither ``gid`` nor -1, -> EPERM;
    everything else falls through to the instruction right after this block."""
    import struct
    import sys

    if sys.byteorder != "little":
        return b""  # args' low words are elsewhere; the kernel's EINVAL stays
    arch = {"x86_64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64}.get(os.uname().machine)
    table = dict(CHOWN_SYSCALLS).get(arch)
    if not table:
        return b""
    # instructions as (code, jt, jf, k); jump targets named, resolved below
    prog: list[list] = [[_LD_W_ABS, 0, 0, 4], [_JEQ_K, 0, "end", arch], [_LD_W_ABS, 0, 0, 0]]
    groups = sorted(set(table.values()))
    for nr, first in sorted(table.items()):
        prog.append([_JEQ_K, f"check{first}", 0, nr])
    prog.append([_JA, 0, 0, "end"])
    for first in groups:
        prog.append(f"check{first}")
        for idx, want in ((first, uid), (first + 1, gid)):
            prog.append([_LD_W_ABS, 0, 0, _arg_lo(idx)])
            prog.append([_JEQ_K, f"ok{first}.{idx}", 0, want & 0xFFFFFFFF])
            prog.append([_JEQ_K, f"ok{first}.{idx}", "deny", NO_CHANGE])
            prog.append(f"ok{first}.{idx}")
        prog.append([_JA, 0, 0, "end"])
    prog.append("deny")
    prog.append([_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM])
    prog.append("end")
    labels: dict[str, int] = {}
    insns: list[list] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    out = b""
    for pc, (code, jt, jf, k) in enumerate(insns):
        def rel(t):
            return labels[t] - pc - 1 if isinstance(t, str) else t
        if code == _JA:
            k, jt, jf = rel(k), 0, 0
        else:
            jt, jf = rel(jt), rel(jf)
        assert 0 <= jt < 256 and 0 <= jf < 256 and k >= 0
        out += struct.pack("<HBBI", code, jt, jf, k)
    return out


# ------------------------------------------------------------------ libseccomp, without pyseccomp
# pyseccomp finds libseccomp with ctypes.util.find_library, which runs `ldconfig -p` twice (two
# forks of the whole process, ~8 ms on every start). What a start needs of libseccomp - a
# syscall's number, the library's version for the cache key - is two plain calls: the library
# is opened by its soname (the dynamic loader's own lookup: the same file find_library names).
# Building a filter still goes through pyseccomp (_build), once per cache key.
_LIB: list = []


def libseccomp():
    """libseccomp, opened by its soname (ctypes.CDLL), with the two functions a start uses."""
    if not _LIB:
        import ctypes

        try:
            lib = ctypes.CDLL("libseccomp.so.2")
        except OSError:
            import ctypes.util

            name = ctypes.util.find_library("seccomp")
            if name is None:
                raise PrimitiveMissing("libseccomp is not installed", hint="apt-get install -y libseccomp2") from None
            lib = ctypes.CDLL(name)
        lib.seccomp_syscall_resolve_name_arch.argtypes = (ctypes.c_uint32, ctypes.c_char_p)
        lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int

        class _Version(ctypes.Structure):
            _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]

        lib.seccomp_version.argtypes = ()
        lib.seccomp_version.restype = ctypes.POINTER(_Version)
        _LIB.append(lib)
    return _LIB[0]


def syscall_number(name: str) -> int:
    """``name``'s number on the native architecture, as libseccomp resolves it (what
    pyseccomp.resolve_syscall(Arch.NATIVE, name) returns); negative when this libseccomp does
    not know it on this architecture."""
    return int(libseccomp().seccomp_syscall_resolve_name_arch(0, name.encode()))


def libseccomp_version() -> str:
    v = libseccomp().seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"


@lru_cache(maxsize=16)
def cache_key(opts: SeccompOptions) -> str:
    """The name of ``opts``' compiled filter on disk: the options' key and a digest of every
    input of the program - the rule list as it is now (a rule changed without a FILTER_VERSION
    bump is a new file, never the old program), the chown prefix's table, the architecture and
    libseccomp's version (a newer libseccomp may name more syscalls)."""
    import hashlib

    # every field of every rule, spelled out (the dataclasses' own repr costs ~1 ms here)
    text = "\n".join(f"{r.id}|{r.syscall}|{r.conds!r}|{r.errno}|{r.action}|{r.strict}" for r in rules(opts))
    h = hashlib.sha256(f"{FILTER_VERSION}|{os.uname().machine}|{libseccomp_version()}|"
                       f"{CHOWN_SYSCALLS if opts.chown_mapped else None!r}\n{text}".encode())
    return f"{opts.key()}-{h.hexdigest()[:12]}"


@lru_cache(maxsize=8)
def compiled_filter(opts: SeccompOptions, cache_dir: Path | None = None) -> bytes:
    """The BPF program for ``opts`` (cached in memory and, if given, on disk under
    :func:`cache_key`: a file this user or root wrote, no one else may write, read without
    following a link; anything else is compiled again)."""
    if cache_dir is not None:
        path = cache_dir / f"seccomp-{cache_key(opts)}.bpf"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                data = os.read(fd, 1 << 20) if (stat.S_ISREG(st.st_mode) and st.st_uid in (0, os.geteuid())
                                                 and not st.st_mode & 0o022) else b""
            finally:
                os.close(fd)
            if data and len(data) % 8 == 0 and len(data) == st.st_size:
                return data
        except OSError:
            pass
    data = _build(opts)
    if cache_dir is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            import tempfile

            fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".bpf-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, cache_dir / f"seccomp-{cache_key(opts)}.bpf")
        except OSError:
            pass
    return data


def filter_fd(opts: SeccompOptions, cache_dir: Path | None = None) -> int:
    """A memfd holding the compiled filter, for ``agentvm-helper init --seccomp-fd``."""
    data = compiled_filter(opts, cache_dir)
    fd = os.memfd_create("agentvm-seccomp", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
