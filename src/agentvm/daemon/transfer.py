"""The HTTP side of ``cp``'s streams: an upload's body read a piece at a time as the control
plane stages it (:class:`BodyStream`), and a download sent from a file descriptor as the
socket drains (:func:`send_fd`). Neither holds more than one piece (SEND_CHUNK, or what one
socket read returns) in memory. ``agentvm.daemon.http`` uses them for
``PUT|GET /v1/sandboxes/NAME/files`` only; every other body is read whole, capped.
"""

from __future__ import annotations

import asyncio
import os

import h11

from agentvm.daemon.events import refuse

SEND_CHUNK = 1 << 20  # bytes of a download read at once
READ_CHUNK = 1 << 20  # most bytes asked of the socket at once (the stream reader gives less)


class BodyStream:
    """A cp upload's body, read as the control plane takes it (``await read()``: the next
    piece, ``b""`` at its end), each socket read within ``timeout`` seconds. ``length``: its
    Content-Length, None when chunked. Nothing is buffered here beyond one piece."""

    def __init__(self, conn, reader, length: int | None, timeout: float) -> None:
        self.conn, self.reader, self.length, self.timeout = conn, reader, length, timeout
        self.done = False

    async def read(self) -> bytes:
        while not self.done:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                try:
                    data = await asyncio.wait_for(self.reader.read(READ_CHUNK), self.timeout)
                except asyncio.TimeoutError:
                    raise refuse("api.timeout", f"the request body stalled for {self.timeout:g}s") from None
                self.conn.receive_data(data)
                continue
            if isinstance(ev, h11.Data):
                return bytes(ev.data)
            if isinstance(ev, h11.EndOfMessage):
                self.done = True
                return b""
            raise ConnectionError("the client closed the connection before the end of its upload")
        return b""


def is_upload(req) -> bool:
    """``PUT /v1/sandboxes/NAME/files``: the one route whose body is streamed, not read whole."""
    if req.method != b"PUT":
        return False
    parts = [p for p in req.target.split(b"?", 1)[0].split(b"/") if p]
    return len(parts) == 4 and parts[:2] == [b"v1", b"sandboxes"] and parts[3] == b"files"


async def send_fd(conn, writer, fd: int, size: int, headers: list) -> None:
    """A download: exactly ``size`` bytes of the file ``fd`` (from its offset), read SEND_CHUNK
    at a time off the loop and written as the socket drains - memory does not grow with the
    file. A file that shrank under us ends the connection short (the client sees an incomplete
    body, never a silently truncated file)."""
    writer.write(conn.send(h11.Response(status_code=200, headers=[*headers, ("content-length", str(size)),
                                                                  ("connection", "close")])))
    left = size
    while left > 0:
        chunk = await asyncio.to_thread(os.read, fd, min(SEND_CHUNK, left))
        if not chunk:
            raise ConnectionError("the file shrank while it was sent")
        left -= len(chunk)
        writer.write(conn.send(h11.Data(data=chunk)))
        await writer.drain()
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
