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
