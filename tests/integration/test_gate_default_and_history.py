"""Every sandbox routes through the gate (no rules = deny, explained, logged); `--network none`
has no route at all; every run is on the audit chain, listed by `agentvm runs`, and
`agentvm logs RUN` shows an embedded run's history without a daemon."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from tests.helpers import last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]

CURL = "curl -sS -m 10 -o /tmp/body -D - http://{host}:{port}/probe; echo CURL=$?"


@pytest.fixture
def listener():
    """A loopback HTTP server that counts connections: nothing may reach it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    hits = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            hits.append(1)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1], hits
    srv.close()


def test_no_egress_rules_still_go_through_the_gate_and_are_denied_and_logged(agentvm, listener):
    port, hits = listener
    r = agentvm("run", "--json", "--", "/bin/sh", "-c", CURL.format(host="example.com", port=port))
    out = r.stdout.decode()
    assert "403" in out.splitlines()[0] and "x-agentvm-denied" in out.lower(), (out, r.stderr)
    res = last_json(r.stdout)
    denied = res["egress"]["denied"]
    assert denied and denied[0]["target"] == f"example.com:{port}", res["egress"]
    assert "--allow example.com" in denied[0]["how_to_allow"], denied
    log = [json.loads(x) for x in open(res["egress"]["log"]).read().splitlines() if x]
    assert any(x["verdict"] == "deny" and x["host"] == "example.com" for x in log), log
    plain = agentvm("run", "--", "/bin/sh", "-c", CURL.format(host="example.com", port=port))
    assert f"denied example.com:{port}".encode() in plain.stderr and b"to allow it: --allow example.com" in plain.stderr
    assert not hits


def test_network_none_has_no_route_at_all(agentvm, listener):
    port, hits = listener
    r = agentvm("run", "--network", "none", "--json", "--", "/bin/sh", "-c",
                "env | grep -ci proxy; " + CURL.format(host="127.0.0.1", port=port)
                + "; python3 -c \"import socket; socket.create_connection(('10.0.0.1', 80), timeout=2)\" 2>&1 | tail -1")
    out = r.stdout.decode()
    assert out.startswith("0\n"), out  # no proxy variables
    assert "CURL=7" in out and "unreachable" in out.lower(), out
    assert last_json(r.stdout)["egress"] is None
    assert not hits
    bad = agentvm("run", "--network", "none", "--allow", "example.com", "--", "true")
    assert bad.returncode == 78 and b"no route out" in bad.stderr, bad.stderr


def test_runs_lists_embedded_runs_and_logs_shows_one(agentvm, avm_home):
    ids = []
    for cmd in ("exit 0", "exit 3", "curl -s -m 5 http://example.org/x >/dev/null; exit 0"):
        r = agentvm("run", "--json", "--", "/bin/sh", "-c", cmd)
        ids.append(last_json(r.stdout)["sandbox_id"])
    refused = agentvm("run", "--mount", "/:/host", "--", "true")
    assert refused.returncode == 77
    r = agentvm("runs", "--json", "-n", "10")
    assert r.returncode == 0, r.stderr
    runs = [json.loads(x) for x in r.stdout.decode().splitlines()]
    by = {x["run"]: x for x in runs}
    assert [by[i]["exit_code"] for i in ids] == [0, 3, 0], runs
    assert all(by[i]["duration"] is not None and by[i]["duration"] >= 0 for i in ids)
    assert by[ids[2]]["egress"]["denied"] == 1 and by[ids[2]]["egress"]["denied_hosts"] == ["example.org:80"]
    assert runs[0].get("refused") == "policy.grant-forbidden", runs[0]
    assert [x["run"] for x in runs if x["run"] in ids] == ids[::-1], "newest first"
    table = agentvm("runs").stdout.decode()
    assert ids[1] in table and "exit 3" in table
    lg = agentvm("logs", ids[2], env={"AGENTVM_NO_DAEMON": "1"})
    text = lg.stdout.decode()
    assert lg.returncode == 0 and "run.started" in text and "run.exited" in text, (text, lg.stderr)
    assert "egress deny" in text and "example.org:80" in text, text
    v = agentvm("audit", "verify", "--file", str(avm_home / "audit" / "audit.db"))
    assert v.returncode == 0 and b"intact" in v.stdout
