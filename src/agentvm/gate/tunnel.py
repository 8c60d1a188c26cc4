"""Opaque tunnels: a spliced CONNECT (``splice(2)`` through pipes, the bytes never enter
Python) and a stream relay (an upgraded WebSocket). Bytes out count against the sandbox's
limit on every path."""

from __future__ import annotations

import asyncio
import os
import socket

from agentvm.gate.endpoint import Endpoint
from agentvm.gate.streams import PlainStream

SPLICE_READ = 262144


async def stream_splice(ep: Endpoint, client, upstream: PlainStream, target: tuple[str, int]) -> tuple[int, int]:
    """Relay both ways through Python (an upgraded WebSocket, where one side may be TLS
    terminated by the gate); returns (bytes out, bytes in)."""
    counts = [0, 0]

    async def pump(src, dst, idx: int, outbound: bool):
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
                write_eof = getattr(dst, "write_eof", None)  # a plain connection (TLS: none)
                if write_eof is not None:
                    write_eof()
            except (OSError, RuntimeError):
                pass

    await _both_ways(pump(client, upstream, 0, True), pump(upstream, client, 1, False))
    return counts[0], counts[1]

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
    tr = stream.transport
    tr.pause_reading()
    fd = os.dup(tr.get_extra_info("socket").fileno())
    os.set_blocking(fd, False)
    buffered = stream.take_buffered()
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


async def zero_copy_splice(ep: Endpoint, client: PlainStream, upstream: PlainStream, target: tuple) -> tuple[int, int]:
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
