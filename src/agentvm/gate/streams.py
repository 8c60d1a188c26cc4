"""Byte streams the gate relays over: a plain socket (asyncio streams) and TLS terminated by
the gate on top of one (a sans-IO ``ssl.MemoryBIO`` session from ``gate.tls``)."""

from __future__ import annotations

import asyncio
import ssl

READ = 65536
HELLO_TIMEOUT = 10.0


class PlainStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def read(self, n: int = READ) -> bytes:
        return await self.reader.read(n)

    @property
    def reusable(self) -> bool:
        """Open both ways, and nothing unread: bytes an upstream sent unasked (a response ahead
        of its request) make a connection unusable. (``_buffer`` is StreamReader's buffer, as
        ``_eof`` below: both in every CPython.)"""
        return not self.reader.at_eof() and not self.writer.is_closing() and not getattr(self.reader, "_buffer", b"")

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


def client_gone(client) -> bool:
    """The sandbox side has closed its connection: its EOF has arrived, even if bytes it sent
    before (a request body) are still buffered. (``StreamReader`` exposes only "EOF and empty
    buffer" publicly; ``_eof`` is the flag ``feed_eof`` sets, present in every CPython.)"""
    raw = getattr(client, "raw", client)
    reader = getattr(raw, "reader", None)
    return reader is not None and bool(getattr(reader, "_eof", reader.at_eof()))


class TLSStream:
    """Application bytes over a sans-IO TLS server session on top of a PlainStream."""

    def __init__(self, raw: PlainStream, session):
        self.raw, self.tls = raw, session

    async def handshake(self, initial: bytes) -> None:
        if initial:
            self.tls.receive(initial)
        while True:
            done = self.tls.handshake()
            out = self.tls.outgoing()
            if out:
                await self.raw.write(out)
            if done:
                return
            data = await asyncio.wait_for(self.raw.read(), HELLO_TIMEOUT)
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

    async def write(self, data: bytes) -> None:
        self.tls.write(data)
        out = self.tls.outgoing()
        if out:
            await self.raw.write(out)

    def close(self) -> None:
        try:
            self.tls.close()
            out = self.tls.outgoing()
            if out:
                self.raw.writer.write(out)
        except Exception:
            pass
        self.raw.close()
