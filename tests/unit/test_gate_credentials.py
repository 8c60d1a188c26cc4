"""Credentials at the gate, pure: where a placeholder may be swapped, where it is a leak."""

from __future__ import annotations

import base64
import json
import re
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentvm.gate.credentials import (
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


def test_basic_auth_placeholder_in_the_undeclared_part_is_a_leak(cs):
    """``basic: password``: a placeholder in the user part would travel upstream as written."""
    ph = cs.placeholders["user"]
    both = "Basic " + base64.b64encode(f"{ph}:{ph}".encode()).decode()
    with pytest.raises(CredentialError) as ei:
        cs.apply(host="db.svc.test", scheme="https", target="/", headers=H(("Authorization", both)))
    assert ei.value.rule_id == "credential:leak:user" and ei.value.alert
    other = "Basic " + base64.b64encode(f"{cs.placeholders['api']}:{ph}".encode()).decode()
    with pytest.raises(CredentialError) as ei:
        cs.apply(host="db.svc.test", scheme="https", target="/", headers=H(("Authorization", other)))
    assert ei.value.rule_id == "credential:leak:api"


# -- the scrubber knows every form the gate produces or that trivially carries a value ------
ECHO_REAL = b'wJalrXUtnFEMI/K7MDENG+bPxRfiCY="EXAMPLE\\KEY'
ECHO_PH = b"sk-" + b"P" * (len(ECHO_REAL) - 3)


def _carriers(real: bytes) -> dict[str, bytes]:
    from urllib.parse import quote, quote_plus

    text = real.decode()
    return {
        "raw": b"x" + real + b"y",
        "basic": b"Basic " + base64.b64encode(b"alice:" + real),
        "b64-0": base64.b64encode(real + b"tail"),
        "b64-1": base64.b64encode(b"a" + real),
        "b64-2": base64.b64encode(b"ab" + real + b"c"),
        "b64url": base64.urlsafe_b64encode(b"{\"k\": \"" + real + b"\"}"),
        "pct": b"/q?key=" + quote(text, safe="").encode(),
        "pct-lower": b"/q?key=" + re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(text, safe="")).encode(),
        "pct-plus": b"k=" + quote_plus(text).encode(),
        "pct-slash-kept": quote(text).encode(),
        "json": json.dumps({"h": text}).encode(),
        "json-slash": json.dumps({"h": text}).replace("/", "\\/").encode(),
        "json-ascii-false": json.dumps({"h": text}, ensure_ascii=False).encode(),
        "hex": real.hex().encode(),
        "HEX": real.hex().upper().encode(),
    }


def _decodings(data: bytes) -> list[bytes]:
    """What a client could get back out of ``data`` by undoing the carrier's encoding."""
    import binascii
    from urllib.parse import unquote, unquote_plus

    out = [data, unquote(data.decode("latin-1")).encode("latin-1"), unquote_plus(data.decode("latin-1")).encode("latin-1")]
    for text in (data, data.split(b" ")[-1]):
        for dec in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                out.append(dec(text + b"=" * (-len(text) % 4)))
            except (binascii.Error, ValueError):
                pass
    try:
        out.append(json.dumps(json.loads(data), ensure_ascii=False).encode())
        out.append(json.loads(data)["h"].encode())
    except (ValueError, KeyError, TypeError):
        pass
    try:
        out.append(bytes.fromhex(data.decode()))
    except ValueError:
        pass
    return out


@pytest.mark.parametrize("carrier", sorted(_carriers(ECHO_REAL)))
def test_every_encoded_form_is_scrubbed_and_decodes_to_the_placeholder(carrier):
    data = _carriers(ECHO_REAL)[carrier]
    assert any(ECHO_REAL in d for d in _decodings(data)), "the carrier really carries the value"
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    out = s.feed(data) + s.finish()
    assert s.hits >= 1, carrier
    for d in _decodings(out):
        assert ECHO_REAL not in d, (carrier, out)
        assert ECHO_REAL[4:-4] not in d, (carrier, out)  # not even most of it
    assert any(ECHO_PH[4:-4] in d for d in _decodings(out)), (carrier, out)  # the client reads the placeholder


@given(carrier=st.sampled_from(sorted(_carriers(ECHO_REAL))), cuts=st.lists(st.integers(0, 400), max_size=12),
       before=st.binary(max_size=40), after=st.binary(max_size=40))
def test_encoded_forms_split_across_chunks_are_still_found(carrier, cuts, before, after):
    data = before + _carriers(ECHO_REAL)[carrier] + after
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    out = b""
    last = 0
    for c in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
        out += s.feed(data[last:c])
        last = c
    out += s.finish()
    whole = Scrubber([(ECHO_REAL, ECHO_PH)])
    assert out == whole.feed(data) + whole.finish()


def test_the_scrubber_releases_a_stream_event_at_once_and_still_joins_a_split_value():
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    event = b"data: {\"delta\": \"hello\"}\n\n"
    assert s.feed(event) == event  # a piece that ends its line goes out at once
    part = b"data: " + ECHO_REAL[:10]
    held = s.feed(part)  # the end of an unfinished line waits for the next piece (whatever it is)
    assert held + s.feed(ECHO_REAL[10:] + b"\n\n") == b"data: " + ECHO_PH + b"\n\n"


def _spellings(text: bytes) -> dict[str, bytes]:
    return {"raw": text, "json": b"".join(b"\\u%04x" % c for c in text), "pct": b"".join(b"%%%02X" % c for c in text),
            "html": b"".join(b"&#x%x;" % c for c in text), "css": b"".join(b"\\%x " % c for c in text),
            "hex": text.hex().encode()}


@pytest.mark.parametrize("before", [b"", b"BEGIN:", b"line one\nBEGIN:", b"x" * 300])
def test_what_the_scrubber_holds_back_never_tells_whether_a_text_starts_a_value(before):
    """Review 8 (HIGH): the scrubber held back the longest tail that could still become a value,
    so how much of a reflected text arrived before the upstream paused told the sandbox whether
    its guess of a value's start was right - a character at a time, ~64 guesses each, on any
    allowed host. What waits must be the same for the start of a value and for any other text
    of its length, in every spelling the scrubber reads (fails on the previous hold: it released
    fewer bytes for the true prefix)."""
    from agentvm.gate.credentials import ScrubTable

    real = ECHO_REAL
    # another value of the same length and make-up: the sandbox's text is a prefix of one of them
    fake = bytes(c + 1 if chr(c).isalnum() and chr(c + 1).isalnum() else c for c in real)
    assert fake != real and len(fake) == len(real)
    mine, theirs = ScrubTable([(real, ECHO_PH)]), ScrubTable([(fake, ECHO_PH)])
    for k in range(1, len(real)):
        for name, spell in _spellings(real[:k]).items():
            a, b = Scrubber(mine), Scrubber(theirs)
            out_a, out_b = a.feed(before + spell), b.feed(before + spell)
            assert len(out_a) == len(out_b), (name, k, out_a[-40:], out_b[-40:])
            # the rest arrives with the next piece, scrubbed (the value whole: replaced)
            assert real not in out_a + a.feed(real[k:]) + a.finish()


def test_a_clean_line_break_ends_the_hold_but_an_escape_across_it_does_not():
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    # quoted-printable's soft line break goes on across the line: the value spelled across it is
    # still replaced when the rest comes
    qp = b"".join(b"=%02X" % c for c in ECHO_REAL)
    out = s.feed(b"text " + qp[:12] + b"=\r\n") + s.feed(qp[12:] + b" end\n") + s.finish()
    assert ECHO_REAL not in out and qp not in out


def test_raw_only_scrubber_misses_encoded_forms():
    """The selftest's weakened configuration: proves the encoded forms are what catches these."""
    s = Scrubber([(ECHO_REAL, ECHO_PH)], encoded=False)
    data = _carriers(ECHO_REAL)["basic"]
    assert s.feed(data) + s.finish() == data and s.hits == 0


def test_a_form_right_after_a_re_encoded_base64_match_is_replaced_too():
    """Re-encoding a base64 match takes up to 3 characters past it; a raw value starting there
    must still be found (it once went out whole)."""
    real = b"REALsecret-abcdef0123456789XYZ"[:29]
    ph = b"P" * 29
    for lead in (b"", b"xx"):
        s = Scrubber([(real, ph)])
        out = s.feed(lead + base64.b64encode(real).rstrip(b"=") + real) + s.finish()
        assert real not in out and real[3:-3] not in out, out


def test_two_basic_credentials_user_and_password_on_one_host():
    bindings = compile_credentials([cred("u", ["db.test"], basic="user"), cred("p", ["db.test"], basic="password")])
    real = {"u": "real-user-name", "p": "real-password-value"}
    ph = {b.name: make_placeholder(b, len(real[b.name])) for b in bindings}
    s = CredentialSet(bindings, ph, lambda n: real[n], lambda n: False)
    hdr = "Basic " + base64.b64encode(f"{ph['u']}:{ph['p']}".encode()).decode()
    sw = s.apply(host="db.test", scheme="https", target="/", headers=H(("Authorization", hdr)))
    assert base64.b64decode(sw.headers[0][1][6:]) == b"real-user-name:real-password-value"
    assert sorted(sw.used) == ["p", "u"]
    swapped = "Basic " + base64.b64encode(f"{ph['p']}:{ph['u']}".encode()).decode()
    with pytest.raises(CredentialError):
        s.apply(host="db.test", scheme="https", target="/", headers=H(("Authorization", swapped)))


def _outcome(s, host, headers):
    try:
        sw = s.apply(host=host, scheme="https", target="/", headers=list(headers))
    except CredentialError as err:
        return ("refused", err.rule_id)
    return ("swapped", sw.headers, sw.used)


_NAMES = st.sampled_from([b"authorization", b"Authorization", b"proxy-authorization", b"x-api-key", b"accept",
                          b"x-authorization-hint", b"cookie"])


@settings(max_examples=400, deadline=None)
@given(data=st.data(), host=st.sampled_from(["api.test", "a.svc.test", "maps.test", "elsewhere.test"]))
def test_the_one_search_over_all_headers_decides_exactly_as_header_by_header(data, host):
    """apply() first searches all header lines at once; only when that finds a placeholder (any
    case) or an Authorization-like name does it go header by header. Forcing the header-by-header
    path every time must give the same swap, the same headers and the same refusals."""
    revoked: set[str] = set()
    ph = {b.name: make_placeholder(b, len(REAL[b.name])) for b in BINDINGS}
    fast = CredentialSet(BINDINGS, ph, lambda n: REAL[n], lambda n: n in revoked)
    slow = CredentialSet(BINDINGS, ph, lambda n: REAL[n], lambda n: n in revoked)
    slow._header_work = re.compile(b"")  # matches everything: always header by header
    pieces = [p.encode() for p in ph.values()] + [p.lower().encode() for p in ph.values()] + [
        b"Bearer " + ph["api"].encode(), b"Basic " + base64.b64encode(b"u:" + ph["user"].encode()),
        b"Basic " + base64.b64encode(b"u:plain"), b"text/html", b"", b"x"]
    value = st.lists(st.sampled_from(pieces), max_size=3).map(b"".join)
    name = _NAMES | st.sampled_from([p.encode() for p in ph.values()]).map(lambda p: b"x-" + p.lower())
    headers = data.draw(st.lists(st.tuples(name, value), max_size=5))
    assert _outcome(fast, host, headers) == _outcome(slow, host, headers)


def test_headers_without_placeholders_pass_as_they_are(cs):
    headers = H(("accept", "*/*"), ("user-agent", "curl/8"), ("x-trace", "abc"))
    sw = cs.apply(host="api.test", scheme="https", target="/", headers=headers)
    assert sw.headers == headers and sw.headers is not headers and sw.used == []


def test_headers_given_as_an_iterator_are_still_checked(cs):
    """apply() reads the headers twice (one search, then header by header): an iterator must
    not be spent by the first read and let the placeholder through (review finding)."""
    bearer = "Bearer " + cs.placeholders["api"]
    with pytest.raises(CredentialError):
        cs.apply(host="elsewhere.test", scheme="https", target="/", headers=iter(H(("authorization", bearer))))
    sw = cs.apply(host="api.test", scheme="https", target="/", headers=iter(H(("authorization", bearer))))
    assert sw.used == ["api"] and sw.headers == [(b"authorization", b"Bearer " + REAL["api"].encode())]


@settings(max_examples=300, deadline=None)
@given(hosts=st.lists(st.sampled_from(["api.test", "API.TEST.", "a.svc.test", "svc.test", "maps.test", "x.maps.test",
                                       "elsewhere.test", "[::1]", "api.test:443", ""]) | st.text(max_size=12),
                      max_size=30))
def test_bound_to_remembers_only_what_it_would_answer_again(hosts):
    """bound_to's answers are cached by (patterns, host): the same answer as asked afresh, in
    any order, and the cache stays bounded."""
    from agentvm.gate import credentials as cm

    cm._bound.cache_clear()
    for b in BINDINGS:
        for h in hosts + hosts[::-1]:
            assert b.bound_to(h) == cm._bound_to(b.hosts, h), (b.name, h)
            assert cm._bound.cache_info().currsize <= 1024


def test_bindings_given_as_an_iterator_still_swap():
    """CredentialSet reads its bindings once: an iterator must give the same set as a tuple
    (review finding: the header forms were built from a second, spent read)."""
    ph = {b.name: make_placeholder(b, len(REAL[b.name])) for b in BINDINGS}
    s = CredentialSet(iter(BINDINGS), ph, lambda n: REAL[n], lambda n: False)
    sw = s.apply(host="api.test", scheme="https", target="/", headers=[(b"authorization", b"Bearer " + ph["api"].encode())])
    assert sw.headers == [(b"authorization", b"Bearer " + REAL["api"].encode())] and sw.used == ["api"]


# -- text escapes as a class, and values split across events (issue 35 item 3) ---------------
def _escaped(real: bytes) -> dict[str, bytes]:
    import html
    import quopri
    from urllib.parse import quote

    t = real.decode()
    return {
        "html-dec": "".join(f"&#{ord(c)};" for c in t).encode(),
        "html-hex": "".join(f"&#x{ord(c):x};" for c in t).encode(),
        "html-named": html.escape(t).encode(),
        "html-twice": html.escape(html.escape(t)).encode(),
        "xml-mixed": "".join(f"&#x{ord(c):X};" if i % 2 else c for i, c in enumerate(t)).encode(),
        "js-x": "".join(f"\\x{ord(c):02x}" for c in t).encode(),
        "js-u": "".join(f"\\u{ord(c):04x}" for c in t).encode(),
        "js-braces": "".join(f"\\u{{{ord(c):x}}}" for c in t).encode(),
        "json-in-json": json.dumps(json.dumps({"a": t})).encode(),
        "css": "".join(f"\\{ord(c):x} " for c in t).encode(),
        "pct-twice": quote(quote(t, safe=""), safe="").encode(),
        "pct-every-byte": "".join(f"%{b:02X}" for b in real).encode(),
        "quoted-printable": quopri.encodestring(real * 3),
        "base32": base64.b32encode(b"xy" + real),
        "utf-16": json.dumps({"a": t}).encode("utf-16"),
        "base64url-unpadded": base64.urlsafe_b64encode(b"q" + real).rstrip(b"="),
    }


@pytest.mark.parametrize("form", sorted(_escaped(ECHO_REAL)))
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_value_in_text_escapes_is_replaced_in_any_chunking_and_the_rest_stays(form, step):
    data = b"<p>before " + _escaped(ECHO_REAL)[form] + b" after</p>"
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    out = b"".join(s.feed(data[i:i + step]) for i in range(0, len(data), step)) + s.finish()
    assert s.hits >= 1 and _escaped(ECHO_REAL)[form] not in out
    assert out.startswith(b"<p>before ") and out.endswith(b" after</p>")
    from agentvm.selftest.cases.credentials import all_decoded_views
    import html

    for view in all_decoded_views(html.unescape(out.decode("latin-1")).encode("latin-1"))[0] + [out]:
        assert ECHO_REAL[4:-4] not in view


def test_escapes_of_other_text_are_left_as_they_are():
    s = Scrubber([(ECHO_REAL, ECHO_PH)])
    page = b'<a href="/x?a=1&amp;b=%20c">&#x41;&lt;b&gt; caf\\u00e9 \\x41 \\41 =3D</a>' * 50
    assert b"".join(s.feed(page[i:i + 13]) for i in range(0, len(page), 13)) + s.finish() == page and s.hits == 0


def test_a_value_split_across_stream_events_cuts_the_stream_before_it_is_whole():
    from agentvm.gate.credentials import StreamGuard
    from agentvm.gate.encoding import DecodeError

    real = REAL["api"].encode()
    s = Scrubber([(real, b"sk-" + b"P" * (len(real) - 3))])
    g = StreamGuard(s._t)
    sent = b""
    ev = lambda d: b"data: " + json.dumps({"choices": [{"delta": {"content": d}}]}).encode() + b"\n\n"  # noqa: E731
    with pytest.raises(DecodeError) as ei:
        for piece in ("Your key is ", real[:3].decode(), real[3:12].decode(), real[12:].decode(), "."):
            sent += g.feed(s.feed(ev(piece)))
    assert ei.value.rule_id == "credential:echo-split"
    assert real[:4] not in sent and b"Your key is " in sent  # what came before went out as it came


def test_a_stream_guard_holds_at_most_its_bound():
    from agentvm.gate.credentials import StreamGuard
    from agentvm.gate.encoding import DecodeError

    real = REAL["api"].encode()
    g = StreamGuard(Scrubber([(real, b"x" * len(real))])._t)
    g.HOLD_MAX = 10_000
    assert g.feed(b"data: " + real[:8] + b"\n\n") == b""  # could be the start: held
    with pytest.raises(DecodeError) as ei:
        for _ in range(100):
            g.feed(b'data: {"other": "' + b"z" * 200 + b'"}\n\n')
    assert ei.value.rule_id == "credential:uninspectable-stream"


@pytest.mark.parametrize("where", ["path", "query", "header", "header-name", "basic", "body", "body-split", "b64", "host"])
def test_a_real_value_from_the_sandbox_is_a_leak_wherever_it_is(cs, where):
    """Review 8 (MEDIUM): the gate looked for placeholders only, so a real value the agent had
    got hold of (an echo, a side channel) went to any allowed host - and into the decision log.
    The sandbox never holds a real value: one it sends is blocked, an alert, named. (In the
    forms responses are scrubbed of; an agent that has a value can transform it beyond them -
    the defence is that it never gets one, this is the alarm.)"""
    real = REAL["api"]
    scanner = None
    try:
        if where == "path":
            cs.check_request("other.test", "/x/" + real, [])
        elif where == "query":
            cs.check_request("other.test", "/x?k=" + real, [])
        elif where == "header":
            cs.check_request("other.test", "/", H(("X-Note", "it is " + real)))
        elif where == "header-name":
            cs.check_request("other.test", "/", H((real, "1")))
        elif where == "basic":
            cs.check_request("x.svc.test", "/",
                             H(("Authorization", "Basic " + base64.b64encode(b"u:" + REAL["user"].encode()).decode())))
        elif where == "b64":
            cs.check_request("other.test", "/?d=" + base64.b64encode(real.encode()).decode(),
                     headers=[])
        elif where == "host":
            cs.check_request(real.lower()[:20] + "-" + real.lower()[20:] + ".evil.test", "/", [])
            cs.check_target("evil.test", sni=real)
        else:
            scanner = cs.body_scanner("other.test")
            data = b'{"note": "' + real.encode() + b'"}'
            cuts = [len(data)] if where == "body" else [12, 15, 30, len(data)]
            last = 0
            for c in cuts:
                scanner.feed(data[last:c])
                last = c
            scanner.finish()
    except CredentialError as err:
        assert err.rule_id in ("credential:leak-real:api", "credential:leak-real:user"), err.rule_id
        assert err.alert
        return
    pytest.fail(f"a real value in the {where} was not refused")


def test_a_request_without_real_values_is_not_refused_and_placeholders_still_swap(cs):
    ph = cs.placeholders["api"]
    sw = cs.apply(host="api.test", scheme="https", target="/v1/models?limit=5",
                  headers=H(("Authorization", f"Bearer {ph}"), ("X-Text", "sk-REAL-fake but not the value")))
    assert sw.used == ["api"] and (b"authorization", f"Bearer {REAL['api']}".encode()) in \
        [(k.lower(), v) for k, v in sw.headers]
    s = cs.body_scanner("other.test")
    assert s.feed(b"x" * 1000) + s.finish() == b"x" * 1000


def test_a_refused_real_value_never_reaches_the_decision_log():
    from agentvm.gate.credentials import CredentialError as CE
    from agentvm.gate.exchange import cred_deny

    req = SimpleNamespace(host="other.test", port=443, method="GET", scheme="https", path="/x/" + REAL["api"], headers=())
    d = cred_deny(req, CE("credential:leak-real:api", "r", name="api", where="the path", alert=True))
    assert REAL["api"] not in repr(d.log_fields())


def test_a_value_rotated_away_mid_session_is_still_scrubbed():
    """Review 8 (LOW): after `agentvm secret set` only the new value was scrubbed, and a value
    the vault could not give at that moment dropped out of the table - an upstream echoing
    the old one (swapped a minute ago) handed it to the sandbox."""
    values = {"api": "sk-OLD-fake-value-0123456789abcdef0123", "user": REAL["user"], "q": REAL["q"]}
    ph = {b.name: make_placeholder(b, 40) for b in BINDINGS}
    s = CredentialSet(BINDINGS, ph, lambda n: values[n], lambda n: False)
    s.apply(host="api.test", scheme="https", target="/", headers=H(("Authorization", f"Bearer {ph['api']}")))
    s.scrubber()
    values["api"] = "sk-NEW-fake-value-0123456789abcdef0123"
    sc = s.scrubber()
    out = sc.feed(b"old sk-OLD-fake-value-0123456789abcdef0123 new sk-NEW-fake-value-0123456789abcdef0123\n") + sc.finish()
    assert b"OLD-fake" not in out and b"NEW-fake" not in out and sc.hits == 2
    del values["api"]  # the vault cannot give it now
    sc = s.scrubber()
    out = sc.feed(b"sk-NEW-fake-value-0123456789abcdef0123\n") + sc.finish()
    assert b"NEW-fake" not in out


def test_a_signature_the_gate_made_is_scrubbed_from_every_later_response_in_any_case(cs):
    """Review 9 (MEDIUM): a signature made with a real key was scrubbed from its own request's
    answer only, in its exact case: an upstream that stored the request and showed it later
    (another host, another connection), or upper-cased the hex, handed the sandbox a presigned
    URL signed with the real key. Now every later answer of the session, in any case, and a
    sandbox that sends one back is a leak."""
    made = b"17693d0b1af315923c0683eee1792032b1943690908573acedae5cc32274d750"
    agent = b"f0f414d28fbcd48efcc71eeff2d160fc17f255064e4dc4f7c1f12441256d5a78"
    cs.remember_derived([(made, agent)])
    for text in (made, made.upper(), b"X-Amz-Signature=" + made + b"&y=1"):
        sc = cs.scrubber()
        out = sc.feed(b"echo " + text[:20]) + sc.feed(text[20:] + b" end\n") + sc.finish()
        assert made not in out.lower() and agent in out, out
        assert sc.hits == 1
    assert made.decode() not in repr(cs.scrubber().headers([(b"x-echo", made.upper())]))
    with pytest.raises(CredentialError) as ei:
        cs.check_request("other.test", "/?s=" + made.decode().upper(), [])
    assert ei.value.rule_id == "credential:leak-real:signature"
