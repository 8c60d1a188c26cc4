"""PlainStream, the gate's connection protocol, driven by hand with a recording transport:
back-pressure both ways, bounded memory for hostile chunking, one reader, independent writers."""

from __future__ import annotations

import asyncio
import sys

import pytest

from agentvm.gate import streams
from agentvm.gate.streams import PlainStream


class FakeTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.out = bytearray()
        self.paused = 0
        self.resumed = 0
        self.closing = False

    def write(self, data):
        self.out += data

    def pause_reading(self):
        self.paused += 1

    def resume_reading(self):
        self.resumed += 1

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def get_extra_info(self, name, default=None):
        return default


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def made(limit: int = 1024) -> tuple[PlainStream, FakeTransport]:
    s, t = PlainStream(limit), FakeTransport()
    s.connection_made(t)
    return s, t


def test_tiny_pieces_cost_about_their_bytes_and_reading_pauses_at_twice_the_limit():
    async def go():
        s, t = made(limit=64 * 1024)
        sent = 0
        while not t.paused:
            s.data_received(b"ab")  # a hostile sender: 2-byte writes, each its own read
            sent += 2
        held = sum(sys.getsizeof(c) for c in s._chunks)
        assert sent == 2 * 64 * 1024 + 2 and held < 1.1 * sent  # ~1 byte of memory per byte held
        got = bytearray()
        while len(got) < sent:
            got += await s.read(4096)
        assert bytes(got) == b"ab" * (sent // 2) and t.resumed == 1

    run(go())


def test_reads_split_and_join_pieces_and_hand_out_what_arrived_before_an_error():
    async def go():
        s, t = made()
        s.data_received(b"x" * 5000)
        s.data_received(b"y" * 10)
        assert await s.read(4000) == b"x" * 4000
        assert await s.read(65536) == b"x" * 1000 + b"y" * 10
        s.data_received(b"last")
        s.connection_lost(ConnectionResetError("reset"))
        assert s.eof and await s.read() == b"last"  # what arrived is delivered, then the reset
        with pytest.raises(ConnectionResetError):
            await s.read()
        with pytest.raises(ConnectionResetError):
            await s.write(b"too late")

    run(go())


def test_a_second_reader_is_refused_not_left_waiting_forever():
    async def go():
        s, t = made()
        first = asyncio.ensure_future(s.read())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError):
            await s.read()
        s.data_received(b"hi")
        assert await first == b"hi"
        s.eof_received()
        assert await s.read() == b""

    run(go())


def test_cancelling_one_waiting_writer_leaves_the_others_waiting_and_served():
    async def go():
        s, t = made()
        s.pause_writing()
        w1 = asyncio.ensure_future(s.write(b"one"))
        w2 = asyncio.ensure_future(s.write(b"two"))
        await asyncio.sleep(0)
        w1.cancel()
        await asyncio.sleep(0)
        assert w1.cancelled() and not w2.done()
        s.resume_writing()
        await asyncio.wait_for(w2, 1)  # served, not cancelled with its neighbour
        await s.write(b"three")  # nothing stale left behind
        s.pause_writing()
        w3 = asyncio.ensure_future(s.write(b"four"))
        await asyncio.sleep(0)
        s.connection_lost(None)
        with pytest.raises(ConnectionResetError):
            await w3
        assert bytes(t.out) == b"onetwothreefour" and not s._drains

    run(go())


def test_reusable_only_open_and_with_nothing_unread():
    async def go():
        s, t = made()
        assert s.reusable
        s.data_received(b"HTTP/1.1 200 OK\r\n")  # sent unasked
        assert not s.reusable
        s2, t2 = made()
        s2.eof_received()
        assert not s2.reusable

    run(go())


def test_small_pieces_are_joined_only_up_to_the_coalescing_size():
    async def go():
        s, t = made(limit=1 << 20)
        for _ in range(3 * streams.COALESCE):
            s.data_received(b"z")
        assert all(len(c) <= 2 * streams.COALESCE for c in s._chunks) and len(s._chunks) <= 4

    run(go())


def test_an_interrupted_read_still_returns_what_arrived_in_the_same_turn_and_the_next_one_raises():
    async def go():
        s = PlainStream()
        s.connection_made(FakeTransport())
        reader = asyncio.ensure_future(s.read())
        await asyncio.sleep(0)  # the read waits
        assert s.waiting
        s.interrupt()  # the sandbox left...
        s.data_received(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")  # ...as the answer came
        first = await reader
        with pytest.raises(streams.Interrupted):
            await s.read()
        s2 = PlainStream()
        s2.connection_made(FakeTransport())
        s2.interrupt("upstream-timeout")
        s2.uninterrupt()  # only a client-left is ever undone
        with pytest.raises(streams.Interrupted):
            await s2.read()
        s2._exc = None
        assert s2.reusable
        s2.interrupt()
        assert not s2.reusable  # never pooled once interrupted
        return first

    assert asyncio.run(go()) == b"HTTP/1.1 101 Switching Protocols\r\n\r\n"
