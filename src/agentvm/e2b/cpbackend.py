"""The E2B backend over the daemon's ControlPlane, in the daemon's own process.

:class:`ControlPlaneBackend` is what the daemon serves the E2B API with (``agentvm up
--e2b-listen``): every call is a typed ControlPlane call on the daemon's loop (create,
start_and_wait, stop, remove, exec, copy_in, sandbox), so no HTTP hop, no token and no second
process sit between the E2B API and the sandboxes. The operations that are commands inside
the sandbox (stat, listing, mkdir, move, remove, signals, stdin through the wrapper's FIFOs)
are :class:`agentvm.e2b.backend.DaemonBackend`'s, run through this backend's exec: the same
sandbox view and the same controls whichever backend serves.

``agentvm e2b serve`` keeps using DaemonBackend (the daemon's HTTP client) from its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import AsyncIterator

from agentvm.e2b.backend import HEAD_LIMIT, BackendFailure, DaemonBackend, EventChannel, ExecEvent, \
    ExecSpec, RUN_OUTPUT_LIMIT, Unsupported, Upload, _FifoControl, check_env, started, wrapped_argv
from agentvm.errors import AgentVMError

ACTOR = "e2b-adapter"  # the daemon's own records of the adapter's calls (its e2b.* records name the tenant)

_KINDS = {"sandbox.not-found": "not-found", "files.not-found": "not-found", "sandbox.not-running": "gone"}


def _failure(exc: AgentVMError) -> BackendFailure:
    code = getattr(exc, "code", "") or ""
    kind = _KINDS.get(code)
    if kind is None:
        kind = "permission" if code.startswith("files.") or getattr(exc, "status", 0) == 403 else "internal"
    return BackendFailure(kind, f"{exc} ({code})")


class _Collect:
    """A pump Output into a coroutine function (the control plane's exec streams into it).
    The pump awaits each write: ``on_data`` waiting for room in a full channel is what stops
    the pump, so the sandbox's pipe fills and the command blocks (back-pressure)."""

    def __init__(self, on_data):
        self.on_data = on_data

    async def start(self) -> None:
        pass

    async def write(self, stream: str, data: bytes) -> None:
        await self.on_data(stream, data)

    def hangup(self):
        return None


class _Wrapped:
    """What both process kinds share: a command run under the wrapper (``_WRAPPER``), whose
    first line on ``_head_stream`` is its pid (taken off the output: ``\\x1e<pid>``), its output
    and its end as events in a bounded channel (a full one stops the daemon's pump)."""

    _head_stream = "stderr"  # where the wrapper writes its pid (and where an unparsed head goes)
    _pid_line = re.compile(rb"\x1e(\d+)")

    def _begin(self) -> None:
        self.pid = 0
        self._queue = EventChannel()
        self._started = asyncio.Event()
        self._head = b""
        self._head_done = False

    def _started_with(self, pid: int) -> None:
        if not self._started.is_set():
            self.pid = pid
            self._started.set()

    async def _head_data(self, data: bytes) -> None:
        """Output of ``_head_stream``: its first line is the wrapper's pid (bounded: a first line
        longer than HEAD_LIMIT is not the wrapper's), the rest goes on as output."""
        if self._head_done:
            await self._queue.put(ExecEvent(self._head_stream, data))
            return
        self._head += data
        if b"\n" not in self._head and len(self._head) < HEAD_LIMIT:
            return
        line, _, rest = self._head.partition(b"\n")
        self._head_done = True
        m = self._pid_line.fullmatch(line)
        self._started_with(int(m.group(1)) if m else 0)
        if not m:
            rest = self._head
        self._head = b""
        if rest:
            await self._queue.put(ExecEvent(self._head_stream, rest))

    async def _end(self, run) -> None:
        """Await ``run()`` (the control plane's exec: its ExitStatus) and finish the events with
        the command's end: its exit status, or -1 with why it failed; started in any case."""
        try:
            status = await run()
            if not self._head_done and self._head:
                await self._queue.put(ExecEvent(self._head_stream, self._head))
                self._head = b""
            err = str(status.setup_error) if status.setup_error else ("timed out" if status.timed_out else None)
            self._queue.finish(ExecEvent("exit", exit_code=int(status.exit_code), error=err))
        except asyncio.CancelledError:
            self._queue.finish(ExecEvent("exit", exit_code=-1, error="cancelled"))
            raise
        except AgentVMError as exc:
            self._queue.finish(ExecEvent("exit", exit_code=-1, error=str(_failure(exc))))
        except Exception as exc:  # noqa: BLE001 - reported to the client as the process's end
            self._queue.finish(ExecEvent("exit", exit_code=-1, error=f"{type(exc).__name__}: {exc}"))
        finally:
            self._started_with(0)

    async def wait_started(self) -> None:
        await self._started.wait()

    def events(self) -> AsyncIterator[ExecEvent]:
        return self._queue.events()


class _CPProcess(_Wrapped, _FifoControl):
    """One exec on the control plane, its output parsed as the wrapper writes it (its pid on
    the first stderr line) into events."""

    def __init__(self, backend: "ControlPlaneBackend", name: str, argv: list[str], timeout: float | None,
                 stdin: bool):
        self._begin()
        self._name, self._stdin, self._backend = name, stdin, backend
        self._task = asyncio.ensure_future(self._end(lambda: backend.cp.exec(
            name, argv, _Collect(self._data), timeout=timeout, actor=ACTOR)))

    async def _data(self, stream: str, data: bytes) -> None:
        if stream == "stderr":
            await self._head_data(data)
            return
        await self._queue.put(ExecEvent(stream, data))

    def close(self) -> None:
        """Nobody reads the events any more: the queued output is released and the pump's
        writes return at once (the daemon drains the command's pipes until it ends)."""
        self._queue.close()

    def abort(self) -> None:
        """The Start that asked for this process was cancelled before it was handed out: its
        events are released and the control plane's exec is cancelled (nobody will follow it)."""
        self.close()
        self._task.cancel()


class _PtyProcess(_Wrapped):
    """A command on a terminal: the control plane's interactive exec (``exec_attached`` with a
    pty made by the daemon, whose master never enters the sandbox), its input and resizes
    relayed as typed events. The command runs under the same wrapper as any other (its pid is
    the wrapper's first line on the terminal, taken off the output), so kill and signals go
    through the wrapper's control FIFO: a process group of a terminal cannot be signalled
    with SIGKILL through the terminal."""

    _head_stream = "pty"  # the whole terminal: the wrapper's pid is its first line
    _pid_line = re.compile(rb"\x1e(\d+)\r?")

    def __init__(self, backend: "ControlPlaneBackend", name: str, argv: list[str], size: tuple[int, int],
                 timeout: float | None):
        from agentvm.daemon.pump import QueueAttached

        self._begin()  # (the terminal fills when the channel is full)
        self._backend, self._name = backend, name
        self.io = QueueAttached(self._out)
        cols, rows = size
        self._task = asyncio.ensure_future(self._end(lambda: backend.cp.exec_attached(
            name, argv, self.io, tty=(rows, cols), timeout=timeout, actor=ACTOR)))

    async def _out(self, stream: str, data: bytes) -> None:
        await self._head_data(data)

    def close(self) -> None:
        """Nobody reads the events any more: the queued output is released, the pump's writes
        return at once, and the terminal is hung up as for a client that went away."""
        self._queue.close()
        if not self.io.gone.done():
            self.io.gone.set_result(b"")
        with contextlib.suppress(asyncio.QueueFull):
            self.io.input.put_nowait(None)

    async def write_stdin(self, data: bytes) -> None:
        from agentvm.daemon.pump import StdinData

        if self._task.done():
            raise BackendFailure("not-found", f"process {self.pid} is gone")
        for i in range(0, len(data), 64 * 1024):
            await self.io.input.put(StdinData(data[i:i + 64 * 1024]))

    async def close_stdin(self) -> None:
        from agentvm.daemon.pump import StdinEof

        await self.io.input.put(StdinEof())

    async def resize(self, cols: int, rows: int) -> None:
        from agentvm.daemon.pump import Resize

        if not (0 < cols <= 1000 and 0 < rows <= 1000):
            raise BackendFailure("invalid", "a terminal of 1..1000 columns and rows")
        await self.io.input.put(Resize(rows, cols))


class _Out:
    """The whole output of one of the adapter's own commands (stat, find, head -c ...), kept up
    to RUN_OUTPUT_LIMIT bytes: past it the rest is dropped and the call fails."""

    def __init__(self):
        self.out, self.err = [], []
        self.size, self.over = 0, False

    async def start(self) -> None:
        pass

    async def write(self, stream: str, data: bytes) -> None:
        self.size += len(data)
        if self.size > RUN_OUTPUT_LIMIT:
            if not self.over:
                self.over = True
                self.out.clear()
                self.err.clear()
            return
        (self.out if stream == "stdout" else self.err).append(data)

    def hangup(self):
        return None


class ControlPlaneBackend(DaemonBackend):
    """E2BBackend over a ControlPlane (``cp``) on the same loop."""

    def __init__(self, cp):
        self.cp = cp
        self.client = None  # nothing here goes through the HTTP client

    async def _cp(self, coro):
        try:
            return await coro
        except AgentVMError as exc:
            raise _failure(exc) from exc

    def _sync(self, fn, *a):
        try:
            return fn(*a)
        except AgentVMError as exc:
            raise _failure(exc) from exc

    # -- sandboxes --------------------------------------------------------------------------
    async def _create(self, name: str, spec_text: str, ttl: float | None) -> None:
        await self._cp(self.cp.create(spec_text, f"<e2b:{name}>", ttl=ttl, actor=ACTOR))

    async def _start(self, name: str) -> None:
        await self._cp(self.cp.start_and_wait(name, actor=ACTOR))

    async def _remove(self, name: str) -> None:
        await self._cp(self.cp.remove(name, actor=ACTOR))

    async def pause(self, name: str) -> None:
        """The daemon's suspend (a checkpoint: processes and memory kept) where the substrate
        can; else (bubblewrap: ``backend.suspend-unsupported``; connections open:
        ``sandbox.suspend-busy``) a stop, the workspace kept."""
        suspend = getattr(self.cp, "suspend", None)
        if suspend is not None:
            try:
                await suspend(name, actor=ACTOR)
                return
            except AgentVMError as exc:
                # cannot checkpoint here (bubblewrap), or not now (open egress connections)
                if exc.code not in ("backend.suspend-unsupported", "sandbox.suspend-busy"):
                    raise _failure(exc) from exc
        await self._cp(self.cp.stop(name, actor=ACTOR))

    async def resume(self, name: str) -> None:
        row = self._sync(self.cp.row, name)
        if row.state == "suspended" and hasattr(self.cp, "resume_sandbox"):
            await self._cp(self.cp.resume_sandbox(name, actor=ACTOR, why="e2b"))
            return
        await self._start(name)

    async def _rows(self) -> list[dict]:
        return self._sync(self.cp.sandboxes)

    async def _get(self, name: str) -> dict:
        return self._sync(self.cp.sandbox, name)

    # -- processes --------------------------------------------------------------------------
    async def exec(self, name: str, spec: ExecSpec):
        check_env(spec.env)
        if name not in self.cp.managed or self.cp.managed[name].handle is None:
            self._sync(self.cp.row, name)  # not-found before not-running
            raise BackendFailure("gone", f"{name} is not running")
        if spec.pty is not None:
            proc = self._exec_pty(name, spec)
            await started(proc)  # (cancelled: its terminal is hung up)
            return proc
        argv = wrapped_argv(spec, "e2b-exec", "1" if spec.stdin else "0")
        proc = _CPProcess(self, name, argv, spec.timeout, spec.stdin)
        await started(proc)
        return proc

    def _exec_pty(self, name: str, spec: ExecSpec) -> _PtyProcess:
        if not hasattr(self.cp, "exec_attached"):
            raise Unsupported("a pty needs the daemon's interactive exec, which this daemon does not have")
        return _PtyProcess(self, name, wrapped_argv(spec, "e2b-pty", "2"), spec.pty, spec.timeout)

    async def _run(self, name: str, argv: list[str]) -> tuple[int, bytes, bytes]:
        out = _Out()
        status = await self._cp(self.cp.exec(name, argv, out, timeout=60, actor=ACTOR))
        if out.over:
            raise BackendFailure("invalid", f"the answer is larger than {RUN_OUTPUT_LIMIT} bytes")
        return int(status.exit_code), b"".join(out.out), b"".join(out.err)

    # -- files --------------------------------------------------------------------------------
    async def _put_file(self, name: str, rel: str, data) -> None:
        if isinstance(data, Upload):  # staged by copy_in on the state disk as it is read: never whole in memory
            data.rewind()
        await self._cp(self.cp.copy_in(name, rel, data, actor=ACTOR))
