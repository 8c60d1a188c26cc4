"""Fuzzing the gate's content decoders (gate/encoding.py): stacked codings, corrupted and cut
streams, bombs. A decoder yields the body's bytes (a valid stream decodes to what was encoded),
in pieces never much over PIECE (a bomb costs CPU time, never memory), or refuses with
DecodeError; the sniffer only ever answers "", None or a coding's name."""

from __future__ import annotations

import gzip
import zlib

import brotli
import zstandard
from hypothesis import given, strategies as st

from agentvm.gate import encoding
from tests.fuzz.grammar import FUZZ, splits

SLACK = 1 << 20  # (brotli may overshoot PIECE by one of its buffers)


def _enc(coding: str, data: bytes, raw: bool) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, mtime=0)
    if coding == "deflate":
        c = zlib.compressobj(wbits=-15 if raw else 15)
        return c.compress(data) + c.flush()
    if coding == "br":
        return brotli.compress(data)
    return zstandard.ZstdCompressor().compress(data)


@st.composite
def encoded(draw):
    body = draw(st.one_of(st.binary(max_size=300), st.integers(0, 3 << 20).map(lambda n: b"\0" * n)))
    codings = draw(st.lists(st.sampled_from(["gzip", "deflate", "br", "zstd"]), min_size=0, max_size=4))
    data = body
    for c in codings:  # applied left to right
        data = _enc(c, data, draw(st.booleans()))
    header = b", ".join(c.encode() for c in codings)
    if draw(st.booleans()):
        header = draw(st.sampled_from([b"identity, ", b"", b"IDENTITY,"])) + header.upper() if header else header
    broken = False
    if data and draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["flip", "cut", "junk"]))
        if how == "flip":
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
        elif how == "cut":
            data = data[:i]
        else:
            data = data + draw(st.binary(min_size=1, max_size=8))
        broken = True
    if draw(st.integers(0, 9)) == 0:
        header += b", " + draw(st.sampled_from([b"compress", b"x-unknown", b"gzip;q=1", b"\xff"]))
        broken = True
    if not codings:  # identity: the body is what was sent, broken or not
        return header, data, data, "x-unknown" in header.decode("latin-1") or b"compress" in header or b"gzip" in header
    return header, data, body, broken


@FUZZ
@given(case=encoded(), data=st.data())
def test_decoder(case, data):
    header, wire, body, broken = case
    out = bytearray()
    try:
        d = encoding.Decoder(header)
        for piece in data.draw(splits(wire)):
            for p in d.feed(piece):
                assert len(p) <= encoding.PIECE + SLACK, len(p)
                out += p
                assert len(out) <= len(body) + SLACK or broken, "more out than was put in"
        for p in d.finish():
            assert len(p) <= encoding.PIECE + SLACK
            out += p
    except encoding.DecodeError as exc:
        assert exc.rule_id in ("upstream:bad-encoding", "credential:uninspectable-encoding"), exc.rule_id
        assert broken or exc.rule_id == "credential:uninspectable-encoding", (exc, header)
        return
    if not broken and len(header.split(b",")) <= encoding.Decoder.MAX_LAYERS + 1:
        assert bytes(out) == body


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), encoded().map(lambda c: c[1])), parts=st.data())
def test_sniffer(data, parts):
    s = encoding.Sniffer()
    pieces = parts.draw(splits(data)) or [b""]
    for i, p in enumerate(pieces):
        ans = s.feed(p, final=i == len(pieces) - 1)
        assert ans is None or isinstance(ans, str), ans
        if ans != "":
            break


@FUZZ
@given(value=st.one_of(st.none(), st.binary(max_size=60)))
def test_narrow_accept(value):
    out = encoding.narrow_accept(value)
    if out is not None:
        assert b"\r" not in out and b"\n" not in out
        for c in out.split(b","):
            name = c.split(b";")[0].strip().lower()
            assert not name or name.decode("latin-1") in encoding.supported() + ("identity", "x-gzip", "*"), out
