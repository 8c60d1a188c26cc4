"""The tool gateway's decisions around a human approval, driven in-process (a fake tool
server, the real approvals queue): what the human is shown, a deny made while a call waits,
what an agent's request for access can grant, resource URIs that climb out of their glob."""

from __future__ import annotations

import asyncio
import json
import time
import types as pytypes

import mcp_types as mt
import pytest

from agentvm.approvals import ApprovalStore
from agentvm.tools import policy as tp
from agentvm.tools.gateway import ToolGateway


LISTED = ("write_file", "read_note", "write_note", "list_notes", "get_issue", "GET_ADMIN_TOKEN")  # the fake's tools


def gateway(tmp_path, sp, listed=LISTED):
    audit, logs, called = [], [], []
    store = ApprovalStore(tmp_path / "approvals.db", record=lambda k, **kw: audit.append((k, kw)))
    pol = tp.ToolPolicy(servers=(sp,), tier_approval=("destructive",), tier="L3", approval_timeout=30)
    gw = ToolGateway(sandbox_id="sbx1", agent="a", policy=pol, policy_digest="sha256:v1", run_dir=tmp_path,
                     log=lambda **kw: logs.append(kw), approvals=store)

    class FakeClient:
        async def list_tools(self, cursor=None):
            return mt.ListToolsResult(tools=[mt.Tool(name=n, input_schema={"type": "object"}) for n in listed])

        async def call_tool(self, name, args):
            called.append((name, args))
            return mt.CallToolResult(content=[mt.TextContent(type="text", text="done")])

    async def get():
        return FakeClient()

    gw.upstreams[sp.name].get = get
    return gw, store, pol, audit, called


def call(gw, name, args):
    return gw._call_tool(None, pytypes.SimpleNamespace(name=name, arguments=args))


def test_the_human_sees_every_argument_and_the_chain_sees_none(tmp_path):
    sp = tp.ServerPolicy(name="fs", kind="local", approve=("write_file",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)
    args = {"content": "x" * 250, "path": "/home/op/.bashrc"}

    async def go():
        t = asyncio.ensure_future(call(gw, "fs__write_file", args))
        await asyncio.sleep(0.2)
        r = store.list()[0]
        assert r.summary["keys"] == ["content", "path"]
        assert json.loads(r.summary["arguments"]) == args, "the whole of it, not a cut preview"
        requested = [kw for k, kw in audit if k == "approval.requested"][0]
        assert "/home/op/.bashrc" not in json.dumps(requested) and requested["keys"] == ["content", "path"]
        store.answer(r.id, False, "cli:op")
        with pytest.raises(Exception):
            await t

    asyncio.run(go())
    assert called == []


def test_a_deny_made_while_a_call_waits_wins_over_its_approval(tmp_path):
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("read_note",), approve=("write_note",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)

    async def go():
        t = asyncio.ensure_future(call(gw, "notes__write_note", {"title": "x"}))
        await asyncio.sleep(0.2)
        gw.set_policy(tp.apply_live(pol, [{"action": "deny", "server": "notes", "tool": "write_note"}]), "sha256:v2")
        store.answer(store.list()[0].id, True, "cli:op")
        with pytest.raises(Exception) as e:
            await t
        assert "policy changed while the call waited" in str(e.value)

    asyncio.run(go())
    assert called == [], "the call never reached the server"


def test_request_access_cannot_lift_a_deny_or_an_approval(tmp_path):
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("read_note",), approve=("write_note",),
                         deny=("delete_note",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)
    _, tools, refused = gw._access_delta({"tools": ["notes__delete_note", "notes__write_note", "notes__list_notes"]})
    assert any("delete_note" in r and "not grantable" in r for r in refused)
    assert tools == [{"action": tp.GRANT, "server": "notes", "tool": "list_notes"}]  # write_note is visible already
    granted = tp.apply_live(pol, tools, grants=True)
    assert tp.decide("notes", "list_notes", {}, granted).verdict == "allow"
    assert tp.decide("notes", "write_note", {}, granted).verdict == "ask", "its approval stays"
    live_denied = tp.apply_live(granted, [{"action": "deny", "server": "notes", "tool": "list_notes"}])
    again = tp.apply_live(live_denied, [{"action": tp.GRANT, "server": "notes", "tool": "list_notes"}], grants=True)
    assert tp.decide("notes", "list_notes", {}, again).verdict == "deny", "a grant never lifts a deny"
    with pytest.raises(ValueError):  # the operator's API has no "grant"
        tp.apply_live(pol, [{"action": tp.GRANT, "server": "notes", "tool": "x"}])


@pytest.mark.parametrize("uri", ["file:///srv/notes/../../etc/shadow", "file:///srv/notes/%2e%2e/%2E%2E/etc/shadow",
                                 "file:///srv/notes/a%2f..%2f..%2fetc", "file:///srv/notes/..\\..\\etc",
                                 "file:///srv/notes/./x/../../y", "file:///srv/notes/a\x00b"])
def test_resource_uris_cannot_climb_out_of_their_glob(uri):
    sp = tp.ServerPolicy(name="n", kind="local", resources=("file:///srv/notes/*",))
    assert not tp.resource_allowed(sp, uri)
    assert tp.resource_allowed(sp, "file:///srv/notes/today.md")


def test_a_modern_tools_call_does_not_list_every_server_first(tmp_path):
    """The SDK's 2026-07-28 transport checks Mcp-Param-* headers against the called tool's input
    schema. Unless the gateway names the schema, the SDK gets it by running the whole tools/list
    - a round trip to every declared tool server - before each call. The gateway answers from
    the last listing instead: one listing for many calls, and the calls still work."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    sp = tp.ServerPolicy(name="t", kind="local", allow=("echo",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)
    listed = []

    class Upstream:
        async def list_tools(self, cursor=None):
            listed.append(cursor)
            return mt.ListToolsResult(tools=[mt.Tool(name="echo", input_schema={
                "type": "object", "properties": {"text": {"type": "string"}}})])

        async def call_tool(self, name, args):
            called.append((name, args))
            return mt.CallToolResult(content=[mt.TextContent(type="text", text=args["text"])])

    async def get():
        return Upstream()

    gw.upstreams["t"].get = get

    async def go():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.handle), base_url="http://127.0.0.1:3128")
        try:
            async with Client(streamable_http_client("http://127.0.0.1:3128/mcp", http_client=http)) as c:
                first = await c.call_tool("t__echo", {"text": "before any listing"})  # nothing cached: still served
                names = [t.name for t in (await c.list_tools()).tools]
                out = [await c.call_tool("t__echo", {"text": f"n{i}"}) for i in range(5)]
        finally:
            await gw.close()
            await http.aclose()
        return first, names, out

    first, names, out = asyncio.run(go())
    assert names == [tp.REQUEST_ACCESS, "t__echo"]
    assert first.content[0].text == "before any listing"
    assert [r.content[0].text for r in out] == [f"n{i}" for i in range(5)]
    assert len(called) == 6
    # three listings: the gateway's own for the first call (a call is forwarded only under a name
    # the server lists, and nothing was listed yet), the one asked for, and the SDK client's own
    # before its first call (it learns the tools' output schemas); without the gateway's schema
    # lookup it is nine (one more per call)
    assert len(listed) == 3, f"tools/list ran {len(listed)} times for one listing and six calls"


def _egress(yaml_body: str):
    from _spec_helpers import agent

    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    return compile_policy(load_agent_text(agent("spec:\n  riskTier: L3\n" + yaml_body), "a.yaml",
                                          preset_dirs=[]).spec).egress


def test_request_access_for_a_host_the_operator_denied_is_refused_never_queued(tmp_path):
    """Issue 35: such a request was queued, and once approved the agent was told "granted"
    while the gate still answered 403. Refused outright - a deny rule of the operator's or a
    default deny (metadata, private addresses) - and never put before a human."""
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("read_note",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)
    eg = _egress("  egress:\n    allow: [{host: ok.test}]\n    deny: [{host: evil.test}, {host: '*.evil.test'}]\n")
    gw.endpoint = pytypes.SimpleNamespace(policy=eg, set_policy=lambda p: setattr(gw.endpoint, "policy", p))
    for item in ("evil.test", "EVIL.test:443", "api.evil.test", "dns.google"):  # the last: a default deny (DoH)
        egress, _, refused = gw._access_delta({"egress": [item]})
        assert egress == [] and refused and "not grantable" in refused[0], (item, refused)
    for item in ("169.254.169.254:80", "10.0.0.1", "127.0.0.1:8080", "[::1]"):  # an allow rule naming one lifts it
        egress, _, refused = gw._access_delta({"egress": [item]})
        assert egress == [] and refused and "never granted on request" in refused[0], (item, refused)

    async def go(args):
        return await gw._call_tool(None, pytypes.SimpleNamespace(name=tp.REQUEST_ACCESS, arguments=args))

    res = asyncio.run(go({"egress": ["evil.test:443"], "reason": "need it"}))
    assert res.is_error and "not grantable" in res.content[0].text
    assert store.list() == [], "never queued for a human"
    # a grantable item beside a denied one: only the grantable one is put before the human
    egress, _, refused = gw._access_delta({"egress": ["new.test", "evil.test"]})
    assert egress == [("new.test", (443,))] and len(refused) == 1


class _Conn:
    """The sandbox's side of an /mcp connection as the gate's door sees it: a request, and
    whether the peer has hung up (``peer_closed``, the kernel's POLLRDHUP in the gate)."""

    def __init__(self):
        self.out, self.closed = bytearray(), False

    async def read(self, n: int = 65536) -> bytes:
        return b""

    async def write(self, b: bytes) -> None:
        self.out += b

    def peer_closed(self) -> bool:
        return self.closed


def _mcp_call(name: str, args: dict) -> tuple:
    from agentvm.gate import h1

    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": name, "arguments": args}}).encode()
    raw = (b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nContent-Type: application/json\r\n"
           b"Accept: application/json, text/event-stream\r\nMcp-Protocol-Version: 2025-06-18\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head, rest = raw.split(b"\r\n\r\n", 1)
    return h1.parse_head(head + b"\r\n\r\n", rest)


def test_a_held_call_whose_connection_is_cut_expires_and_cannot_be_approved(tmp_path):
    """Issue 35: a tool call held for approval whose caller had gone stayed pending, and an
    operator approving it later made the tool run with nobody waiting. Driven through the
    gate's /mcp door (asgi.serve_one) into the real gateway and queue."""
    from agentvm.approvals import ApprovalError
    from agentvm.gate.asgi import serve_one

    sp = tp.ServerPolicy(name="notes", kind="local", allow=("read_note",), approve=("write_note",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)

    class Slot:
        async def gateway(self):
            return gw

    ep = pytypes.SimpleNamespace(tools=Slot(), log=lambda **kw: None)
    conn = _Conn()

    async def go():
        req, body = _mcp_call("notes__write_note", {"title": "x"})
        t = asyncio.ensure_future(serve_one(ep, conn, body, req))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if store.list():
                break
        held = store.list()[0]
        assert held.state == "pending"
        conn.closed = True  # the agent hangs up
        for _ in range(40):
            await asyncio.sleep(0.05)
            if store.get(held.id).state != "pending":
                break
        try:
            async with asyncio.timeout(10):
                await t
        finally:
            await gw.close()
        return held.id

    rid = asyncio.run(go())
    row = store.get(rid)
    assert row.state == "expired" and "requester is gone" in (row.note or "")
    with pytest.raises(ApprovalError, match="already expired") as e:
        store.answer(rid, True, "cli:op")
    assert e.value.code == "approvals.expired"
    assert called == [], "the tool never ran"


def test_an_orphaned_request_cannot_be_approved(tmp_path):
    """A pending row nobody waits for any more (no heartbeat from its waiter) is expired by the
    next answer, which is refused."""
    from agentvm.approvals import ORPHANED_AFTER, ApprovalError

    sp = tp.ServerPolicy(name="notes", kind="local", approve=("write_note",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)
    r = store.submit(kind="tool", sandbox="sb", agent="a", target="notes__write_note", summary={}, arg_digest="d",
                     policy="p", timeout=600)
    store._db.execute("UPDATE approvals SET alive=? WHERE id=?", (time.time() - ORPHANED_AFTER - 1, r.id))
    with pytest.raises(ApprovalError, match="already expired") as e:
        store.answer(r.id, True, "cli:op")
    assert e.value.code == "approvals.expired" and "orphaned" in e.value.message


def test_resource_uris_are_paths_compared_exactly_not_names():
    """Names are folded (NFKC + case); a resource URI is a path on a case-sensitive file
    system: folding it would let file:///srv/notes/* reach file:///SRV/NOTES/..."""
    sp = tp.ServerPolicy(name="n", kind="local", resources=("file:///srv/notes/*",), prompts=("summary",))
    assert tp.resource_allowed(sp, "file:///srv/notes/a.md")
    assert not tp.resource_allowed(sp, "file:///SRV/NOTES/a.md")
    # a prompt is a name, but prompts is an allow list: compared exactly (folding would widen it)
    assert tp.prompt_allowed(sp, "summary") and not tp.prompt_allowed(sp, "SUMMARY")


@pytest.mark.parametrize("name", ["notes__GET_ADMIN_TOKEN", "notes__Get_issue", "notes__get_Admin_Token",
                                  "notes__get_nothing"])
def test_a_call_is_forwarded_only_under_a_name_the_server_lists_exactly(tmp_path, name):
    """allow: ["get_*"] allowed GET_ADMIN_TOKEN (folded) and the call went upstream in the
    agent's spelling: a case-sensitive server with tools differing only by case gave access to
    the other one. Now an allow glob matches exactly, and a name the server does not list,
    exactly, is refused before anything is sent."""
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("get_*", "get_nothing"), deny=("*secret*",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)

    async def go():
        try:
            with pytest.raises(Exception) as e:
                await call(gw, name, {})
            ok = await call(gw, "notes__get_issue", {})
            return str(e.value), ok
        finally:
            await gw.close()

    err, ok = asyncio.run(go())
    assert "tools:not-allowed" in err or "tools:not-listed" in err, err
    assert called == [("get_issue", {})], "only the listed, allowed name went upstream, as listed"
    assert ok.content[0].text == "done"


def test_a_listing_hides_a_tool_an_allow_glob_names_in_another_case(tmp_path):
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("get_*",))
    gw, *_ = gateway(tmp_path, sp)

    async def go():
        try:
            return [t.name for t in (await gw._list_tools(None, None)).tools]
        finally:
            await gw.close()

    assert asyncio.run(go()) == [tp.REQUEST_ACCESS, "notes__get_issue"]


def test_another_spelling_of_a_server_only_routes_and_every_narrowing_rule_applies(tmp_path):
    """The SERVER part may be spelled otherwise (``ｎｏｔｅｓ``, ``NOTES``: the selftest's
    tools.deny-spelling calls so): it routes to the server as declared, deny still folds, and
    the tool part is still compared exactly."""
    sp = tp.ServerPolicy(name="notes", kind="local", allow=("*",), deny=("*admin*",))
    gw, store, pol, audit, called = gateway(tmp_path, sp)

    async def go():
        out = []
        for name in ("\uff4e\uff4f\uff54\uff45\uff53__GET_ADMIN_TOKEN", "NOTES__GET_ADMIN_TOKEN", "NOTES__get_issue",
                     "\uff4e\uff4f\uff54\uff45\uff53__get_issue"):
            try:
                await call(gw, name, {})
                out.append("ran")
            except Exception as exc:  # noqa: BLE001
                out.append(str(exc))
        await gw.close()
        return out

    a, b, c, d = asyncio.run(go())
    assert "tools:deny:notes:*admin*" in a and "tools:deny:notes:*admin*" in b
    assert c == d == "ran" and called == [("get_issue", {}), ("get_issue", {})]
