"""The tool gateway's agent-facing side, for a sandbox served by a confined gate worker.

What an agent sends to ``/mcp`` is parsed here, in the worker (unprivileged, its own uid,
seccomp, Landlock): the HTTP (agentvm.gate.asgi), then the JSON-RPC, by the MCP SDK's own
server and its pydantic models - the same :class:`mcp.server.lowlevel.Server` and stateless
streamable-HTTP transport the gateway uses in-process, with the same DNS-rebinding settings.
Each request that gets past them is handed to the sandbox's tool gateway in the daemon as
plain data - a method of :data:`METHODS` and its params as a dict - and its answer (a result
as a dict, or an MCP error) comes back the same way. The daemon validates that data again
with the models (agentvm.tools.gateway.ToolGateway.rpc), but never sees the agent's bytes:
no JSON, no HTTP (issue 43).

The tool servers, their sessions, the policy and human approvals stay in the daemon.
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from agentvm.tools import policy as tp

NAME = "agentvm-tool-gateway"

#: each method the gateway serves -> (its params' model, its result's model, its handler's name:
#: the lowlevel Server's ``on_NAME``, the gateway's ``_NAME``)
METHODS: dict[str, tuple[type, type, str]] = {
    "tools/list": (types.PaginatedRequestParams, types.ListToolsResult, "list_tools"),
    "tools/call": (types.CallToolRequestParams, types.CallToolResult, "call_tool"),
    "resources/list": (types.PaginatedRequestParams, types.ListResourcesResult, "list_resources"),
    "resources/read": (types.ReadResourceRequestParams, types.ReadResourceResult, "read_resource"),
    "prompts/list": (types.PaginatedRequestParams, types.ListPromptsResult, "list_prompts"),
    "prompts/get": (types.GetPromptRequestParams, types.GetPromptResult, "get_prompt"),
}
OPTIONAL_PARAMS = {"tools/list", "resources/list", "prompts/list"}


def make_server(handler: Callable[[str], Callable], schemas: dict) -> Server:
    """The gateway's MCP server - the same for the in-process gateway and the worker's front:
    each method M of :data:`METHODS` answered by ``handler(M)``, the tools' input schemas
    looked up in ``schemas``."""
    return Server(NAME, get_tool_input_schema=schemas.get,
                  **{f"on_{name}": handler(m) for m, (_, _, name) in METHODS.items()})


#: a request's params as the front hands them over: the daemon drops a worker that sends more
#: (agentvm.gate.workers._tools_question), so the front answers such a request itself - below
#: what the worker's channel carries (64 levels, 2^20 items)
PARAMS_DEPTH = 48
PARAMS_ITEMS = 1 << 18
PARAMS_TEXT = 8 << 20

#: whether the requester of the request being served has left (a callable; None: unknown)
REQUESTER_GONE: contextvars.ContextVar = contextvars.ContextVar("agentvm_front_requester_gone", default=None)


def request_access_tool() -> types.Tool:
    return types.Tool(
        name=tp.REQUEST_ACCESS,
        description="Ask a human operator for access this sandbox does not have: egress to hosts, tools of the "
        "declared servers, or anything else in words. The request waits for a human; if approved, the egress and "
        "tools asked for are granted for this session. Nothing is granted without a human.",
        input_schema={"type": "object", "required": ["reason"], "additionalProperties": False,
                      "properties": {
                          "egress": {"type": "array", "items": {"type": "string"},
                                     "description": "HOST[:PORT] items, e.g. 'api.example.com:443'"},
                          "tools": {"type": "array", "items": {"type": "string"},
                                    "description": "SERVER__TOOL names of declared servers"},
                          "access": {"type": "string", "description": "Anything else, in words (a folder...)"},
                          "reason": {"type": "string", "description": "Why it is needed"}}},
    )


def session_manager(server: Server) -> StreamableHTTPSessionManager:
    """The transport both sides use: stateless, JSON answers, loopback hosts and origins only."""
    return StreamableHTTPSessionManager(
        app=server, json_response=True, stateless=True,
        security_settings=TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "127.0.0.1", "localhost"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*"]),
    )


def plain(params) -> dict | None:
    """A validated params model as plain data (what crosses to the daemon)."""
    if params is None:
        return None
    return params.model_dump(mode="json", by_alias=True, exclude_none=True)


def json_shaped(v, *, depth: int = PARAMS_DEPTH, items: int = PARAMS_ITEMS, text: int = PARAMS_TEXT) -> str | None:
    """Why ``v`` is not plain JSON data within the bounds (dicts with str keys, lists, str, bool,
    None, ints of 64 bits, finite floats; at most ``depth`` levels, ``items`` values and
    ``text`` characters, shared references counted each time), or None. Walked without
    recursion; stops at the first excess."""
    import math

    stack = [(v, 0)]
    n = chars = 0
    while stack:
        x, d = stack.pop()
        n += 1
        if n > items:
            return f"more than {items} values"
        t = type(x)
        if t is str:
            chars += len(x)
        elif t is dict:
            if d >= depth:
                return f"nested deeper than {depth}"
            for k, val in x.items():
                if type(k) is not str:
                    return "a key that is not a string"
                chars += len(k)
                stack.append((val, d + 1))
        elif t is list:
            if d >= depth:
                return f"nested deeper than {depth}"
            stack.extend((y, d + 1) for y in x)
        elif t is int:
            if not -(1 << 63) <= x < 1 << 64:
                return "an integer past 64 bits"
        elif t is float:
            if not math.isfinite(x):
                return "a float that is not finite"
        elif x is not None and t is not bool:
            return f"a value of type {t.__name__}"
        if chars > text:
            return f"more than {text} characters of text"
    return None


class Served:
    """An MCP lowlevel :class:`Server` (``self.server``) on the stateless streamable-HTTP
    transport, started on its first request; :meth:`handle` serves one ASGI request, with
    :data:`REQUESTER_GONE` set for the handlers the SDK runs for it. (The tool gateway's
    in-process door and the worker's front.)"""

    def _serve(self, server: Server) -> None:
        import asyncio

        self.server = server
        self.manager = session_manager(server)
        self._running: asyncio.Task | None = None
        self._up = asyncio.Event()
        self._closing = asyncio.Event()

    async def start(self) -> None:
        import asyncio

        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._run())
        await self._up.wait()

    async def _run(self) -> None:
        try:
            async with self.manager.run():
                self._up.set()
                await self._closing.wait()
        finally:
            self._up.set()

    async def handle(self, scope, receive, send) -> None:
        await self.start()
        # whether this request's requester has left (the gate's door says: its connection was
        # cut); the handlers the SDK runs for it inherit the context
        token = REQUESTER_GONE.set(scope.get("agentvm.gone"))
        try:
            await self.manager.handle_request(scope, receive, send)
        finally:
            REQUESTER_GONE.reset(token)

    async def _stop_serving(self) -> None:
        import asyncio

        self._closing.set()
        if self._running is not None:
            try:
                async with asyncio.timeout(5):
                    await self._running
            except (TimeoutError, Exception):  # noqa: BLE001
                self._running.cancel()


class ToolFront(Served):
    """The MCP server an agent talks to, in the gate worker; ``ask(method, params)`` is awaited
    for each request and gives ``("ok", result dict)`` or ``("error", code, message, data)``."""

    def __init__(self, ask: Callable[[str, dict | None], Awaitable[tuple]], log=None) -> None:
        self.ask = ask
        self.log = log  # (the endpoint's decision log: what this front refuses itself is a decision too)
        # input schemas by exposed tool name, from the last tools/list this front answered (the
        # SDK's 2026-07-28 transport checks Mcp-Param-* headers against them)
        self._schemas: dict[str, Any] = {tp.REQUEST_ACCESS: request_access_tool().input_schema}
        self._serve(make_server(self._handler, self._schemas))

    def _handler(self, method: str):
        async def handle(ctx, params):
            data = plain(params)
            why = json_shaped(data) if data is not None else None
            if why is not None:  # (asking with it would cost the agent its gate worker)
                if self.log is not None:
                    self.log(verdict="deny", rule_id="tools:request-too-large", reason=f"params {why}", host="",
                             port=None, method=method, path="/mcp", phase="tool")
                raise MCPError(types.INVALID_PARAMS, f"agent-vm tool gateway: the params of {method} are {why}"
                               " [tools:request-too-large]", {"rule": "tools:request-too-large"})
            answer = await self.ask(method, data)
            if not isinstance(answer, tuple) or not answer or answer[0] not in ("ok", "error"):
                raise MCPError(types.INTERNAL_ERROR, "agent-vm tool gateway: no answer")
            if answer[0] == "error":
                _, code, message, data = answer
                raise MCPError(int(code), str(message), data)
            result = METHODS[method][1].model_validate(answer[1])
            if method == "tools/list":
                self._schemas.clear()
                self._schemas.update((t.name, t.input_schema) for t in result.tools)
                self._schemas.setdefault(tp.REQUEST_ACCESS, request_access_tool().input_schema)
            return result
        return handle

    async def close(self) -> None:
        await self._stop_serving()
