"""Playbooks for the gate's sans-IO exchange core: a script of events in, commands out.

No socket and no event loop: each test parses a request head the way the server does, runs
the flow of ``agentvm.gate.exchange`` and compares the commands it yields. The end-to-end
suites (``tests/integration/test_gate_e2e.py``, ``tests/attacks/test_network.py``) attack the
same rules through the real gate; these pin down the order of the decisions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentvm.gate import exchange as ex
from agentvm.gate import h1
from agentvm.gate.credentials import CredentialSet, compile_credentials, make_placeholder
from agentvm.gate.endpoint import TokenBucket
from agentvm.gate.policy import compile_egress
from agentvm.spec.loader import load_agent_text

from _spec_helpers import agent

SPEC = agent("""\
    spec:
      egress:
        allow:
          - {host: api.test, ports: [443], methods: [GET, POST], paths: ["/v1/**"], id: api}
          - {host: plain.test, ports: [80], id: plain}
          - {host: files.test, ports: [80], maxBody: 10, id: files}
          - {host: dns.test, ports: [80, 443], id: dns}
          - {host: ws.test, ports: [80], websocket: true, id: ws}
          - {host: spliced.test, ports: [443], id: spliced}
        deny:
          - {host: api.test, paths: ["/v1/admin/**"], id: no-admin}
        hosts:
          api.test: 10.0.0.5
          plain.test: 10.0.0.6
          files.test: 10.0.0.7
          ws.test: 10.0.0.8
          spliced.test: 10.0.0.9
    """)
POLICY = compile_egress(load_agent_text(SPEC, "a.yaml", preset_dirs=[]).spec.spec.egress)

REAL = "sk-REAL-fake-test-value-0123456789abcdef"


def endpoint(policy=POLICY, *, creds=None, paused=False, rate=1e9):
    return SimpleNamespace(policy=policy, creds=creds, paused=paused, bucket=TokenBucket(rate, rate), budget=None)


def credset(vault=lambda n: REAL):
    b = SimpleNamespace(
        name="api", env="API_KEY", ref="vault:api", hosts=["api.test", "ws.test"],
        inject=SimpleNamespace(header="Authorization", format="Bearer {}", basic=None, query=None), file=None,
        placeholder=SimpleNamespace(prefix="sk-", length=None, charset="alnum"), sigv4=None, hmac=None)
    bindings = compile_credentials([b])
    ph = {"api": make_placeholder(bindings[0], len(REAL))}
    return CredentialSet(bindings, ph, vault, lambda n: False), ph["api"]


def head(text: str) -> h1.ProxyRequest:
    """A request head as a client sends it (a Host header is added when the text has none)."""
    lines = text.split("\n")
    if not any(ln.lower().startswith("host:") for ln in lines[1:]):
        target = lines[0].split()[1]
        lines.insert(1, "Host: " + (target.split("/")[2] if "://" in target else target))
    raw = "\r\n".join(lines).encode() + b"\r\n\r\n"
    return h1.parse_head(raw)[0]


def play(flow, *answers):
    """Run ``flow``: every non-terminal command gets the next answer. -> the commands, in order."""
    cmds = []
    answers = list(answers)
    try:
        cmd = next(flow)
        while True:
            cmds.append(cmd)
            if isinstance(cmd, (ex.Deny, ex.Forward, ex.OpenTunnel, ex.ToTools, ex.ToTelemetry)):
                break
            cmd = flow.send(answers.pop(0))
    except StopIteration:
        pass
    assert not answers, f"answers left over: {answers}"
    return cmds


def only(cmds, kind):
    assert len(cmds) >= 1 and isinstance(cmds[-1], kind), cmds
    return cmds[-1]


# ---------------------------------------------------------------------------- plain requests


def test_allowed_request_to_a_static_host_is_forwarded_to_the_mapped_address_without_a_lookup():
    cmds = play(ex.request(endpoint(), head("GET http://plain.test/x?y=1 HTTP/1.1\nHost: plain.test"), scheme="http"))
    assert len(cmds) == 1
    fwd = only(cmds, ex.Forward)
    assert fwd.addr == "10.0.0.6" and fwd.decision.rule_id == "plain" and fwd.req.path == "/x?y=1" and fwd.sni is None


def test_no_rule_denies_with_the_flag_that_would_allow_it():
    d = only(play(ex.request(endpoint(), head("GET http://other.test/ HTTP/1.1"), scheme="http")), ex.Deny)
    assert (d.rule_id, d.status, d.phase, d.host, d.port) == ("default-deny", 403, "request", "other.test", 80)
    assert d.how_to_allow and "--allow other.test" in d.how_to_allow and d.respond


def test_admission_comes_first_pause_then_rate():
    req = head("GET http://plain.test/ HTTP/1.1")
    d = only(play(ex.request(endpoint(paused=True), req, scheme="http")), ex.Deny)
    assert d.rule_id == "paused"
    ep = endpoint(rate=1)
    assert isinstance(play(ex.request(ep, req, scheme="http"))[-1], ex.Forward)
    d = only(play(ex.request(ep, req, scheme="http")), ex.Deny)
    assert (d.rule_id, d.status) == ("limit:rate", 429)
    # a CONNECT takes a token too
    d = only(play(ex.connect(ep, head("CONNECT spliced.test:443 HTTP/1.1"))), ex.Deny)
    assert d.rule_id == "limit:rate" and d.method == "CONNECT"


def test_origin_form_to_the_proxy_is_a_bad_request_not_a_policy_decision():
    d = only(play(ex.request(endpoint(), head("GET / HTTP/1.1\nHost: plain.test"), scheme="http")), ex.Deny)
    assert (d.rule_id, d.status, d.answer) == ("bad-request:not-a-proxy-request", 400, "error")


def test_max_body_a_known_size_over_it_matches_no_rule_an_unknown_size_is_cut_by_the_relay():
    d = only(play(ex.request(endpoint(), head("POST http://files.test/up HTTP/1.1\nContent-Length: 11"), scheme="http")),
             ex.Deny)
    assert d.rule_id == "default-deny"
    fwd = only(play(ex.request(endpoint(), head("POST http://files.test/up HTTP/1.1\nContent-Length: 10"),
                               scheme="http")), ex.Forward)
    assert fwd.decision.rule_id == "files"
    fwd = only(play(ex.request(endpoint(), head("POST http://files.test/up HTTP/1.1\nTransfer-Encoding: chunked"),
                               scheme="http")), ex.Forward)
    assert fwd.max_body == 10 and fwd.decision.body_rule_id == "files"  # the relay cuts the body beyond it


def test_deny_rules_win_over_allow_rules():
    ep = endpoint()
    tun = ex.Tunnel("api.test", 443, "10.0.0.5", "api.test")
    d = only(play(ex.request(ep, head("GET /v1/admin/users HTTP/1.1\nHost: api.test"), scheme="https", tunnel=tun)),
             ex.Deny)
    assert d.rule_id == "no-admin"
    d = only(play(ex.request(ep, head("DELETE /v1/items HTTP/1.1\nHost: api.test"), scheme="https", tunnel=tun)),
             ex.Deny)
    assert d.rule_id == "default-deny"


# ---------------------------------------------------------------------------- resolution


def test_a_name_without_a_static_address_is_looked_up_and_every_answer_checked():
    req = head("GET http://dns.test/ HTTP/1.1")
    cmds = play(ex.request(endpoint(), req, scheme="http"), ex.Resolved(("127.0.0.1", "8.8.4.4")))
    assert cmds[0] == ex.Lookup("dns.test", 80)
    assert only(cmds, ex.Forward).addr == "8.8.4.4"  # the loopback answer is skipped, never used


@pytest.mark.parametrize("answer,rule", [
    (ex.LookupFailed("Name or service not known"), "dns-failure"),
    (ex.Resolved(("127.0.0.1",)), "address-class"),
    (ex.Resolved(("169.254.169.254",)), "address-class"),
    (ex.Resolved(("::ffff:10.0.0.1",)), "address-class"),
    (ex.Resolved(()), "dns-failure"),
])
def test_lookup_failures_and_internal_answers_deny(answer, rule):
    cmds = play(ex.request(endpoint(), head("GET http://dns.test/ HTTP/1.1"), scheme="http"), answer)
    assert isinstance(cmds[0], ex.Lookup)
    assert only(cmds, ex.Deny).rule_id == rule


def test_an_ip_literal_is_not_looked_up_and_still_checked():
    pol = compile_egress(None, extra_allow=["127.0.0.1:80"])
    fwd = only(play(ex.request(endpoint(pol), head("GET http://127.0.0.1/ HTTP/1.1"), scheme="http")), ex.Forward)
    assert fwd.addr == "127.0.0.1"  # a rule naming the IP literally allows it
    pol = compile_egress(None, extra_allow=["*.test:80"])
    d = only(play(ex.request(endpoint(pol), head("GET http://127.0.0.1/ HTTP/1.1"), scheme="http")), ex.Deny)
    assert d.rule_id != "allow"


# ---------------------------------------------------------------------------- inside a tunnel


TUN = ex.Tunnel("api.test", 443, "10.0.0.5", "api.test")


def test_requests_in_a_tunnel_reuse_the_connect_address_without_a_lookup():
    cmds = play(ex.request(endpoint(), head("GET /v1/items HTTP/1.1\nHost: api.test"), scheme="https", tunnel=TUN))
    fwd = only(cmds, ex.Forward)
    assert len(cmds) == 1 and fwd.addr == "10.0.0.5" and fwd.sni == "api.test" and fwd.req.port == 443


def test_the_tunnel_address_is_checked_again_under_the_live_policy():
    # the operator drops the static mapping: 10.0.0.5 is a private address again
    narrowed = compile_egress(load_agent_text("\n".join(ln for ln in SPEC.splitlines() if "api.test: 10.0.0.5" not in ln), "a.yaml",
                                              preset_dirs=[]).spec.spec.egress)
    d = only(play(ex.request(endpoint(narrowed), head("GET /v1/items HTTP/1.1\nHost: api.test"), scheme="https",
                             tunnel=TUN)), ex.Deny)
    assert d.rule_id == "address-class"


@pytest.mark.parametrize("text,rule", [
    ("GET /v1/x HTTP/1.1\nHost: evil.test", "host-mismatch"),  # domain fronting
    ("GET /v1/x HTTP/1.1\nHost: api.test:8443", "host-mismatch"),
    ("GET http://api.test/v1/x HTTP/1.1", "bad-request:absolute-form-in-tunnel"),
])
def test_a_request_in_a_tunnel_must_name_the_tunnel_host(text, rule):
    d = only(play(ex.request(endpoint(), head(text), scheme="https", tunnel=TUN)), ex.Deny)
    assert d.rule_id == rule


def test_host_without_a_port_in_a_tunnel_means_the_tunnel_port():
    fwd = only(play(ex.request(endpoint(), head("GET /v1/x HTTP/1.1\nHost: API.test."), scheme="https", tunnel=TUN)),
               ex.Forward)
    assert fwd.req.host == "api.test" and fwd.req.port == 443


# ---------------------------------------------------------------------------- credentials


def test_a_placeholder_is_swapped_only_on_a_terminated_request_to_its_bound_host():
    cs, ph = credset()
    req = head(f"GET /v1/me HTTP/1.1\nHost: api.test\nAuthorization: Bearer {ph}")
    fwd = only(play(ex.request(endpoint(creds=cs), req, scheme="https", tunnel=TUN)), ex.Forward)
    assert fwd.req.header(b"authorization") == f"Bearer {REAL}".encode() and fwd.swap.used == ["api"]
    assert ph.encode() not in repr(fwd.req.headers).encode()


def query_credset():
    b = SimpleNamespace(
        name="q", env="Q_KEY", ref="vault:q", hosts=["api.test"],
        inject=SimpleNamespace(header=None, format="{}", basic=None, query="key"), file=None,
        placeholder=SimpleNamespace(prefix="", length=None, charset="alnum"), sigv4=None, hmac=None)
    bindings = compile_credentials([b])
    ph = {"q": make_placeholder(bindings[0], len(REAL))}
    return CredentialSet(bindings, ph, lambda n: REAL, lambda n: False), ph["q"]


def test_a_query_string_swap_goes_on_the_wire_but_the_logged_request_keeps_the_placeholder():
    cs, ph = query_credset()
    req = head(f"GET /v1/search?key={ph}&a=1 HTTP/1.1\nHost: api.test")
    fwd = only(play(ex.request(endpoint(creds=cs), req, scheme="https", tunnel=TUN)), ex.Forward)
    assert REAL in fwd.req.path and ph not in fwd.req.path  # the wire
    assert ph in fwd.logged.path and REAL not in fwd.logged.path  # the log, the audit chain, the console


def test_a_denial_after_the_query_swap_logs_the_placeholder():
    cs, ph = query_credset()
    req = head(f"GET /v1/up?key={ph} HTTP/1.1\nHost: api.test")
    bad = ex.Tunnel("api.test", 443, "169.254.169.254", "api.test")  # refused when re-checked at request time
    d = only(play(ex.request(endpoint(creds=cs), req, scheme="https", tunnel=bad)), ex.Deny)
    assert d.rule_id == "address-class" and ph in d.path and REAL not in repr(d.log_fields())


@pytest.mark.parametrize("text", [
    "GET http://plain.test/ HTTP/1.1\nAuthorization: Bearer {ph}",  # unbound host
    "GET http://plain.test/?k={ph} HTTP/1.1",  # in the query
    "GET http://plain.test/ HTTP/1.1\nX-Other: {ph}",  # another header
])
def test_a_placeholder_anywhere_else_is_a_leak_and_never_forwarded(text):
    cs, ph = credset()
    d = only(play(ex.request(endpoint(creds=cs), head(text.format(ph=ph)), scheme="http")), ex.Deny)
    assert d.rule_id.startswith("credential:") and d.credential == "api" and d.alert
    assert d.how_to_allow is None  # nothing should allow a leak


def test_a_placeholder_in_a_plain_request_to_the_bound_host_is_a_leak_too():
    cs, ph = credset()
    pol = compile_egress(None, extra_allow=["api.test:80"], extra_hosts={"api.test": "10.0.0.5"})
    d = only(play(ex.request(endpoint(pol, creds=cs), head(f"GET http://api.test/ HTTP/1.1\nAuthorization: Bearer {ph}"),
                             scheme="http")), ex.Deny)
    assert d.rule_id.startswith("credential:")  # the real value never travels in clear text


def test_credentials_are_consulted_after_the_policy_decision():
    cs, ph = credset()
    d = only(play(ex.request(endpoint(creds=cs), head(f"GET http://other.test/ HTTP/1.1\nX: {ph}"), scheme="http")),
             ex.Deny)
    assert d.rule_id == "default-deny"


def test_a_vault_failure_fails_closed():
    def broken(name):
        raise OSError("vault is locked")

    cs, ph = credset(broken)
    req = head(f"GET /v1/me HTTP/1.1\nHost: api.test\nAuthorization: Bearer {ph}")
    d = only(play(ex.request(endpoint(creds=cs), req, scheme="https", tunnel=TUN)), ex.Deny)
    assert d.rule_id == "credential:unavailable" and "OSError" in d.reason and "locked" not in d.reason


def test_no_websocket_to_a_host_a_credential_is_bound_to():
    req = head("GET http://ws.test/s HTTP/1.1\nUpgrade: websocket\nConnection: Upgrade")
    assert isinstance(play(ex.request(endpoint(), req, scheme="http"))[-1], ex.Forward)
    cs, _ = credset()
    d = only(play(ex.request(endpoint(creds=cs), req, scheme="http")), ex.Deny)
    assert d.rule_id == "credential:uninspectable-websocket"


# ---------------------------------------------------------------------------- CONNECT


def test_a_denied_connect_is_answered_before_any_tls():
    cmds = play(ex.connect(endpoint(), head("CONNECT other.test:443 HTTP/1.1")))
    d = only(cmds, ex.Deny)
    assert len(cmds) == 1 and (d.rule_id, d.phase, d.method, d.respond) == ("default-deny", "connect", "CONNECT", True)


def test_connect_to_an_ip_literal_is_refused():
    d = only(play(ex.connect(endpoint(), head("CONNECT 10.0.0.9:443 HTTP/1.1"))), ex.Deny)
    assert d.rule_id == "ip-literal"


def test_host_only_rules_splice_with_the_decision_kept_for_live_policy_changes():
    cmds = play(ex.connect(endpoint(), head("CONNECT spliced.test:443 HTTP/1.1")), ex.Hello("spliced.test"))
    assert isinstance(cmds[0], ex.Accept)
    t = only(cmds, ex.OpenTunnel)
    assert t.kind == "splice" and t.tunnel == ex.Tunnel("spliced.test", 443, "10.0.0.9", "spliced.test")
    assert t.meta is not None and t.meta.sni == "spliced.test" and t.meta.phase == "clienthello"


def test_l7_rules_or_credentials_terminate():
    t = only(play(ex.connect(endpoint(), head("CONNECT api.test:443 HTTP/1.1")), ex.Hello("api.test")), ex.OpenTunnel)
    assert t.kind == "terminate"
    cs, _ = credset()
    t = only(play(ex.connect(endpoint(creds=cs), head("CONNECT spliced.test:443 HTTP/1.1")), ex.Hello("spliced.test")),
             ex.OpenTunnel)
    assert t.kind == "terminate"  # a sandbox holding placeholders gets every tunnel terminated


@pytest.mark.parametrize("hello,rule", [
    (ex.Hello("evil.test"), "sni-mismatch"),
    (ex.Hello(None), "no-sni"),
    (ex.NotTLS("record type 0x17"), "not-tls"),
])
def test_the_client_hello_must_name_the_connect_host(hello, rule):
    cmds = play(ex.connect(endpoint(), head("CONNECT spliced.test:443 HTTP/1.1")), hello)
    d = only(cmds, ex.Deny)
    assert d.rule_id == rule and d.phase == "clienthello" and not d.respond  # 200 was sent: no HTTP answer


def test_plain_http_inside_a_tunnel_is_decided_request_by_request():
    t = only(play(ex.connect(endpoint(), head("CONNECT plain.test:80 HTTP/1.1")), ex.PlainHTTP()), ex.OpenTunnel)
    assert t.kind == "plain" and t.tunnel.addr == "10.0.0.6"
    d = only(play(ex.request(endpoint(), head("GET / HTTP/1.1\nHost: evil.test"), scheme="http", tunnel=t.tunnel)),
             ex.Deny)
    assert d.rule_id == "host-mismatch"


def test_a_client_that_leaves_after_200_ends_the_flow_quietly():
    assert play(ex.connect(endpoint(), head("CONNECT spliced.test:443 HTTP/1.1")), None) == [ex.Accept()]


def test_a_placeholder_in_the_connect_host_or_the_sni_is_a_leak():
    cs, ph = credset()
    pol = compile_egress(None, extra_allow=["*.test:443"])
    d = only(play(ex.connect(endpoint(pol, creds=cs), head(f"CONNECT {ph.lower()}.test:443 HTTP/1.1"))), ex.Deny)
    assert d.rule_id.startswith("credential:") and d.phase == "connect" and d.alert
    cmds = play(ex.connect(endpoint(creds=cs), head("CONNECT spliced.test:443 HTTP/1.1")), ex.Hello(f"{ph}.test"))
    d = only(cmds, ex.Deny)
    assert d.rule_id.startswith("credential:") and d.phase == "clienthello" and not d.respond


# ---------------------------------------------------------------------------- smuggling


@pytest.mark.parametrize("raw,code", [
    (b"POST http://plain.test/ HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n", "cl-and-te"),
    (b"POST http://plain.test/ HTTP/1.1\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\n", "duplicate-content-length"),
    (b"POST http://plain.test/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "bad-transfer-encoding"),
    (b"POST http://plain.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n chunked\r\n\r\n", "obs-fold"),
    (b"GET http://plain.test/ HTTP/1.1\r\nX: a\nHost: evil.test\r\n\r\n", "bare-lf"),
    (b"GET http://plain.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n", "host-mismatch"),
    (b"GET http://plain.test@evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n", "bad-authority"),
    (b"GET https://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n\r\n", "https-absolute-form"),
    (b"GET http://plain.test/ HTTP/1.1\r\nX: \x00\r\n\r\n", "bad-bytes"),
])
def test_smuggling_prone_heads_never_reach_a_flow(raw, code):
    with pytest.raises(h1.ProtocolError) as err:
        h1.parse_head(raw)
    d = only(play(ex.refuse(ex.bad_request(err.value))), ex.Deny)
    assert (d.rule_id, d.status, d.answer) == (f"bad-request:{code}", 400, "error")


# ---------------------------------------------------------------------------- held requests and the tool gateway's door

ASK = compile_egress(load_agent_text(agent("""\
    spec:
      egress:
        allow:
          - {host: pay.test, ports: [80], methods: [POST], paths: ["/v1/charges"], action: ask, id: charges}
          - {host: pay.test, ports: [80], methods: [GET], id: read}
        hosts: {pay.test: 10.0.0.5}
    """), "a.yaml", preset_dirs=[]).spec.spec.egress)


def test_an_ask_rule_holds_the_request_and_only_an_approval_forwards_it():
    req = head("POST http://pay.test/v1/charges HTTP/1.1\nContent-Length: 3")
    cmds = play(ex.request(endpoint(ASK), req, scheme="http"), ex.Answered(True, "approval:approved", "ok", "apr-1"))
    hold, fwd = cmds
    assert isinstance(hold, ex.Hold) and hold.decision.verdict == "ask" and hold.decision.rule_id == "charges"
    assert isinstance(fwd, ex.Forward) and fwd.decision.allowed and "apr-1" in fwd.decision.reason
    for answer, rid in ((ex.Answered(False, "approval:denied", "no"), "approval:denied"),
                        (ex.Answered(False, "approval:timeout", "late"), "approval:timeout"),
                        (None, "approval:unavailable"), ("garbage", "approval:unavailable")):
        d = only(play(ex.request(endpoint(ASK), req, scheme="http"), answer), ex.Deny)
        assert d.rule_id == rid and d.status == 403
    # a request the ask rule does not match is decided as usual, never held
    assert isinstance(play(ex.request(endpoint(ASK), head("GET http://pay.test/v1/charges HTTP/1.1"), scheme="http"))[0],
                      ex.Forward)


def test_an_ask_rule_makes_the_gate_terminate_tls_so_each_request_can_be_held():
    policy = compile_egress(load_agent_text(agent("""\
        spec:
          egress:
            allow: [{host: pay.test, ports: [443], action: ask}]
        """), "a.yaml", preset_dirs=[]).spec.spec.egress)
    assert policy.needs_termination("pay.test", 443)


def test_mcp_on_the_proxy_port_goes_to_the_tool_gateway_only_when_tools_are_declared():
    req = head("POST /mcp HTTP/1.1\nHost: 127.0.0.1:3128\nContent-Length: 2")
    ep = endpoint()
    ep.tools = None
    d = only(play(ex.request(ep, req, scheme="http")), ex.Deny)
    assert (d.rule_id, d.status) == ("tools:none", 404)
    ep.tools = object()
    cmd = play(ex.request(ep, req, scheme="http"))[-1]
    assert isinstance(cmd, ex.ToTools) and cmd.req is req
    for other in ("POST /mcpx HTTP/1.1", "POST /other/mcp HTTP/1.1"):
        d = only(play(ex.request(ep, head(other + "\nHost: 127.0.0.1:3128"), scheme="http")), ex.Deny)
        assert d.rule_id == "bad-request:not-a-proxy-request"
    # absolute-form to a host named like the door is egress, decided by policy
    d = only(play(ex.request(ep, head("POST http://mcp.test/mcp HTTP/1.1"), scheme="http")), ex.Deny)
    assert d.rule_id == "default-deny"
    # admission still comes first: a paused sandbox reaches no tools either
    ep.paused = True
    assert only(play(ex.request(ep, req, scheme="http")), ex.Deny).rule_id == "paused"


def test_otlp_on_the_proxy_port_is_relayed_only_to_the_daemons_collector():
    """The agent's own OpenTelemetry export: POST /otlp/v1/<signal> goes to the relay when the
    daemon has a collector; without one, or for anything else under /otlp, a 404 that says so."""
    req = head("POST /otlp/v1/traces HTTP/1.1\nHost: 127.0.0.1:3128\nContent-Length: 2")
    ep = endpoint()
    ep.tools = None
    ep.gate = SimpleNamespace(telemetry=None)
    d = only(play(ex.request(ep, req, scheme="http")), ex.Deny)
    assert (d.rule_id, d.status, d.how_to_allow) == ("telemetry:not-configured", 404, None)
    ep.gate.telemetry = object()
    for signal in ("traces", "metrics", "logs"):
        r = head(f"POST /otlp/v1/{signal} HTTP/1.1\nHost: 127.0.0.1:3128\nContent-Length: 2")
        cmd = only(play(ex.request(ep, r, scheme="http")), ex.ToTelemetry)
        assert cmd.signal == signal and cmd.req is r
    for bad in ("GET /otlp/v1/traces HTTP/1.1", "POST /otlp/v1/profiles HTTP/1.1", "POST /otlp/v2/traces HTTP/1.1",
                "POST /otlp HTTP/1.1", "POST /otlp/v1/traces/../../x HTTP/1.1"):
        d = only(play(ex.request(ep, head(bad + "\nHost: 127.0.0.1:3128\nContent-Length: 0"), scheme="http")), ex.Deny)
        assert d.rule_id == "telemetry:bad-request", bad
    # the pause (admission) comes first: a paused sandbox exports nothing either
    ep.paused = True
    d = only(play(ex.request(ep, req, scheme="http")), ex.Deny)
    assert d.rule_id == "paused"
    # absolute-form to a host is egress, decided by policy, not the relay
    ep.paused = False
    d = only(play(ex.request(ep, head("POST http://collector.test/otlp/v1/traces HTTP/1.1\nContent-Length: 0"),
                             scheme="http")), ex.Deny)
    assert d.rule_id == "default-deny"


# ---------------------------------------------------------------------------- LLM budgets


def test_a_metered_request_is_reserved_last_and_carries_its_reservation(tmp_path):
    from agentvm.gate.budget import Budget, BudgetSpec

    budget = Budget("b", BudgetSpec(requests=1, hosts=("api.test",)), None)
    ep = endpoint()
    ep.budget = budget
    fwd = only(play(ex.request(ep, head("GET /v1/x HTTP/1.1\nHost: api.test"), scheme="https", tunnel=TUN)),
               ex.Forward)
    assert fwd.budget is budget and budget.ledger.inflight == 1
    d = only(play(ex.request(ep, head("GET /v1/y HTTP/1.1\nHost: api.test"), scheme="https", tunnel=TUN)), ex.Deny)
    assert d.rule_id == "budget:reserved" and b"x-should-retry: true" in d.as_http1().lower()
    # a request the policy denies takes no reservation
    d = only(play(ex.request(ep, head("GET /v1/admin/z HTTP/1.1\nHost: api.test"), scheme="https", tunnel=TUN)),
             ex.Deny)
    assert d.rule_id == "no-admin" and budget.ledger.inflight == 1
    budget.add("m", 1, 1, False)
    d = only(play(ex.request(ep, head("GET /v1/y HTTP/1.1\nHost: api.test"), scheme="https", tunnel=TUN)), ex.Deny)
    assert d.rule_id == "budget:exceeded" and b"x-should-retry: false" in d.as_http1().lower()


def test_a_websocket_to_a_metered_api_is_refused():
    from agentvm.gate.budget import Budget, BudgetSpec

    ep = endpoint()
    ep.budget = Budget("b", BudgetSpec(tokens=10, hosts=("ws.test",)), None)
    d = only(play(ex.request(ep, head("GET http://ws.test/ HTTP/1.1\nUpgrade: websocket\nConnection: Upgrade\n"
                                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\nSec-WebSocket-Version: 13"),
                             scheme="http")), ex.Deny)
    assert d.rule_id == "budget:websocket" and ep.budget.ledger.inflight == 0
