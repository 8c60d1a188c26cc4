"""Byte streams the gate relays over: a plain connection (:class:`PlainStream`, an asyncio
Protocol with a buffer one coroutine reads) and TLS terminated by the gate on top of one (a
sans-IO ``ssl.MemoryBIO`` session from ``gate.tls``)."""

from __future__ import annotations

import asyncio
import select
import ssl
from collections import deque

READ = 65536
HELLO_TIMEOUT = 10.0
LIMIT = 65536  # bytes buffered unread before the socket is no longer read (x2, as asyncio's streams)
COALESCE = 4096  # a piece smaller than this is appended to a last piece smaller than this


_CLOSED = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
_POLLIN = select.POLLIN


class Interrupted(Exception):
    """A read stopped by :meth:`PlainStream.interrupt`: ``why`` is ``client-left`` (the sandbox
    closed its side while the relay waited for the upstream) or ``upstream-timeout``. Not a
    ConnectionError: the relay tells it apart from the upstream failing."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class PlainStream:
    """One connection, as the relay's coroutine sees it: ``await read()`` the bytes that
    arrived (b"" at EOF), ``await write()`` (waits only while the peer is not taking them).

    The loop's callbacks append what arrives to a buffer and wake the one reader; reading
    stops past ``2 * limit`` unread bytes (back-pressure to the sender) and resumes once the
    reader caught up. This replaced asyncio's StreamReader/StreamWriter pair on the gate's hot
    path: the same semantics with about half the Python per read and per write, and a chunk
    that arrived whole is handed on without a copy. ``on_connect`` (servers) is called with
    the stream once the connection is made.

    An asyncio protocol by its methods (the loops call them by name), not by deriving from
    ``asyncio.Protocol``: Cython compiles this class as an extension type (``streams.pxd``),
    and an extension type cannot derive from a Python class."""

    __slots__ = ("transport", "_chunks", "_size", "_limit", "_eof", "_exc", "_lost", "_waiter", "_reading_paused",
                 "_writing_paused", "_drains", "_on_connect", "_over_ssl", "task", "_loop", "on_gone", "_poll")

    def __init__(self, limit: int = LIMIT, on_connect=None) -> None:
        self.transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._limit = limit
        self._eof = False  # the peer's EOF arrived (bytes before it may still be buffered)
        self._exc: BaseException | None = None
        self._lost = False
        self._waiter: asyncio.Future | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drains: deque[asyncio.Future] = deque()  # one per writer waiting for the peer to read
        self._on_connect = on_connect
        self._over_ssl = False
        # the handler serving this connection (servers): held here, the loop keeps only a weak reference
        self.task: asyncio.Task | None = None
        # called (no arguments) when the peer's EOF arrives or the connection is lost: the relay
        # sets it on the sandbox's connection while it waits for the upstream's answer
        self.on_gone = None
        self._poll = None  # select.poll() of this connection's socket (peer_closed), once asked

    # -- protocol callbacks (the loop) -----------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        self._over_ssl = transport.get_extra_info("sslcontext") is not None
        if self._on_connect is not None:
            cb, self._on_connect = self._on_connect, None
            self.task = cb(self)

    def data_received(self, data: bytes) -> None:
        if not data:
            return
        chunks = self._chunks
        if len(data) < COALESCE and chunks and len(chunks[-1]) < COALESCE:
            # small pieces join the last one: a peer sending 2-byte writes must not cost the
            # gate ~40 bytes of object overhead per byte (the limit counts bytes, not objects)
            chunks[-1] += data
        else:
            chunks.append(bytes(data))
        self._size += len(data)
        self._wake()
        if self._size > 2 * self._limit and not self._reading_paused:
            try:
                self.transport.pause_reading()
                self._reading_paused = True
            except (AttributeError, NotImplementedError, RuntimeError):
                pass

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        self._gone()
        return not self._over_ssl  # keep a plain socket half-open: the answer can still be written

    def connection_lost(self, exc) -> None:
        self._lost = True
        self._eof = True
        if exc is not None:
            self._exc = exc
        self._wake()
        self._gone()
        drains = self._drains
        while drains:
            d = drains.popleft()
            if not d.done():
                d.set_exception(ConnectionResetError("Connection lost"))

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drains = self._drains
        while drains:
            d = drains.popleft()
            if not d.done():
                d.set_result(None)

    def _gone(self) -> None:
        cb = self.on_gone
        if cb is not None:
            self.on_gone = None
            cb()

    def interrupt(self, why: str = "client-left") -> None:
        """Stop waiting on this peer: the pending read - or the next one that finds nothing
        buffered - raises :class:`Interrupted` (the connection is not to be read again)."""
        if self._exc is None:
            self._exc = Interrupted(why)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_exception(self._exc)

    @property
    def waiting(self) -> bool:
        """A read is waiting for bytes (none have arrived since it began)."""
        return self._waiter is not None

    def uninterrupt(self) -> None:
        """Undo a ``client-left`` interruption (a WebSocket's splice: the sandbox's EOF ends one
        direction there, not the connection)."""
        if isinstance(self._exc, Interrupted) and self._exc.why == "client-left":
            self._exc = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    # -- the relay's side -----------------------------------------------------------------
    async def read(self, n: int = READ) -> bytes:
        """Up to ``n`` bytes that arrived; b"" once the peer ended (a reset raises)."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            if self._waiter is not None:
                raise RuntimeError("read() called while another coroutine is already waiting for data")
            w = self._waiter = self._loop.create_future()
            try:
                await w
            except Interrupted:
                if not self._chunks:
                    raise
                # bytes arrived in the same turn as the interruption: they are read first (the
                # next read raises)
            finally:
                if self._waiter is w:
                    self._waiter = None
        chunks = self._chunks
        data = chunks.popleft()
        if len(data) > n:
            chunks.appendleft(data[n:])
            data = data[:n]
        elif chunks and len(data) < n:
            parts = [data]
            size = len(data)
            while chunks and size < n:
                nxt = chunks.popleft()
                if size + len(nxt) > n:
                    chunks.appendleft(nxt[n - size:])
                    nxt = nxt[: n - size]
                parts.append(nxt)
                size += len(nxt)
            data = b"".join(parts)
        self._size -= len(data)
        if self._reading_paused and self._size <= self._limit:
            self._reading_paused = False
            try:
                self.transport.resume_reading()
            except (AttributeError, NotImplementedError, RuntimeError):
                pass
        return data

    def send(self, data: bytes) -> bool:
        """Hand ``data`` to the socket now, without a coroutine; True when the peer is not
        taking bytes and the writer must ``await drained()`` before it writes more (``write``
        is both; the relay's hot path sends and only awaits when it must)."""
        if self._lost:
            raise ConnectionResetError("Connection lost")
        self.transport.write(data)
        return self._writing_paused

    async def drained(self) -> None:
        """Return once the peer takes bytes again (at once when it does)."""
        if self._writing_paused:
            # each waiting writer has its own future: cancelling one never fails another
            d = self._loop.create_future()
            self._drains.append(d)
            try:
                await d
            finally:
                if not d.done():
                    d.cancel()
                try:
                    self._drains.remove(d)
                except ValueError:
                    pass

    async def write(self, data: bytes) -> None:
        """Hand ``data`` to the socket; waits only while the peer is not reading (flow control)."""
        if self.send(data):
            await self.drained()

    def _pending(self) -> int:
        """What the kernel holds for this socket that the loop has not read: poll(2) without
        waiting (one poll object per connection, made on first use) - 0 for nothing, -1 when
        there is no socket to ask (not a real connection)."""
        p = self._poll
        if p is None:
            sock = self.transport.get_extra_info("socket")
            fd = sock.fileno() if sock is not None else -1
            if fd < 0:
                return -1
            p = self._poll = select.poll()
            p.register(fd, select.POLLIN | select.POLLRDHUP)
        mask = 0
        for _fd, ev in p.poll(0):
            mask |= ev
        return mask

    def peer_closed(self) -> bool:
        """The peer's EOF (or a reset) has arrived - read by the loop or still in the socket
        (asked of the kernel: POLLRDHUP). Unread bytes alone do not count."""
        if self._eof:
            return True
        t = self.transport
        if t is None or t.is_closing():
            return True
        ev = self._pending()
        return ev > 0 and bool(ev & _CLOSED)

    def idle(self, strict: bool = False) -> bool:
        """Fit to be handed out again by the upstream pool: :attr:`reusable`, and the kernel
        holds nothing for it either - no FIN and, on a plain connection, no byte (one the
        upstream sent unasked would answer the next request). Over TLS a byte may be a session
        ticket, so there only the FIN counts - unless ``strict`` (a request that will not be
        sent again if this connection fails): then any byte, which may be a close_notify."""
        if not self.reusable:
            return False
        ev = self._pending()
        if ev <= 0:
            return True
        return not ev & _CLOSED and not (ev & _POLLIN and (strict or not self._over_ssl))

    @property
    def eof(self) -> bool:
        """The peer's EOF (or a reset) arrived, even if bytes it sent before are still unread."""
        return self._eof

    @property
    def reusable(self) -> bool:
        """Open both ways, and nothing unread: bytes an upstream sent unasked (a response ahead
        of its request) make a connection unusable."""
        return not self._eof and self._exc is None and not self.transport.is_closing() and not self._chunks

    def take_buffered(self) -> bytes:
        """What arrived and was not read yet (handing the socket over to a splice)."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    def write_eof(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing() and t.can_write_eof():
            t.write_eof()

    def get_extra_info(self, name: str, default=None):
        return self.transport.get_extra_info(name, default) if self.transport is not None else default

    def close(self) -> None:
        try:
            if self.transport is not None:
                self.transport.close()
        except Exception:
            pass


def client_gone(client) -> bool:
    """The sandbox side has closed its connection: its EOF has arrived, even if bytes it sent
    before (a request body) are still buffered."""
    raw = getattr(client, "raw", client)
    return bool(getattr(raw, "eof", False))


def client_left(client) -> bool:
    """:func:`client_gone`, or the client's EOF (or a reset) has reached the socket and the loop
    has not read it yet (:meth:`PlainStream.peer_closed`). A request that arrived together with
    its client's EOF - a client that gave up while the gate was stalled - is seen as gone before
    it is forwarded, without waiting a turn of the loop for the EOF."""
    raw = getattr(client, "raw", client)
    peer_closed = getattr(raw, "peer_closed", None)  # (which looks at the EOF read first)
    return peer_closed() if peer_closed is not None else client_gone(raw)


class TLSStream:
    """Application bytes over a sans-IO TLS server session on top of a PlainStream."""

    def __init__(self, raw: PlainStream, session):
        self.raw, self.tls = raw, session

    async def handshake(self, initial: bytes) -> None:
        """The whole handshake within HELLO_TIMEOUT (not per read: a peer trickling its flight
        a byte at a time does not get HELLO_TIMEOUT per byte)."""
        if initial:
            self.tls.receive(initial)
        async with asyncio.timeout(HELLO_TIMEOUT):
            while True:
                done = self.tls.handshake()
                out = self.tls.outgoing()
                if out:
                    await self.raw.write(out)
                if done:
                    return
                data = await self.raw.read()
                if not data:
                    raise ConnectionError("client closed during TLS handshake")
                self.tls.receive(data)

    async def read(self, n: int = READ) -> bytes:
        while True:
            try:
                data = self.tls.read()
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                return b""
            out = self.tls.outgoing()
            if out:
                await self.raw.write(out)
            if data:
                return data
            if getattr(self.tls, "eof", False):
                return b""
            raw = await self.raw.read()
            if not raw:
                self.tls.receive_eof()
                continue
            self.tls.receive(raw)

    def send(self, data: bytes) -> bool:
        """As PlainStream.send: encrypted and handed to the socket now; True when the writer
        must ``await drained()``."""
        self.tls.write(data)
        out = self.tls.outgoing()
        return self.raw.send(out) if out else False

    async def drained(self) -> None:
        await self.raw.drained()

    async def write(self, data: bytes) -> None:
        if self.send(data):
            await self.raw.drained()

    def close(self) -> None:
        try:
            self.tls.close()
            out = self.tls.outgoing()
            if out and self.raw.transport is not None:
                self.raw.transport.write(out)
        except Exception:
            pass
        self.raw.close()
