"""The tool gateway and approvals, end to end: the official mcp SDK client inside a real
sandbox, a real stdio MCP server (tools_server.py) in a sandbox of its own, the gateway on
the gate's port, and the approvals queue answered by `agentvm approvals` as a human would."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]

HERE = Path(__file__).parent
TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))
REAL_TOKEN = "tool-fake-REAL-" + secrets.token_hex(16)  # obviously fake


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        Recorder.seen.append(("GET", self.path, self.headers.get("Authorization", "")))
        ok = self.headers.get("Authorization", "") == f"Bearer {REAL_TOKEN}"
        self._answer(200 if ok else 401, b"token accepted" if ok else b"wrong token")

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n)
        Recorder.seen.append(("POST", self.path, body.decode(errors="replace")))
        self._answer(200, b"charged")


@pytest.fixture(scope="module")
def env(avm_home):
    from tests.integration.gate_upstreams import make_test_ca, serve_https

    if not (TESTLIB / "mcp").is_dir():
        pytest.fail(f"{TESTLIB} lacks the mcp SDK: run `bash scripts/install.sh --test`")
    d = Path(f"/tmp/agentvm-tools-test-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    for f in ("tools_server.py", "tools_client.py"):
        shutil.copy(HERE / f, d / f)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    https = serve_https(Recorder, cert, key)
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    plain.daemon_threads = True
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    r = subprocess.run(agentvm_cmd() + ["secret", "set", "tool-token"], input=REAL_TOKEN.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr
    yield {"dir": d, "ca": ca, "https": https.server_address[1], "plain": plain.server_address[1]}
    https.shutdown()
    plain.shutdown()
    shutil.rmtree(d, ignore_errors=True)


def write_agent(env, name: str, *, spec_extra: str = "", timeout: str = "20s") -> Path:
    d = env["dir"]
    p = d / f"{name}.yaml"
    head = textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          riskTier: L3
          limits: {{timeout: 150s}}
          approvals: {{timeout: {timeout}}}
          mounts:
            - {{host: {d}, path: /work, mode: ro}}
            - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
        """)
    tools = textwrap.dedent(f"""\
          tools:
            - name: t
              command: [python3, /srv/tools_server.py]
              allow: [echo, read_file, crash, hang, big, env_names, fetch, inject, flood]
              approve: [write_file]
              risk: {{"*": read, write_file: write}}
              arguments:
                read_file: {{path: {{path: /}}}}
                echo: {{text: {{maxLength: 100, pattern: "[a-z ]*"}}}}
              limits: {{timeout: 5s, maxResult: 64K}}
              resources: ["note://public"]
              prompts: [summarize]
              mounts:
                - {{host: {d}, path: /srv, mode: ro}}
                - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
              env: {{PYTHONPATH: /opt/testlib}}
              egress:
                hosts: {{api.test: 127.0.0.1}}
                upstreamCa: {env['ca']}
                allow: [{{host: api.test, ports: [{env['https']}]}}]
              credentials:
                - {{name: tooltoken, env: TOOL_TOKEN, ref: "vault:tool-token", hosts: [api.test],
                    inject: {{header: Authorization, format: "Bearer {{}}"}}}}
        """)
    p.write_text(head + textwrap.indent(spec_extra, "  ") + textwrap.indent(tools, "  "))
    return p


def run_client(env, agent: Path, ops: list, mode: str = "auto", timeout: float = 150, background: bool = False,
               via: str = "http"):
    argv = agentvm_cmd() + ["run", "-f", str(agent), "--json", "--", "python3", "/work/tools_client.py",
                            json.dumps(ops), mode, via]
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    r = subprocess.run(argv, capture_output=True, timeout=timeout)
    return r


def outputs(stdout: bytes) -> list[dict]:
    lines = [json.loads(ln) for ln in stdout.decode().splitlines() if ln.startswith("{")]
    return lines[:-1]  # the last line is the run's --json result


def approvals(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(agentvm_cmd() + ["approvals", *args], capture_output=True, timeout=30)


def wait_pending(sandbox_prefix: str, timeout: float = 60) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        r = approvals("list", "--json")
        assert r.returncode == 0, r.stderr
        mine = [a for a in json.loads(r.stdout) if a["agent"] == sandbox_prefix]
        if mine:
            return mine[0]
        time.sleep(0.2)
    raise AssertionError(f"no pending approval for {sandbox_prefix}")


@pytest.mark.parametrize("mode, via", [("auto", "http"), ("legacy", "http"), ("auto", "stdio"), ("legacy", "stdio")])
def test_only_allowed_tools_are_listed_and_a_hidden_one_is_denied(env, mode, via):
    agent = write_agent(env, f"tl-{mode}-{via}")
    r = run_client(env, agent, [["list"], ["call", "t__echo", {"text": "hi there"}], ["call", "t__secret_tool", {}],
                                ["call", "secret_tool", {}], ["call", "nope__echo", {"text": "x"}]], mode, via=via)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    proto, listed, echo, hidden, bare, unknown = outputs(r.stdout)
    assert proto["protocol"] == ("2026-07-28" if mode == "auto" else "2025-11-25")
    assert "t__secret_tool" not in listed["tools"] and "t__echo" in listed["tools"]
    assert "agentvm__request_access" in listed["tools"]
    assert echo == {"ok": True, "text": "hi there"}
    assert "tools:not-allowed" in hidden["error"]
    assert "tools:not-allowed" in bare["error"] and "tools:unknown-server" in unknown["error"]
    res = last_json(r.stdout)
    log = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    calls = [(x["tool"], x["verdict"], x["rule"]) for x in log if x.get("phase") == "tool"]
    assert ("t__echo", "allow", "tools:allow:t:echo") in calls
    assert ("t__secret_tool", "deny", "tools:not-allowed") in calls
    assert all(x["policy"].startswith("sha256:") for x in log if x.get("phase") == "tool")
    # (issue 43) the agent's /mcp requests - HTTP and JSON-RPC - were parsed by the run's
    # confined gate worker, not by this root process; the tool gateway answered from here
    assert res["egress"]["gate"]["confined"] is True and res["egress"]["gate"]["uid"] != 0, res["egress"]["gate"]


def test_resources_and_prompts_follow_the_allowlist(env):
    agent = write_agent(env, "tres")
    r = run_client(env, agent, [["resources"], ["read", "note://public"], ["read", "note://private"], ["prompts"],
                                ["prompt", "t__summarize", {"text": "x"}], ["prompt", "t__exfiltrate", {}]])
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, res, public, private, prompts, ok, hidden = outputs(r.stdout)
    assert res == {"resources": ["note://public"]}
    assert public == {"text": "a public note"}
    assert "tools:resource-not-allowed" in private["error"]
    assert prompts == {"prompts": ["t__summarize"]}
    assert ok == {"text": "Summarize: x"}
    assert "tools:prompt-not-allowed" in hidden["error"]


def test_arguments_outside_their_constraints_are_denied(env):
    agent = write_agent(env, "targs")
    r = run_client(env, agent, [["call", "t__echo", {"text": "UPPER"}], ["call", "t__echo", {"text": "a" * 101}],
                                ["call", "t__echo", {"text": ["a", "list"]}], ["call", "t__read_file", {"path": "rel"}]])
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, upper, long_, smuggled, rel = outputs(r.stdout)
    for out in (upper, long_, smuggled):
        assert "tools:argument:text" in out["error"], out
    assert "tools:argument:path" in rel["error"]


def test_ask_then_approve_then_deny_and_both_are_audited(env):
    agent = write_agent(env, "task")
    p = run_client(env, agent, [["call", "t__write_file", {"path": "/x", "text": "one"}],
                                ["call", "t__write_file", {"path": "/x", "text": "two"}]], background=True)
    first = wait_pending("task")
    assert first["kind"] == "tool" and first["target"] == "t__write_file"
    assert json.loads(approvals("show", first["id"], "--json").stdout)["summary"]["preview"] == \
        '{"path": "/x", "text": "one"}'
    assert approvals("approve", first["id"], "--note", "fine").returncode == 0
    second = wait_pending("task")
    assert second["id"] != first["id"]
    assert approvals("deny", second["id"], "--note", "no").returncode == 0
    again = approvals("approve", second["id"])
    assert again.returncode != 0 and b"already denied" in again.stderr
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-3000:]
    _, ok, denied = outputs(out)
    assert ok == {"ok": True, "text": "wrote 3 bytes to /x"}
    assert "approval:denied" in denied["error"] and "by cli:" in denied["error"]
    audit = subprocess.run(agentvm_cmd() + ["audit", "show", "--json"], capture_output=True).stdout.decode()
    recs = [json.loads(ln) for ln in audit.splitlines()]
    for rid, state in ((first["id"], "approved"), (second["id"], "denied")):
        assert any(x["kind"] == "approval.requested" and x["data"]["id"] == rid for x in recs)
        ans = [x for x in recs if x["kind"] == "approval.answered" and x["data"]["id"] == rid]
        assert ans and ans[0]["data"]["state"] == state and ans[0]["actor"].startswith("cli:")


def test_ask_times_out_as_a_denial(env):
    agent = write_agent(env, "ttime", timeout="1s")
    r = run_client(env, agent, [["call", "t__write_file", {"path": "/x", "text": "late"}]])
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, out = outputs(r.stdout)
    assert "approval:timeout" in out["error"]
    rows = json.loads(approvals("list", "--all", "--json").stdout)
    mine = [a for a in rows if a["agent"] == "ttime"]
    assert mine and mine[0]["state"] == "expired" and mine[0]["by"] == "timeout"


def test_a_broken_tool_server_costs_only_its_calls(env):
    agent = write_agent(env, "tbroken")
    r = run_client(env, agent, [["call", "t__hang", {"seconds": 30}], ["call", "t__big", {"n": 100000}],
                                ["call", "t__crash", {}], ["call", "t__echo", {"text": "still here"}]])
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, hang, big, crash, echo = outputs(r.stdout)
    assert "tools:server-timeout" in hang["error"]
    assert "tools:result-too-large" in big["error"]
    assert "tools:server-exited" in crash["error"]
    # the crashed server is started again for the next call
    assert echo == {"ok": True, "text": "still here"}


def test_a_tool_server_flooding_its_output_is_cut_off_and_the_gateway_stays_small(env):
    """One endless line (256 MiB, no newline) from a tool server: the gateway reads at most its
    line limit (4 MiB here), stops that server, answers tools:server-flood, and starts it again
    for the next call. Measured: the largest RSS among the processes of the run (the gateway's
    among them; the server writes 1 MiB at a time and holds little)."""
    import resource  # noqa: F401 - read in the wrapper below

    agent = write_agent(env, "tflood")
    ops = [["call", "t__flood", {"mib": 256}], ["call", "t__echo", {"text": "still here"}]]
    argv = agentvm_cmd() + ["run", "-f", str(agent), "--json", "--", "python3", "/work/tools_client.py",
                            json.dumps(ops), "auto", "http"]
    wrapper = ("import json, resource, subprocess, sys\n"
               "r = subprocess.run(json.loads(sys.argv[1]), capture_output=True)\n"
               "sys.stdout.buffer.write(r.stdout)\n"
               "sys.stderr.buffer.write(r.stderr)\n"
               "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(r.returncode)\n")
    r = subprocess.run([sys.executable, "-c", wrapper, json.dumps(argv)], capture_output=True, timeout=150)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, flood, echo = outputs(r.stdout)
    assert "tools:server-flood" in flood.get("error", ""), (flood, r.stderr.decode()[-2000:])
    assert echo == {"ok": True, "text": "still here"}
    maxrss_mib = int(r.stderr.decode().rsplit("MAXRSS_KIB", 1)[1].split()[0]) / 1024
    assert maxrss_mib < 200, f"a process of the run grew to {maxrss_mib:.0f} MiB reading one line"


def test_the_tool_servers_sandbox_has_its_credential_and_the_agent_never_does(env):
    agent = write_agent(env, "tcred")
    marker = "agent-workspace-marker-" + secrets.token_hex(4)
    code = ["call", "t__fetch", {"url": f"https://api.test:{env['https']}/v1/me"}]
    r = run_client(env, agent, [code, ["call", "t__env_names", {}],
                                ["call", "t__read_file", {"path": "/home/agent/work/marker"}]],
                   timeout=150)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, fetched, names, ws = outputs(r.stdout)
    assert fetched == {"ok": True, "text": "token accepted"}, fetched  # the upstream saw the real value
    assert "TOOL_TOKEN" in names["text"]  # a placeholder, in the tool server's sandbox only
    assert REAL_TOKEN.encode() not in r.stdout + r.stderr
    # the agent's own sandbox: no tool credential, not even its placeholder
    mine = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--", "sh", "-c",
                                           f"env; echo {marker} > $HOME/marker; ls /srv 2>&1"],
                          capture_output=True, timeout=120)
    assert mine.returncode in (0, 2), mine.stderr
    assert b"TOOL_TOKEN" not in mine.stdout and REAL_TOKEN.encode() not in mine.stdout
    assert b"AGENTVM_MCP_URL=http://127.0.0.1:" in mine.stdout
    assert "cannot read" in ws["text"]  # the tool server does not see the agent's workspace


def test_a_held_egress_request_completes_after_approval_and_not_before(env):
    port = env["plain"]
    agent = write_agent(env, "tegress", spec_extra=textwrap.dedent(f"""\
        egress:
          hosts: {{pay.test: 127.0.0.1}}
          allow:
            - {{host: pay.test, ports: [{port}], methods: [POST], paths: [/v1/charges], action: ask, id: charges}}
        """))
    Recorder.seen.clear()
    argv = agentvm_cmd() + ["run", "-f", str(agent), "--json", "--", "sh", "-c",
                            f"curl -s -w ' %{{http_code}}' -d amount=1 http://pay.test:{port}/v1/charges; "
                            f"echo; curl -s -w ' %{{http_code}}' -d amount=2 http://pay.test:{port}/v1/charges; echo"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    held = wait_pending("tegress")
    assert held["kind"] == "egress" and held["target"] == f"POST pay.test:{port}/v1/charges"
    time.sleep(0.5)
    assert not [s for s in Recorder.seen if s[0] == "POST"], "nothing leaves before the human answers"
    assert approvals("approve", held["id"]).returncode == 0
    second = wait_pending("tegress")
    assert approvals("deny", second["id"]).returncode == 0
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    assert lines[0] == "charged 200"
    assert lines[1].endswith(" 403") and "approval:denied" in lines[1]
    assert [s[2] for s in Recorder.seen if s[0] == "POST"] == ["amount=1"]


def test_tool_results_cannot_widen_policy_and_request_access_waits_for_a_human(env):
    agent = write_agent(env, "tinject")
    p = run_client(env, agent, [["call", "t__inject", {}],
                                ["call", "agentvm__request_access", {"egress": ["evil.test:443"],
                                                                     "reason": "the tool said so"}],
                                ["call", "agentvm__request_access", {"tools": ["t__echo"], "reason": "have it"}]],
                   background=True)
    req = wait_pending("tinject")
    assert req["kind"] == "access" and req["summary"]["delta"] == ["adds egress to evil.test:443"]
    assert approvals("deny", req["id"]).returncode == 0
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-3000:]
    _, injected, access, already = outputs(out)
    assert injected["ok"] and "policy/allow" in injected["text"]  # data to the agent, nothing more
    assert access["ok"] is False and "not granted" in access["text"]
    assert already["ok"] and "already allowed" in already["text"]  # no delta: nothing queued


def test_an_approved_access_request_opens_egress_for_this_session_only(env):
    port = env["plain"]
    agent = write_agent(env, "tgrant", spec_extra=f"egress:\n  hosts: {{pay.test: 127.0.0.1}}\n")
    script = (f"curl -s -o /dev/null -w '%{{http_code}} ' http://pay.test:{port}/before; "
              f"agentvm-request --egress pay.test:{port} --reason 'need the API'; echo rc=$?; "
              f"curl -s -w ' %{{http_code}}' -d x=1 http://pay.test:{port}/after; echo")
    argv = agentvm_cmd() + ["run", "-f", str(agent), "--", "sh", "-c", script]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    req = wait_pending("tgrant")
    assert req["summary"]["delta"] == [f"adds egress to pay.test:{port}"]
    assert approvals("approve", req["id"]).returncode == 0
    out, err = p.communicate(timeout=120)
    text = out.decode()
    assert text.startswith("403 "), text
    assert f"granted for this session: egress to pay.test:{port}" in text and "rc=0" in text
    assert text.strip().endswith("charged 200"), text
    # a new session starts from the agent file again
    again = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--", "curl", "-s", "-o", "/dev/null", "-w",
                                            "%{http_code}", f"http://pay.test:{port}/x"], capture_output=True, timeout=120)
    assert again.stdout == b"403"


def test_a_pending_approval_survives_kill_9_of_its_holder_and_is_answered_as_expired(env, avm_home):
    agent = write_agent(env, "tkill", timeout="600s")
    p = run_client(env, agent, [["call", "t__write_file", {"path": "/x", "text": "held"}]], background=True)
    held = wait_pending("tkill")
    os.kill(p.pid, signal.SIGKILL)  # the process that holds the request (its gate and gateway)
    p.wait(30)
    rows = {a["id"]: a for a in json.loads(approvals("list", "--all", "--json").stdout)}
    got = rows[held["id"]]
    assert got["state"] == "expired" and got["by"] == "reaper" and "gone" in got["note"]
    ans = approvals("approve", held["id"])
    assert ans.returncode != 0 and b"already expired" in ans.stderr
    # whatever sandboxes the killed run left are reaped by the next run (existing stale-state GC)
    subprocess.run(agentvm_cmd() + ["run", "--", "true"], capture_output=True, timeout=60)


def test_through_the_daemon_a_pending_approval_survives_kill_9_of_the_daemon(env, avm_home):
    """`agentvm run` through the daemon: the daemon's gate hosts the gateway and holds the
    call. kill -9 of the daemon: the request is still in the queue, answered as expired by the
    restarted side (never lost, never allowed)."""
    up = subprocess.run(agentvm_cmd() + ["up"], capture_output=True, timeout=60)
    assert up.returncode == 0, up.stderr
    pidf = avm_home / "run" / "daemon.pid"
    try:
        agent = write_agent(env, "tdaemon", timeout="600s")
        r = run_client(env, agent, [["call", "t__echo", {"text": "via the daemon"}]])
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert outputs(r.stdout)[1] == {"ok": True, "text": "via the daemon"}
        p = run_client(env, agent, [["call", "t__write_file", {"path": "/x", "text": "held"}]], background=True)
        held = wait_pending("tdaemon")
        os.kill(int(pidf.read_text()), signal.SIGKILL)
        p.wait(60)
        rows = {a["id"]: a for a in json.loads(approvals("list", "--all", "--json").stdout)}
        got = rows[held["id"]]
        assert got["state"] == "expired" and got["by"] == "reaper", got
        restarted = subprocess.run(agentvm_cmd() + ["up"], capture_output=True, timeout=60)
        assert restarted.returncode == 0, restarted.stderr
        assert approvals("approve", held["id"]).returncode != 0
    finally:
        subprocess.run(agentvm_cmd() + ["down"], capture_output=True, timeout=60)
        if pidf.exists():
            try:
                os.kill(int(pidf.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def test_live_tool_policy_narrows_a_running_sandbox_at_once(env, avm_home):
    """`agentvm policy NAME tools deny|approve|allow SERVER__TOOL` on a daemon sandbox: the next
    call is decided under the change (and the change is audited); the SDK answers approvals."""
    import agentvm.sdk as sdk

    up = subprocess.run(agentvm_cmd() + ["up"], capture_output=True, timeout=60)
    assert up.returncode == 0, up.stderr
    try:
        agent = write_agent(env, "tlive")
        # a persistent sandbox whose agent waits for a go file between calls
        loop = ("import json,os,subprocess,sys,time\n"
                "for i in range(3):\n"
                "    while not os.path.exists(f'/home/agent/go{i}'): time.sleep(0.1)\n"
                "    r = subprocess.run(['python3', '/work/tools_client.py', json.dumps([['call', 't__echo', {'text': 'x'}]])],"
                " capture_output=True, text=True)\n"
                "    print('ROUND', i, r.stdout.splitlines()[-1], flush=True)\n"
                "time.sleep(600)\n")
        (env["dir"] / "live_agent.py").write_text(loop)
        spec = agent.read_text().replace("  limits: {timeout: 150s}", "  lifecycle: persistent\n  command: [python3, /work/live_agent.py]\n  limits: {timeout: 0}")
        agent.write_text(spec)
        assert subprocess.run(agentvm_cmd() + ["create", "-f", str(agent)], capture_output=True, timeout=60).returncode == 0
        assert subprocess.run(agentvm_cmd() + ["start", "tlive"], capture_output=True, timeout=60).returncode == 0

        def go(i):
            r = subprocess.run(agentvm_cmd() + ["exec", "tlive", "--", "touch", f"/home/agent/go{i}"], capture_output=True,
                               timeout=60)
            assert r.returncode == 0, r.stderr

        def rounds():
            return subprocess.run(agentvm_cmd() + ["logs", "tlive"], capture_output=True, timeout=30).stdout.decode()

        def wait_round(i):
            end = time.time() + 90
            while time.time() < end:
                for ln in rounds().splitlines():
                    if ln.startswith(f"ROUND {i} "):
                        return json.loads(ln.split(" ", 2)[2])
                time.sleep(0.2)
            raise AssertionError(rounds())

        go(0)
        assert wait_round(0) == {"ok": True, "text": "x"}
        r = subprocess.run(agentvm_cmd() + ["policy", "tlive", "tools", "deny", "t__echo"], capture_output=True, timeout=30)
        assert r.returncode == 0 and b"applied live" in r.stdout, r.stderr
        go(1)
        assert "tools:deny:t:echo" in wait_round(1)["error"]
        show = json.loads(subprocess.run(agentvm_cmd() + ["policy", "tlive", "show", "--json"], capture_output=True).stdout)
        assert show["tools"][0]["deny"] == ["echo"]
        # allow lifts the live deny, approve puts it before a human; the SDK answers
        assert subprocess.run(agentvm_cmd() + ["policy", "tlive", "tools", "allow", "t__echo"], capture_output=True).returncode == 0
        assert subprocess.run(agentvm_cmd() + ["policy", "tlive", "tools", "approve", "t__echo"], capture_output=True).returncode == 0
        go(2)
        held = wait_pending("tlive")
        assert [a["id"] for a in sdk.pending_approvals() if a["agent"] == "tlive"] == [held["id"]]
        assert sdk.approve(held["id"], "looks fine")["state"] == "approved"
        assert wait_round(2) == {"ok": True, "text": "x"}
        audit = subprocess.run(agentvm_cmd() + ["audit", "show", "--json"], capture_output=True).stdout.decode()
        changes = [json.loads(ln) for ln in audit.splitlines() if '"policy.change"' in ln and '"tlive"' in ln]
        assert [c["data"]["detail"]["action"] for c in changes if c["data"]["op"] == "tools"] == ["deny", "allow", "approve"]
        answered = [json.loads(ln) for ln in audit.splitlines() if held["id"] in ln and "approval.answered" in ln]
        assert answered and answered[0]["actor"].startswith("api:")
    finally:
        subprocess.run(agentvm_cmd() + ["stop", "tlive"], capture_output=True, timeout=60)
        subprocess.run(agentvm_cmd() + ["rm", "tlive"], capture_output=True, timeout=60)
        subprocess.run(agentvm_cmd() + ["down"], capture_output=True, timeout=60)


class RemoteMCP:
    """A remote streamable-HTTP MCP server over TLS on loopback (the SDK's app under uvicorn),
    answering only requests that carry the real token - which only the gate can add."""

    def __init__(self, cert: Path, key: Path):
        import socket

        import uvicorn
        from mcp.server.mcpserver import MCPServer
        from mcp.server.transport_security import TransportSecuritySettings

        srv = MCPServer("remote")

        @srv.tool()
        def shout(text: str) -> str:
            return text.upper()

        @srv.tool()
        def drop_tables() -> str:
            return "dropped"

        inner = srv.streamable_http_app(json_response=True, stateless_http=True,
                                        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        self.auth: list[str] = []

        async def app(scope, receive, send):
            if scope["type"] == "http":
                auth = dict(scope["headers"]).get(b"authorization", b"").decode()
                self.auth.append(auth)
                if auth != f"Bearer {REAL_TOKEN}":
                    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
                    await send({"type": "http.response.body", "body": b""})
                    return
            await inner(scope, receive, send)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", ssl_certfile=str(cert), ssl_keyfile=str(key), lifespan="on")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        end = time.time() + 20
        while not self.server.started and time.time() < end:
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def test_a_remote_server_is_reached_through_the_gate_with_its_token_swapped_in(env):
    d = env["dir"]
    remote = RemoteMCP(d / "ca" / "server.pem", d / "ca" / "server.key")
    try:
        agent = d / "tremote.yaml"
        agent.write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {{name: tremote}}
            spec:
              riskTier: L3
              limits: {{timeout: 150s}}
              mounts:
                - {{host: {d}, path: /work, mode: ro}}
                - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
              tools:
                - name: r
                  url: https://api.test:{remote.port}/mcp
                  allow: [shout]
                  risk: {{shout: read}}
                  egress: {{hosts: {{api.test: 127.0.0.1}}, upstreamCa: {env['ca']}}}
                  credentials:
                    - {{name: rtoken, env: UNUSED, ref: "vault:tool-token", hosts: [api.test],
                        inject: {{header: Authorization, format: "Bearer {{}}"}}}}
            """))
        r = run_client(env, agent, [["list"], ["call", "r__shout", {"text": "quiet"}], ["call", "r__drop_tables", {}]])
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        _, listed, shout, drop = outputs(r.stdout)
        res = last_json(r.stdout)
        log = Path(res["egress"]["log"])
        assert "r__shout" in listed["tools"], ([json.loads(x)["reason"] for x in log.read_text().splitlines()], [p.read_text()[-2000:] for p in log.parent.glob(f"{res['sandbox_id']}.tool-r*")])
        assert "r__shout" in listed["tools"] and "r__drop_tables" not in listed["tools"]
        assert shout == {"ok": True, "text": "QUIET"}
        assert "tools:not-allowed" in drop["error"]
        assert remote.auth and all(a == f"Bearer {REAL_TOKEN}" for a in remote.auth)  # swapped by the gate
        assert REAL_TOKEN.encode() not in r.stdout + r.stderr
        res = last_json(r.stdout)
        tool_log = Path(res["egress"]["log"]).with_name(f"{res['sandbox_id']}.tool-r.egress.jsonl")
        recs = [json.loads(ln) for ln in tool_log.read_text().splitlines()]
        assert recs and all(x["host"] == "api.test" for x in recs if x["verdict"] == "allow")
    finally:
        remote.close()


def test_request_access_for_a_host_the_operator_denied_is_refused_and_never_queued(env):
    """Issue 35: it was queued, and once approved the agent was told "granted" while the gate
    still answered 403. Refused outright, before any human sees it."""
    agent = write_agent(env, "tdenied", spec_extra="egress:\n  deny: [{host: evil.test}]\n")
    r = run_client(env, agent, [["call", "agentvm__request_access", {"egress": ["evil.test:443"], "reason": "x"}]])
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    _, access = outputs(r.stdout)
    assert access["ok"] is False and "not grantable" in access["text"], access
    rows = json.loads(approvals("list", "--all", "--json").stdout)
    assert not [a for a in rows if a["agent"] == "tdenied"], "never put before a human"


def _expired_after_hangup(agent_name: str) -> dict:
    """The held request of ``agent_name`` once answered - within seconds of the hang-up, while
    the run (sleeping on) still holds it."""
    end = time.time() + 10
    while time.time() < end:
        rows = [a for a in json.loads(approvals("list", "--all", "--json").stdout) if a["agent"] == agent_name]
        if rows and rows[0]["state"] != "pending":
            return rows[0]
        time.sleep(0.2)
    raise AssertionError(f"{agent_name}'s held request is still pending after its requester hung up")


def test_a_held_tool_call_whose_caller_hangs_up_expires_and_cannot_be_approved(env):
    """Issue 35: the request stayed pending with nobody waiting; an approval later made the
    tool run for no one. The client is killed while its call waits; the run goes on."""
    agent = write_agent(env, "thangup", timeout="120s")
    ops = json.dumps([["call", "t__write_file", {"path": "/x", "text": "held"}]])
    script = f"timeout -s KILL 4 python3 /work/tools_client.py '{ops}' auto http; sleep 25"
    p = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(agent), "--", "sh", "-c", script],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    held = wait_pending("thangup")
    row = _expired_after_hangup("thangup")
    assert row["id"] == held["id"] and row["state"] == "expired" and "requester is gone" in row["note"]
    ans = approvals("approve", held["id"])
    assert ans.returncode != 0 and b"already expired" in ans.stderr
    p.communicate(timeout=120)


def test_a_held_egress_request_whose_client_hangs_up_expires(env):
    port = env["plain"]
    agent = write_agent(env, "thangegress", timeout="120s", spec_extra=textwrap.dedent(f"""\
        egress:
          hosts: {{pay.test: 127.0.0.1}}
          allow:
            - {{host: pay.test, ports: [{port}], methods: [POST], paths: [/v1/charges], action: ask}}
        """))
    Recorder.seen.clear()
    script = f"curl -s -m 3 -d amount=9 http://pay.test:{port}/v1/charges; sleep 25"
    p = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(agent), "--", "sh", "-c", script],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    held = wait_pending("thangegress")
    row = _expired_after_hangup("thangegress")
    assert row["id"] == held["id"] and "requester is gone" in row["note"]
    assert approvals("approve", held["id"]).returncode != 0
    p.communicate(timeout=120)
    assert not [s for s in Recorder.seen if s[0] == "POST"], "nothing left for the upstream"
