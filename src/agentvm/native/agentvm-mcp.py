#!/usr/bin/python3
"""agentvm-mcp: the sandbox's tool gateway as a stdio MCP server, for clients that only launch
commands (``"command": "agentvm-mcp"`` in a client's MCP configuration).

It is a pipe, nothing more: each JSON-RPC message read from stdin is POSTed to the gateway at
$AGENTVM_MCP_URL (streamable HTTP on the sandbox's loopback, the same port as the egress
gate), and every message of the answer (JSON, or server-sent events) is written to stdout,
one per line. The gateway decides everything; if it cannot be reached, each request gets a
JSON-RPC error that says so (fail closed, and visible). Standard library only: it runs under
the sandbox's own python3.
"""

import base64
import http.client
import json
import os
import re
import select
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

URL = os.environ.get("AGENTVM_MCP_URL", "")
VERSION_META = "io.modelcontextprotocol/protocolVersion"
TIMEOUT = float(os.environ.get("AGENTVM_MCP_TIMEOUT", "3600"))  # held calls wait for a human
_out = threading.Lock()
_state = {"version": None}
MODERN = ("2026-07-28",)  # revisions with the per-request envelope: routing headers mirror the body
NAMED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
_SAFE = re.compile(r"[\x20-\x7e]*")


def header_value(value: str) -> str:
    """As the 2026-07-28 transport wants it: printable ASCII verbatim, anything else base64-wrapped."""
    if _SAFE.fullmatch(value) and value == value.strip() and not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    return "=?base64?" + base64.b64encode(value.encode("utf-8")).decode("ascii") + "?="
# straight to the gateway: never through a proxy (the gateway is the proxy's own port)
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_idle: list = []  # keep-alive connections to the gateway, free for the next request
_idle_lock = threading.Lock()


def _connection():
    """An idle keep-alive connection to the gateway that is still open, or a new one. The gate
    closes connections idle for a while: one it closed reads as ready (end of file) and is
    dropped here, before anything is sent on it."""
    while True:
        with _idle_lock:
            c = _idle.pop() if _idle else None
        if c is None:
            break
        try:
            ready, _, _ = select.select([c.sock], [], [], 0)
        except (OSError, ValueError):
            ready = [c.sock]
        if not ready:
            return c
        c.close()  # closed by the gateway (or it sent something unasked): never reused
    u = urllib.parse.urlsplit(URL)
    c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=TIMEOUT)
    c.connect()
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def _post(raw: bytes, headers: dict):
    """POST one message on a keep-alive connection: (connection, response). A message is sent
    once: a connection that breaks is an error, never a second send that could run a tool call
    twice."""
    c = _connection()
    try:
        c.request("POST", urllib.parse.urlsplit(URL).path or "/", body=raw, headers=headers)
        return c, c.getresponse()
    except BaseException:
        c.close()
        raise


def _done(c, resp) -> None:
    """The answer was read whole: its connection serves the next request, unless it closes."""
    if resp.will_close:
        c.close()
    else:
        with _idle_lock:
            _idle.append(c)


def emit(msg) -> None:
    line = json.dumps(msg, separators=(",", ":"))
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def fail(msg, reason: str) -> None:
    if isinstance(msg, dict) and "id" in msg and "method" in msg:
        emit({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32000, "message": f"agentvm-mcp: {reason}"}})
    else:
        sys.stderr.write(f"agentvm-mcp: {reason}\n")


def version_of(msg):
    params = msg.get("params") if isinstance(msg, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    v = meta.get(VERSION_META) if isinstance(meta, dict) else None
    return v if isinstance(v, str) else _state["version"]


def learn(msg, answer) -> None:
    if isinstance(msg, dict) and msg.get("method") == "initialize" and isinstance(answer, dict):
        v = (answer.get("result") or {}).get("protocolVersion")
        if isinstance(v, str):
            _state["version"] = v


def send(raw: bytes) -> None:
    try:
        msg = json.loads(raw)
    except ValueError:
        emit({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "agentvm-mcp: not JSON"}})
        return
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    v = version_of(msg)
    if v and not (isinstance(msg, dict) and msg.get("method") == "initialize"):
        headers["MCP-Protocol-Version"] = v
    if v in MODERN and isinstance(msg, dict) and isinstance(msg.get("method"), str):
        headers["Mcp-Method"] = msg["method"]
        key = NAMED.get(msg["method"])
        params = msg.get("params")
        if key and isinstance(params, dict) and isinstance(params.get(key), str):
            headers["Mcp-Name"] = header_value(params[key])
    try:
        c, resp = _post(raw, headers)
    except (OSError, http.client.HTTPException) as exc:
        fail(msg, f"the tool gateway at {URL} cannot be reached ({exc}): no tools")
        return
    try:
        ctype = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype == "text/event-stream":
            data = []
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip())
                elif not line and data:
                    _forward(msg, "\n".join(data))
                    data = []
            if data:
                _forward(msg, "\n".join(data))
        else:
            body = resp.read()
            if body.strip():
                if ctype == "application/json":
                    _forward(msg, body.decode("utf-8", "replace"))
                else:
                    fail(msg, f"the gateway answered HTTP {resp.status} without JSON")
            elif resp.status >= 400:
                fail(msg, f"the gateway answered HTTP {resp.status}")
    except (OSError, http.client.HTTPException) as exc:
        c.close()
        fail(msg, f"the tool gateway's answer broke off ({exc})")
        return
    _done(c, resp)


def _forward(msg, text: str) -> None:
    try:
        answer = json.loads(text)
    except ValueError:
        fail(msg, "the gateway's answer is not JSON")
        return
    for one in answer if isinstance(answer, list) else [answer]:
        learn(msg, one)
        emit(one)


def request_access(argv) -> int:
    """agentvm-request: ask a human for more access (agentvm__request_access), wait for the answer."""
    import argparse

    ap = argparse.ArgumentParser(prog="agentvm-request", description="Ask the operator for access this sandbox "
                                 "does not have; waits for a human's answer (exit 0: granted or already allowed).")
    ap.add_argument("--egress", action="append", default=[], metavar="HOST[:PORT]", help="egress to a host (443 if no port)")
    ap.add_argument("--tool", action="append", default=[], metavar="SERVER__TOOL", help="a tool of a declared server")
    ap.add_argument("--reason", required=True, help="why it is needed (the operator reads it)")
    ap.add_argument("access", nargs="*", help="anything else, in words")
    a = ap.parse_args(argv)
    if not URL:
        sys.stderr.write("agentvm-request: AGENTVM_MCP_URL is not set: this sandbox declares no tools, so it has no "
                         "gateway to ask through\n")
        return 78
    args = {"egress": a.egress, "tools": a.tool, "reason": a.reason, "access": " ".join(a.access)}
    msg = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "agentvm__request_access",
                                                                          "arguments": args}}
    req = urllib.request.Request(URL, data=json.dumps(msg).encode(), method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25"})
    try:
        with _opener.open(req, timeout=TIMEOUT) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read() or b"{}")
    except OSError as exc:
        sys.stderr.write(f"agentvm-request: the tool gateway cannot be reached ({exc})\n")
        return 69
    if "error" in answer:
        sys.stderr.write(f"agentvm-request: {answer['error'].get('message')}\n")
        return 1
    res = answer.get("result") or {}
    text = "".join(c.get("text", "") for c in res.get("content", []) if isinstance(c, dict))
    print(text)
    return 1 if res.get("isError") else 0


def main() -> int:
    if os.path.basename(sys.argv[0]) == "agentvm-request":
        return request_access(sys.argv[1:])
    if not URL:
        sys.stderr.write("agentvm-mcp: AGENTVM_MCP_URL is not set: this sandbox declares no tools (spec.tools)\n")
        return 78
    threads = []
    for raw in sys.stdin.buffer:
        if not raw.strip():
            continue
        try:
            first = json.loads(raw)
        except ValueError:
            first = None
        if isinstance(first, dict) and first.get("method") == "initialize":
            send(raw)  # the handshake first, alone: later requests carry its version
            continue
        t = threading.Thread(target=send, args=(raw,), daemon=True)
        t.start()
        threads.append(t)
        threads = [x for x in threads if x.is_alive()]
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
