"""Fuzzing the tool gateway's agent-facing JSON-RPC path: a sandbox's POST /mcp, parsed by the
gate's HTTP/1 parser, read by the /mcp door (gate/asgi.py) and handled by a real ToolGateway
(the MCP SDK's streamable HTTP transport, then the gateway's own checks). Whatever the body -
well-formed calls with hostile names and arguments, wrong versions, ids and shapes, batches,
garbage - the answer is an HTTP response on the connection, never the door's "internal error"
(a gateway bug), and no call reaches a tool server the policy denies."""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings, strategies as st

from agentvm.gate import h1
from agentvm.gate.asgi import serve_one
from tests.fuzz.grammar import EXAMPLES, FUZZ

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), st.floats(allow_nan=False, allow_infinity=False),
                              st.text(max_size=20)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4)),
                    max_leaves=12)
METHODS = st.sampled_from(["initialize", "tools/list", "tools/call", "resources/list", "resources/read", "prompts/list",
                           "prompts/get", "ping", "notifications/initialized", "completion/complete", "logging/setLevel",
                           "tools/call ", "TOOLS/CALL", ""])
TOOL_NAMES = st.one_of(st.sampled_from(["notes__read"] * 4 + ["notes__read", "notes__admin_wipe", "other__x", "agentvm__request_access",
                                        "notes__", "__read", "notes__r\u00e9ad", "notes__read\u200b", "a" * 300]),
                       st.text(max_size=30))


@st.composite
def message(draw):
    if draw(st.booleans()):  # a well-formed call (hostile name, arguments): the gateway's own checks are reached
        return {"jsonrpc": "2.0", "id": draw(st.integers(0, 2**31)), "method": "tools/call",
                "params": {"name": draw(TOOL_NAMES), "arguments": draw(st.dictionaries(st.text(max_size=8), JSON,
                                                                                         max_size=3)),
                           "_meta": {"io.modelcontextprotocol/protocolVersion": draw(st.sampled_from(
                               ["2026-07-28", "2025-06-18", "x"])), "io.modelcontextprotocol/clientCapabilities": {}}}}
    method = draw(st.one_of(METHODS, st.text(max_size=15)))
    msg = {"jsonrpc": draw(st.sampled_from(["2.0", "2.0", "1.0", None])), "method": method}
    if draw(st.booleans()):
        msg["id"] = draw(st.one_of(st.integers(-5, 2**70), st.text(max_size=10), st.none(), JSON))
    if method == "tools/call" or draw(st.integers(0, 3)) == 0:
        msg["params"] = {"name": draw(st.one_of(TOOL_NAMES, JSON)), "arguments": draw(JSON)}
    elif draw(st.booleans()):
        msg["params"] = draw(JSON)
    if msg["jsonrpc"] is None:
        del msg["jsonrpc"]
    return msg


@st.composite
def body(draw) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind < 6:
        return json.dumps(draw(message())).encode()
    if kind < 8:
        return json.dumps(draw(st.lists(message(), max_size=3))).encode()
    return draw(st.one_of(st.binary(max_size=60), JSON.map(lambda v: json.dumps(v).encode())))


class _Stream:
    def __init__(self):
        self.out = bytearray()

    async def read(self, n: int = 65536) -> bytes:
        return b""

    async def write(self, b: bytes) -> None:
        self.out += b


class _Ep:
    def __init__(self, gw):
        self.gw, self.logged = gw, []
        self.tools = self

    async def gateway(self):
        return self.gw

    def log(self, **kw):
        self.logged.append(kw)


def _gateway(run_dir: Path, reached: list):
    from agentvm.tools import policy as tp
    from agentvm.tools.gateway import ToolGateway

    sp = tp.ServerPolicy(name="notes", kind="local", allow=("*",), deny=("*admin*",))
    pol = tp.ToolPolicy(servers=(sp,), tier_approval=(), tier="L3")
    gw = ToolGateway(sandbox_id="sbx1", agent="a", policy=pol, policy_digest="sha256:v1", run_dir=run_dir,
                     log=lambda **kw: None)

    class _Server:  # a tool server that records what reached it
        async def call_tool(self, name, arguments=None):
            reached.append(name)
            from mcp import types

            return types.CallToolResult(content=[types.TextContent(type="text", text="ok")], isError=False)

        async def list_tools(self, cursor=None):
            from mcp import types

            return types.ListToolsResult(tools=[types.Tool(name="read", inputSchema={"type": "object"}),
                                                types.Tool(name="admin_wipe", inputSchema={"type": "object"})])

        def __getattr__(self, name):
            raise ConnectionError("the fuzz server has no " + name)

    async def get():
        return _Server()

    gw.upstreams["notes"].get = get
    return gw


_DIR = Path(tempfile.mkdtemp(prefix="agentvm-test-fuzz-mcp-"))
atexit.register(shutil.rmtree, _DIR, True)


@settings(FUZZ, max_examples=max(20, EXAMPLES // 3))
@given(data=body(), proto=st.sampled_from([None, b"2025-06-18", b"2026-07-28", b"1999-01-01"]))
def test_mcp_requests(data, proto):
    head = (b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\n"
            + (b"MCP-Protocol-Version: " + proto + b"\r\n" if proto else b"")
            + b"Content-Length: %d\r\n\r\n" % len(data))
    req, rb = h1.parse_head(head, data)
    reached: list = []

    async def main():
        gw = _gateway(_DIR, reached)
        ep, stream = _Ep(gw), _Stream()
        try:
            await asyncio.wait_for(serve_one(ep, stream, rb, req), 20)
        finally:
            await gw.close()
        return ep, bytes(stream.out)

    ep, out = asyncio.run(main())
    assert out.startswith(b"HTTP/1.1 "), out[:100]
    assert not any(r.get("rule_id") == "tools:internal-error" for r in ep.logged), (ep.logged, data)
    assert b" 500 " not in out.split(b"\r\n", 1)[0], (out[:300], data)
    assert "admin_wipe" not in reached, "a denied tool reached its server"
