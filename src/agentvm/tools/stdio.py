"""A local tool server's stdio as the gateway's MCP client: newline-delimited JSON-RPC 2.0,
the initialize handshake, every line bounded.

Why not the SDK's stdio client: it buffers a line of any length - one endless line from a tool
server would grow the gateway, which serves every sandbox of the daemon, without bound - and
its memory streams and tasks cost about 0.7 ms per call (``bench/bench_tools.py``). This is
the part of the transport the gateway needs and no more:

- requests are matched to answers by id; a call the gateway gives up on (timeout) is
  cancelled at the server with ``notifications/cancelled``;
- the server's own requests (sampling, elicitation, roots...) are refused with "method not
  found", ``ping`` is answered; its notifications are dropped;
- a line that is not JSON is ignored (servers that print to stdout exist), a line over the
  limit ends the session (``tools:server-flood``), end of file ends it (the SDK's
  ``CONNECTION_CLOSED``, so the gateway starts the server again on the next call);
- what the server has not read of its input is bounded: past the bound its own requests go
  unanswered and the gateway's are refused (``Busy``: ``tools:server-busy``) until it reads;
- results are validated with the SDK's own types (``mcp_types``), as its client would.

The MCP revision is the handshake era's latest (``initialize``), which every stdio server
speaks; the server's answer must name a revision of that era.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

MAX_LINE_FLOOR = 4 * 1024 * 1024  # a tools/list of many tools with long schemas fits
MAX_UNREAD = 4 * 1024 * 1024  # bytes written to the server and not yet read: at least this much room
MAX_ID = 256  # characters of a server request's id the gateway echoes back (a longer one is not answered)
STOP_GRACE = 2.0  # seconds between closing the server's stdin and SIGTERM, then SIGTERM and SIGKILL
METHOD_NOT_FOUND = -32601


class Flooded(Exception):
    """The server wrote a line over the limit: the session is over."""


class Busy(Exception):
    """The server has not read what the gateway sent it before: this request is not sent (the
    session goes on; the server may be slow, not hostile)."""


class StdioSession:
    """One running server process and its JSON-RPC session. ``closed`` is set when it ends."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str, max_line: int,
                 max_unread: int = MAX_UNREAD) -> None:
        self.proc, self.name, self.max_line, self.max_unread = proc, name, max_line, max_unread
        self.protocol_version: str | None = None
        self.closed = asyncio.Event()
        self.end: MCPError | Flooded | None = None  # why the session ended
        self._ids = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def spawn(cls, argv: list[str], *, env: dict[str, str], errlog, name: str,
                    max_line: int = MAX_LINE_FLOOR, max_unread: int = MAX_UNREAD) -> "StdioSession":
        # its own session: the whole tree is signalled at the end, as the SDK's client does
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errlog, env=env,
            limit=max_line, start_new_session=True)
        return cls(proc, name, max_line, max_unread)

    # ------------------------------------------------------------------ the wire
    def _write(self, msg: dict, request: bool = False) -> bool:
        """One message to the server; nothing waits for it to be read, so what it has not read
        is bounded: over ``max_unread`` bytes waiting, a request is refused (Busy: the session
        goes on), and an answer or a notice is not sent (False) - a server that asks and never
        reads gets nothing, and costs the gateway nothing more."""
        stdin = self.proc.stdin
        if self.closed.is_set() or stdin is None or stdin.is_closing():
            raise MCPError(types.CONNECTION_CLOSED, f"tool server {self.name} is gone")
        unread = stdin.transport.get_write_buffer_size()
        if unread > self.max_unread:
            if request:
                raise Busy(f"tool server {self.name} has not read {unread} bytes of earlier requests")
            return False
        stdin.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        return True

    async def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            while True:
                try:
                    line = await out.readline()
                except ValueError:  # asyncio's limit: the line is longer than max_line
                    raise Flooded(f"tool server {self.name} wrote a message over {self.max_line} bytes") from None
                if not line:
                    raise MCPError(types.CONNECTION_CLOSED, f"tool server {self.name} closed its output")
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not JSON-RPC (a server printing to stdout): not an answer to anything
                if isinstance(msg, dict):
                    self._dispatch(msg)
        except BaseException as exc:  # noqa: BLE001 - every end of the session is reported the same way
            self._finish(exc)
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise

    def _dispatch(self, msg: dict) -> None:
        if "method" in msg:
            if "id" in msg:  # the server asks something of the client: nothing is offered but ping
                mid = msg["id"]
                if not isinstance(mid, (str, int)) or isinstance(mid, bool) or (isinstance(mid, str) and
                                                                                 len(mid) > MAX_ID):
                    return
                try:
                    if msg["method"] == "ping":
                        self._write({"jsonrpc": "2.0", "id": mid, "result": {}})
                    else:
                        self._write({"jsonrpc": "2.0", "id": mid, "error": {
                            "code": METHOD_NOT_FOUND, "message": "not offered by the agent-vm tool gateway"}})
                except MCPError:
                    pass  # gone: the session's end says so
            return  # notifications (progress, logging, list_changed): dropped
        fut = self._pending.pop(msg.get("id"), None) if isinstance(msg.get("id"), int) else None
        if fut is None or fut.done():
            return  # an answer to nothing pending (late, after a timeout, or made up)
        err = msg.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            message = err.get("message")
            fut.set_exception(MCPError(code if isinstance(code, int) and not isinstance(code, bool) else -32603,
                                       str(message)[:1000] if message is not None else "error"))
        elif "result" in msg:
            fut.set_result(msg["result"])
        else:
            fut.set_exception(MCPError(-32603, f"tool server {self.name} sent an answer with neither result nor error"))

    def _finish(self, exc: BaseException) -> None:
        """The session is over: ``end`` says why (a flood, or the SDK's CONNECTION_CLOSED for any
        other end), as every pending and later request fails."""
        if self.closed.is_set():
            return
        self.end = exc if isinstance(exc, (MCPError, Flooded)) else MCPError(
            types.CONNECTION_CLOSED, f"tool server {self.name}: {type(exc).__name__}")
        self.closed.set()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.end)
        self._pending.clear()

    async def request(self, method: str, params: dict | None = None) -> Any:
        if self.end is not None:
            raise self.end
        self._ids += 1
        rid = self._ids
        msg: dict = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self._write(msg, request=True)  # before the answer can be read: nothing runs in between
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            return await fut
        except asyncio.CancelledError:  # a timeout above: the server is told to stop working on it
            if self._pending.pop(rid, None) is not None:
                try:
                    self._write({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": rid, "reason": "timed out at the agent-vm tool gateway"}})
                except MCPError:
                    pass
            raise
        finally:
            self._pending.pop(rid, None)

    # ------------------------------------------------------------------ the session
    async def initialize(self) -> None:
        res = await self.request("initialize", {
            "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
            "clientInfo": {"name": "agentvm-tool-gateway", "version": "1"}})
        version = res.get("protocolVersion") if isinstance(res, dict) else None
        if version not in HANDSHAKE_PROTOCOL_VERSIONS:
            raise MCPError(types.INVALID_REQUEST, f"tool server {self.name} answered initialize with protocol "
                           f"version {str(version)[:40]!r}, which the gateway does not speak")
        self.protocol_version = version
        self._write({"jsonrpc": "2.0", "method": "notifications/initialized"}, request=True)

    async def list_tools(self, cursor: str | None = None) -> types.ListToolsResult:
        return types.ListToolsResult.model_validate(
            await self.request("tools/list", {"cursor": cursor} if cursor else None))

    async def call_tool(self, name: str, arguments: dict | None = None) -> types.CallToolResult:
        return types.CallToolResult.model_validate(
            await self.request("tools/call", {"name": name, "arguments": arguments or {}}))

    async def list_resources(self) -> types.ListResourcesResult:
        return types.ListResourcesResult.model_validate(await self.request("resources/list"))

    async def read_resource(self, uri: str) -> types.ReadResourceResult:
        return types.ReadResourceResult.model_validate(await self.request("resources/read", {"uri": uri}))

    async def list_prompts(self) -> types.ListPromptsResult:
        return types.ListPromptsResult.model_validate(await self.request("prompts/list"))

    async def get_prompt(self, name: str, arguments: dict | None = None) -> types.GetPromptResult:
        params: dict = {"name": name}
        if arguments:
            params["arguments"] = arguments
        return types.GetPromptResult.model_validate(await self.request("prompts/get", params))

    async def close(self) -> None:
        """Close its stdin, give it STOP_GRACE to exit, then SIGTERM its process group (``agentvm
        run`` tears its sandbox down on it), then SIGKILL."""
        self._finish(MCPError(types.CONNECTION_CLOSED, f"tool server {self.name} was stopped"))
        p = self.proc
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
        # a server that flooded is blocked writing, not reading its stdin: no grace for it
        for sig in ((signal.SIGTERM, signal.SIGKILL) if isinstance(self.end, Flooded) else
                    (None, signal.SIGTERM, signal.SIGKILL)):
            if sig is not None and p.returncode is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                async with asyncio.timeout(STOP_GRACE if sig != signal.SIGKILL else 5.0):
                    await p.wait()
                break
            except TimeoutError:
                continue
        self._reader.cancel()
        try:
            await self._reader
        except BaseException:  # noqa: BLE001 - it ended, whichever way
            pass
