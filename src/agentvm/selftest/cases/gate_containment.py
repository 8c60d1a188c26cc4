"""The gate's containment (issue 43): a gate worker parses everything sandboxes send, so it
runs confined (agentvm.gate.confine) - if a parser bug gives an agent code execution in it,
that code must not reach the daemon's state, root, exec or new namespaces.

Each case starts a fresh interpreter that confines itself exactly as a gate worker of this
environment's gate does (the same plan: ``confine.plan`` for the gate under ``env.home``, the
same uid as worker slot 0, the same steps) and then runs the attack - the stand-in for an
exploited parser. The weakenings leave out steps (``gate-unconfined``: none is applied;
``gate-no-seccomp``, ``gate-no-landlock``: that step), which must make the case escape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentvm.selftest.framework import Env, Verdict, case

_NOT_ROOT = "a gate worker switches to a uid of its own only under a root daemon"


def _skip(env: Env) -> str | None:
    """The confinement steps left out: None - none applied at all."""
    if "gate-unconfined" in env.weakens:
        return None
    skip = []
    if "gate-no-seccomp" in env.weakens:
        skip.append("seccomp")
    if "gate-no-landlock" in env.weakens:
        skip.append("landlock")
    if os.geteuid() != 0:  # (an unprivileged daemon's workers: Landlock, seccomp, no_new_privs only)
        skip += ["mount-namespace", "identity"]
    return ",".join(skip)


def _attack(env: Env, code: str, timeout: float = 20) -> tuple[int, dict | None, str]:
    """Run ``code`` (which sets ``result``) in a confined interpreter -> (exit status, result, stderr)."""
    skip = _skip(env)
    (env.home / "logs").mkdir(mode=0o711, exist_ok=True)
    args = [sys.executable, "-c", "import sys; from agentvm.selftest.cases.gate_containment import _child; "
            "sys.exit(_child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))", str(env.home)]
    if skip is not None:
        args.append(skip)
    p = subprocess.run(args, input=code.encode(), capture_output=True, timeout=timeout,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    out = p.stdout.decode(errors="replace").strip().splitlines()
    try:
        res = json.loads(out[-1]) if out else None
    except ValueError:
        res = None
    return p.returncode, res, p.stderr.decode(errors="replace")[-400:]


def _child(home: str, skip: str | None) -> int:
    """The confined interpreter: the plan a gate worker of ``home``'s gate gets, then the attack."""
    from agentvm.gate import confine

    code = sys.stdin.read()
    if skip is not None:
        uid = confine.gate_uid(Path(home), 0) if os.geteuid() == 0 else 1
        plan = confine.plan(uid, uid, state_dir=Path(home) / "gate", log_dir=Path(home) / "logs")
        confine.confine(plan, skip=tuple(s for s in skip.split(",") if s))
    env = {"result": None}
    exec(compile(code, "<attack>", "exec"), env)  # noqa: S102 - the stand-in for an exploited parser
    print(json.dumps(env["result"], default=str), flush=True)
    return 0


def _canaries(env: Env) -> dict[str, str]:
    """Files a gate worker must not read, each holding a canary."""
    c = env.home / "gate-selftest-state.txt"  # (beside the state db and the vault)
    c.write_text(env.canary + "\n")
    os.chmod(c, 0o644)
    return {"canary file outside every grant": str(env.canary_dir / "secret.txt"), "the daemon's state": str(c),
            "the vault's key": str(env.home / "vault" / "key"), "the vault's store": str(env.home / "vault" / "store.json")}


_READ = """
import os
out = {}
for what, p in PATHS.items():
    try:
        with open(p, "rb") as f:
            out[what] = f.read(200).decode("latin-1")
    except OSError as e:
        out[what] = "refused: " + (e.strerror or str(e))
try:
    out["/root"] = "listed: " + ", ".join(sorted(os.listdir("/root"))[:5])
except OSError as e:
    out["/root"] = "refused: " + (e.strerror or str(e))
result = out
"""


@case("gate.read-daemon-state", "gate-containment", "a compromised gate worker reads the daemon's state, the vault "
      "or /root", weakened_by="gate-unconfined")
def read_state(env: Env) -> Verdict:
    paths = _canaries(env)
    for name in ("key", "store.json"):
        if not (env.home / "vault" / name).exists():
            return Verdict.error(f"the environment's vault has no {name}")
    rc, res, err = _attack(env, f"PATHS = {paths!r}\n" + _READ)
    if res is None:
        return Verdict.error(f"the attack did not run (exit {rc}): {err}")
    got = {k: v for k, v in res.items() if not v.startswith("refused")}
    if got:
        return Verdict.escaped("read: " + "; ".join(f"{k}: {v[:40]!r}" for k, v in got.items()))
    return Verdict.contained("refused: " + "; ".join(f"{k} ({v[9:]})" for k, v in res.items()))


@case("gate.root-privilege", "gate-containment", "a compromised gate worker still has root or a capability",
      weakened_by="gate-unconfined")
def root_privilege(env: Env) -> Verdict:
    rc, res, err = _attack(env, "import os\nfrom agentvm.gate import confine\n"
                                "result = {'uids': os.getresuid(), 'caps': confine.capabilities()}")
    if res is None:
        return Verdict.error(f"the attack did not run (exit {rc}): {err}")
    if 0 in res["uids"] or any(res["caps"]):
        return Verdict.escaped(f"uids {res['uids']}, capabilities {[hex(c) for c in res['caps']]}")
    return Verdict.contained(f"uids {res['uids']}, no capability")


@case("gate.daemon-memory", "gate-containment", "a compromised gate worker reads the daemon's process (environment, "
      "memory) through /proc", weakened_by="gate-unconfined")
def daemon_memory(env: Env) -> Verdict:
    code = ("import os\nout = {}\nfor f in ('environ', 'maps', 'mem'):\n"
            "    try:\n        out[f] = len(open(f'/proc/{os.getppid()}/' + f, 'rb').read(64))\n"
            "    except OSError as e:\n        out[f] = 'refused: ' + (e.strerror or str(e))\nresult = out")
    rc, res, err = _attack(env, code)
    if res is None:
        return Verdict.error(f"the attack did not run (exit {rc}): {err}")
    got = [k for k, v in res.items() if isinstance(v, int)]
    if got:
        return Verdict.escaped(f"read the daemon's /proc/PID/{', '.join(got)}")
    return Verdict.contained("; ".join(f"{k}: {v}" for k, v in res.items()))


def _killed(rc: int, res, err: str, what: str, done: str) -> Verdict:
    if rc == -31:  # SIGSYS: the seccomp filter killed it (the daemon reports gate.worker-killed)
        return Verdict.contained(f"{what}: the worker was killed by its seccomp filter (SIGSYS)")
    if res is None:
        return Verdict.error(f"the attack did not run (exit {rc}): {err}")
    if res == done:
        return Verdict.escaped(f"{what}: it worked")
    return Verdict.contained(f"{what}: refused ({res})")


@case("gate.exec", "gate-containment", "a compromised gate worker runs a program (execve)",
      weakened_by="gate-no-seccomp+gate-no-landlock")
def gate_exec(env: Env) -> Verdict:
    code = ("import os, sys\nr, w = os.pipe()\npid = os.fork()\n"
            "if pid == 0:\n    os.dup2(w, 1)\n    try:\n        os.execv('/bin/echo', ['echo', 'EXECUTED'])\n"
            "    finally:\n        os._exit(5)\n"
            "os.close(w)\nout = os.read(r, 100).decode()\n_, st = os.waitpid(pid, 0)\n"
            "if os.WIFSIGNALED(st) and os.WTERMSIG(st) == 31:\n    os.kill(os.getpid(), 31)\n"
            "result = 'executed' if 'EXECUTED' in out else f'exit status {st}'")
    rc, res, err = _attack(env, code)
    return _killed(rc, res, err, "execve('/bin/echo')", "executed")


@case("gate.new-namespace", "gate-containment", "a compromised gate worker makes a user namespace (where it would be "
      "root) to reach kernel surface", weakened_by="gate-no-seccomp")
def new_namespace(env: Env) -> Verdict:
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "rc = libc.unshare(0x10000000)\n"
            "result = 'unshared' if rc == 0 else 'refused: ' + os.strerror(ctypes.get_errno())")
    rc, res, err = _attack(env, code)
    return _killed(rc, res, err, "unshare(CLONE_NEWUSER)", "unshared")

