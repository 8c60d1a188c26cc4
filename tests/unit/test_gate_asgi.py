"""The /mcp door: an origin-form request on the proxy port served by the sandbox's tool
gateway in-process (ASGI), framed back as HTTP/1.1 - and refused, fail closed, when the
gateway cannot start."""

from __future__ import annotations

import asyncio

from agentvm.gate import h1
from agentvm.gate.asgi import MAX_BODY, serve_one


class Stream:
    def __init__(self, data: bytes = b""):
        self.data, self.out = bytearray(data), bytearray()

    async def read(self, n: int = 65536) -> bytes:
        chunk, self.data = bytes(self.data[:n]), self.data[n:]
        return chunk

    async def write(self, b: bytes) -> None:
        self.out += b


class Slot:
    def __init__(self, app=None, error=None):
        self.app, self.error = app, error

    async def gateway(self):
        if self.error:
            raise self.error
        return self


class Ep:
    def __init__(self, tools):
        self.tools, self.logged = tools, []

    def log(self, **kw):
        self.logged.append(kw)


def parse(raw: bytes):
    req, body = h1.parse_head(raw.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n", raw.split(b"\r\n\r\n", 1)[1])
    return req, body


def run(ep, raw: bytes, more: bytes = b""):
    req, body = parse(raw)
    stream = Stream(more)
    keep, rest = asyncio.run(serve_one(ep, stream, body, req))
    return keep, rest, bytes(stream.out)


def echo_app(chunks=None, length=True):
    async def handle(scope, receive, send):
        msg = await receive()
        body = msg["body"]
        headers = [(b"content-type", b"application/json")] + ([(b"content-length", str(len(body)).encode())] if length else [])
        await send({"type": "http.response.start", "status": 200, "headers": headers + [(b"x-bad", b"a\r\nInjected: 1")]})
        for i, piece in enumerate(chunks or [body]):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(chunks or [body]) - 1})

    slot = Slot()
    slot.handle = handle
    return slot


def test_a_request_is_answered_on_the_same_connection_and_pipelined_bytes_are_kept():
    raw = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nContent-Length: 7\r\n\r\n{\"a\":1}GET /next"
    keep, rest, out = run(Ep(echo_app()), raw)
    assert keep and rest == b"GET /next"
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b'\r\n\r\n{"a":1}')
    assert b"content-length: 7" in out and b"Injected" not in out  # a header with CR/LF is dropped


def test_a_streamed_answer_without_a_length_is_chunked_and_a_close_is_honoured():
    raw = b"POST /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    keep, _, out = run(Ep(echo_app([b"ab", b"cd"], length=False)), raw)
    assert not keep
    assert out.endswith(b"transfer-encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")


def test_no_gateway_no_tools_fail_closed():
    ep = Ep(Slot(error=ImportError("no mcp")))
    keep, _, out = run(ep, b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert not keep and out.startswith(b"HTTP/1.1 503 ") and b"tools:unavailable" in out
    assert ep.logged[0]["rule_id"] == "tools:unavailable"


def test_an_oversized_or_broken_body_never_reaches_the_gateway():
    called = []
    app = echo_app()
    app.handle = lambda *a: called.append(a)
    keep, _, out = run(Ep(app), b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    assert not keep and b" 413 " in out.split(b"\r\n")[0]
    keep, _, out = run(Ep(app), b"POST /mcp HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert not keep and not called


def test_a_gateway_that_raises_or_answers_nothing_is_an_error_not_a_hang():
    boom = Slot()

    async def handle(scope, receive, send):
        raise RuntimeError("bug")

    boom.handle = handle
    ep = Ep(boom)
    keep, _, out = run(ep, b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert not keep and b" 500 " in out.split(b"\r\n")[0] and ep.logged[0]["rule_id"] == "tools:internal-error"
    silent = Slot()

    async def nothing(scope, receive, send):
        return None

    silent.handle = nothing
    keep, _, out = run(Ep(silent), b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert not keep and b" 500 " in out.split(b"\r\n")[0]
