"""The credential-echo checker's decoder (``decoded_views``, used by the selftest's echo cases
and the echo end-to-end tests) is total: any bytes give views or nothing, never an exception.
A crash inside the checker would both fail a run by chance and hide a real echo."""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from urllib.parse import quote_from_bytes

import brotli
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.selftest.cases.credentials import VIEW_LIMIT, decoded_views

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n"


def test_the_ci_failure_bytes_a_percent_sequence_of_a_byte_that_is_not_utf8():
    # the body of the failing CI run: `unquote` decoded %Aa as UTF-8 (U+FFFD), and encoding
    # that to latin-1 raised UnicodeEncodeError out of the checker
    body = b"\x00\x13random\xbf%Aa\xa4more"
    views = decoded_views(HEAD + body)
    assert HEAD + b"\x00\x13random\xbf\xaa\xa4more" in views  # percent-decoded as bytes


def test_a_secret_percent_encoded_among_bytes_that_are_not_utf8_is_found():
    secret = b"sk-REAL-0123456789abcdef"
    body = b"\xff\xfe%C3%28" + quote_from_bytes(secret, safe="").encode() + b"\xbf%Aa"
    assert any(secret in v for v in decoded_views(HEAD + body))


def test_a_secret_in_a_json_string_next_to_a_lone_surrogate_is_found():
    # "\ud800" is valid JSON but cannot be encoded as strict UTF-8; the value itself is only
    # readable once the JSON escapes are decoded
    body = b'{"echo": "\\ud800sk-\\u0052EAL-abc", "n": 1}'
    assert b"sk-REAL-abc" not in body
    assert any(b"sk-REAL-abc" in v for v in decoded_views(HEAD + body))


def test_nesting_past_the_json_parsers_depth_is_no_crash():
    views = decoded_views(HEAD + b"[" * 200_000)
    assert HEAD + b"[" * 200_000 in views


def test_compression_bombs_are_bounded():
    bomb = zlib.compress(b"\0" * (64 << 20), 9)
    for data in (gzip.compress(b"\0" * (64 << 20), 9), bomb, brotli.compress(b"\0" * (64 << 20)),
                 zstandard.ZstdCompressor().compressobj().compress(b"\0" * (64 << 20)) + zstandard.ZstdCompressor().compressobj().flush()):
        views = decoded_views(data)
        assert max(len(v) for v in views) <= max(VIEW_LIMIT, len(data))


def test_layers_still_decode_gzip_of_base64_of_json():
    secret = "sk-REAL-layered-42"
    body = gzip.compress(base64.b64encode(json.dumps({"k": secret}).encode()))
    assert any(secret.encode() in v for v in decoded_views(HEAD + body))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_any_bytes_give_views_never_an_exception(data):
    views = decoded_views(data)
    assert data in views and all(isinstance(v, bytes) for v in views)


percentish = st.lists(st.one_of(st.binary(max_size=8),
                                st.sampled_from([b"%", b"%A", b"%Aa", b"%ff", b"%C3%28", b"+", b"\\u", b'"', b"\\ud800",
                                                 b"\r\n\r\n", b"0\r\n", b"\x1f\x8b", b"(\xb5/\xfd", b"=", b"{", b"["])),
                      max_size=40).map(b"".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(percentish)
def test_escape_heavy_bytes_give_views_never_an_exception(data):
    views = decoded_views(HEAD + data)
    assert HEAD + data in views


def test_hex_and_misaligned_base64_are_decoded():
    from agentvm.selftest.cases.credentials import decoded_views

    secret = b"sk-REAL-hexhex-0042"
    assert any(secret in v for v in decoded_views(HEAD + b"x=" + secret.hex().encode() + b"&"))
    assert any(secret in v for v in decoded_views(HEAD + b"x=f" + secret.hex().upper().encode()))
    blob = base64.b64encode(b"ab" + secret + b"cd")  # the value starts mid-quantum
    assert any(secret in v for v in decoded_views(HEAD + b"tok=" + blob[1:]))


def test_a_body_with_more_decodings_than_searched_is_not_called_clean():
    from agentvm.selftest.cases.credentials import MAX_VIEWS, all_decoded_views

    body = b" ".join(base64.b64encode(b"%06d-padding-token" % i) for i in range(MAX_VIEWS))
    views, complete = all_decoded_views(HEAD + body)
    assert not complete and len(views) == MAX_VIEWS
    assert all_decoded_views(HEAD + b"small")[1]
