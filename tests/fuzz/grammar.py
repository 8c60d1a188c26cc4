"""Grammars of what a sandbox (or an upstream) sends the gate, as Hypothesis strategies, shared
by the CI fuzz tests (tests/fuzz/test_fuzz_*.py: a few seconds each, derandomized) and the long
runs (bench/fuzz_gate.py). Each strategy mixes well-formed messages, near misses (one field
broken) and raw bytes, so the parsers' error paths are reached as well as their happy ones."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings, strategies as st

# CI: a few seconds per target, the same examples on every run (derandomize); bench/fuzz_gate.py
# raises the count (AGENTVM_FUZZ_EXAMPLES) and turns derandomize off
EXAMPLES = int(os.environ.get("AGENTVM_FUZZ_EXAMPLES", "150"))
DERANDOMIZE = os.environ.get("AGENTVM_FUZZ_RANDOM") != "1"
FUZZ = settings(max_examples=EXAMPLES, derandomize=DERANDOMIZE, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~",
                min_size=1, max_size=12)
NASTY = st.sampled_from([b"", b"\r", b"\n", b"\x00", b" ", b"\t", b"\r\n", b"\xff", b":", b"%00", b"\\", b"..",
                         b"0x", b"-1", b"99999999999999999999", b"chunked", b"identity", b",", b";"])
HEADER_NAMES = st.sampled_from([b"host", b"content-length", b"transfer-encoding", b"connection", b"te", b"upgrade",
                                b"proxy-authorization", b"authorization", b"x-api-key", b"expect", b"content-encoding",
                                b"accept-encoding", b"trailer", b"keep-alive", b"proxy-connection"])


@st.composite
def header_value(draw) -> bytes:
    return draw(st.one_of(st.binary(max_size=40), TOKEN.map(str.encode), NASTY,
                          st.integers(-5, 10**12).map(lambda n: str(n).encode()),
                          st.lists(st.sampled_from([b"chunked", b"gzip", b"identity", b"br", b"x"]), max_size=4)
                          .map(lambda xs: b", ".join(xs))))


@st.composite
def headers(draw) -> list[tuple[bytes, bytes]]:
    names = st.one_of(HEADER_NAMES, TOKEN.map(str.encode), st.binary(min_size=0, max_size=10))
    return draw(st.lists(st.tuples(names, header_value()), max_size=8))


@st.composite
def request_head(draw) -> bytes:
    """An HTTP/1 request head, mostly proxy-shaped (absolute-form, CONNECT, origin-form /mcp)."""
    method = draw(st.one_of(st.sampled_from([b"GET", b"POST", b"CONNECT", b"PUT", b"HEAD", b"OPTIONS", b"get"]),
                            st.binary(max_size=8)))
    host = draw(st.one_of(st.sampled_from([b"api.test", b"127.0.0.1", b"[::1]", b"169.254.169.254", b"a..b",
                                           b"xn--", b"API.TEST.", b""]), st.binary(max_size=12)))
    port = draw(st.one_of(st.none(), st.integers(-1, 70000).map(lambda n: str(n).encode()), NASTY))
    auth = host + (b":" + port if port is not None else b"")
    target = draw(st.one_of(
        st.just(auth),
        st.builds(lambda p: b"http://" + auth + b"/" + p, st.binary(max_size=20)),
        st.just(b"/mcp"), st.just(b"/otlp/v1/traces"), st.binary(max_size=20)))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b""]))
    sep = draw(st.sampled_from([b" ", b"  ", b"\t"]))
    line = method + sep + target + b" " + version
    fields = draw(headers())
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n"]))
    text = line + eol + b"".join(k + draw(st.sampled_from([b": ", b":", b" : ", b":\t"])) + v + eol for k, v in fields)
    return text + b"\r\n"


@st.composite
def chunked_body(draw) -> tuple[bytes, bytes | None]:
    """(wire bytes, the body they carry or None when the framing is broken on purpose)."""
    pieces = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=5))
    ext = draw(st.sampled_from([b"", b";a=b", b";x", b" ", b";" + b"a" * 300]))
    upper = draw(st.booleans())
    out = b""
    for p in pieces:
        size = (b"%X" if upper else b"%x") % len(p)
        out += size + ext + b"\r\n" + p + b"\r\n"
    trailers = draw(st.lists(st.tuples(TOKEN.map(str.encode), st.binary(max_size=10)), max_size=2))
    out += b"0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in trailers) + b"\r\n"
    body: bytes | None = b"".join(pieces)
    if ext.startswith(b";" + b"a" * 10) or any(any(c < 32 and c != 9 or c == 127 for c in v) for _, v in trailers):
        body = None  # (an overlong line or a control character in a trailer: broken framing)
    if draw(st.integers(0, 4)) == 0:  # break it: flip, cut or insert
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and out:
            out = out[:i] + bytes([out[i] ^ draw(st.integers(1, 255))]) + out[i + 1:]
        elif how == "cut":
            out = out[:i]
        else:
            out = out[:i] + draw(NASTY) + out[i:]
        body = None
    return out, body


def splits(data: bytes):
    """A strategy: ``data`` cut into non-empty pieces at arbitrary points (framing must not
    depend on reads; an empty piece would be the peer's EOF)."""
    return st.lists(st.integers(0, len(data)), max_size=6).map(
        lambda cuts: [p for p in (data[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(data)])) if p])


@st.composite
def response_bytes(draw) -> bytes:
    status = draw(st.one_of(st.sampled_from([b"200", b"101", b"204", b"304", b"100", b"999", b"20"]), st.binary(max_size=4)))
    fields = draw(headers())
    head = b"HTTP/1.1 " + status + b" OK\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in fields) + b"\r\n"
    body = draw(st.one_of(st.binary(max_size=60), chunked_body().map(lambda t: t[0])))
    return head + body
