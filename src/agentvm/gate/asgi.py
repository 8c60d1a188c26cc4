"""An ``/mcp`` request on the proxy port, served by the sandbox's tool gateway (an ASGI app).

The gate has already parsed and checked the request head (its own strict parser) and decided
that the request is for this sandbox's tools (``exchange.ToTools``); here the body is read
(bounded), the app is called in-process, and its answer is framed as HTTP/1.1 on the same
connection (Content-Length when the app gives one, else chunked). There is no extra socket
and no extra hop: the sandbox's identity is still the socket the request came in on.
"""

from __future__ import annotations

import asyncio

from agentvm.gate import h1
from agentvm.gate.framing import RequestBody
from agentvm.gate.relay import BadBody, BodyEnded, request_body
from agentvm.gate.streams import client_left

MAX_BODY = 4 * 1024 * 1024  # a JSON-RPC message to the gateway, buffered whole (each server has its own, smaller, limits)
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"proxy-connection", b"te", b"trailer"}


class TooLarge(Exception):
    pass


async def read_body(stream, body: RequestBody, req: h1.ProxyRequest, limit: int, timeout: float = 30.0) -> bytes | None:
    """A request body buffered whole for one of the gate's own doors (/mcp, /otlp): at most
    ``limit`` bytes (``TooLarge`` as soon as it is known to be more) within ``timeout``
    seconds; None when the body is malformed, cut off or too slow."""
    if req.content_length is not None and req.content_length > limit:
        raise TooLarge()
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for piece in request_body(stream, body):
                size += len(piece)
                if size > limit:
                    raise TooLarge()
                chunks.append(piece)
    except (BadBody, BodyEnded, TimeoutError):
        return None
    return b"".join(chunks)


async def serve_one(ep, stream, body: RequestBody, req: h1.ProxyRequest) -> tuple[bool, bytes]:
    """-> (keep the connection, bytes after this request)."""
    try:
        data = await read_body(stream, body, req, MAX_BODY)
    except TooLarge:
        await stream.write(h1.error_response(413, "tools:request-too-large", f"a request over {MAX_BODY} bytes"))
        return False, b""
    if data is None:
        return False, b""
    try:
        gw = await ep.tools.gateway()
    except Exception as exc:  # noqa: BLE001 - no gateway, no tools: fail closed
        ep.log(verdict="deny", rule_id="tools:unavailable", reason=f"the tool gateway cannot start ({type(exc).__name__})",
               host="", port=None, method=req.method, path="/mcp", phase="tool")
        await stream.write(h1.error_response(503, "tools:unavailable", "the tool gateway cannot start"))
        return False, b""
    path, _, query = req.path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": req.http_version,
        "method": req.method, "scheme": "http", "path": path, "raw_path": path.encode("ascii"),
        "query_string": query.encode("ascii"), "root_path": "", "headers": [(k, v) for k, v in req.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", req.port or 80), "state": {},
        # the requester has left (its connection cut): a call held for a human expires at once
        "agentvm.gone": lambda: client_left(stream),
    }
    sent = False
    finished = asyncio.Event()
    state = {"started": False, "chunked": False, "done": False}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        kind = msg.get("type")
        if kind == "http.response.start":
            if state["started"]:
                raise RuntimeError("response started twice")
            state["started"] = True
            status = int(msg["status"])
            lines = [f"HTTP/1.1 {status} {_reason(status)}".encode()]
            has_len = False
            for k, v in msg.get("headers", []):
                k, v = bytes(k).lower(), bytes(v)
                if k in _HOP or b"\r" in k + v or b"\n" in k + v:
                    continue
                has_len = has_len or k == b"content-length"
                lines.append(k + b": " + v)
            if not has_len:
                state["chunked"] = True
                lines.append(b"transfer-encoding: chunked")
            state["head"] = b"\r\n".join(lines) + b"\r\n\r\n"  # sent with the first piece of body: one write
        elif kind == "http.response.body":
            if not state["started"] or state["done"]:
                raise RuntimeError("body outside a response")
            piece = bytes(msg.get("body", b""))
            more = bool(msg.get("more_body", False))
            if state["chunked"]:
                out = (b"%x\r\n" % len(piece) + piece + b"\r\n") if piece else b""
                if not more:
                    out += b"0\r\n\r\n"
            else:
                out = piece
            head, state["head"] = state.get("head", b""), b""
            if head or out:
                await stream.write(head + out)
            if not more:
                state["done"] = True

    try:
        await gw.handle(scope, receive, send)
    except Exception as exc:  # noqa: BLE001 - a gateway bug must not take the gate down
        ep.log(verdict="deny", rule_id="tools:internal-error", reason=type(exc).__name__, host="", port=None,
               method=req.method, path="/mcp", phase="tool")
        if not state["started"]:
            await stream.write(h1.error_response(500, "tools:internal-error", "the tool gateway failed"))
        return False, b""
    finally:
        finished.set()
    if not state["started"]:
        await stream.write(h1.error_response(500, "tools:internal-error", "the tool gateway gave no answer"))
        return False, b""
    if not state["done"]:
        return False, b""
    close = (req.header(b"connection") or b"").lower() == b"close" or req.http_version == "1.0"
    return not close, body.trailing


def _reason(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Status"
