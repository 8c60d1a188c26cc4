"""Content codings the gate decodes before scrubbing a response (a compressed echo of a real
credential is still an echo)."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from agentvm.gate.encoding import PIECE, Decoder, DecodeError, narrow_accept, supported

ENCODERS = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,  # zlib-wrapped, as RFC 9110 says
    "deflate-raw": lambda b: zlib.compress(b)[2:-4],  # raw deflate, as some servers send it
    "br": brotli.compress,
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
}


def _decode(ce: str, data: bytes, cuts=()) -> bytes:
    d = Decoder(ce.encode())
    out, last = b"", 0
    for c in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
        out += b"".join(d.feed(data[last:c]))
        last = c
    return out + b"".join(d.finish())


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(ENCODERS)), body=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 5000), max_size=10))
def test_every_supported_coding_round_trips_in_any_split(name, body, cuts):
    ce = "deflate" if name == "deflate-raw" else name
    assert _decode(ce, ENCODERS[name](body), cuts) == body


def test_stacked_codings_are_undone_right_to_left():
    body = b"echo " * 1000
    assert _decode("gzip, br", brotli.compress(gzip.compress(body))) == body
    assert _decode("zstd,deflate", zlib.compress(zstandard.ZstdCompressor().compress(body))) == body


def test_multi_member_gzip_and_multi_frame_zstd():
    assert _decode("gzip", gzip.compress(b"one ") + gzip.compress(b"two")) == b"one two"
    z = zstandard.ZstdCompressor()
    assert _decode("zstd", z.compress(b"one ") + z.compress(b"two"), cuts=range(0, 40, 3)) == b"one two"


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_a_truncated_or_corrupt_body_is_an_error_not_a_short_answer(name):
    ce = "deflate" if name == "deflate-raw" else name
    data = ENCODERS[name](bytes(range(256)) * 64)
    with pytest.raises(DecodeError) as ei:
        _decode(ce, data[: len(data) // 2])
    assert ei.value.rule_id == "upstream:bad-encoding"
    with pytest.raises(DecodeError):
        _decode(ce, b"\x00garbage-that-is-no-stream" * 4)


@pytest.mark.parametrize("ce", ["compress", "x-custom", "gzip, exi", "gzip, gzip, gzip, gzip"])
def test_a_coding_the_gate_cannot_read_is_refused(ce):
    with pytest.raises(DecodeError) as ei:
        Decoder(ce.encode())
    assert ei.value.rule_id == "credential:uninspectable-encoding"


@pytest.mark.parametrize("name", ["gzip", "deflate", "br", "zstd"])
def test_a_compression_bomb_comes_out_in_bounded_pieces(name):
    import tracemalloc

    bomb = ENCODERS[name](b"\0" * (64 * 1024 * 1024))
    d = Decoder(name.encode())
    total = biggest = 0
    tracemalloc.start()
    try:
        for piece in d.feed(bomb):
            biggest = max(biggest, len(piece))
            total += len(piece)
        total += sum(len(p) for p in d.finish())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 64 * 1024 * 1024
    assert peak < 8 * 1024 * 1024, f"decoding held {peak} bytes at once"
    assert biggest <= 2 * PIECE  # brotli stops growing its buffer once past the limit


def test_accept_encoding_is_narrowed_to_what_the_gate_decodes():
    assert set(supported()) == {"gzip", "deflate", "br", "zstd"}
    assert narrow_accept(b"gzip, deflate, br, zstd, compress;q=0.5, exi") == b"gzip, deflate, br, zstd"
    assert narrow_accept(b"compress") == b"identity"
    assert narrow_accept(b"gzip;q=1.0, identity;q=0.5") == b"gzip;q=1.0, identity;q=0.5"
    assert narrow_accept(None) is None
