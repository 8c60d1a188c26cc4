"""Sans-IO TLS pieces of the egress gate.

Nothing here touches a socket. Bytes go in, bytes (or parsed facts) come out:

* :func:`parse_client_hello` / :class:`ClientHelloParser` - read the first handshake
  message of a client's TLS stream (the *peek* the gate does before it decides whether to
  splice the connection or terminate it). Strict: every length is checked against its
  container, nothing is read past a declared length, and anything that is not a plain
  TLS ClientHello raises :class:`TLSParseError`. A handshake message fragmented over
  several records is reassembled (attackers split the SNI across records to fool
  peekers), up to :data:`MAX_HELLO` bytes of handshake message.
* :class:`TLSServerSide` / :class:`TLSClientSide` - ``ssl.SSLObject`` over two
  ``ssl.MemoryBIO`` s: ``receive`` ciphertext, ``handshake``, ``read`` / ``write``
  plaintext, ``outgoing`` ciphertext to put on the wire.
* :func:`server_context` - the context that terminates the agent's TLS with a leaf
  minted on the fly by the per-installation CA for the SNI the client sent.
* :func:`client_context` - the context for the gate's own connections upstream.

``ssl`` is imported lazily: parsing a ClientHello does not need it, and importing
``agentvm.gate.tls`` must stay cheap.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    import ssl

    from agentvm.gate.ca import CertificateAuthority

__all__ = [
    "MAX_HELLO",
    "MAX_HELLO_RAW",
    "ClientHello",
    "ClientHelloParser",
    "TLSParseError",
    "TLSServerSide",
    "TLSClientSide",
    "parse_client_hello",
    "server_context",
    "client_context",
    "ALPN_HTTP1",
    "ALPN_H2",
]

#: Largest ClientHello handshake message (4-byte header included) the parser reassembles.
MAX_HELLO = 16384
#: Largest number of raw record bytes (headers included) the parser will buffer for one
#: hello. Bounds the work of a peer that fragments its hello into tiny records.
MAX_HELLO_RAW = 2 * MAX_HELLO

ALPN_HTTP1 = "http/1.1"
ALPN_H2 = "h2"

_CT_HANDSHAKE = 0x16
_HS_CLIENT_HELLO = 0x01
_MAX_RECORD_PAYLOAD = 1 << 14  # TLSPlaintext.length <= 2^14
_RECORD_HEADER = 5

_EXT_SERVER_NAME = 0
_EXT_ALPN = 16
_EXT_SUPPORTED_VERSIONS = 43
_EXT_ECH = 0xFE0D  # encrypted_client_hello (draft-ietf-tls-esni)
_SNI_HOST_NAME = 0
_MAX_HOSTNAME = 255


class TLSParseError(ValueError):
    """The bytes are not (the start of) an acceptable TLS ClientHello."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    """The facts the gate needs from a ClientHello.

    ``sni`` is the single ``host_name`` of the server_name extension exactly as sent
    (ASCII; not lower-cased, trailing dot kept) or ``None`` without the extension.
    ``alpn`` lists the offered protocols in order, ``versions`` the supported_versions
    extension (GREASE values included, empty without the extension). ``raw_length`` is
    how many bytes of the stream the hello occupied (every record that carried it).
    ``ech`` is True when an encrypted_client_hello extension was offered: then ``sni``
    is only the outer, public name.
    """

    sni: str | None
    alpn: tuple[str, ...]
    versions: tuple[int, ...]
    raw_length: int
    legacy_version: int = 0x0303
    extensions: tuple[int, ...] = ()
    ech: bool = False


class _Reader:
    """A bounds-checked cursor over one byte range; every read is length-checked."""

    __slots__ = ("_data", "_pos", "_end")

    def __init__(self, data: bytes | memoryview, start: int = 0, end: int | None = None) -> None:
        self._data = data
        self._pos = start
        self._end = len(data) if end is None else end

    def remaining(self) -> int:
        return self._end - self._pos

    def u8(self, what: str) -> int:
        if self._end - self._pos < 1:
            raise TLSParseError(f"truncated {what}")
        v = self._data[self._pos]
        self._pos += 1
        return v

    def u16(self, what: str) -> int:
        if self._end - self._pos < 2:
            raise TLSParseError(f"truncated {what}")
        v = (self._data[self._pos] << 8) | self._data[self._pos + 1]
        self._pos += 2
        return v

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self._end - self._pos < n:
            raise TLSParseError(f"{what}: declared length {n} exceeds the {self._end - self._pos} bytes left")
        v = bytes(self._data[self._pos:self._pos + n])
        self._pos += n
        return v

    def sub(self, n: int, what: str) -> "_Reader":
        """A reader over the next ``n`` bytes; this reader skips past them."""
        if n < 0 or self._end - self._pos < n:
            raise TLSParseError(f"{what}: declared length {n} exceeds the {self._end - self._pos} bytes left")
        r = _Reader(self._data, self._pos, self._pos + n)
        self._pos += n
        return r

    def expect_end(self, what: str) -> None:
        if self._pos != self._end:
            raise TLSParseError(f"{self._end - self._pos} trailing bytes after {what}")


def _check_record_header(buf: bytearray, pos: int, first: bool) -> int | None:
    """Validate the (possibly partial) record header at ``pos``; its payload length or None."""
    avail = len(buf) - pos
    if avail >= 1:
        ct = buf[pos]
        if ct != _CT_HANDSHAKE:
            if first and ct & 0x80:
                raise TLSParseError("SSLv2-style ClientHello is not supported")
            raise TLSParseError(f"record content type {ct:#04x} is not handshake (0x16)")
    if avail >= 2 and buf[pos + 1] != 3:
        raise TLSParseError(f"record version major {buf[pos + 1]} is not 3")
    if avail >= 3 and buf[pos + 2] > 4:
        raise TLSParseError(f"record version 3.{buf[pos + 2]} is not a TLS version")
    if avail < _RECORD_HEADER:
        return None
    length = (buf[pos + 3] << 8) | buf[pos + 4]
    if length == 0:
        raise TLSParseError("empty handshake record")
    if length > _MAX_RECORD_PAYLOAD:
        raise TLSParseError(f"record length {length} exceeds 2^14")
    return length


class ClientHelloParser:
    """Incremental ClientHello parser: ``feed`` bytes as they arrive.

    ``feed`` returns ``None`` while more bytes are needed, the :class:`ClientHello` once
    complete (and on every later call), and raises :class:`TLSParseError` as soon as the
    bytes cannot be a ClientHello (and on every later call). Each byte is examined a
    bounded number of times, so feeding one byte at a time is linear overall.
    Bytes after the hello are kept (see :attr:`buffered`) but never interpreted.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # start of the next record not yet consumed
        self._hs = bytearray()  # reassembled handshake message bytes so far
        self._hs_total: int | None = None  # 4 + declared handshake body length
        self._result: ClientHello | None = None
        self._error: TLSParseError | None = None

    @property
    def buffered(self) -> bytes:
        """Every byte fed so far (the hello and anything after it)."""
        return bytes(self._buf)

    @property
    def done(self) -> bool:
        return self._result is not None

    def feed(self, data: bytes) -> ClientHello | None:
        if self._error is not None:
            raise self._error
        if data:
            self._buf += data
        if self._result is not None:
            return self._result
        try:
            self._result = self._advance()
        except TLSParseError as exc:
            self._error = exc
            raise
        return self._result

    def _check_hs_header(self, hs: bytes | bytearray) -> None:
        if len(hs) >= 1 and hs[0] != _HS_CLIENT_HELLO:
            raise TLSParseError(f"handshake message type {hs[0]} is not ClientHello (1)")
        if len(hs) >= 4 and self._hs_total is None:
            body = (hs[1] << 16) | (hs[2] << 8) | hs[3]
            if body + 4 > MAX_HELLO:
                raise TLSParseError(f"ClientHello of {body + 4} bytes exceeds the {MAX_HELLO}-byte limit")
            if body < 2 + 32 + 1 + 2 + 1:
                raise TLSParseError(f"ClientHello body of {body} bytes is too short")
            self._hs_total = body + 4

    def _advance(self) -> ClientHello | None:
        buf = self._buf
        while True:
            first = self._pos == 0
            length = _check_record_header(buf, self._pos, first)
            if length is None:
                return None
            if self._pos + _RECORD_HEADER + length > MAX_HELLO_RAW:
                raise TLSParseError(f"ClientHello spread over more than {MAX_HELLO_RAW} record bytes")
            start = self._pos + _RECORD_HEADER
            avail = min(length, len(buf) - start)
            if len(self._hs) < 4 and avail > 0:
                # Reject a wrong message type/length before the whole record arrives.
                self._check_hs_header(self._hs + buf[start:start + min(avail, 4 - len(self._hs))])
            if avail < length:
                return None
            self._hs += buf[start:start + length]
            self._pos = start + length
            self._check_hs_header(self._hs)
            total = self._hs_total
            if total is None:
                continue  # the 4-byte handshake header itself is fragmented
            if len(self._hs) > total:
                raise TLSParseError("bytes after the ClientHello inside its last record")
            if len(self._hs) == total:
                return _parse_hello_body(memoryview(self._hs)[4:], self._pos)


def parse_client_hello(data: bytes) -> ClientHello | None:
    """Parse the ClientHello at the start of a TLS stream.

    ``None``: incomplete, call again with more bytes (the whole buffer, from the start).
    Raises :class:`TLSParseError` when ``data`` cannot be the start of a ClientHello.
    Bytes after ``raw_length`` are ignored. For byte-at-a-time input prefer a
    :class:`ClientHelloParser`, which does not rescan what it has seen.
    """
    return ClientHelloParser().feed(data)


def _ascii(raw: bytes, what: str) -> str:
    if not raw:
        raise TLSParseError(f"empty {what}")
    for b in raw:
        if b < 0x21 or b > 0x7E:
            raise TLSParseError(f"{what} contains a byte {b:#04x} that is not printable ASCII")
    return raw.decode("ascii")


def _parse_sni(r: _Reader) -> str:
    names = r.sub(r.u16("server_name list length"), "server_name list")
    r.expect_end("server_name list")
    if names.remaining() == 0:
        raise TLSParseError("empty server_name list")
    host: str | None = None
    while names.remaining():
        name_type = names.u8("server_name type")
        raw = names.take(names.u16("server_name length"), "server_name")
        if name_type != _SNI_HOST_NAME:
            raise TLSParseError(f"server_name of unknown type {name_type}")
        if host is not None:
            raise TLSParseError("more than one host_name in server_name")
        if len(raw) > _MAX_HOSTNAME:
            raise TLSParseError(f"host_name of {len(raw)} bytes is longer than {_MAX_HOSTNAME}")
        host = _ascii(raw, "host_name")
    assert host is not None
    return host


def _parse_alpn(r: _Reader) -> tuple[str, ...]:
    lst = r.sub(r.u16("ALPN list length"), "ALPN list")
    r.expect_end("ALPN list")
    if lst.remaining() == 0:
        raise TLSParseError("empty ALPN list")
    out: list[str] = []
    while lst.remaining():
        out.append(_ascii(lst.take(lst.u8("ALPN protocol length"), "ALPN protocol"), "ALPN protocol"))
    return tuple(out)


def _parse_versions(r: _Reader) -> tuple[int, ...]:
    n = r.u8("supported_versions length")
    if n == 0 or n % 2:
        raise TLSParseError(f"supported_versions length {n} is not a positive even number")
    lst = r.sub(n, "supported_versions")
    r.expect_end("supported_versions")
    return tuple(lst.u16("version") for _ in range(n // 2))


def _parse_hello_body(body: memoryview, raw_length: int) -> ClientHello:
    r = _Reader(body)
    legacy_version = r.u16("client_version")
    if legacy_version >> 8 != 3:
        raise TLSParseError(f"client_version {legacy_version:#06x} is not TLS")
    r.take(32, "random")
    sid_len = r.u8("session_id length")
    if sid_len > 32:
        raise TLSParseError(f"session_id length {sid_len} exceeds 32")
    r.take(sid_len, "session_id")
    cs_len = r.u16("cipher_suites length")
    if cs_len < 2 or cs_len % 2:
        raise TLSParseError(f"cipher_suites length {cs_len} is not a positive even number")
    r.take(cs_len, "cipher_suites")
    cm_len = r.u8("compression_methods length")
    if cm_len < 1:
        raise TLSParseError("no compression_methods")
    r.take(cm_len, "compression_methods")

    sni: str | None = None
    alpn: tuple[str, ...] = ()
    versions: tuple[int, ...] = ()
    types: list[int] = []
    if r.remaining():  # extensions are optional (pre-TLS 1.3 clients)
        exts = r.sub(r.u16("extensions length"), "extensions")
        r.expect_end("ClientHello")
        seen: set[int] = set()
        while exts.remaining():
            ext_type = exts.u16("extension type")
            data = exts.sub(exts.u16("extension length"), f"extension {ext_type}")
            if ext_type in seen:
                raise TLSParseError(f"extension {ext_type} appears twice")
            seen.add(ext_type)
            types.append(ext_type)
            if ext_type == _EXT_SERVER_NAME:
                sni = _parse_sni(data)
            elif ext_type == _EXT_ALPN:
                alpn = _parse_alpn(data)
            elif ext_type == _EXT_SUPPORTED_VERSIONS:
                versions = _parse_versions(data)
    return ClientHello(
        sni=sni,
        alpn=alpn,
        versions=versions,
        raw_length=raw_length,
        legacy_version=legacy_version,
        extensions=tuple(types),
        ech=_EXT_ECH in types,
    )


# --------------------------------------------------------------------------- endpoints


class _TLSSide:
    """``ssl.SSLObject`` over two memory BIOs; see :class:`TLSServerSide`."""

    def __init__(self, context: "ssl.SSLContext", *, server_side: bool, server_hostname: str | None) -> None:
        import ssl

        self._ssl = ssl
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=server_hostname
        )
        self.handshake_done = False
        #: True once the peer's close_notify was read (``read`` then returns b"").
        self.eof = False
        self.closed = False
        self._pending_error: BaseException | None = None

    # -- bytes in / out
    def receive(self, data: bytes) -> None:
        """Ciphertext from the peer."""
        if data:
            self._incoming.write(data)

    def receive_eof(self) -> None:
        """The transport reached EOF (no more ciphertext will arrive)."""
        self._incoming.write_eof()

    def outgoing(self) -> bytes:
        """Ciphertext to send to the peer (b"" if none). Flush it after errors too: it may hold an alert."""
        return self._outgoing.read()

    # -- TLS operations
    def handshake(self) -> bool:
        """Advance the handshake; True once complete. Raises ``ssl.SSLError`` on failure."""
        if self.handshake_done:
            return True
        try:
            self._obj.do_handshake()
        except self._ssl.SSLWantReadError:
            return False
        self.handshake_done = True
        return True

    def read(self) -> bytes:
        """All decrypted application data available now (b"" if none).

        The peer's close_notify sets :attr:`eof`. A transport EOF without close_notify
        (after :meth:`receive_eof`) raises ``ssl.SSLEOFError`` - possible truncation;
        the caller decides. Data decrypted before an error is returned first; the error
        is raised by the next call.
        """
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err
        if not self.handshake_done or self.eof:
            return b""
        ssl = self._ssl
        chunks: list[bytes] = []
        incoming, obj = self._incoming, self._obj
        while True:
            if not incoming.pending and not obj.pending() and not incoming.eof:
                # nothing left to decrypt: a read could only raise SSLWantReadError (an exception
                # per read, on every request of a terminated tunnel). OpenSSL reads one record at
                # a time from the BIO (no read-ahead), so an empty BIO and nothing decrypted
                # pending means no whole record is waiting
                break
            try:
                chunk = obj.read(65536)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self.eof = True
                break
            except ssl.SSLError as exc:
                if not chunks:
                    raise
                self._pending_error = exc
                break
            if not chunk:
                self.eof = True
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def write(self, data: bytes) -> None:
        """Encrypt application data; the ciphertext appears in :meth:`outgoing`."""
        if not self.handshake_done:
            raise RuntimeError("TLS write before the handshake completed")
        if self.closed:
            raise RuntimeError("TLS write after close")
        view = memoryview(data)
        while view:
            n = self._obj.write(view)
            view = view[n:]

    def close(self) -> None:
        """Queue a close_notify (collect it with :meth:`outgoing`). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.handshake_done:
            return
        try:
            self._obj.unwrap()
        except (self._ssl.SSLWantReadError, self._ssl.SSLZeroReturnError):
            pass  # our close_notify is queued; the peer's has not arrived (or already did)
        except self._ssl.SSLError:
            pass  # the session is already broken; nothing to say politely

    # -- facts
    @property
    def selected_alpn(self) -> str | None:
        return self._obj.selected_alpn_protocol()

    @property
    def version(self) -> str | None:
        return self._obj.version()

    @property
    def cipher(self) -> tuple[str, str, int] | None:
        return self._obj.cipher()

    @property
    def peer_cert_der(self) -> bytes | None:
        """The peer's certificate (DER) once the handshake is done; None if it sent none."""
        return self._obj.getpeercert(binary_form=True)


class TLSServerSide(_TLSSide):
    """The gate's end of the agent's TLS connection (the gate plays the server).

    Bytes already read while peeking the ClientHello are given as ``preread`` (or simply
    :meth:`receive` d first). Peek with :func:`parse_client_hello` before handing bytes
    here: the parser refuses malformed names that ``ssl`` would only fail on noisily.
    :attr:`peer_sni` is the SNI the client sent (captured by :func:`server_context`'s
    sni_callback), available once the ClientHello was processed.
    """

    def __init__(self, context: "ssl.SSLContext", preread: bytes = b"", alpn: tuple[str, ...] = (ALPN_HTTP1,)) -> None:
        super().__init__(context, server_side=True, server_hostname=None)
        self._obj._agentvm_alpn = tuple(alpn)  # read by server_context's sni_callback
        self.receive(preread)

    @property
    def peer_sni(self) -> str | None:
        return getattr(self._obj, "_agentvm_sni", None)

    @property
    def sni_error(self) -> BaseException | None:
        """Why the sni_callback refused the handshake (None if it did not)."""
        return getattr(self._obj, "_agentvm_sni_error", None)


class TLSClientSide(_TLSSide):
    """The gate's connection upstream (or a test client). ``server_hostname`` is sent as
    SNI and checked against the certificate when the context has ``check_hostname``."""

    def __init__(self, context: "ssl.SSLContext", server_hostname: str | None) -> None:
        super().__init__(context, server_side=False, server_hostname=server_hostname)
        self.server_hostname = server_hostname


# --------------------------------------------------------------------------- contexts

#: How many per-host server contexts :func:`server_context` keeps.
HOST_CONTEXT_CACHE = 1024
#: A per-host context is rebuilt after this many seconds, so long-running gates pick up
#: the CA's renewed leaves (leaves live 7 days and are renewed with 2 days left).
HOST_CONTEXT_TTL = 24 * 3600.0


def _harden(ctx: "ssl.SSLContext", alpn: tuple[str, ...] = (ALPN_HTTP1,)) -> None:
    import ssl

    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_alpn_protocols(list(alpn))


def _new_server_ctx(alpn: tuple[str, ...] = (ALPN_HTTP1,)) -> "ssl.SSLContext":
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx, alpn)
    # No session resumption: nothing to gain for a terminating gate, and no ticket keys
    # or cached sessions that could carry across hosts.
    ctx.options |= ssl.OP_NO_TICKET
    ctx.num_tickets = 0
    ctx.verify_mode = ssl.CERT_NONE  # the agent authenticates by the socket it uses
    return ctx


class _HostContexts:
    """Bounded LRU of per-host server contexts, each holding that host's leaf."""

    def __init__(self, ca: "CertificateAuthority", size: int, ttl: float, clock: Callable[[], float]) -> None:
        self._ca = ca
        self._size = size
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, tuple[str, ...]], tuple[float, "ssl.SSLContext"]] = OrderedDict()

    def get(self, host: str, alpn: tuple[str, ...] = (ALPN_HTTP1,)) -> "ssl.SSLContext":
        now = self._clock()
        key = (host, alpn)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < self._ttl:
                self._cache.move_to_end(key)
                return hit[1]
        certfile, keyfile = self._ca.leaf_files(host)  # validates host; may mint
        ctx = _new_server_ctx(alpn)
        ctx.load_cert_chain(str(certfile), str(keyfile))
        with self._lock:
            self._cache[key] = (now, ctx)
            self._cache.move_to_end(key)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return ctx

    def __len__(self) -> int:
        return len(self._cache)


def server_context(
    ca: "CertificateAuthority",
    *,
    cache_size: int = HOST_CONTEXT_CACHE,
    ttl: float = HOST_CONTEXT_TTL,
    clock: Callable[[], float] = time.monotonic,
) -> "ssl.SSLContext":
    """A TLS >= 1.2 server context that presents a CA-minted leaf for the client's SNI.

    ALPN offers what the :class:`TLSServerSide` asked for (``http/1.1`` unless ``h2`` too: the
    gate offers ``h2`` only where the upstream speaks it). The ``sni_callback`` swaps the
    connection to a per-host context (bounded LRU) holding the leaf from
    ``ca.leaf_files(host)`` (and that ALPN list: OpenSSL selects ALPN after the callback). A
    ClientHello without SNI, or with a name the CA refuses to sign, fails the handshake
    with an ``unrecognized_name`` alert.
    """
    import ssl

    from agentvm.gate.policy import normalize_host

    ctx = _new_server_ctx()
    hosts = _HostContexts(ca, cache_size, ttl, clock)

    def _sni(ssl_obj, server_name, _ctx):  # noqa: ANN001 - ssl's callback signature
        try:
            ssl_obj._agentvm_sni = server_name
            if not server_name:
                raise TLSParseError("the ClientHello has no SNI; the gate needs one to pick a certificate")
            ssl_obj.context = hosts.get(normalize_host(server_name), getattr(ssl_obj, "_agentvm_alpn", (ALPN_HTTP1,)))
        except Exception as exc:  # noqa: BLE001 - an exception here must fail closed, not print
            ssl_obj._agentvm_sni_error = exc
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        return None

    ctx.sni_callback = _sni
    ctx._agentvm_host_contexts = hosts  # type: ignore[attr-defined]  # for tests/diagnostics
    return ctx


def client_context(extra_ca_pem_path: str | None = None, alpn: tuple[str, ...] = (ALPN_HTTP1,)) -> "ssl.SSLContext":
    """The context for the gate's upstream connections.

    Verifies with the system default CAs plus, optionally, an operator CA file (PEM);
    hostname checking on; TLS >= 1.2; ALPN ``http/1.1`` (or ``alpn``).
    """
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if extra_ca_pem_path:
        ctx.load_verify_locations(cafile=extra_ca_pem_path)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    _harden(ctx, alpn)
    return ctx
