"""The syscall audit: the supervisor of the seccomp user-notification listeners.

The sandbox's seccomp filter (``agentvm.seccomp``, ``notify=True``) returns
``SECCOMP_RET_USER_NOTIF`` for the calls its deny list refuses as escape probes (``unshare``,
``mount``, ``ptrace``, ``bpf``, a raw socket...) and for a few watched, allowed-but-rare calls.
``agentvm-helper init`` loads it with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` right before it
execs the command and sends the listener here over a unix socket (``SCM_RIGHTS``), keeping no
copy. This module answers and records:

* **answer** (one thread, :class:`Supervisor`): receive the notification, classify it with the
  same rule list the BPF was compiled from, answer a denial with that rule's errno (so the
  sandbox behaves exactly as with the plain deny list) and a watched call with
  ``SECCOMP_USER_NOTIF_FLAG_CONTINUE``. Before answering - while the caller is held in the
  kernel, so its pid cannot be reused - it reads ``/proc/PID/cmdline`` and ``exe`` and checks
  with ``SECCOMP_IOCTL_NOTIF_ID_VALID`` that the notification (hence the pid) was still live
  after the reads (``verified``). Pointer arguments are never read (the caller could change
  them after the check): only flags and numbers are decoded.
* **record** (another thread): a bounded queue between the two; on overflow the record is
  dropped and counted, never the answer. Identical records of one process are rate limited
  (one per ``REPEAT_WINDOW`` seconds, the next one carries the count). Records go to the
  sandbox's sinks (its ``<home>/logs/ID.syscalls.jsonl``; the audit chain and the trace when
  the daemon or run wires :func:`audit_sink` / :func:`trace_sink`) and to the metric
  ``agentvm_syscalls_denied_total{syscall}`` (:class:`Collector`).
* **act**: ``security.onEscapeProbe`` - ``log`` (records only), ``alert`` (each record is an
  alert), ``pause`` (freeze the sandbox's cgroup) or ``stop`` (kill it) once a sandbox has
  made ``PROBE_THRESHOLD`` denied calls.

Fail closed: if this process dies the kernel answers every pending and later notification
with ``ENOSYS`` - the call is still refused (never run), only the errno differs from the deny
list's ``EPERM``. The listener is never closed while a task of the sandbox lives: with no
listener the kernel forgets it, and a process could then have a listener of its own (which
wins a tie between USER_NOTIF filters and could answer CONTINUE). The filter refuses that too,
in the BPF (``seccomp:seccomp-listener``: ``seccomp()`` with ``SECCOMP_FILTER_FLAG_NEW_LISTENER``
-> EBUSY, an ERRNO that outranks any USER_NOTIF), so a dead supervisor still leaves every call
refused. The answering thread is shared by every sandbox, so each has a budget: once one has
had ``FLOOD_PER_SEC`` notifications answered in a second, its listeners are not polled until
that second is over - its further calls wait in the kernel (its threads block; every call is
still refused with its rule's errno when it is answered), the listener is never closed, other
sandboxes are answered as ever - and one ``syscall.audit-flood`` record says so. Records are
capped too: at most ``RECORDS_PER_MIN`` per sandbox per minute (varying arguments defeat the
folding); beyond it the calls are answered without reading ``/proc``, counted
(``suppressed``), and one ``syscall.audit-capped`` record gives the count when the minute is
over (or the sandbox's last listener closes). :meth:`Supervisor.drop_all` (letting go of
every listener) stops or freezes the sandboxes first.
"""

from __future__ import annotations

import collections
import ctypes
import errno as _errno
import json
import os
import queue
import select
import _socket as socket  # the C module: socket.py builds its enums (~1.4 ms of a start without the gate)
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from agentvm import seccomp as sc

# ------------------------------------------------------------------ kernel ABI (linux/seccomp.h)


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("instruction_pointer", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class _NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def _iowr(nr: int, size: int, direction: int = 3) -> int:
    return (direction << 30) | (size << 16) | (ord("!") << 8) | nr


IOCTL_RECV = _iowr(0, ctypes.sizeof(_Notif))  # SECCOMP_IOCTL_NOTIF_RECV
IOCTL_SEND = _iowr(1, ctypes.sizeof(_NotifResp))  # SECCOMP_IOCTL_NOTIF_SEND
IOCTL_ID_VALID = _iowr(2, 8, direction=1)  # SECCOMP_IOCTL_NOTIF_ID_VALID (_IOW)
FLAG_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE

# ctypes releases the GIL around foreign calls (fcntl.ioctl does not): a RECV that blocks
# (its notification vanished between poll and recv) never stalls the rest of the process
_libc = ctypes.CDLL(None, use_errno=True)
_ioctl = _libc.ioctl
_ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_ioctl.restype = ctypes.c_int

# ------------------------------------------------------------------ policy knobs

ON_PROBE = ("log", "alert", "pause", "stop")
PROBE_THRESHOLD = 3  # denied calls of one sandbox before pause/stop acts
QUEUE_MAX = 4096  # records waiting for the sinks; beyond: dropped and counted
REPEAT_WINDOW = 10.0  # seconds: identical records of one process are folded into one
FLOOD_PER_SEC = 1000  # notifications of one sandbox answered in one second: then its listeners wait for the next
RECORDS_PER_MIN = 600  # records of one sandbox in one minute: beyond, counted and summed up in one record
ARGV_MAX = 4096  # bytes of /proc/PID/cmdline kept


# ------------------------------------------------------------------ classification (pure)

@dataclass(frozen=True)
class Verdict:
    """What the filter does with one watched or denied system call, and under which rule."""
    syscall: str
    rule: str
    action: str  # "deny" | "watch"
    errno: int  # 0 for watch


class Classifier:
    """The filter's rules by syscall number: what the BPF notified, and the errno to answer.

    A notification no rule explains (it cannot happen with the filter this was built from) is
    denied with EPERM under ``seccomp:unknown``: fail closed."""

    def __init__(self, opts: sc.SeccompOptions) -> None:
        # numbers from libseccomp itself (the library the BPF is compiled with), without
        # pyseccomp: importing it runs `ldconfig -p` twice (seccomp.libseccomp)
        self.by_nr: dict[int, list[sc.Rule]] = {}
        self.names: dict[int, str] = {}
        for r in sc.rules(opts):
            if r.action in ("compat", "refuse"):
                continue  # errno in the BPF itself: never notified
            try:
                nr = sc.syscall_number(r.syscall)
            except Exception:
                nr = -1
            if nr < 0 and r.syscall == "fchmodat2":
                nr = 452  # as the BPF has it (seccomp._build): the same number on every architecture
            if nr < 0:
                continue
            self.by_nr.setdefault(nr, []).append(r)
            self.names[nr] = r.syscall

    def classify(self, nr: int, args) -> Verdict:
        for r in self.by_nr.get(nr, ()):
            if r.matches(args):
                return Verdict(r.syscall, r.id, r.action, r.errno if r.action == "deny" else 0)
        return Verdict(self.names.get(nr, f"syscall-{nr}"), "seccomp:unknown", "deny", _errno.EPERM)


# ------------------------------------------------------------------ argument decoding (pure)

_CLONE_NS = {0x00020000: "CLONE_NEWNS", 0x02000000: "CLONE_NEWCGROUP", 0x04000000: "CLONE_NEWUTS",
             0x08000000: "CLONE_NEWIPC", 0x10000000: "CLONE_NEWUSER", 0x20000000: "CLONE_NEWPID",
             0x40000000: "CLONE_NEWNET", 0x00000080: "CLONE_NEWTIME", 0x00000200: "CLONE_FILES",
             0x00000400: "CLONE_FS", 0x00000100: "CLONE_VM", 0x00010000: "CLONE_THREAD",
             0x00000800: "CLONE_SIGHAND", 0x00008000: "CLONE_VFORK", 0x00001000: "CLONE_PIDFD"}
_MS = {1: "MS_RDONLY", 2: "MS_NOSUID", 4: "MS_NODEV", 8: "MS_NOEXEC", 0x20: "MS_REMOUNT", 0x1000: "MS_BIND",
       0x2000: "MS_MOVE", 0x4000: "MS_REC", 0x20000: "MS_PRIVATE", 0x40000: "MS_SLAVE", 0x80000: "MS_SHARED",
       0x10000: "MS_UNBINDABLE"}
_AF = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6", 15: "AF_KEY", 16: "AF_NETLINK", 17: "AF_PACKET", 40: "AF_VSOCK"}
_SOCK = {1: "SOCK_STREAM", 2: "SOCK_DGRAM", 3: "SOCK_RAW", 5: "SOCK_SEQPACKET", 10: "SOCK_PACKET"}
_IOCTL = {0x5412: "TIOCSTI", 0x541C: "TIOCLINUX"}
_PTRACE = {0: "PTRACE_TRACEME", 1: "PTRACE_PEEKTEXT", 3: "PTRACE_PEEKUSER", 16: "PTRACE_ATTACH",
           0x4206: "PTRACE_SEIZE", 17: "PTRACE_DETACH"}
_PRCTL = {sc.PR_SET_MM: "PR_SET_MM", sc.PR_SET_PTRACER: "PR_SET_PTRACER"}


def _flags(v: int, names: dict[int, str]) -> str:
    out, rest = [], v
    for bit, name in names.items():
        if v & bit == bit and bit:
            out.append(name)
            rest &= ~bit
    if rest:
        out.append(hex(rest))
    return "|".join(out) or "0"


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def decode_args(syscall: str, args) -> dict:
    """The arguments that are safe to report: flags and numbers, never what a pointer points
    to (the caller could change it after any check). Unknown syscalls: nothing."""
    a = [int(x) & 0xFFFFFFFFFFFFFFFF for x in args]
    if syscall in ("unshare",):
        return {"flags": _flags(a[0] & 0xFFFFFFFF, _CLONE_NS)}
    if syscall == "clone":
        return {"flags": _flags(a[0] & 0xFFFFFFFF, _CLONE_NS)}
    if syscall == "setns":
        return {"fd": _s32(a[0]), "nstype": _flags(a[1] & 0xFFFFFFFF, _CLONE_NS)}
    if syscall == "socket":
        t = a[1] & 0xF
        extra = [n for bit, n in ((0o4000, "SOCK_NONBLOCK"), (0o2000000, "SOCK_CLOEXEC")) if a[1] & bit]
        return {"domain": _AF.get(a[0] & 0xFFFFFFFF, str(a[0] & 0xFFFFFFFF)),
                "type": "|".join([_SOCK.get(t, str(t)), *extra]), "protocol": _s32(a[2])}
    if syscall == "mount":
        return {"flags": _flags(a[3] & 0xFFFFFFFF, _MS)}
    if syscall == "umount2":
        return {"flags": hex(a[1] & 0xFFFFFFFF)}
    if syscall == "ioctl":
        cmd = a[1] & 0xFFFFFFFF
        return {"fd": _s32(a[0]), "cmd": _IOCTL.get(cmd, hex(cmd))}
    if syscall == "ptrace":
        return {"request": _PTRACE.get(a[0], str(a[0])), "pid": _s32(a[1])}
    if syscall in ("process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"):
        return {"pid": _s32(a[0])}
    if syscall in ("keyctl", "bpf"):
        return {"cmd": _s32(a[0])}
    if syscall == "perf_event_open":
        return {"pid": _s32(a[1]), "cpu": _s32(a[2])}
    if syscall == "prctl":
        return {"option": _PRCTL.get(a[0] & 0xFFFFFFFF, str(_s32(a[0])))}
    if syscall in ("chmod", "fchmod", "creat"):
        return {"mode": oct(a[1] & 0o7777)}
    if syscall in ("fchmodat", "fchmodat2"):
        return {"mode": oct(a[2] & 0o7777)}
    if syscall in ("mknod", "mknodat"):
        i = 1 if syscall == "mknod" else 2
        return {"mode": oct(a[i] & 0o177777)}
    if syscall in ("open", "openat"):
        i = 1 if syscall == "open" else 2
        return {"flags": oct(a[i] & 0xFFFFFFFF), "mode": oct(a[i + 1] & 0o7777)}
    if syscall == "memfd_create":
        return {"flags": hex(a[1] & 0xFFFFFFFF)}
    if syscall == "execveat":
        return {"dirfd": _s32(a[0]), "flags": hex(a[4] & 0xFFFFFFFF)}
    if syscall == "init_module" or syscall == "finit_module":
        return {}
    return {}


# ------------------------------------------------------------------ one sandbox's audit

Sink = Callable[[dict], None]


@dataclass
class SandboxAudit:
    """What the supervisor knows of one sandbox: where its records go and what to do when it
    keeps probing. ``sinks`` are called on the recording thread, never on the answering one."""

    sandbox_id: str
    agent: str = ""
    on_probe: str = "log"
    sinks: list = field(default_factory=list)
    freeze: Callable[[], object] | None = None  # pause: freeze the sandbox's cgroup
    kill: Callable[[], object] | None = None  # stop
    threshold: int = PROBE_THRESHOLD
    # counters (the recording thread writes the record ones; the answering thread the others)
    denied: int = 0
    watched: int = 0
    suppressed: int = 0
    acted: str | None = None
    _act_started: bool = False
    detached: bool = False  # never set any more (a flood no longer closes the listener); kept for readers
    flooded: int = 0  # seconds in which the sandbox went over FLOOD_PER_SEC
    listeners: int = 0
    _repeat: dict = field(default_factory=dict, repr=False)
    _second: list = field(default_factory=lambda: [0.0, 0], repr=False)
    _minute: list = field(default_factory=lambda: [0.0, 0, 0], repr=False)  # start, records, capped

    def summary(self) -> dict:
        """The console's column: counts and the action taken (see docs/syscall-audit.md)."""
        return {"denied": self.denied, "watched": self.watched, "suppressed": self.suppressed,
                "action": self.acted, "detached": self.detached, "flooded": self.flooded,
                "on_probe": self.on_probe}


# ------------------------------------------------------------------ metrics (process-wide)

_metric_lock = threading.Lock()
_denied_by_syscall: collections.Counter = collections.Counter()
_watched_by_syscall: collections.Counter = collections.Counter()
_dropped = [0]


def metrics() -> dict:
    with _metric_lock:
        return {"denied": dict(_denied_by_syscall), "watched": dict(_watched_by_syscall), "dropped": _dropped[0]}


class Collector:
    """A prometheus_client collector: ``registry.register(sysaudit.Collector())`` exports
    ``agentvm_syscalls_denied_total{syscall}``, ``agentvm_syscalls_watched_total{syscall}`` and
    ``agentvm_syscall_audit_dropped_total``. Label values are syscall names from the filter's
    rule list (bounded)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        m = metrics()
        d = CounterMetricFamily("agentvm_syscalls_denied", "Denied syscalls (escape probes), by syscall",
                                labels=["syscall"])
        for k, v in sorted(m["denied"].items()):
            d.add_metric([k], v)
        yield d
        w = CounterMetricFamily("agentvm_syscalls_watched", "Watched (allowed, recorded) syscalls, by syscall",
                                labels=["syscall"])
        for k, v in sorted(m["watched"].items()):
            w.add_metric([k], v)
        yield w
        yield CounterMetricFamily("agentvm_syscall_audit_dropped", "Syscall records dropped (queue full)",
                                  value=m["dropped"])

    def describe(self):
        return []


# ------------------------------------------------------------------ the supervisor


def _read_proc(pid: int) -> tuple[list[str], str]:
    argv: list[str] = []
    exe = ""
    try:
        fd = os.open(f"/proc/{pid}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, ARGV_MAX)
        finally:
            os.close(fd)
        argv = [x.decode(errors="replace") for x in raw.split(b"\0")]
        if argv and argv[-1] == "":
            argv.pop()
    except OSError:
        pass
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    return argv, exe


class Supervisor:
    """One answering thread and one recording thread for every sandbox of this process.

    ``attach(sock, audit, opts)`` takes the supervisor's end of the socket the in-sandbox
    helper sends its listener on (owned from then on) and returns at once; the listener is
    picked up when it arrives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list = []  # (sock, audit, classifier) to register on the answering thread
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._q: queue.Queue = queue.Queue(QUEUE_MAX)
        self._classifiers: dict[str, Classifier] = {}
        self._stop = False
        self._busy = 0  # notifications received and not yet queued (answering thread)
        self._drop = threading.Event()
        self._stop_on_drop = True
        self._dropped_all = threading.Event()
        self._answer = threading.Thread(target=self._answer_loop, name="agentvm-sysaudit-answer", daemon=True)
        self._record = threading.Thread(target=self._record_loop, name="agentvm-sysaudit-record", daemon=True)
        self._answer.start()
        self._record.start()

    # -- public -------------------------------------------------------------------------
    def classifier(self, opts: sc.SeccompOptions) -> Classifier:
        key = opts.key()
        with self._lock:
            c = self._classifiers.get(key)
            if c is None:
                c = self._classifiers[key] = Classifier(opts)
            return c

    def attach(self, sock: socket.socket, audit: SandboxAudit, opts: sc.SeccompOptions) -> None:
        c = self.classifier(opts)
        sock.setblocking(False)
        with self._lock:
            self._pending.append((sock, audit, c))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def drop_all(self, timeout: float = 5.0, *, stop_sandboxes: bool = True) -> bool:
        """Close every listener at once. A sandbox is not left running with notify rules and no
        listener: each one with a listener is stopped (``kill``) or else frozen first.
        ``stop_sandboxes=False`` closes the listeners alone - what the kernel does when this
        process dies (tests prove the sandbox stays confined then: ENOSYS, and no listener of
        its own, see ``seccomp:seccomp-listener``)."""
        self._stop_on_drop = stop_sandboxes
        self._dropped_all.clear()
        self._drop.set()
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        return self._dropped_all.wait(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        """Until every record taken so far has reached its sinks (tests, teardown)."""
        deadline = time.monotonic() + timeout
        while (self._busy or self._q.unfinished_tasks) and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- answering thread ---------------------------------------------------------------
    def _answer_loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        socks: dict[int, tuple] = {}  # fd -> (sock, audit, classifier): waiting for a listener
        listeners: dict[int, tuple] = {}  # fd -> (audit, classifier)
        paused: dict[int, float] = {}  # listener fd -> when it is polled again (its sandbox's budget is spent)
        notif = _Notif()
        resp = _NotifResp()
        while not self._stop:
            wait = 1000
            if paused:
                wait = max(0, min(1000, int((min(paused.values()) - time.monotonic()) * 1000) + 1))
            try:
                events = poller.poll(wait)
            except InterruptedError:
                continue
            if paused:
                now = time.monotonic()
                for fd, until in list(paused.items()):
                    if now >= until:
                        del paused[fd]
                        if fd in listeners:
                            poller.register(fd, select.POLLIN)
            if self._drop.is_set():
                if self._stop_on_drop:
                    for audit in {id(a): a for a, _c in listeners.values()}.values():
                        _stop_sandbox(audit)
                for fd in list(listeners):
                    if fd not in paused:
                        poller.unregister(fd)
                    audit = listeners.pop(fd)[0]
                    audit.listeners -= 1
                    os.close(fd)
                    if not audit.listeners:
                        self._flush_capped(audit)
                paused.clear()
                for fd in list(socks):
                    poller.unregister(fd)
                    socks.pop(fd)[0].close()
                self._drop.clear()
                self._dropped_all.set()
            for fd, ev in events:
                if fd not in socks and fd not in listeners and fd != self._wake_r:
                    continue
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        pending, self._pending = self._pending, []
                    for sock, audit, c in pending:
                        socks[sock.fileno()] = (sock, audit, c)
                        poller.register(sock.fileno(), select.POLLIN)
                elif fd in socks:
                    sock, audit, c = socks.pop(fd)
                    poller.unregister(fd)
                    lfd = _recv_listener(sock)
                    sock.close()
                    if lfd is not None:
                        listeners[lfd] = (audit, c)
                        audit.listeners += 1
                        poller.register(lfd, select.POLLIN)
                elif fd in listeners and fd not in paused:
                    audit, c = listeners[fd]
                    if ev & select.POLLIN:
                        self._busy += 1
                        try:
                            until = self._one(fd, audit, c, notif, resp)
                        finally:
                            self._busy -= 1
                        if until is not None:
                            # its budget for this second is spent: its listeners wait (its calls
                            # stay pending in the kernel); never closed, see the module doc
                            for lfd, (a, _c) in listeners.items():
                                if a is audit and lfd not in paused:
                                    poller.unregister(lfd)
                                    paused[lfd] = until
                            continue
                    if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) and not ev & select.POLLIN:
                        # every task under this filter is gone (the only time a listener is
                        # closed while the supervisor lives: never on a flood, see the module doc)
                        poller.unregister(fd)
                        del listeners[fd]
                        audit.listeners -= 1
                        os.close(fd)
                        if not audit.listeners:
                            self._flush_capped(audit)

    def _one(self, fd: int, audit: SandboxAudit, c: Classifier, notif: _Notif, resp: _NotifResp) -> float | None:
        """Receive and answer one notification. Returns None, or (its sandbox's budget for this
        second spent) when its listeners may be polled again."""
        ctypes.memset(ctypes.byref(notif), 0, ctypes.sizeof(notif))
        if _ioctl(fd, IOCTL_RECV, ctypes.byref(notif)) < 0:
            return None  # ENOENT: the caller died (or was interrupted) in between
        now = time.monotonic()
        args = tuple(notif.data.args)
        v = c.classify(notif.data.nr, args)
        # the flood valve: FLOOD_PER_SEC answers per sandbox per second on this shared thread;
        # the one that spends the budget pauses its listeners until the second is over (the
        # caller's answer is sent first). The listener is NEVER closed here: without it the
        # kernel forgets the listener (see the module doc).
        sec = audit._second
        if now - sec[0] >= 1.0:
            sec[0], sec[1] = now, 0
        sec[1] += 1
        until = sec[0] + 1.0 if sec[1] >= FLOOD_PER_SEC else None
        if sec[1] > FLOOD_PER_SEC:  # (another listener of the same sandbox in the same round)
            self._answer_only(fd, audit, v, notif, resp)
            return until
        if sec[1] == FLOOD_PER_SEC:
            audit.flooded += 1
            if self._may_record(audit, now, call=False):
                self._put(audit, {
                    "kind": "syscall.audit-flood", "time": time.time(), "sandbox": audit.sandbox_id,
                    "agent": audit.agent, "pid": notif.pid, "syscall": v.syscall, "rule": v.rule, "alert": True,
                    "reason": f"{FLOOD_PER_SEC} notified syscalls in one second: the sandbox's further calls wait in "
                              "the kernel until the second is over, then are refused as ever (their errno)"})
        decoded = decode_args(v.syscall, args)
        key = (notif.pid, v.syscall, v.rule, tuple(sorted(decoded.items())))
        last = audit._repeat.get(key)
        folded = last is not None and now - last[0] < REPEAT_WINDOW
        if not folded and not self._may_record(audit, now):
            # past RECORDS_PER_MIN: answered as ever, counted, summed up in one record later
            self._answer_only(fd, audit, v, notif, resp)
            return until
        argv: list[str] = []
        exe = ""
        verified = False
        if not folded:
            argv, exe = _read_proc(notif.pid)
            nid = ctypes.c_uint64(notif.id)
            # still the same, still-blocked caller after the reads: the pid was not reused
            verified = _ioctl(fd, IOCTL_ID_VALID, ctypes.byref(nid)) == 0
        resp.id = notif.id
        resp.val = 0
        if v.action == "watch":
            resp.error, resp.flags = 0, FLAG_CONTINUE
        else:
            resp.error, resp.flags = -v.errno, 0
        _ioctl(fd, IOCTL_SEND, ctypes.byref(resp))  # ENOENT: the caller is gone; nothing to answer
        with _metric_lock:
            (_watched_by_syscall if v.action == "watch" else _denied_by_syscall)[v.syscall] += 1
        if v.action == "watch":
            audit.watched += 1
        else:
            audit.denied += 1
            if act_due(audit):
                # off this thread: a kill waits for the processes to go, and answers must not
                threading.Thread(target=act, args=(audit, v.rule), name="agentvm-sysaudit-act", daemon=True).start()
        if folded:
            last[1] += 1
            audit.suppressed += 1
            return until
        if len(audit._repeat) > 4096:
            audit._repeat.clear()
        audit._repeat[key] = [now, 0]
        rec = {
            "kind": "syscall.denied" if v.action == "deny" else "syscall.watched",
            "time": time.time(), "sandbox": audit.sandbox_id, "agent": audit.agent,
            "pid": notif.pid, "exe": exe, "argv": argv, "verified": verified,
            "syscall": v.syscall, "nr": notif.data.nr, "args": decoded, "rule": v.rule,
            "errno": _errno.errorcode.get(v.errno, str(v.errno)) if v.action == "deny" else None,
            "repeats": last[1] if last else 0,
        }
        self._put(audit, rec)
        return until

    def _may_record(self, audit: SandboxAudit, now: float, call: bool = True) -> bool:
        """One more record of ``audit`` this minute? (RECORDS_PER_MIN; answering thread.) A
        ``call``'s record refused is counted for the summary."""
        m = audit._minute
        if now - m[0] >= 60.0:
            self._flush_capped(audit)
            m[0], m[1] = now, 0
        if m[1] < RECORDS_PER_MIN:
            m[1] += 1
            return True
        if call:
            m[2] += 1
        return False

    def _flush_capped(self, audit: SandboxAudit) -> None:
        """The one record for the calls the record cap left unrecorded (if any)."""
        n, audit._minute[2] = audit._minute[2], 0
        if n:
            self._put(audit, {
                "kind": "syscall.audit-capped", "time": time.time(), "sandbox": audit.sandbox_id,
                "agent": audit.agent, "alert": True, "suppressed": n,
                "reason": f"more than {RECORDS_PER_MIN} syscall records in one minute: {n} more calls were refused "
                          "as ever (their errno) and counted, not recorded one by one"})

    def _answer_only(self, fd: int, audit: SandboxAudit, v: Verdict, notif: _Notif, resp: _NotifResp) -> None:
        """Past the record cap: answer as ever, count, record nothing (no /proc reads)."""
        resp.id = notif.id
        resp.val = 0
        if v.action == "watch":
            resp.error, resp.flags = 0, FLAG_CONTINUE
        else:
            resp.error, resp.flags = -v.errno, 0
        _ioctl(fd, IOCTL_SEND, ctypes.byref(resp))
        with _metric_lock:
            (_watched_by_syscall if v.action == "watch" else _denied_by_syscall)[v.syscall] += 1
        audit.suppressed += 1
        if v.action == "watch":
            audit.watched += 1
        else:
            audit.denied += 1
            if act_due(audit):
                threading.Thread(target=act, args=(audit, v.rule), name="agentvm-sysaudit-act", daemon=True).start()

    def _put(self, audit: SandboxAudit, rec: dict) -> None:
        try:
            self._q.put_nowait((audit, rec))
        except queue.Full:
            with _metric_lock:
                _dropped[0] += 1

    # -- recording thread ---------------------------------------------------------------
    def _record_loop(self) -> None:
        while True:
            audit, rec = self._q.get()
            try:
                deliver(audit, rec)
            except Exception:  # noqa: BLE001 - a sink must never stop the audit
                pass
            finally:
                self._q.task_done()


def deliver(audit: SandboxAudit, rec: dict) -> None:
    """Hand ``rec`` to the sandbox's sinks (an alert unless ``security.onEscapeProbe: log``)."""
    if rec["kind"] == "syscall.denied" and audit.on_probe != "log":
        rec["alert"] = True
    for s in list(audit.sinks):
        try:
            s(rec)
        except Exception:  # noqa: BLE001
            pass


def act_due(audit: SandboxAudit) -> bool:
    """Whether ``security.onEscapeProbe`` pause/stop must act now (once per sandbox). Counts
    every denied call, the folded repeats included."""
    if audit.on_probe not in ("pause", "stop") or audit._act_started or audit.denied < audit.threshold:
        return False
    audit._act_started = True
    return True


def act(audit: SandboxAudit, rule: str | None = None) -> dict:
    """Pause (freeze the cgroup) or stop (kill) the sandbox; the record of it goes to the sinks."""
    how = audit.freeze if audit.on_probe == "pause" else audit.kill
    ok = False
    if how is not None:
        try:
            how()
            ok = True
        except Exception:  # noqa: BLE001
            ok = False
    word = "paused" if audit.on_probe == "pause" else "stopped"
    audit.acted = word if ok else "failed"
    rec = {"kind": "syscall.probe-" + word, "time": time.time(), "sandbox": audit.sandbox_id, "agent": audit.agent,
           "alert": True, "ok": ok, "denied": audit.denied, "threshold": audit.threshold, "rule": rule,
           "reason": f"{audit.denied} denied escape probes (security.onEscapeProbe: {audit.on_probe})"}
    deliver(audit, rec)
    return rec


def _stop_sandbox(audit: SandboxAudit) -> None:
    """Before the supervisor lets go of a live sandbox's listener: kill it (or else freeze it)."""
    for how in (audit.kill, audit.freeze):
        if how is None:
            continue
        try:
            how()
        except Exception:  # noqa: BLE001 - try the next way
            continue
        audit.acted = "stopped" if how is audit.kill else "paused"
        deliver(audit, {"kind": "syscall.audit-released", "time": time.time(), "sandbox": audit.sandbox_id,
                        "agent": audit.agent, "alert": True, "action": audit.acted,
                        "reason": "the syscall supervisor let go of the sandbox's listener: the sandbox was "
                                  + audit.acted})
        return


def _recv_listener(sock: socket.socket) -> int | None:
    """The listener fd the helper sent (one byte + SCM_RIGHTS), or None (EOF: it died first)."""
    try:
        msg, anc, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(4 * 4))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return None
    fds: list[int] = []
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            n = len(data) // 4
            fds += list(memoryview(data)[: n * 4].cast("i"))
    if msg != b"L" or len(fds) != 1:
        for f in fds:
            os.close(f)
        return None
    os.set_inheritable(fds[0], False)
    return fds[0]


_SUP: Supervisor | None = None
_SUP_LOCK = threading.Lock()


def supervisor() -> Supervisor:
    """The process's supervisor (started on first use)."""
    global _SUP
    with _SUP_LOCK:
        if _SUP is None:
            _SUP = Supervisor()
        return _SUP


def handoff_pair() -> tuple[socket.socket, int]:
    """(the supervisor's end, the fd for ``agentvm-helper init --sysaudit-fd``). The helper's end
    is close-on-exec here: the caller passes it to the one child that needs it."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fd = b.detach()
    return a, fd


# ------------------------------------------------------------------ sinks


def jsonl_sink(path: Path) -> Sink:
    """Append each record as one JSON line (``<home>/logs/<sandbox>.syscalls.jsonl``, 0600)."""
    lock = threading.Lock()

    def sink(rec: dict) -> None:
        line = (json.dumps(rec, sort_keys=True, default=str) + "\n").encode()
        with lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    return sink


def audit_sink(log, *, actor: str = "agentvm") -> Sink:
    """Each record on the audit chain (``AuditLog.append``), as kind ``syscall.denied`` etc.
    The daemon / embedded run adds it with :func:`add_sink` (see docs/syscall-audit.md)."""

    def sink(rec: dict) -> None:
        data = {k: v for k, v in rec.items() if k not in ("kind", "sandbox", "time")}
        log.append(rec["kind"], actor=actor, sandbox=rec.get("sandbox"), data=data)

    return sink


def trace_sink(session_trace) -> Sink:
    """Each record as a span (``SessionTrace.span``) named after the syscall, with the record's
    fields as attributes - the trace's event for the attempt."""

    def sink(rec: dict) -> None:
        t = float(rec.get("time") or time.time())
        attrs = {"agentvm.syscall": rec.get("syscall") or "", "agentvm.rule": rec.get("rule") or "",
                 "agentvm.errno": rec.get("errno") or "", "agentvm.pid": int(rec.get("pid") or 0),
                 "agentvm.exe": rec.get("exe") or "", "agentvm.argv": " ".join(rec.get("argv") or [])[:512],
                 "agentvm.args": json.dumps(rec.get("args") or {}, sort_keys=True)}
        session_trace.span(rec["kind"], t, t, attributes=attrs)

    return sink


_FACTORIES: list = []


def register_sink_factory(factory: Callable[[str], Sink | None]) -> Callable[[], None]:
    """``factory(sandbox_id) -> sink | None`` is called for every sandbox this process launches
    from now on, before its first syscall can be recorded (the daemon registers the audit
    chain, the event stream and the trace once at start-up). Returns the unregister function."""
    _FACTORIES.append(factory)
    return lambda: _FACTORIES.remove(factory) if factory in _FACTORIES else None


def sinks_for(sandbox_id: str) -> list:
    """The registered factories' sinks for a new sandbox (a failing factory is skipped)."""
    out = []
    for f in list(_FACTORIES):
        try:
            s = f(sandbox_id)
        except Exception:  # noqa: BLE001 - a broken factory must not stop a launch
            s = None
        if s is not None:
            out.append(s)
    return out


def add_sink(audit: SandboxAudit | None, sink: Sink) -> None:
    """Add ``sink`` to a running sandbox's audit (``handle.private["sysaudit"]``)."""
    if audit is not None:
        audit.sinks.append(sink)


# ------------------------------------------------------------------ pause / stop helpers


def freezer(group) -> Callable[[], None] | None:
    """A function freezing ``group`` (cgroups.SandboxCgroup): cgroup v2 ``cgroup.freeze`` or
    the v1 freezer; None when neither exists."""
    if group is None:
        return None
    if callable(getattr(group, "freeze", None)):
        # the backends' own pause (waits until the kernel reports the group frozen, never
        # half-frozen): the operator's unpause/resume thaws it the usual way
        return group.freeze
    v2 = getattr(group, "kill_dir", None)
    v1 = getattr(group, "freezer_dir", None)
    if v2 is not None and (Path(v2) / "cgroup.freeze").exists():
        return lambda: Path(v2, "cgroup.freeze").write_text("1")
    if v1 is not None:
        return lambda: Path(v1, "freezer.state").write_text("FROZEN")
    return None


def thaw(group) -> None:
    """Undo :func:`freezer` (the operator's resume)."""
    if callable(getattr(group, "thaw", None)):
        group.thaw()
        return
    v2 = getattr(group, "kill_dir", None)
    v1 = getattr(group, "freezer_dir", None)
    if v2 is not None and (Path(v2) / "cgroup.freeze").exists():
        Path(v2, "cgroup.freeze").write_text("0")
    if v1 is not None:
        Path(v1, "freezer.state").write_text("THAWED")


# ------------------------------------------------------------------ reading the log


def read_log(path: Path) -> list[dict]:
    """The records of a ``.syscalls.jsonl`` (a torn last line is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def log_path(home: Path, sandbox_id: str) -> Path:
    return Path(home) / "logs" / f"{sandbox_id}.syscalls.jsonl"
