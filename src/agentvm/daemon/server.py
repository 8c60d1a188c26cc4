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
"""

from __future__ import annotations

import asyncio
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
                 gate_workers: int = 0, resume: bool = True) -> None:
        super().__init__(paths, backend=backend, tracing=tracing, gate_workers=gate_workers, resume=resume)
        self.http = HttpServer(self, listen)

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
        await self.http.start()
        self.record("daemon.started", pid=os.getpid(), socket=str(self.socket_path), tcp=self.listen)
        await self.stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        self.http.close_listeners()
        await self.close()
        self.http.remove_socket()


def run_daemon(paths: Paths, *, listen: str | None = None, backend=None, accept_broken_chain: bool = False,
               otlp_endpoint: str | None = None, otlp_sample_allowed: float | None = None, gate_workers: int = 0,
               resume: bool = True) -> None:
    """Foreground entry point (``agentvm up --foreground``)."""
    accepted = check_chain(paths, accept_broken_chain)
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
        d = Daemon(paths, backend=backend, listen=listen, tracing=tracing, gate_workers=gate_workers, resume=resume)
        if tracing is not None:
            d.record("daemon.tracing", endpoint=tracing.endpoint, sample_allowed=tracing.sample_allowed)
        if accepted:
            d.record("daemon.accepted-broken-chain", problem=accepted)
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, d.stopping.set)
        await d.serve()

    from agentvm.gate.server import run

    run(main())
