"""Fuzzing the gate's HTTP/1 parsers (gate/h1.py, gate/framing.py) over request/response
grammars (tests/fuzz/grammar.py): whatever a sandbox or an upstream sends, a parser either
gives a well-formed result or refuses with its own error - never another exception, never a
result that breaks the invariants the rest of the gate relies on."""

from __future__ import annotations

from hypothesis import given, strategies as st

from agentvm.gate import framing, h1
from tests.fuzz.grammar import FUZZ, chunked_body, request_head, response_bytes, splits

REFUSALS = (h1.ProtocolError, framing.FramingError)


@FUZZ
@given(head=request_head(), rest=st.binary(max_size=30), data=st.data())
def test_request_heads(head, rest, data):
    hr = h1.HeadReader()
    done = False
    try:
        for piece in data.draw(splits(head + rest)):
            done = hr.feed(piece) or done
    except h1.ProtocolError:
        return
    if not done:
        return
    assert hr.head is not None and hr.head.endswith(b"\r\n\r\n")
    try:
        req, body = h1.parse_head(hr.head, hr.rest)
    except REFUSALS:
        return
    # what the gate decides on and forwards: no control characters, a real port
    assert req.host == req.host.strip() and not any(c in req.host for c in "\r\n\x00 /")
    assert req.port is None or 0 < req.port < 65536 or req.scheme == "origin" and req.port == 0, req
    assert req.method and all(32 < ord(c) < 127 for c in req.method), req.method
    assert not any(b"\r" in k + v or b"\n" in k + v for k, v in req.headers)
    assert not (req.header(b"content-length") is not None and req.header(b"transfer-encoding") is not None), \
        "both framings: a smuggling head was accepted"
    try:
        fwd = h1.forward_headers(req, req.host)
    except REFUSALS:
        return
    assert not any(b"\r" in k + v or b"\n" in k + v for k, v in fwd)


def _drain(body: framing.RequestBody) -> bytes:
    out = b""
    while True:
        ev = body.next_event()
        if ev is framing.END or ev is framing.NEED_DATA:
            return out
        out += ev


@FUZZ
@given(wire=chunked_body(), data=st.data())
def test_chunked_request_bodies(wire, data):
    raw, expected = wire
    body = framing.RequestBody(None, True)
    got = b""
    try:
        for piece in data.draw(splits(raw)):
            body.receive_data(piece)
            got += _drain(body)
        body.receive_data(b"")
        got += _drain(body)
    except (framing.FramingError, EOFError):
        assert expected is None, f"well-formed chunked framing refused: {raw!r}"
        return
    if expected is not None:
        assert body.done and got == expected, (raw, got, expected)
    elif body.done:
        # a broken variant that still parses must carry no more than the bytes sent
        assert len(got) <= len(raw)


@FUZZ
@given(n=st.integers(0, 200), payload=st.binary(max_size=300), data=st.data())
def test_length_delimited_request_bodies(n, payload, data):
    body = framing.RequestBody(n, False)
    got = b""
    try:
        for piece in data.draw(splits(payload)):
            body.receive_data(piece)
            got += _drain(body)
        body.receive_data(b"")
        got += _drain(body)
    except EOFError:
        assert len(payload) < n
        return
    assert got == payload[:n] and body.done
    assert body.trailing == payload[n:]


@FUZZ
@given(raw=response_bytes(), method=st.sampled_from(["GET", "HEAD", "POST", "CONNECT"]), data=st.data())
def test_responses(raw, method, data):
    r = framing.ResponseReader(method)
    total = 0
    try:
        for piece in data.draw(splits(raw)):
            r.receive_data(piece)
            while True:
                ev = r.next_event()
                if ev is framing.NEED_DATA or ev is framing.END:
                    break
                if isinstance(ev, (bytes, bytearray, memoryview)):
                    total += len(ev)
                if isinstance(ev, framing.Upgraded):
                    return
            if ev is framing.END:
                break
        r.receive_data(b"")
        while r.next_event() not in (framing.END, framing.NEED_DATA):
            pass
    except framing.FramingError:
        return
    assert total <= len(raw)
