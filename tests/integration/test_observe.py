"""Seeing and steering a real daemon: Prometheus metrics after real traffic (parsed with
prometheus-client's own parser, matched against the gate's decision log), the OCSF export, and
the web console driven in headless Chromium (Debian's package, through Playwright): it loads
without console errors, lists a running sandbox, shows a denial within a second, escapes what
a sandbox sends, refuses forged forms and foreign hosts, and a stop from it stops the sandbox
and lands on the audit chain with the console as the actor. Screenshots go to
``$AGENTVM_ARTIFACTS`` (default ``artifacts/console``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import agentvm_cmd, av, needs_root

pytestmark = [pytest.mark.integration, needs_root]

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(os.environ.get("AGENTVM_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts")) / "console"



def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def daemon_tcp(avm_home):
    port = free_port()
    av("up", "--listen", f"127.0.0.1:{port}")
    yield avm_home, port
    av("down", check=False)


def write_agent(tmp_path: Path, name: str, extra: str = "") -> Path:
    return helpers.write_agent(tmp_path, name, 'lifecycle: persistent\ncommand: ["/bin/sh", "-c", "exec sleep 600"]\n'
                               "limits: {disk: 16M}\n" + textwrap.dedent(extra))


def http(port: int, path: str, *, method: str = "GET", headers: dict | None = None, data: bytes | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=data, headers=headers or {})
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **kw):
        return None


def gate_log(home: Path, agent: str) -> list[dict]:
    out = []
    for f in (home / "logs").glob("*.egress.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("agent") == agent:
                out.append(rec)
    return out


# ------------------------------------------------------------------------------ metrics
def test_metrics_match_the_decision_log(daemon_tcp, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.integration.gate_upstreams import Upstream, sandbox_test_ca

    home, port = daemon_tcp
    ca, cert, key = sandbox_test_ca(tmp_path)
    up = Upstream(tls=(cert, key))
    try:
        av("secret", "set", "m-key", input=b"fake-metrics-key-0123456789")
        f = write_agent(tmp_path, "m-obs", f"""\
            riskTier: L3
            egress:
              hosts: {{api.test: 127.0.0.1, other.test: 127.0.0.1}}
              upstreamCa: {ca}
              allow: [{{host: api.test, ports: [{up.port}]}}, {{host: other.test, ports: [{up.port}]}}]
            credentials:
              - {{name: k, env: K, ref: "vault:m-key", hosts: [api.test], inject: {{header: X-Api-Key}}}}
            """)
        av("create", "-f", str(f), "--start")
        for i in range(3):
            r = av("exec", "m-obs", "--", "/bin/sh", "-c", f'curl -s -o /dev/null -w "%{{http_code}}" -H "X-Api-Key: $K" https://api.test:{up.port}/ok{i}')
            assert r.stdout == b"200", (r.stdout, f.read_text())
        for i in range(2):
            av("exec", "m-obs", "--", "curl", "-s", "-o", "/dev/null", f"http://denied-{i}.test/")
        # the placeholder sent to an allowed host it is not bound to: a leak, blocked
        av("exec", "m-obs", "--", "/bin/sh", "-c", f'curl -s -o /dev/null -H "X-Api-Key: $K" https://other.test:{up.port}/',
           check=False)
        assert len(up.requests_to("api.test")) == 3 and not up.requests_to("other.test")
        # without the token, the TCP listener refuses /metrics
        status, _, _ = http(port, "/metrics")
        assert status == 401
        token = (home / "daemon.token").read_text().strip()
        status, headers, body = http(port, "/metrics", headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        got: dict[tuple, float] = {}
        for s in fams["agentvm_egress_decisions"].samples:
            if s.labels["agent"] == "m-obs":
                got[(s.labels["verdict"], s.labels["rule"])] = s.value
        want: dict[tuple, float] = {}
        log = gate_log(home, "m-obs")
        for rec in log:
            n = rec.get("suppressed", 1) if rec["rule"] == "log:suppressed" else 1
            want[(rec["verdict"], rec["rule"])] = want.get((rec["verdict"], rec["rule"]), 0) + n
        assert got == want, (got, want)
        assert got[("deny", "default-deny")] == 2
        assert sum(v for (verdict, _), v in got.items() if verdict == "allow") == 3
        assert any(rule.startswith("credential:leak:") for (_, rule) in got)

        def sample(name, **labels):
            return sum(s.value for s in fams[name].samples
                       if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))

        assert sample("agentvm_credential_swaps", agent="m-obs", credential="k") == 3
        assert sample("agentvm_credential_leaks_blocked", agent="m-obs", where="request") >= 1
        # the upstream echoes the request's headers: the real key in each answer was scrubbed
        assert sample("agentvm_credential_leaks_blocked", agent="m-obs", where="response") == 3
        # bytes: the gate's counters (heads, bodies), counted as they move: more than the log's
        # per-request bodies, and at the end exactly what the session's run report says (below)
        assert sample("agentvm_egress_bytes", agent="m-obs", direction="out") > sum(r["bytes_out"] for r in log)
        hist = {s.name: s.value for s in fams["agentvm_gate_upstream_seconds"].samples}
        assert hist["agentvm_gate_upstream_seconds_count"] == 3
        assert 0 < hist["agentvm_gate_upstream_seconds_sum"] < 30
        running = [s for s in fams["agentvm_sandboxes"].samples if s.labels["state"] == "running"]
        assert running and running[0].value == 1
        assert sample("agentvm_sandbox_events", agent="m-obs", event="start") == 1
        assert fams["agentvm_audit_chain_valid"].samples[0].value == 1
        assert fams["agentvm_audit_records"].samples[0].value >= 5
        assert fams["agentvm_approvals_pending"].samples[0].value == 0
        # the unix socket serves the same exposition (the operator's own door, no token)
        r = subprocess.run(["curl", "-s", "--unix-socket", str(home / "run" / "agentvm.sock"), "http://d/metrics"],
                           capture_output=True, timeout=30)
        assert b"agentvm_egress_decisions_total" in r.stdout
        # the same decisions, exported for a SIEM (OCSF HTTP Activity), and the audit records (API Activity)
        lines = [json.loads(x) for x in av("audit", "export", "--format", "ocsf", "--sandbox", "m-obs").stdout.splitlines()]
        http_act = [e for e in lines if e["class_uid"] == 4002]
        api_act = [e for e in lines if e["class_uid"] == 6003]
        assert len(http_act) == len(log)
        denied = [e for e in http_act if e["action_id"] == 2]
        assert {e["dst_endpoint"]["hostname"] for e in denied} >= {"denied-0.test", "denied-1.test", "other.test"}
        assert all(e["disposition"] == "Blocked" and e["firewall_rule"]["uid"] for e in denied)
        allowed = [e for e in http_act if e["action_id"] == 1]
        assert len(allowed) == 3 and all(e["http_request"]["http_method"] == "GET" for e in allowed)
        assert all(e["unmapped"]["credentials"] == ["k"] for e in allowed)
        assert any(e["api"]["operation"] == "lifecycle.running" for e in api_act)
        assert all(e["metadata"]["version"].startswith("1.") and e["type_uid"] == 600300 + e["activity_id"]
                   for e in api_act)
        assert b"fake-metrics-key" not in av("audit", "export").stdout, "an export never carries a secret"
        # /metrics and the run report count the same bytes (one session: the worker's only run)
        av("stop", "m-obs")
        status, _, body = http(port, "/metrics", headers={"Authorization": f"Bearer {token}"})
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        status, _, body = http(port, "/v1/audit", headers={"Authorization": f"Bearer {token}"})
        exited = [r for r in json.loads(body) if r["kind"] == "run.exited" and r["data"].get("agent") == "m-obs"]
        assert len(exited) == 1, exited
        eg = exited[0]["data"]["egress"]
        assert eg["bytes_out"] > 0 and eg["bytes_in"] > 0
        assert sample("agentvm_egress_bytes", agent="m-obs", direction="out") == eg["bytes_out"]
        assert sample("agentvm_egress_bytes", agent="m-obs", direction="in") == eg["bytes_in"]
        av("rm", "m-obs", check=False)
    finally:
        up.close()


# ------------------------------------------------------------------------------ console (HTTP level)
def login(port: int) -> str:
    url = av("console").stdout.decode().strip()
    assert url.startswith(f"http://127.0.0.1:{port}/login?code=")
    return url


def test_console_refuses_what_it_must(daemon_tcp, tmp_path):
    home, port = daemon_tcp
    av("create", "-f", str(write_agent(tmp_path, "c-sec")), "--start")
    # no session: the login page, not the data
    status, headers, body = http(port, "/")
    assert status == 401 and b"c-sec" not in body and b"agentvm console" in body
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    # the API on TCP still wants the token (a console cookie is not an API credential)
    assert http(port, "/v1/sandboxes")[0] == 401
    url = login(port)
    code_path = url.split(str(port), 1)[1]
    status, headers, _ = http(port, code_path)
    assert status == 303
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    sid = cookie.split(";")[0]
    assert http(port, code_path)[0] == 401, "a login link works once"
    status, _, body = http(port, "/", headers={"Cookie": sid})
    assert status == 200 and b"c-sec" in body
    # DNS rebinding: a page of another name that resolves here gets nothing
    assert http(port, "/", headers={"Cookie": sid, "Host": f"evil.example:{port}"})[0] == 421
    # a forged form (no CSRF token, or another origin) changes nothing
    form = b"action=stop"
    st, _, body = http(port, "/sandboxes/c-sec/action", method="POST", data=form,
                       headers={"Cookie": sid, "Content-Type": "application/x-www-form-urlencoded"})
    assert st == 403 and b"CSRF" in body
    page = http(port, "/sandboxes/c-sec", headers={"Cookie": sid})[2].decode()
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    assert len(csrf) >= 20
    st, _, _ = http(port, "/sandboxes/c-sec/action", method="POST", data=f"action=stop&csrf={csrf}".encode(),
                    headers={"Cookie": sid, "Content-Type": "application/x-www-form-urlencoded",
                             "Origin": "http://evil.example"})
    assert st == 403
    ps = json.loads(av("ps", "--json").stdout)
    assert next(r for r in ps if r["name"] == "c-sec")["state"] == "running", "a refused form stopped nothing"
    # an oversized form is refused before it is read whole
    st, _, _ = http(port, "/sandboxes/c-sec/action", method="POST", data=b"x=" + b"a" * 200_000,
                    headers={"Cookie": sid, "Content-Type": "application/x-www-form-urlencoded"})
    assert st == 413
    # with the token, the console's own check passes without a cookie (curl, scripts)
    token = (home / "daemon.token").read_text().strip()
    assert http(port, "/audit", headers={"Authorization": f"Bearer {token}"})[0] == 200
    # the operator's unix socket gets the console too (no browser can reach it)
    r = subprocess.run(["curl", "-s", "--unix-socket", str(home / "run" / "agentvm.sock"), "http://d/"],
                       capture_output=True, timeout=30)
    assert b"c-sec" in r.stdout
    av("rm", "c-sec", check=False)


def test_console_login_needs_a_tcp_listener(avm_home):
    av("up")
    try:
        r = av("console", check=False)
        assert r.returncode == 78 and b"--listen" in r.stderr
    finally:
        av("down", check=False)


# ------------------------------------------------------------------------------ console (in Chromium)
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/install.sh --test installs it)")
def test_console_in_chromium(daemon_tcp, tmp_path):
    from playwright.sync_api import sync_playwright

    home, port = daemon_tcp
    av("create", "-f", str(write_agent(tmp_path, "c-web", "egress:\n  allow: [{host: allowed.test, ports: [443]}]\n")),
       "--start")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(login(port))
            assert page.url == f"http://127.0.0.1:{port}/"
            row = page.locator('#sandboxes tr[data-name="c-web"]')
            assert row.count() == 1 and "running" in row.inner_text()
            page.screenshot(path=str(ARTIFACTS / "sandboxes.png"), full_page=True)

            page.goto(f"http://127.0.0.1:{port}/decisions")
            page.wait_for_selector("#live:not([hidden])", timeout=5000)
            page.wait_for_function("document.getElementById('live').textContent === 'live'", timeout=5000)
            # a denial, with markup in its path: it must show, as text, within a second
            av("exec", "c-web", "--", "curl", "-s", "-o", "/dev/null", "http://denied-live.test/a<b/id=pwn>x</b>")
            seen = time.monotonic()
            page.wait_for_selector("#decisions tbody tr:has-text('denied-live.test')", timeout=1000)
            assert time.monotonic() - seen < 1.0
            first = page.locator("#decisions tbody tr").first.inner_text()
            assert "deny" in first and "default-deny" in first and "<b/id=pwn>" in first
            assert page.locator("#pwn").count() == 0, "a path from the sandbox became markup"
            page.screenshot(path=str(ARTIFACTS / "decisions.png"), full_page=True)
            # the server-rendered page escapes it too (a reload, no live stream involved)
            page.reload()
            assert page.locator("#pwn").count() == 0
            assert "<b/id=pwn>" in page.locator("#decisions tbody tr").first.inner_text()

            page.goto(f"http://127.0.0.1:{port}/sandboxes/c-web")
            assert "denied-live.test" in page.locator("#summary").inner_text()
            page.screenshot(path=str(ARTIFACTS / "sandbox.png"), full_page=True)
            page.click("#stop")
            page.wait_for_selector("#flash", timeout=30000)
            assert page.locator("#state").inner_text() == "stopped"

            page.goto(f"http://127.0.0.1:{port}/audit?sandbox=c-web")
            assert "Chain intact" in page.locator("#verify").inner_text()
            page.screenshot(path=str(ARTIFACTS / "audit.png"), full_page=True)
            page.goto(f"http://127.0.0.1:{port}/approvals")
            assert page.locator("#none-pending").count() == 1
            page.screenshot(path=str(ARTIFACTS / "approvals.png"), full_page=True)
        finally:
            browser.close()
    assert problems == [], problems
    ps = json.loads(av("ps", "--json").stdout)
    assert next(r for r in ps if r["name"] == "c-web")["state"] == "stopped"
    recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "c-web").stdout.splitlines()]
    assert any(r["kind"] == "lifecycle.stopped" and r["actor"] == "console" for r in recs)
    assert b"intact" in av("audit", "verify").stdout
    av("rm", "c-web", check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/install.sh --test installs it)")
def test_console_answers_an_approval(daemon_tcp, tmp_path):
    """An egress request held for a human (``action: ask``) shows on the approvals page; the
    Approve button releases it, and the answer is on the audit chain with the console's name."""
    from playwright.sync_api import sync_playwright

    from tests.integration.gate_upstreams import Upstream

    home, port = daemon_tcp
    up = Upstream()
    try:
        f = write_agent(tmp_path, "c-ask", f"""\
            riskTier: L3
            approvals: {{timeout: 60s}}
            egress:
              hosts: {{pay.test: 127.0.0.1}}
              allow:
                - {{host: pay.test, ports: [{up.port}], methods: [POST], paths: [/v1/charges], action: ask, id: charges}}
            """)
        av("create", "-f", str(f), "--start")
        held = subprocess.Popen(agentvm_cmd() + ["exec", "c-ask", "--", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                                 "-d", "amount=1", f"http://pay.test:{up.port}/v1/charges"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        problems: list[str] = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 700})
                page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
                page.on("pageerror", lambda e: problems.append(str(e)))
                page.goto(login(port))
                deadline = time.monotonic() + 20
                while page.locator("#pending tbody tr").count() == 0 and time.monotonic() < deadline:
                    page.goto(f"http://127.0.0.1:{port}/approvals")
                row = page.locator("#pending tbody tr").first
                assert "c-ask" in row.inner_text() and f"POST pay.test:{up.port}/v1/charges" in row.inner_text()
                assert not up.requests_to("pay.test"), "nothing leaves before the human answers"
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "approvals-pending.png"), full_page=True)
                row.locator("button", has_text="Approve").click()
                page.wait_for_selector("#flash", timeout=10000)
                assert page.locator("#none-pending").count() == 1
            finally:
                browser.close()
        out, err = held.communicate(timeout=60)
        assert out == b"200", (out, err)
        assert len(up.requests_to("pay.test")) == 1
        assert problems == [], problems
        recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "c-ask").stdout.splitlines()]
        answered = [r for r in recs if r["kind"] == "approval.answered"]
        assert answered and answered[-1]["data"]["state"] == "approved" and answered[-1]["actor"].startswith("console")
        av("rm", "c-ask", check=False)
    finally:
        up.close()


def test_an_approval_answered_from_the_cli_is_counted_and_attributed(daemon_tcp):
    """With a daemon up, `agentvm approvals approve` goes through it: counted in
    agentvm_approvals_total (and so traced: the same record stream), the CLI's user kept."""
    from prometheus_client.parser import text_string_to_metric_families

    from agentvm.approvals import open_store
    from agentvm.paths import default_paths

    home, port = daemon_tcp
    store = open_store(default_paths())
    req = store.submit(kind="tool", sandbox="s-1", agent="cli-appr", target="t__write", summary={"keys": []},
                       arg_digest="sha256:" + "2" * 64, policy="sha256:p", timeout=120)
    r = av("approvals", "approve", req.id, "--note", "ok", "--json")
    assert json.loads(r.stdout)["state"] == "approved"
    token = (home / "daemon.token").read_text().strip()
    _, _, body = http(port, "/metrics", headers={"Authorization": f"Bearer {token}"})
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    approved = [s.value for s in fams["agentvm_approvals"].samples
                if s.name == "agentvm_approvals_total" and s.labels.get("state") == "approved"]
    assert approved == [1.0], fams["agentvm_approvals"].samples
    recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines()]
    ans = [x for x in recs if x["kind"] == "approval.answered" and x["data"]["id"] == req.id]
    assert len(ans) == 1 and ans[0]["actor"].startswith("cli:") and ans[0]["actor"].endswith(" via api:operator")
    # an answer the daemon refuses keeps the embedded exit code (approvals.* exit 2)
    again = av("approvals", "deny", req.id, check=False)
    assert again.returncode == 2 and b"already approved" in again.stderr, again.stderr
