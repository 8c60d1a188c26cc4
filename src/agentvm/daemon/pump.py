"""A command's output, streamed to whoever asked for it while it runs (``exec``, ``run``):
the control plane's side of an output stream, whatever carries it (HTTP NDJSON, frames).

:class:`Output` is what a transport gives the control plane; :func:`pump` moves a command's
output pipes into it with back-pressure.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Protocol, Union


class ClientGone(ConnectionError):
    """The client of a streamed answer went away (not an error of the run itself)."""


class Output(Protocol):
    """Where a command's output goes (a transport's stream to its client)."""

    async def start(self) -> None:
        """The stream begins (a refusal from here on is part of it, not an error answer)."""

    async def write(self, stream: str, data: bytes) -> None:
        """``data`` of ``stream`` (``stdout`` or ``stderr``); raises ConnectionError or
        OSError when the client is gone."""

    def hangup(self):
        """An awaitable that finishes when the client hangs up (b"" or an error), or None."""


async def pump(streams: dict[int, str], fut, our_ends: tuple[int, ...], out: Output, on_gone=None):
    """Stream a command's output pipes to ``out`` *while* it runs, then return its result.

    Back-pressure, not buffering: at most a few chunks are queued; when the client reads
    slowly the pipes stop being read, fill, and the writer inside the sandbox blocks - the
    root daemon's memory never grows with a command's output. ``our_ends`` (our copies of
    the child's stdio) are closed only once the blocking call is over, so no fd number is
    freed while another thread may still use it. A client that goes away stops receiving;
    the pipes are still drained until the command ends (``on_gone()`` may end it sooner)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=8)
    paused: set[int] = set()
    live = set(streams)

    def readable(fd):
        if queue.full():
            loop.remove_reader(fd)
            paused.add(fd)
            return
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
        queue.put_nowait((fd, data))

    for fd in streams:
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable, fd)
    ends_open, client = True, True

    def gone() -> None:
        nonlocal client
        client = False
        if on_gone is not None:
            on_gone()

    hangup = out.hangup()
    try:
        while live:
            get = asyncio.ensure_future(queue.get())
            waits = {get, fut} if ends_open else {get}
            if hangup is not None and client:
                waits.add(hangup)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if hangup is not None and client and hangup.done():
                if hangup.cancelled() or hangup.exception() is not None or hangup.result() == b"":
                    gone()
                hangup = None
            if ends_open and fut.done():
                for fd in our_ends:
                    os.close(fd)
                ends_open = False
            if not get.done():
                get.cancel()
                continue
            fd, data = get.result()
            if not data:
                live.discard(fd)
            elif client:
                try:
                    await out.write(streams[fd], data)
                except (ConnectionError, OSError):
                    gone()
            for p in paused:
                if p in live:
                    loop.add_reader(p, readable, p)
            paused.clear()
    finally:
        if hangup is not None and not hangup.done():
            hangup.cancel()
        for fd in streams:
            loop.remove_reader(fd)
        if ends_open:
            await asyncio.wait({fut})
            for fd in our_ends:
                os.close(fd)
        for fd in streams:
            os.close(fd)
    if not client:
        raise ClientGone("the client went away")
    return await fut


# ---------------------------------------------------------------- interactive input
# What a client of an interactive session (``run`` or ``exec`` with stdin or a terminal) sends,
# whatever carries it (docs/daemon.md "Interactive sessions"): typed events, never raw frames.

SIGNALS = {"INT": 2, "TERM": 15, "HUP": 1, "QUIT": 3}  # what a client may forward


@dataclass(frozen=True)
class StdinData:
    data: bytes


@dataclass(frozen=True)
class StdinEof:
    pass


@dataclass(frozen=True)
class Resize:
    rows: int
    cols: int


@dataclass(frozen=True)
class Signal:
    name: str  # a key of SIGNALS


InputEvent = Union[StdinData, StdinEof, Resize, Signal]


class Attached(Output, Protocol):
    """An interactive session's transport: an Output that also reads the client's input."""

    async def read(self) -> InputEvent | None:
        """The client's next input event; None when the client is gone (its connection closed)."""


def set_winsize(fd: int, rows: int, cols: int) -> None:
    """The terminal's size (the kernel sends SIGWINCH to its foreground process group)."""
    import fcntl
    import struct
    import termios

    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    except OSError:
        pass


async def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to the non-blocking ``fd``, waiting (not buffering) while it is full:
    back-pressure from the sandbox's stdin to the client's socket."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
            continue
        except BlockingIOError:
            pass
        ready = loop.create_future()
        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fd)


async def feed(io: Attached, stdin_fd: int | None, *, tty_fd: int | None = None, on_signal=None,
               on_gone=None) -> None:
    """The client's input into a session until the client closes its stdin (then ``stdin_fd``
    is closed: the command reads EOF) or goes away (``on_gone()``). One event at a time: the
    next frame is read only once this one's bytes are in the pipe/terminal (so a client
    streaming 100 MB waits on the sandbox's reading, the daemon holds one frame).
    ``stdin_fd`` and ``tty_fd`` are this function's to close. Cancelled when the session ends."""
    try:
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        while True:
            ev = await io.read()
            if ev is None:
                if on_gone is not None:
                    on_gone()
                return
            if isinstance(ev, StdinData):
                if stdin_fd is not None:
                    try:
                        await write_all(stdin_fd, ev.data)
                    except OSError:  # the command closed its stdin: the rest is dropped
                        os.close(stdin_fd)
                        stdin_fd = None
            elif isinstance(ev, StdinEof):
                if stdin_fd is not None and tty_fd is None:
                    os.close(stdin_fd)
                    stdin_fd = None
            elif isinstance(ev, Resize):
                if tty_fd is not None:
                    set_winsize(tty_fd, ev.rows, ev.cols)
            elif isinstance(ev, Signal):
                if on_signal is not None:
                    on_signal(ev.name)
    finally:
        if stdin_fd is not None:
            os.close(stdin_fd)
        if tty_fd is not None:
            os.close(tty_fd)


class QueueAttached:
    """An Attached for in-process adapters (the E2B envd process service, tests): input events
    put on ``input`` (an asyncio.Queue of InputEvent; None: the client is gone), output handed
    to ``on_output(stream, data)`` (a coroutine function: awaiting it is the back-pressure)."""

    def __init__(self, on_output, maxsize: int = 4) -> None:
        self.input: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.on_output = on_output
        self.gone = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        return None

    async def write(self, stream: str, data: bytes) -> None:
        await self.on_output(stream, data)

    def hangup(self):
        return self.gone

    async def read(self):
        ev = await self.input.get()
        if ev is None:
            if not self.gone.done():
                self.gone.set_result(b"")
            self.input.put_nowait(None)
        return ev
