"""The egress gate: one asyncio server, one unix-socket listener per sandbox.

This is the module of the gate that owns sockets, and all it does is move bytes: what
happens to a request, and in which order, is the sans-IO exchange core (``exchange``); this
module carries out its commands (answer a denial, look a name up, connect, relay) and feeds
it what arrived. The rest of the gate, by job:

* ``endpoint`` - one sandbox's listener state: policy, limits, upstream pool, decision log;
* ``exchange`` - decide -> credentials -> resolve -> connect, as flows of commands (pure);
* ``relay`` - one forwarded HTTP/1.1 request: body checks, re-signing, response scrubbing;
* ``tunnel`` - opaque relays: spliced CONNECT tunnels (``splice(2)``), upgraded WebSockets;
* ``streams`` - plain and gate-terminated TLS byte streams;
* ``h1`` / ``tls`` / ``policy`` / ``credentials`` - parsing, policy and credentials (pure);
* ``embedded`` - the gate in a thread of ``agentvm run`` (no daemon).

A sandbox's identity is the listener its connection arrived on - never a header. Every
decision is one JSON line in the sandbox's log (``endpoint``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import ssl
from time import monotonic
from pathlib import Path

from agentvm.gate import exchange as ex
from agentvm.gate import h1
from agentvm.gate.endpoint import Cut, Endpoint
from agentvm.gate.framing import RequestBody
from agentvm.gate.h1 import HeadReader
from agentvm.gate.policy import EgressPolicy
from agentvm.gate.relay import UPSTREAM_IDLE_TIMEOUT, Relay, Stale, UpstreamError
from agentvm.gate.streams import HELLO_TIMEOUT, PlainStream, TLSStream, client_left
from agentvm.gate.tunnel import _detach, stream_splice, zero_copy_splice

log = logging.getLogger("agentvm.gate")

HEAD_TIMEOUT = 30.0  # seconds a connection has for a whole request head (and a keep-alive one between requests)
HEAD_SWEEP = 1.0  # how often connections waiting for a head are checked against HEAD_TIMEOUT
STREAM_LIMIT = 1 << 20  # a sandbox's connection (and a tunnel's upstream): unread bytes before reading pauses
STREAM_DEFAULT = 1 << 16  # an upstream connection of the relay
CONNECT_TIMEOUT = 10.0
IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"))  # RFC 9110 9.2.2

# The bridge's hand-off (a bwrap sandbox's bridge, ``agentvm-helper init --bridge-key-fd``):
# instead of relaying every byte of every connection between the sandbox's TCP port and this
# socket, the bridge opens a channel to its endpoint - HANDOFF_PREFIX, the bridge's key, CRLF
# CRLF; answered HANDOFF_ACK - and sends each connection it accepts over it (one HANDOFF_CONN
# byte with the descriptor, SCM_RIGHTS), keeping no copy. The gate serves that TCP socket as it
# would the bridge's connection: the sandbox is still the endpoint the channel arrived on. The
# key (``Endpoint.bridge_key``, made per sandbox at launch, given to the bridge through a
# descriptor init closes before the agent runs) is what keeps the channel the bridge's: the
# agent can reach this socket too, and a socket the agent made itself would stay its own kernel
# object - one it kept a copy of could be made blocking again, one with SO_LINGER set would
# stall the loop's close() - so a hello without the key is refused, alerted, and no descriptor
# is ever read from such a connection. The hello is a head no request can be (a NUL byte), so it
# is recognised only where the strict parser has already refused a head: no cost to a request.
HANDOFF_PREFIX = b"\x00agentvm-bridge-handoff/2 "
HANDOFF_ACK = b"\x06"
HANDOFF_CONN = b"C"
HANDOFF_BATCH = 64  # connections taken per wake-up of a channel (then the loop's other work)
HANDOFF_CHANNELS = 2  # channels an endpoint keeps at once (the bridge's, and its next after a failure)


def _connected_tcp(fd: int) -> socket.socket | None:
    """``fd`` as a socket when it is a connected TCP socket (the bridge's accepted connection),
    else None (``fd`` closed)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        os.close(fd)
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM \
                or sock.proto not in (0, socket.IPPROTO_TCP):
            raise OSError("not a TCP socket")
        sock.getpeername()  # (a listening or unconnected socket: ENOTCONN)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        sock.close()
        return None
    return sock


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop the gate runs on: uvloop (libuv; a declared dependency, about a third less CPU
    per proxied request than the stdlib loop here), else asyncio's own."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; a broken install still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main) -> None:
    """``asyncio.run(main)`` on the gate's loop (the daemon's loop is the gate's)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main)


class Gate:
    """The gate: owns the CA, the upstream TLS contexts and every sandbox endpoint."""

    # a spliced tunnel moves bytes socket to socket (splice(2)) where the client's socket carries
    # them as they are; a subclass whose client sockets carry TLS (the mTLS gateway) turns it off
    zero_copy = True
    # a bridge may hand its sandbox's connections over (HANDOFF_PREFIX); a subclass whose
    # clients are not a local sandbox's bridge (the mTLS gateway) refuses it
    handoff = True

    def __init__(self, state_dir: Path, log_dir: Path):
        self.state_dir = Path(state_dir)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.endpoints: dict[str, Endpoint] = {}
        self._ca = None
        self._server_ctx = None
        self._client_ctx: dict[tuple[str | None, bool], ssl.SSLContext] = {}
        self.subscribers: list = []
        # held requests (action: ask, tool approvals): a factory of the approvals queue, set
        # by the host (daemon, embedded run); opened on first use
        self.approvals_factory = None
        self.telemetry = None  # gate.telemetry.TelemetryRelay when the daemon exports traces
        self._approvals = None
        # connections waiting for a request head: task -> when it began waiting. One timer
        # sweeps them (HEAD_SWEEP) instead of a timeout armed and cancelled around every read
        # (that was ~10 us of the gate's CPU per request, measured); a task past HEAD_TIMEOUT
        # is cancelled and noted in _head_expired, and its connection closed quietly
        self._head_waits: dict[asyncio.Task, float] = {}
        self._head_expired: set[asyncio.Task] = set()
        # upstream connections a relay is waiting to read from: stream -> since when. The same
        # sweep interrupts a read idle past UPSTREAM_IDLE_TIMEOUT (the relay answers 504)
        self._upstream_waits: dict[PlainStream, float] = {}
        self._head_sweep: asyncio.TimerHandle | None = None
        self._closing: set[Endpoint] = set()  # endpoints being closed (their logs still open)
        self._head_sweep_loop: asyncio.AbstractEventLoop | None = None
        self._handoffs: dict[socket.socket, Endpoint] = {}  # bridges' hand-off channels -> their endpoint
        self._adopting: set[asyncio.Task] = set()  # connections handed over, being wrapped in a transport

    def approval_store(self):
        """The approvals queue, or None (nobody to ask: a held request is denied)."""
        if self._approvals is None and self.approvals_factory is not None:
            try:
                self._approvals = self.approvals_factory()
            except Exception:  # noqa: BLE001 - no queue: held requests are denied
                return None
        return self._approvals

    # -- CA and TLS contexts (lazy: a run without TLS interception never loads cryptography)
    @property
    def ca(self):
        if self._ca is None:
            from agentvm.gate.ca import CertificateAuthority

            self._ca = CertificateAuthority.load_or_create(self.state_dir / "ca")
        return self._ca

    def server_ctx(self) -> ssl.SSLContext:
        if self._server_ctx is None:
            from agentvm.gate.tls import server_context

            self._server_ctx = server_context(self.ca)
        return self._server_ctx

    def client_ctx(self, extra_ca: str | None, *, h2: bool = False) -> ssl.SSLContext:
        key = (extra_ca, h2)
        if key not in self._client_ctx:
            from agentvm.gate.tls import ALPN_H2, ALPN_HTTP1, client_context

            self._client_ctx[key] = client_context(extra_ca, alpn=(ALPN_H2, ALPN_HTTP1) if h2 else (ALPN_HTTP1,))
        return self._client_ctx[key]

    def emit(self, rec: dict) -> None:
        for cb in list(self.subscribers):
            try:
                cb(rec)
            except Exception:
                pass

    # -- endpoints ------------------------------------------------------------------------
    async def open_endpoint(self, sandbox_id: str, agent: str, policy: EgressPolicy, sock_path: Path, *, uid: int | None = None,
                            creds=None, sock=None, extras=None, bridge_key: str = "") -> Endpoint:
        """Serve ``sandbox_id``'s socket: bound here, or ``sock`` - already bound, owned and
        listening (``agentvm.gate.embedded`` binds it before the sandbox starts, so connections
        wait in its backlog while the gate comes up)."""
        sock_path = Path(sock_path)
        ep = Endpoint(self, sandbox_id, agent, policy, sock_path, self.log_dir / f"{sandbox_id}.egress.jsonl")
        ep.creds = creds
        ep.bridge_key = bridge_key
        if extras is not None:  # the sandbox policy's tools and approvals (agentvm.tools.slot.EndpointExtras)
            extras.attach(ep)
        bound = sock is None
        if bound:  # only the sandbox's uid (and root) may connect
            from agentvm.fsutil import bind_unix_listener

            sock = bind_unix_listener(sock_path, uid, 100)
        try:
            ep.server = await asyncio.get_running_loop().create_unix_server(self._accepting(ep), sock=sock)
        except BaseException:
            if bound:
                sock.close()
            raise
        self.endpoints[sandbox_id] = ep
        ep.prepare_credentials()  # (brokered credentials minted off the loop; first requests wait for it)
        return ep

    async def close_endpoint(self, sandbox_id: str, *, unlink: bool = True) -> Endpoint | None:
        """Stop serving ``sandbox_id``; its socket's path is removed unless ``unlink`` is false
        (a gate worker: the daemon owns the path, agentvm.gate.workers)."""
        ep = self.endpoints.pop(sandbox_id, None)
        if ep is None:
            return None
        self._closing.add(ep)
        try:
            return await self._close(ep, unlink)
        finally:
            self._closing.discard(ep)

    async def _close(self, ep: Endpoint, unlink: bool) -> Endpoint:
        ep.closing = True  # (a connection accepted now is closed at once: _handle)
        if ep.server is not None:
            ep.server.close()
        for chan, owner in list(self._handoffs.items()):  # no more connections handed over
            if owner is ep:
                self._drop_handoff(chan)
        # the connections still open are closed: nothing is served, unlogged, by an endpoint
        # that is gone (a sandbox still running when its endpoint is closed: a gate worker
        # stopping, an endpoint opened again). Those of a sandbox that has gone end on their own
        # (their end is a loop turn away: no record); of the rest, one between requests closes
        # quietly (as an idle one), one with a request or a tunnel under way is cut, its record
        # written before the log closes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2
        if ep.conns:
            await asyncio.wait(list(ep.conns), timeout=0.1)
        closed: set = set()
        while ep.conns and loop.time() < deadline:
            for t in list(ep.conns):
                if t in closed:
                    continue
                closed.add(t)
                if t in self._head_waits:
                    self._head_expired.add(t)
                    t.cancel()
                else:
                    ep._cut(t, "endpoint:closed", "the sandbox's gate endpoint was closed: connection cut")
            if ep.conns:
                await asyncio.wait(list(ep.conns), timeout=max(0.0, deadline - loop.time()))
        if ep.server is not None:
            try:
                await asyncio.wait_for(ep.server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass
        if unlink:
            try:
                ep.sock_path.unlink()
            except FileNotFoundError:
                pass
        ep.pool_close()
        if ep.tools is not None:
            await ep.tools.close()
        await ep.close_credentials()  # (minted tokens revoked at session end)
        ep.close_log()
        return ep

    # -- per connection -------------------------------------------------------------------
    def _accepting(self, ep: Endpoint):
        """The protocol factory of ``ep``'s listener: each connection a PlainStream, served by
        its own task (:meth:`_handle`)."""
        loop = asyncio.get_running_loop()

        def start(stream: PlainStream) -> asyncio.Task:
            return loop.create_task(self._handle(ep, stream))

        return lambda: PlainStream(STREAM_LIMIT, on_connect=start)

    async def _handle(self, ep: Endpoint, client: PlainStream) -> None:
        if ep.closing:  # accepted as the endpoint closed: nothing is served
            client.close()
            return
        if ep.active >= ep.policy.limits.connections:
            ep.log(verdict="deny", rule_id="limit:connections", reason="too many concurrent connections",
                   host="", port=None, phase="connect")
            try:
                await client.write(h1.deny_response("limit:connections", "too many concurrent connections", host="", port=0, status=429))
            except Exception:
                pass
            client.close()
            return
        ep.active += 1
        task = asyncio.current_task()
        ep.conns.add(task)
        try:
            if ep.creds_ready is not None:
                await ep.credentials_ready()
            await self._requests(ep, client, b"", scheme="http", tunnel=None)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            if task not in ep.cut:
                if task in self._head_expired:
                    return  # no whole request head within HEAD_TIMEOUT: closed (finally), as before
                raise  # the gate is shutting down
            rule, reason = ep.cut[task]
            ep.log(verdict="deny", rule_id=rule, reason=reason, host="", port=None, phase="cut")
        except Cut as cut:
            ep.log(verdict="deny", rule_id=cut.rule_id, reason=f"limit reached: connection cut ({ep.bytes_out} bytes out)",
                   host=cut.host, port=cut.port, phase="stream")
        except Exception as exc:  # never let one connection take the gate down
            log.exception("internal error on a connection of sandbox %s", ep.sandbox_id)  # a gate bug: the traceback
            ep.log(verdict="deny", rule_id="internal-error", reason=f"{type(exc).__name__}", host="", port=None, phase="internal")
        finally:
            ep.active -= 1
            ep.conns.discard(task)
            ep.cut.pop(task, None)
            self._head_expired.discard(task)
            client.close()

    # -- the bridge's hand-off (see HANDOFF_PREFIX) ------------------------------------------
    def _hello(self, ep: Endpoint, stream: PlainStream, head: bytes, rest: bytes) -> None:
        """A hand-off hello: with the endpoint's bridge key (and nothing after it) the connection
        becomes a channel, taken out of asyncio, acknowledged and read for descriptors from now
        on (its task ends here); otherwise it is refused - an alert: only the agent sends one
        without the key - and closed, nothing read from it again."""
        key = head[len(HANDOFF_PREFIX):-4]
        why = None
        if not self.handoff or not ep.bridge_key:
            why = "this endpoint takes no hand-off (no bridge key: gVisor's bridge relays)"
        elif not hmac.compare_digest(key, ep.bridge_key.encode()):
            why = "a hand-off hello without the bridge's key (only the sandbox's bridge holds it)"
        elif rest:
            why = "bytes after the hand-off hello, before its acknowledgement"
        elif sum(1 for owner in self._handoffs.values() if owner is ep) >= HANDOFF_CHANNELS:
            why = f"more than {HANDOFF_CHANNELS} hand-off channels at once"
        if why is not None:
            ep.log(verdict="deny", rule_id="handoff:refused", reason=why, host="", port=None, phase="connect",
                   alert="security")
            stream.close()
            return
        fd, buffered = _detach(stream)
        chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
        if buffered or ep.closing:  # (a bridge waits for the acknowledgement before it sends)
            chan.close()
            return
        try:
            chan.send(HANDOFF_ACK)
        except OSError:
            chan.close()
            return
        loop = asyncio.get_running_loop()
        self._handoffs[chan] = ep
        loop.add_reader(fd, self._handed, ep, chan, loop)

    def _drop_handoff(self, chan: socket.socket) -> None:
        if self._handoffs.pop(chan, None) is not None:
            try:
                asyncio.get_running_loop().remove_reader(chan.fileno())
            except (RuntimeError, ValueError, OSError):
                pass
        chan.close()

    def _handed(self, ep: Endpoint, chan: socket.socket, loop) -> None:
        """Connections arrived on a hand-off channel (the bridge's: it proved its key): each
        served as if accepted on ``ep``'s listener. Anything but one HANDOFF_CONN byte with one
        connected TCP socket ends the channel (the descriptors that came with it closed) and is
        logged."""
        for _ in range(HANDOFF_BATCH):
            try:
                msg, fds, flags, _ = socket.recv_fds(chan, 1, 1, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds, flags = b"", [], 0
            sock = None
            if msg == HANDOFF_CONN and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
                sock = _connected_tcp(fds[0])
            else:
                for fd in fds:
                    os.close(fd)
            if sock is None:
                if msg:  # (no message: the bridge went away, as it does with its sandbox)
                    ep.log(verdict="deny", rule_id="handoff:refused", reason="a hand-off message that is not one connected "
                           "TCP socket: the channel is closed", host="", port=None, phase="connect")
                self._drop_handoff(chan)
                return
            task = loop.create_task(self._adopt(ep, sock))
            self._adopting.add(task)  # (held until it has run: the loop keeps only a weak reference)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, ep: Endpoint, sock: socket.socket) -> None:
        if ep.closing:
            sock.close()
            return
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._accepting(ep), sock)
        except Exception:  # noqa: BLE001 - the connection is lost, as one the listener could not accept
            sock.close()

    def _head_wait(self, task: asyncio.Task) -> None:
        """``task`` waits for a request head from now on (see HEAD_TIMEOUT, _sweep_heads)."""
        self._head_waits[task] = monotonic()
        # (a Gate may serve on a later loop: armed on the one running. The task's loop is that
        # loop, and asking it costs no system call - get_running_loop() makes a getpid())
        if self._head_sweep is None or self._head_sweep_loop is not task.get_loop():
            self._arm_head_sweep()

    def _arm_head_sweep(self) -> None:
        self._head_sweep_loop = loop = asyncio.get_running_loop()
        self._head_sweep = loop.call_later(min(HEAD_SWEEP, HEAD_TIMEOUT / 4), self._sweep_heads)

    def watch_read(self, upstream: PlainStream) -> None:
        """A relay starts waiting for ``upstream``'s next bytes (see UPSTREAM_IDLE_TIMEOUT)."""
        self._upstream_waits[upstream] = monotonic()
        if self._head_sweep is None or self._head_sweep_loop is not upstream._loop:  # (see _head_wait)
            self._arm_head_sweep()

    def unwatch_read(self, upstream: PlainStream) -> None:
        self._upstream_waits.pop(upstream, None)

    def _sweep_heads(self) -> None:
        """Cancel the connections that have waited HEAD_TIMEOUT for a head, interrupt the reads
        of upstreams silent for UPSTREAM_IDLE_TIMEOUT; re-armed while any wait."""
        self._head_sweep = None
        now = monotonic()
        late = now - HEAD_TIMEOUT
        for task, since in list(self._head_waits.items()):
            if since <= late:
                del self._head_waits[task]
                self._head_expired.add(task)
                task.cancel()
        late = now - UPSTREAM_IDLE_TIMEOUT
        for up, since in list(self._upstream_waits.items()):
            if since <= late and up.waiting:  # (bytes that just arrived are not a silence)
                del self._upstream_waits[up]
                up.interrupt("upstream-timeout")
        if self._head_waits or self._upstream_waits:
            self._arm_head_sweep()

    # -- carrying out the exchange core's commands -----------------------------------------
    async def _run(self, ep: Endpoint, client, flow: ex.Flow, event=None, *, started: bool = False):
        """Drive ``flow`` until it yields a command this module must act on with bytes
        (Forward, Accept, OpenTunnel) and return that command; ``None`` once the flow denied
        (logged and answered here) or ended. ``event`` answers the command the flow is waiting on."""
        try:
            cmd = flow.send(event) if started else next(flow)
            while True:
                if isinstance(cmd, ex.Deny):
                    ep.log(**cmd.log_fields())
                    if cmd.respond:
                        await client.write(cmd.as_http1())
                    flow.close()
                    return None
                if isinstance(cmd, ex.Hold):
                    # held while its requester is there: a cut connection expires the request
                    cmd = flow.send(await ep.hold(cmd, gone=lambda: client_left(client)))
                    continue
                if isinstance(cmd, ex.Admit):  # an LLM budget kept by the daemon (a gate worker's)
                    cmd = flow.send(await cmd.budget.admit_async())
                    continue
                if isinstance(cmd, ex.Lookup):
                    try:
                        infos = await asyncio.get_running_loop().getaddrinfo(cmd.name, cmd.port, type=socket.SOCK_STREAM)
                        answer = ex.Resolved(tuple(i[4][0] for i in infos))
                    except socket.gaierror as exc:
                        answer = ex.LookupFailed(str(exc.strerror))
                    cmd = flow.send(answer)
                    continue
                return cmd
        except StopIteration:
            return None

    async def _requests(self, ep: Endpoint, stream, pending: bytes, *, scheme: str, tunnel: ex.Tunnel | None) -> None:
        """One request after another on ``stream``: on a proxy connection (``tunnel`` None:
        absolute-form http://, kept alive, or CONNECT) or inside a CONNECT tunnel (each decided
        on its own: L7 rules apply). Each request head must be whole within HEAD_TIMEOUT: a slow
        sender (slowloris) or an idle keep-alive connection is cut."""
        where = (tunnel.host, tunnel.port) if tunnel is not None else ("", None)
        task = asyncio.current_task()
        waits = self._head_waits
        while True:
            try:
                # the next request head (the read is inline: this loop runs once per request)
                hr = HeadReader()
                if not (pending and hr.feed(pending)):
                    self._head_wait(task)
                    try:
                        while True:
                            data = await stream.read()
                            if not data:
                                return  # a clean EOF between requests
                            if hr.feed(data):
                                break
                    finally:
                        waits.pop(task, None)
                req, body = h1.parse_head(hr.head, hr.rest)
                pending = hr.rest
            except h1.ProtocolError as exc:
                if tunnel is None and hr.head is not None and hr.head.startswith(HANDOFF_PREFIX):
                    self._hello(ep, stream, hr.head, hr.rest)  # (a bridge: see HANDOFF_PREFIX)
                    return
                await self._run(ep, stream, ex.refuse(ex.bad_request(exc, *where)))
                return
            if tunnel is None and req.scheme == "connect":
                await self._connect(ep, stream, req, pending)
                return
            fwd = await self._run(ep, stream, ex.request(ep, req, scheme=scheme, tunnel=tunnel))
            if fwd is None:
                return
            if isinstance(fwd, ex.ToTools):
                from agentvm.gate.asgi import serve_one

                keep, pending = await serve_one(ep, stream, body, fwd.req)
                if not keep:
                    return
                continue
            if isinstance(fwd, ex.ToTelemetry):
                keep, pending = await self.telemetry.relay(ep, stream, body, fwd.req, fwd.signal)
                if not keep:
                    return
                continue
            keep, pending = await self._forward(ep, stream, body, fwd)
            if not keep:
                return

    # -- a forwarded request ----------------------------------------------------------------
    async def _forward(self, ep: Endpoint, client, body: RequestBody, fwd: ex.Forward) -> tuple[bool, bytes]:
        """Connect (or take a pooled connection) to the address the core checked and relay one
        request; returns (keep the client connection, leftover bytes)."""
        relay = None  # the last relay: it counted the metered response, if one was counted
        try:
            req = fwd.req
            shown = fwd.logged.path  # logged: the agent's target, never a swapped query-string value
            if client_left(client):
                # the client gave up (its timeout passed while the gate was stopped or slow): what it
                # sent is not forwarded late, unseen - a replayed POST is a real harm
                ep.log(verdict="deny", rule_id="client-gone", reason="the client closed the connection before the request "
                       "was forwarded", host=req.host, port=req.port, method=req.method, path=shown, phase="request")
                return False, b""
            key = _pool_key(ep, fwd.scheme, fwd.addr, req.port, fwd.sni)
            # a pooled connection that fails before the answer may have delivered the request:
            # only an idempotent request without a body (RFC 9110 9.2.2) is sent again, fresh
            retry_ok = (req.method in IDEMPOTENT and not req.upgrade_websocket and not req.chunked
                        and not req.content_length)
            for attempt in (0, 1):
                pooled = ep.pool_get(key, retry_ok=retry_ok) if (attempt == 0 and not req.upgrade_websocket) else None
                if pooled is not None:
                    upstream = pooled
                else:
                    try:
                        upstream = await self._dial(ep, fwd.addr, req.port, fwd.sni)  # sni: https only
                    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                        ep.log(verdict="allow", rule_id=fwd.decision.rule_id,
                               reason=f"upstream unreachable: {type(exc).__name__}", host=req.host, port=req.port,
                               method=req.method, path=shown, phase="upstream", error="upstream:unreachable")
                        await client.write(h1.error_response(502, "upstream:unreachable", f"cannot reach {req.host}:{req.port}"))
                        return False, b""
                relay = Relay(ep, client, body, upstream, fwd, pooled=pooled is not None and retry_ok,
                              splice=stream_splice)
                try:
                    keep, leftover, reusable = await relay.run()
                except Stale:
                    upstream.close()
                    continue  # the pooled connection had been closed by the upstream: once more, fresh
                except UpstreamError as exc:
                    upstream.close()
                    ep.log(verdict="allow", rule_id=fwd.decision.rule_id, reason=exc.reason, host=req.host, port=req.port,
                           method=req.method, path=shown, phase="upstream", error=exc.rule_id)
                    if not exc.answered:
                        await client.write(h1.error_response(exc.status, exc.rule_id, exc.reason))
                    return False, b""
                except BaseException:
                    upstream.close()
                    raise
                if reusable:
                    ep.pool_put(key, upstream)
                else:
                    upstream.close()
                return keep, leftover
            return False, b""
        finally:
            if fwd.budget is not None and not (relay is not None and relay.llm_counted):
                fwd.budget.release()  # never answered: its LLM budget reservation ends uncounted

    # -- CONNECT ----------------------------------------------------------------------------
    async def _connect(self, ep: Endpoint, client: PlainStream, req: h1.ProxyRequest, pending: bytes) -> None:
        flow = ex.connect(ep, req)
        cmd = await self._run(ep, client, flow)
        if not isinstance(cmd, ex.Accept):
            return
        await client.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        # peek the first bytes: a ClientHello whose SNI must be the CONNECT host, or plain HTTP
        from agentvm.gate.tls import TLSParseError, parse_client_hello

        buf = pending
        alpn: tuple[str, ...] = ()
        # HELLO_TIMEOUT for the whole ClientHello (not per read: a client trickling it a byte at
        # a time must not hold the connection for HELLO_TIMEOUT per byte)
        deadline = asyncio.get_running_loop().time() + HELLO_TIMEOUT
        try:
            while True:
                if buf[:1] == b"S" and _SSH_ID.startswith(buf[:len(_SSH_ID)]):
                    if len(buf) < len(_SSH_ID):  # (maybe an SSH identification string: read on)
                        data = await _read_by(client, deadline)
                        if not data:
                            flow.close()
                            return
                        buf += data
                        continue
                    first = ex.SshBanner()
                    break
                if buf[:1] != b"\x16" and buf[:1].isalpha():
                    first = ex.PlainHTTP()
                    break
                hello = parse_client_hello(buf) if buf else None
                if hello is not None:
                    first, alpn = ex.Hello(hello.sni), hello.alpn
                    break
                data = await _read_by(client, deadline)
                if not data:
                    flow.close()
                    return
                buf += data
        except TLSParseError as exc:
            first = ex.NotTLS(str(exc))
        except asyncio.TimeoutError:
            # the tunnel was granted and nothing decidable came: said, not closed in silence
            flow.close()
            ep.log(verdict="deny", rule_id="clienthello-timeout", reason=f"neither a whole TLS ClientHello nor a first "
                   f"byte of plain HTTP within {HELLO_TIMEOUT:g} s of the CONNECT ({len(buf)} bytes came): the tunnel "
                   "is closed",
                   host=req.host, port=req.port, method="CONNECT", phase="clienthello")
            return
        cmd = await self._run(ep, client, flow, first, started=True)
        if not isinstance(cmd, ex.OpenTunnel):
            return
        tunnel = cmd.tunnel
        if cmd.kind == "plain":
            await self._requests(ep, client, buf, scheme="http", tunnel=tunnel)
        elif cmd.kind == "terminate":
            await self._terminate(ep, client, tunnel, buf, alpn)
        else:
            await self._splice(ep, client, cmd, buf)

    async def _splice(self, ep: Endpoint, client: PlainStream, cmd: ex.OpenTunnel, buf: bytes) -> None:
        tunnel = cmd.tunnel
        target = (tunnel.host, tunnel.port)
        try:
            upstream = await self._dial(ep, tunnel.addr, tunnel.port, limit=STREAM_LIMIT)
        except (OSError, asyncio.TimeoutError) as exc:
            ep.log(verdict="allow", rule_id=cmd.decision.rule_id, reason=f"upstream unreachable: {type(exc).__name__}",
                   host=tunnel.host, port=tunnel.port, method="CONNECT", phase="upstream",
                   error="upstream:unreachable")
            return
        ep.count_out(len(buf), *target)
        task = asyncio.current_task()
        try:
            await upstream.write(buf)
            ep.splices[task] = cmd.meta
            if hasattr(os, "splice") and self.zero_copy:
                out, inn = await zero_copy_splice(ep, client, upstream, target)
            else:  # pragma: no cover - Linux < 2.6.17 / Python < 3.10
                out, inn = await stream_splice(ep, client, upstream, target)
        finally:
            ep.splices.pop(task, None)
            upstream.close()
        ep.log(verdict="allow", rule_id=cmd.decision.rule_id,
               reason=("ssh tunnel (opaque; signatures decided by the gate's ssh-agent)" if cmd.kind == "ssh"
                       else "tunnel (SNI checked, not terminated)"),
               host=tunnel.host, port=tunnel.port, method="CONNECT", phase="ssh" if cmd.kind == "ssh" else "tunnel",
               bytes_out=out + len(buf), bytes_in=inn, sni=tunnel.sni)

    async def _terminate(self, ep: Endpoint, client: PlainStream, tunnel: ex.Tunnel, hello_bytes: bytes,
                         alpn: tuple[str, ...] = ()) -> None:
        from agentvm.gate.tls import ALPN_H2, ALPN_HTTP1, TLSServerSide

        # HTTP/2 is offered to the sandbox only where the upstream speaks it: when the sandbox
        # offers h2, the gate first opens the upstream connection (to the address checked at
        # CONNECT) and lets the upstream choose; an HTTP/1.1 answer goes to the pool
        h2_up = None
        budget = ep.budget
        # an LLM API under a budget is metered on HTTP/1.1 (the usage is read from each response)
        if ALPN_H2 in alpn and not (budget is not None and budget.covers(tunnel.host)):
            h2_up = await self._open_h2_upstream(ep, tunnel)
        offer = (ALPN_H2, ALPN_HTTP1) if h2_up is not None else (ALPN_HTTP1,)
        tls = TLSStream(client, TLSServerSide(self.server_ctx(), alpn=offer))
        try:
            try:
                await tls.handshake(hello_bytes)
            except (ssl.SSLError, ConnectionError, asyncio.TimeoutError) as exc:
                ep.log(verdict="deny", rule_id="tls-handshake",
                       reason=f"TLS handshake with the sandbox failed: {type(exc).__name__}",
                       host=tunnel.host, port=tunnel.port, method="CONNECT", phase="tls")
                return
            if h2_up is not None and tls.tls.selected_alpn == ALPN_H2:
                from agentvm.gate.h2relay import H2Bridge

                await H2Bridge(ep, tls, h2_up, tunnel).run()
                return
            await self._requests(ep, tls, b"", scheme="https", tunnel=tunnel)
        finally:
            if h2_up is not None:
                h2_up.close()
            tls.close()

    async def _open_h2_upstream(self, ep: Endpoint, tunnel: ex.Tunnel):
        """An upstream connection that chose h2, or None (unreachable - the request that follows
        reports it -, or HTTP/1.1 only: then the connection is pooled for that request)."""
        from agentvm.gate.policy import normalize_host

        try:
            sni = normalize_host(tunnel.host)
            up = await self._dial(ep, tunnel.addr, tunnel.port, sni, h2=True)
        except (OSError, asyncio.TimeoutError, ssl.SSLError, ValueError):
            return None
        ssl_obj = up.get_extra_info("ssl_object")
        if ssl_obj is not None and ssl_obj.selected_alpn_protocol() == "h2":
            return up
        ep.pool_put(_pool_key(ep, "https", tunnel.addr, tunnel.port, sni), up)
        return None

    async def _dial(self, ep: Endpoint, addr: str, port: int, sni: str | None = None, *, h2: bool = False,
                    limit: int | None = None) -> PlainStream:
        """A connection to an address the exchange core checked, within CONNECT_TIMEOUT: TLS
        (verified with the system CAs plus the policy's ``upstreamCa``, SNI ``sni``, ALPN
        ``h2`` too when asked) when ``sni`` is given, else plain."""
        loop = asyncio.get_running_loop()
        size = limit or STREAM_DEFAULT
        made: list[PlainStream] = []

        def protocol() -> PlainStream:
            made.append(PlainStream(size))
            return made[-1]

        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                if sni is None:
                    _, stream = await loop.create_connection(protocol, addr, port)
                else:
                    _, stream = await loop.create_connection(protocol, addr, port,
                                                             ssl=self.client_ctx(ep.policy.upstream_ca, h2=h2),
                                                             server_hostname=sni)
        except BaseException:
            for s in made:  # the deadline passed just as the connection was made: not left open
                s.close()
            raise
        return stream


_SSH_ID = b"SSH-2.0-"  # the start of an SSH client's identification string (RFC 4253 4.2)


async def _read_by(stream, deadline: float) -> bytes:
    async with asyncio.timeout_at(deadline):
        return await stream.read()


def _pool_key(ep: Endpoint, scheme: str, addr: str, port: int, sni: str | None) -> tuple:
    """Idle upstream connections are kept per sandbox and per (scheme, address, port, SNI, CA)."""
    return (scheme, addr, port, sni, ep.policy.upstream_ca)
