"""The embedded gate (``agentvm run`` without a daemon), started when it is first needed.

Importing and starting the gate (asyncio, h11, cryptography, its CA) takes longer than
starting a sandbox. So the sandbox's socket is bound, owned and listening *before* the
sandbox starts - there is never a moment without the gate's socket - and the gate itself is
started, in a background thread, when the first connection arrives on it; it then takes over
that listening socket. The connection waits in the backlog meanwhile (the first request of
a run pays the gate's start once). A sandbox that never connects never starts a gate. If
the gate cannot start, the socket is closed and every waiting connection is refused (fail
closed), and the run reports it.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from agentvm.errors import BackendError
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


class LazyGate:
    def __init__(self, state_dir: Path, log_dir: Path, approvals_factory=None) -> None:
        self.state_dir, self.log_dir = state_dir, log_dir
        self.approvals_factory = approvals_factory
        self._pending: set[PendingEndpoint] = set()  # endpoints not yet served or abandoned
        self._ready = threading.Event()
        self._start_lock = threading.Lock()
        self._started = False
        self._impl = None
        self._error: BaseException | None = None

    def _ensure_started(self) -> None:
        with self._start_lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._start, name="agentvm-gate-start", daemon=True).start()

    def _start(self) -> None:
        try:

            self._impl = EmbeddedGate(self.state_dir, self.log_dir)
            self._impl.gate.approvals_factory = self.approvals_factory
        except BaseException as exc:  # noqa: BLE001 - reported to every endpoint
            self._error = exc
        finally:
            self._ready.set()

    def impl(self, timeout: float = START_TIMEOUT):
        self._ensure_started()
        if not self._ready.wait(timeout):
            raise BackendError(f"the egress gate did not start within {timeout:g}s")
        if self._error is not None:
            raise BackendError(f"the egress gate failed to start: {self._error}") from self._error
        return self._impl

    @property
    def gate(self):  # the started gate (its subscribers, endpoints...)
        return self.impl().gate

    def open(self, sandbox_id: str, agent: str, policy, sock_path: Path, uid: int | None, creds=None,
             extras=None) -> PendingEndpoint:
        """Bind, own and listen on the sandbox's socket now; the gate serves it when it is up."""
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
                impl = self.impl()
                pending._set(impl.open(sandbox_id, agent, policy, sock_path, uid, creds=creds, sock=s, extras=extras))
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
        if not self._started:
            return None
        self._ready.wait(START_TIMEOUT)
        if self._impl is None:
            return None
        return self._impl.close(sandbox_id)

    def stop(self) -> None:
        for pending in list(self._pending):
            pending.abandon_if_unused()
        if self._ready.is_set() and self._impl is not None:
            self._impl.stop()
        # still starting: nothing of it serves anyone (every endpoint was closed or abandoned)


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
             extras=None):
        return self.call(self.gate.open_endpoint(sandbox_id, agent, policy, sock_path, uid=uid, creds=creds, sock=sock,
                                                 extras=extras))

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
