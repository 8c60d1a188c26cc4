"""The tool gateway: one MCP endpoint per sandbox, outside it, fail closed.

The agent reaches it as streamable HTTP at ``http://127.0.0.1:$AGENTVM_GATE_PORT/mcp`` - the
same loopback port that leads to the egress gate, so the sandbox's identity is the socket it
arrived on, never anything it sends. The gate hands such requests to this sandbox's
:class:`ToolGateway` (an ASGI app: the official ``mcp`` SDK's streamable-HTTP server, which
speaks both the handshake-era revisions and the stateless 2026-07-28 one).

Behind it, each declared server is an MCP client session of the SDK:

- a **local** server (``command``) runs in a sandbox of its own - ``agentvm run`` of an agent
  file made from its entry (its grants, environment, egress and credentials; none of the
  agent's) with its stdio as the MCP stdio transport. Its egress goes through its own gate,
  which swaps its credentials in: the agent never holds them, the tool server never holds
  the agent's workspace;
- **remote** servers (``url``) are refused at run time for now (``pending_features``).

What the gateway does with each message:

- ``tools/list``: every server's tools, filtered by :func:`agentvm.tools.policy.visible`
  (hidden = absent), renamed ``SERVER__TOOL``; plus ``agentvm__request_access``;
- ``tools/call``: :func:`agentvm.tools.policy.decide` (deny wins, no match denies, bad
  arguments deny, an exception denies); ``ask`` holds the call in the approvals queue until a
  human answers or the timeout denies; allowed calls are rate-limited per server, forwarded
  with a timeout, and their result bounded in size. Every call is logged (decision, rule,
  policy digest, argument digest - never argument values) in the sandbox's decision log;
- resources and prompts: only those named by ``resources`` / ``prompts`` globs.

A server that crashes, hangs, floods or answers garbage costs the agent that server's calls
(a JSON-RPC error naming the reason), never the gateway or another server or sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mcp_types as types
from mcp import Client
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from agentvm import names
from agentvm.held import digest as arg_digest
from agentvm.gate.endpoint import TokenBucket
from agentvm.approvals import GONE, SHOW_MAX, preview, shown
from agentvm.tools import policy as tp
from agentvm.tools.front import METHODS, OPTIONAL_PARAMS, REQUESTER_GONE as _REQUESTER_GONE, Served, make_server
from agentvm.tools.front import request_access_tool as _request_access_tool
from agentvm.tools.stdio import MAX_LINE_FLOOR, MAX_UNREAD, Busy, Flooded, StdioSession

START_TIMEOUT = 60.0  # a local server's sandbox and MCP handshake
LIST_PAGES = 20  # at most this many pages of tools/list per server
MAX_TOOLS = 1000  # per server: a server that lists more is cut here
MAX_REQUEST_ACCESS = 4096  # bytes of a request_access justification

#: the current request's "has its requester left?" check (agentvm.tools.front.REQUESTER_GONE:
#: set by Served.handle from the gate's ASGI scope, or by :meth:`ToolGateway.rpc` from the
#: worker's word; None where nobody can tell)


def _gone(gone) -> bool:
    try:
        return bool(gone())
    except Exception:  # noqa: BLE001 - cannot tell: treated as gone (nothing runs for nobody)
        return True


# JSON-RPC error codes of the gateway's own answers (the -32000..-32099 server range)
DENIED = -32010
APPROVAL_DENIED = -32011
SERVER_FAILED = -32012
LIMITED = -32013


RESTART_BASE = 0.5  # seconds before a failed tool server is started again, doubling per failure
RESTART_MAX = 30.0
QUICK_EXIT = 5.0  # seconds: a session that ends sooner than this counts as a failed start
STOP_WAIT = 12.0  # seconds to wait for a stopped server's sandbox to end (stdin closed, SIGTERM, SIGKILL)


def _described(exc: BaseException) -> str:
    """An exception as a tool server's error: its type, and its message (bounded) if it has one."""
    return f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__


class ToolFailure(Exception):
    def __init__(self, rule_id: str, reason: str, code: int = SERVER_FAILED) -> None:
        super().__init__(reason)
        self.rule_id, self.reason, self.code = rule_id, reason, code


class Upstream:
    """One declared server: its MCP client session, held open by a task of its own."""

    def __init__(self, gw: "ToolGateway", sp: tp.ServerPolicy) -> None:
        self.gw, self.sp = gw, sp
        self.client: Client | StdioSession | None = None
        self.error: str | None = None
        self.bucket = TokenBucket(sp.calls_per_minute / 60.0, float(sp.calls_per_minute))
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._failures = 0  # starts in a row that ended without a working client
        self._retry_at = 0.0  # no new start before this (monotonic): a failing server is not restarted per request
        self._served = False  # the current start got as far as a session (its end is not a failed start)
        self._served_at = 0.0  # when it did (monotonic)
        self._ending: asyncio.Task | None = None  # a discarded session, until its server is stopped
        self.listed: frozenset[str] = frozenset()  # the tool names of its last tools/list, exactly as listed

    def _local_argv_env(self) -> tuple[list[str], dict[str, str]]:
        """``agentvm run`` of the server's own agent file, embedded, in this installation."""
        spec_file = self.gw.run_dir / f"tool-{self.sp.name}.json"
        spec_file.write_text(self.sp.sandbox_spec)
        os.chmod(spec_file, 0o600)
        # agent-vm's own settings (home, uid range...) pass on, the daemon's address does not: the
        # server's sandbox runs embedded, in this installation
        env = get_default_environment()
        env.update({k: v for k, v in os.environ.items()
                    if (k.startswith("AGENTVM_") and not k.startswith("AGENTVM_DAEMON")) or k in ("PATH", "LANG")})
        env.update(self.gw.env)
        env["AGENTVM_NO_DAEMON"] = "1"
        return [sys.executable, "-m", "agentvm", "run", "--no-tty", "-f", str(spec_file)], env

    async def _hold(self, ready: asyncio.Event, stop: asyncio.Event) -> None:
        """The server's session, from its start until ``stop`` or its end: a local server is a
        :class:`StdioSession` (bounded lines), a remote one the SDK's streamable-HTTP client."""
        errlog = None
        try:
            if self.sp.kind == "remote":
                transport = await self._remote_transport()
                async with Client(transport, cache=None, read_timeout_seconds=self.sp.timeout,
                                  client_info=types.Implementation(name="agentvm-tool-gateway", version="1")) as c:
                    self.client, self._served, self._served_at = c, True, time.monotonic()
                    ready.set()
                    await stop.wait()
                return
            argv, env = self._local_argv_env()
            # the run folder is root's; never through a link
            log_fd = os.open(self.gw.run_dir / f"tool-{self.sp.name}.log",
                             os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            errlog = os.fdopen(log_fd, "a", buffering=1)
            # room for eight of the largest requests (escaped JSON is at most 6 bytes a character)
            session = await StdioSession.spawn(argv, env=env, errlog=errlog, name=self.sp.name,
                                               max_line=max(MAX_LINE_FLOOR, 2 * self.sp.max_result + 65536),
                                               max_unread=max(MAX_UNREAD, 8 * (6 * self.sp.max_arguments + 4096)))
            try:
                try:
                    async with asyncio.timeout(START_TIMEOUT):
                        await session.initialize()
                except BaseException as exc:  # said now: stopping its server below can take seconds
                    if isinstance(exc, TimeoutError):
                        exc = MCPError(types.REQUEST_TIMEOUT, f"tool server {self.sp.name} did not answer "
                                       f"initialize within {START_TIMEOUT:g}s")
                    self.error = _described(exc)
                    ready.set()
                    raise exc from None
                self.client, self._served, self._served_at = session, True, time.monotonic()
                ready.set()
                ended = asyncio.ensure_future(session.closed.wait())
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait((ended, stopped), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ended.cancel()
                    stopped.cancel()
                if session.end is not None and not stop.is_set():
                    raise session.end
            finally:
                await asyncio.shield(session.close())
        except BaseException as exc:  # noqa: BLE001 - the server's failure is this server's only
            inner = exc
            while isinstance(inner, BaseExceptionGroup) and inner.exceptions:
                inner = inner.exceptions[0]
            if not ready.is_set() or self.error is None:
                self.error = _described(inner)
        finally:
            if self._stop is stop:
                self.client = None
            ready.set()
            if errlog is not None:
                errlog.close()

    async def get(self) -> "Client | StdioSession":
        async with self._lock:
            if self._task is not None and self._task.done():
                self._task = None  # it ended (the server exited): started again below
                if not self._served:  # it never got as far as a session: the next start waits
                    self._failures += 1
                    self._back_off(self._failures - 1)
                else:
                    self._ended_session()
            if self._task is None and time.monotonic() < self._retry_at:
                raise ToolFailure("tools:server-unavailable", f"tool server {self.sp.name} failed "
                                  f"({self.error or 'it exited'}); it is started again in "
                                  f"{self._retry_at - time.monotonic():.1f}s")
            if self._task is None:
                # a discarded session's server must be gone first: a second sandbox of the same
                # tool server would share its uid, so it is refused while the first still runs
                await self._reap(self._ending)
                self._ending = None
                self.client, self.error, self._served = None, None, False
                self._ready, self._stop = asyncio.Event(), asyncio.Event()
                self._task = asyncio.get_running_loop().create_task(self._hold(self._ready, self._stop))
            ready = self._ready
        try:
            async with asyncio.timeout(START_TIMEOUT + 5):  # the start's own deadline says why first
                await ready.wait()
        except TimeoutError:
            raise ToolFailure("tools:server-unavailable", f"tool server {self.sp.name} did not start within "
                              f"{START_TIMEOUT:g}s") from None
        if self.client is None:
            raise ToolFailure("tools:server-unavailable", f"tool server {self.sp.name} is not running "
                              f"({self.error or 'it exited'}); see tool-{self.sp.name}.log in the sandbox's run folder")
        return self.client

    async def _remote_transport(self):
        """A remote server is reached through an egress gate endpoint of its own, in the same
        gate: its policy allows only the url's host, port and path (TLS terminated by the gate,
        which verifies the server), and its credentials are swapped in there. The gateway's
        HTTP client holds placeholders only, and talks to that endpoint's unix socket (0600,
        root's) as to a proxy."""
        import ssl

        import httpcore2
        import httpx2

        from agentvm.sessioncreds import session_credentials

        gw, sp = self.gw, self.sp
        gate = gw.gate
        if gate is None:
            raise ToolFailure("tools:server-unavailable", "no gate to reach a remote tool server through")
        ep_id = f"{gw.sandbox_id}.tool-{sp.name}"
        sock = gw.run_dir / f"tool-{sp.name}.sock"
        creds = None
        headers = {}
        if sp.remote_credentials:
            home = gw.env.get("AGENTVM_HOME") or os.environ.get("AGENTVM_HOME") or "/var/lib/agentvm"
            creds, _, _ = await asyncio.get_running_loop().run_in_executor(
                None, session_credentials, sp.remote_credentials, Path(home) / "vault", ep_id)
            for b in sp.remote_credentials:
                headers[b.header] = b.format.replace("{}", creds.placeholders[b.name])
        if ep_id in gate.endpoints:
            await gate.close_endpoint(ep_id)
        await gate.open_endpoint(ep_id, gw.agent, sp.remote_egress, sock, creds=creds)
        self._endpoint_id = ep_id
        ctx = ssl.create_default_context(cadata=gate.ca.cert_pem.decode())

        from httpcore2._backends.auto import AutoBackend

        class GateSocket(AutoBackend):
            """Every connection the proxy pool opens goes to this endpoint's unix socket."""

            async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
                return await self.connect_unix_socket(str(sock), timeout=timeout)

        class ThroughGate(httpx2.AsyncHTTPTransport):
            def __init__(self) -> None:
                super().__init__()
                self._pool = httpcore2.AsyncHTTPProxy(proxy_url=httpcore2.URL("http://agentvm-gate/"),
                                                      ssl_context=ctx, network_backend=GateSocket(), max_connections=8)

        client = httpx2.AsyncClient(transport=ThroughGate(), headers=headers,
                                    timeout=httpx2.Timeout(sp.timeout, read=max(sp.timeout, 300.0)))
        self._http = client
        return streamable_http_client(sp.url, http_client=client)

    def discard(self, client=None) -> None:
        """The session is dead (the server's stdio closed, or it flooded): the next call starts it
        again, once this one's server is stopped. Several calls failing at once discard it once;
        ``client``: the session the caller saw fail (a newer one is left alone)."""
        if client is not None and client is not self.client:
            return
        self._stop.set()
        if self._task is not None:
            self._ending, self._task = self._task, None
            self._ended_session()
        self.client = None

    def _ended_session(self) -> None:
        """A session that served and ended: one that lived less than QUICK_EXIT counts as a
        failure (the second in a row waits before the next start: a server that dies on every
        call is not restarted per call), a longer one clears the count."""
        if time.monotonic() - self._served_at < QUICK_EXIT:
            self._failures += 1
            if self._failures >= 2:
                self._back_off(self._failures - 2)
        else:
            self._failures = 0

    def _back_off(self, doublings: int) -> None:
        """No new start for RESTART_BASE seconds, doubled ``doublings`` times (at most RESTART_MAX)."""
        self._retry_at = time.monotonic() + min(RESTART_MAX, RESTART_BASE * 2 ** doublings)

    @staticmethod
    async def _reap(task: asyncio.Task | None) -> None:
        """Wait (bounded) for a session's task, which stops its server on the way out."""
        if task is None or task.done():
            return
        try:
            async with asyncio.timeout(STOP_WAIT):
                await asyncio.shield(task)
        except (TimeoutError, Exception):  # noqa: BLE001 - it is cancelled below; its end is logged by it
            task.cancel()

    async def close(self) -> None:
        ep_id = getattr(self, "_endpoint_id", None)
        if ep_id is not None and self.gw.gate is not None:
            await self.gw.gate.close_endpoint(ep_id)
        self._stop.set()
        await self._reap(self._ending)
        await self._reap(self._task)


class ToolGateway(Served):
    def __init__(self, *, sandbox_id: str, agent: str, policy: tp.ToolPolicy, policy_digest: str, run_dir: Path,
                 log: Callable[..., None], approvals=None, env: dict | None = None, gate=None,
                 endpoint=None) -> None:
        self.sandbox_id, self.agent = sandbox_id, agent
        self.policy, self.policy_digest = policy, policy_digest
        self.run_dir = Path(run_dir)
        self.log = log
        self.approvals = approvals
        self.env = dict(env or {})
        self.gate = gate  # the gate this sandbox's endpoint is on: remote servers get endpoints of their own there
        self.endpoint = endpoint  # this sandbox's gate endpoint (an approved request_access changes its policy)
        self.upstreams = {sp.name: Upstream(self, sp) for sp in policy.servers}
        # input schemas of the tools the last tools/list showed, by exposed name: what the SDK's
        # 2026-07-28 transport checks Mcp-Param-* headers against. Without it the SDK runs the
        # whole tools/list (a round trip to every tool server) before each tools/call.
        self._schemas: dict[str, Any] = {tp.REQUEST_ACCESS: _request_access_tool().input_schema}
        self._serve(make_server(self._handler_of, self._schemas))

    # ------------------------------------------------------------------ lifecycle: Served (start, handle)
    def _handler_of(self, method: str):
        """The handler of ``method`` (front.METHODS names it: ``_list_tools``...)."""
        return getattr(self, f"_{METHODS[method][2]}")

    async def rpc(self, method: str, params: dict | None, gone=None) -> tuple:
        """One MCP request of a sandbox served by a confined gate worker, which parsed its HTTP
        and JSON-RPC (agentvm.tools.front): its method and params as plain data, validated here
        again by the SDK's models -> ``("ok", result as plain data)`` or ``("error", code,
        message, data)``. This process never parses the agent's bytes. ``gone``: whether the
        requester has left (a held call then ends)."""
        from pydantic import ValidationError

        spec = METHODS.get(method) if type(method) is str else None
        if spec is None:
            raise ValueError("not a method of the tool gateway")
        model = spec[0]
        if params is None and method not in OPTIONAL_PARAMS:
            return "error", types.INVALID_PARAMS, f"{method} needs params", None
        try:
            p = model.model_validate(params) if params is not None else None
        except ValidationError as exc:
            return "error", types.INVALID_PARAMS, f"invalid params for {method} ({exc.error_count()} error(s))", None
        handler = self._handler_of(method)
        token = _REQUESTER_GONE.set(gone)
        try:
            result = await handler(None, p)
        except MCPError as exc:
            return "error", int(exc.code), str(exc.message), _plain_data(exc.data)
        finally:
            _REQUESTER_GONE.reset(token)
        return "ok", result.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def close(self) -> None:
        for u in self.upstreams.values():
            await u.close()
        await self._stop_serving()

    def set_policy(self, policy: tp.ToolPolicy, digest: str) -> None:
        """Live change (``agentvm policy NAME tools ...``): the next call is decided under it."""
        self.policy, self.policy_digest = policy, digest
        for sp in policy.servers:
            u = self.upstreams.get(sp.name)
            if u is not None:
                u.sp = sp

    # ------------------------------------------------------------------ logging
    def _log(self, *, verdict: str, rule: str, reason: str, target: str, args_digest: str | None = None,
             **extra) -> None:
        self.log(verdict=verdict, rule_id=rule, reason=reason, host="", port=None,
                 method="tools/call", path=target, phase="tool", tool=target, policy=self.policy_digest,
                 **({"arguments": args_digest} if args_digest else {}), **extra)

    # ------------------------------------------------------------------ tools
    async def _server_tools(self, u: Upstream) -> list[types.Tool]:
        c = await u.get()
        out: list[types.Tool] = []
        cursor = None
        for _ in range(LIST_PAGES):
            try:
                async with asyncio.timeout(u.sp.timeout):
                    res = await c.list_tools(cursor=cursor)
            except TimeoutError:
                raise ToolFailure("tools:server-timeout", f"tool server {u.sp.name} did not list its tools within "
                                  f"{u.sp.timeout:g}s") from None
            out.extend(res.tools)
            cursor = res.next_cursor
            if not cursor or len(out) >= MAX_TOOLS:
                break
        out = out[:MAX_TOOLS]
        u.listed = frozenset(t.name for t in out if isinstance(t.name, str))
        return out

    async def _list_tools(self, ctx, params) -> types.ListToolsResult:
        tools: list[types.Tool] = [_request_access_tool()]
        for name, u in self.upstreams.items():
            sp = self.policy.server(name)
            if sp is None:
                continue
            try:
                listed = await self._server_tools(u)
            except ToolFailure as f:
                self._log(verdict="deny", rule=f.rule_id, reason=f.reason, target=f"{name}{tp.SEP}*")
                continue  # that server's tools are absent; the others are listed
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, MCPError) and exc.code == types.CONNECTION_CLOSED or isinstance(exc, Flooded):
                    u.discard()
                rule = ("tools:server-busy" if isinstance(exc, Busy) else "tools:server-flood"
                        if isinstance(exc, Flooded) else "tools:server-error")
                self._log(verdict="deny", rule=rule, reason=str(exc)[:300] or type(exc).__name__,
                          target=f"{name}{tp.SEP}*")
                continue
            for t in listed:
                if tp.visible(sp, t.name):
                    tools.append(t.model_copy(update={"name": f"{name}{tp.SEP}{t.name}"}))
        self._schemas.clear()
        self._schemas.update((t.name, t.input_schema) for t in tools)
        return types.ListToolsResult(tools=tools)

    def _server_limit(self, u: Upstream, c, exc: Exception, target: str, args_digest: str | None = None):
        """A server past a bound of the stdio session: flooding (stopped, started again on the
        next call) or not reading its input (busy: this request is not sent)."""
        if isinstance(exc, Flooded):
            u.discard(c)
            return self._deny("tools:server-flood", f"{exc} (it is stopped, and started again on the next call)",
                              target, SERVER_FAILED, args_digest)
        return self._deny("tools:server-busy", f"{exc}: this request is not sent; try again when it has caught up",
                          target, LIMITED, args_digest)

    def _deny(self, rule: str, reason: str, target: str, code: int = DENIED, args_digest: str | None = None):
        self._log(verdict="deny", rule=rule, reason=reason, target=target, args_digest=args_digest)
        return MCPError(code, f"agent-vm tool gateway: {reason} [{rule}]", {"rule": rule, "reason": reason})

    async def _call_tool(self, ctx, params) -> types.CallToolResult:
        exposed = params.name
        args = params.arguments or {}
        ad = arg_digest(args)
        if not tp.valid_exposed(exposed):  # before anything compares it: nothing long is ever normalised
            bad = repr(exposed[:100]) if isinstance(exposed, str) else type(exposed).__name__  # (never all 4 MB)
            raise self._deny("tools:invalid-name", f"the tool name is not a valid tool name (at most {tp.MAX_EXPOSED} "
                             "characters; the tool part letters, digits, _ . - /)", bad, args_digest=ad)
        if names.same(exposed, tp.REQUEST_ACCESS):
            return await self._request_access(args, ad)
        split = tp.split_name(exposed)
        if split is None:
            raise self._deny("tools:not-allowed", "unknown tool (tools are named SERVER__TOOL)", str(exposed)[:200],
                             args_digest=ad)
        server, tool = split
        policy = self.policy
        named = policy.server(server)
        if named is not None:
            server = named.name  # the server as declared (names are compared in normal form)
        d = tp.decide(server, tool, args, policy)
        target = f"{server}{tp.SEP}{tool}"
        if d.verdict == "ask":
            whole = shown(args)
            if len(whole) > SHOW_MAX:  # a human approves only what a human can see, whole
                raise self._deny("approval:unshowable", f"the arguments ({len(whole)} bytes) are too large to show a "
                                 f"human for approval (at most {SHOW_MAX})", target, APPROVAL_DENIED, ad)
            answer = await self._hold("tool", target, {"server": server, "tool": tool, "preview": preview(args),
                                                       "keys": sorted(map(str, args)), "arguments": whole,
                                                       "risk": d.risk, "rule": d.rule_id}, ad)
            if answer is not None:
                raise self._deny(answer[0], answer[1], target, APPROVAL_DENIED, ad)
            # decided again under the policy in force now: a deny made while it waited wins
            policy = self.policy
            again = tp.decide(server, tool, args, policy)
            if again.verdict not in ("ask", "allow"):
                raise self._deny(again.rule_id, f"{again.reason} (the policy changed while the call waited for its "
                                 "approval)", target, args_digest=ad)
        elif not d.allowed:
            raise self._deny(d.rule_id, d.reason, target, args_digest=ad)
        u = self.upstreams.get(server)
        sp = policy.server(server)
        if u is None or sp is None:
            raise self._deny("tools:unknown-server", "no tool server of that name is declared", target, args_digest=ad)
        if not u.bucket.take():
            raise self._deny("tools:rate", f"more than {sp.calls_per_minute} calls a minute to {server}", target,
                             LIMITED, ad)
        t0 = time.monotonic()
        c = None
        try:
            c = await u.get()
            if tool not in u.listed:  # not in the last listing (or none yet): listed again, once
                await self._server_tools(u)
            if tool not in u.listed:
                # forwarded only under a name the server lists, exactly: an allow glob matches
                # exactly, but a server may still take another spelling for another tool
                raise ToolFailure("tools:not-listed", f"tool server {server} lists no tool named exactly {tool!r}",
                                  DENIED)
            async with asyncio.timeout(sp.timeout):
                result = await c.call_tool(tool, args)
        except ToolFailure as f:
            raise self._deny(f.rule_id, f.reason, target, f.code, ad) from None
        except TimeoutError:
            raise self._deny("tools:server-timeout", f"{target} did not answer within {sp.timeout:g}s", target,
                             SERVER_FAILED, ad) from None
        except (Busy, Flooded) as exc:
            raise self._server_limit(u, c, exc, target, ad) from None
        except MCPError as exc:
            if exc.code == types.CONNECTION_CLOSED:  # the SDK's own: the server's stdio closed (it exited)
                u.discard(c)
                raise self._deny("tools:server-exited", f"tool server {server} exited during the call to {target} "
                                 "(it is started again on the next call)", target, SERVER_FAILED, ad) from None
            if exc.code == types.REQUEST_TIMEOUT:
                raise self._deny("tools:server-timeout", f"{target} did not answer within {sp.timeout:g}s", target,
                                 SERVER_FAILED, ad) from None
            # the server's own JSON-RPC error: passed on, named as the server's
            self._log(verdict="allow", rule=d.rule_id, reason=f"server error {exc.code}", target=target,
                      args_digest=ad, error="tools:server-error")
            raise MCPError(exc.code, f"{target}: {exc.message}"[:1000]) from None
        except Exception as exc:  # noqa: BLE001 - a broken server is that server's problem only
            raise self._deny("tools:server-error", f"{target} failed: {type(exc).__name__}", target, SERVER_FAILED,
                             ad) from None
        size = len(result.model_dump_json(by_alias=True, exclude_none=True).encode())
        if size > sp.max_result:
            raise self._deny("tools:result-too-large", f"the result of {target} is {size} bytes, over {sp.max_result}",
                             target, LIMITED, ad)
        self._log(verdict="allow", rule=d.rule_id, reason=d.reason, target=target, args_digest=ad,
                  ms=round((time.monotonic() - t0) * 1000, 2), result_bytes=size)
        return result

    async def _hold(self, kind: str, target: str, summary: dict, ad: str, who: list | None = None) -> tuple[str, str] | None:
        """Put the action before a human; None when approved (``who`` gets the approver), else
        (rule, reason)."""
        if self.approvals is None:
            return "approval:unavailable", "no approvals queue is available to ask a human"
        try:
            req = self.approvals.submit(kind=kind, sandbox=self.sandbox_id, agent=self.agent, target=target,
                                        summary=summary, arg_digest=ad, policy=self.policy_digest,
                                        timeout=self.policy.approval_timeout, webhook=self.policy.webhook)
        except Exception as exc:  # noqa: BLE001 - not recorded, not held: denied
            return "approval:unavailable", f"the request could not be queued ({type(exc).__name__})"
        self._log(verdict="ask", rule="approval:pending", reason=f"waiting for a human ({req.id})", target=target,
                  args_digest=ad, approval=req.id)
        gone = _REQUESTER_GONE.get()
        try:
            req = await self.approvals.wait(req.id, gone=gone)
        except Exception as exc:  # noqa: BLE001
            return "approval:unavailable", f"the approvals queue failed ({type(exc).__name__})"
        if gone is not None and req.state == "approved" and _gone(gone):
            # approved in the instant its requester left: nobody waits for the result, it is not run
            self._log(verdict="deny", rule="approval:gone", reason=f"{req.id} was approved after its requester left",
                      target=target, args_digest=ad, approval=req.id)
            return "approval:gone", f"{req.id}: the requester is gone"
        if req.state == "approved":
            if who is not None:
                who.append(req.by)  # per call: concurrent holds never mix up their approvers
            self._log(verdict="ask", rule="approval:approved", reason=f"approved by {req.by} ({req.id})",
                      target=target, args_digest=ad, approval=req.id)
            return None
        if req.state == "expired":
            if req.note == GONE:
                self._log(verdict="deny", rule="approval:gone", reason=f"{req.id} expired: {GONE}", target=target,
                          args_digest=ad, approval=req.id)
                return "approval:gone", f"{req.id} expired: the requester is gone"
            return "approval:timeout", f"no human answered {req.id} in time ({req.note or 'expired'})"
        return "approval:denied", f"{req.id} was denied by {req.by}" + (f": {req.note}" if req.note else "")

    def _access_delta(self, args: dict) -> tuple[list, list, list]:
        """What the request would add to the policy in force now: (egress rules, tool changes,
        refusals). Items already allowed are no delta; items the tier forbids are refused."""
        from dataclasses import replace

        from agentvm.gate.exchange import _is_ip
        from agentvm.gate.policy import RequestMeta, Rule, check_address, cli_rule, decide
        from agentvm.spec.models import TIER_CEILINGS

        egress_items, tool_items, refused = [], [], []
        ep = self.endpoint
        want_egress = args.get("egress") or []
        want_tools = args.get("tools") or []
        if not isinstance(want_egress, list) or not isinstance(want_tools, list) or \
                len(want_egress) + len(want_tools) > 20 or not all(isinstance(x, str) for x in want_egress + want_tools):
            raise ValueError("'egress' and 'tools' are lists of at most 20 strings in all")
        for i, item in enumerate(want_egress):
            rule = cli_rule(f"granted[{i}]", item, default_ports=(443,))  # raises ValueError on a bad item
            if "*" in rule.host:
                refused.append(f"egress to {rule.host}: a pattern is never granted on request")
                continue
            if _is_ip(rule.host) and check_address(rule.host, rule.host, ep.policy if ep is not None else None) \
                    is not None:
                # an allow rule naming an IP literal lifts the address-class protection (loopback,
                # private, link-local, metadata): that is the operator's to write, never granted on request
                refused.append(f"egress to {rule.host}: a loopback, private, link-local or metadata address is never "
                               "granted on request")
                continue
            if not TIER_CEILINGS.get(self.policy.tier, {}).get("egress"):
                refused.append(f"egress to {rule.host}: risk tier {self.policy.tier} allows no egress")
                continue
            if ep is None:
                refused.append(f"egress to {rule.host}: no gate endpoint to change")
                continue
            def meta(p):
                return RequestMeta(host=rule.host, port=p, scheme="connect", phase="connect")

            missing = [p for p in rule.ports if not decide(meta(p), ep.policy).allowed]
            if not missing:
                continue
            # what the gate would answer once granted: an item a deny rule of the operator's (or
            # a default deny: metadata, private addresses) still refuses is refused now, never
            # queued for a human whose approval could not make it work
            granted = replace(ep.policy, allow=ep.policy.allow + (Rule(id="granted", host=rule.host, ports=tuple(missing)),))
            still = [(p, decide(meta(p), granted)) for p in missing]
            blocked = [(p, d) for p, d in still if not d.allowed]
            if blocked:
                p, d = blocked[0]
                refused.append(f"egress to {rule.host}:{p}: denied by the operator ({d.rule_id}; a deny rule is not "
                               "grantable)")
                continue
            egress_items.append((rule.host, tuple(missing)))
        for item in want_tools:
            split = tp.split_name(item)
            sp = self.policy.server(split[0]) if split else None
            if split is None or sp is None or not tp.TOOL_NAME_RE.fullmatch(split[1]) or "*" in split[1] or "?" in split[1]:
                refused.append(f"tool {item[:100]!r}: not a tool of a declared server (SERVER__TOOL, no globs)")
                continue
            if tp.visible(sp, split[1]):
                continue  # already callable (with its constraints, perhaps with an approval: both stay)
            grant = {"action": tp.GRANT, "server": sp.name, "tool": split[1]}
            after = tp.apply_live(self.policy, [grant], grants=True).server(sp.name)
            if tp._match(sp.deny, split[1]) is not None or after is None or not tp.visible(after, split[1]):
                refused.append(f"tool {item[:100]!r}: denied by the operator (a deny rule is not grantable)")
                continue
            tool_items.append(grant)
        return egress_items, tool_items, refused

    async def _request_access(self, args: dict, ad: str) -> types.CallToolResult:
        """The agent asks for more access: the request is computed as a delta against the policy
        in force (what it would add), queued for a human, and applied to this sandbox's running
        gate endpoint and gateway only once a human approves it - never otherwise. A request
        whose delta adds nothing is answered at once (nothing to approve)."""
        why = args.get("reason")
        what = args.get("access", "")
        if not isinstance(why, str) or not why.strip() or not isinstance(what, str):
            raise self._deny("tools:bad-arguments", "request_access needs a 'reason' (and 'egress', 'tools' or "
                             "'access')", tp.REQUEST_ACCESS, args_digest=ad)
        if len(what) + len(why) > MAX_REQUEST_ACCESS:
            raise self._deny("tools:arguments-too-large", "request_access text is too long", tp.REQUEST_ACCESS,
                             args_digest=ad)
        try:
            egress_items, tool_items, refused = self._access_delta(args)
        except ValueError as exc:
            raise self._deny("tools:bad-arguments", f"request_access: {str(exc)[:300]}", tp.REQUEST_ACCESS,
                             args_digest=ad) from None
        delta = [f"adds egress to {h}:{','.join(map(str, ports))}" for h, ports in egress_items]
        delta += [f"adds tool {t['server']}{tp.SEP}{t['tool']}" for t in tool_items]

        def result(text: str, error: bool) -> types.CallToolResult:
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=error)

        if not delta and not what.strip():
            msg = "nothing to approve: " + ("; ".join(refused) if refused else "everything asked for is already allowed")
            self._log(verdict="allow" if not refused else "deny", rule="tools:access-no-delta", reason=msg[:300],
                      target=tp.REQUEST_ACCESS, args_digest=ad)
            return result(msg, bool(refused))
        who: list = []
        answer = await self._hold("access", tp.REQUEST_ACCESS, {
            "preview": preview({"delta": delta, "reason": why}, 600), "delta": delta, "refused": refused,
            "access": what[:1000], "reason": why[:2000]}, ad, who)
        if answer is not None:
            return result(f"not granted: {answer[1]}", True)
        applied = self._apply_access(egress_items, tool_items, who[0] if who else "approvals")
        text = ("granted for this session: " + "; ".join(applied)) if applied else \
            "approved: an operator agreed; nothing could be applied automatically (ask them to change the policy)"
        if refused:
            text += " (not grantable: " + "; ".join(refused) + ")"
        return result(text, False)

    def _apply_access(self, egress_items: list, tool_items: list, approver: str) -> list[str]:
        """A human approved: the delta is applied to the running gate endpoint and gateway (for
        this session; the agent file and the daemon's stored policy do not change)."""
        from dataclasses import replace

        from agentvm.gate.policy import Rule

        ep = self.endpoint
        if ep is None:
            egress_items = []
        done = [f"egress to {h}:{','.join(map(str, p))}" for h, p in egress_items]
        done += [f"tool {t['server']}{tp.SEP}{t['tool']}" for t in tool_items]
        if not done:
            return done
        # on the chain first: a grant that cannot be recorded is not made
        if self.approvals is None:
            raise self._deny("approval:unavailable", "the grant cannot be recorded: not applied", tp.REQUEST_ACCESS)
        try:
            self.approvals.record("policy.change", actor=approver, sandbox=self.sandbox_id, op="request_access",
                                  detail=done, applied_live=True)
        except Exception as exc:  # noqa: BLE001
            raise self._deny("approval:unavailable", f"the grant could not be recorded ({type(exc).__name__}): not "
                             "applied", tp.REQUEST_ACCESS) from None
        if egress_items:
            n = len(ep.policy.allow)
            rules = tuple(Rule(id=f"granted[{n + i}]", host=h, ports=ports) for i, (h, ports) in enumerate(egress_items))
            ep.set_policy(replace(ep.policy, allow=ep.policy.allow + rules))
        if tool_items:
            self.set_policy(tp.apply_live(self.policy, tool_items, grants=True), self.policy_digest + "+access")
        return done

    # ------------------------------------------------------------------ resources and prompts
    async def _gather(self, wants, fetch) -> list:
        """(server policy, its upstream, its items) of every server ``wants`` something of; a
        server that fails or is slow is left out (its items are absent, the others listed)."""
        out = []
        for name, u in self.upstreams.items():
            sp = self.policy.server(name)
            if sp is None or not wants(sp):
                continue
            try:
                c = await u.get()
                async with asyncio.timeout(sp.timeout):
                    out.append((sp, await fetch(c)))
            except Exception:  # noqa: BLE001
                continue
        return out

    async def _list_resources(self, ctx, params) -> types.ListResourcesResult:
        got = await self._gather(lambda sp: sp.resources, lambda c: c.list_resources())
        return types.ListResourcesResult(resources=[r for sp, res in got for r in res.resources[:MAX_TOOLS]
                                                    if tp.resource_allowed(sp, str(r.uri))])

    async def _read_resource(self, ctx, params) -> types.ReadResourceResult:
        uri = str(params.uri)
        for name, u in self.upstreams.items():
            sp = self.policy.server(name)
            if sp is not None and tp.resource_allowed(sp, uri):
                if not u.bucket.take():  # reads count against the server's rate, as calls do
                    raise self._deny("tools:rate", f"more than {sp.calls_per_minute} requests a minute to {name}",
                                     uri[:200], LIMITED)
                c = None
                try:
                    c = await u.get()
                    async with asyncio.timeout(sp.timeout):
                        res = await c.read_resource(uri)
                except ToolFailure as f:
                    raise self._deny(f.rule_id, f.reason, uri[:200], f.code) from None
                except TimeoutError:
                    raise self._deny("tools:server-timeout", f"{name} did not answer in time", uri[:200],
                                     SERVER_FAILED) from None
                except (Busy, Flooded) as exc:
                    raise self._server_limit(u, c, exc, uri[:200]) from None
                size = len(res.model_dump_json(by_alias=True, exclude_none=True).encode())
                if size > sp.max_result:
                    raise self._deny("tools:result-too-large", f"resource of {size} bytes, over {sp.max_result}",
                                     uri[:200], LIMITED)
                self._log(verdict="allow", rule=f"tools:resource:{name}", reason="resource allowed", target=uri[:200])
                return res
        raise self._deny("tools:resource-not-allowed", "no server's resources rule names this resource", uri[:200])

    async def _list_prompts(self, ctx, params) -> types.ListPromptsResult:
        got = await self._gather(lambda sp: sp.prompts, lambda c: c.list_prompts())
        return types.ListPromptsResult(prompts=[p.model_copy(update={"name": f"{sp.name}{tp.SEP}{p.name}"})
                                                for sp, res in got for p in res.prompts[:MAX_TOOLS]
                                                if tp.prompt_allowed(sp, p.name)])

    async def _get_prompt(self, ctx, params) -> types.GetPromptResult:
        split = tp.split_name(params.name) if tp.valid_exposed(params.name) else None
        sp = self.policy.server(split[0]) if split else None
        if split is None or sp is None or not tp.prompt_allowed(sp, split[1]):
            raise self._deny("tools:prompt-not-allowed", "no server's prompts rule names this prompt",
                             str(params.name)[:200])
        target = str(params.name)[:200]
        args = params.arguments or {}
        size = len(json.dumps(args, default=str).encode())
        if size > sp.max_arguments:
            raise self._deny("tools:arguments-too-large", f"prompt arguments of {size} bytes, over {sp.max_arguments}",
                             target, LIMITED)
        split = (sp.name, split[1])  # the server as declared (names are compared in normal form)
        u = self.upstreams[split[0]]
        if not u.bucket.take():
            raise self._deny("tools:rate", f"more than {sp.calls_per_minute} requests a minute to {split[0]}", target,
                             LIMITED)
        c = None
        try:
            c = await u.get()
            async with asyncio.timeout(sp.timeout):
                res = await c.get_prompt(split[1], params.arguments)
        except ToolFailure as f:
            raise self._deny(f.rule_id, f.reason, target, f.code) from None
        except TimeoutError:
            raise self._deny("tools:server-timeout", f"{split[0]} did not answer in time", target,
                             SERVER_FAILED) from None
        except (Busy, Flooded) as exc:
            raise self._server_limit(u, c, exc, target) from None
        out = len(res.model_dump_json(by_alias=True, exclude_none=True).encode())
        if out > sp.max_result:
            raise self._deny("tools:result-too-large", f"prompt of {out} bytes, over {sp.max_result}", target, LIMITED)
        self._log(verdict="allow", rule=f"tools:prompt:{split[0]}", reason="prompt allowed", target=target)
        return res


def _plain_data(data):
    """An MCP error's data as plain JSON data (what crosses to the worker), or None."""
    if data is None:
        return None
    try:
        return json.loads(json.dumps(data, default=str))
    except (TypeError, ValueError):
        return None
