"""The gate contained by default (issue 43), through the real daemon and real sandboxes.

`agentvm up` with no option serves every sandbox's egress from a confined gate worker of its
agent's own: the process at the other end of a sandbox's gate connection is not uid 0, has no
capability, no_new_privs and a seccomp filter (read from /proc of that process); two agents
never share one; the worker is started with its agent's first sandbox and retired after its
last. A held request (``action: ask``) and an LLM budget are served by the worker, which asks
the daemon (held, approved or denied by a human; admitted and counted there). The unconfined
in-process gate is only an explicit opt-in (`--gate-workers 0`), recorded on the audit chain
as a security alert and warned by `agentvm doctor` and `agentvm status`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root
from tests.integration.test_daemon import agent, av, daemon_up

pytestmark = [pytest.mark.integration, needs_root]


def audit(sandbox: str | None = None) -> list[dict]:
    args = ["audit", "show", "--json"] + (["--sandbox", sandbox] if sandbox else [])
    return [json.loads(x) for x in av(*args).stdout.splitlines()]


def wait_for(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def proc_status(pid: int) -> dict:
    return dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)


@pytest.fixture
def upstream():
    from tests.integration.gate_upstreams import Upstream

    d = Path(f"/tmp/agentvm-gdtest-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    up = Upstream()
    try:
        yield d, up
    finally:
        up.close()
        subprocess.run(["rm", "-rf", str(d)])


def sleeper(tmp_path: Path, name: str, port: int, extra_allow: str = "") -> Path:
    return agent(tmp_path, name, ["/bin/sh", "-c", "exec sleep 600"], extra=textwrap.indent(textwrap.dedent(f"""\
        riskTier: L3
        egress:
          hosts: {{api.test: 127.0.0.1, other.test: 127.0.0.1}}
          allow: [{{host: api.test, ports: [{port}]}}{extra_allow}]
        """), "  "))


def sandbox_id(name: str) -> str:
    return [r for r in audit(name) if r["kind"] == "lifecycle.running"][-1]["data"]["sandbox_id"]


def gate_socket(sid: str) -> Path:
    """The sandbox's gate socket on the host (its path names the sandbox id)."""
    ss = subprocess.run(["ss", "-xlpn"], capture_output=True, text=True).stdout
    for ln in ss.splitlines():
        for field in ln.split():
            if sid in field and field.startswith("/"):
                return Path(field)
    raise AssertionError(f"no listening socket names {sid}")


def peer_pids(path: Path) -> set[int]:
    """The processes holding the accepted (server) end of connections to ``path``: whoever
    reads what the sandbox sends. (The daemon keeps a copy of the listening socket, to hand it
    to a replacement worker; it accepts nothing on it.)"""
    ss = subprocess.run(["ss", "-xpn"], capture_output=True, text=True).stdout
    pids = set()
    for ln in ss.splitlines():
        if str(path) in ln and "ESTAB" in ln and "users:" in ln:
            for part in ln.split("pid=")[1:]:
                pids.add(int(part.split(",", 1)[0]))
    return pids


def connected_peer(path: Path) -> tuple[socket.socket, int]:
    """Open a connection to the gate socket (as the sandbox would: a request head not yet
    finished, so it stays open) -> (the connection, the pid that accepted it)."""
    c = socket.socket(socket.AF_UNIX)
    c.connect(str(path))
    c.sendall(b"GET http://api.test/ HTTP/1.1\r\n")
    pids = wait_for(lambda: peer_pids(path), f"the accepted end of a connection to {path}", 10)
    assert len(pids) == 1, pids
    return c, pids.pop()


def test_by_default_each_agent_is_served_by_a_confined_worker_of_its_own(fresh_home, tmp_path, upstream):
    d, up = upstream
    with daemon_up(fresh_home) as home:
        daemon = int((Path(home) / "run" / "daemon.pid").read_text())
        mode = [r for r in audit() if r["kind"] == "gate.workers"]
        assert mode and mode[-1]["data"]["mode"] == "per-agent" and mode[-1]["data"]["confined"] == "full", mode
        assert not [r for r in audit() if r["kind"] == "gate.unconfined"]
        for name in ("gd-one", "gd-two"):
            av("create", "-f", str(sleeper(tmp_path, name, up.port)), "--start")
        peers = {}
        for name in ("gd-one", "gd-two"):
            # the sandbox's own request is served (by a worker)
            r = av("exec", name, "--", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                   f"http://api.test:{up.port}/ok")
            assert r.stdout == b"200", r.stdout
            running = [r for r in audit(name) if r["kind"] == "lifecycle.running"][-1]
            assert running["data"]["gate"].startswith("worker "), running
            conn, pid = connected_peer(gate_socket(sandbox_id(name)))
            try:
                assert pid != daemon, "the daemon itself reads the sandbox's bytes"
                st = proc_status(pid)
                uid = st["Uid"].split()
                assert len(set(uid)) == 1 and uid[0] != "0", st["Uid"]
                assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == int(st["CapBnd"], 16) == 0, st["CapEff"]
                assert st["NoNewPrivs"].strip() == "1", st["NoNewPrivs"]
                assert st["Seccomp"].strip() == "2", st["Seccomp"]
                assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink(f"/proc/{daemon}/ns/mnt")
                peers[name] = (pid, uid[0])
            finally:
                conn.close()
        assert peers["gd-one"][0] != peers["gd-two"][0], "two agents share a gate worker"
        assert peers["gd-one"][1] != peers["gd-two"][1], "two agents' workers share a uid"
        started = {r["data"]["tenant"]: r["data"] for r in audit() if r["kind"] == "gate.worker-started"}
        assert started["agent:gd-one"]["pid"] == peers["gd-one"][0], started
        assert started["agent:gd-two"]["pid"] == peers["gd-two"][0], started
        # `agentvm status` (the fleet status document) says the gate is contained
        gate = json.loads(av("status", "--json", check=False).stdout)["gate"]
        assert gate["mode"] == "per-agent" and gate["contained"] is True and "warning" not in gate, gate
        # the last sandbox of an agent stops: its worker retires (the other agent's stays)
        av("stop", "gd-one")
        wait_for(lambda: [r for r in audit() if r["kind"] == "gate.worker-retired"
                          and r["data"]["tenant"] == "agent:gd-one"], "gd-one's worker to retire")
        wait_for(lambda: not Path(f"/proc/{peers['gd-one'][0]}").exists(), "gd-one's worker to exit")
        assert Path(f"/proc/{peers['gd-two'][0]}").exists()
        # it starts again: a new worker for it
        av("start", "gd-one")
        r = av("exec", "gd-one", "--", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
               f"http://api.test:{up.port}/ok")
        assert r.stdout == b"200"
        for name in ("gd-one", "gd-two"):
            av("rm", name)


def test_a_held_request_waits_in_the_daemon_and_is_served_by_the_worker(fresh_home, tmp_path, upstream):
    d, up = upstream
    with daemon_up(fresh_home):
        f = sleeper(tmp_path, "gd-ask", up.port, extra_allow=f", {{host: other.test, ports: [{up.port}], action: ask}}")
        av("create", "-f", str(f), "--start")
        running = [r for r in audit("gd-ask") if r["kind"] == "lifecycle.running"][-1]
        assert running["data"]["gate"].startswith("worker "), running
        assert not [r for r in audit() if r["kind"] == "gate.placement"], "placed on the daemon's own gate"
        results = {}

        def ask(path: str, key: str):
            results[key] = subprocess.Popen(
                agentvm_cmd() + ["exec", "gd-ask", "--", "curl", "-s", "-o",
                 "/dev/null", "-w", "%{http_code}", "--max-time", "60", f"http://other.test:{up.port}{path}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def pending(path):
            rows = json.loads(av("approvals", "list", "--json").stdout)
            return [r for r in rows if r["target"].endswith(path) and r["state"] == "pending"]

        ask("/approve-me", "yes")
        row = wait_for(lambda: pending("/approve-me"), "the held request in the approvals queue")[0]
        assert row["sandbox"].startswith("gd-ask") and row["kind"] == "egress"
        assert not any(s[2] == "/approve-me" for s in up.seen), "forwarded before it was approved"
        av("approvals", "approve", row["id"])
        out, _ = results["yes"].communicate(timeout=60)
        assert out == b"200", out
        assert any(s[2] == "/approve-me" for s in up.seen)
        ask("/deny-me", "no")
        row = wait_for(lambda: pending("/deny-me"), "the second held request")[0]
        av("approvals", "deny", row["id"])
        out, _ = results["no"].communicate(timeout=60)
        assert out == b"403", out
        assert not any(s[2] == "/deny-me" for s in up.seen)
        recs = audit("gd-ask")
        assert any(r["kind"] == "approval.requested" for r in recs)
        denied = [r for r in recs if r["kind"] == "egress.deny" and r["data"].get("rule") == "approval:denied"]
        assert denied, [r["kind"] for r in recs][-20:]
        av("rm", "gd-ask")


def test_the_unconfined_gate_is_an_audited_opt_in(fresh_home, tmp_path, upstream):
    d, up = upstream
    with daemon_up(fresh_home, "--gate-workers", "0") as home:
        daemon = int((Path(home) / "run" / "daemon.pid").read_text())
        alert = [r for r in audit() if r["kind"] == "gate.unconfined"]
        assert alert and alert[-1]["data"]["alert"] == "security" and alert[-1]["data"]["pid"] == daemon, alert
        av("create", "-f", str(sleeper(tmp_path, "gd-root", up.port)), "--start")
        conn, pid = connected_peer(gate_socket(sandbox_id("gd-root")))
        conn.close()
        assert pid == daemon, "(the opt-in: the daemon's own process reads the sandbox's bytes)"
        gate = json.loads(av("status", "--json", check=False).stdout)["gate"]
        assert gate["mode"] == "unconfined" and gate["contained"] is False and "--gate-workers 0" in gate["warning"]
        text = av("status", check=False)  # the text form says it too, on stderr
        assert b"warning: " in text.stderr and b"--gate-workers 0" in text.stderr, text.stderr
        doc = json.loads(av("doctor", "--json", "--no-smoke", check=False).stdout)
        assert any("not contained" in w for w in doc["warnings"]), doc["warnings"]
        av("rm", "gd-root")
    # the default again: doctor warns of nothing about the gate (no daemon, or a contained one)
    doc = json.loads(av("doctor", "--json", "--no-smoke", check=False).stdout)
    assert not any("not contained" in w for w in doc["warnings"]), doc["warnings"]
    # --unconfined-gate: the same opt-in, recorded again (each start of such a daemon)
    with daemon_up(fresh_home, "--unconfined-gate") as home:
        alerts = [r for r in audit() if r["kind"] == "gate.unconfined"]
        assert len(alerts) == 2 and alerts[-1]["data"]["pid"] == int((Path(home) / "run" / "daemon.pid").read_text())
    with daemon_up(fresh_home):
        assert len([r for r in audit() if r["kind"] == "gate.unconfined"]) == 2, "the default is not an opt-in"
        doc = json.loads(av("doctor", "--json", "--no-smoke", check=False).stdout)
        gate = next(p for p in doc["extras"] if p["name"] == "gate-contained")
        assert gate["ok"] and "per-agent" in gate["detail"], gate


from tests.integration.test_tools_e2e import env, outputs, run_client, write_agent  # noqa: E402,F401 (env: a fixture)


BAD_RPC = r"""
import json, os, urllib.request
url = os.environ["AGENTVM_MCP_URL"]
for body in (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"', b'[' * 100000, b'\xff\xfe not json',
             json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": 7}}).encode()):
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "content-type": "application/json", "accept": "application/json, text/event-stream"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        doc = json.loads(e.read() or b"{}")
    print(json.dumps({"code": (doc.get("error") or {}).get("code")}), flush=True)
"""


def test_a_sandbox_with_tools_is_served_by_a_worker_and_its_tools_by_the_daemon(env, avm_home):
    """Its egress and its /mcp requests - their HTTP and their JSON-RPC - are parsed by its
    agent's confined worker (agentvm.tools.front); the tool gateway (tool servers, policy,
    approvals) answers each request in the daemon, asked with plain data. Malformed JSON-RPC
    (cut short, nested 100,000 deep, not UTF-8, params of the wrong type) is answered with the
    protocol's errors, and the tools are served on after it."""
    with daemon_up(avm_home):
        agent = write_agent(env, "tgw")
        r = run_client(env, agent, [["call", "t__echo", {"text": "through a worker"}]])
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert outputs(r.stdout)[1] == {"ok": True, "text": "through a worker"}
        (env["dir"] / "bad_rpc.py").write_text(BAD_RPC)
        bad = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--json", "--", "python3", "/work/bad_rpc.py"],
                             capture_output=True, timeout=150)
        assert bad.returncode == 0, bad.stderr.decode()[-3000:]
        codes = [d["code"] for d in outputs(bad.stdout)]
        assert codes[:3] == [-32700, -32700, -32700] and codes[3] == -32602, codes
        r = run_client(env, agent, [["call", "t__echo", {"text": "still served"}]])
        assert r.returncode == 0 and outputs(r.stdout)[1] == {"ok": True, "text": "still served"}, r.stderr[-2000:]
        recs = audit()
        assert not [x for x in recs if x["kind"] == "gate.placement"], "placed on the daemon's own gate"
        started = [x["data"] for x in recs if x["kind"] == "gate.worker-started"]
        assert any(d["tenant"].endswith("tgw") for d in started), started
        # the gateway's decision, written by the worker in the sandbox's decision log
        logged = [ln for f in (Path(avm_home) / "logs").glob("*.egress.jsonl") for ln in f.read_text().splitlines()
                  if '"phase": "tool"' in ln.replace('":"', '": "') and "echo" in ln]
        assert logged, "the tool call's decision record"
