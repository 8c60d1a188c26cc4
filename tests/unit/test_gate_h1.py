"""The gate's HTTP/1.1 layer, sans-IO: request heads in, ProxyRequest or ProtocolError out.

Playbook style: each case is the bytes an agent sends and what the gate must conclude."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.gate import h1


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# ---- what must be accepted -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,expect",
    [
        (head("GET http://a.test/x?y=1 HTTP/1.1", "Host: a.test"), ("http", "a.test", 80, "/x?y=1")),
        (head("GET http://a.test:8080 HTTP/1.1", "Host: a.test:8080"), ("http", "a.test", 8080, "/")),
        (head("GET http://A.Test./p HTTP/1.1", "Host: a.test"), ("http", "A.Test.", 80, "/p")),
        (head("CONNECT a.test:443 HTTP/1.1", "Host: a.test:443"), ("connect", "a.test", 443, "")),
        (head("CONNECT [::1]:8443 HTTP/1.1", "Host: [::1]:8443"), ("connect", "[::1]", 8443, "")),
        (head("GET /inside HTTP/1.1", "Host: a.test"), ("origin", "a.test", 80, "/inside")),
        (head("POST http://a.test/u HTTP/1.1", "Host: a.test", "Content-Length: 3"), ("http", "a.test", 80, "/u")),
        (head("POST http://a.test/u HTTP/1.1", "Host: a.test", "Transfer-Encoding: chunked"), ("http", "a.test", 80, "/u")),
    ],
)
def test_accepted_requests(raw, expect):
    r = h1.parse_request(raw)
    assert (r.scheme, r.host, r.port, r.path) == expect


def test_body_framing_and_upgrade_are_reported():
    r = h1.parse_request(head("POST http://a.test/ HTTP/1.1", "Host: a.test", "Content-Length: 12"))
    assert r.content_length == 12 and not r.chunked
    r = h1.parse_request(head("GET http://a.test/ws HTTP/1.1", "Host: a.test", "Upgrade: websocket", "Connection: Upgrade"))
    assert r.upgrade_websocket


# ---- what must be refused (smuggling and ambiguity) -----------------------------------------


@pytest.mark.parametrize(
    "raw,code",
    [
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 3", "Transfer-Encoding: chunked"), "cl-and-te"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Content-Length: 3"), "cl-and-te"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 3", "Content-Length: 3"), "duplicate-content-length"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 3", "Content-Length: 4"), "duplicate-content-length"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 3, 3"), "bad-content-length"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: -1"), "bad-content-length"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Transfer-Encoding: gzip, chunked"), "bad-transfer-encoding"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"), "duplicate-transfer-encoding"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Transfer-Encoding : chunked"), "bad-header"),
        (head("GET http://a/ HTTP/1.1", "Host: a", "X-Long: a", " folded"), "obs-fold"),
        (head("GET http://a/ HTTP/1.1", "Host: a", "X-Long: a", "\tfolded"), "obs-fold"),
        (b"GET http://a/ HTTP/1.1\nHost: a\r\n\r\n", "bare-lf"),
        (b"GET http://a/ HTTP/1.1\r\nHost: a\x00\r\n\r\n", "bad-bytes"),
        (head("GET http://a/ HTTP/1.1", "Host: a", "X: \x01"), "bad-bytes"),
        (head("GET http://a.test/ HTTP/1.1", "Host: b.test"), "host-mismatch"),
        (head("GET http://a.test/ HTTP/1.1", "Host: a.test:81"), "host-mismatch"),
        (head("GET http://a.test@evil.test/ HTTP/1.1", "Host: evil.test"), "bad-authority"),
        (head("GET https://a.test/ HTTP/1.1", "Host: a.test"), "https-absolute-form"),
        (head("GET ftp://a.test/ HTTP/1.1", "Host: a.test"), "bad-target"),
        (head("CONNECT a.test HTTP/1.1", "Host: a.test"), "bad-connect"),
        (head("CONNECT a.test:99999 HTTP/1.1", "Host: a.test"), "bad-port"),
        (head("CONNECT a.test:0 HTTP/1.1", "Host: a.test"), "bad-port"),
        (head("GET http://a/ HTTP/1.1", "Host: a", "Host: b"), "bad-request"),
        (head("GET http://a/ HTTP/1.1"), "bad-request"),  # HTTP/1.1 without Host
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: " + "9" * 5000), "bad-content-length"),
        (head("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 4", "Connection: content-length"), "bad-connection"),
    ],
)
def test_refused_requests(raw, code):
    with pytest.raises(h1.ProtocolError) as ei:
        h1.parse_request(raw)
    assert ei.value.code == code


def test_head_reader_is_incremental_and_bounded():
    hr = h1.HeadReader(limit=1024)
    raw = head("GET http://a/ HTTP/1.1", "Host: a") + b"BODY"
    for i, b in enumerate(raw):
        done = hr.feed(bytes([b]))
        if done:
            break
    assert hr.head == raw[:-4] and hr.rest == b""
    hr.feed(b"Y")
    assert hr.rest == b"Y"
    with pytest.raises(h1.ProtocolError) as ei:
        h1.HeadReader(limit=100).feed(b"GET http://a/ HTTP/1.1\r\nX: " + b"a" * 200)
    assert ei.value.code == "head-too-large"


def test_hop_by_hop_headers_are_not_forwarded():
    r = h1.parse_request(
        head(
            "GET http://a.test/ HTTP/1.1", "Host: a.test", "Proxy-Authorization: Basic eA==", "Connection: keep-alive, X-Secret",
            "X-Secret: 1", "Keep-Alive: 5", "Accept: */*", "TE: trailers",
        )
    )
    names = [k for k, _ in h1.forward_headers(r, "a.test")]
    assert names == [b"host", b"accept"]


def test_deny_response_explains_itself():
    raw = h1.deny_response("allow[2]\r\nX-Evil: 1", "no rule allows it", host="x.test", port=443)
    head_, _, body = raw.partition(b"\r\n\r\n")
    lines = head_.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 403 Forbidden"
    denied = [ln for ln in lines if ln.startswith(b"X-Agentvm-Denied: ")]
    assert len(denied) == 1 and b"\r" not in denied[0][18:] and b"X-Evil" not in b"\n".join(lines[1:]).split(b"X-Agentvm-Denied")[0]
    doc = json.loads(body)
    assert doc["error"] == "egress-denied" and doc["host"] == "x.test" and doc["port"] == 443
    assert int(dict(ln.split(b": ", 1) for ln in lines[1:])[b"Content-Length"]) == len(body)


# ---- fuzzing: the byte-level layer only ever answers with ProtocolError ------------------------

TOKENS = [b"GET ", b"POST ", b"CONNECT ", b"http://", b"a.test", b":443", b"/", b" HTTP/1.1", b"\r\n", b"\n", b"Host: ",
          b"Content-Length: ", b"Transfer-Encoding: chunked", b"0", b"5", b" ", b"\t", b"\x00", b"@", b"[::1]", b":", b"\r\n\r\n"]


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(st.binary(max_size=512), st.lists(st.sampled_from(TOKENS), max_size=40).map(b"".join)))
def test_fuzz_parse_request_never_crashes(data):
    hr = h1.HeadReader(limit=4096)
    try:
        if not hr.feed(data):
            return
        req = h1.parse_request(hr.head)
    except h1.ProtocolError:
        return
    assert req.scheme in ("connect", "http", "origin")
    assert 0 < req.port < 65536 or req.scheme == "origin"


def test_origin_form_host_without_port_is_marked():
    r = h1.parse_request(head("GET /x HTTP/1.1", "Host: api.test"))
    assert r.scheme == "origin" and not r.explicit_port
    r = h1.parse_request(head("GET /x HTTP/1.1", "Host: api.test:8443"))
    assert r.explicit_port and r.port == 8443


def test_our_header_namespace_is_never_forwarded():
    r = h1.parse_request(head("GET http://a.test/ HTTP/1.1", "Host: a.test", "X-Agentvm-Sandbox: other", "Accept: */*"))
    assert [k for k, _ in h1.forward_headers(r, "a.test")] == [b"host", b"accept"]


# ---- the gate's own head parser is at least as strict as h11 (which it replaced) -----------------

METHODS = [b"GET"] * 4 + [b"POST"] * 3 + [b"CONNECT", b"PUT", b"G@T", b"", b"get"]
TARGETS = [b"http://a.test/", b"http://a.test:80/p?q=1", b"http://a.test:8080", b"/x", b"a.test:443", b"*",
           b"http://a.test/\xff", b"http://a.test/a b", b"https://a.test/", b"http://[::1]:80/", b"http://u@a.test/"]
VERSIONS = [b"HTTP/1.1"] * 6 + [b"HTTP/1.0"] * 2 + [b"HTTP/2.0", b"HTTP/1.1 x", b"http/1.1", b""]
NAMES = [b"X-A", b"Accept", b"User-Agent"] * 4 + [b"Host", b"host", b"Content-Length", b"Transfer-Encoding", b"X A", b"",
                                                   b"Upgrade", b"Connection"]
VALUES = [b"v", b"*/*", b"x y"] * 3 + [b"a.test", b"a.test:80", b"a.test:8080", b"5", b"05", b"chunked", b"gzip", b" v ",
                                       b"", b"\x01", b"\xff", b"websocket", b"close", b"\t"]
SEPS = [b": "] * 6 + [b":", b" : ", b":\t"]


@st.composite
def request_heads(draw):
    line = b" ".join([draw(st.sampled_from(METHODS)), draw(st.sampled_from(TARGETS)), draw(st.sampled_from(VERSIONS))])
    fields = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(SEPS), st.sampled_from(VALUES)), max_size=5))
    if draw(st.booleans()):
        fields.insert(0, (b"Host", b": ", draw(st.sampled_from([b"a.test", b"a.test:80", b"a.test:443"]))))
    eol = draw(st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r\n "]))
    return eol.join([line] + [n + sep + v for n, sep, v in fields]) + b"\r\n\r\n"


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(request_heads())
def test_differential_every_head_the_gate_accepts_h11_accepts_the_same_way(raw):
    import h11

    try:
        req, _ = h1.parse_head(raw)
    except h1.ProtocolError:
        return
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    ev = conn.next_event()  # must not raise: the gate accepted it
    assert isinstance(ev, h11.Request), ev
    assert ev.method.decode() == req.method and ev.target.decode() == req.target
    assert [(bytes(k), bytes(v)) for k, v in ev.headers] == list(req.headers)
    assert ev.http_version.decode() == req.http_version


def test_the_differential_generator_reaches_accepted_heads():
    """The test above is only as good as its inputs: a fair share must be accepted."""
    import random

    rnd, accepted = random.Random(7), 0
    for _ in range(3000):
        line = b" ".join([rnd.choice(METHODS), rnd.choice(TARGETS), rnd.choice(VERSIONS)])
        fields = [rnd.choice(NAMES) + rnd.choice(SEPS) + rnd.choice(VALUES) for _ in range(rnd.randint(0, 5))]
        if rnd.random() < 0.5:
            fields.insert(0, b"Host: " + rnd.choice([b"a.test", b"a.test:80", b"a.test:443"]))
        try:
            h1.parse_head(b"\r\n".join([line] + fields) + b"\r\n\r\n")
            accepted += 1
        except h1.ProtocolError:
            pass
    assert accepted > 100, accepted


def test_one_upgrade_header_at_most():
    with pytest.raises(h1.ProtocolError) as ei:
        h1.parse_request(head("GET http://a.test/ws HTTP/1.1", "Host: a.test", "Upgrade: websocket", "Upgrade: h2c",
                              "Connection: Upgrade"))
    assert ei.value.code == "duplicate-upgrade"


def _response_headers_reference(headers, *, keep_upgrade=False):
    """response_headers as first written (two passes, every name converted and lower-cased in each)."""
    named = set()
    for k, v in headers:
        if bytes(k).lower() == b"connection":
            named |= {t.strip().lower() for t in bytes(v).split(b",") if t.strip()}
    out = []
    for k, v in headers:
        k = bytes(k).lower()
        if keep_upgrade and k in (b"upgrade", b"connection"):
            out.append((k, bytes(v)))
            continue
        if k in h1.HOP_BY_HOP or k in named:
            continue
        out.append((k, bytes(v)))
    return out


_RESP_NAMES = st.sampled_from([b"Connection", b"connection", b"Keep-Alive", b"Upgrade", b"TE", b"X-A", b"x-a",
                               b"Content-Type", b"Transfer-Encoding", b"Proxy-Connection", b"Trailer"])
_RESP_VALUES = st.one_of(st.binary(max_size=12), st.sampled_from([b"x-a, keep-alive", b"close", b"X-A ,, Upgrade",
                                                                  b"upgrade", b" content-type "]))


@settings(max_examples=500, deadline=None)
@given(headers=st.lists(st.tuples(_RESP_NAMES, _RESP_VALUES), max_size=8), keep=st.booleans(),
       kind=st.sampled_from([bytes, bytearray, memoryview]))
def test_response_headers_is_the_reference(headers, keep, kind):
    given_ = [(kind(k), kind(v)) for k, v in headers]
    out = h1.response_headers(given_, keep_upgrade=keep)
    assert out == _response_headers_reference(headers, keep_upgrade=keep)
    assert all(type(k) is bytes and type(v) is bytes for k, v in out)


def test_not_ctl_is_every_byte_value_ctl_re_does_not_match():
    for b in range(256):
        assert (bytes([b]) in h1.NOT_CTL) == (h1.VALUE_CTL_RE.search(bytes([b])) is None), b


def _check_head_reference(head):
    """check_head as first written: the control-character search on every value, field by field."""
    if b"\x00" in head:
        raise h1.ProtocolError("bad-bytes", "")
    text = head[:-4]
    crlf = text.count(b"\r\n")
    if text.count(b"\r") != crlf or text.count(b"\n") != crlf:
        raise h1.ProtocolError("bare-lf", "")
    lines = text.split(b"\r\n")
    if len(lines) - 1 > h1.MAX_HEADERS:
        raise h1.ProtocolError("too-many-headers", "")
    cl = te = upgrades = 0
    fields = []
    for ln in lines[1:]:
        if ln[:1] in (b" ", b"\t"):
            raise h1.ProtocolError("obs-fold", "")
        name, sep, value = ln.partition(b":")
        if not sep or not name or name.strip(h1.TCHAR):
            raise h1.ProtocolError("bad-header", "")
        lname = name.lower()
        if lname == b"content-length":
            cl += 1
            v = value.strip()
            if not v.isdigit() or len(v) > 18:
                raise h1.ProtocolError("bad-content-length", "")
        elif lname == b"upgrade":
            upgrades += 1
        elif lname == b"transfer-encoding":
            te += 1
            if value.strip().lower() != b"chunked":
                raise h1.ProtocolError("bad-transfer-encoding", "")
        if h1.VALUE_CTL_RE.search(value):
            raise h1.ProtocolError("bad-bytes", "")
        if lname == b"connection" and h1._CONNECTION_BAD.search(value.lower()):
            raise h1.ProtocolError("bad-connection", "")
        fields.append((lname, value.strip(b" \t")))
    if upgrades > 1:
        raise h1.ProtocolError("duplicate-upgrade", "")
    if cl > 1:
        raise h1.ProtocolError("duplicate-content-length", "")
    if te > 1:
        raise h1.ProtocolError("duplicate-transfer-encoding", "")
    if cl and te:
        raise h1.ProtocolError("cl-and-te", "")
    return lines[0], fields


_HEAD_PIECES = st.sampled_from([b"a", b"Host", b":", b": ", b" ", b"\t", b"\x01", b"\x7f", b"\x80", b"\x1f", b"\x0b",
                                b"Content-Length", b"12", b"x", b"Transfer-Encoding", b"chunked", b"Upgrade",
                                b"Connection", b"close", b"host", b"\x00", b"\r", b"\n", b"\r\n", b"GET / HTTP/1.1"])


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.lists(_HEAD_PIECES, max_size=6).map(b"".join), max_size=5),
       st.sampled_from([b"GET http://a/ HTTP/1.1", b"GET /\x01 HTTP/1.1", b"G\x7fT / HTTP/1.1", b""]),
       st.sampled_from([b"\r\n\r\n", b"\r\n\r\n", b"\r\n\r\n", b"\n\r\n\r", b"\r\n\x00\n", b"a\r\n\r", b"", b"\r"]))
def test_check_head_gives_what_the_field_by_field_check_gave(lines, first, end):
    """The one-pass control-byte checks (the whole head, then the fields) change no answer:
    the same fields, or the same error code for the same head - also for a head that does not
    end as the reader delivers it (CRLF CRLF)."""
    head = b"\r\n".join([first, *lines]) + end
    try:
        want = _check_head_reference(head)
    except h1.ProtocolError as e:
        with pytest.raises(h1.ProtocolError) as got:
            h1.check_head(head)
        assert got.value.code == e.code, head
    else:
        assert h1.check_head(head) == want
