"""The observability pieces that need no daemon: the metrics observer (counts, bounded labels,
the exposition parsed back with prometheus-client's parser), the OCSF mapping, span path
templates, and the console's one-time login codes and sessions."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentvm.console.app import Sessions
from agentvm.observe import metrics as mx
from agentvm.observe import ocsf
from agentvm.observe.tracing import check_endpoint, path_template


def observer(**kw):
    return mx.Observer(sandboxes_by_state=kw.get("states", lambda: {"running": 2, "stopped": 1}),
                       approvals_pending=kw.get("pending", lambda: 3), audit_status=kw.get("audit", lambda: (42, True)))


def families(o):
    return {f.name: f for f in text_string_to_metric_families(o.exposition().decode())}


def value(fams, name, suffix="_total", **labels):
    return sum(s.value for s in fams[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_decisions_bytes_credentials_and_latency_are_counted():
    o = observer()
    o.observe({"kind": "egress", "agent": "a", "verdict": "allow", "rule": "api", "host": "api.test", "bytes_out": 10,
               "bytes_in": 200, "credentials": ["gh"], "upstream_ms": 12.5, "time": 1.0})
    o.observe({"kind": "egress", "agent": "a", "verdict": "deny", "rule": "credential:leak:gh", "host": "x.test",
               "credential": "gh", "alert": True, "time": 2.0})
    o.observe({"kind": "egress", "agent": "a", "verdict": "allow", "rule": "api", "host": "api.test", "scrubbed": 1,
               "alert": True, "time": 3.0})
    # a "log:suppressed" record stands for n denials the deny-log rate limit folded: counted as n
    o.observe({"kind": "egress", "agent": "a", "verdict": "deny", "rule": "log:suppressed", "suppressed": 7, "time": 4.0})
    f = families(o)
    assert value(f, "agentvm_egress_decisions", agent="a", verdict="allow", rule="api") == 2
    assert value(f, "agentvm_egress_decisions", agent="a", verdict="deny", rule="log:suppressed") == 7
    # a record's bytes_out/bytes_in are its request's body: the byte counters are the gate's own
    # (the run report's), counted by the daemon through count_bytes
    assert value(f, "agentvm_egress_bytes", agent="a", direction="in") == 0
    o.count_bytes("a", 573, 200)
    o.count_bytes("a", 27, 0)
    f = families(o)
    assert value(f, "agentvm_egress_bytes", agent="a", direction="out") == 600
    assert value(f, "agentvm_egress_bytes", agent="a", direction="in") == 200
    assert value(f, "agentvm_credential_swaps", agent="a", credential="gh") == 1
    assert value(f, "agentvm_credential_leaks_blocked", agent="a", where="request") == 1
    assert value(f, "agentvm_credential_leaks_blocked", agent="a", where="response") == 1
    assert value(f, "agentvm_gate_upstream_seconds", "_count") == 1
    assert value(f, "agentvm_gate_upstream_seconds", "_bucket", le="0.025") == 1
    assert value(f, "agentvm_gate_upstream_seconds", "_bucket", le="0.01") == 0
    assert value(f, "agentvm_sandboxes", "", state="running") == 2
    assert value(f, "agentvm_approvals_pending", "") == 3
    assert value(f, "agentvm_audit_records", "") == 42 and value(f, "agentvm_audit_chain_valid", "") == 1
    assert [h["host"] for h in o.egress_summary("a")] == ["api.test", "x.test"]
    assert o.egress_summary("a")[0]["allowed"] == 2 and o.egress_summary("a")[1]["denied"] == 1
    # hosts are never labels: a sandbox cannot mint series
    assert "api.test" not in o.exposition().decode()


def test_lifecycle_events_count_by_agent_and_labels_are_bounded(monkeypatch):
    o = observer()
    o.observe({"kind": "run.started", "sandbox": "w-1a2b3c4d", "agent": "w"})
    o.observe({"kind": "lifecycle.running", "sandbox": "w"})
    o.observe({"kind": "lifecycle.restart-scheduled", "sandbox": "w"})
    o.observe({"kind": "run.refused", "agent": "w"})
    o.observe({"kind": "approval.requested"})
    o.observe({"kind": "approval.answered", "state": "approved"})
    f = families(o)
    assert value(f, "agentvm_sandbox_events", agent="w", event="run") == 1
    assert value(f, "agentvm_sandbox_events", agent="w", event="start") == 1
    assert value(f, "agentvm_sandbox_events", agent="w", event="restart") == 1
    assert value(f, "agentvm_sandbox_events", agent="w", event="refused") == 1
    assert value(f, "agentvm_approvals", state="approved") == 1
    monkeypatch.setattr(mx, "MAX_AGENTS", 3)
    monkeypatch.setattr(mx, "MAX_HOSTS", 2)
    o = observer()
    for i in range(10):
        o.observe({"kind": "egress", "agent": f"a{i}", "verdict": "deny", "rule": "default-deny", "host": f"h{i}.test"})
        o.observe({"kind": "egress", "agent": "a0", "verdict": "deny", "rule": "default-deny", "host": f"h{i}.test"})
    f = families(o)
    agents = {s.labels["agent"] for s in f["agentvm_egress_decisions"].samples}
    assert agents == {"a0", "a1", "a2", "(other)"}
    assert value(f, "agentvm_egress_decisions", agent="(other)") == 7
    assert {h["host"] for h in o.egress_summary("a0")} == {"h0.test", "h1.test", "(other hosts)"}


def test_a_broken_collector_input_never_raises():
    o = observer(audit=lambda: (_ for _ in ()).throw(RuntimeError("db gone")))
    o.observe({"kind": "egress", "bytes_out": "not a number"})  # swallowed
    with pytest.raises(RuntimeError):
        o.exposition()  # a scrape of a broken chain is an error the daemon reports, not a 0
    v = mx.CachedVerify(lambda: (_ for _ in ()).throw(OSError("gone")), lambda: 5, every=3600)
    assert v() == (5, False), "a chain that cannot be read does not verify"


def test_ocsf_decision_and_audit_mapping():
    e = ocsf.decision({"time": 1700000000.5, "agent": "a", "sandbox": "a-1", "host": "x.test", "port": 443,
                       "method": "POST", "path": "/v1/charges", "rule": "default-deny", "verdict": "deny",
                       "reason": "no rule allows POST", "phase": "request"})
    assert (e["class_uid"], e["activity_id"], e["type_uid"]) == (4002, 6, 400206)
    assert (e["action_id"], e["disposition"], e["severity_id"], e["status_id"]) == (2, "Blocked", 3, 2)
    assert e["time"] == 1700000000500 and e["firewall_rule"]["uid"] == "default-deny"
    assert e["http_request"]["url"] == {"hostname": "x.test", "path": "/v1/charges", "port": 443}
    ok = ocsf.decision({"verdict": "allow", "rule": "api", "method": "GET", "host": "a.test", "credentials": ["k"],
                        "upstream_ms": 12.7, "bytes_in": 5})
    assert (ok["action_id"], ok["disposition_id"], ok["severity_id"], ok["duration"]) == (1, 1, 1, 12)
    assert ok["unmapped"]["credentials"] == ["k"] and ok["traffic"]["bytes_in"] == 5
    tunnel = ocsf.decision({"verdict": "allow", "rule": "api", "method": "CONNECT", "host": "a.test", "port": 443})
    assert tunnel["activity_id"] == 1
    ask = ocsf.decision({"verdict": "ask", "rule": "approval:pending", "method": "PUT"})
    assert ask["action_id"] == 99 and ask["unmapped"]["verdict"] == "ask"
    alert = ocsf.decision({"verdict": "deny", "rule": "credential:leak:k", "alert": True, "credential": "k"})
    assert alert["severity_id"] == 4 and alert["is_alert"] and alert["unmapped"]["credential"] == "k"
    a = ocsf.audit_record({"seq": 9, "time": 2.0, "kind": "policy.change", "actor": "console", "sandbox": "w",
                           "data": {"op": "deny"}, "prev": "p", "hash": "h"})
    assert (a["class_uid"], a["activity_id"], a["type_uid"]) == (6003, 3, 600303)
    assert a["actor"]["user"]["name"] == "console" and a["resources"] == [{"type": "sandbox", "name": "w"}]
    assert a["unmapped"]["hash"] == "h" and a["metadata"]["sequence"] == 9
    refused = ocsf.audit_record({"seq": 1, "kind": "run.refused", "actor": "agentvm"})
    assert refused["status_id"] == 2


def test_ocsf_reads_gate_logs_tolerating_a_torn_line():
    lines = ['{"time": 5, "agent": "a", "verdict": "deny"}', '{"time": 1, "agent": "a"}', '{"time": 9, "agent": "b"}',
             '{"time": 7, "agen']
    assert [r["time"] for r in ocsf.decisions_from_logs(lines, since=2)] == [5, 9]
    assert [r["time"] for r in ocsf.decisions_from_logs(lines, sandbox="a")] == [5, 1]


@pytest.mark.parametrize("path,want", [
    ("/v1/users/12345/files", "/v1/users/{id}/files"),
    ("/v1/x?token=sk-secret-value", "/v1/x"),
    ("/objects/0123456789abcdef0123", "/objects/{id}"),
    ("/r/123e4567-e89b-12d3-a456-426614174000", "/r/{id}"),
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/k/AKIAFAKEFAKEFAKEFAKEFAKE12", "/k/{id}"),
    ("", ""),
    ("*", "/"),
])
def test_span_paths_are_templates_without_identifiers_or_queries(path, want):
    assert path_template(path) == want


def test_otlp_endpoint_must_be_a_base_url():
    from agentvm.errors import ConfigError

    assert check_endpoint("http://127.0.0.1:4318/") == "http://127.0.0.1:4318"
    for bad in ("127.0.0.1:4318", "ftp://x", "http://", "http://u:p@x:4318", "http://x:4318/?a=1"):
        with pytest.raises(ConfigError):
            check_endpoint(bad)


def test_console_login_codes_work_once_and_expire(monkeypatch):
    from agentvm.console import app as capp

    s = Sessions()
    code = s.mint_code()
    got = s.redeem(code)
    assert got is not None and s.get(got[0]) is got[1] and len(got[1]["csrf"]) >= 20
    assert s.redeem(code) is None, "single use"
    assert s.redeem("guess") is None and s.get("guess") is None and s.get(None) is None
    code = s.mint_code()
    now = time.monotonic()
    monkeypatch.setattr(capp.time, "monotonic", lambda: now + capp.CODE_TTL + 1)
    assert s.redeem(code) is None, "expired"
    monkeypatch.setattr(capp.time, "monotonic", lambda: now + capp.SESSION_TTL + 10)
    assert s.get(got[0]) is None, "sessions expire"
    monkeypatch.setattr(capp.time, "monotonic", time.monotonic)
    idle = s.redeem(s.mint_code())[0]
    t0 = time.monotonic()
    monkeypatch.setattr(capp.time, "monotonic", lambda: t0 + capp.SESSION_IDLE / 2)
    assert s.get(idle) is not None, "use keeps a session alive"
    monkeypatch.setattr(capp.time, "monotonic", lambda: t0 + capp.SESSION_IDLE * 1.4)
    assert s.get(idle) is not None
    monkeypatch.setattr(capp.time, "monotonic", lambda: t0 + capp.SESSION_IDLE * 2.5)
    assert s.get(idle) is None and idle not in s.sessions, "an unused session ends"
    monkeypatch.setattr(capp.time, "monotonic", time.monotonic)
    sids = [s.redeem(s.mint_code())[0] for _ in range(capp.MAX_SESSIONS + 5)]
    assert len(s.sessions) == capp.MAX_SESSIONS and s.get(sids[0]) is None and s.get(sids[-1]) is not None
    for _ in range(100):
        s.mint_code()
    assert len(s.codes) <= 32, "unredeemed codes are bounded"


def test_trace_sampling_keeps_everything_but_plain_allowed_requests(monkeypatch):
    from agentvm.errors import ConfigError
    from agentvm.observe.tracing import Tracing, check_sample

    tr = Tracing("http://127.0.0.1:9", sample_allowed=0.0)
    try:
        got = []
        monkeypatch.setattr(tr, "submit", got.append)
        plain = {"kind": "egress", "verdict": "allow", "rule": "a"}
        kept = [{"kind": "egress", "verdict": "deny", "rule": "default-deny"},
                {"kind": "egress", "verdict": "allow", "rule": "a", "credentials": ["k"]},
                {"kind": "egress", "verdict": "allow", "rule": "a", "llm": {"model": "m"}},
                {"kind": "approval.requested", "id": "x"}, {"kind": "approval.answered", "id": "x"}]
        for rec in [plain] * 50 + kept + [{"kind": "lifecycle.running"}]:
            tr.observe(rec)
        assert [g[1] for g in got] == kept
    finally:
        tr.shutdown()
    for bad in ("x", -0.1, 1.5):
        with pytest.raises(ConfigError):
            check_sample(bad)
    assert check_sample("0.25") == 0.25


def test_a_relayed_export_is_marked_and_bombs_and_garbage_are_refused():
    import gzip

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agentvm.gate.telemetry import MAX_DECODED, ExportRefused, stamp

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in (("service.name", "mine"), ("agentvm.sandbox", "forged")):
        a = rs.resource.attributes.add()
        a.key, a.value.string_value = k, v
    out = ExportTraceServiceRequest()
    out.ParseFromString(stamp(gzip.compress(req.SerializeToString()), b"application/x-protobuf", b"gzip", "traces",
                              "sb-1", "ag"))
    attrs = {a.key: a.value for a in out.resource_spans[0].resource.attributes}
    assert attrs["agentvm.sandbox"].string_value == "sb-1" and attrs["agentvm.agent"].string_value == "ag"
    assert attrs["agentvm.relayed"].bool_value is True and attrs["service.name"].string_value == "mine"
    assert [a.key for a in out.resource_spans[0].resource.attributes].count("agentvm.sandbox") == 1
    bomb = gzip.compress(b"\0" * (MAX_DECODED + 1))
    for body, ctype, coding, why in [(bomb, b"application/x-protobuf", b"gzip", "inflates"),
                                     (b"not gzip", b"application/x-protobuf", b"gzip", "gzip"),
                                     (b"\xff\xff\xff", b"application/x-protobuf", b"", "not an OTLP"),
                                     (b"{", b"application/json", b"", "not an OTLP")]:
        with pytest.raises(ExportRefused, match=why):
            stamp(body, ctype, coding, "traces", "sb", "ag")
    rs.resource.attributes[0].value.string_value = "agent-vm"
    with pytest.raises(ExportRefused, match="agent-vm"):
        stamp(req.SerializeToString(), b"application/x-protobuf", b"", "traces", "sb", "ag")


def test_a_tiny_export_cannot_become_a_huge_one_and_look_alikes_are_refused():
    import gzip

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agentvm.gate.telemetry import ExportRefused, stamp

    amp = gzip.compress(b"\x0a\x00" * 200_000)  # 200k empty resources in a few hundred bytes
    assert len(amp) < 2000
    with pytest.raises(ExportRefused, match="resources"):
        stamp(amp, b"application/x-protobuf", b"gzip", "traces", "sb", "ag")
    for name in ("agent-vm ", "Agent\u2011VM", "agentvm"):
        req = ExportTraceServiceRequest()
        a = req.resource_spans.add().resource.attributes.add()
        a.key, a.value.string_value = "service.name", name
        with pytest.raises(ExportRefused, match="agent-vm"):
            stamp(req.SerializeToString(), b"application/x-protobuf", b"", "traces", "sb", "ag")
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    a = rs.resource.attributes.add()
    a.key, a.value.string_value = "service.name", "mine"
    sp = rs.scope_spans.add().spans.add()
    sp.name = "x"
    for k, v in (("agentvm.sandbox", "victim"), ("keep", "1")):
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = k, v
    out = ExportTraceServiceRequest()
    out.ParseFromString(stamp(req.SerializeToString(), b"application/x-protobuf", b"", "traces", "sb", "ag"))
    assert [kv.key for kv in out.resource_spans[0].scope_spans[0].spans[0].attributes] == ["keep"]


@pytest.mark.parametrize("name", [
    "agent\u2212vm",                      # MINUS SIGN
    "\u0430gent-vm",                      # Cyrillic a
    "\u0430\u0261\u0435\u0578\u0442-v\u043c",  # Cyrillic, Latin script g, Armenian vo
    "\u1d00\u0262\u1d07\u0274\u1d1b-\u1d20\u1d0d",  # small capitals
    "agent\u200b-vm", "AGENT\u2010VM", "\uff41gent-vm", "agent vm", "agentvm", "\U0001d41agent-vm",
])
def test_look_alikes_of_agent_vm_are_refused_by_their_confusable_skeleton(name):
    """Issue 35: a minus sign, Cyrillic or small-capital letters got past the check."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agentvm.gate.telemetry import ExportRefused, stamp

    req = ExportTraceServiceRequest()
    a = req.resource_spans.add().resource.attributes.add()
    a.key, a.value.string_value = "service.name", name
    with pytest.raises(ExportRefused, match="agent-vm"):
        stamp(req.SerializeToString(), b"application/x-protobuf", b"", "traces", "sb", "ag")


@pytest.mark.parametrize("name", ["my-agent", "agent-vn", "vm-agent", "agent-vm-client", "\u0430\u0433\u0435\u043d\u0442"])
def test_names_that_do_not_look_like_agent_vm_pass(name):
    from agentvm.gate.telemetry import _looks_like_ours

    assert not _looks_like_ours(name)


def test_skeleton_is_uts39():
    from agentvm.names import skeleton

    assert skeleton("p\u0430ypal") == skeleton("paypal")  # Cyrillic a
    assert skeleton("\u2212") == "-" and skeleton("rn") == skeleton("m")
    assert skeleton("\u0410\u0412\u0421") == "ABC"


def test_syscall_and_ssh_records_become_spans_of_the_sandbox_session(monkeypatch):
    """``syscall.*`` (agentvm.sysaudit) and ``ssh.*`` (the gate's ssh-agent) events are kept by
    the sampler and turned into spans of the sandbox's session, named after the record's kind."""
    from agentvm.observe.tracing import Tracing

    tr = Tracing("http://127.0.0.1:9", sample_allowed=0.0)
    try:
        spans = []

        class FakeSession:
            def span(self, name, start, end=None, attributes=None, parent=None, error=None):
                spans.append((name, attributes, error))

        monkeypatch.setattr(tr, "session", lambda sid: FakeSession() if sid == "s1" else None)
        tr._event({"kind": "syscall.denied", "sandbox": "s1", "syscall": "unshare", "errno": "EPERM", "pid": 7,
                   "argv": ["unshare", "-U", "true"], "args": {"flags": "CLONE_NEWUSER"}, "rule": "deny:unshare"})
        tr._event({"kind": "ssh.refuse", "sandbox": "s1", "verdict": "refuse", "key": "deploy", "host": "other.test",
                   "reason": "not listed"})
        tr._event({"kind": "syscall.denied", "sandbox": "elsewhere", "syscall": "mount"})
        assert [s[0] for s in spans] == ["syscall.denied", "ssh.refuse"]
        assert spans[0][1]["agentvm.syscall"] == "unshare" and spans[0][1]["agentvm.errno"] == "EPERM"
        assert spans[1][1]["server.address"] == "other.test" and spans[1][2] == "not listed"
        got = []
        monkeypatch.setattr(tr, "submit", got.append)
        tr.observe({"kind": "syscall.watched", "sandbox": "s1"})
        tr.observe({"kind": "ssh.sign", "sandbox": "s1"})
        tr.observe({"kind": "lifecycle.running"})
        assert [g[1]["kind"] for g in got] == ["syscall.watched", "ssh.sign"]
    finally:
        tr.shutdown()
