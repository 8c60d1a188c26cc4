"""The embedded gate (``agentvm run`` without a daemon), started when it is first needed.

Importing and starting the gate (asyncio, h11, cryptography, its CA) takes longer than
starting a sandbox. So the sandbox's socket is bound, owned and listening *before* the
sandbox starts - there is never a moment without the gate's socket - and the gate itself is
started, in a background thread, when the first connection arrives on it; it then takes over
that listening socket. The connection waits in the backlog meanwhile (the first request of
a run pays the gate's start once). A sandbox that never connects never starts a gate. If
the gate cannot start, the socket is closed and every waiting connection is refused (fail
closed), and the run reports it.

The gate that serves is, by default, not this process: one confined, unprivileged gate worker
process (agentvm.gate.embedded_worker), forked early and told to start on the first connection.
See LazyGate for which sandboxes the in-process gate still serves, and docs/gate-embedded.md.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from agentvm.errors import AgentVMError, BackendError
from agentvm.fsutil import bind_unix_listener

START_TIMEOUT = 30.0


class PendingEndpoint:
    """A sandbox's gate endpoint that may still be coming up."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._claimed = False  # the starting gate owns the socket from here on
        self._abandoned = False
        self._done = threading.Event()
        self._ep = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # the attach thread (it polls the socket)

    def _set(self, ep=None, error: BaseException | None = None) -> None:
        self._ep, self._error = ep, error
        self._done.set()

    def abandon_if_unused(self) -> bool:
        """The sandbox is gone: if it never connected (the gate has not claimed the socket and
        nothing waits in the backlog), close the socket without waiting for a gate - True. Else
        False: the gate serves (or refuses) what arrived, and result() has the outcome."""
        import select

        with self._lock:
            if self._abandoned:
                return True
            if self._claimed or self._done.is_set():
                return False
            p = select.poll()
            p.register(self.sock.fileno(), select.POLLIN)
            if p.poll(0):
                return False
            self._abandoned = True
        try:
            os.write(self._wake_w, b"x")  # the waiter stops waiting for a first connection
        except OSError:
            pass  # it already stopped
        self._close_wake()
        self.sock.close()  # only here, or by the attach thread: never both (the lock decides)
        # the attach thread's poll holds the listening socket until it wakes: once it is gone,
        # the socket is really closed and a connection is refused
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)
        return True

    def _close_wake(self) -> None:
        fd, self._wake_w = self._wake_w, -1
        if fd >= 0:
            os.close(fd)

    def result(self, timeout: float = START_TIMEOUT):
        if not self._done.wait(timeout):
            self._close_wake()
            raise BackendError(f"the egress gate did not start within {timeout:g}s")
        self._close_wake()
        if self._error is not None:
            raise BackendError(f"the egress gate failed to start: {type(self._error).__name__}: {self._error}") from self._error
        return self._ep


class _Lazy:
    """One gate implementation, started (in a background thread) when first needed."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self.started = False
        self.impl_ = None
        self.error: BaseException | None = None

    def ensure_started(self) -> None:
        with self._lock:
            if not self.started:
                self.started = True
                threading.Thread(target=self._start, name="agentvm-gate-start", daemon=True).start()

    def _start(self) -> None:
        try:
            self.impl_ = self.factory()
        except BaseException as exc:  # noqa: BLE001 - reported to every endpoint
            self.error = exc
        finally:
            self.ready.set()

    def impl(self, timeout: float = START_TIMEOUT):
        self.ensure_started()
        if not self.ready.wait(timeout):
            raise BackendError(f"the egress gate did not start within {timeout:g}s")
        if self.error is not None:
            if isinstance(self.error, AgentVMError):
                raise self.error
            raise BackendError(f"the egress gate failed to start: {self.error}") from self.error
        return self.impl_

    def running(self):
        """The started implementation, or None (never started, or failed)."""
        if not self.started:
            return None
        self.ready.wait(START_TIMEOUT)
        return self.impl_


class LazyGate:
    """The embedded run's gate. By default each sandbox's socket is served by one confined gate
    worker process (agentvm.gate.embedded_worker: unprivileged, its own uid, no capabilities,
    no_new_privs, Landlock, seccomp) - a sandbox with tools too: the worker parses its /mcp
    requests, and their tool gateway lives here, asked with plain data; the in-process gate (a
    thread of this process, as root) serves only what a worker cannot (agentvm.gate.workers.
    unplaceable: credentials not of the vault), the tool gateways' own remote servers, or every
    sandbox with the explicit opt-in ``AGENTVM_GATE_UNCONFINED=1``. Each placement is recorded (``record``: the run's audit
    chain; :meth:`placement` for the run's result). A confined gate that cannot be had refuses
    the run (fail closed).

    ``confine``: None - confined unless the opt-in is set; False - the in-process gate (tests
    of the gate itself); True - confined whatever the environment says. ``lease_dir``: where the
    worker's uid is leased (the anonymous runs' lease directory)."""

    def __init__(self, state_dir: Path, log_dir: Path, approvals_factory=None, *, record=None,
                 lease_dir: Path | None = None, confine: bool | None = None) -> None:
        from agentvm.gate import embedded_worker as EW

        self.state_dir, self.log_dir = state_dir, log_dir
        self.approvals_factory = approvals_factory
        self._record = record
        self.lease_dir = Path(lease_dir) if lease_dir is not None else Path(state_dir).parent / "run" / "uid-leases"
        self.opt_in = EW.unconfined_opt_in() if confine is None else not confine
        self.confine = not self.opt_in
        self._pending: set[PendingEndpoint] = set()  # endpoints not yet served or abandoned
        self._inproc = _Lazy(self._make_inprocess)
        self._confined = _Lazy(self._make_confined)
        self._where: dict[str, _Lazy] = {}  # sandbox -> the implementation serving it
        self._lease = None  # the confined worker's uid lease
        self._lease_lock = threading.Lock()
        self._zygote = None
        self._noted = False
        self._placements: dict[str, dict] = {}  # sandbox -> where its gate runs (placement())
        self._problem = EW.confinable() if self.confine else None

    def prefork(self) -> None:
        """Fork the gate worker now, before this process reads a secret (the vault, for the
        sandbox's credentials): it keeps a copy of this process's memory until it confines
        itself. Call it before ``prepare`` when the policy has credentials; otherwise the worker
        is forked at the sandbox's first connection (nothing secret in memory then), and a run
        whose sandbox never connects pays nothing (a fork costs the rest of the run copies of
        the pages it writes while the two processes share them)."""
        from agentvm import vault

        with self._lease_lock:
            if (self.confine and self._problem is None and self._zygote is None and not self._confined.started
                    and not vault.held_secrets()):
                from agentvm.gate.embedded_worker import Zygote

                self._zygote = Zygote(preload=True)

    @property
    def _started(self) -> bool:
        return self._inproc.started or self._confined.started

    def _make_inprocess(self):
        impl = EmbeddedGate(self.state_dir, self.log_dir)
        impl.gate.approvals_factory = self.approvals_factory
        return impl

    def _make_confined(self):
        from agentvm.gate.embedded_worker import ConfinedGate, worker_argv

        zygote, self._zygote = self._zygote, None
        if zygote is not None and not zygote.used:  # it starts now, beside this side's own imports
            zygote.go(worker_argv(Path(self.state_dir), Path(self.log_dir), self._lease.uid))
        return ConfinedGate(self.state_dir, self.log_dir, uid=self._lease.uid, zygote=zygote, on_event=self._event,
                            approvals=self.approvals_factory, host_gate=_HostGate(self))

    def _event(self, kind: str, **data) -> None:
        """A worker lost, replaced, or killed by its seccomp filter (a security alert): on the chain."""
        sids = data.get("sandboxes") or []
        self._rec(kind, sandbox=sids[0] if len(sids) == 1 else None, **data)

    def _rec(self, kind: str, sandbox: str | None = None, **data) -> None:
        if self._record is not None:
            self._record(kind, sandbox=sandbox, **data)

    def impl(self, timeout: float = START_TIMEOUT):
        """The in-process gate (started if it is not)."""
        return self._inproc.impl(timeout)

    @property
    def gate(self):  # the in-process gate (its subscribers, endpoints...)
        return self.impl().gate

    def _place(self, sandbox_id: str) -> _Lazy | None:
        """At open: the in-process gate (the opt-in, recorded), None (decided at the first
        connection: :meth:`_decide`), or a refusal when the gate must be confined and cannot."""
        from agentvm.gate import embedded_worker as EW

        if self.opt_in:
            self._placements[sandbox_id] = {"confined": False, "uid": os.geteuid(), "opt_in": EW.UNCONFINED_ENV,
                                            "reason": f"opt-in: {EW.UNCONFINED_ENV}=1"}
            self._rec("gate.unconfined", sandbox=sandbox_id, reason=f"opt-in: {EW.UNCONFINED_ENV}=1",
                      opt_in=EW.UNCONFINED_ENV, uid=os.geteuid())
            if not self._noted:
                self._noted = True
                import sys

                print(f"agentvm: note: {EW.UNCONFINED_ENV}=1: the egress gate runs unconfined in this process "
                      f"(uid {os.geteuid()}); recorded on the audit chain", file=sys.stderr)
            return self._inproc
        if self._problem is not None:
            raise EW.refusal(self._problem)
        return None

    def _decide(self, sandbox_id: str, policy, creds, extras) -> _Lazy:
        """At the first connection (off the run's critical path): the confined worker, or the
        in-process gate for a sandbox that needs state only this process holds. Recorded."""
        from agentvm.gate.embedded_worker import Zygote, worker_argv

        with self._lease_lock:
            if self._lease is None:
                from agentvm import identity

                self._lease = identity.lease_identity(self.lease_dir, f"gate-{sandbox_id}",
                                                      Path(self.state_dir).parent)
            from agentvm import vault

            if self._zygote is None and not self._confined.started and not vault.held_secrets():
                # not forked early (see prefork): now. (A process that has held a secret - an
                # earlier run's, in an SDK user or the selftest - forks nothing: the worker is a
                # fresh interpreter, whose memory never held one)
                self._zygote = Zygote()
            z = self._zygote
            if z is not None and not z.used:
                # (told now, so that its imports run beside this side's; unplaceable() decides)
                z.go(worker_argv(Path(self.state_dir), Path(self.log_dir), self._lease.uid))
        from agentvm.gate.workers import unplaceable

        # a sandbox with tools is served by the worker too - its /mcp requests' HTTP and
        # JSON-RPC parsed there (agentvm.tools.front) - and its tool gateway (tool servers,
        # approvals) lives in this process, whose in-process gate serves the remote tool
        # servers' egress and keeps the approvals queue (started now, ready by the first call)
        if getattr(getattr(extras, "tools", None), "servers", None):
            self._inproc.ensure_started()
        why = unplaceable(policy, extras, creds, tools=True)
        if why is not None:
            self._placements[sandbox_id] = {"confined": False, "uid": os.geteuid(), "reason": why}
            self._rec("gate.unconfined", sandbox=sandbox_id, reason=why, uid=os.geteuid())
            return self._inproc
        self._placements[sandbox_id] = {"confined": True, "uid": self._lease.uid}
        self._rec("gate.confined", sandbox=sandbox_id, uid=self._lease.uid)
        return self._confined

    def placement(self, sandbox_id: str) -> dict | None:
        """Where ``sandbox_id``'s gate ran, for the run's result: {"confined": bool, "uid": int,
        and "reason"/"opt_in" when unconfined}; None when no gate served it (it never connected)."""
        p = self._placements.get(sandbox_id)
        return dict(p) if p is not None else None

    def open(self, sandbox_id: str, agent: str, policy, sock_path: Path, uid: int | None, creds=None,
             extras=None, bridge_key: str = "") -> PendingEndpoint:
        """Bind, own and listen on the sandbox's socket now; the gate serves it when it is up."""
        placed = self._place(sandbox_id)
        s = bind_unix_listener(Path(sock_path), uid, 128)
        pending = PendingEndpoint(s)

        def attach() -> None:
            import select

            p = select.poll()  # wait, without the GIL, for a first connection (or the end)
            p.register(s.fileno(), select.POLLIN)
            p.register(pending._wake_r, select.POLLIN)
            try:
                try:
                    while True:
                        ready = dict(p.poll())
                        if pending._wake_r in ready:
                            return  # abandoned: the sandbox never connected
                        if s.fileno() in ready:
                            break
                finally:
                    os.close(pending._wake_r)
                with pending._lock:
                    if pending._abandoned:
                        return
                    pending._claimed = True
                lazy = placed or self._decide(sandbox_id, policy, creds, extras)
                self._where[sandbox_id] = lazy
                impl = lazy.impl()
                pending._set(impl.open(sandbox_id, agent, policy, sock_path, uid, creds=creds, sock=s, extras=extras,
                                       bridge_key=bridge_key))
            except BaseException as exc:  # noqa: BLE001
                with pending._lock:
                    mine = not pending._abandoned
                if mine:
                    s.close()  # fail closed: waiting connections are refused
                pending._set(error=exc)
            finally:
                self._pending.discard(pending)

        self._pending.add(pending)

        pending._thread = threading.Thread(target=attach, name=f"agentvm-gate-{sandbox_id}", daemon=True)
        pending._thread.start()
        return pending

    def close(self, sandbox_id: str):
        lazy = self._where.pop(sandbox_id, None)
        impl = lazy.running() if lazy is not None else None
        if impl is None:
            return None
        return impl.close(sandbox_id)

    def worker_pids(self) -> list[int]:
        """The confined gate worker's pid(s) while it runs (tests, diagnostics)."""
        impl = self._confined.impl_
        return impl.alive() if impl is not None else []

    def stop(self) -> None:
        for pending in list(self._pending):
            pending.abandon_if_unused()
        killed = True  # (the confined worker runs no more code: its uid may be leased again)
        for lazy in (self._inproc, self._confined):
            if lazy.started:
                lazy.ready.wait(START_TIMEOUT)  # (one coming up now would serve, unstopped, after the run)
            if lazy.ready.is_set() and lazy.impl_ is not None:
                r = lazy.impl_.stop()
                if lazy is self._confined:
                    killed = bool(r)
            elif lazy is self._confined and lazy.started and not lazy.ready.is_set():
                # still starting: nothing of it serves anyone (every endpoint was closed or
                # abandoned), but its worker may yet run as the leased uid - the lease is kept
                # (not released), so the next leaser of that uid checks it for processes
                killed = False
        z, self._zygote = self._zygote, None
        if z is not None:
            z.abandon() if z.used else z.discard()
        if self._lease is not None:
            from agentvm import identity

            if killed:
                identity.release_lease(self._lease)
            elif self._lease.lease_fd is not None:
                os.close(self._lease.lease_fd)  # a process of that uid may remain: the next leaser checks it
            self._lease = None


class _HostGate:
    """The run's in-process gate as the confined worker's pool sees its host's gate - for a
    sandbox's tool gateway, which runs on the pool's loop: its approvals queue, the CA, and its
    remote servers' endpoints, opened and closed on the in-process gate's own loop (its state
    is that loop's). Started when a sandbox with tools connects (LazyGate._decide)."""

    def __init__(self, lazy: "LazyGate") -> None:
        self._lazy = lazy

    def _impl(self) -> "EmbeddedGate":
        return self._lazy.impl()

    def __getattr__(self, name: str):  # (approval_store, ca, endpoints: read only)
        return getattr(self._impl().gate, name)

    async def _on_its_loop(self, name: str, *a, **kw):
        import asyncio

        impl = await asyncio.to_thread(self._impl)  # (this loop does not wait for its start)
        coro = getattr(impl.gate, name)(*a, **kw)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, impl.loop))

    async def open_endpoint(self, *a, **kw):
        return await self._on_its_loop("open_endpoint", *a, **kw)

    async def close_endpoint(self, *a, **kw):
        return await self._on_its_loop("close_endpoint", *a, **kw)


class EmbeddedGate:
    """The gate in a background thread of the current process (``agentvm run`` without a daemon)."""

    def __init__(self, state_dir: Path, log_dir: Path):
        from agentvm.gate.server import Gate, new_event_loop

        self.gate = Gate(state_dir, log_dir)
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentvm-gate", daemon=True)
        self._thread.start()

    def call(self, coro, timeout: float = 10.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open(self, sandbox_id: str, agent: str, policy, sock_path: Path, uid: int | None, creds=None, sock=None,
             extras=None, bridge_key: str = ""):
        return self.call(self.gate.open_endpoint(sandbox_id, agent, policy, sock_path, uid=uid, creds=creds, sock=sock,
                                                 extras=extras, bridge_key=bridge_key))

    def close(self, sandbox_id: str):
        return self.call(self.gate.close_endpoint(sandbox_id))

    def stop(self) -> None:
        import asyncio

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
