"""Content codings the gate can look inside, sans-IO.

A sandbox that holds credential placeholders has every response scrubbed of real values
(``credentials.Scrubber``). A scrubber that reads only identity bytes is blind to a gzip'd
echo, so for such a sandbox the gate

* narrows the agent's ``Accept-Encoding`` to the codings it can decode (:func:`narrow_accept`),
* decodes every response body whose ``Content-Encoding`` it supports - gzip, deflate (zlib or
  raw), br, zstd, stacked in any order - and forwards identity (:class:`Decoder`),
* refuses a response in any other coding (``credential:uninspectable-encoding``): never passed
  through unread.

Decoding is lazy and bounded: :meth:`Decoder.feed` yields decoded pieces of at most
about :data:`PIECE` bytes (brotli may overshoot it by one buffer), so a compression bomb costs the gate CPU time (like any large download),
never memory; a corrupt or truncated stream raises :class:`DecodeError`.
"""

from __future__ import annotations

import zlib
from typing import Iterator

PIECE = 256 * 1024  # decoded bytes produced before the caller gets to send them on
# the zstd binding has no output cap: feed it a few bytes at a time (an RLE block is 4 bytes
# for 128 KiB, so 32 bytes yield at most 1 MiB)
_ZSTD_SLICE = 32

try:  # both are dependencies; a broken install must not make responses uninspected
    import brotli
except ImportError:  # pragma: no cover - refused per response instead
    brotli = None
try:
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None


class DecodeError(Exception):
    """A response body the gate cannot read; ``rule_id`` is what the log and the 502 carry."""

    def __init__(self, rule_id: str, reason: str):
        super().__init__(reason)
        self.rule_id, self.reason = rule_id, reason


def supported() -> tuple[str, ...]:
    out = ["gzip", "deflate"]
    if brotli is not None:
        out.append("br")
    if zstandard is not None:
        out.append("zstd")
    return tuple(out)


def _codings(value: bytes) -> list[str]:
    return [t.strip().lower() for t in value.decode("latin-1").split(",") if t.strip()]


def narrow_accept(value: bytes | None) -> bytes | None:
    """The agent's ``Accept-Encoding`` with only the codings the gate can decode (in the
    agent's order, weights kept); ``identity`` when none is left; None when none was sent."""
    if value is None:
        return None
    ok = set(supported()) | {"identity", "x-gzip"}
    keep = []
    for item in value.decode("latin-1").split(","):
        name = item.split(";", 1)[0].strip().lower()
        if name in ok:
            keep.append(item.strip())
    return (", ".join(keep) if keep else "identity").encode("latin-1")


def narrow_accept_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` (names lower-case) with ``Accept-Encoding`` narrowed by :func:`narrow_accept`."""
    return [(k, narrow_accept(v)) if k == b"accept-encoding" else (k, v) for k, v in headers]


class _Zlib:
    def __init__(self, coding: str):
        self.coding = coding
        self.d = None  # chosen on the first bytes for deflate (zlib-wrapped or raw, both seen)
        self.head = b""

    def _new(self, first: bytes):
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        zlib_wrapped = len(first) >= 2 and (first[0] & 0x0F) == 8 and ((first[0] << 8) | first[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self.d is None:
            self.head += data
            if len(self.head) < 2:
                return
            data, self.head = self.head, b""
            self.d = self._new(data)
        buf = data
        while buf or (self.d.eof and self.d.unused_data.strip(b"\0")):
            if self.d.eof:  # what follows the end of the stream: another gzip member, or padding
                rest, buf = self.d.unused_data + buf, b""
                if not rest.strip(b"\0"):
                    return
                if self.coding != "gzip":
                    raise DecodeError("upstream:bad-encoding", f"{self.coding} body has data after its end")
                self.d = self._new(rest)
                buf = rest
                continue
            try:
                out = self.d.decompress(buf, PIECE)
            except zlib.error as exc:
                raise DecodeError("upstream:bad-encoding", f"{self.coding} body does not decode: {exc}") from None
            if out:
                yield out
            buf = self.d.unconsumed_tail

    def finish(self) -> Iterator[bytes]:
        if self.d is None:
            if self.head:
                raise DecodeError("upstream:bad-encoding", f"{self.coding} body is truncated")
            return  # an empty body
        out = self.d.flush()
        if out:
            yield out
        if not self.d.eof:
            raise DecodeError("upstream:bad-encoding", f"{self.coding} body is truncated")


class _Brotli:
    def __init__(self):
        self.d = brotli.Decompressor()
        self.any = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self.any = True
        try:
            out = self.d.process(data, output_buffer_limit=PIECE)
            if out:
                yield out
            while True:  # it may hold decoded output even once it could take more input
                out = self.d.process(b"", output_buffer_limit=PIECE)
                if not out:
                    break
                yield out
        except brotli.error as exc:
            raise DecodeError("upstream:bad-encoding", f"br body does not decode: {exc}") from None

    def finish(self) -> Iterator[bytes]:
        if self.any and not self.d.is_finished():
            raise DecodeError("upstream:bad-encoding", "br body is truncated")
        return iter(())


class _Zstd:
    def __init__(self):
        self.d = zstandard.ZstdDecompressor().decompressobj()
        self.fed = False  # bytes of the current frame seen (truncation check)

    def feed(self, data: bytes) -> Iterator[bytes]:
        view = memoryview(data)
        i = 0
        while i < len(view):
            if self.d.eof:  # a frame ended: the next one starts with what it did not use
                rest = self.d.unused_data
                self.d = zstandard.ZstdDecompressor().decompressobj()
                self.fed = False
                if rest:
                    yield from self._run(rest)
                    continue
            yield from self._run(view[i:i + _ZSTD_SLICE])
            i += _ZSTD_SLICE

    def _run(self, piece) -> Iterator[bytes]:
        try:
            out = self.d.decompress(bytes(piece))
        except zstandard.ZstdError as exc:
            raise DecodeError("upstream:bad-encoding", f"zstd body does not decode: {exc}") from None
        self.fed = True
        for j in range(0, len(out), PIECE):
            yield out[j:j + PIECE]

    def finish(self) -> Iterator[bytes]:
        if self.fed and not self.d.eof:
            raise DecodeError("upstream:bad-encoding", "zstd body is truncated")
        return iter(())


def _step(coding: str):
    if coding in ("gzip", "x-gzip"):
        return _Zlib("gzip")
    if coding == "deflate":
        return _Zlib("deflate")
    if coding == "br" and brotli is not None:
        return _Brotli()
    if coding == "zstd" and zstandard is not None:
        return _Zstd()
    raise DecodeError("credential:uninspectable-encoding",
                      f"response in Content-Encoding {coding!r}, which the gate cannot inspect for credential echoes")


# What a body that is compressed but not declared so starts with: the magic numbers of the
# codings a client can undo with a stock library. gzip (RFC 1952: 1f 8b, method 8), zstd (RFC
# 8878: a frame 28 b5 2f fd, or a skippable frame 5? 2a 4d 18), zlib (RFC 1950: a two-byte
# header whose check bits make it a multiple of 31, method 8, window <= 32 KiB, no preset
# dictionary) - the zlib header alone is two bytes that text can start with ("x^", "80"), so it
# counts only when the bytes after it also inflate. Brotli and raw deflate have no magic number
# (a prefix of almost any bytes is a valid start of one): they are not sniffed (see
# docs/credentials.md, what remains).
SNIFF_BYTES = 64  # the most a sniff needs (a zlib header is confirmed on the bytes after it)


def sniff(head: bytes, final: bool = False) -> str | None:
    """The compression ``head`` (the first bytes of a body) starts with: ``"gzip"``, ``"zstd"``,
    ``"zlib"``; None when it starts with none of them; ``""`` when more bytes are needed to
    tell (never once ``final``: the body ended)."""
    if not head:
        return None if final else ""
    b0 = head[0]
    if b0 == 0x1F:
        if len(head) < 2:
            return None if final else ""
        return "gzip" if head[1] == 0x8B else None
    if b0 == 0x28 or (b0 & 0xF0) == 0x50:
        if head[:4] == b"\x28\xb5\x2f\xfd"[:len(head)] or (b0 & 0xF0 == 0x50 and head[1:4] == b"\x2a\x4d\x18"[:len(head) - 1]):
            if len(head) < 4:
                return None if final else ""
            return "zstd"
        # (0x28 and 0x58 are also zlib header bytes: fall through)
    if (b0 & 0x0F) == 8 and (b0 >> 4) <= 7:
        if len(head) < 2:
            return None if final else ""
        if ((b0 << 8) | head[1]) % 31 or head[1] & 0x20:  # not a header, or a preset dictionary
            return None
        d = zlib.decompressobj(zlib.MAX_WBITS)
        try:
            out = d.decompress(head[:SNIFF_BYTES], 4096)
        except zlib.error:
            return None  # "80 bytes": a header by chance, not a stream
        if len(head) >= SNIFF_BYTES or d.eof:
            return "zlib"
        if not final:
            return ""  # inflated so far: wait for more (a short stream is judged at its end)
        return "zlib" if out else None  # a short body: compressed if a client gets something out of it

    return None


class Sniffer:
    """Whether a body is compressed without saying so, told from its first bytes.

    First the magic numbers (:func:`sniff`). A body without one may still be brotli or raw
    deflate, which have none: both are tried on it (trial decoders, output discarded). Most
    text dies in either within a few bytes (``{"``, ``<!``, ``data:`` are not valid starts);
    while one is alive the body is held, and it is judged compressed only when a trial decoder
    read *all* of it without an error, ended exactly where the body ends, and produced
    output - a whole stream, which no text is by chance. Bounded: past :attr:`HOLD` bytes with
    a trial still alive (a metadata block can skip megabytes of anything) the body is released
    as it is; a trial's output past :attr:`OUT_MAX` (a bomb) makes it compressed.

    :meth:`feed` -> ``""`` (hold: cannot tell yet), None (not compressed: release what was
    held), or the coding's name (compressed)."""

    HOLD = 64 * 1024
    OUT_MAX = 16 << 20

    def __init__(self) -> None:
        self.head = b""
        self.trials: list | None = None  # [name, decoder, output so far]

    def feed(self, data: bytes, final: bool = False) -> str | None:
        self.head += data
        if self.trials is None:
            found = sniff(self.head, final)
            if found != "" and found is not None:
                return found
            if found == "" and not final:
                return ""
            self.trials = []
            if brotli is not None:
                self.trials.append(["br", brotli.Decompressor(), 0])
            self.trials.append(["deflate", zlib.decompressobj(-zlib.MAX_WBITS), 0])
            data = self.head
        alive = []
        for t in self.trials:
            try:
                if not self._run(t, data):
                    continue
            except _TrialDone as done:
                return done.name
            alive.append(t)
        self.trials = alive
        if not alive:
            return None
        if final:
            for name, d, out in alive:
                ended = d.is_finished() if name == "br" else (d.eof and not d.unused_data)
                if ended and out:
                    return name  # the whole body is one stream of it
            return None
        if len(self.head) > self.HOLD:
            return None  # (alive this long: released as it is; see the class)
        return ""

    def _run(self, t: list, data: bytes) -> bool:
        """Feed ``data`` to one trial decoder; False when it fails (or it had already ended:
        bytes after the end of a stream are not one body of it)."""
        name, d = t[0], t[1]
        if name == "br":
            if data and d.is_finished():
                return False
            try:
                out = len(d.process(data, output_buffer_limit=PIECE))
                t[2] += out
                while out and t[2] <= self.OUT_MAX:  # (it may hold output even once it could take more input)
                    out = len(d.process(b"", output_buffer_limit=PIECE))
                    t[2] += out
            except brotli.error:
                return False
        else:
            if data and d.eof:
                return False
            try:
                out = len(d.decompress(data, PIECE))
                t[2] += out
                while d.unconsumed_tail and t[2] <= self.OUT_MAX:
                    t[2] += len(d.decompress(d.unconsumed_tail, PIECE))
            except zlib.error:
                return False
            if d.eof and d.unused_data:
                return False
        if t[2] > self.OUT_MAX:
            raise _TrialDone(name)
        return True


class _TrialDone(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Decoder:
    """Undo a ``Content-Encoding`` header (codings applied left to right, undone right to left)."""

    MAX_LAYERS = 3

    def __init__(self, content_encoding: bytes):
        codings = [c for c in _codings(content_encoding) if c != "identity"]
        if len(codings) > self.MAX_LAYERS:
            raise DecodeError("credential:uninspectable-encoding", f"{len(codings)} stacked content codings")
        self.steps = [_step(c) for c in reversed(codings)]

    def _through(self, pieces: Iterator[bytes], k: int) -> Iterator[bytes]:
        if k == len(self.steps):
            yield from pieces
            return
        step = self.steps[k]
        for piece in pieces:
            yield from self._through(step.feed(piece), k + 1)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Decoded pieces of ``data`` (lazily: pull one, send it, pull the next)."""
        return self._through(iter((data,)), 0)

    def finish(self) -> Iterator[bytes]:
        """The end of the body: what the decoders still hold; raises if it was truncated."""
        for k, step in enumerate(self.steps):
            yield from self._through(step.finish(), k + 1)
