"""The embedded run's gate is a confined, unprivileged process (issue 43).

``agentvm run`` without a daemon: the process that parses what the sandbox sends is one gate
worker (agentvm.gate.embedded_worker), not the root ``agentvm run`` process. Each test runs the
real CLI with a real bubblewrap sandbox and looks at the process serving the sandbox's gate
socket two ways:

* from outside: the processes holding the socket (``/proc/net/unix`` for its inode, then every
  ``/proc/PID/fd``): besides the run itself, one process - its ``/proc/PID/status``;
* from inside: the sandbox sends the TEST-ONLY eval hook's payload (agentvm.gate.workers:
  ``AGENTVM_TEST_GATE_EVAL=1`` and tests/attacks/gate_eval.marker in this checkout) - a
  stand-in for an exploited parser bug - and that code reports what it is and what it can
  read: not /root, not the state db, not the vault's key, only this sandbox's credential.

Also: a forbidden system call kills the worker, is a security alert on the audit chain, and
the sandbox is served again; the opt-in to the unconfined gate is recorded and said; a run
whose gate cannot be confined is refused (fail closed), and a worker that cannot confine
itself serves nothing.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, needs_root]

SECRET_A = "fake-embedded-a-" + "a" * 20
SECRET_B = "fake-embedded-b-" + "b" * 20
EVAL_ENV = "AGENTVM_TEST_GATE_EVAL"
OPERATOR_VAR, OPERATOR_TOKEN = "EMBGATE_OPERATOR_TOKEN", "fake-operator-token-" + "c" * 12  # the operator's shell


def _landlock() -> bool:
    from agentvm.gate import confine

    return confine.landlock_abi() >= 1


needs_landlock = pytest.mark.skipif(not _landlock(), reason="the kernel has no Landlock")

# what the eval hook runs in the gate process: what it is, what it can read, what it holds
PROBE_CODE = textwrap.dedent("""\
    import ctypes, os
    from agentvm.gate import confine
    libc = ctypes.CDLL(None)
    def tryread(p):
        try:
            with open(p, 'rb') as f:
                f.read(1)
            return 'READ'
        except Exception as e:
            return type(e).__name__
    ep = gate.endpoints[sandbox_id]
    held = sorted((ep.creds._held['values'] if ep.creds is not None else {}).values())
    result = {'pid': os.getpid(), 'uid': list(os.getresuid()), 'gid': list(os.getresgid()),
              'caps': list(confine.capabilities()), 'nnp': libc.prctl(39, 0, 0, 0, 0),
              'seccomp': libc.prctl(21, 0, 0, 0, 0), 'held': held, 'proc': os.path.exists('/proc/self'),
              'env': sorted(os.environ),
              'reads': {p: tryread(p) for p in PATHS}}
    """)


@pytest.fixture(scope="module")
def env(avm_home):
    home = avm_home
    d = Path(f"/tmp/agentvm-test-embgate-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    probe = Path("/root") / f"agentvm-test-embgate-{secrets.token_hex(4)}"
    probe.write_text("root's file\n")
    for name, value in (("a-key", SECRET_A), ("b-key", SECRET_B)):
        r = subprocess.run(agentvm_cmd() + ["secret", "set", name], input=value.encode(), capture_output=True)
        assert r.returncode == 0, r.stderr
    spec = d / "embgate.yaml"
    spec.write_text(textwrap.dedent("""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {name: embgate}
        spec:
          riskTier: L3
          limits: {timeout: 60s}
          egress:
            hosts: {api.test: 127.0.0.1}
            allow:
              - {host: api.test, ports: [9]}
          credentials:
            - {name: a, env: A_KEY, ref: "vault:a-key", hosts: [api.test], inject: {header: X-Api-Key}}
        """))
    try:
        yield {"home": home, "dir": d, "spec": spec, "probe": probe}
    finally:
        probe.unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)


def _payload(code: str) -> str:
    return "AGENTVM-TEST-EVAL " + str(len(code.encode())) + "\n" + code


def _sandbox_script(*steps: tuple[str, str], hold: float = 0.0) -> str:
    """Python run INSIDE the sandbox: each step (label, bytes to send) on its own connection to
    the gate's bridge, its answer printed as ``LABEL <answer>``; then ``hold`` seconds asleep."""
    return textwrap.dedent(f"""\
        import socket, sys, time
        for label, data in {list(steps)!r}:
            s = socket.create_connection(('127.0.0.1', 3128), timeout=20)
            s.sendall(data.encode())
            out = b''
            try:
                while True:
                    b = s.recv(65536)
                    if not b:
                        break
                    out += b
            except OSError as e:
                out += ('<' + type(e).__name__ + '>').encode()
            s.close()
            print(label, out.decode(errors='replace').strip().splitlines()[0] if out.strip() else '<nothing>', flush=True)
            time.sleep(0.3)
        time.sleep({hold})
        """)


def _start(env, script: str, *, extra_env: dict | None = None) -> subprocess.Popen:
    e = dict(os.environ, AGENTVM_NO_DAEMON="1", **{EVAL_ENV: "1"})
    e.pop("AGENTVM_GATE_UNCONFINED", None)
    e.update(extra_env or {})
    assert (ROOT / "tests/attacks/gate_eval.marker").is_file()
    return subprocess.Popen(agentvm_cmd() + ["run", "-f", str(env["spec"]), "--json", "--", "/usr/bin/python3", "-c",
                                             script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)


def _finish(p: subprocess.Popen, timeout: float = 90) -> tuple[dict, str, str]:
    out, err = p.communicate(timeout=timeout)
    out, err = out.decode(errors="replace"), err.decode(errors="replace")
    try:
        res = last_json(out)
    except AssertionError:
        raise AssertionError(f"no --json result; rc={p.returncode}\n{out[-3000:]}\n{err[-3000:]}") from None
    return res, out, err


def _status(pid: int) -> dict:
    st = Path(f"/proc/{pid}/status").read_text()
    return {ln.split(":", 1)[0]: ln.split(":", 1)[1].split() for ln in st.splitlines() if ":" in ln}


def _socket_holders(sock_path: str) -> set[int]:
    """Pids holding the listening unix socket bound at ``sock_path`` (this network namespace)."""
    inodes = set()
    for ln in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = ln.split()
        if len(parts) >= 8 and parts[7] == sock_path:
            inodes.add(parts[6])
    want = {f"socket:[{i}]" for i in inodes}
    pids = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    if os.readlink(f"/proc/{d}/fd/{fd}") in want:
                        pids.add(int(d))
                        break
                except OSError:
                    pass
        except OSError:
            pass
    return pids


def _gate_socket(home: Path, agent: str, p: subprocess.Popen, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            out, err = p.communicate()
            raise AssertionError(f"the run ended early: rc={p.returncode}\n{out.decode()[-2000:]}\n{err.decode()[-2000:]}")
        found = sorted((home / "run" / "sandboxes").glob(f"{agent}-*/gate.sock"))
        if found:
            return str(found[-1])
        time.sleep(0.05)
    raise AssertionError(f"no gate socket of {agent} appeared under {home}/run/sandboxes")


def _serving_pid(sock: str, run_pid: int, timeout: float = 20) -> int:
    """The process other than the run serving ``sock`` (there once the sandbox has connected)."""
    deadline = time.monotonic() + timeout
    others: set[int] = set()
    while time.monotonic() < deadline:
        holders = _socket_holders(sock)
        others = holders - {run_pid}
        if others:
            break
        time.sleep(0.05)
    assert len(others) == 1, f"holders of {sock}: {others} (run {run_pid})"
    return others.pop()


def _audit(sandbox: str) -> list[dict]:
    r = subprocess.run(agentvm_cmd() + ["audit", "show", "--json", "--sandbox", sandbox], capture_output=True)
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.decode().splitlines() if x.strip()]


def _kinds(recs: list[dict]) -> list[str]:
    return [r.get("kind") for r in recs]


def _eval_answer(out: str, label: str) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith(label + " ")), None)
    assert line is not None, out
    text = line[len(label) + 1:]
    assert not text.startswith(("EXC", "<")), line
    return ast.literal_eval(text)


# ---------------------------------------------------------------------------------- tests
@needs_landlock
def test_the_process_serving_the_sandbox_is_unprivileged_and_confined(env):
    home = env["home"]
    paths = [str(env["probe"]), str(home / "state.db"), str(home / "vault" / "key"), str(home / "vault" / "store"),
             str(home / "audit" / "audit.db"), "/etc/shadow", str(home / "gate" / "ca" / "ca.key")]
    code = f"PATHS = {paths!r}\n" + PROBE_CODE
    p = _start(env, _sandbox_script(("EVAL", _payload(code)), hold=2.0), extra_env={OPERATOR_VAR: OPERATOR_TOKEN})
    try:
        sock = _gate_socket(home, "embgate", p)
        # the sandbox's first connection starts the worker: it then holds the socket
        pid = _serving_pid(sock, p.pid)
        st = _status(pid)
        run_st = _status(p.pid)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        run_environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        fds = {int(f): os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")}
        run_fds = set(os.readlink(f"/proc/{p.pid}/fd/{f}") for f in os.listdir(f"/proc/{p.pid}/fd"))
    finally:
        res, out, err = _finish(p)
    assert res["exit_code"] == 0, (out, err)
    # from outside: the run is root, the process serving its sandbox is not
    assert run_st["Uid"][0] == "0"
    assert all(u != "0" for u in st["Uid"]) and all(g != "0" for g in st["Gid"]), st["Uid"]
    assert int(st["CapEff"][0], 16) == 0 and int(st["CapPrm"][0], 16) == 0 and int(st["CapBnd"][0], 16) == 0, st
    assert st["NoNewPrivs"] == ["1"] and st["Seccomp"] == ["2"], st
    assert st["Uid"][0] != str(res["host_uid"]), "the gate and the sandbox never share a uid"
    # forked from the run, it keeps nothing of the operator's environment, and its command line
    # is its own (not the run's, which names the sandbox's command)
    assert OPERATOR_TOKEN.encode() in run_environ
    assert OPERATOR_TOKEN.encode() not in environ and OPERATOR_VAR.encode() not in environ, environ[:300]
    assert b"EVAL" not in cmdline and cmdline.startswith(b"agentvm-gate-worker"), cmdline[:200]
    # and none of the run's descriptors but its stderr (its log lines): not the run's stdout, not
    # the audit chain, not the state db
    assert fds[0] == "/dev/null" and fds[1] == "/dev/null", fds
    shared = {t for t in fds.values() if not t.startswith(("socket:", "anon_inode:", "pipe:"))} & run_fds
    assert shared <= {"/dev/null", fds[2]}, shared
    assert not any(t.endswith((".db", "audit.db", "state.db")) for t in fds.values()), fds
    # from inside (code run in the gate process by the sandbox's own bytes): the same process
    ans = _eval_answer(out, "EVAL")
    assert ans["pid"] == pid, (ans, pid)
    assert [str(u) for u in ans["uid"]] == st["Uid"][:3] and 0 not in ans["gid"], ans
    assert ans["caps"] == [0, 0, 0] and ans["nnp"] == 1 and ans["seccomp"] == 2, ans
    assert ans["proc"] is False, "no /proc in the worker's mount namespace"
    assert OPERATOR_VAR not in ans["env"], ans["env"]
    assert all(v != "READ" for v in ans["reads"].values()), ans["reads"]
    # it holds this sandbox's credential value (to swap it in), and no other of the vault
    assert ans["held"] == [SECRET_A], ans["held"]
    # on the run's audit records: the gate's placement, with its uid
    recs = _audit(res["sandbox_id"])
    confined = [r for r in recs if r.get("kind") == "gate.confined"]
    assert confined and str(confined[0]["data"]["uid"]) == st["Uid"][0], recs
    assert "gate.unconfined" not in _kinds(recs)


@needs_landlock
def test_a_forbidden_system_call_kills_the_gate_is_an_alert_and_the_sandbox_is_served_again(env):
    exec_code = "import os\nos.execv('/bin/true', ['/bin/true'])\nresult = 'still here'"
    script = _sandbox_script(("EXEC", _payload(exec_code)),
                             ("AFTER", "GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n"))
    p = _start(env, script)
    res, out, err = _finish(p)
    assert res["exit_code"] == 0, (out, err)
    assert "still here" not in out, out
    after = next(ln for ln in out.splitlines() if ln.startswith("AFTER "))
    assert after.startswith("AFTER HTTP/1.1 403"), out  # a replacement decided it
    recs = _audit(res["sandbox_id"])
    killed = [r for r in recs if r.get("kind") == "gate.worker-killed"]
    assert killed, _kinds(recs)
    d = killed[0]["data"]
    assert d["alert"] == "security" and d["cause"] == "seccomp" and d["signal"] == "SIGSYS", d
    assert "gate.worker-restarted" in _kinds(recs), _kinds(recs)


def test_the_opt_in_to_an_unconfined_gate_is_said_and_recorded(env):
    home = env["home"]
    script = _sandbox_script(("REQ", "GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n"),
                             hold=1.0)
    p = _start(env, script, extra_env={"AGENTVM_GATE_UNCONFINED": "1"})
    try:
        sock = _gate_socket(home, "embgate", p)
        time.sleep(0.5)
        holders = _socket_holders(sock)
    finally:
        res, out, err = _finish(p)
    assert res["exit_code"] == 0, (out, err)
    assert "REQ HTTP/1.1 403" in out, out
    assert holders == {p.pid}, f"the opt-in serves from the run's own process: {holders} (run {p.pid})"
    assert "AGENTVM_GATE_UNCONFINED=1" in err and "unconfined" in err, err
    recs = _audit(res["sandbox_id"])
    un = [r for r in recs if r.get("kind") == "gate.unconfined"]
    assert un and un[0]["data"]["opt_in"] == "AGENTVM_GATE_UNCONFINED", recs
    assert "gate.confined" not in _kinds(recs)


def _library_run(command: tuple[str, ...], tmp_path: Path):
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime

    policy = Policy(name="embgate-lib", command=command)
    out = tmp_path / "out"
    rt = Runtime()
    try:
        with open(out, "wb") as fo, open(os.devnull, "rb") as fi:
            try:
                result = rt.run(policy, tty=False, stdio=(fi.fileno(), fo.fileno(), fo.fileno()))
            except Exception as exc:  # noqa: BLE001 - a refusal is an outcome
                result = exc
    finally:
        rt.close()
    return result, out.read_text(errors="replace")


def test_a_gate_that_cannot_be_confined_refuses_the_run(env, monkeypatch, tmp_path):
    """No Landlock (simulated): the run is refused before the sandbox starts, with the fix."""
    from agentvm.errors import AgentVMError
    from agentvm.gate import embedded_worker

    monkeypatch.delenv("AGENTVM_GATE_UNCONFINED", raising=False)
    monkeypatch.setattr(embedded_worker, "confinable", lambda: "the kernel has no Landlock (simulated)")
    marker = tmp_path / "ran"
    result, _ = _library_run(("/bin/sh", "-c", f"touch {marker}"), tmp_path)
    assert isinstance(result, AgentVMError), result
    assert result.code == "gate.confine-failed" and "simulated" in result.message, result
    assert "AGENTVM_GATE_UNCONFINED=1" in (result.hint or ""), result.hint
    assert not marker.exists(), "the sandbox never started"


@needs_landlock
def test_a_worker_that_cannot_confine_itself_serves_nothing(env, monkeypatch, tmp_path):
    """The worker's confinement fails (simulated, in the forked worker): it exits without
    serving, the sandbox's connections are refused, the run says so."""
    from agentvm import vault
    from agentvm.gate import confine

    def broken(plan, skip=()):
        raise confine.ConfineError("landlock", "simulated confinement failure")

    monkeypatch.delenv("AGENTVM_GATE_UNCONFINED", raising=False)
    monkeypatch.setattr(confine, "confine", broken)  # (the fork inherits it)
    # (a test process that has held a secret - an earlier test's - forks no worker: it would
    # start a fresh interpreter, which the simulation cannot reach. The zygote's path here)
    monkeypatch.setattr(vault, "_HELD_SECRETS", False)
    script = ("import socket\n"
              "s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n"
              "s.sendall(b'GET http://denied.test/ HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n')\n"
              "try:\n    print('GOT', s.recv(100))\nexcept OSError as e:\n    print('ERR', type(e).__name__)\n")
    result, out = _library_run(("/usr/bin/python3", "-c", script), tmp_path)
    assert not isinstance(result, Exception), result
    assert "403" not in out and "HTTP/1.1" not in out, out  # nothing was served
    assert result.exit_code == 125 and result.setup_error["step"] == "gate", (result, out)
