"""HTTP/1.1 framing of the gate's relay (``agentvm.gate.framing``), sans-IO.

Request bodies come from a hostile sandbox: the chunked decoder must agree with a strict
reading of RFC 9112 or refuse (a proxy and a server that disagree on where a body ends is
request smuggling). Responses come from an upstream through llhttp.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.gate import framing as fr


def body_of(reader: fr.RequestBody, *feeds: bytes) -> tuple[bytes, bool]:
    """Feed ``feeds`` one by one; -> (the body decoded so far, whether it ended)."""
    out = bytearray()
    feeds = list(feeds)
    while True:
        ev = reader.next_event()
        if ev is fr.END:
            return bytes(out), True
        if ev is fr.NEED_DATA:
            if not feeds:
                return bytes(out), False
            reader.receive_data(feeds.pop(0))
            continue
        out += ev


def test_content_length_body_and_what_follows_is_the_next_request():
    r = fr.RequestBody(5, False, b"hel")
    body, done = body_of(r, b"loGET / HTTP/1.1\r\n")
    assert (body, done, r.trailing) == (b"hello", True, b"GET / HTTP/1.1\r\n")


def test_no_body():
    r = fr.RequestBody(None, False, b"NEXT")
    assert body_of(r) == (b"", True) and r.trailing == b"NEXT"


def test_chunked_in_pieces_of_one_byte():
    raw = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    r = fr.RequestBody(None, True)
    body, done = body_of(r, *[bytes([b]) for b in raw])
    assert (body, done, r.trailing) == (b"hello world", True, b"")
    r = fr.RequestBody(None, True, raw[:7])
    assert body_of(r, raw[7:] + b"NEXT") == (b"hello world", True) and r.trailing == b"NEXT"


@pytest.mark.parametrize("raw", [
    b"5\nhello\r\n0\r\n\r\n",  # bare LF after the size
    b"5\r\nhello\n0\r\n\r\n",  # bare LF after the data
    b"5\r\nhelloXY0\r\n\r\n",  # data not followed by CRLF
    b"5\r\r\nhello\r\n0\r\n\r\n",  # bare CR
    b"-5\r\nhello\r\n0\r\n\r\n",
    b"0x5\r\nhello\r\n0\r\n\r\n",
    b" 5\r\nhello\r\n0\r\n\r\n",
    b"\r\nhello\r\n0\r\n\r\n",  # empty size
    b"11111111111111111\r\n",  # 17 hex digits
    b"5;\x00\r\nhello\r\n0\r\n\r\n",  # NUL in an extension
    b"0\r\n folded: x\r\n\r\n",  # obs-fold in a trailer
    b"0\r\nbad header\r\n\r\n",
    b"0\r\nX: a\x01b\r\n\r\n",
    b"5" + b";" * 2000 + b"\r\n",  # an endless chunk line
])
def test_broken_chunked_framing_is_refused(raw):
    r = fr.RequestBody(None, True, raw)
    with pytest.raises(fr.FramingError):
        body_of(r)


def test_eof_inside_a_body():
    for r, raw in ((fr.RequestBody(10, False), b"12345"), (fr.RequestBody(None, True), b"5\r\nhel")):
        with pytest.raises(EOFError):
            body_of(r, raw, b"")


def test_trailers_are_bounded():
    r = fr.RequestBody(None, True, b"0\r\n" + b"X: " + b"a" * 1000 + b"\r\n")
    with pytest.raises(fr.FramingError):
        body_of(r, *([b"X: " + b"a" * 1000 + b"\r\n"] * 80))


CHUNK_TOKENS = [b"0", b"5", b"a", b"F", b"\r\n", b"\n", b"\r", b";x=1", b"hello", b" ", b"X: y", b"\x00", b"-"]


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.sampled_from(CHUNK_TOKENS), max_size=30).map(b"".join), st.integers(1, 7))
def test_fuzz_chunked_agrees_with_a_reference_reading_or_refuses(raw, step):
    """Any split of the input gives the same answer, and an accepted body is exactly what a
    strict reference decoder reads (so the gate and a strict server never disagree)."""
    def decode(feeds):
        r = fr.RequestBody(None, True)
        try:
            return body_of(r, *feeds), r.trailing
        except fr.FramingError:
            return "refused"

    whole = decode([raw] if raw else [])
    pieces = decode([raw[i:i + step] for i in range(0, len(raw), step)])
    # the same body and end, however it arrives (what follows the end is only what had arrived)
    assert (whole if whole == "refused" else whole[0]) == (pieces if pieces == "refused" else pieces[0])
    if whole != "refused" and whole[0][1]:
        assert _reference(raw) == (whole[0][0], whole[1])


def _reference(raw: bytes):
    """A plain reading of RFC 9112 7.1 (no extensions beyond ';...', CRLF only)."""
    import re

    out, i = b"", 0
    while True:
        j = raw.index(b"\r\n", i)
        m = re.fullmatch(rb"([0-9A-Fa-f]{1,16})(;[\x21-\x7e \t]*)?[ \t]*", raw[i:j])
        assert m, raw
        size = int(m.group(1), 16)
        i = j + 2
        if size == 0:
            break
        out += raw[i:i + size]
        assert raw[i + size:i + size + 2] == b"\r\n"
        i += size + 2
    while True:
        j = raw.index(b"\r\n", i)
        line = raw[i:j]
        i = j + 2
        if not line:
            return out, raw[i:]


# ---------------------------------------------------------------------------- responses


def events(reader: fr.ResponseReader, *feeds: bytes):
    out = []
    feeds = list(feeds)
    while True:
        ev = reader.next_event()
        if ev is fr.NEED_DATA:
            if not feeds:
                return out
            reader.receive_data(feeds.pop(0))
            continue
        out.append(ev)
        if ev is fr.END or isinstance(ev, fr.Upgraded):
            return out


def test_a_response_with_a_length_is_reusable():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhel", b"lo")
    head = evs[0]
    assert (head.status, head.reason, head.headers) == (200, b"OK", [(b"content-length", b"5"), (b"x-a", b"b")])
    assert b"".join(e for e in evs if isinstance(e, bytes)) == b"hello" and evs[-1] is fr.END and r.reusable


def test_chunked_response_and_a_1xx_before_it():
    r = fr.ResponseReader("POST")
    evs = events(r, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n0\r\n\r\n")
    assert [e.status for e in evs if isinstance(e, fr.Head)] == [100, 201]
    assert b"".join(e for e in evs if isinstance(e, bytes)) == b"abc" and r.reusable


def test_head_204_and_304_have_no_body():
    for method, raw in (("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"),
                        ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
                        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n")):
        r = fr.ResponseReader(method)
        evs = events(r, raw)
        assert evs[-1] is fr.END and not any(isinstance(e, bytes) for e in evs) and r.reusable, (method, raw)


def test_a_response_framed_by_the_connection_end_is_not_reusable():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\n\r\nsome", b" body", b"")
    assert b"".join(e for e in evs if isinstance(e, bytes)) == b"some body" and evs[-1] is fr.END
    assert not r.reusable


def test_bytes_after_the_response_make_the_connection_unusable():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert [e for e in evs if isinstance(e, fr.Head)][0].status == 200 and len([e for e in evs if isinstance(e, fr.Head)]) == 1
    assert evs[-1] is fr.END and not r.reusable


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",  # CL and TE
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: a\x00\r\nContent-Length: 0\r\n\r\n",
    b"NOTHTTP\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
])
def test_a_broken_upstream_is_refused(raw):
    r = fr.ResponseReader("GET")
    with pytest.raises(fr.FramingError):
        events(r, raw)


def test_an_upstream_that_closes_inside_a_response():
    r = fr.ResponseReader("GET")
    with pytest.raises(fr.FramingError):
        events(r, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", b"")


def test_switching_protocols_keeps_what_followed():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x02hi")
    up = evs[-1]
    assert isinstance(up, fr.Upgraded) and up.head.status == 101 and up.rest == b"\x81\x02hi"


def test_what_the_gate_sends_cannot_carry_an_injected_header():
    with pytest.raises(ValueError):
        fr.request_head("GET", "/", [(b"authorization", b"Bearer real\r\nX-Evil: 1")])
    with pytest.raises(ValueError):
        fr.request_head("GET", "/a b", [])
    with pytest.raises(ValueError):
        fr.response_head(200, b"OK", [(b"x", b"a\nb")])
    assert fr.response_head(200, b"O\r\nK", []) == b"HTTP/1.1 200 \r\n\r\n"  # a broken reason is dropped
    assert fr.request_head("GET", "/x?y", [(b"host", b"a")]) == b"GET /x?y HTTP/1.1\r\nhost: a\r\n\r\n"
    assert fr.chunk(b"abc") == b"3\r\nabc\r\n" and fr.chunk(b"") == b""


_PIECES = [b"a", b"B", b"-", b":", b" ", b"\r", b"\n", b"\r\n", b"\t", b"\x00", b"\x7f", b"\x80", b": ", b"\x1f"]
_piece_bytes = st.lists(st.sampled_from(_PIECES), max_size=5).map(b"".join)


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.tuples(_piece_bytes, _piece_bytes), max_size=4))
def test_the_one_block_header_check_refuses_exactly_what_one_check_per_field_did(headers):
    """The heads the gate sends are checked as one block (framing._field_lines); it must refuse
    exactly the headers a name-by-name, value-by-value check refuses: a name that is not a token,
    a value with CR, LF, NUL or another control character - including a value hiding a whole
    CRLF + "Name: value" line, which a check of the lines alone would pass."""
    from agentvm.gate.h1 import TOKEN_RE, VALUE_CTL_RE

    expected_ok = all(TOKEN_RE.match(k) and not VALUE_CTL_RE.search(v) for k, v in headers)
    try:
        head = fr.response_head(200, b"OK", headers)
    except ValueError:
        assert not expected_ok
    else:
        assert expected_ok
        assert head == b"HTTP/1.1 200 OK\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"


def test_a_1xx_with_a_body_or_a_body_before_the_final_head_is_refused():
    for raw in (b"HTTP/1.1 150 Odd\r\nContent-Length: 6\r\n\r\nforgedHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                b"HTTP/1.1 199 Odd\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nforged\r\n0\r\n\r\n"):
        with pytest.raises(fr.FramingError):
            events(fr.ResponseReader("GET"), raw)


def test_trailers_do_not_join_the_response_head():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: t\r\n\r\n")
    assert evs[0].headers == [(b"transfer-encoding", b"chunked")] and evs[-1] is fr.END


@pytest.mark.parametrize("flood", [
    b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 20000,  # endless fields
    b"HTTP/1.1 200 OK\r\nX-A: " + b"b" * 300000,  # an endless value, no CRLF
    b"HTTP/1.1 200 " + b"O" * 300000,  # an endless reason phrase
])
def test_an_upstreams_response_head_is_bounded(flood):
    r = fr.ResponseReader("GET")
    with pytest.raises(fr.FramingError):
        for i in range(0, len(flood), 16384):
            r.receive_data(flood[i:i + 16384])
            while r.next_event() is not fr.NEED_DATA:
                pass


def test_trailers_are_dropped_not_kept():
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n" + b"X-T: v\r\n" * 500 + b"\r\n")
    assert evs[-1] is fr.END and r._headers == []


@pytest.mark.parametrize("size", [65_000, 65_536, 300_000, 2_000_000])
def test_a_response_whose_head_and_large_body_arrive_in_one_read_is_not_taken_for_a_huge_head(size):
    # the bytes fed before the final head are bounded (an endless header line), but the body
    # that follows the head in the same read is not part of the head: a big answer in one read
    # was refused as "a response head over 65536 bytes" (502)
    r = fr.ResponseReader("GET")
    body = b"x" * size
    evs = events(r, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + body)
    assert evs[0].status == 200 and b"".join(e for e in evs if isinstance(e, bytes)) == body and evs[-1] is fr.END


def test_a_head_that_never_ends_is_still_bounded():
    r = fr.ResponseReader("GET")
    r.receive_data(b"HTTP/1.1 200 OK\r\nX-Long: ")
    with pytest.raises(fr.FramingError):
        for _ in range(40):
            r.receive_data(b"a" * 8192)


def test_a_trailer_that_never_ends_is_bounded_too():
    # after the body, llhttp keeps an unfinished trailer line (and grows it): cut, like a head
    r = fr.ResponseReader("GET")
    evs = events(r, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: ")
    assert evs[0].status == 200
    with pytest.raises(fr.FramingError):
        for _ in range(40):
            r.receive_data(b"a" * 8192)


def test_a_long_chunked_body_in_small_pieces_is_not_taken_for_an_endless_trailer():
    r = fr.ResponseReader("GET")
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    pieces += [b"400\r\n" + b"z" * 1024 + b"\r\n" for _ in range(600)] + [b"0\r\nX-T: done\r\n\r\n"]
    evs = events(r, *pieces)
    assert b"".join(e for e in evs if isinstance(e, bytes)) == b"z" * (1024 * 600) and evs[-1] is fr.END
