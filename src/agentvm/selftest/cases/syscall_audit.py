"""The escape surface is observable: every escape probe the seccomp filter refuses is also
*recorded* (agentvm.sysaudit) - the syscall by name, the rule, the errno the agent got, and
the process (pid, argv, exe, verified live while it was held).

A case here is contained only when each probe is refused with the deny list's errno *and* has
its record; the weakening ``no-syscall-audit`` (the same filter, denying silently) makes it
escape: a refusal nobody sees is the failure this proves absent.

:func:`audit_verdict` is the check for any case that attempts denied syscalls: give it the
outcome and the syscalls the program tried.
"""

from __future__ import annotations

from agentvm.selftest.framework import Env, Verdict, case

_GVISOR = ("gVisor's Sentry implements the syscalls itself and this runsc has no user-notification listener "
           "for the filter init loads inside it: probes are refused there (the same filter, EPERM) but not recorded "
           "by agent-vm; see docs/syscall-audit.md")


def records(env: Env, outcome) -> list[dict]:
    """The syscall records of the run ``outcome`` (its sandbox's ``.syscalls.jsonl``)."""
    from agentvm import sysaudit

    sysaudit.supervisor().flush()
    sid = outcome.result.get("sandbox_id") or ""
    return sysaudit.read_log(sysaudit.log_path(env.paths.home, sid)) if sid else []


def audit_verdict(env: Env, outcome, tried: dict[str, str], what: str) -> Verdict:
    """``tried``: label printed by the program -> syscall name. Contained when every label was
    answered EPERM (the deny list's errno) and a ``syscall.denied`` record names that syscall
    with errno EPERM and a process verified live; escaped when a call was served or a refusal
    left no record."""
    res: dict[str, list[str]] = {}
    for ln in outcome.stdout.splitlines():
        parts = ln.split()
        if parts:
            res[parts[0]] = parts[1:]
    missing = [k for k in tried if k not in res]
    if missing:
        return Verdict.error(f"{what}: the program did not report {missing}: {outcome.out.strip()[-400:]}")
    served = {k: v for k, v in res.items() if k in tried and v[-1] != "EPERM"}
    if any(v[-1] == "OK" for v in served.values()):
        return Verdict.escaped(f"{what}: served by the kernel: {served}")
    if served:
        return Verdict.error(f"{what}: not the deny list's EPERM: {served}")
    recs = [r for r in records(env, outcome) if r.get("kind") == "syscall.denied"]
    got = {r.get("syscall") for r in recs if r.get("errno") == "EPERM" and r.get("verified") and r.get("argv")}
    unrecorded = sorted({s for s in tried.values() if s not in got})
    if unrecorded:
        return Verdict.escaped(f"{what}: refused (EPERM) but not recorded - the probe was invisible: {unrecorded} "
                               f"(records: {[(r.get('syscall'), r.get('rule')) for r in recs]})")
    rules = sorted({f"{r['syscall']}:{r.get('rule')}" for r in recs})
    return Verdict.contained(f"{what}: each refused with EPERM and recorded: {', '.join(rules)}")


PROBES = """
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def err(r):
    return "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def sc(nr, *a):
    ctypes.set_errno(0)
    return err(libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a]))
NR = %r
print("unshare", err(libc.unshare(0x10000000)))
print("mount", err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close(); print("raw_socket OK")
except OSError as e:
    print("raw_socket", errno.errorcode.get(e.errno, e.errno))
print("io_uring_setup", sc(NR["io_uring_setup"], 4, ctypes.create_string_buffer(120)))
print("bpf", sc(NR["bpf"], 999, ctypes.create_string_buffer(72), 72))
print("keyctl", sc(NR["keyctl"], 0, -3, 0))
print("ptrace", sc(NR["ptrace"], 16, 1, 0, 0))
print("setns", sc(NR["setns"], -1, 0))
"""

_NR = {"x86_64": {"io_uring_setup": 425, "bpf": 321, "keyctl": 250, "ptrace": 101, "setns": 308},
       "aarch64": {"io_uring_setup": 425, "bpf": 280, "keyctl": 219, "ptrace": 117, "setns": 268}}


@case("proc.escape-probes-audited", "process",
      "escape probes (unshare, mount, a raw socket, io_uring, bpf, keyctl, ptrace, setns) are refused with the deny "
      "list's errno AND each leaves a syscall record naming the syscall, rule and process",
      weakened_by="no-syscall-audit", not_on={"gvisor": _GVISOR})
def _(env: Env) -> Verdict:
    import os

    nr = _NR.get(os.uname().machine, _NR["x86_64"])
    o = env.sandbox(PROBES % (nr,), lang="python", egress=False)
    tried = {"unshare": "unshare", "mount": "mount", "raw_socket": "socket", "io_uring_setup": "io_uring_setup",
             "bpf": "bpf", "keyctl": "keyctl", "ptrace": "ptrace", "setns": "setns"}
    return audit_verdict(env, o, tried, "escape probes")


@case("proc.unshare-cli-audited", "process",
      "`unshare -U true` (the util-linux tool, as an agent would type it) is refused and recorded with its argv",
      weakened_by="no-syscall-audit", not_on={"gvisor": _GVISOR})
def _(env: Env) -> Verdict:
    o = env.sandbox("unshare -U true; echo \"unshare_cli $?\"; "
                    "python3 -c 'import ctypes,errno; l=ctypes.CDLL(None,use_errno=True); r=l.unshare(0x10000000); "
                    "print(\"unshare\", errno.errorcode.get(ctypes.get_errno()) if r else \"OK\")'", egress=False)
    if "unshare_cli 0" in o.stdout:
        return Verdict.escaped("unshare -U true succeeded: " + o.out[-300:])
    v = audit_verdict(env, o, {"unshare": "unshare"}, "unshare")
    if v.status != "contained":
        return v
    cli = [r for r in records(env, o) if r.get("syscall") == "unshare" and (r.get("argv") or [""])[0] == "unshare"]
    if not cli:
        return Verdict.escaped("the unshare tool's refusal left no record with its argv: "
                               + str([(r.get("argv"), r.get("syscall")) for r in records(env, o)]))
    return Verdict.contained(f"refused and recorded: argv={cli[0]['argv']} exe={cli[0].get('exe')} "
                             f"flags={cli[0].get('args')}")


OWN_LISTENER = r"""
import ctypes, errno, os, struct, threading, time
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
NR = %r
def sc(nr, *a):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])
    return r, ("OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno())))
# 1. flood the audit with distinct denied calls (a new protocol each: nothing is folded) - what
#    once made the supervisor close its listener, after which the kernel accepted a new one
stop = time.monotonic() + 1.5
def flood(base):
    i = 0
    while time.monotonic() < stop:
        libc.syscall(ctypes.c_long(NR["socket"]), ctypes.c_long(16), ctypes.c_long(3), ctypes.c_long(1000 + base + i))
        i += 1
ts = [threading.Thread(target=flood, args=(k * 10_000_000,)) for k in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
# 2. a filter of our own whose USER_NOTIF for keyctl would win the tie, with a listener
ins = [struct.pack("HBBI", 0x20, 0, 0, 0), struct.pack("HBBI", 0x15, 0, 1, NR["keyctl"]),
       struct.pack("HBBI", 0x06, 0, 0, 0x7fc00000), struct.pack("HBBI", 0x06, 0, 0, 0x7fff0000)]
buf = ctypes.create_string_buffer(b"".join(ins))
prog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(ins), ctypes.addressof(buf)))
lst = sc(NR["seccomp"], 1, 8, ctypes.addressof(prog))  # SET_MODE_FILTER, FLAG_NEW_LISTENER
print("own_listener", *lst, flush=True)
if lst[0] >= 0:
    def answer():  # CONTINUE every notification: the call runs
        while True:
            n = ctypes.create_string_buffer(80)
            if libc.ioctl(lst[0], ctypes.c_ulong(0xc0502100), n) < 0:
                return
            nid = struct.unpack_from("Q", n, 0)[0]
            libc.ioctl(lst[0], ctypes.c_ulong(0xc0182101), ctypes.create_string_buffer(struct.pack("QqiI", nid, 0, 0, 1)))
    threading.Thread(target=answer, daemon=True).start()
print("keyctl_after", *sc(NR["keyctl"], 0, -3, 1), flush=True)  # KEYCTL_GET_KEYRING_ID(session)
"""
_NR_LISTENER = {"x86_64": {"seccomp": 317, "keyctl": 250, "socket": 41},
                "aarch64": {"seccomp": 277, "keyctl": 219, "socket": 198}}


@case("proc.own-seccomp-listener", "process",
      "after flooding the syscall audit, load a seccomp filter with a listener of the agent's own and answer its "
      "USER_NOTIF rules with CONTINUE (the newest filter wins a tie): denied calls must stay refused",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    import os

    nr = _NR_LISTENER.get(os.uname().machine, _NR_LISTENER["x86_64"])
    o = env.sandbox(OWN_LISTENER % (nr,), lang="python", egress=False, timeout=60)
    res: dict[str, list[str]] = {}
    for ln in o.stdout.splitlines():
        parts = ln.split()
        if parts:
            res[parts[0]] = parts[1:]
    if "own_listener" not in res or "keyctl_after" not in res:
        return Verdict.error("the program did not report: " + o.out.strip()[-400:])
    if res["keyctl_after"][-1] == "OK":
        return Verdict.escaped(f"keyctl ran through the agent's own listener (listener: {res['own_listener']})")
    if res["own_listener"][-1] == "OK":
        return Verdict.escaped(f"the agent got a seccomp listener of its own (keyctl: {res['keyctl_after']})")
    if res["keyctl_after"][-1] != "EPERM":
        return Verdict.error(f"keyctl refused, but not with the deny list's EPERM (the audit's listener gone?): "
                             f"{res['keyctl_after']}")
    return Verdict.contained(f"own listener refused ({res['own_listener'][-1]}), keyctl still EPERM after the flood")
