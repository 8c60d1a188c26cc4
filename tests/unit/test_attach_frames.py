"""The daemon's side of an interactive session's wire (agentvm.daemon.http.HttpAttached, the
agentvm-frames/1 upgrade; docs/daemon.md "Interactive sessions"), over a real h11 connection and
an asyncio stream: client frames become typed input events, anything malformed or oversized
ends the session as a client that went away does, and a full queue stops the reading."""

from __future__ import annotations

import asyncio

import h11
import pytest

from agentvm.daemon import pump
from agentvm.daemon.http import IN_QUEUE, MAX_IN_FRAME, HttpAttached


class _Writer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None

    def get_extra_info(self, name):
        return None


def _session(first: bytes = b""):
    conn = h11.Connection(h11.SERVER)
    body = b"{}"
    conn.receive_data(b"POST /v1/run/attach HTTP/1.1\r\nHost: d\r\nContent-Length: 2\r\nConnection: Upgrade\r\n"
                      b"Upgrade: agentvm-frames/1\r\n\r\n" + body + first)
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    reader = asyncio.StreamReader()
    w = _Writer()
    return HttpAttached(conn, w, reader), reader, w


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_frames_become_typed_events_including_bytes_sent_with_the_head():
    async def main():
        io, reader, w = _session(b"i3\nab")
        await io.start()
        assert bytes(w.data).startswith(b"HTTP/1.1 101 ") and b"upgrade: agentvm-frames/1" in bytes(w.data)
        reader.feed_data(b"cw5\n24 80s3\nINTs4\nKILLc0\n")
        reader.feed_eof()
        evs = [await io.read() for _ in range(5)]
        assert evs == [pump.StdinData(b"abc"), pump.Resize(24, 80), pump.Signal("INT"), pump.StdinEof(), None]
        assert await io.read() is None, "gone stays gone"
        assert io.hangup().done()

    run(main())


@pytest.mark.parametrize("bad", [b"i%d\n" % (MAX_IN_FRAME + 1), b"w40\n" + b"1" * 40, b"wx\n", b"w3\n1 x",
                                 b"q1\nx", b"i-1\n", b"i12345678\n", b"abcdefghijklmnop"])
def test_a_malformed_or_oversized_frame_ends_the_session(bad):
    async def main():
        io, reader, _ = _session()
        await io.start()
        reader.feed_data(bad)
        assert await io.read() is None
        assert io.hangup().done()

    run(main())


def test_a_session_that_does_not_take_input_stops_the_reading():
    async def main():
        io, reader, _ = _session()
        await io.start()
        frame = b"i4\nxxxx"
        sent = frame * 200_000  # 1.4 MB of frames, never taken
        reader.feed_data(sent)
        await asyncio.sleep(0.2)
        assert io.queue.qsize() == IN_QUEUE, "at most IN_QUEUE frames read ahead"
        assert len(io.buf) <= 65536, "one read's worth is held, not the stream"
        assert len(reader._buffer) >= len(sent) - 65536, "the rest is not read (back-pressure to the client)"
        assert await io.read() == pump.StdinData(b"xxxx")
        io.close()

    run(main())
