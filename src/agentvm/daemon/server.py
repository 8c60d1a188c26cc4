"""The control-plane daemon: owns state, supervises sandboxes, hosts the egress gate, applies
policy live, records everything in the audit chain, and streams events.

:class:`Daemon` is the :class:`~agentvm.daemon.control.ControlPlane` (the typed service: no
HTTP in it) served over HTTP by :class:`~agentvm.daemon.http.HttpServer` (the transport, with
the routes of ``agentvm.daemon.router``). The daemon's modules, by job:

    control.py     the ControlPlane: sandboxes, exec, run, cp, live policy, approvals, audit
    supervisor.py  runs (Lifecycle.run_to_end), restarts, TTL and idle timeouts, recovery
    gatehost.py    the gate as the lifecycle's gate host: placement, endpoints, live policy onto one
    events.py      events, the audit chain and its queue, the disk reserve, the start-up checks
    fleetops.py    fleet plan, apply (canaries), rollback, status
    pump.py        a command's output streamed with back-pressure (Output)
    http.py        HTTP/1.1 over the unix socket and TCP, streams, the console's door
    router.py      the API's routes: typed input (api.py) -> one ControlPlane call
    api.py         the API's models and its OpenAPI description
    state.py       the sandboxes' rows and their state table

With ``--e2b-listen`` the daemon also serves the E2B-compatible API (agentvm.e2b) on a port of
its own, in this process and on this loop, over the ControlPlane (``serve_e2b`` below).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from agentvm.daemon.control import ControlPlane
from agentvm.daemon.events import check_chain, check_state  # noqa: F401 (the CLI's `up` calls them)
from agentvm.daemon.gatehost import DaemonGateHost  # noqa: F401 (re-exported)
from agentvm.daemon.http import SOCKET_NAME, HttpServer  # noqa: F401 (re-exported)
from agentvm.daemon.supervisor import Managed  # noqa: F401 (re-exported)
from agentvm.paths import Paths


class Daemon(ControlPlane):
    """The ControlPlane, served: its HTTP listeners (``http``) from ``serve()`` until stopped."""

    def __init__(self, paths: Paths, *, backend=None, listen: str | None = None, tracing=None,
                 gate_workers: int | str = "agent", resume: bool = True, e2b: dict | None = None) -> None:
        super().__init__(paths, backend=backend, tracing=tracing, gate_workers=gate_workers, resume=resume)
        self.http = HttpServer(self, listen)
        self.e2b_options = e2b  # {"listen": HOST:PORT, "max_per_tenant", "max_creating"} or None
        self.e2b = None  # the E2B API's server (E2BServer) while it runs

    @property
    def listen(self) -> str | None:
        return self.http.listen

    @property
    def token(self) -> str | None:
        return self.http.token

    @property
    def socket_path(self):
        return self.http.socket_path

    async def serve(self) -> None:
        # recover before answering anyone: a client that sees the socket sees a clean state
        await self.open()
        from agentvm import sysaudit  # escape probes of the sandboxes launched from now on: chain + events

        self._sysaudit_off = sysaudit.register_sink_factory(self.syscall_sink)
        await self.http.start()
        if self.e2b_options:
            try:
                self.e2b = await E2BServer.start(self, **self.e2b_options)
            except BaseException:
                self.http.close_listeners()
                await self.close()
                self.http.remove_socket()
                raise
        self.record("daemon.started", pid=os.getpid(), socket=str(self.socket_path), tcp=self.listen,
                    e2b=self.e2b.url if self.e2b is not None else None)
        await self.stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        if self.e2b is not None:  # first: its calls need the control plane
            await self.e2b.stop()
        self.http.close_listeners()
        await self.close()
        off = getattr(self, "_sysaudit_off", None)
        if off is not None:
            off()
        self.http.remove_socket()


class E2BServer:
    """The E2B API (``agentvm.e2b.app.make_app``) served by the daemon: uvicorn on its own
    loopback port, on the daemon's loop, over the ControlPlane in-process
    (``agentvm.e2b.cpbackend``), its sandboxes kept in ``<home>/e2b/sandboxes.db`` across
    restarts, its records on the daemon's audit chain with the tenant as actor (``e2b:TENANT``).

    A port of its own, not the daemon's ``--listen``: the E2B SDKs need what the daemon's
    transport deliberately does not do (keep-alive, long Connect streams, WebSockets for
    ``get_host``, routing by ``Host``), and every path but ``/v1`` on that listener is the web
    console's; two listeners keep the daemon's bearer-token API and the E2B API's X-API-Key
    tenants from ever being confused."""

    def __init__(self, cp, server, task, url: str, domain: str) -> None:
        self.cp, self.server, self.task, self.url, self.domain = cp, server, task, url, domain

    @classmethod
    async def start(cls, cp, *, listen: str, max_per_tenant: int = 20, max_creating: int = 4) -> "E2BServer":
        import json

        import uvicorn

        from agentvm import e2b as pkg
        from agentvm.e2b.app import make_app
        from agentvm.e2b.cpbackend import ControlPlaneBackend
        from agentvm.e2b.store import E2BStore

        host, port = parse_e2b_listen(listen)
        home = cp.paths.home
        pkg.api_keys(home)  # the first key exists before anyone asks for it

        def audit(kind, **data):
            tenant = data.pop("tenant", None)
            cp.record(kind, actor=f"e2b:{tenant}" if tenant else "e2b", sandbox=data.pop("sandbox", None), **data)

        domain = f"localhost:{port}"
        app = make_app(ControlPlaneBackend(cp), lambda: pkg.api_keys(home, create=False), home=home,
                       max_per_tenant=max_per_tenant, max_concurrent_creates=max_creating, audit=audit,
                       domain=domain, store=E2BStore(pkg.state_dir(home) / "sandboxes.db"))

        class _InLoop(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the daemon's loop owns SIGTERM/SIGINT
                yield

        # a stop waits at most 5 s for open streams (a client following a process's output)
        from agentvm.e2b.listener import guarded_protocol

        # connections capped, heads due in time: local peers cannot hold the daemon's fds (docs/e2b.md)
        server = _InLoop(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                        http=guarded_protocol(),
                                        ws_max_size=16 << 20, ws_max_queue=1,  # (bounded: docs/e2b.md)
                                        log_config=None, access_log=False, timeout_graceful_shutdown=5))
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                from agentvm.errors import ConfigError

                raise ConfigError(f"the E2B API could not be served on {listen}: {exc or 'uvicorn stopped'}",
                                  hint="is the port in use? choose another with `agentvm up --e2b-listen`")
            await asyncio.sleep(0.02)
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        f = cp.paths.runtime / "e2b.json"
        f.write_text(json.dumps({"url": url, "pid": os.getpid(), "domain": domain, "by": "daemon"}))
        return cls(cp, server, task, url, domain)

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 30)
        except Exception:  # noqa: BLE001 - stopping anyway
            self.server.force_exit = True
            await asyncio.wait({self.task}, timeout=5)
        try:
            (self.cp.paths.runtime / "e2b.json").unlink()
        except FileNotFoundError:
            pass


def parse_e2b_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` on loopback (the E2B API is plain HTTP)."""
    import ipaddress

    from agentvm.errors import ConfigError

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError
        return host, int(port)
    except ValueError:
        raise ConfigError(f"--e2b-listen {listen!r}: a loopback HOST:PORT is required",
                          hint="the E2B API is plain HTTP: serve it on 127.0.0.1 (a TLS front is yours to add)") from None


def run_daemon(paths: Paths, *, listen: str | None = None, backend=None, accept_broken_chain: bool = False,
               otlp_endpoint: str | None = None, otlp_sample_allowed: float | None = None, gate_workers: int | str = "agent",
               resume: bool = True, e2b: dict | None = None) -> None:
    """Foreground entry point (``agentvm up --foreground``)."""
    check_chain(paths, accept_broken_chain)  # refuses a broken chain, or records its acceptance
    check_state(paths)
    from agentvm.observe.tracing import from_env_or

    # a bad URL or ratio refuses here, before anything starts
    tracing = from_env_or(otlp_endpoint, otlp_sample_allowed)
    import resource

    # one daemon serves every sandbox, client and gate connection of the host: the default
    # soft limit of 1024 descriptors is a ceiling it would hit (every fd path is poll/epoll based)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))

    async def main():
        from concurrent.futures import ThreadPoolExecutor

        # blocking substrate calls (prepare, launch, exec, stop, destroy) run in threads; never
        # let a busy fleet starve them (the default pool is cpu+4 threads)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=256,
                                                                           thread_name_prefix="agentvm"))
        d = Daemon(paths, backend=backend, listen=listen, tracing=tracing, gate_workers=gate_workers, resume=resume,
                   e2b=e2b)
        if tracing is not None:
            d.record("daemon.tracing", endpoint=tracing.endpoint, sample_allowed=tracing.sample_allowed)
        # (an accepted break is on the chain already: check_chain recorded it)
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, d.stopping.set)
        from agentvm import workspace

        # the workspace pool stays mounted while the daemon runs (no btrfs mount/unmount per start
        # or rm); at shutdown it is removed when empty, else unmounted when nobody else uses it
        with workspace.keep_pool(paths.workspaces, paths.runtime):
            await d.serve()

    from agentvm.gate.server import run

    run(main())
