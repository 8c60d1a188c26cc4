"""The tool gateway's agent-facing JSON-RPC is parsed in the confined gate worker
(agentvm.tools.front) and the daemon is asked with plain data only (issue 43): here, the
daemon's side. What a compromised worker can send is ``(method, params)``: anything else - the
old raw HTTP request, params that are not a dict, a method the gateway does not serve - drops
the worker (a ValueError), and params of the wrong shape are answered with the protocol's
invalid-params error after the SDK's models checked them again. The front, driven in-process,
turns the daemon's answers back into MCP results and errors."""

from __future__ import annotations

import asyncio
import types as pytypes

import mcp_types as mt
import pytest

from agentvm.tools import front
from agentvm.tools import policy as tp
from tests.unit.test_tools_gateway_review import gateway


def _pool_and_ep(gw):
    from agentvm.gate.workers import WorkerPool

    pool = WorkerPool.__new__(WorkerPool)

    class Tools:
        async def gateway(self):
            return gw

    ep = pytypes.SimpleNamespace(tools=Tools())
    w = pytypes.SimpleNamespace(abandoned=set())
    return pool, w, ep


def test_the_daemon_takes_only_method_and_plain_params(tmp_path):
    from agentvm.gate.workers import _tools_question

    gw = gateway(tmp_path, tp.ServerPolicy(name="fs", kind="local", allow=("read_note",)))[0]
    pool, w, ep = _pool_and_ep(gw)

    def ask(args):
        return asyncio.run(pool._q_tools(w, ep, 1, _tools_question(args)))

    raw_http = ("POST", "/mcp", "", [(b"content-type", b"application/json")], b'{"jsonrpc":"2.0"}', "1.1", 80)
    deep: dict = {}
    cur = deep
    for _ in range(60):
        cur["x"] = {}
        cur = cur["x"]
    for bad in (raw_http, ("tools/call", b'{"name": "x"}'), ("tools/call", ["x"]), ("x" * 65, {}),
                ("admin/shutdown", {}), ("tools/call",), ("tools/call", {"name": "x", "arguments": {"a": b"raw"}}),
                ("tools/call", {"name": "x", "arguments": {"a": {1, 2}}}), ("tools/call", {"name": "x", 7: 1}),
                ("tools/call", {"name": "x", "arguments": {"a": float("nan")}}),
                ("tools/call", {"name": "x", "arguments": {"a": 1 << 70}}), ("tools/call", {"name": "x", "arguments": deep}),
                ("tools/call", {"name": "x", "arguments": {"a": ("t", "u")}})):
        with pytest.raises(ValueError):
            ask(bad)
    status, code, message, _ = ask(("tools/call", {"name": 7}))
    assert (status, code) == ("error", mt.INVALID_PARAMS) and "tools/call" in message
    assert ask(("tools/call", None))[:2] == ("error", mt.INVALID_PARAMS)
    status, result = ask(("tools/list", None))
    assert status == "ok" and {t["name"] for t in result["tools"]} == {tp.REQUEST_ACCESS, "fs__read_note"}
    status, result = ask(("tools/call", {"name": "fs__read_note", "arguments": {}}))
    assert status == "ok" and result["content"][0]["text"] == "done"
    status, code, message, data = ask(("tools/call", {"name": "fs__write_note", "arguments": {}}))
    assert status == "error" and data["rule"].startswith("tools:"), (code, message, data)


def test_a_malformed_tools_question_drops_the_worker_at_once(tmp_path):
    """(review 4: the shape was checked inside the question's task, whose ValueError only became
    a refused answer - not the dropped worker the threat model says)"""
    from agentvm.gate.workers import WorkerPool

    pool = WorkerPool.__new__(WorkerPool)
    ep = pytypes.SimpleNamespace(closed=False)
    w = pytypes.SimpleNamespace(endpoints={"sbx1": ep}, questions={}, index=0)

    async def go():
        pool.question(w, ("q", 1, "tools", "sbx1", ("POST", "/mcp", "", [], b"{}", "1.1", 80)))

    with pytest.raises(ValueError):
        asyncio.run(go())
    assert w.questions == {}


def test_shared_references_cannot_make_the_daemon_expand_a_message():
    """(review 4: one 12 MiB string referenced a million times passed the item count - every
    string was one item - and the first json.dumps of the params built terabytes in root)"""
    import pickle

    from agentvm.gate.workers import MAX_FROM_WORKER, _plain_loads

    big = "x" * (12 << 20)
    msg = pickle.dumps(("q", 1, "tools", "sbx1", ("tools/call", {"name": "t", "arguments": {"a": [big] * 1_000_000}})),
                       protocol=5)
    assert len(msg) < MAX_FROM_WORKER, "small enough to be read"
    with pytest.raises(ValueError, match="bytes of text"):
        _plain_loads(msg)


def test_the_front_answers_what_the_daemon_would_refuse_without_asking():
    """(review 4: an agent's 239-byte request - arguments nested 70 deep - passed the SDK and cost
    the agent its gate worker, dropped by the daemon as a broken channel)"""
    from mcp.shared.exceptions import MCPError

    asked = []

    async def ask(method, params):
        asked.append(method)
        return "ok", {"content": []}

    logged = []
    f = front.ToolFront(ask, lambda **kw: logged.append(kw))
    call = f._handler("tools/call")
    deep: dict = {}
    cur = deep
    for _ in range(70):
        cur["x"] = {}
        cur = cur["x"]
    for args in (deep, {"a": [0] * (front.PARAMS_ITEMS + 1)}):
        with pytest.raises(MCPError) as e:
            asyncio.run(call(None, mt.CallToolRequestParams(name="s__t", arguments=args)))
        assert e.value.code == mt.INVALID_PARAMS and "tools:request-too-large" in e.value.message
    assert asked == []
    assert [(r["verdict"], r["rule_id"]) for r in logged] == [("deny", "tools:request-too-large")] * 2, logged
    asyncio.run(call(None, mt.CallToolRequestParams(name="s__t", arguments={"a": [0] * 1000})))
    assert asked == ["tools/call"]


def test_the_front_rebuilds_results_and_errors_from_plain_answers():
    asked = []

    async def ask(method, params):
        asked.append((method, params))
        if method == "tools/list":
            return "ok", {"tools": [{"name": "s__t", "inputSchema": {"type": "object"}}]}
        return "error", mt.INVALID_PARAMS, "no such tool [tools:unknown]", {"rule": "tools:unknown"}

    f = front.ToolFront(ask)
    handlers = {m: f._handler(m) for m in front.METHODS}
    listed = asyncio.run(handlers["tools/list"](None, None))
    assert isinstance(listed, mt.ListToolsResult) and listed.tools[0].name == "s__t"
    assert f._schemas["s__t"] == {"type": "object"} and tp.REQUEST_ACCESS in f._schemas
    from mcp.shared.exceptions import MCPError

    with pytest.raises(MCPError) as e:
        asyncio.run(handlers["tools/call"](None, mt.CallToolRequestParams(name="s__x", arguments={"a": 1})))
    assert e.value.code == mt.INVALID_PARAMS and e.value.data == {"rule": "tools:unknown"}
    assert asked[1] == ("tools/call", {"name": "s__x", "arguments": {"a": 1}}), "plain data, as validated"
