"""``agentvm gateway serve``: the gate's exchange core for many sandboxes over TCP + mTLS.

The gate (``agentvm.gate.server.Gate``) identifies a sandbox by the unix socket its
connection arrived on. Here the identity is the client certificate the connection was
authenticated with: the listener is one TLS server (``CERT_REQUIRED``, trusting only the
gateway's CA), and after the handshake the verified certificate's one ``agentvm://`` URI
names the sandbox. From there on a connection is served by exactly the code that serves a
unix-socket connection today - ``Gate._handle`` with the identity's own ``Endpoint``
(policy, limits, upstream pool, credentials, budget, decision log) - which this module opens
without a listener, one per identity, on first use.

What this adapter adds around the core (no file of ``agentvm.gate`` is changed):

* before every request (each flow the core starts), the configuration source is checked
  (a stat per file) and the connection's certificate re-admitted: a revoked identity or
  serial, an identity whose agent was removed, or a certificate past its notAfter is refused
  on that request (403 ``identity:*``) and the connection closed; a changed agent file is
  applied to the endpoint (``Endpoint.set_policy``, a new credential set);
* a timer (every second) does the same for connections that are not asking - HTTP/2 streams
  in a terminated tunnel, spliced tunnels, idle keep-alives - and cuts those refused;
* a spliced CONNECT tunnel is relayed through the stream (``stream_splice``), not with
  ``splice(2)`` on the socket: the socket carries the sandbox's mTLS records.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import ssl
import time
from pathlib import Path

from agentvm.gate import h1
from agentvm.gate.endpoint import Endpoint
from agentvm.gate.server import STREAM_LIMIT, Gate
from agentvm.gate.streams import HELLO_TIMEOUT, PlainStream
from agentvm.gateway.config import GATEWAY_LOG, CompiledAgent, Refusal, Registry
from agentvm.gateway.identity import Identity, from_peercert

log = logging.getLogger("agentvm.gateway")

RECHECK_INTERVAL = 1.0  # seconds between checks of connections that are not sending requests
IDLE_CLOSE = 300.0  # an identity's endpoint without a connection this long is closed (its log fd, its pool)


def server_context(ca_dir: Path) -> ssl.SSLContext:
    """TLS for the gateway's listener: its server certificate; client certificates required and
    verified against the gateway's CA only (never the system's)."""
    ca_dir = Path(ca_dir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(ca_dir / "server.pem", ca_dir / "server.key")
    ctx.load_verify_locations(cafile=str(ca_dir / "ca.pem"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _not_after(cert: dict) -> float:
    try:
        return ssl.cert_time_to_seconds(cert["notAfter"])
    except (KeyError, ValueError):
        return 0.0


class GatewayGate(Gate):
    """A Gate whose endpoints are identities, reached through one mTLS listener."""

    zero_copy = False  # a spliced tunnel goes through the stream: the client's socket carries mTLS
    handoff = False  # its clients are remote nodes, never a local sandbox's bridge

    def __init__(self, state_dir: Path, log_dir: Path, registry: Registry) -> None:
        super().__init__(state_dir, log_dir)
        self.registry = registry
        self.by_id: dict[str, tuple[Identity, str]] = {}  # sandbox id -> (identity, agent digest)
        # the certificate of each connection being served: task -> (identity, serial, notAfter)
        self.conn_cert: dict[asyncio.Task, tuple[Identity, str, float]] = {}
        self.admitted: dict[asyncio.Task, int] = {}  # task -> the configuration generation it was last admitted under
        self.refused = 0
        self.servers: list[asyncio.AbstractServer] = []
        self._recheck: asyncio.TimerHandle | None = None
        self._gw_log = None
        registry.listeners.append(self._reloaded)
        self.last_used: dict[str, float] = {}  # sandbox id -> when its last connection ended (monotonic)
        # budgets per identity, kept in this replica's own database (an endpoint closed when idle
        # and opened again keeps counting where it was)
        self.budget_db = Path(state_dir) / "budgets.db"
        self._budget_store = None

    # -- the listener ---------------------------------------------------------------------
    async def listen(self, host: str, port: int, ctx: ssl.SSLContext) -> asyncio.AbstractServer:
        loop = asyncio.get_running_loop()

        def protocol() -> PlainStream:
            return PlainStream(STREAM_LIMIT, on_connect=lambda s: loop.create_task(self._serve(s)))

        server = await loop.create_server(protocol, host, port, ssl=ctx, ssl_handshake_timeout=HELLO_TIMEOUT,
                                          backlog=1024)
        self.servers.append(server)
        if self._recheck is None:
            self._recheck = loop.call_later(RECHECK_INTERVAL, self._tick)
        return server

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        for s in self.servers:
            s.close()
        for sid in list(self.endpoints):
            await self.close_endpoint(sid, unlink=False)
        for s in self.servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass

    async def _serve(self, stream: PlainStream) -> None:
        task = asyncio.current_task()
        ssl_obj = stream.get_extra_info("ssl_object")
        cert = ssl_obj.getpeercert() if ssl_obj is not None else None
        ident = from_peercert(cert)
        serial = (cert or {}).get("serialNumber")
        res = self.registry.admit(ident, serial)
        if isinstance(res, Refusal):
            # into the identity's own decision log when it has one open (a revoked claim); never
            # an endpoint opened for a refusal (an unknown name must not cost the gateway a log)
            ep = self.endpoints.get(ident.key) if ident is not None else None
            await self._refuse(stream, ident, res, ep if ep is not None and not ep.closing else None)
            stream.close()
            return
        ep = self._endpoint(ident, res)
        self.conn_cert[task] = (ident, serial or "", _not_after(cert))
        try:
            await self._handle(ep, stream)
        finally:
            self.conn_cert.pop(task, None)
            self.admitted.pop(task, None)
            self.last_used[ep.sandbox_id] = time.monotonic()

    async def _refuse(self, stream, ident: Identity | None, res: Refusal, ep: Endpoint | None = None) -> None:
        self.refused += 1
        if ep is not None:
            ep.log(verdict="deny", rule_id=res.rule_id, reason=res.reason, host="", port=None, phase="identity")
        else:
            self.emit({"time": round(time.time(), 6), "sandbox": GATEWAY_LOG, "identity": ident.uri if ident else None,
                       "phase": "identity", "rule": res.rule_id, "verdict": "deny", "reason": res.reason})
        try:
            await stream.write(h1.deny_response(res.rule_id, res.reason, host="", port=0, status=403))
        except Exception:  # noqa: BLE001 - the refusal is logged; the peer may be gone
            pass

    # -- endpoints, one per identity ------------------------------------------------------
    def _endpoint(self, ident: Identity, agent: CompiledAgent) -> Endpoint:
        sid = ident.key
        ep = self.endpoints.get(sid)
        if ep is not None and not ep.closing:
            if self.by_id[sid][1] != agent.digest:
                self._apply(ep, ident, agent)
            return ep
        ep = Endpoint(self, sid, agent.name, agent.policy.egress, Path("/nonexistent"),
                      self.log_dir / f"{sid}.egress.jsonl")
        self._apply(ep, ident, agent, new=True)
        self.endpoints[sid] = ep
        return ep

    def _apply(self, ep: Endpoint, ident: Identity, agent: CompiledAgent, *, new: bool = False) -> None:
        """The agent's policy, credentials, budget and approvals on ``ep`` (as
        ``EndpointExtras.attach`` does for a host sandbox; tools are not served here)."""
        if not new:
            ep.set_policy(agent.policy.egress)
        ep.creds = self.registry.credential_set(agent, ident)
        ep.approval_timeout = agent.policy.approval_timeout
        ep.approval_webhook = agent.policy.approval_webhook
        ep.policy_digest = agent.digest
        spec = getattr(agent.policy.limits, "budget", None)
        if spec is None:
            ep.budget = None
        elif new or ep.budget is None or ep.budget.spec != spec:
            from agentvm.gate.budget import Budget

            if self._budget_store is None:
                from agentvm.gate.budget import BudgetStore

                self._budget_store = BudgetStore(self.budget_db)
            budget = Budget(ident.uri, spec, self._budget_store)  # per identity, per replica (docs/scale-out.md)
            ep.budget = budget if new else None
            if not new:
                ep.set_budget(budget)
        self.by_id[ep.sandbox_id] = (ident, agent.digest)

    # -- every request is admitted again --------------------------------------------------
    def _check(self, task: asyncio.Task | None, ep: Endpoint) -> Refusal | None:
        held = self.conn_cert.get(task) if task is not None else None
        if held is None:
            return None  # (not a connection of ours: the core's own internal flows)
        ident, serial, not_after = held
        if not_after and time.time() > not_after:
            return Refusal("identity:expired", f"the certificate of {ident.uri} expired during the connection")
        gen = self.registry.current().generation  # (a stat per file of the source; a change reloads it)
        if self.admitted.get(task) == gen:
            return None  # admitted under this very configuration already
        res = self.registry.admit(ident, serial)
        if isinstance(res, Refusal):
            return res
        if self.by_id.get(ep.sandbox_id, (None, None))[1] != res.digest:
            self._apply(ep, ident, res)
        self.admitted[task] = gen
        return None

    async def _run(self, ep, client, flow, event=None, *, started: bool = False):
        if not started:
            res = self._check(asyncio.current_task(), ep)
            if res is not None:
                flow.close()
                ident = self.conn_cert.get(asyncio.current_task(), (None,))[0]
                await self._refuse(client, ident, res, ep)
                raise ConnectionAbortedError(res.rule_id)  # (_handle closes the connection quietly)
        return await super()._run(ep, client, flow, event, started=started)

    def _tick(self) -> None:
        self._recheck = None
        try:
            self.registry.current()  # a change calls _reloaded
            now = time.time()
            for task, (ident, serial, not_after) in list(self.conn_cert.items()):
                ep = self.endpoints.get(ident.key)
                if ep is None:
                    continue
                if not_after and now > not_after:
                    ep._cut(task, "identity:expired", f"the certificate of {ident.uri} expired: connection cut")
            idle = time.monotonic() - IDLE_CLOSE
            for sid, ep in list(self.endpoints.items()):
                if not ep.conns and ep.active == 0 and self.last_used.get(sid, idle + 1) < idle:
                    self.last_used.pop(sid, None)
                    # taken out now (a connection arriving meanwhile gets a new endpoint), closed after
                    del self.endpoints[sid]
                    self._closing.add(ep)
                    asyncio.get_running_loop().create_task(self._close_idle(ep))
        except Exception:  # noqa: BLE001 - the timer must keep running
            log.exception("gateway recheck failed")
        finally:
            if self.servers:
                self._recheck = asyncio.get_running_loop().call_later(RECHECK_INTERVAL, self._tick)

    async def _close_idle(self, ep: Endpoint) -> None:
        try:
            await self._close(ep, False)
        finally:
            self._closing.discard(ep)

    def _reloaded(self, old, new) -> None:
        """The source changed: identities refused now have their connections cut; endpoints whose
        agent changed take the new policy at once."""
        try:
            me = asyncio.current_task()
        except RuntimeError:
            me = None
        for task, (ident, serial, _na) in list(self.conn_cert.items()):
            ep = self.endpoints.get(ident.key)
            if ep is None or task is me:  # (the connection asking now is answered by _check itself)
                continue
            res = self.registry.admit(ident, serial)
            if isinstance(res, Refusal):
                ep._cut(task, res.rule_id, f"{res.reason}: connection cut")
            elif self.by_id.get(ep.sandbox_id, (None, None))[1] != res.digest:
                self._apply(ep, ident, res)



async def serve(config_dir: Path, ca_dir: Path, host: str, port: int, *, state_dir: Path, audit_dir: Path | None,
                replica: str, vault_dir: Path | None = None, ready=None, stop: asyncio.Event | None = None,
                issuer_dir: Path | None = None, enroll_key: Path | None = None, enroll_port: int | None = None,
                cert_lifetime: float = 3600.0) -> None:
    """Run a gateway replica until ``stop`` is set (or forever). With ``issuer_dir`` and
    ``enroll_key`` it also serves per-claim enrolment on ``enroll_port`` (agentvm.gateway.enroll);
    ``ready`` then gets the enrolment address as ``gate.enroll_addr``."""
    registry = Registry(config_dir, vault_dir=vault_dir)
    gate = GatewayGate(Path(state_dir) / "gate", Path(state_dir) / "logs" / replica, registry)
    gate.ca  # the interception CA now (its ca.pem is what sandboxes trust; replicas share it: docs/k8s.md)
    snap = registry.current()
    if snap.approvals:
        from agentvm.approvals import ApprovalStore

        gate.approvals_factory = lambda: ApprovalStore(Path(snap.approvals))
    sink = None
    if audit_dir is not None:
        from agentvm.gateway.audit import AuditSink

        sink = AuditSink(audit_dir, replica)
        gate.subscribers.append(sink)
    server = await gate.listen(host, port, server_context(ca_dir))
    enroll_server = None
    if issuer_dir is not None or enroll_key is not None:
        from agentvm.errors import ConfigError
        from agentvm.gateway.ca import Issuer
        from agentvm.gateway.enroll import ENROLL_PORT, Enroller, enroll_context, load_key

        if issuer_dir is None or enroll_key is None:
            raise ConfigError("per-claim enrolment needs both --issuer and --enroll-key", code="gateway.ca-invalid")
        gate.enroller = Enroller(gate, Issuer(issuer_dir), load_key(enroll_key), lifetime=cert_lifetime)
        enroll_server = await gate.enroller.listen(host, ENROLL_PORT if enroll_port is None else enroll_port,
                                                   enroll_context(ca_dir))
        gate.enroll_addr = enroll_server.sockets[0].getsockname()[:2]
    if ready is not None:
        ready(server.sockets[0].getsockname()[:2], gate)
    try:
        if stop is None:
            await asyncio.Event().wait()
        else:
            await stop.wait()
    finally:
        if enroll_server is not None:
            enroll_server.close()
        await gate.close()
        if sink is not None:
            sink.close()


def utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)
