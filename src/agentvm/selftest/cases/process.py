"""Processes and the kernel: the seccomp deny list, ptrace and memory of other processes,
the 32-bit syscall ABI, terminal injection, and reaching processes outside the sandbox.

Each seccomp case calls the syscall with arguments that the kernel *serves* for an
unprivileged process when no filter is loaded (a new fd, a key serial, a copied byte...), so
``EPERM`` is the filter's answer and anything else is evidence that the call reached the
kernel's implementation. The programs are Python with ctypes (no compiler needed).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

from agentvm.selftest.framework import Env, Verdict, case

# syscall numbers of the native ABI (only what these cases call)
_NR = {
    "x86_64": {"io_uring_setup": 425, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "bpf": 321,
               "userfaultfd": 323, "name_to_handle_at": 303, "open_by_handle_at": 304, "kcmp": 312,
               "process_vm_readv": 310, "pidfd_open": 434},
    "aarch64": {"io_uring_setup": 425, "perf_event_open": 241, "keyctl": 219, "add_key": 217, "bpf": 280,
                "userfaultfd": 282, "name_to_handle_at": 264, "open_by_handle_at": 265, "kcmp": 272,
                "process_vm_readv": 270, "pidfd_open": 434},
}


def nr_table() -> dict[str, int]:
    return _NR.get(os.uname().machine, _NR["x86_64"])


# Prepended to every ctypes program: `sc(name, *args) -> (rc, "OK" | errno name)` and
# `rep(label, rc_err)` printing "label rc ERR".
PRELUDE = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = %r
def sc(name, *args):
    a = [ctypes.c_long(x) if isinstance(x, int) else x for x in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NR[name]), *a)
    return r, ("OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno())))
def rep(label, res):
    print(label, res[0], res[1], flush=True)
"""


def program(body: str) -> str:
    return PRELUDE % (nr_table(),) + body


def table(text: str) -> dict[str, list[str]]:
    """``label v1 v2...`` lines -> {label: [v1, v2...]} (the last line of a label wins)."""
    out: dict[str, list[str]] = {}
    for ln in text.splitlines():
        parts = ln.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def _seccomp_verdict(env: Env, o, what: str, labels: tuple[str, ...]) -> Verdict:
    res = table(o.stdout)
    served = {k: res[k] for k in labels if k in res and len(res[k]) >= 2 and res[k][1] == "OK"}
    if served:
        return Verdict.escaped(f"{what}: served by the kernel: " + ", ".join(f"{k} -> {' '.join(v)}" for k, v in served.items()))
    got = {k: res.get(k) for k in labels}
    if any(v is None for v in got.values()):
        return Verdict.error(f"{what}: the program did not report every call: {o.out.strip()[-400:]}")
    return Verdict.contained(f"{what}: " + ", ".join(f"{k} -> {' '.join(v)}" for k, v in got.items()))


# ------------------------------------------------------------------------ seccomp groups


@case("proc.io-uring", "process", "io_uring_setup: create an io_uring (the largest unprivileged kernel attack surface)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program("""
params = ctypes.create_string_buffer(120)
rep("io_uring_setup", sc("io_uring_setup", 4, params))
""")
    return _seccomp_verdict(env, env.sandbox(code, lang="python", egress=False), "io_uring", ("io_uring_setup",))


@case("proc.bpf", "process", "bpf(): reach the eBPF syscall (map creation, and a bogus command the kernel must parse)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    # BPF_MAP_CREATE is also refused by kernel.unprivileged_bpf_disabled on most hosts; an
    # unknown command is answered EINVAL by the kernel's bpf() itself when no filter is loaded
    code = program("""
attr = ctypes.create_string_buffer(72)
ctypes.memmove(attr, (ctypes.c_uint * 4)(2, 4, 4, 1), 16)  # ARRAY map, 4-byte key/value, 1 entry
r = sc("bpf", 0, attr, 72)
rep("bpf_map_create", r)
r = sc("bpf", 999, attr, 72)
print("bpf_unknown_cmd", r[0], "OK" if r[1] == "EINVAL" else r[1], "(kernel-answered-EINVAL)" if r[1] == "EINVAL" else "")
""")
    return _seccomp_verdict(env, env.sandbox(code, lang="python", egress=False), "bpf", ("bpf_map_create", "bpf_unknown_cmd"))


@case("proc.perf-event", "process", "perf_event_open: a software counter on itself (perf is a frequent LPE vector)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program("""
attr = ctypes.create_string_buffer(136)
ctypes.memmove(attr, (ctypes.c_uint * 2)(1, 136), 8)          # PERF_TYPE_SOFTWARE, size; config 0 = CPU_CLOCK
ctypes.memmove(ctypes.addressof(attr) + 40, ctypes.byref(ctypes.c_ulonglong((1 << 5) | (1 << 6))), 8)  # exclude_kernel|hv
rep("perf_event_open", sc("perf_event_open", attr, 0, -1, -1, 0))
""")
    return _seccomp_verdict(env, env.sandbox(code, lang="python", egress=False), "perf", ("perf_event_open",))


@case("proc.keyring", "process", "add_key/keyctl: store a key in the kernel keyring and read it back",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program("""
r = sc("add_key", b"user", b"selftest-key", b"KEYRING-PAYLOAD", 15, -3)  # KEY_SPEC_SESSION_KEYRING
rep("add_key", r)
buf = ctypes.create_string_buffer(64)
if r[0] > 0:
    rr = sc("keyctl", 11, r[0], buf, 64)  # KEYCTL_READ
    rep("keyctl_read", rr); print("payload", buf.value.decode(errors="replace"))
else:
    rep("keyctl_get_keyring_id", sc("keyctl", 0, -3, 0))
""")
    o = env.sandbox(code, lang="python", egress=False)
    if "payload KEYRING-PAYLOAD" in o.stdout:
        return Verdict.escaped("a key was stored in and read back from the kernel keyring: " + "; ".join(o.stdout.split("\n"))[-200:])
    return _seccomp_verdict(env, o, "keyring", ("add_key", "keyctl_get_keyring_id"))


@case("proc.userfaultfd", "process", "userfaultfd: the page-fault handler used to win kernel races",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program("""
rep("userfaultfd", sc("userfaultfd", 1))  # UFFD_USER_MODE_ONLY: allowed unprivileged when unfiltered
""")
    return _seccomp_verdict(env, env.sandbox(code, lang="python", egress=False), "userfaultfd", ("userfaultfd",))


@case("proc.netlink-families", "process", "netlink sockets other than ROUTE (uevent, sock_diag) and AF_VSOCK (the VM host channel)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    # only socket(): nothing is sent, and the vsock is never connected
    code = """
import socket, errno
def tryit(label, fam, typ, proto):
    try:
        s = socket.socket(fam, typ, proto); print(label, s.fileno(), "OK"); s.close()
    except OSError as e:
        print(label, -1, errno.errorcode.get(e.errno, e.errno))
tryit("netlink_uevent", socket.AF_NETLINK, socket.SOCK_DGRAM, 15)
tryit("netlink_sock_diag", socket.AF_NETLINK, socket.SOCK_DGRAM, 4)
tryit("vsock", 40, socket.SOCK_STREAM, 0)
tryit("CONTROL_netlink_route", socket.AF_NETLINK, socket.SOCK_DGRAM, 0)
"""
    o = env.sandbox(code, lang="python", egress=False)
    if table(o.stdout).get("CONTROL_netlink_route", ["", ""])[1] != "OK":
        return Verdict.error("control failed: a NETLINK_ROUTE socket was refused: " + o.out[-300:])
    return _seccomp_verdict(env, o, "sockets", ("netlink_uevent", "netlink_sock_diag", "vsock"))


@case("proc.socket-family-high-bits", "process",
      "socket() with bits 32-63 of the family set (the kernel reads an int and drops them): AF_VSOCK, AF_PACKET, "
      "AF_KEY, netlink uevent/audit", weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
NR_SOCKET = %d
def tryit(label, fam, typ, proto):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NR_SOCKET), ctypes.c_long(fam | (1 << 32)), ctypes.c_long(typ), ctypes.c_long(proto))
    if r >= 0:
        os.close(r); print(label, r, "OK")
    else:
        print(label, r, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
tryit("vsock_hi", 40, 1, 0)
tryit("packet_hi", 17, 3, 0)
tryit("af_key_hi", 15, 3, 2)
tryit("netlink_uevent_hi", 16, 2, 15)
tryit("netlink_audit_hi", 16, 3, 9)
tryit("CONTROL_netlink_route_hi", 16, 3, 0)
""" % ({"aarch64": 198}.get(os.uname().machine, 41),)
    o = env.sandbox(code, lang="python", egress=False)
    if table(o.stdout).get("CONTROL_netlink_route_hi", ["", ""])[1] != "OK":
        return Verdict.error("control failed: a NETLINK_ROUTE socket (family with bit 32 set) was refused: " + o.out[-300:])
    return _seccomp_verdict(env, o, "sockets with bits 32-63 set",
                            ("vsock_hi", "packet_hi", "af_key_hi", "netlink_uevent_hi", "netlink_audit_hi"))


@case("proc.int80-32bit-abi", "process", "a 32-bit syscall through int $0x80 (bypasses filters written for the native ABI)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    if os.uname().machine != "x86_64":
        return Verdict.error("int $0x80 exists only on x86_64")
    # machine code in an executable page: mov eax, 20 (i386 getpid); int 0x80; ret
    code = """
import ctypes, mmap, os
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(b"\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3")
fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print("before", os.getpid(), flush=True)
r = fn()
print("SURVIVED", r, flush=True)
"""
    o = env.sandbox(code, lang="python", egress=False)
    t = table(o.stdout)
    if "before" not in t:
        return Verdict.error("the program did not start: " + o.out[-300:])
    if "SURVIVED" in t:
        if t["SURVIVED"][0] == t["before"][0]:
            return Verdict.escaped(f"i386 getpid via int $0x80 was served: returned {t['SURVIVED'][0]} (pid {t['before'][0]})")
        # not the i386 table: the call went through the native one (gVisor's Sentry does
        # this), where the native filter applies - no way around it
        return Verdict.contained(f"int $0x80 is not the i386 ABI here: i386 getpid returned {t['SURVIVED'][0]}, not the "
                                 f"pid {t['before'][0]} (served as native syscall 20 under the native filter)")
    return Verdict.contained(f"killed at the 32-bit syscall: exit {o.exit_code} (128+SIGSYS=159), {o.stderr.strip()[-80:]}")


@case("proc.tiocsti", "process", "TIOCSTI: push keystrokes into a terminal's input queue (its controlling tty)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = """
import ctypes, errno, fcntl, os, pty, termios, select
libc = ctypes.CDLL(None, use_errno=True)
m, s = pty.openpty()
pid = os.fork()
if pid == 0:
    os.setsid()
    fcntl.ioctl(s, termios.TIOCSCTTY, 0)  # make the pty our controlling terminal
    ok = 0
    for ch in b"id\\n":
        rc = libc.ioctl(s, ctypes.c_ulong(0x5412), ctypes.byref(ctypes.c_char(ch)))
        if rc != 0:
            print("tiocsti -1", errno.errorcode.get(ctypes.get_errno()), flush=True); os._exit(1)
    print("tiocsti 0 OK", flush=True); os._exit(0)
os.waitpid(pid, 0)
attrs = termios.tcgetattr(s); attrs[3] &= ~termios.ICANON; termios.tcsetattr(s, termios.TCSANOW, attrs)
r, _, _ = select.select([s], [], [], 0.3)
print("injected", (os.read(s, 64) if r else b"").decode(errors="replace").strip() or "-", flush=True)
"""
    o = env.sandbox(code, lang="python", egress=False)
    t = table(o.stdout)
    if t.get("tiocsti", ["", ""])[1] == "OK" or t.get("injected", ["-"])[0] != "-":
        return Verdict.escaped(f"TIOCSTI injected input into the terminal: read back {t.get('injected')}")
    return _seccomp_verdict(env, o, "TIOCSTI", ("tiocsti",))


# ------------------------------------------------------------------------ ptrace and memory


SIBLING_SECRET = """
secret = "SIBLING-SECRET-" + os.urandom(8).hex()
buf = ctypes.create_string_buffer(secret.encode())
addr = ctypes.addressof(buf)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r); os.write(w, b"x"); os.close(w)
    import time
    time.sleep(10)
    os._exit(0)
os.close(w); os.read(r, 1)
"""


@case("proc.ptrace-sibling", "process", "ptrace another process of the sandbox and read its memory (PEEKDATA)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program(SIBLING_SECRET + """
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ctypes.set_errno(0)
rc = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
print("attach", rc, "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()), flush=True)
if rc == 0:
    os.waitpid(pid, 0)
    data = b""
    for off in range(0, len(secret), 8):
        ctypes.set_errno(0)
        word = libc.ptrace(2, pid, ctypes.c_void_p(addr + off), None)  # PTRACE_PEEKDATA
        data += (word & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    print("peeked", data[:len(secret)].decode(errors="replace") == secret, flush=True)
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
os.kill(pid, 9); os.waitpid(pid, 0)
""")
    o = env.sandbox(code, lang="python", egress=False)
    t = table(o.stdout)
    if t.get("peeked") == ["True"]:
        return Verdict.escaped("attached to a sibling with PTRACE_ATTACH and read its secret with PTRACE_PEEKDATA")
    return _seccomp_verdict(env, o, "ptrace", ("attach",))


@case("proc.process-vm-readv", "process", "process_vm_readv: copy another process's memory without ptrace-stopping it",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    code = program(SIBLING_SECRET + """
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
out = ctypes.create_string_buffer(len(secret))
local = iovec(ctypes.addressof(out), len(secret)); remote = iovec(addr, len(secret))
r = sc("process_vm_readv", pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
rep("process_vm_readv", r)
print("copied", out.raw.decode(errors="replace") == secret, flush=True)
os.kill(pid, 9); os.waitpid(pid, 0)
""")
    o = env.sandbox(code, lang="python", egress=False)
    if table(o.stdout).get("copied") == ["True"]:
        return Verdict.escaped("process_vm_readv copied a secret out of another process's memory")
    return _seccomp_verdict(env, o, "process_vm_readv", ("process_vm_readv",))


@case("proc.ptrace-pid1", "process", "ptrace pid 1 (bwrap, outside the Landlock domain) of the sandbox",
      weakened_by="no-seccomp+no-landlock")
def _(env: Env) -> Verdict:
    code = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ctypes.set_errno(0)
rc = libc.ptrace(0x4206, 1, None, None)  # PTRACE_SEIZE: attaches without stopping the tracee
print("seize_pid1", rc, "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()), flush=True)
if rc == 0:
    libc.ptrace(17, 1, None, None)  # PTRACE_DETACH (best effort: a seized, running tracee just loses us at exit)
"""
    return _seccomp_verdict(env, env.sandbox(code, lang="python", egress=False, timeout=10), "ptrace pid 1", ("seize_pid1",))


_PID1_IS_THE_AGENT = ("pid 1 is the agent's own first process (init execs the command; runsc, the gofer and the "
                      "Sentry are host processes outside the sandbox's pid namespace); the one agent-vm process "
                      "inside, the egress bridge, is attacked by proc.bridge-hijack")


@case("proc.pid1-memory", "process", "read pid 1's memory (/proc/1/mem) for the launcher's host paths",
      weakened_by="no-landlock", not_on={"gvisor": _PID1_IS_THE_AGENT})
def _(env: Env) -> Verdict:
    code = """
import os, re, errno
found = set(); opened = "no"
try:
    maps = open("/proc/1/maps").read().splitlines()
    mem = open("/proc/1/mem", "rb", buffering=0); opened = "yes"
    for ln in maps:
        rng, perms = ln.split()[:2]
        if "r" not in perms or not ("[heap]" in ln or "[stack]" in ln or len(ln.split()) < 6):
            continue
        a, b = (int(x, 16) for x in rng.split("-"))
        try:
            mem.seek(a); data = mem.read(min(b - a, 8 << 20))
        except OSError:
            continue
        for m in re.finditer(rb"/(?:tmp|var|run|home|root|srv)/[A-Za-z0-9._/-]{6,200}", data):
            found.add(m.group().decode())
except OSError as e:
    print("denied", errno.errorcode.get(e.errno))
print("opened", opened)
for p in sorted(found)[:40]:
    print("path", p)
"""
    o = env.sandbox(code, lang="python", egress=False)
    paths = [ln[5:] for ln in o.stdout.splitlines() if ln.startswith("path ")]
    host = [p for p in paths if str(env.root) in p]
    if host:
        return Verdict.escaped(f"pid 1's memory disclosed {len(host)} host path(s) of agent-vm's state, e.g. {host[0]}")
    if "opened yes" in o.stdout:
        return Verdict.escaped(f"opened /proc/1/mem of the sandbox's pid 1 (no host path found in {len(paths)} strings)")
    return Verdict.contained("/proc/1/mem: " + o.stdout.strip()[-200:])


# ------------------------------------------------------------------------ signals and other processes


@case("proc.bridge-hijack", "process",
      "ptrace the egress bridge (agent-vm's relay inside the sandbox, started before the agent's filter) or "
      "open its memory, with ptrace allowed to the agent (allowPtrace, L4)",
      weakened_by="no-landlock+weak-bridge")
def _(env: Env) -> Verdict:
    code = r"""
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
found = []
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == me:
        continue
    pid = int(p)
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        continue
    r = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    e = ctypes.get_errno()
    if r == 0:
        libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
    try:
        open(f"/proc/{pid}/mem", "rb").close(); mem = "OK"
    except OSError as x:
        mem = errno.errorcode.get(x.errno)
    found.append(pid)
    print("PROC", pid, cmd, "attach", "OK" if r == 0 else errno.errorcode.get(e), "mem", mem)
print("SEEN", len(found))
"""
    o = env.sandbox(code, lang="python", allow_ptrace=True)
    lines = [ln for ln in o.stdout.splitlines() if ln.startswith("PROC")]
    if "SEEN" not in o.stdout:
        return Verdict.error("the program did not run: " + o.out[-300:])
    if not any("/.agentvm/init" in ln for ln in lines):
        return Verdict.error("the bridge was not found among the sandbox's processes: " + o.stdout[-400:])
    # the bridge only (pid 1 under bwrap is proc.pid1-memory's and proc.signal-pid1's)
    won = [ln for ln in lines if "/.agentvm/init" in ln and (" attach OK" in ln or ln.endswith(" mem OK"))]
    if won:
        return Verdict.escaped("the agent can take over the bridge, outside its filter: " + "; ".join(won)[:400])
    return Verdict.contained("the bridge refused ptrace and /proc/PID/mem: " + "; ".join(lines)[:400])


@case("proc.signal-pid1", "process", "signal pid 1 (bwrap), a process outside the sandbox's Landlock signal scope",
      weakened_by="no-landlock", not_on={"gvisor": _PID1_IS_THE_AGENT})
def _(env: Env) -> Verdict:
    code = """
import os, signal, errno
for label, sig in (("probe", 0), ("sigcont", signal.SIGCONT)):
    try:
        os.kill(1, sig); print(label, 0, "OK")
    except OSError as e:
        print(label, -1, errno.errorcode.get(e.errno))
try:
    os.kill(os.getpid(), 0); print("CONTROL_self 0 OK")
except OSError as e:
    print("CONTROL_self -1", errno.errorcode.get(e.errno))
"""
    o = env.sandbox(code, lang="python", egress=False)
    if table(o.stdout).get("CONTROL_self", ["", ""])[1] != "OK":
        return Verdict.error("control failed: " + o.out[-300:])
    return _seccomp_verdict(env, o, "signal pid 1", ("probe", "sigcont"))


@case("proc.see-host-processes", "process", "list the host's processes and read their command lines",
      weakened_by="no-pidns")
def _(env: Env) -> Verdict:
    marker = "selftest-hostproc-" + secrets.token_hex(6)
    host = subprocess.Popen([marker, "20"], executable="/bin/sleep", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.05)
        code = """
import os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
print("nprocs", len(pids))
for p in pids:
    try:
        cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if "selftest-hostproc-" in cmd:
        print("SEEN", p, cmd.strip())
"""
        o = env.sandbox(code, lang="python", egress=False)
    finally:
        host.kill()
        host.wait()
    seen = [ln for ln in o.stdout.splitlines() if ln.startswith("SEEN") and marker in ln]
    if seen:
        return Verdict.escaped(f"a host process (pid {host.pid}) was visible with its command line: {seen[0]}")
    return Verdict.contained(f"host process {host.pid} ({marker}) not visible; " + o.stdout.strip().splitlines()[0])


@case("proc.kill-host-process", "process", "signal a host process of the agent's own uid (e.g. another session of the same agent)",
      weakened_by="no-pidns+no-landlock")
def _(env: Env) -> Verdict:
    from agentvm import identity

    name = "selftest-victim"
    uid = identity.agent_identity(env.paths.state_db, name).uid  # the uid the runtime will give the agent
    victim_code = """
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
print("ready", os.getpid(), flush=True)
info = signal.sigtimedwait({signal.SIGUSR1, signal.SIGTERM}, 15)
print("GOT", info.si_signo if info else 0, info.si_pid if info else 0, flush=True)
"""

    def drop() -> None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    victim = subprocess.Popen(["/usr/bin/python3", "-c", victim_code], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, preexec_fn=drop, cwd="/")
    try:
        line = victim.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "ready":
            return Verdict.error(f"the host victim did not start: {line}")
        vpid = int(line[1])
        code = f"""
import os, signal, errno
for label, sig in (("usr1", signal.SIGUSR1), ("term", signal.SIGTERM)):
    try:
        os.kill({vpid}, sig); print(label, 0, "OK")
    except OSError as e:
        print(label, -1, errno.errorcode.get(e.errno))
"""
        # the run's teardown SIGKILLs every process of the uid (the victim too): the victim's own
        # report of a *caught* USR1/TERM is the evidence, never its death
        o = env.sandbox(code, lang="python", egress=False, agent=True, name=name, disk=16 * 1024**2)
        try:
            rest = victim.communicate(timeout=5)[0].decode()
        except subprocess.TimeoutExpired:
            rest = ""
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    got = table(rest).get("GOT")
    if got and got[0] != "0":
        return Verdict.escaped(f"host process {vpid} (uid {uid}) received signal {got[0]} from pid {got[1]} in the sandbox")
    return _seccomp_verdict(env, o, f"signals to host pid {vpid} (uid {uid})", ("usr1", "term"))
