"""agentvm.gate.policy: host normalization, matching, decide() and check_address() tables,
compilation from real specs and CLI extras, fail-closed behaviour, and property tests."""

from __future__ import annotations

import ipaddress
import json
import string
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentvm.gate.policy as gp
from agentvm.gate.policy import (
    Decision,
    EgressLimits,
    EgressPolicy,
    RequestMeta,
    Rule,
    canonical_path,
    check_address,
    compile_egress,
    decide,
    host_matches,
    normalize_host,
    normalize_pattern,
    parse_authority,
    path_matches,
)
from agentvm.spec.loader import builtin_preset_dir, load_agent_text

from _spec_helpers import agent

SPEC = agent("""\
    spec:
      egress:
        allow:
          - {host: allowed.com}
          - {host: "*.wild.com", id: wild}
          - {host: api.example.com, methods: [GET, HEAD], paths: ["/repos/*", "/orgs/**"], id: api-read}
          - {host: api.example.com, methods: [POST], paths: ["/upload"], maxBody: 1000, id: api-upload}
          - {host: ws.example.com, websocket: true, id: ws}
          - {host: 10.0.0.5, ports: [8080], id: ip-ok}
          - {host: "2001:db8::5", id: ip6-ok}
          - {host: plain.example.com, ports: [80], id: plain}
          - {host: multi.example.com, ports: [443, 8443], id: multi}
          - {host: files.example.com, id: files}
          - {host: any.example.com, id: any-example}
          - {host: xn--bc-uia.de, id: idn}
          - {host: npm.example.org, paths: ["/pkg/**"], id: npm-paths}
          - {host: npm.example.org, id: npm-all}
        deny:
          - {host: api.example.com, paths: ["/admin/**"], id: no-admin}
          - {host: "*.example.com", methods: [DELETE], id: no-delete}
          - {host: blocked.wild.com, id: blocked}
          - {host: files.example.com, maxBody: 100, id: files-cap}
          - {host: any.example.com, websocket: true, id: no-ws}
          - {host: "*.example.com", ports: [8443], id: no-8443}
        hosts:
          internal.corp: 10.1.2.3
          Local.Test.: 127.0.0.1
      """)


@pytest.fixture(scope="module")
def pol() -> EgressPolicy:
    la = load_agent_text(SPEC, "a.yaml", preset_dirs=[])
    return compile_egress(la.spec.spec.egress)


SAME = object()


def C(host, port=443, sni=SAME, phase="clienthello"):
    """A connect-level meta; by default after the ClientHello peek with SNI == host."""
    if sni is SAME:
        sni = host if phase == "clienthello" else None
    return RequestMeta(host=host, port=port, scheme="connect", sni=sni, phase=phase)


def R(host, method="GET", path="/", port=443, scheme="https", sni=SAME, body=None, ws=False):
    """A request-phase meta; https carries the tunnel SNI (== host unless given)."""
    if sni is SAME:
        sni = host if scheme == "https" else None
    return RequestMeta(host=host, port=port, scheme=scheme, method=method, path=path,
                       body_size=body, sni=sni, websocket=ws)


# ---------------------------------------------------------------------------- normalize_host

NORMALIZE_OK = [
    ("example.com", "example.com"),
    ("EXAMPLE.COM", "example.com"),
    ("Example.Com.", "example.com"),
    ("a-b.c-d.example", "a-b.c-d.example"),
    ("localhost", "localhost"),
    ("123.example.com", "123.example.com"),
    ("0x7f.example.com", "0x7f.example.com"),
    ("äbc.de", "xn--bc-uia.de"),
    ("ÄBC.de", "xn--bc-uia.de"),
    ("аllowed.com", "xn--llowed-2nf.com"),  # Cyrillic a
    ("xn--bc-uia.DE", "xn--bc-uia.de"),
    ("1.2.3.4", "1.2.3.4"),
    ("0.0.0.0", "0.0.0.0"),
    ("255.255.255.255", "255.255.255.255"),
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("[0:0::1]", "::1"),
    ("[2001:DB8::1]", "2001:db8::1"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1"),
    ("a" * 63 + ".com", "a" * 63 + ".com"),
    (".".join(["a" * 61] * 4), ".".join(["a" * 61] * 4)),  # 247 chars
]


@pytest.mark.parametrize("raw,want", NORMALIZE_OK)
def test_normalize_host_ok(raw, want):
    assert normalize_host(raw) == want
    assert normalize_host(want) == want  # idempotent


NORMALIZE_BAD = [
    "",
    ".",
    "..",
    "a..b",
    ".example.com",
    "example.com..",
    "allowed.com@evil.com",
    "user@allowed.com",
    "allowed.com%2eevil.com",
    "allowed.com\x00.evil.com",
    "allowed.com\r\nx",
    "allowed .com",
    " allowed.com",
    "allowed.com/",
    "allowed.com\\evil.com",
    "allowed.com:443",
    "allowed.com:",
    "*.allowed.com",
    "*",
    "allowed.com#",
    "allowed.com?",
    "-a.com",
    "a-.com",
    "a_b.com",
    "a" * 64 + ".com",
    ".".join(["a" * 62] * 4) + ".com",  # > 253
    "2130706433",
    "0x7f.1",
    "017700000001",
    "127.1",
    "127.0.1",
    "0x7f000001",
    "0177.0.0.1",
    "127.000.000.001",
    "01.2.3.4",
    "256.1.1.1",
    "1.2.3.4.5",
    "1.2.3.4.",
    "example.123",
    "example.0x1f",
    "[127.0.0.1]",
    "[::1",
    "::1]",
    "[[::1]]",
    "[fe80::1%eth0]",
    "fe80::1%25eth0",
    "1:2:3",
    "faß.de",  # IDNA 2003 would map to fass.de: rejected, not guessed
    "ａｌｌｏｗｅｄ.com",  # fullwidth -> ASCII under nameprep
    "\u212a.com",  # Kelvin sign lower-cases to ASCII k
    "allowed\u3002com",  # ideographic full stop
    "allowed\uff0ecom",
    "allowed.com\u200b",  # zero-width space
    "a\u0085b.com",  # C1 control
    "\u00a0allowed.com",
    None,
    443,
]


@pytest.mark.parametrize("raw", NORMALIZE_BAD, ids=lambda r: repr(r)[:40])
def test_normalize_host_rejects(raw):
    with pytest.raises(ValueError):
        normalize_host(raw)


def test_normalize_error_messages_are_printable():
    with pytest.raises(ValueError) as ei:
        normalize_host("a\x00\x1b[31m.com")
    assert all(0x20 <= ord(c) < 0x7F for c in str(ei.value))


@pytest.mark.parametrize("raw,want", [
    ("*.Example.COM.", "*.example.com"),
    ("*.äbc.de", "*.xn--bc-uia.de"),
    ("10.0.0.5", "10.0.0.5"),
    ("[::1]", "::1"),
])
def test_normalize_pattern(raw, want):
    assert normalize_pattern(raw) == want


@pytest.mark.parametrize("raw", ["*.1.2.3.4", "**.a.com", "*a.com", "a.*.com", "*.", "*", "*.*.a.com"])
def test_normalize_pattern_rejects(raw):
    with pytest.raises(ValueError):
        normalize_pattern(raw)


# ---------------------------------------------------------------------------- host_matches

@pytest.mark.parametrize("pattern,host,want", [
    ("example.com", "example.com", True),
    ("example.com", "a.example.com", False),
    ("example.com", "evilexample.com", False),
    ("example.com", "example.com.evil.com", False),
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "a.b.example.com", True),
    ("*.example.com", "example.com", False),
    ("*.example.com", "evilexample.com", False),
    ("*.example.com", "a.evilexample.com", False),
    ("*.example.com", "example.com.evil.com", False),
    ("::1", "0:0::1", True),
    ("::1", "::1", True),
    ("10.0.0.5", "10.0.0.5", True),
    ("10.0.0.5", "10.0.0.6", False),
    ("10.0.0.5", "::ffff:a00:5", False),  # mapped is not the same address
    ("*.0.0.5", "10.0.0.5", False),
    ("example.com", "", False),
    ("", "example.com", False),
])
def test_host_matches(pattern, host, want):
    assert host_matches(pattern, host) is want


# ---------------------------------------------------------------------------- paths

@pytest.mark.parametrize("glob,path,want", [
    ("/repos/*", "/repos/x", True),
    ("/repos/*", "/repos/", True),
    ("/repos/*", "/repos/x/y", False),
    ("/repos/**", "/repos/x/y", True),
    ("/repos/**", "/repos/x", True),
    ("/repos/**", "/repos", False),
    ("/repos/*/issues", "/repos/x/issues", True),
    ("/repos/*/issues", "/repos/x/y/issues", False),
    ("/a.b", "/aXb", False),  # '.' is literal
    ("/a?", "/ab", False),  # '?' is literal
    ("/x[1]", "/x[1]", True),
    ("/**/raw", "/a/b/raw", True),
    ("/exact", "/exact/", False),
])
def test_path_glob(glob, path, want):
    assert path_matches(glob, path) is want


@pytest.mark.parametrize("raw,want", [
    ("/repos/x", "/repos/x"),
    ("/repos/x?q=1&r=/../", "/repos/x"),
    ("/a%20b", "/a b"),
    ("/%61dmin/", "/admin/"),
    ("/caf%C3%A9", "/café"),
    ("/", "/"),
])
def test_canonical_path_ok(raw, want):
    assert canonical_path(raw) == want


@pytest.mark.parametrize("raw", [
    "/repos/../admin", "/a/./b", "/a/%2e%2e/b", "/a/%2E%2e/b", "/a/.%2e/b", "/a/..", "/..;/admin",
    "/a/%2fb", "/a%2Fb", "/a%5cb", "/a\\b", "//a", "/a//b", "/a%252e%252e/b", "/a%", "/a%zz",
    "/a%00b", "/a\x00b", "/a b", "a/b", "*", "http://x/y", "/a#frag", "/caf\u00e9", "",
])
def test_canonical_path_rejects(raw):
    with pytest.raises(ValueError):
        canonical_path(raw)


# ---------------------------------------------------------------------------- decide table

DECIDE = [
    # --- basic host:port at the clienthello phase
    ("exact", C("allowed.com"), "allow", "allow[0]"),
    ("trailing dot upper", C("ALLOWED.COM."), "allow", "allow[0]"),
    ("suffix attack", C("allowed.com.evil.com"), "deny", "default-deny"),
    ("prefix attack", C("evilallowed.com"), "deny", "default-deny"),
    ("userinfo", C("allowed.com@evil.com"), "deny", "invalid-host"),
    ("pct dot", C("allowed.com%2eevil.com"), "deny", "invalid-host"),
    ("nul", C("allowed.com\x00.evil.com"), "deny", "invalid-host"),
    ("crlf", C("allowed.com\r\n"), "deny", "invalid-host"),
    ("homoglyph", C("аllowed.com"), "deny", "default-deny"),
    ("fullwidth", C("ａｌｌｏｗｅｄ.com"), "deny", "invalid-host"),
    ("port mismatch", C("allowed.com", 8443), "deny", "default-deny"),
    ("port 80 not default", C("allowed.com", 80), "deny", "default-deny"),
    ("port 0", C("allowed.com", 0), "deny", "invalid-request"),
    ("port 65536", C("allowed.com", 65536), "deny", "invalid-request"),
    ("port str", C("allowed.com", "443"), "deny", "invalid-request"),
    ("port bool", C("allowed.com", True), "deny", "invalid-request"),
    ("subdomain of exact", C("a.allowed.com"), "deny", "default-deny"),
    ("wild sub", C("a.wild.com"), "allow", "wild"),
    ("wild deep", C("a.b.c.wild.com"), "allow", "wild"),
    ("wild trailing dot", C("a.wild.com."), "allow", "wild"),
    ("wild bare", C("wild.com"), "deny", "default-deny"),
    ("wild evil suffix", C("evilwild.com"), "deny", "default-deny"),
    ("wild pattern as host", C("*.wild.com"), "deny", "invalid-host"),
    ("empty label", C("a..wild.com"), "deny", "invalid-host"),
    ("leading dot", C(".wild.com"), "deny", "invalid-host"),
    ("very long", C(("a" * 63 + ".") * 4 + "wild.com"), "deny", "invalid-host"),
    ("long label", C("a" * 64 + ".wild.com"), "deny", "invalid-host"),
    ("deny wins over wild", C("blocked.wild.com"), "deny", "blocked"),
    ("deny wins trailing dot", C("BLOCKED.wild.com."), "deny", "blocked"),
    ("deny not sub", C("x.blocked.wild.com"), "allow", "wild"),
    ("multi 443", C("multi.example.com"), "allow", "multi"),
    ("deny port-scoped wins", C("multi.example.com", 8443), "deny", "no-8443"),
    ("idn rule unicode host", C("äbc.de", sni="xn--bc-uia.de"), "allow", "idn"),
    ("idn rule ace host", C("xn--bc-uia.de"), "allow", "idn"),
    ("idn ss", C("abc.de"), "deny", "default-deny"),
    ("empty host", C(""), "deny", "invalid-host"),
    ("host with port", C("allowed.com:443"), "deny", "invalid-host"),
    ("host none", C(None), "deny", "invalid-host"),
    # --- SNI
    ("no sni", C("allowed.com", sni=None), "deny", "no-sni"),
    ("sni mismatch", C("allowed.com", sni="evil.com"), "deny", "sni-mismatch"),
    ("sni to allowed from evil", C("evil.com", sni="allowed.com"), "deny", "sni-mismatch"),
    ("sni case", C("allowed.com", sni="ALLOWED.com."), "allow", "allow[0]"),
    ("sni invalid", C("allowed.com", sni="allowed.com\x00"), "deny", "sni-mismatch"),
    ("sni ip", C("allowed.com", sni="1.2.3.4"), "deny", "sni-mismatch"),
    # --- IP literals
    ("ip not named", C("1.2.3.4", sni=None), "deny", "ip-literal"),
    ("ip named", C("10.0.0.5", 8080, sni=None), "allow", "ip-ok"),
    ("ip named wrong port", C("10.0.0.5", 443, sni=None), "deny", "default-deny"),
    ("ip named sni mismatch", C("10.0.0.5", 8080, sni="allowed.com"), "deny", "sni-mismatch"),
    ("ip6 named", C("[2001:db8::5]", sni=None), "allow", "ip6-ok"),
    ("ip6 named long form", C("[2001:0db8:0:0:0:0:0:5]", sni=None), "allow", "ip6-ok"),
    ("ip6 bare", C("2001:db8::5", sni=None), "allow", "ip6-ok"),
    ("ip6 other", C("[2001:db8::6]", sni=None), "deny", "ip-literal"),
    ("ip6 loopback", C("[::1]", sni=None), "deny", "ip-literal"),
    ("ip6 mapped loopback", C("[::ffff:127.0.0.1]", sni=None), "deny", "ip-literal"),
    ("ip6 mapped named", C("[::ffff:10.0.0.5]", 8080, sni=None), "deny", "ip-literal"),
    ("ip6 zone", C("[fe80::1%eth0]", sni=None), "deny", "invalid-host"),
    ("decimal ip", C("2130706433", sni=None), "deny", "invalid-host"),
    ("hex ip", C("0x7f.1", sni=None), "deny", "invalid-host"),
    ("octal ip", C("017700000001", sni=None), "deny", "invalid-host"),
    ("short ip", C("127.1", sni=None), "deny", "invalid-host"),
    ("octal dotted", C("010.0.0.5", 8080, sni=None), "deny", "invalid-host"),
    ("ip with trailing dot", C("10.0.0.5.", 8080, sni=None), "deny", "invalid-host"),
    # --- connect phase (before the peek) and termination
    ("connect plain host", C("allowed.com", phase="connect"), "allow", "allow[0]"),
    ("connect unknown", C("evil.com", phase="connect"), "deny", "default-deny"),
    ("connect blocked", C("blocked.wild.com", phase="connect"), "deny", "blocked"),
    ("connect sni given must match", C("allowed.com", sni="evil.com", phase="connect"), "deny", "sni-mismatch"),
    ("connect L7 allow", C("api.example.com", phase="connect"), "allow", "api-read"),
    ("connect ws", C("ws.example.com", phase="connect"), "allow", "ws"),
    ("connect ip named", C("10.0.0.5", 8080, phase="connect"), "allow", "ip-ok"),
    ("connect with scheme http", RequestMeta("allowed.com", 443, "http", phase="connect"), "deny", "invalid-request"),
    ("request with scheme connect", RequestMeta("allowed.com", 443, "connect"), "deny", "invalid-request"),
    ("unknown phase", RequestMeta("allowed.com", 443, "connect", phase="tls"), "deny", "invalid-request"),
    ("unknown scheme", RequestMeta("allowed.com", 443, "ftp", "GET", "/"), "deny", "invalid-request"),
    # --- request phase: methods and paths
    ("GET repos/x", R("api.example.com", "GET", "/repos/x"), "allow", "api-read"),
    ("HEAD repos/x", R("api.example.com", "HEAD", "/repos/x"), "allow", "api-read"),
    ("GET repos/x?q", R("api.example.com", "GET", "/repos/x?per_page=100"), "allow", "api-read"),
    ("GET repos/x/y one star", R("api.example.com", "GET", "/repos/x/y"), "deny", "default-deny"),
    ("GET orgs deep", R("api.example.com", "GET", "/orgs/a/b/c"), "allow", "api-read"),
    ("GET repos dotdot", R("api.example.com", "GET", "/repos/../admin"), "deny", "path-normalization"),
    ("GET repos enc dotdot", R("api.example.com", "GET", "/repos/%2e%2e/admin"), "deny", "path-normalization"),
    ("GET repos enc slash", R("api.example.com", "GET", "/repos/a%2Fb"), "deny", "path-normalization"),
    ("GET repos double slash", R("api.example.com", "GET", "//repos/x"), "deny", "path-normalization"),
    ("GET repos backslash", R("api.example.com", "GET", "/repos\\x"), "deny", "path-normalization"),
    ("GET repos encoded letter", R("api.example.com", "GET", "/rep%6fs/x"), "allow", "api-read"),
    ("GET lowercase method", R("api.example.com", "get", "/repos/x"), "deny", "default-deny"),
    ("POST repos", R("api.example.com", "POST", "/repos/x"), "deny", "default-deny"),
    ("bad method", R("api.example.com", "G ET", "/repos/x"), "deny", "invalid-request"),
    ("no method", R("api.example.com", None, "/repos/x"), "deny", "invalid-request"),
    ("no path", R("api.example.com", "GET", None), "deny", "invalid-request"),
    ("admin deny", R("api.example.com", "GET", "/admin/users"), "deny", "no-admin"),
    ("admin deny encoded", R("api.example.com", "GET", "/%61dmin/users"), "deny", "no-admin"),
    ("admin deny params", R("api.example.com", "GET", "/admin;x=1/users"), "deny", "no-admin"),
    ("admin deny dotdot", R("api.example.com", "GET", "/repos/x/../../admin/u"), "deny", "path-normalization"),
    ("delete denied", R("files.example.com", "DELETE", "/x"), "deny", "no-delete"),
    ("delete lowercase denied", R("files.example.com", "delete", "/x"), "deny", "no-delete"),
    ("delete on other host allowed", R("allowed.com", "DELETE", "/x"), "allow", "allow[0]"),
    # --- body sizes
    ("upload small", R("api.example.com", "POST", "/upload", body=1000), "allow", "api-upload"),
    ("upload big", R("api.example.com", "POST", "/upload", body=1001), "deny", "default-deny"),
    ("upload chunked", R("api.example.com", "POST", "/upload", body=None), "allow", "api-upload"),
    ("upload negative", R("api.example.com", "POST", "/upload", body=-1), "deny", "invalid-request"),
    ("files deny big body", R("files.example.com", "PUT", "/x", body=101), "deny", "files-cap"),
    ("files small body", R("files.example.com", "PUT", "/x", body=100), "allow", "files"),
    # --- websocket
    ("ws allowed", R("ws.example.com", "GET", "/socket", ws=True), "allow", "ws"),
    ("ws on non-ws rule", R("allowed.com", "GET", "/socket", ws=True), "deny", "default-deny"),
    ("ws deny rule", R("any.example.com", "GET", "/", ws=True), "deny", "no-ws"),
    ("non-ws on any", R("any.example.com", "GET", "/"), "allow", "any-example"),
    # --- paths only checked when a path rule is consulted
    ("npm scoped on path host", R("npm.example.org", "GET", "/@s%2fname"), "allow", "npm-all"),
    ("npm path rule", R("npm.example.org", "GET", "/pkg/a"), "allow", "npm-paths"),
    ("encoded slash on plain host", R("allowed.com", "GET", "/a%2fb"), "allow", "allow[0]"),
    ("dotdot on plain host", R("allowed.com", "GET", "/a/../b"), "allow", "allow[0]"),
    # --- https SNI / Host header consistency, plain http
    ("https host==sni", R("allowed.com"), "allow", "allow[0]"),
    ("https fronting", R("evil.com", sni="allowed.com"), "deny", "sni-mismatch"),
    ("https no sni", R("allowed.com", sni=None), "deny", "no-sni"),
    ("https ip named no sni", R("10.0.0.5", port=8080, sni=None), "allow", "ip-ok"),
    ("http plain", R("plain.example.com", port=80, scheme="http"), "allow", "plain"),
    ("http on 443-only rule", R("allowed.com", port=80, scheme="http"), "deny", "default-deny"),
    ("http with sni", R("plain.example.com", port=80, scheme="http", sni="plain.example.com"), "deny", "invalid-request"),
    ("http ip literal", R("127.0.0.1", port=80, scheme="http"), "deny", "ip-literal"),
    ("http decimal ip", R("2130706433", port=80, scheme="http"), "deny", "invalid-host"),
    ("http unknown", R("evil.com", port=80, scheme="http"), "deny", "default-deny"),
]


@pytest.mark.parametrize("meta,verdict,rule_id", [c[1:] for c in DECIDE], ids=[c[0] for c in DECIDE])
def test_decide_table(pol, meta, verdict, rule_id):
    d = decide(meta, pol)
    assert (d.verdict, d.rule_id) == (verdict, rule_id), d.reason
    assert d.allowed is (verdict == "allow")
    assert d.reason and all(0x20 <= ord(c) < 0x7F for c in d.reason)


@pytest.mark.parametrize("meta,terminate", [
    (C("allowed.com"), False),
    (C("allowed.com", phase="connect"), False),
    (C("a.wild.com"), False),
    (C("api.example.com"), True),  # methods/paths
    (C("ws.example.com"), True),  # websocket counts as L7
    (C("files.example.com"), True),  # L7 deny rule (maxBody) on a plain allow
    (C("any.example.com"), True),  # L7 deny rule (websocket)
    (C("multi.example.com"), True),  # *.example.com DELETE deny on a plain allow
    (C("npm.example.org", phase="connect"), True),
    (C("10.0.0.5", 8080, sni=None), False),
])
def test_terminate_flag(pol, meta, terminate):
    d = decide(meta, pol)
    assert d.allowed and d.terminate is terminate
    assert pol.needs_termination(meta.host, meta.port) is terminate


def test_needs_termination_edge_cases(pol):
    assert pol.needs_termination("nope..com", 443) is False
    assert pol.needs_termination("evil.com", 443) is False
    assert pol.needs_termination("API.example.com.", 443) is True


def test_decision_carries_normalized_host(pol):
    assert decide(C("ALLOWED.COM."), pol).host == "allowed.com"
    assert decide(C("äbc.de", sni="xn--bc-uia.de"), pol).host == "xn--bc-uia.de"
    assert decide(C("evil.com"), pol).host == "evil.com"
    assert decide(C("bad..host"), pol).host is None


def test_max_body_for_unknown_sizes(pol):
    d = decide(R("api.example.com", "POST", "/upload"), pol)
    assert d.allowed and (d.max_body, d.body_rule_id) == (1000, "api-upload")
    d = decide(R("api.example.com", "POST", "/upload", body=10), pol)
    assert d.allowed and d.max_body is None
    d = decide(R("files.example.com", "PUT", "/x"), pol)  # the deny rule's cap applies
    assert d.allowed and (d.rule_id, d.max_body, d.body_rule_id) == ("files", 100, "files-cap")
    d = decide(R("allowed.com", "POST", "/x"), pol)
    assert d.max_body is None and d.body_rule_id is None


def test_smallest_cap_wins():
    p = EgressPolicy(
        allow=(Rule("a", "x.com", (443,), max_body=50),),
        deny=(Rule("d1", "x.com", (443,), max_body=80), Rule("d2", "x.com", (443,), max_body=20)),
    )
    d = decide(R("x.com", "POST", "/"), p)
    assert (d.verdict, d.max_body, d.body_rule_id) == ("allow", 20, "d2")


def test_reasons_do_not_leak_path_or_query(pol):
    for meta in [R("api.example.com", "GET", "/repos/x/y?token=SECRET"),
                 R("allowed.com", "GET", "/x?token=SECRET"),
                 R("api.example.com", "GET", "/repos/../SECRET?token=SECRET")]:
        assert "SECRET" not in decide(meta, pol).reason


def test_reason_sanitizes_control_chars(pol):
    d = decide(C("evil\x1b[31m.com\r\nX-Injected: 1"), pol)
    assert d.rule_id == "invalid-host"
    assert all(0x20 <= ord(c) < 0x7F for c in d.reason)


def test_first_allow_rule_wins_and_deny_order():
    p = EgressPolicy(
        allow=(Rule("first", "x.com", (443,)), Rule("second", "x.com", (443,))),
        deny=(Rule("d-first", "*.y.com", (443,)), Rule("d-second", "a.y.com", (443,))),
    )
    assert decide(C("x.com"), p).rule_id == "first"
    assert decide(C("a.y.com"), p).rule_id == "d-first"


def test_deny_wins_over_allow_in_any_order():
    p = EgressPolicy(allow=(Rule("a", "x.com", (443,)),), deny=(Rule("d", "x.com", (443,)),))
    for meta in (C("x.com"), C("x.com", phase="connect"), R("x.com")):
        d = decide(meta, p)
        assert (d.verdict, d.rule_id) == ("deny", "d")


def test_empty_policy_denies_everything():
    for meta in (C("x.com"), R("x.com"), R("x.com", port=80, scheme="http")):
        d = decide(meta, EgressPolicy())
        assert (d.verdict, d.rule_id) == ("deny", "default-deny")
        assert "x.com" in d.reason


def test_path_rule_skipped_then_nothing_else_gives_path_normalization(pol):
    d = decide(R("npm.example.org", "GET", "/pkg/../x"), pol)
    assert (d.verdict, d.rule_id) == ("allow", "npm-all")  # a path-less rule still allows
    p = EgressPolicy(allow=(Rule("p", "x.com", (443,), paths=("/pkg/**",)),))
    assert decide(R("x.com", "GET", "/pkg/%2e%2e/y"), p).rule_id == "path-normalization"
    assert decide(R("x.com", "GET", "/other"), p).rule_id == "default-deny"


def test_rule_with_no_ports_matches_nothing():
    p = EgressPolicy(allow=(Rule("a", "x.com", ()),))
    assert decide(C("x.com"), p).rule_id == "default-deny"


# ---------------------------------------------------------------------------- fail closed

def test_exception_is_internal_error_deny(pol, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kaboom secret")

    monkeypatch.setattr(gp, "normalize_host", boom)
    d = decide(C("allowed.com"), pol)
    assert (d.verdict, d.rule_id) == ("deny", "internal-error")
    assert "secret" not in d.reason


def test_exception_in_matching_is_internal_error(monkeypatch):
    monkeypatch.setattr(gp, "host_matches", lambda *a: 1 / 0)
    d = decide(C("x.com"), EgressPolicy(allow=(Rule("a", "x.com", (443,)),)))
    assert (d.verdict, d.rule_id) == ("deny", "internal-error")


def test_garbage_policy_is_internal_error():
    d = decide(C("x.com"), EgressPolicy(allow=(None,)))  # type: ignore[arg-type]
    assert (d.verdict, d.rule_id) == ("deny", "internal-error")
    d = decide(C("x.com"), None)  # type: ignore[arg-type]
    assert d.verdict == "deny"


# ---------------------------------------------------------------------------- check_address

ADDR_DENY = [
    "127.0.0.1", "127.255.255.254", "10.0.0.1", "10.255.255.255", "172.16.0.1", "172.31.255.255",
    "192.168.1.1", "169.254.1.1", "169.254.169.254", "169.254.170.2", "100.64.0.1",
    "100.127.255.255", "100.100.100.200", "192.0.0.192", "192.0.0.1", "0.0.0.0", "0.1.2.3",
    "255.255.255.255", "224.0.0.1", "239.255.255.250", "240.0.0.1", "198.18.0.1",
    "198.19.255.255", "192.0.2.1", "198.51.100.1", "203.0.113.1", "192.88.99.1",
    "::", "::1", "[::1]", "fc00::1", "fd00::1", "fd00:ec2::254", "fe80::1", "fe80::1%eth0", "febf::1",
    "fec0::1", "ff02::1", "ff05::2", "2001:db8::1", "3fff::1", "100::1", "2001:2::1", "2001:10::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::ffff:8.8.8.8",
    "::127.0.0.1", "64:ff9b::127.0.0.1", "64:ff9b::a9fe:a9fe", "64:ff9b::10.1.1.1",
    "64:ff9b:1::1.2.3.4", "2002:7f00:1::1", "2002:a9fe:a9fe::1", "2002:c0a8:101::",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo, client 192.0.2.45
    "2001:0:7f00:1::1",  # Teredo with a loopback server
    "4000::1", "::2", "not-an-ip", "127.1", "", "1.2.3.4.5",
]

ADDR_OK = [
    "1.1.1.1", "8.8.8.8", "93.184.216.34", "100.63.255.255", "100.128.0.0", "172.15.255.255",
    "172.32.0.0", "192.167.255.255", "198.17.255.255", "198.20.0.0", "223.255.255.255",
    "2606:4700:4700::1111", "2a00:1450:4001::1", "64:ff9b::8.8.8.8", "2002:808:808::1",
    "2001:0:4136:e378:8000:63bf:f7f7:f7f7",  # Teredo, client 8.8.8.8, server 65.54.227.120
    "[2606:4700::1]",
]


@pytest.mark.parametrize("addr", ADDR_DENY)
def test_check_address_denies(addr):
    d = check_address("example.com", addr, EgressPolicy())
    assert d is not None and (d.verdict, d.rule_id) == ("deny", "address-class")
    assert all(0x20 <= ord(c) < 0x7F for c in d.reason)


@pytest.mark.parametrize("addr", ADDR_OK)
def test_check_address_allows_public(addr):
    assert check_address("example.com", addr, EgressPolicy()) is None


def test_check_address_reason_names_the_class():
    d = check_address("evil.com", "169.254.169.254", EgressPolicy())
    assert "metadata" in d.reason and "evil.com" in d.reason
    assert "loopback" in check_address("x", "::ffff:127.0.0.1", EgressPolicy()).reason


def test_check_address_static_mapping_exception(pol):
    assert check_address("internal.corp", "10.1.2.3", pol) is None
    assert check_address("INTERNAL.corp.", "10.1.2.3", pol) is None
    assert check_address("local.test", "127.0.0.1", pol) is None
    assert check_address("internal.corp", "10.1.2.4", pol) is not None  # other address
    assert check_address("other.corp", "10.1.2.3", pol) is not None  # other name
    assert check_address("a.internal.corp", "10.1.2.3", pol) is not None
    assert pol.static_address("Internal.Corp.") == "10.1.2.3"
    assert pol.static_address("nope.corp") is None
    assert pol.static_address("bad..name") is None


def test_check_address_explicit_ip_rule_exception(pol):
    assert check_address("10.0.0.5", "10.0.0.5", pol) is None
    assert check_address("whatever.com", "10.0.0.5", pol) is None  # named explicitly by a rule
    assert check_address("10.0.0.6", "10.0.0.6", pol) is not None
    assert check_address("x", "::ffff:10.0.0.5", pol) is not None  # embedding is not the named IP
    p = compile_egress(extra_allow=["[::1]:8080"])
    assert check_address("x", "::1", p) is None
    assert check_address("x", "0:0::1", p) is None


def test_check_address_never_raises():
    for addr in [None, 12, b"1.2.3.4", "[", "::ffff:999.1.1.1"]:
        d = check_address("x", addr, EgressPolicy())  # type: ignore[arg-type]
        assert d is not None and d.verdict == "deny"


# ---------------------------------------------------------------------------- compile

def test_compile_from_real_spec(pol):
    assert [r.id for r in pol.allow][:3] == ["allow[0]", "wild", "api-read"]
    r0 = pol.allow[0]
    assert r0 == Rule("allow[0]", "allowed.com", (443,))
    assert not r0.is_l7
    api = pol.allow[2]
    assert api.methods == ("GET", "HEAD") and api.paths == ("/repos/*", "/orgs/**") and api.is_l7
    assert pol.allow[3].max_body == 1000 and pol.allow[3].is_l7
    assert pol.allow[4].websocket and pol.allow[4].is_l7
    assert pol.allow[6].host == "2001:db8::5"
    assert pol.allow[11].host == "xn--bc-uia.de"
    assert [r.id for r in pol.deny] == ["no-admin", "no-delete", "blocked", "files-cap", "no-ws", "no-8443"]
    assert pol.hosts == (("internal.corp", "10.1.2.3"), ("local.test", "127.0.0.1"))
    assert pol.limits == EgressLimits()
    assert pol.upstream_ca is None
    d = pol.to_dict()
    json.dumps(d)
    assert d["hosts"] == {"internal.corp": "10.1.2.3", "local.test": "127.0.0.1"}
    assert d["allow"][0] == {"id": "allow[0]", "host": "allowed.com", "ports": [443], "methods": [],
                             "paths": [], "max_body": None, "websocket": False}
    hash(pol)  # frozen all the way down


def test_compile_limits_and_upstream_ca():
    la = load_agent_text(agent("""\
        spec:
          egress:
            upstreamCa: /etc/ssl/corp.pem  # to_camel spelling of upstream_ca
            limits: {connections: 8, requestsPerSecond: 2.5, burst: 5, bytesOut: 10M}
        """), "a.yaml", preset_dirs=[])
    p = compile_egress(la.spec.spec.egress)
    assert p.upstream_ca == "/etc/ssl/corp.pem"
    assert p.limits == EgressLimits(8, 2.5, 5, 10 * 1024**2)


def test_compile_none_and_empty():
    assert compile_egress() == EgressPolicy()
    assert compile_egress(None) == EgressPolicy()
    la = load_agent_text(agent(), "a.yaml", preset_dirs=[])
    assert compile_egress(la.spec.spec.egress) == EgressPolicy()


def _ns_rule(**kw):
    base = dict(host="x.com", ports=[443], methods=[], paths=[], max_body=None, websocket=False, id=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _ns_egress(allow=(), deny=(), hosts=None):
    return SimpleNamespace(allow=list(allow), deny=list(deny), hosts=hosts or {}, upstream_ca=None, limits=None)


@pytest.mark.parametrize("rule,msg", [
    (_ns_rule(host="x..com"), "allow[0].host"),
    (_ns_rule(host="a@b.com"), "allow[0].host"),
    (_ns_rule(host="*.1.2.3.4"), "allow[0].host"),
    (_ns_rule(ports=[0]), "allow[0].ports"),
    (_ns_rule(methods=["G T"]), "allow[0].methods"),
    (_ns_rule(paths=["repos"]), "allow[0].paths"),
    (_ns_rule(max_body=-1), "allow[0].maxBody"),
    (_ns_rule(id="a\r\nb"), "allow[0].id"),
    (_ns_rule(id=""), "allow[0].id"),
])
def test_compile_rejects_bad_rules(rule, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        compile_egress(_ns_egress(allow=[rule]))


def test_compile_duck_typed_normalizes():
    p = compile_egress(_ns_egress(
        allow=[_ns_rule(host="X.COM.", ports=[443, 443, 80], methods=["get", "GET"])],
        deny=[_ns_rule(host="*.Y.com")],
        hosts={"B.example": "10.0.0.2", "a.example": "[::1]"},
    ))
    assert p.allow[0] == Rule("allow[0]", "x.com", (443, 80), ("GET",))
    assert p.deny[0].id == "deny[0]" and p.deny[0].host == "*.y.com"
    assert p.hosts == (("a.example", "::1"), ("b.example", "10.0.0.2"))


@pytest.mark.parametrize("hosts", [{"x..com": "1.2.3.4"}, {"1.2.3.4": "1.2.3.4"}, {"a.com": "nope"},
                                   {"a.com": "fe80::1%eth0"}])
def test_compile_rejects_bad_hosts(hosts):
    with pytest.raises(ValueError):
        compile_egress(_ns_egress(hosts=hosts))
    with pytest.raises(ValueError):
        compile_egress(extra_hosts=hosts)


@pytest.mark.parametrize("arg,host,ports", [
    ("example.com", "example.com", (80, 443)),
    ("Example.com:8443", "example.com", (8443,)),
    ("*.example.com", "*.example.com", (80, 443)),
    ("*.example.com:443", "*.example.com", (443,)),
    ("10.0.0.5", "10.0.0.5", (80, 443)),
    ("10.0.0.5:8080", "10.0.0.5", (8080,)),
    ("[::1]:8080", "::1", (8080,)),
    ("[::1]", "::1", (80, 443)),
    ("::1", "::1", (80, 443)),
    ("äbc.de:443", "xn--bc-uia.de", (443,)),
])
def test_cli_allow(arg, host, ports):
    p = compile_egress(extra_allow=[arg])
    assert p.allow == (Rule("cli[0]", host, ports),)


@pytest.mark.parametrize("arg", ["", "example.com:", "example.com:0", "example.com:65536", "example.com:x",
                                 "example.com:+80", "a@b.com", "http://example.com", "[::1]x", "[::1",
                                 "[::1]:", "1.2.3:80", "example.com:80:90", "x..com"])
def test_cli_allow_rejects(arg):
    with pytest.raises(ValueError, match="--allow"):
        compile_egress(extra_allow=[arg])


def test_cli_allow_string_not_sequence():
    with pytest.raises(ValueError):
        compile_egress(extra_allow="example.com")


def test_cli_extras_append_and_override():
    la = load_agent_text(SPEC, "a.yaml", preset_dirs=[])
    p = compile_egress(la.spec.spec.egress, extra_allow=["evil.com", "x.org:22"],
                       extra_hosts={"internal.corp": "10.9.9.9", "new.test": "127.0.0.2"})
    assert [r.id for r in p.allow[-2:]] == ["cli[0]", "cli[1]"]
    assert decide(C("evil.com"), p).rule_id == "cli[0]"
    assert decide(R("evil.com", port=80, scheme="http"), p).rule_id == "cli[0]"
    assert decide(C("x.org", 22), p).rule_id == "cli[1]"
    assert dict(p.hosts) == {"internal.corp": "10.9.9.9", "local.test": "127.0.0.1", "new.test": "127.0.0.2"}
    assert check_address("new.test", "127.0.0.2", p) is None


def test_static_address_last_entry_wins_when_concatenated():
    from dataclasses import replace

    base = compile_egress(extra_hosts={"a.test": "10.0.0.1"})
    extra = compile_egress(extra_hosts={"a.test": "10.0.0.2"})
    p = replace(base, hosts=base.hosts + extra.hosts)
    assert p.static_address("a.test") == "10.0.0.2"
    assert check_address("a.test", "10.0.0.2", p) is None


@pytest.mark.parametrize("raw,default,want", [
    ("example.com:443", None, ("example.com", 443)),
    ("example.com", 80, ("example.com", 80)),
    ("[::1]:8080", None, ("[::1]", 8080)),
    ("[::1]", 443, ("[::1]", 443)),
    ("::1", 443, ("::1", 443)),
])
def test_parse_authority(raw, default, want):
    assert parse_authority(raw, default) == want


@pytest.mark.parametrize("raw", ["", "example.com", "example.com:", "example.com:99999", "example.com:0",
                                 "example.com:-1", "[::1]:x", "[::1", "[::1]8080"])
def test_parse_authority_rejects(raw):
    with pytest.raises(ValueError):
        parse_authority(raw)


# ---------------------------------------------------------------------------- presets

def _preset_policy(name: str) -> EgressPolicy:
    la = load_agent_text(agent(f"spec:\n  presets: [{name}]\n"), "a.yaml", preset_dirs=[])
    return compile_egress(la.spec.spec.egress)


@pytest.mark.parametrize("name,hosts", [
    ("github", ["github.com", "api.github.com", "codeload.github.com", "objects.githubusercontent.com",
                "raw.githubusercontent.com"]),
    ("pypi", ["pypi.org", "files.pythonhosted.org"]),
    ("npm", ["registry.npmjs.org"]),
])
def test_allow_presets(name, hosts):
    p = _preset_policy(name)
    assert sorted(r.host for r in p.allow) == sorted(hosts)
    for h in hosts:
        d = decide(C(h), p)
        assert d.allowed and not d.terminate and d.rule_id == f"{name}:{h}"
        assert decide(C(h, 80), p).rule_id == "default-deny"
    assert decide(C("evil.com"), p).rule_id == "default-deny"


def test_doh_deny_preset_beats_a_broad_allow():
    la = load_agent_text(agent("""\
        spec:
          presets: [doh-deny, github]
          egress:
            allow:
              - {host: "*.google", id: google}
              - {host: "*.cloudflare-dns.com", id: cf}
              - {host: "*.nextdns.io", ports: [443, 80], id: nd}
        """), "a.yaml", preset_dirs=[])
    p = compile_egress(la.spec.spec.egress)
    assert all(r.id.startswith("doh:") and r.ports == (443, 80) for r in p.deny)
    for h, rid in [("dns.google", "doh:dns.google"), ("mozilla.cloudflare-dns.com", "doh:*.cloudflare-dns.com"),
                   ("x.nextdns.io", "doh:*.nextdns.io")]:
        for port in (443, 80):
            d = decide(C(h, port, phase="connect"), p)
            assert (d.verdict, d.rule_id) == ("deny", rid)
    assert decide(C("mail.google"), p).rule_id == "google"
    assert decide(C("api.github.com"), p).rule_id == "github:api.github.com"


def test_builtin_egress_presets_validate():
    for name in ("github", "pypi", "npm", "doh-deny"):
        assert (builtin_preset_dir() / f"{name}.yaml").is_file()


# ---------------------------------------------------------------------------- properties

_host_chars = string.ascii_letters + string.digits + ".-_:[]@%*/\\\x00 \u0430\u00e4\u00df\u3002"
hosts_st = st.one_of(
    st.text(alphabet=_host_chars, max_size=40),
    st.text(max_size=20),
    st.sampled_from(["allowed.com", "a.wild.com", "wild.com", "api.example.com", "10.0.0.5", "[::1]",
                     "blocked.wild.com", "ALLOWED.COM.", "xn--bc-uia.de"]),
    st.builds(lambda a, b: f"{a}.{b}", st.sampled_from(["a", "x.y", "ALLOWED"]),
              st.sampled_from(["allowed.com", "wild.com", "example.com", "com"])),
)
metas_st = st.builds(
    RequestMeta,
    host=hosts_st,
    port=st.one_of(st.sampled_from([443, 80, 8080, 8443]), st.integers(-5, 70000)),
    scheme=st.sampled_from(["connect", "http", "https", "ftp"]),
    method=st.one_of(st.none(), st.sampled_from(["GET", "POST", "DELETE", "get", "G T"]), st.text(max_size=5)),
    path=st.one_of(st.none(), st.sampled_from(["/repos/x", "/admin/x", "/upload", "/a/../b"]),
                   st.text(max_size=20)),
    body_size=st.one_of(st.none(), st.integers(-10, 5000)),
    sni=st.one_of(st.none(), hosts_st),
    websocket=st.booleans(),
    phase=st.sampled_from(["connect", "clienthello", "request", "bogus"]),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=metas_st)
def test_decide_never_raises_and_allows_only_matching_hosts(pol, meta):
    d = decide(meta, pol)
    assert isinstance(d, Decision) and d.verdict in ("allow", "deny")
    assert d.rule_id != "internal-error", d.reason
    assert all(0x20 <= ord(c) < 0x7F for c in d.reason)
    if d.allowed:
        host = normalize_host(meta.host)
        assert d.host == host
        rule = next(r for r in pol.allow if r.id == d.rule_id)
        assert host_matches(rule.host, host) and meta.port in rule.ports
        assert not any(r.host == host and not r.is_l7 and meta.port in r.ports for r in pol.deny)


@settings(max_examples=300, deadline=None)
@given(raw=st.text(max_size=60))
def test_normalize_host_is_idempotent_and_clean(raw):
    try:
        h = normalize_host(raw)
    except ValueError:
        return
    assert normalize_host(h) == h
    assert h.isascii() and h == h.lower()
    assert all(c in string.ascii_lowercase + string.digits + ".-:" for c in h)


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 2**128 - 1))
def test_check_address_never_raises_on_any_ipv6(a):
    ip = ipaddress.IPv6Address(a)
    d = check_address("x", str(ip), EgressPolicy())
    assert d is None or d.rule_id == "address-class"
    if ip.ipv4_mapped is not None or ip in ipaddress.ip_network("fc00::/7") or ip.is_loopback:
        assert d is not None


def test_how_to_allow_names_the_exact_flag_or_nothing():
    from agentvm.gate.policy import how_to_allow

    assert how_to_allow("default-deny", "no rule allows it", "pypi.org", 443).startswith("--allow pypi.org ")
    assert how_to_allow("default-deny", "", "api.test", 8443).startswith("--allow api.test:8443 ")
    msg = how_to_allow("address-class", "pypi.org resolved to 10.0.0.5 (private), which is not allowed", "pypi.org", 443)
    assert "10.0.0.5" in msg and "private" in msg and "--add-host pypi.org=10.0.0.5" in msg
    assert "--add-host nowhere.test=ADDRESS" in how_to_allow("dns-failure", "cannot resolve", "nowhere.test", 443)
    for rid in ("credential:leak:api", "doh", "limit:rate", "bad-request:smuggling", "host-mismatch"):
        assert how_to_allow(rid, "x", "h.test", 443) is None, rid



def test_how_to_allow_never_suggests_opening_loopback_link_local_or_metadata():
    """A denial the agent provokes must not talk the operator into opening the host."""
    from agentvm.gate.policy import how_to_allow

    for host, port in (("169.254.169.254", 80), ("::1", 22), ("127.0.0.1", 8080), ("10.0.0.1", 443)):
        assert how_to_allow("ip-literal", "an IP literal", host, port) is None, host
        assert how_to_allow("default-deny", "x", host, port) is None, host
    for cls, ip in (("loopback", "127.0.0.1"), ("link-local", "169.254.169.254"), ("cloud metadata", "169.254.169.254")):
        assert how_to_allow("address-class", f"evil.test resolved to {ip} ({cls}), which is not allowed", "evil.test", 443) is None
    assert "--allow [2001:db8::1]:8443" not in (how_to_allow("ip-literal", "x", "2001:db8::1", 8443) or "")
    assert how_to_allow("ip-literal", "x", "93.184.216.34", 8443) == (
        "connect by name, or allow the address explicitly: --allow 93.184.216.34:8443")
    assert how_to_allow("default-deny", "x", "Evil.Example.", 8443).startswith("--allow evil.example:8443 ")
    assert how_to_allow("default-deny", "x", "bad host\x9b", 80) is None


def test_a_deny_rule_without_ports_denies_every_port():
    from types import SimpleNamespace

    from agentvm.spec.models import Egress

    eg = compile_egress(Egress.model_validate({"allow": [{"host": "x.com", "ports": [443, 8080]}],
                                               "deny": [{"host": "x.com"}]}))
    assert eg.deny[0].ports == ()
    for port in (443, 8080):
        assert decide(C("x.com", port=port), eg).verdict == "deny"
    with pytest.raises(ValueError, match="at least one port"):
        compile_egress(SimpleNamespace(allow=[SimpleNamespace(host="x.com", ports=[])], deny=[]))


# ---------------------------------------------------------------------------- the decision memo

@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metas=st.lists(metas_st, min_size=1, max_size=12), order=st.randoms(use_true_random=False))
def test_a_remembered_decision_is_the_decision_made_again(pol, metas, order):
    """Whatever was asked before (in any order, twice), decide() answers what _decide() would."""
    fresh = EgressPolicy(allow=pol.allow, deny=pol.deny, hosts=pol.hosts)
    asked = metas + metas
    order.shuffle(asked)
    for meta in asked:
        assert decide(meta, fresh) == gp._decide_safely(meta, fresh), meta


@pytest.mark.parametrize("confusable, key", [
    (dict(port=True), dict(port=1)),  # bool is an int subclass, True == 1 and hash(True) == hash(1)
    (dict(ws=0), dict(ws=False)),
    (dict(body=True), dict(body=1)),
    (dict(body=1.0), dict(body=1)),
])
def test_a_value_equal_to_a_remembered_one_but_of_another_type_is_decided_again(confusable, key):
    """A port of True must not find the decision made for port 1: it is an invalid request."""
    p = EgressPolicy(allow=(Rule("one", "x.com", (1,), max_body=10, websocket=False),))
    allowed = decide(R("x.com", port=1, **{k: v for k, v in key.items() if k != "port"}), p)
    assert allowed.verdict == "allow", allowed
    args = dict(port=1)
    args.update(confusable)
    again = decide(R("x.com", **args), p)
    assert (again.verdict, again.rule_id) == ("deny", "invalid-request"), again


def test_a_new_policy_starts_with_an_empty_memo():
    """A live policy change is a new EgressPolicy: a decision of the old one never answers."""
    old = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))
    assert decide(R("x.com", path="/a"), old).verdict == "allow"
    new = EgressPolicy(allow=old.allow, deny=(Rule("shut", "x.com", ()),))
    assert (decide(R("x.com", path="/a"), new).rule_id) == "shut"
    assert decide(R("x.com", path="/a"), old).verdict == "allow"
    from dataclasses import replace

    assert decide(R("x.com", path="/a"), replace(old, allow=())).rule_id == "default-deny"
    assert old == EgressPolicy(allow=(Rule("open", "x.com", (443,)),))  # the memo is not a field


def test_the_memo_stays_bounded_and_long_paths_are_not_kept():
    p = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))
    for i in range(gp.DECISION_MEMO * 3 + 7):
        assert decide(R("x.com", path=f"/p/{i}"), p).verdict == "allow"
        assert len(p._decisions) <= gp.DECISION_MEMO
    p._decisions.clear()
    assert decide(R("x.com", path="/" + "a" * (gp._MEMO_PATH + 1)), p).verdict == "allow"
    assert decide(R("x.com", path="/" + "a" * (gp._MEMO_PATH - 1)), p).verdict == "allow"
    assert len(p._decisions) == 1
    assert decide(C("x.com"), p).verdict == "allow" and len(p._decisions) == 1  # connect phases: decided each time


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=metas_st.filter(lambda m: m.phase == "request"))
def test_decide_request_is_decide_of_the_meta_it_would_build(pol, meta):
    fresh = EgressPolicy(allow=pol.allow, deny=pol.deny, hosts=pol.hosts)
    fields = (meta.host, meta.port, meta.scheme, meta.method, meta.path, meta.body_size, meta.sni, meta.websocket)
    want = gp._decide_safely(meta, fresh)
    assert gp.decide_request(fresh, *fields) == want  # a miss: the meta built here
    assert gp.decide_request(fresh, *fields) == want  # a hit
    assert gp.decide_request(EgressPolicy(allow=pol.allow, deny=pol.deny, hosts=pol.hosts), *fields, meta) == want


def test_a_long_method_host_or_sni_is_decided_every_time_not_kept():
    """A memo entry stays small: a 60,000-byte method (a token the parser accepts) or an
    over-long host is decided, not remembered (review finding: 7.5 MiB per policy otherwise)."""
    p = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))
    assert decide(R("x.com", method="M" * 60_000), p).rule_id == "invalid-request"
    assert decide(R("x" * 300 + ".com"), p).verdict == "deny"
    assert decide(R("x.com", sni="s" * 300), p).rule_id == "sni-mismatch"
    assert p._decisions == {}
    assert decide(R("x.com", method="M" * gp._MEMO_METHOD), p).verdict == "allow" and len(p._decisions) == 1


def test_an_internal_error_is_not_remembered(monkeypatch):
    """A deny made because evaluation failed (memory, a lazy import) is not kept: the next
    request is decided afresh (review finding)."""
    p = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))
    real, calls = gp._decide, []

    def flaky(meta, policy):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError()
        return real(meta, policy)

    monkeypatch.setattr(gp, "_decide", flaky)
    assert decide(R("x.com"), p).rule_id == "internal-error"
    assert p._decisions == {}
    assert decide(R("x.com"), p).verdict == "allow" and len(calls) == 2
    assert decide(R("x.com"), p).verdict == "allow" and len(calls) == 2  # (now remembered)


@pytest.mark.parametrize("junk", [None, object(), {}, "request"])
def test_decide_of_something_that_is_not_a_meta_is_an_internal_error_deny(junk):
    d = decide(junk, EgressPolicy(allow=(Rule("open", "x.com", (443,)),)))
    assert (d.verdict, d.rule_id) == ("deny", "internal-error")


def test_decide_never_raises_for_a_meta_that_breaks_halfway(monkeypatch):
    """Review finding: the memo path read fields and built the RequestMeta outside any try."""
    p = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))

    class Broken:
        phase = "request"

        @property
        def host(self):
            raise RuntimeError("boom")

    for junk in (SimpleNamespace(phase="request"), SimpleNamespace(phase="request", host="x.com", port=443), Broken()):
        assert decide(junk, p).rule_id == "internal-error"

    def no_memory(*a):
        raise MemoryError()

    monkeypatch.setattr(gp, "_make_meta", no_memory)
    d = gp.decide_request(p, "x.com", 443, "https", "GET", "/", None, "x.com", False)
    assert (d.verdict, d.rule_id) == ("deny", "internal-error") and p._decisions == {}


@pytest.mark.parametrize("field, value", [("scheme", "s" * 100 + "https"), ("port", 10**9), ("port", -1),
                                          ("body", 10**30), ("body", -5)])
def test_fields_outside_the_parsers_ranges_are_not_remembered(field, value):
    p = EgressPolicy(allow=(Rule("open", "x.com", (443,)),))
    args = {"scheme": "https", "port": 443, "body": None}
    args[field] = value
    meta = RequestMeta(host="x.com", port=args["port"], scheme=args["scheme"], method="GET", path="/",
                       body_size=args["body"], sni="x.com")
    assert decide(meta, p) == gp._decide_safely(meta, p) and p._decisions == {}
