"""The egress gate: one asyncio server, one unix-socket listener per sandbox.

This is the only module of the gate that owns sockets. Parsing (``h1``, ``tls``) and policy
(``policy.decide``) are pure; this module moves bytes between them and the network.

A sandbox's identity is the listener its connection arrived on - never a header. Per
connection: read a request head (checked against smuggling), decide, and then

* plain ``http://`` requests: forwarded with h11 to the address the gate resolved and checked;
* ``CONNECT host:port``: decided (403 before any TLS if denied), answered 200, the TLS
  ClientHello is peeked and its SNI must equal the CONNECT host; then either spliced (fast
  path: hosts with only host/port rules) or terminated with the installation's CA so each
  request inside is decided on method/path/body (L7 rules), ``Host`` must match the SNI.

Every decision is one JSON line in the sandbox's log. Limits per sandbox: concurrent
connections, request rate (token bucket) and bytes out (a large upload is cut).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import h11

from agentvm.gate import encoding, h1
from agentvm.gate.policy import EgressPolicy, RequestMeta, _safe, check_address, decide, how_to_allow, normalize_host

READ = 65536
SPLICE_READ = 262144
HEAD_TIMEOUT = 30.0
POOL_IDLE = 8  # idle upstream connections kept per (upstream, sandbox)
STREAM_LIMIT = 1 << 20  # StreamReader buffer before it pauses the transport (bulk tunnels)
CRED_BUFFER = 1 << 20  # request bodies held for a placeholder scan before anything is sent
CONNECT_TIMEOUT = 10.0
HELLO_TIMEOUT = 10.0


class _Cut(Exception):
    """A limit stopped a connection mid-stream; carries where the bytes were going."""

    def __init__(self, rule_id: str, host: str = "", port: int | None = None):
        super().__init__(rule_id)
        self.rule_id, self.host, self.port = rule_id, host, port


class _BodyEnded(Exception):
    """The sandbox stopped sending (or sent something else) in the middle of a request body."""


async def _request_body(client, down: h11.Connection):
    """The chunks of the current request's body from the sandbox, until its end (h11 framing)."""
    while True:
        ev = down.next_event()
        if ev is h11.NEED_DATA:
            data = await client.read()
            if not data:
                raise _BodyEnded()
            down.receive_data(data)
            continue
        if isinstance(ev, h11.Data):
            yield ev.data
            continue
        if isinstance(ev, h11.EndOfMessage):
            return
        raise _BodyEnded()


class _Stale(Exception):
    """A pooled upstream connection turned out closed before answering (safe to retry)."""


# deny records per second (and burst) an endpoint writes one by one; beyond, they are counted
DENY_LOG_RATE = 50.0
DENY_LOG_BURST = 200.0
MAX_DENIAL_KEYS = 1024  # distinct (rule, target) pairs kept in a run's summary
# a SigV4/HMAC request is buffered whole to be re-signed: per request, and per sandbox in total
RESIGN_MAX_BODY = 64 * 1024 * 1024
RESIGN_BUDGET = 96 * 1024 * 1024


@dataclass
class TokenBucket:
    rate: float
    capacity: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.capacity
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class Endpoint:
    """One sandbox's listener, policy, limits and decision log."""

    def __init__(self, gate: "Gate", sandbox_id: str, agent: str, policy: EgressPolicy, sock_path: Path, log_path: Path):
        self.gate = gate
        self.sandbox_id = sandbox_id
        self.agent = agent
        self.policy = policy
        self.sock_path = sock_path
        self.log_path = log_path
        self._log = open(log_path, "a", buffering=1, encoding="utf-8")
        os.chmod(log_path, 0o600)
        self.server: asyncio.AbstractServer | None = None
        self.active = 0
        self.bucket = TokenBucket(policy.limits.requests_per_second, float(policy.limits.burst))
        self.bytes_out = 0
        self.bytes_in = 0
        self.denials: dict[tuple[str, str], int] = {}
        self.denial_reasons: dict[tuple[str, str], tuple[str, str | None]] = {}  # first reason, how to allow
        # deny records are rate-limited (a sandbox must not be able to flood the log, the
        # audit chain and the daemon's loop by hammering the gate); the excess is counted and
        # logged as one summary record, so every decision is still accounted for
        self.deny_log_bucket = TokenBucket(DENY_LOG_RATE, DENY_LOG_BURST)
        self.deny_suppressed = 0
        self.resign_buffered = 0  # bytes of signed request bodies held for re-signing right now
        self.allowed = 0
        self._paused = False
        # live connections, so a pause or a narrowed policy reaches those already open
        self.conns: set[asyncio.Task] = set()
        self.splices: dict[asyncio.Task, RequestMeta] = {}  # opaque tunnels: decided once, at setup
        self.cut: dict[asyncio.Task, tuple[str, str]] = {}  # task -> (rule, reason) it was cut for
        self.creds = None  # CredentialSet of this session (credentials by reference), or None
        self.alerts = 0
        # idle upstream connections: per sandbox, never shared across sandboxes
        self.pool: dict[tuple, list[tuple[PlainStream, h11.Connection]]] = {}

    def pool_get(self, key: tuple):
        idle = self.pool.get(key)
        while idle:
            stream, up = idle.pop()
            if stream.reusable:
                return stream, up
            stream.close()
        return None

    def pool_put(self, key: tuple, stream: "PlainStream", up: h11.Connection) -> None:
        idle = self.pool.setdefault(key, [])
        if len(idle) < POOL_IDLE and stream.reusable:
            idle.append((stream, up))
        else:
            stream.close()

    def pool_close(self) -> None:
        for idle in self.pool.values():
            for stream, _ in idle:
                stream.close()
        self.pool.clear()

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = bool(value)
        if self._paused:  # all egress stops: requests and tunnels already under way included
            for t in list(self.conns):
                self._cut(t, "paused", "egress paused by the operator: connection cut")

    def _cut(self, task: asyncio.Task, rule: str, reason: str) -> None:
        if task not in self.cut and not task.done():
            self.cut[task] = (rule, reason)
            task.cancel()

    def set_policy(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.bucket.rate = policy.limits.requests_per_second
        self.bucket.capacity = float(policy.limits.burst)
        # terminated and plain connections decide every request under the new policy; an
        # opaque tunnel was decided once, so one the new policy denies is cut now
        for t, meta in list(self.splices.items()):
            d = decide(meta, policy)
            if not d.allowed:
                self._cut(t, d.rule_id, f"policy changed: {d.reason}; tunnel cut")

    def log(self, *, verdict: str, rule_id: str, reason: str, host: str, port: int | None, method: str | None = None,
            path: str | None = None, phase: str, bytes_out: int = 0, bytes_in: int = 0, **extra) -> None:
        if path is not None and len(path) > 2048:
            path = path[:2048] + "...(truncated)"
        rec = {
            "time": round(time.time(), 6),
            "sandbox": self.sandbox_id,
            "agent": self.agent,
            "phase": phase,
            "host": host,
            "port": port,
            "method": method,
            "path": path,
            "rule": rule_id,
            "verdict": verdict,
            "reason": reason,
            "bytes_out": bytes_out,
            "bytes_in": bytes_in,
        }
        rec.update(extra)
        if extra.get("alert"):
            self.alerts += 1
        if verdict == "deny":
            # printable ASCII only: the target reaches the operator's terminal in the run summary
            target = f"{_safe(host, 255).lower()}:{port}" if host else "(malformed request)"
            key = (rule_id[:128], target)
            if key not in self.denials and len(self.denials) >= MAX_DENIAL_KEYS:
                key = ("(other)", "(too many distinct denials to list)")
            self.denials[key] = self.denials.get(key, 0) + 1
            if key not in self.denial_reasons and key[0] != "(other)":
                self.denial_reasons[key] = (reason[:300], extra.get("how_to_allow"))
            if not extra.get("alert") and not self.deny_log_bucket.take():
                self.deny_suppressed += 1
                return
        else:
            self.allowed += 1
        self.flush_suppressed()
        self._write(rec)

    def _write(self, rec: dict) -> None:
        # json.dumps escapes every control character (and non-ASCII): one record, one line
        self._log.write(json.dumps(rec, sort_keys=True, ensure_ascii=True) + "\n")
        self.gate.emit(rec)

    def flush_suppressed(self) -> None:
        """One record for the denials not logged one by one (none were lost: they were counted)."""
        if not self.deny_suppressed:
            return
        n, self.deny_suppressed = self.deny_suppressed, 0
        self._write({"time": round(time.time(), 6), "sandbox": self.sandbox_id, "agent": self.agent,
                     "phase": "log", "host": "", "port": None, "method": None, "path": None,
                     "rule": "log:suppressed", "verdict": "deny", "suppressed": n,
                     "reason": f"{n} further denials were counted but not logged one by one (deny-log rate limit)",
                     "bytes_out": 0, "bytes_in": 0})

    def count_out(self, n: int, host: str = "", port: int | None = None) -> None:
        self.bytes_out += n
        if self.bytes_out > self.policy.limits.bytes_out:
            raise _Cut("limit:bytes-out", host, port)

    def close_log(self) -> None:
        try:
            self.flush_suppressed()
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        try:
            self._log.close()
        except OSError:
            pass


class PlainStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def read(self, n: int = READ) -> bytes:
        return await self.reader.read(n)

    @property
    def reusable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


def _client_gone(client) -> bool:
    """The sandbox side has closed its connection: its EOF has arrived, even if bytes it sent
    before (a request body) are still buffered. (``StreamReader`` exposes only "EOF and empty
    buffer" publicly; ``_eof`` is the flag ``feed_eof`` sets, present in every CPython.)"""
    raw = getattr(client, "raw", client)
    reader = getattr(raw, "reader", None)
    return reader is not None and bool(getattr(reader, "_eof", reader.at_eof()))


class TLSStream:
    """Application bytes over a sans-IO TLS server session on top of a PlainStream."""

    def __init__(self, raw: PlainStream, session):
        self.raw, self.tls = raw, session

    async def handshake(self, initial: bytes) -> None:
        if initial:
            self.tls.receive(initial)
        while True:
            done = self.tls.handshake()
            out = self.tls.outgoing()
            if out:
                await self.raw.write(out)
            if done:
                return
            data = await asyncio.wait_for(self.raw.read(), HELLO_TIMEOUT)
            if not data:
                raise ConnectionError("client closed during TLS handshake")
            self.tls.receive(data)

    async def read(self, n: int = READ) -> bytes:
        while True:
            try:
                data = self.tls.read()
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                return b""
            out = self.tls.outgoing()
            if out:
                await self.raw.write(out)
            if data:
                return data
            if getattr(self.tls, "eof", False):
                return b""
            raw = await self.raw.read()
            if not raw:
                self.tls.receive_eof()
                continue
            self.tls.receive(raw)

    async def write(self, data: bytes) -> None:
        self.tls.write(data)
        out = self.tls.outgoing()
        if out:
            await self.raw.write(out)

    def close(self) -> None:
        try:
            self.tls.close()
            out = self.tls.outgoing()
            if out:
                self.raw.writer.write(out)
        except Exception:
            pass
        self.raw.close()


class Gate:
    """The gate: owns the CA, the upstream TLS contexts and every sandbox endpoint."""

    def __init__(self, state_dir: Path, log_dir: Path):
        self.state_dir = Path(state_dir)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.endpoints: dict[str, Endpoint] = {}
        self._ca = None
        self._server_ctx = None
        self._client_ctx: dict[str | None, ssl.SSLContext] = {}
        self.subscribers: list = []

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

    def client_ctx(self, extra_ca: str | None) -> ssl.SSLContext:
        if extra_ca not in self._client_ctx:
            from agentvm.gate.tls import client_context

            self._client_ctx[extra_ca] = client_context(extra_ca)
        return self._client_ctx[extra_ca]

    def emit(self, rec: dict) -> None:
        for cb in list(self.subscribers):
            try:
                cb(rec)
            except Exception:
                pass

    # -- endpoints ------------------------------------------------------------------------
    async def open_endpoint(self, sandbox_id: str, agent: str, policy: EgressPolicy, sock_path: Path, *, uid: int | None = None,
                            creds=None, sock=None) -> Endpoint:
        """Serve ``sandbox_id``'s socket: bound here, or ``sock`` - already bound, owned and
        listening (``agentvm.gate.embedded`` binds it before the sandbox starts, so connections
        wait in its backlog while the gate comes up)."""
        sock_path = Path(sock_path)
        ep = Endpoint(self, sandbox_id, agent, policy, sock_path, self.log_dir / f"{sandbox_id}.egress.jsonl")
        ep.creds = creds
        if sock is not None:
            ep.server = await asyncio.start_unix_server(lambda r, w: self._handle(ep, r, w), sock=sock, limit=STREAM_LIMIT)
            self.endpoints[sandbox_id] = ep
            return ep
        sock_path.parent.mkdir(parents=True, exist_ok=True)
        if sock_path.exists():
            sock_path.unlink()
        ep.server = await asyncio.start_unix_server(lambda r, w: self._handle(ep, r, w), path=str(sock_path),
                                                    limit=STREAM_LIMIT)
        # only the sandbox's uid (and root) may connect
        if uid is not None and os.geteuid() == 0:
            os.chown(sock_path, uid, uid)
        os.chmod(sock_path, 0o600)
        self.endpoints[sandbox_id] = ep
        return ep

    async def close_endpoint(self, sandbox_id: str) -> Endpoint | None:
        ep = self.endpoints.pop(sandbox_id, None)
        if ep is None:
            return None
        if ep.server is not None:
            ep.server.close()
            try:
                await asyncio.wait_for(ep.server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass
        try:
            ep.sock_path.unlink()
        except FileNotFoundError:
            pass
        ep.pool_close()
        ep.close_log()
        return ep

    # -- per connection -------------------------------------------------------------------
    async def _handle(self, ep: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = PlainStream(reader, writer)
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
            await self._serve(ep, client)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            if task not in ep.cut:
                raise  # the gate is shutting down
            rule, reason = ep.cut[task]
            ep.log(verdict="deny", rule_id=rule, reason=reason, host="", port=None, phase="cut")
        except _Cut as cut:
            ep.log(verdict="deny", rule_id=cut.rule_id, reason=f"limit reached: connection cut ({ep.bytes_out} bytes out)",
                   host=cut.host, port=cut.port, phase="stream")
        except Exception as exc:  # never let one connection take the gate down
            ep.log(verdict="deny", rule_id="internal-error", reason=f"{type(exc).__name__}", host="", port=None, phase="internal")
        finally:
            ep.active -= 1
            ep.conns.discard(task)
            ep.cut.pop(task, None)
            client.close()

    async def _read_head(self, stream, pending: bytes) -> tuple[bytes | None, bytes]:
        hr = h1.HeadReader()
        if pending and hr.feed(pending):
            return hr.head, hr.rest
        async with asyncio.timeout(HEAD_TIMEOUT):
            while True:
                data = await stream.read()
                if not data:
                    return None, b""
                if hr.feed(data):
                    return hr.head, hr.rest

    async def _cred_deny(self, ep: Endpoint, client, err, req: h1.ProxyRequest, *, phase: str = "request",
                         respond: bool = True) -> None:
        ep.log(verdict="deny", rule_id=err.rule_id, reason=err.reason, host=req.host, port=req.port,
               method=req.method if req.scheme != "connect" else "CONNECT", path=req.path or None, phase=phase,
               credential=err.name, alert=err.alert)
        if respond:
            await client.write(h1.deny_response(err.rule_id, err.reason, host=req.host, port=req.port))

    async def _bad_request(self, ep: Endpoint, stream, exc: h1.ProtocolError, host: str = "", port: int | None = None) -> None:
        ep.log(verdict="deny", rule_id=f"bad-request:{exc.code}", reason=str(exc), host=host, port=port, phase="request")
        await stream.write(h1.error_response(400, f"bad-request:{exc.code}", str(exc)))

    async def _serve(self, ep: Endpoint, client: PlainStream) -> None:
        pending = b""
        while True:
            try:
                head, pending = await self._read_head(client, pending)
            except h1.ProtocolError as exc:
                await self._bad_request(ep, client, exc)
                return
            if head is None:
                return
            try:
                req, down = h1.parse_head(head, pending)
            except h1.ProtocolError as exc:
                await self._bad_request(ep, client, exc)
                return
            if not await self._admit(ep, client, req):
                return
            if req.scheme == "connect":
                await self._connect(ep, client, req, pending)
                return
            if req.scheme != "http":
                ep.log(verdict="deny", rule_id="bad-request:not-a-proxy-request", reason="origin-form request to the proxy",
                       host=req.host, port=req.port, method=req.method, path=req.path, phase="request")
                await client.write(h1.error_response(400, "bad-request:not-a-proxy-request", "send absolute-form http:// URLs or CONNECT"))
                return
            keep, pending = await self._exchange(ep, client, down, req, scheme="http", tls_host=None)
            if not keep:
                return

    async def _admit(self, ep: Endpoint, client, req: h1.ProxyRequest) -> bool:
        """Every request, on a plain connection or inside a tunnel: not while paused, and
        within the rate limit. Answers the denial itself; False ends the connection."""
        if ep.paused:
            await self._deny(ep, client, "paused", "egress is paused by the operator", req)
            return False
        if not ep.bucket.take():
            await self._deny(ep, client, "limit:rate", "request rate limit", req, status=429)
            return False
        return True

    async def _deny(self, ep: Endpoint, client, rule_id: str, reason: str, req: h1.ProxyRequest, *, status: int = 403,
                    phase: str = "request") -> None:
        allow = how_to_allow(rule_id, reason, req.host, req.port)
        ep.log(verdict="deny", rule_id=rule_id, reason=reason, host=req.host, port=req.port,
               method=req.method if req.scheme != "connect" else "CONNECT", path=req.path or None, phase=phase,
               **({"how_to_allow": allow} if allow else {}))
        await client.write(h1.deny_response(rule_id, reason, host=req.host, port=req.port, status=status, allow=allow))

    async def _resolve(self, ep: Endpoint, host: str, port: int) -> tuple[str | None, str, str]:
        """-> (address or None, rule_id, reason). Connect only to the address checked here."""
        try:
            name = normalize_host(host)
        except ValueError as exc:
            return None, "invalid-host", str(exc)
        static = ep.policy.static_address(name)
        if static is not None:
            cands = [static]
        else:
            try:
                import ipaddress

                ipaddress.ip_address(name)
                cands = [name]
            except ValueError:
                try:
                    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
                except socket.gaierror as exc:
                    return None, "dns-failure", f"cannot resolve {name}: {exc.strerror}"
                cands = list(dict.fromkeys(i[4][0] for i in infos))
        last = None
        for addr in cands:
            d = check_address(name, addr, ep.policy)
            if d is None:
                return addr, "", ""
            last = d
        return None, last.rule_id if last else "dns-failure", last.reason if last else f"no address for {name}"

    # -- plain HTTP and requests inside a terminated tunnel --------------------------------
    async def _exchange(self, ep: Endpoint, client, down: h11.Connection, req: h1.ProxyRequest, *, scheme: str,
                        tls_host: tuple[str, int] | None) -> tuple[bool, bytes]:
        """Decide and forward one request; returns (keep the client connection, leftover bytes).
        ``tls_host`` is the CONNECT target when the request travels inside a tunnel (TLS
        terminated by the gate when ``scheme == "https"``, plain HTTP otherwise)."""
        if tls_host is not None:
            # inside a tunnel: origin-form only, and Host must be the tunnel's host
            if req.scheme != "origin":
                await self._deny(ep, client, "bad-request:absolute-form-in-tunnel", "absolute-form inside a tunnel", req)
                return False, b""
            try:
                # a Host without a port means the tunnel's port (curl sends "Host: api.x" for :443)
                same = normalize_host(req.host) == normalize_host(tls_host[0]) and (
                    req.port == tls_host[1] or not req.explicit_port)
            except ValueError:
                same = False
            if not same:
                await self._deny(ep, client, "host-mismatch", f"Host {req.host!r} does not match the TLS server name (domain fronting)", req)
                return False, b""
            req = h1.ProxyRequest(**{**req.__dict__, "host": tls_host[0], "port": tls_host[1]})
        meta = RequestMeta(host=req.host, port=req.port, scheme=scheme, method=req.method, path=req.path,
                           body_size=req.content_length, websocket=req.upgrade_websocket, phase="request",
                           sni=tls_host[0] if tls_host and scheme == "https" else None)
        d = decide(meta, ep.policy)
        if not d.allowed:
            await self._deny(ep, client, d.rule_id, d.reason, req)
            return False, b""
        cred = None
        if ep.creds is not None:
            from agentvm.gate.credentials import CredentialError

            try:
                ep.creds.check_target(req.host)
                swap = ep.creds.apply(host=req.host, scheme=scheme, target=req.path, headers=list(req.headers))
            except CredentialError as err:
                await self._cred_deny(ep, client, err, req)
                return False, b""
            except Exception as exc:  # the vault could not give a value: fail closed
                ep.log(verdict="deny", rule_id="credential:unavailable", reason=type(exc).__name__, host=req.host,
                       port=req.port, method=req.method, path=req.path, phase="request")
                await client.write(h1.deny_response("credential:unavailable", "a credential value is unavailable",
                                                    host=req.host, port=req.port))
                return False, b""
            cred = swap
            if req.upgrade_websocket and any(b.bound_to(req.host) for b in ep.creds.bindings.values()):
                # after a 101 the gate relays opaque frames it cannot scrub: a host that holds a
                # real value (it is bound to a credential) gets no WebSocket (fail closed)
                await self._deny(ep, client, "credential:uninspectable-websocket",
                                 "WebSockets to hosts a credential is bound to are refused: the gate cannot scrub "
                                 "echoes of the real value from WebSocket frames", req)
                return False, b""
            if swap.used or swap.target != req.path:
                req = h1.ProxyRequest(**{**req.__dict__, "headers": tuple(swap.headers), "path": swap.target})
        max_body = getattr(d, "max_body", None)
        if req.content_length is not None and max_body is not None and req.content_length > max_body:
            await self._deny(ep, client, d.rule_id + ":max-body", f"body of {req.content_length} bytes over {max_body}", req, status=403)
            return False, b""
        addr, rid, reason = await self._resolve(ep, req.host, req.port)
        if addr is None:
            await self._deny(ep, client, rid, reason, req)
            return False, b""
        await asyncio.sleep(0)  # let an EOF that already arrived be seen
        if _client_gone(client):
            # the client gave up (its timeout passed while the gate was stopped or slow): what it
            # sent is not forwarded late, unseen - a replayed POST is a real harm
            ep.log(verdict="deny", rule_id="client-gone", reason="the client closed the connection before the request "
                   "was forwarded", host=req.host, port=req.port, method=req.method, path=req.path, phase="request")
            return False, b""
        sni = normalize_host(req.host) if scheme == "https" else None
        key = (scheme, addr, req.port, sni, ep.policy.upstream_ca)
        retry_ok = not req.upgrade_websocket and not req.chunked and not req.content_length
        for attempt in (0, 1):
            pooled = ep.pool_get(key) if (attempt == 0 and not req.upgrade_websocket) else None
            if pooled is not None:
                upstream, up = pooled
            else:
                try:
                    async with asyncio.timeout(CONNECT_TIMEOUT):
                        if scheme == "https":
                            ur, uw = await asyncio.open_connection(addr, req.port, ssl=self.client_ctx(ep.policy.upstream_ca),
                                                                   server_hostname=sni)
                        else:
                            ur, uw = await asyncio.open_connection(addr, req.port)
                except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                    ep.log(verdict="allow", rule_id=d.rule_id, reason=f"upstream unreachable: {type(exc).__name__}",
                           host=req.host, port=req.port, method=req.method, path=req.path, phase="upstream", error=True)
                    await client.write(h1.error_response(502, "upstream-unreachable", f"cannot reach {req.host}:{req.port}"))
                    return False, b""
                upstream, up = PlainStream(ur, uw), h11.Connection(h11.CLIENT)
            try:
                keep, leftover, reusable = await self._relay_exchange(ep, client, upstream, up, down, req, d, max_body,
                                                                      pooled=pooled is not None and retry_ok, cred=cred,
                                                                      scheme=scheme)
            except _Stale:
                upstream.close()
                continue  # the pooled connection had been closed by the upstream: once more, fresh
            except BaseException:
                upstream.close()
                raise
            if reusable:
                ep.pool_put(key, upstream, up)
            else:
                upstream.close()
            return keep, leftover
        return False, b""

    async def _relay_exchange(self, ep, client, upstream, up, down, req, d, max_body, *, pooled: bool = False,
                              cred=None, scheme: str = "http"):
        """One request/response over ``upstream``; returns (keep client, leftover, upstream reusable)."""
        host_value = req.host if req.port in (80, 443) else f"{req.host}:{req.port}"
        ws = req.upgrade_websocket  # decide() allowed it, so a rule says websocket: true
        headers = h1.forward_headers(req, host_value, keep_upgrade=True) if ws else h1.forward_headers(req, host_value)
        scanner = ep.creds.body_scanner(req.host) if ep.creds is not None else None
        scrubber = ep.creds.scrubber() if ep.creds is not None else None
        if scrubber is not None and scrubber.encoded:
            # ask only for codings the gate can decode (and so scrub); a signed request keeps
            # its header (it may be signed) and relies on the response check alone
            if not (cred is not None and cred.resign):
                headers = [(k, encoding.narrow_accept(v)) if k == b"accept-encoding" else (k, v) for k, v in headers]
        if cred is not None and cred.resign:
            # a signed request: the whole body is needed to check and redo the signature
            return await self._relay_resigned(ep, client, upstream, up, down, req, d, max_body, headers, cred, scanner,
                                              scrubber, scheme, host_value)
        # With credentials in the sandbox, a body is scanned before anything is sent: the head
        # waits until the body is complete (or CRED_BUFFER is exceeded - then it streams, and a
        # placeholder found later cuts the upstream request mid-body).
        held: list[bytes] | None = [] if scanner is not None else None
        held_len = 0

        async def send_head() -> None:
            head = up.send(h11.Request(method=req.method, target=req.path, headers=headers))
            ep.count_out(len(head), req.host, req.port)  # a head carries data out too (path, headers)
            try:
                await upstream.write(head)
            except (ConnectionError, OSError):
                if pooled:
                    raise _Stale() from None
                raise

        if held is None:
            await send_head()
        sent = 0
        if (req.header(b"expect") or b"").lower() == b"100-continue" and down.their_state is h11.SEND_BODY:
            await client.write(down.send(h11.InformationalResponse(status_code=100, headers=[])))
        # request body
        try:
            async for chunk in _request_body(client, down):
                sent += len(chunk)
                if max_body is not None and sent > max_body:
                    ep.log(verdict="deny", rule_id=(d.body_rule_id or d.rule_id) + ":max-body",
                           reason=f"body over {max_body} bytes: cut",
                           host=req.host, port=req.port, method=req.method, path=req.path, phase="stream", bytes_out=sent)
                    await client.write(h1.error_response(413, "max-body", f"request body over {max_body} bytes"))
                    return False, b"", False
                ep.count_out(len(chunk), req.host, req.port)
                data = chunk
                if scanner is not None:
                    try:
                        data = scanner.feed(data)
                    except Exception as err:  # CredentialError: a placeholder in the body
                        await self._cred_deny(ep, client, err, req)
                        return False, b"", False
                if held is not None:
                    held.append(data)
                    held_len += len(data)
                    if held_len <= CRED_BUFFER:
                        continue
                    await send_head()
                    data, held = b"".join(held), None
                if data:
                    await upstream.write(up.send(h11.Data(data=data)))
        except _BodyEnded:
            return False, b"", False
        rest = scanner.finish() if scanner is not None else b""
        if held is not None:
            await send_head()
            rest = b"".join(held) + rest
        if rest:
            await upstream.write(up.send(h11.Data(data=rest)))
        await upstream.write(up.send(h11.EndOfMessage()))
        return await self._relay_response(ep, client, upstream, up, down, req, d, sent, scrubber, ws, pooled, cred)

    async def _relay_resigned(self, ep, client, upstream, up, down, req, d, max_body, headers, cred, scanner, scrubber,
                              scheme, host_value):
        held = [0]  # bytes this request holds against the sandbox's re-sign budget
        try:
            return await self._relay_resigned_held(ep, client, upstream, up, down, req, d, max_body, headers, cred,
                                                   scanner, scrubber, scheme, host_value, held)
        finally:
            ep.resign_buffered -= held[0]

    async def _relay_resigned_held(self, ep, client, upstream, up, down, req, d, max_body, headers, cred, scanner,
                                   scrubber, scheme, host_value, held):
        from agentvm.gate import signing

        body = bytearray()
        limit = RESIGN_MAX_BODY
        try:
            async for chunk in _request_body(client, down):
                body += chunk
                ep.resign_buffered += len(chunk)
                held[0] += len(chunk)
                if len(body) > limit or (max_body is not None and len(body) > max_body):
                    await client.write(h1.error_response(413, "max-body", "signed request body too large"))
                    return False, b"", False
                if ep.resign_buffered > RESIGN_BUDGET:
                    # all of this sandbox's signed requests in flight share one memory budget
                    ep.log(verdict="deny", rule_id="limit:resign-memory", reason="too many signed bytes buffered at once",
                           host=req.host, port=req.port, method=req.method, path=req.path, phase="stream")
                    await client.write(h1.error_response(503, "limit:resign-memory", "too many signed request bytes in flight"))
                    return False, b"", False
        except _BodyEnded:
            return False, b"", False
        try:
            if scanner is not None:
                scanner.feed(bytes(body))
            sreq = signing.Request(
                method=req.method,
                url=f"https://{host_value}{req.path}",
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                body=bytes(body),
            )
            for b in cred.resign:
                if b.mode == "sigv4":
                    # UNSIGNED-PAYLOAD / STREAMING-UNSIGNED-PAYLOAD-TRAILER (boto3's default for S3
                    # uploads over TLS): the body carries no signature, only the header one is redone
                    sreq = signing.resign_sigv4(sreq, access_key_id=b.sigv4_access_key_id,
                                                placeholder_secret=ep.creds.placeholders[b.name],
                                                real_secret=ep.creds.value(b.name), allow_unsigned_payload=True)
                else:
                    from types import SimpleNamespace

                    sreq = signing.resign_hmac(sreq, SimpleNamespace(**{k: (v or None) if k == "timestamp_header" else v
                                                                         for k, v in b.hmac}),
                                               placeholder=ep.creds.placeholders[b.name], real=ep.creds.value(b.name))
        except signing.SigningError as err:
            ep.log(verdict="deny", rule_id=f"credential:{err.code}", reason=str(err), host=req.host, port=req.port,
                   method=req.method, path=req.path, phase="request", alert=True,
                   credential=",".join(b.name for b in cred.resign))
            await client.write(h1.deny_response(f"credential:{err.code}", str(err), host=req.host, port=req.port))
            return False, b"", False
        except Exception as err:
            if hasattr(err, "rule_id"):
                await self._cred_deny(ep, client, err, req)
            else:
                await client.write(h1.error_response(502, "credential:resign-failed", type(err).__name__))
            return False, b"", False
        from urllib.parse import urlsplit

        u = urlsplit(sreq.url)
        target = u.path + ("?" + u.query if u.query else "")
        new_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in sreq.headers
                       if k.lower() not in ("transfer-encoding", "content-length")]
        new_headers.append((b"content-length", str(len(sreq.body)).encode()))
        ep.count_out(len(sreq.body), req.host, req.port)
        head = up.send(h11.Request(method=req.method, target=target, headers=new_headers))
        ep.count_out(len(head), req.host, req.port)
        await upstream.write(head)
        if sreq.body:
            await upstream.write(up.send(h11.Data(data=sreq.body)))
        await upstream.write(up.send(h11.EndOfMessage()))
        return await self._relay_response(ep, client, upstream, up, down, req, d, len(sreq.body), scrubber, False, False, cred)

    async def _undecodable(self, ep, client, req, d, err, sent: int, *, answered: bool = False) -> None:
        """A response the scrubber cannot read is never passed on: 502 (or, once its head has
        gone out, the response is cut short), logged with the rule id."""
        ep.log(verdict="deny", rule_id=err.rule_id, reason=err.reason, host=req.host, port=req.port, method=req.method,
               path=req.path, phase="response", bytes_out=sent)
        if not answered:
            await client.write(h1.error_response(502, err.rule_id, err.reason))

    async def _relay_response(self, ep, client, upstream, up, down, req, d, sent, scrubber, ws, pooled, cred):
        leftover = down.trailing_data[0]
        # response: coalesce what goes to the sandbox (one TLS record/send for a small response)
        pending_out: list[bytes] = []
        pending_len = 0

        async def emit(data: bytes, flush: bool = False) -> None:
            nonlocal pending_len
            if data:
                pending_out.append(data)
                pending_len += len(data)
            if pending_out and (flush or pending_len >= 65536):
                out = b"".join(pending_out)
                pending_out.clear()
                pending_len = 0
                await client.write(out)

        async def scrubbed_out(pieces) -> bool:
            """Decoded pieces (decoding is lazy: it happens here), scrubbed, to the sandbox; False
            when the body does not decode (what was sent stays, the response ends unfinished)."""
            try:
                for piece in pieces:
                    data = scrubber.feed(piece)
                    if data:
                        await emit(down.send(h11.Data(data=data)))
            except encoding.DecodeError as err:
                await emit(b"", flush=True)
                await self._undecodable(ep, client, req, d, err, sent, answered=True)
                return False
            return True

        received = 0
        answered = False
        scrubbing = scrubber is not None and scrubber.active
        decoder = None
        decoded_from = None
        while True:
            try:
                ev = up.next_event()
            except h11.RemoteProtocolError:
                if pooled and not answered:
                    raise _Stale() from None
                raise
            if ev is h11.NEED_DATA:
                # what was decoded so far goes out before waiting: a stream (SSE, chunked
                # progress) reaches the agent as it is sent, not when the response ends
                await emit(b"", flush=True)
                try:
                    data = await upstream.read()
                except (ConnectionError, OSError):
                    if pooled and not answered:
                        raise _Stale() from None
                    raise
                up.receive_data(data)  # b"" signals EOF
                continue
            if isinstance(ev, h11.InformationalResponse):
                if ws and ev.status_code == 101:
                    await emit(b"", flush=True)
                    wh = h1.response_headers(ev.headers, keep_upgrade=True)
                    await client.write(down.send(h11.InformationalResponse(
                        status_code=101, reason=scrubber.header(bytes(ev.reason)) if scrubbing else ev.reason,
                        headers=scrubber.headers(wh) if scrubbing else wh)))
                    # the upgraded connection is relayed as bytes (still counted against bytesOut)
                    up_rest, down_rest = up.trailing_data[0], down.trailing_data[0]
                    if up_rest:
                        await client.write(up_rest)
                    if down_rest:
                        ep.count_out(len(down_rest), req.host, req.port)
                        await upstream.write(down_rest)
                    out, inn = await self._splice(ep, client, upstream, (req.host, req.port))
                    ep.log(verdict="allow", rule_id=d.rule_id, reason="websocket relayed", host=req.host, port=req.port,
                           method=req.method, path=req.path, phase="websocket", bytes_out=sent + out, bytes_in=inn)
                    return False, b"", False
                continue
            if isinstance(ev, h11.Response):
                answered = True
                rh = h1.response_headers(ev.headers)
                reason = ev.reason
                if scrubbing:
                    # an upstream echoing a real value must not hand it to the sandbox (names,
                    # values, the reason phrase); the body may change length: re-framed (chunked)
                    rh = scrubber.headers((k, v) for k, v in rh if k not in (b"content-length", b"content-encoding"))
                    reason = scrubber.header(bytes(ev.reason))
                    # the codings as sent, even where Connection: content-encoding tried to hide them
                    codings = b", ".join(bytes(v) for k, v in ev.headers if bytes(k).lower() == b"content-encoding")
                    if codings and scrubber.encoded:
                        # a compressed echo is still an echo: decode, scrub, forward identity
                        try:
                            decoder = encoding.Decoder(codings)
                        except encoding.DecodeError as err:
                            await self._undecodable(ep, client, req, d, err, sent)
                            return False, b"", False
                        if decoder.steps:
                            decoded_from = codings.decode("latin-1")
                        else:
                            decoder = None
                    elif codings:
                        rh.append((b"content-encoding", codings))  # forwarded as it is (raw-scrub)
                await emit(down.send(h11.Response(status_code=ev.status_code, reason=reason, headers=rh)))
                continue
            if isinstance(ev, h11.Data):
                received += len(ev.data)
                if not scrubbing:
                    await emit(down.send(h11.Data(data=ev.data)))
                elif not await scrubbed_out(decoder.feed(ev.data) if decoder is not None else (ev.data,)):
                    return False, b"", False
                continue
            if isinstance(ev, h11.EndOfMessage):
                if scrubbing:
                    if not await scrubbed_out(decoder.finish() if decoder is not None else ()):
                        return False, b"", False
                    rest = scrubber.finish()
                    if rest:
                        await emit(down.send(h11.Data(data=rest)))
                await emit(down.send(h11.EndOfMessage()), flush=True)
                break
            if isinstance(ev, h11.ConnectionClosed):
                if pooled and not answered:
                    raise _Stale()
                await emit(b"", flush=True)
                return False, b"", False
        ep.bytes_in += received
        extra = {}
        if cred is not None and cred.used:
            extra["credentials"] = sorted(set(cred.used))
        if scrubber is not None and scrubber.hits:
            extra["scrubbed"] = scrubber.hits
            extra["alert"] = True
        if decoded_from:
            extra["decoded"] = decoded_from
        ep.log(verdict="allow", rule_id=d.rule_id, reason=d.reason, host=req.host, port=req.port, method=req.method,
               path=req.path, phase="request", bytes_out=sent, bytes_in=received, **extra)
        keep = down.our_state is h11.DONE and down.their_state is h11.DONE
        reusable = up.our_state is h11.DONE and up.their_state is h11.DONE and upstream.reusable
        if reusable:
            up.start_next_cycle()
        return keep, leftover, reusable

    # -- CONNECT ----------------------------------------------------------------------------
    async def _connect(self, ep: Endpoint, client: PlainStream, req: h1.ProxyRequest, pending: bytes) -> None:
        if ep.creds is not None:
            from agentvm.gate.credentials import CredentialError

            try:
                ep.creds.check_target(req.host)
            except CredentialError as err:
                await self._cred_deny(ep, client, err, req, phase="connect")
                return
        meta = RequestMeta(host=req.host, port=req.port, scheme="connect", phase="connect")
        d = decide(meta, ep.policy)
        if not d.allowed:
            await self._deny(ep, client, d.rule_id, d.reason, req, phase="connect")
            return
        addr, rid, reason = await self._resolve(ep, req.host, req.port)
        if addr is None:
            await self._deny(ep, client, rid, reason, req, phase="connect")
            return
        await client.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        # peek the ClientHello: its SNI must be the CONNECT host
        from agentvm.gate.tls import TLSParseError, parse_client_hello

        buf = pending
        hello = None
        while not buf:
            data = await asyncio.wait_for(client.read(), HELLO_TIMEOUT)
            if not data:
                return
            buf += data
        if buf[:1] != b"\x16" and buf[:1].isalpha():
            # plain HTTP inside the tunnel (undici, some SDKs tunnel http:// too): every request is
            # parsed and decided like a forward-proxy request, Host pinned to the CONNECT target
            await self._plain_tunnel(ep, client, req, buf)
            return
        try:
            while True:
                if buf:
                    hello = parse_client_hello(buf)
                    if hello is not None:
                        break
                data = await asyncio.wait_for(client.read(), HELLO_TIMEOUT)
                if not data:
                    return
                buf += data
        except TLSParseError as exc:
            ep.log(verdict="deny", rule_id="not-tls", reason=f"tunnel does not start with a TLS ClientHello: {exc}",
                   host=req.host, port=req.port, method="CONNECT", phase="clienthello")
            return
        if ep.creds is not None:
            from agentvm.gate.credentials import CredentialError

            try:
                ep.creds.check_target(req.host, hello.sni)
            except CredentialError as err:
                await self._cred_deny(ep, client, err, req, phase="clienthello", respond=False)
                return
        meta2 = RequestMeta(host=req.host, port=req.port, scheme="connect", phase="clienthello", sni=hello.sni)
        d2 = decide(meta2, ep.policy)
        if not d2.allowed:
            ep.log(verdict="deny", rule_id=d2.rule_id, reason=d2.reason, host=req.host, port=req.port, method="CONNECT",
                   phase="clienthello", sni=hello.sni)
            return
        if d.terminate or d2.terminate or ep.creds is not None:
            # a sandbox holding placeholders gets every tunnel terminated: a placeholder must
            # be seen wherever it travels (and swapped only where it is bound)
            await self._terminate(ep, client, req, buf)
            return
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection(addr, req.port, limit=STREAM_LIMIT), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            ep.log(verdict="allow", rule_id=d2.rule_id, reason=f"upstream unreachable: {type(exc).__name__}",
                   host=req.host, port=req.port, method="CONNECT", phase="upstream", error=True)
            return
        upstream = PlainStream(ur, uw)
        target = (req.host, req.port)
        ep.count_out(len(buf), *target)
        try:
            await upstream.write(buf)
            ep.splices[asyncio.current_task()] = meta2
            if hasattr(os, "splice"):
                out, inn = await _zero_copy_splice(ep, client, upstream, target)
            else:  # pragma: no cover - Linux < 2.6.17 / Python < 3.10
                out, inn = await self._splice(ep, client, upstream, target)
        finally:
            ep.splices.pop(asyncio.current_task(), None)
            upstream.close()
        ep.log(verdict="allow", rule_id=d2.rule_id, reason="tunnel (SNI checked, not terminated)", host=req.host,
               port=req.port, method="CONNECT", phase="tunnel", bytes_out=out + len(buf), bytes_in=inn, sni=hello.sni)

    async def _splice(self, ep: Endpoint, client, upstream: PlainStream, target: tuple[str, int]) -> tuple[int, int]:
        counts = [0, 0]

        async def pump(src: PlainStream, dst: PlainStream, idx: int, outbound: bool):
            try:
                while True:
                    data = await src.read(SPLICE_READ)
                    if not data:
                        break
                    if outbound:
                        ep.count_out(len(data), *target)
                    counts[idx] += len(data)
                    await dst.write(data)
            finally:
                try:
                    w = getattr(dst, "writer", None)
                    if w is not None and w.can_write_eof():
                        w.write_eof()
                except (OSError, RuntimeError):
                    pass

        await _both_ways(pump(client, upstream, 0, True), pump(upstream, client, 1, False))
        return counts[0], counts[1]

    async def _plain_tunnel(self, ep: Endpoint, client: PlainStream, req: h1.ProxyRequest, first: bytes) -> None:
        await self._tunnel_requests(ep, client, req, first, scheme="http")

    async def _terminate(self, ep: Endpoint, client: PlainStream, req: h1.ProxyRequest, hello_bytes: bytes) -> None:
        from agentvm.gate.tls import TLSServerSide

        tls = TLSStream(client, TLSServerSide(self.server_ctx()))
        try:
            await tls.handshake(hello_bytes)
        except (ssl.SSLError, ConnectionError, asyncio.TimeoutError) as exc:
            ep.log(verdict="deny", rule_id="tls-handshake", reason=f"TLS handshake with the sandbox failed: {type(exc).__name__}",
                   host=req.host, port=req.port, method="CONNECT", phase="tls")
            return
        try:
            await self._tunnel_requests(ep, tls, req, b"", scheme="https")
        finally:
            tls.close()

    async def _tunnel_requests(self, ep: Endpoint, stream, req: h1.ProxyRequest, pending: bytes, *, scheme: str) -> None:
        """Requests inside a CONNECT tunnel, one decision each (L7 rules apply)."""
        while True:
            try:
                head, pending = await self._read_head(stream, pending)
                if head is None:
                    return
                inner, down = h1.parse_head(head, pending)
            except h1.ProtocolError as exc:
                await self._bad_request(ep, stream, exc, req.host, req.port)
                return
            if not await self._admit(ep, stream, inner):
                return
            keep, pending = await self._exchange(ep, stream, down, inner, scheme=scheme, tls_host=(req.host, req.port))
            if not keep:
                return


# ---------------------------------------------------------------------------- zero-copy tunnels

_PIPE_SIZE = 1 << 20
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


async def _wait_fd(fd: int, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


def _detach(stream: PlainStream) -> tuple[int, bytes]:
    """Take a stream's socket out of asyncio: a dup of its fd plus the bytes asyncio had
    already read but nobody consumed. The transport is aborted (the dup keeps the socket)."""
    tr = stream.writer.transport
    tr.pause_reading()
    fd = os.dup(tr.get_extra_info("socket").fileno())
    os.set_blocking(fd, False)
    buffered = bytes(getattr(stream.reader, "_buffer", b""))
    if buffered:
        stream.reader._buffer.clear()
    tr.abort()
    return fd, buffered


async def _one_way(ep: Endpoint, src: int, dst: int, outbound: bool, counts: list, idx: int, target: tuple) -> None:
    import fcntl

    pr, pw = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(pw, 1031, _PIPE_SIZE)  # F_SETPIPE_SZ
        except OSError:
            pass
        inpipe, eof = 0, False
        while True:
            progressed = False
            if not eof and inpipe < _PIPE_SIZE:
                try:
                    n = os.splice(src, pw, _PIPE_SIZE - inpipe, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    n = -1
                except OSError:
                    n = 0
                if n == 0:
                    eof = True
                elif n > 0:
                    if outbound:
                        ep.count_out(n, *target)
                    counts[idx] += n
                    inpipe += n
                    progressed = True
            if inpipe:
                try:
                    m = os.splice(pr, dst, inpipe, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    m = 0
                inpipe -= m
                progressed = progressed or m > 0
            if eof and not inpipe:
                try:
                    socket.socket(fileno=os.dup(dst)).shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if not progressed:
                if inpipe:
                    await _wait_fd(dst, write=True)
                else:
                    await _wait_fd(src, write=False)
    finally:
        os.close(pr)
        os.close(pw)


async def _both_ways(out_coro, in_coro) -> None:
    """Relay both directions of a tunnel. The first failure ends both and is raised; either
    way both are finished (not merely cancelled) when this returns."""
    t1, t2 = asyncio.ensure_future(out_coro), asyncio.ensure_future(in_coro)
    try:
        done, _ = await asyncio.wait({t1, t2}, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        await asyncio.gather(t1, t2)
    finally:
        for t in (t1, t2):
            t.cancel()
        await asyncio.gather(t1, t2, return_exceptions=True)


async def _zero_copy_splice(ep: Endpoint, client: PlainStream, upstream: PlainStream, target: tuple) -> tuple[int, int]:
    """Relay a spliced CONNECT tunnel with splice(2) through pipes: the bytes never enter
    Python. Counts bytes out against the sandbox's limit like any other path."""
    cfd, cbuf = _detach(client)
    ufd, ubuf = _detach(upstream)
    counts = [0, 0]
    try:
        if cbuf:
            ep.count_out(len(cbuf), *target)
            counts[0] += len(cbuf)
            await _send_all(ufd, cbuf)
        if ubuf:
            counts[1] += len(ubuf)
            await _send_all(cfd, ubuf)
        # both pumps are finished (their readers removed) before the fds below are closed:
        # a number closed while still registered could be reused by another connection
        await _both_ways(_one_way(ep, cfd, ufd, True, counts, 0, target),
                         _one_way(ep, ufd, cfd, False, counts, 1, target))
    finally:
        os.close(cfd)
        os.close(ufd)
    return counts[0], counts[1]


async def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
        except BlockingIOError:
            await _wait_fd(fd, write=True)


class EmbeddedGate:
    """The gate in a background thread of the current process (``agentvm run`` without a daemon)."""

    def __init__(self, state_dir: Path, log_dir: Path):
        import threading

        self.gate = Gate(state_dir, log_dir)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentvm-gate", daemon=True)
        self._thread.start()

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open(self, sandbox_id: str, agent: str, policy: EgressPolicy, sock_path: Path, uid: int | None, creds=None,
             sock=None) -> Endpoint:
        return self.call(self.gate.open_endpoint(sandbox_id, agent, policy, sock_path, uid=uid, creds=creds, sock=sock))

    def close(self, sandbox_id: str) -> Endpoint | None:
        return self.call(self.gate.close_endpoint(sandbox_id))

    def stop(self) -> None:
        async def _shutdown():
            for sid in list(self.gate.endpoints):
                await self.gate.close_endpoint(sid)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()

        try:
            self.call(_shutdown(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
