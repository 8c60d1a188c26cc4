"""The gate's sans-IO TLS pieces: the ClientHello peek and the in-memory TLS endpoints."""

from __future__ import annotations

import ssl
import struct
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.gate.ca import CertificateAuthority
from agentvm.gate.tls import (
    MAX_HELLO,
    MAX_HELLO_RAW,
    ClientHello,
    ClientHelloParser,
    TLSClientSide,
    TLSParseError,
    TLSServerSide,
    client_context,
    parse_client_hello,
    server_context,
)

# ----------------------------------------------------------------------------- helpers


def _probe_ctx(alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def real_hello(server_hostname: str | None = "example.com", alpn: list[str] | None = None) -> bytes:
    """The first flight of a real Python/OpenSSL client: one record holding its ClientHello."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = _probe_ctx(alpn).wrap_bio(inc, out, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def rerecord(hello: bytes, sizes: list[int], version: bytes | None = None) -> bytes:
    """Re-frame a single-record hello into records carrying ``sizes`` bytes each (rest last)."""
    assert hello[0] == 0x16
    ver = version or hello[1:3]
    (length,) = struct.unpack("!H", hello[3:5])
    payload = hello[5:5 + length]
    out, pos = b"", 0
    for n in sizes:
        n = min(n, len(payload) - pos)
        if n <= 0:
            break
        out += b"\x16" + ver + struct.pack("!H", n) + payload[pos:pos + n]
        pos += n
    if pos < len(payload):
        out += b"\x16" + ver + struct.pack("!H", len(payload) - pos) + payload[pos:]
    return out


def ext(ext_type: int, data: bytes) -> bytes:
    return struct.pack("!HH", ext_type, len(data)) + data


def sni_ext(*names: bytes, name_type: int = 0) -> bytes:
    entries = b"".join(struct.pack("!BH", name_type, len(n)) + n for n in names)
    return ext(0, struct.pack("!H", len(entries)) + entries)


def build_hello(extensions: bytes | None = b"", *, body_extra: bytes = b"", record_version: bytes = b"\x03\x01") -> bytes:
    """A hand-made ClientHello record (for cases a real client will not produce)."""
    body = b"\x03\x03" + b"\x11" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
    if extensions is not None:
        body += struct.pack("!H", len(extensions)) + extensions
    body += body_extra
    hs = b"\x01" + struct.pack("!I", len(body))[1:] + body
    return b"\x16" + record_version + struct.pack("!H", len(hs)) + hs


def check_outcome(data: bytes) -> ClientHello | None | TLSParseError:
    try:
        return parse_client_hello(data)
    except TLSParseError as exc:
        return exc


# ----------------------------------------------------------------------------- parser: real hellos


def test_real_hello_with_sni_and_alpn():
    data = real_hello("allowed.test", ["h2", "http/1.1"])
    hello = parse_client_hello(data)
    assert hello is not None
    assert hello.sni == "allowed.test"
    assert hello.alpn == ("h2", "http/1.1")
    assert 0x0304 in hello.versions and 0x0303 in hello.versions
    assert hello.raw_length == len(data)
    assert hello.extensions[0] == 0 or 0 in hello.extensions
    assert hello.ech is False


def test_real_hello_without_sni_or_alpn():
    hello = parse_client_hello(real_hello(None))
    assert hello is not None
    assert hello.sni is None
    assert hello.alpn == ()
    assert 0 not in hello.extensions


def test_bytes_after_the_hello_are_not_consumed():
    data = real_hello("a.example")
    ccs = b"\x14\x03\x03\x00\x01\x01"  # TLS 1.3 middlebox-compat ChangeCipherSpec record
    hello = parse_client_hello(data + ccs + b"garbage")
    assert hello is not None and hello.raw_length == len(data)


def test_every_prefix_is_incomplete_then_complete():
    data = real_hello("prefix.example", ["http/1.1"])
    for i in range(len(data)):
        assert parse_client_hello(data[:i]) is None, i
    assert parse_client_hello(data).sni == "prefix.example"


def test_incremental_parser_one_byte_at_a_time():
    data = real_hello("bytewise.example")
    p = ClientHelloParser()
    results = [p.feed(data[i:i + 1]) for i in range(len(data))]
    assert all(r is None for r in results[:-1])
    assert results[-1].sni == "bytewise.example"
    assert p.done and p.buffered == data
    # later feeds keep answering the same hello and keep the extra bytes
    assert p.feed(b"\x17\x03\x03") is results[-1]
    assert p.buffered == data + b"\x17\x03\x03"


@pytest.mark.parametrize("sizes", [[1], [2], [3], [4], [5, 7], [40, 1, 1, 60], [1] * 600])
def test_fragmented_hello_is_reassembled(sizes):
    data = real_hello("fragmented.example", ["http/1.1"])
    frag = rerecord(data, sizes)
    hello = parse_client_hello(frag)
    assert hello is not None
    assert hello.sni == "fragmented.example"
    assert hello.alpn == ("http/1.1",)
    assert hello.raw_length == len(frag)
    # and incrementally, byte by byte
    p = ClientHelloParser()
    for i in range(len(frag) - 1):
        assert p.feed(frag[i:i + 1]) is None
    assert p.feed(frag[-1:]) == hello


def test_sni_split_across_records():
    data = real_hello("split.example")
    at = data.index(b"split.example") - 5 + 3  # cut inside the name
    frag = rerecord(data, [at])
    assert parse_client_hello(frag).sni == "split.example"


def test_fragment_of_another_content_type_in_the_middle_is_refused():
    data = real_hello("x.example")
    frag = rerecord(data, [50])
    bad = bytearray(frag)
    bad[5 + 50] = 0x17  # second record claims application_data
    with pytest.raises(TLSParseError, match="content type"):
        parse_client_hello(bytes(bad))


# ----------------------------------------------------------------------------- parser: refusals


@pytest.mark.parametrize(
    "data, match",
    [
        (b"G", "content type"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "content type"),
        (b"\x80\x2e\x01\x03\x01", "SSLv2"),
        (b"\x15\x03\x03\x00\x02\x02\x28", "content type"),  # an alert
        (b"\x16\x02", "major"),
        (b"\x16\x03\x07", "3.7"),
        (b"\x16\x03\x01\x00\x00", "empty"),
        (b"\x16\x03\x01\x40\x01", "2\\^14"),
        (b"\x16\x03\x01\x00\x30\x02", "not ClientHello"),  # ServerHello type, before the record is complete
        (b"\x16\x03\x01\x00\x30\x01\x00\x40\x00", "exceeds"),  # 16 KiB + 4 > MAX_HELLO
        (b"\x16\x03\x01\x00\x30\x01\x00\x00\x05", "too short"),
    ],
)
def test_not_a_client_hello_is_refused_early(data, match):
    with pytest.raises(TLSParseError, match=match):
        parse_client_hello(data)


def test_error_is_sticky():
    p = ClientHelloParser()
    with pytest.raises(TLSParseError):
        p.feed(b"\x17")
    with pytest.raises(TLSParseError):
        p.feed(real_hello())


def test_reassembly_is_bounded():
    # A handshake header announcing just under the limit is accepted as "incomplete"...
    body_len = MAX_HELLO - 4
    head = b"\x01" + struct.pack("!I", body_len)[1:]
    first = b"\x16\x03\x01" + struct.pack("!H", 4) + head
    assert parse_client_hello(first) is None
    # ...but record bytes beyond MAX_HELLO_RAW are refused (tiny records as a slow-loris).
    tiny = b"\x16\x03\x01\x00\x01\x00" * (MAX_HELLO_RAW // 6 + 1)
    with pytest.raises(TLSParseError, match="record bytes"):
        parse_client_hello(first + tiny)


def test_record_with_more_than_the_hello_is_refused():
    data = real_hello("x.example")
    (rlen,) = struct.unpack("!H", data[3:5])
    padded = data[:3] + struct.pack("!H", rlen + 4) + data[5:] + b"\x0b\x00\x00\x00"
    with pytest.raises(TLSParseError, match="after the ClientHello"):
        parse_client_hello(padded)


def test_handshake_length_shorter_than_record_is_refused():
    data = bytearray(real_hello("x.example"))
    hs_len = int.from_bytes(data[6:9], "big")
    data[6:9] = (hs_len - 1).to_bytes(3, "big")
    with pytest.raises(TLSParseError):
        parse_client_hello(bytes(data))


def test_handshake_length_longer_than_record_waits_then_refuses_non_handshake():
    data = bytearray(real_hello("x.example"))
    hs_len = int.from_bytes(data[6:9], "big")
    data[6:9] = (hs_len + 10).to_bytes(3, "big")
    assert parse_client_hello(bytes(data)) is None  # waits for a continuation record
    with pytest.raises(TLSParseError):
        parse_client_hello(bytes(data) + b"\x17\x03\x03\x00\x0a" + b"\x00" * 10)


def test_extensions_length_off_by_one_is_refused():
    good = build_hello(sni_ext(b"x.example"))
    assert parse_client_hello(good).sni == "x.example"
    ext_len_at = len(good) - len(sni_ext(b"x.example")) - 2
    for delta in (-1, +1):
        bad = bytearray(good)
        bad[ext_len_at:ext_len_at + 2] = struct.pack("!H", len(sni_ext(b"x.example")) + delta)
        with pytest.raises(TLSParseError):
            parse_client_hello(bytes(bad))


def test_hand_made_hello_without_extensions_is_fine():
    hello = parse_client_hello(build_hello(None))
    assert hello == ClientHello(sni=None, alpn=(), versions=(), raw_length=len(build_hello(None)))


def test_trailing_garbage_inside_the_message_is_refused():
    with pytest.raises(TLSParseError, match="trailing"):
        parse_client_hello(build_hello(sni_ext(b"a.example"), body_extra=b"\x00"))


@pytest.mark.parametrize(
    "extensions, match",
    [
        (sni_ext(b"a.example", b"b.example"), "more than one host_name"),
        (sni_ext(b"a.exa\x00mple"), "printable ASCII"),
        (sni_ext("bücher.example".encode()), "printable ASCII"),
        (sni_ext(b"a example"), "printable ASCII"),
        (sni_ext(b""), "empty host_name"),
        (sni_ext(b"a" * 256), "longer"),
        (sni_ext(b"a.example", name_type=1), "unknown type"),
        (ext(0, b"\x00\x00"), "empty server_name list"),
        (ext(0, b"\x00\x05\x00\x00\x09a.example"), "trailing"),  # list shorter than its entry
        (ext(0, b"\x00\x0c\x00\x00\x0fa.example"), "exceeds"),  # entry longer than the list
        (ext(0, b"\x00\x0e\x00\x00\x09a.example"), "exceeds"),  # list longer than the extension
        (ext(0, b"\x00\x0c\x00\x00\x09a.example\x00"), "trailing"),  # bytes after the list
        (sni_ext(b"a.example") + sni_ext(b"b.example"), "twice"),
        (ext(16, b"\x00\x00"), "empty ALPN"),
        (ext(16, b"\x00\x03\x00\x01a"), "empty ALPN protocol"),
        (ext(16, b"\x00\x03\x05h2"), "exceeds"),
        (ext(43, b"\x03\x03\x04\x03"), "even"),
        (ext(43, b"\x04\x03\x04"), "exceeds"),
        (ext(99, b"\x00" * 3)[:-1], "exceeds"),
        (b"\x00", "truncated"),
    ],
)
def test_malformed_extensions_are_refused(extensions, match):
    with pytest.raises(TLSParseError, match=match):
        parse_client_hello(build_hello(extensions))


def test_hand_made_hello_fields():
    exts = sni_ext(b"Mixed.Case.Example.") + ext(16, b"\x00\x09\x08http/1.1") + ext(43, b"\x04\x03\x04\x03\x03") + ext(0xFE0D, b"")
    hello = parse_client_hello(build_hello(exts, record_version=b"\x03\x03"))
    assert hello.sni == "Mixed.Case.Example."  # as sent; normalisation is the policy's job
    assert hello.alpn == ("http/1.1",)
    assert hello.versions == (0x0304, 0x0303)
    assert hello.ech is True
    assert hello.extensions == (0, 16, 43, 0xFE0D)


def test_client_version_must_be_tls():
    data = bytearray(build_hello(b""))
    data[9:11] = b"\x02\x00"
    with pytest.raises(TLSParseError, match="client_version"):
        parse_client_hello(bytes(data))


# ----------------------------------------------------------------------------- parser: fuzz

_HELLOS = [real_hello("fuzz.example", ["h2", "http/1.1"]), real_hello(None), build_hello(sni_ext(b"a.b"))]


def _assert_only_allowed_outcomes(data: bytes) -> ClientHello | None | TLSParseError:
    try:
        r = parse_client_hello(data)
    except TLSParseError as exc:
        return exc
    assert r is None or isinstance(r, ClientHello)
    if r is not None:
        assert 0 < r.raw_length <= len(data)
        assert r.sni is None or (r.sni.isascii() and "\x00" not in r.sni)
    return r


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes(data):
    _assert_only_allowed_outcomes(data)
    _assert_only_allowed_outcomes(b"\x16\x03\x01" + data)
    _assert_only_allowed_outcomes(b"\x16\x03\x01" + struct.pack("!H", len(data)) + data)


@st.composite
def mutated_hellos(draw):
    data = bytearray(draw(st.sampled_from(_HELLOS)))
    if draw(st.booleans()):
        data = bytearray(rerecord(bytes(data), draw(st.lists(st.integers(1, 80), max_size=6))))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, data[pos] + 1 & 0xFF, data[pos] - 1 & 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 4))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_hellos())
def test_fuzz_mutated_real_hellos(data):
    _assert_only_allowed_outcomes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated_hellos(), st.sampled_from(_HELLOS)), st.lists(st.integers(1, 64), max_size=40))
def test_fuzz_chunking_never_changes_the_answer(data, cuts):
    whole = check_outcome(data)
    p = ClientHelloParser()
    got: object = None
    pos = 0
    for n in cuts + [len(data)]:
        chunk = data[pos:pos + n]
        pos += n
        try:
            got = p.feed(chunk)
        except TLSParseError as exc:
            got = exc
            break
        if got is not None:
            break
    if isinstance(whole, TLSParseError):
        assert isinstance(got, TLSParseError)
    else:
        assert got == whole


# ----------------------------------------------------------------------------- TLS endpoints


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path_factory.mktemp("gate") / "ca")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path_factory.mktemp("other") / "ca")


@pytest.fixture(scope="module")
def sctx(ca) -> ssl.SSLContext:
    return server_context(ca)


def pump(client: TLSClientSide, server: TLSServerSide, *, preread: bytes = b"", rounds: int = 10) -> None:
    """Drive both handshakes to completion, moving bytes both ways like a socket pair."""
    if preread:
        server.receive(preread)
    for _ in range(rounds):
        c_done = client.handshake()
        server.receive(client.outgoing())
        s_done = server.handshake()
        client.receive(server.outgoing())
        if c_done and s_done:
            return
    raise AssertionError("handshake did not finish")


def test_full_handshake_data_both_ways_and_close(ca, sctx):
    from cryptography import x509

    client = TLSClientSide(client_context(str(ca.cert_path)), "allowed.test")
    assert client.handshake() is False
    first = client.outgoing()
    peek = parse_client_hello(first)
    assert peek is not None and peek.sni == "allowed.test" and peek.alpn == ("http/1.1",)

    server = TLSServerSide(sctx, preread=first)  # the peeked bytes go in first
    pump(client, server)
    assert server.peer_sni == "allowed.test"
    assert client.selected_alpn == "http/1.1" == server.selected_alpn
    assert client.version in ("TLSv1.2", "TLSv1.3")

    leaf = x509.load_der_x509_certificate(client.peer_cert_der)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["allowed.test"]
    leaf.verify_directly_issued_by(ca.certificate)
    assert leaf.issuer == ca.certificate.subject

    client.write(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    server.receive(client.outgoing())
    assert server.read() == b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    assert server.read() == b""

    big = bytes(range(256)) * 1000
    server.write(big)
    client.receive(server.outgoing())
    assert client.read() == big

    # data and close_notify in one flight: the data comes out, then eof
    client.write(b"last words")
    client.close()
    server.receive(client.outgoing())
    assert server.read() == b"last words"
    assert server.eof
    assert server.read() == b""
    server.close()
    client.receive(server.outgoing())
    assert client.read() == b""
    assert client.eof
    with pytest.raises(RuntimeError):
        client.write(b"after close")


def test_per_host_contexts_are_cached(ca):
    ctx = server_context(ca, cache_size=2)
    hosts = ctx._agentvm_host_contexts
    for name in ["one.test", "ONE.test", "two.test", "three.test", "Three.Test"]:
        c, s = TLSClientSide(client_context(str(ca.cert_path)), name), TLSServerSide(ctx)
        pump(c, s)
        assert s.peer_sni == name
    assert len(hosts) == 2  # bounded LRU


def test_client_trusting_a_different_ca_fails(other_ca, sctx):
    client = TLSClientSide(client_context(str(other_ca.cert_path)), "allowed.test")
    server = TLSServerSide(sctx)
    with pytest.raises(ssl.SSLCertVerificationError):
        pump(client, server)


def test_client_without_sni_fails_the_handshake(ca, sctx):
    ctx = _probe_ctx(["http/1.1"])
    ctx.load_verify_locations(cafile=str(ca.cert_path))
    client = TLSClientSide(ctx, None)
    server = TLSServerSide(sctx)
    client.handshake()
    server.receive(client.outgoing())
    with pytest.raises(ssl.SSLError):
        server.handshake()
    assert server.peer_sni is None
    assert isinstance(server.sni_error, TLSParseError)
    alert = server.outgoing()
    assert alert[:1] == b"\x15"  # a fatal alert goes back to the client
    client.receive(alert)
    with pytest.raises(ssl.SSLError):
        client.handshake()


def test_sni_the_ca_refuses_to_sign_fails_the_handshake(ca, sctx):
    ctx = _probe_ctx()
    client = TLSClientSide(ctx, "bad-.example")
    server = TLSServerSide(sctx)
    client.handshake()
    server.receive(client.outgoing())
    with pytest.raises(ssl.SSLError):
        server.handshake()
    assert server.peer_sni == "bad-.example"
    assert isinstance(server.sni_error, ValueError)


def test_transport_eof_without_close_notify_raises(ca, sctx):
    client = TLSClientSide(client_context(str(ca.cert_path)), "allowed.test")
    server = TLSServerSide(sctx)
    pump(client, server)
    client.write(b"partial")
    server.receive(client.outgoing())
    server.receive_eof()
    assert server.read() == b"partial"  # data first...
    with pytest.raises(ssl.SSLEOFError):  # ...then the truncation is reported
        server.read()


def test_tls12_only_client_still_works_and_old_versions_are_refused(ca, sctx):
    ctx = client_context(str(ca.cert_path))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    client, server = TLSClientSide(ctx, "v12.test"), TLSServerSide(sctx)
    pump(client, server)
    assert client.version == "TLSv1.2" and server.selected_alpn == "http/1.1"

    old = _probe_ctx()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    client, server = TLSClientSide(old, "v11.test"), TLSServerSide(sctx)
    with pytest.raises(ssl.SSLError):
        pump(client, server)


def test_contexts_are_hardened(ca, sctx):
    cctx = client_context(None)
    assert cctx.check_hostname and cctx.verify_mode == ssl.CERT_REQUIRED
    for ctx in (cctx, sctx):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
        assert ctx.options & ssl.OP_NO_RENEGOTIATION
    assert sctx.sni_callback is not None


def test_write_before_handshake_is_an_error(sctx):
    with pytest.raises(RuntimeError):
        TLSServerSide(sctx).write(b"x")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 20000), min_size=1, max_size=12), cuts=st.lists(st.integers(1, 9000), max_size=40))
def test_a_read_that_skips_openssl_never_leaves_data_behind(ca, sctx, sizes, cuts):
    """_TLSSide.read() does not call OpenSSL when no ciphertext and no decrypted bytes wait
    (it would only raise SSLWantReadError). That holds only while OpenSSL reads one record at a
    time (no read-ahead): after every read, whatever piece of the ciphertext arrived, a raw read
    must find nothing more - and every byte comes out, in order, then the close_notify."""
    client = TLSClientSide(client_context(str(ca.cert_path)), "allowed.test")
    server = TLSServerSide(sctx)
    pump(client, server)
    sent = b""
    for i, n in enumerate(sizes):
        piece = bytes([i % 251]) * n
        client.write(piece)
        sent += piece
    client.close()
    wire = client.outgoing()
    got = b""
    pos = 0
    for cut in [*cuts, len(wire)]:
        if pos >= len(wire):
            break
        server.receive(wire[pos:pos + cut])
        pos += cut
        got += server.read()
        if not server.eof:
            with pytest.raises(ssl.SSLWantReadError):
                server._obj.read(65536)
    assert got == sent and server.eof


def test_a_handshake_trickled_a_byte_at_a_time_is_cut_at_the_hello_deadline(ca, sctx, monkeypatch):
    """TLSStream.handshake has HELLO_TIMEOUT for the whole handshake: a client sending its
    second flight (Finished) a byte every 50 ms is cut, not given HELLO_TIMEOUT per byte."""
    import asyncio

    from agentvm.gate import streams

    monkeypatch.setattr(streams, "HELLO_TIMEOUT", 0.5)
    client = TLSClientSide(client_context(str(ca.cert_path)), "allowed.test")
    client.handshake()
    hello = client.outgoing()

    class Trickle:  # the raw connection: the client's bytes one at a time, 50 ms apart
        def __init__(self):
            self.pending = b""

        async def write(self, data):
            client.receive(data)
            client.handshake()
            self.pending += client.outgoing()

        async def read(self, n=65536):
            while True:
                await asyncio.sleep(0.05)
                if self.pending:
                    one, self.pending = self.pending[:1], self.pending[1:]
                    return one

    async def go():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await streams.TLSStream(Trickle(), TLSServerSide(sctx)).handshake(hello)
        return loop.time() - t0

    took = asyncio.run(go())
    assert 0.4 <= took < 2.0, took
