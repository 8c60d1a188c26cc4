"""Credentials at the gate, pure: where a placeholder may be swapped, where it is a leak."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentvm.gate.credentials import (
    BodyScanner,
    CredentialError,
    CredentialSet,
    Scrubber,
    compile_credentials,
    make_placeholder,
)

REAL = {"api": "sk-REAL-fake-test-value-0123456789abcdef", "user": "real-user-fake", "q": "real-query-key-fake-123456"}


def cred(name, hosts, *, header=None, fmt="{}", basic=None, query=None, prefix="", sigv4=None, hmac=None):
    return SimpleNamespace(
        name=name, env=name.upper() + "_KEY", ref=f"vault:{name}", hosts=hosts,
        inject=SimpleNamespace(header=header, format=fmt, basic=basic, query=query), file=None,
        placeholder=SimpleNamespace(prefix=prefix, length=None, charset="alnum"), sigv4=sigv4, hmac=hmac,
    )


BINDINGS = compile_credentials([
    cred("api", ["api.test"], header="Authorization", fmt="Bearer {}", prefix="sk-"),
    cred("user", ["*.svc.test"], basic="password"),
    cred("q", ["maps.test"], query="key"),
])


@pytest.fixture
def cs():
    revoked: set[str] = set()
    ph = {b.name: make_placeholder(b, len(REAL[b.name])) for b in BINDINGS}
    s = CredentialSet(BINDINGS, ph, lambda n: REAL[n], lambda n: n in revoked)
    s.revoked_set = revoked
    return s


def H(*pairs):
    return [(k.encode(), v.encode()) for k, v in pairs]


def test_placeholders_look_like_the_real_thing_and_are_unique():
    b = BINDINGS[0]
    p1, p2 = make_placeholder(b, 40), make_placeholder(b, 40)
    assert p1.startswith("sk-") and len(p1) == 40 and p1 != p2
    assert REAL["api"] not in p1


def test_header_swap_on_bound_host_only(cs):
    ph = cs.placeholders["api"]
    sw = cs.apply(host="api.test", scheme="https", target="/v1/x", headers=H(("Authorization", f"Bearer {ph}")))
    assert sw.headers == H(("Authorization", f"Bearer {REAL['api']}")) and sw.used == ["api"]
    with pytest.raises(CredentialError) as ei:
        cs.apply(host="evil.test", scheme="https", target="/", headers=H(("Authorization", f"Bearer {ph}")))
    assert ei.value.rule_id == "credential:leak:api" and ei.value.alert
    assert REAL["api"] not in str(ei.value) and ph not in str(ei.value)


@pytest.mark.parametrize(
    "scheme,target,headers,where",
    [
        ("http", "/", [("Authorization", "Bearer {ph}")], "plain HTTP"),
        ("https", "/", [("X-Api-Key", "{ph}")], "undeclared header"),
        ("https", "/", [("Authorization", "Token {ph}")], "wrong format"),
        ("https", "/search?q={ph}", [], "the query"),
        ("https", "/{ph}/x", [], "the path"),
        ("https", "/", [("Cookie", "s={ph}")], "a cookie"),
        ("https", "/", [("X-{ph}", "1")], "a header name"),
    ],
)
def test_placeholder_anywhere_else_is_a_leak(cs, scheme, target, headers, where):
    ph = cs.placeholders["api"]
    with pytest.raises(CredentialError) as ei:
        cs.apply(host="api.test", scheme=scheme, target=target.format(ph=ph),
                 headers=[(k.format(ph=ph).encode(), v.format(ph=ph).encode()) for k, v in headers])
    assert ei.value.rule_id == "credential:leak:api", where


def test_basic_auth_swap_and_leak(cs):
    ph = cs.placeholders["user"]
    good = "Basic " + base64.b64encode(f"bob:{ph}".encode()).decode()
    sw = cs.apply(host="db.svc.test", scheme="https", target="/", headers=H(("Authorization", good)))
    assert base64.b64decode(sw.headers[0][1][6:]) == f"bob:{REAL['user']}".encode()
    with pytest.raises(CredentialError):
        cs.apply(host="svc.test", scheme="https", target="/", headers=H(("Authorization", good)))  # *.svc.test only
    wrong_part = "Basic " + base64.b64encode(f"{ph}:x".encode()).decode()
    with pytest.raises(CredentialError):
        cs.apply(host="db.svc.test", scheme="https", target="/", headers=H(("Authorization", wrong_part)))


def test_query_swap(cs):
    ph = cs.placeholders["q"]
    sw = cs.apply(host="maps.test", scheme="https", target=f"/geo?addr=x&key={ph}", headers=[])
    assert sw.target == f"/geo?addr=x&key={REAL['q']}"
    with pytest.raises(CredentialError):
        cs.apply(host="maps.test", scheme="https", target=f"/geo?other={ph}", headers=[])


def test_revoked_credential_is_denied_not_swapped(cs):
    cs.revoked_set.add("api")
    with pytest.raises(CredentialError) as ei:
        cs.apply(host="api.test", scheme="https", target="/", headers=H(("Authorization", f"Bearer {cs.placeholders['api']}")))
    assert ei.value.rule_id == "credential:revoked:api" and not ei.value.alert


def test_connect_or_sni_carrying_a_placeholder(cs):
    ph = cs.placeholders["api"]
    with pytest.raises(CredentialError):
        cs.check_target(f"{ph.lower()}.evil.test")
    with pytest.raises(CredentialError):
        cs.check_target("api.test", sni=f"{ph}.evil.test")
    cs.check_target("api.test", sni="api.test")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=50), st.binary(max_size=200), st.binary(max_size=200))
def test_body_scanner_catches_a_split_placeholder(chunk, before, after):
    revoked: set = set()
    ph = {b.name: make_placeholder(b, len(REAL[b.name])) for b in BINDINGS}
    s = CredentialSet(BINDINGS, ph, lambda n: REAL[n], lambda n: n in revoked)
    body = before + ph["api"].encode() + after
    sc = s.body_scanner("api.test")
    released = b""
    with pytest.raises(CredentialError):
        for i in range(0, len(body), chunk):
            released += sc.feed(body[i : i + chunk])
        released += sc.finish()
    assert ph["api"].encode() not in released


def test_body_scanner_passes_clean_bodies_intact(cs):
    sc = cs.body_scanner("api.test")
    body = b"x" * 1000 + b"no placeholder here" * 10
    out = b"".join(sc.feed(body[i : i + 7]) for i in range(0, len(body), 7)) + sc.finish()
    assert out == body


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=60), st.binary(max_size=100))
def test_scrubber_replaces_real_values_across_chunks(chunk, noise):
    real = REAL["api"].encode()
    s = Scrubber([(real, b"sk-PLACEHOLDER")])
    data = noise + real + noise + real
    out = b"".join(s.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)) + s.finish()
    assert real not in out and out.count(b"sk-PLACEHOLDER") >= 2


def test_no_value_in_reprs(cs):
    assert "REAL" not in repr(cs) and all(v not in repr(BINDINGS) for v in REAL.values())


def test_placeholder_in_a_lower_cased_header_name_is_still_a_leak(cs):
    ph = cs.placeholders["api"]
    with pytest.raises(CredentialError):
        cs.apply(host="api.test", scheme="https", target="/", headers=[(f"x-{ph}".lower().encode(), b"1")])
