"""HTTP/1.1 message framing for the relay, sans-IO: bodies in, events out; heads out as bytes.

The gate re-frames every message it relays (it never forwards the sender's framing), so the
sandbox, the gate and the upstream cannot disagree about where a message ends:

* :class:`RequestBody` - the sandbox's request body after a head ``h1`` already checked:
  ``Content-Length`` counted, or ``chunked`` decoded strictly (hex sizes of at most 16 digits,
  CRLF only - a bare CR or LF anywhere is refused -, chunk extensions of visible characters,
  trailers with the header rules of ``h1.check_head``). What follows the body is the next
  request (``trailing``).
* :class:`ResponseReader` - the upstream's response, parsed by llhttp (``httptools``, strict:
  no leniency flags), one reader per response; knows ``HEAD`` and 1xx, 204 and 304 have no
  body, and a response framed by the connection's end.
* :func:`request_head`, :func:`response_head`, :func:`chunk` - what the gate sends; header
  names and values are checked once more here (a credential's real value with a CR or LF in it
  must not become a header of its own).

This replaced h11 on the relay path: the same strictness (``tests/unit/test_gate_h1.py``, the
smuggling cases of the end-to-end suites) for about a third of the CPU per request.
"""

from __future__ import annotations

import re

import httptools

from agentvm.gate.httpsyntax import NOT_CTL, TARGET_BAD_RE, TCHAR, TOKEN_RE, VALUE_CTL_RE

MAX_RESPONSE_HEAD = 64 * 1024  # bytes of response heads (1xx included) before the final one ends
MAX_FIELDS = 256
MAX_REASON = 1024
NEED_DATA = object()
END = object()

MAX_CHUNK_LINE = 1024
MAX_TRAILERS = 64 * 1024
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[\x21-\x7e \t]*)?[ \t]*\Z")


class FramingError(ValueError):
    """A body (from the sandbox or the upstream) that breaks HTTP/1.1 framing."""


# ---------------------------------------------------------------------------- request bodies


class RequestBody:
    """The body of one request from the sandbox. ``receive_data(b"")`` is the sandbox's EOF.

    ``next_event()`` -> ``NEED_DATA``, a ``bytes`` piece of the body, or ``END``; raises
    :class:`FramingError` on broken chunked framing, ``EOFError`` on an EOF inside the body."""

    __slots__ = ("_buf", "_left", "_state", "_eof", "chunked", "_trailer_bytes")

    def __init__(self, content_length: int | None, chunked: bool, rest: bytes = b"") -> None:
        self._buf = bytearray(rest)
        self._eof = False
        self.chunked = chunked
        self._trailer_bytes = 0
        if chunked:
            self._state, self._left = "size", 0
        elif content_length:
            self._state, self._left = "data", content_length
        else:
            self._state, self._left = "done", 0

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def trailing(self) -> bytes:
        """Bytes after the end of this body (the next pipelined request); only once ``done``."""
        return bytes(self._buf) if self._state == "done" else b""

    def receive_data(self, data: bytes) -> None:
        if data:
            self._buf += data
        else:
            self._eof = True

    def _line(self, limit: int) -> bytes | None:
        buf = self._buf
        i = buf.find(b"\n")
        if i < 0:
            if len(buf) > limit or b"\r" in buf[:-1]:
                raise FramingError("chunk line too long or with a bare CR")
            return None
        if i == 0 or buf[i - 1] != 0x0D:
            raise FramingError("bare LF in chunked framing")
        line = bytes(buf[: i - 1])
        if b"\r" in line or len(line) > limit:
            raise FramingError("bare CR or overlong line in chunked framing")
        del buf[: i + 1]
        return line

    def next_event(self):
        while True:
            st = self._state
            if st == "done":
                return END
            if st == "data":
                if self._buf:
                    n = min(self._left, len(self._buf))
                    piece = bytes(self._buf[:n])
                    del self._buf[:n]
                    self._left -= n
                    if not self._left:
                        self._state = "crlf" if self.chunked else "done"
                    return piece
            elif st == "size":
                line = self._line(MAX_CHUNK_LINE)
                if line is not None:
                    m = _CHUNK_LINE.match(line)
                    if m is None:
                        raise FramingError("malformed chunk size line")
                    size = int(m.group(1), 16)
                    self._state, self._left = ("data", size) if size else ("trailer", 0)
                    continue
            elif st == "crlf":
                if len(self._buf) >= 2:
                    if self._buf[:2] != b"\r\n":
                        raise FramingError("chunk data not followed by CRLF")
                    del self._buf[:2]
                    self._state = "size"
                    continue
            elif st == "trailer":
                line = self._line(MAX_TRAILERS)
                if line is not None:
                    if not line:
                        self._state = "done"
                        return END
                    self._trailer_bytes += len(line) + 2
                    name, sep, value = line.partition(b":")
                    if (not sep or not TOKEN_RE.match(name) or VALUE_CTL_RE.search(value)
                            or self._trailer_bytes > MAX_TRAILERS):
                        raise FramingError("malformed chunked trailer")
                    continue  # trailers are read and dropped (never forwarded)
            if self._eof:
                raise EOFError("the sandbox closed the connection inside a request body")
            return NEED_DATA


# ---------------------------------------------------------------------------- responses


class Head:
    """A response head from the upstream: status, reason, headers (names lower-case)."""

    __slots__ = ("status", "reason", "headers", "version")

    def __init__(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], version: str) -> None:
        self.status, self.reason, self.headers, self.version = status, reason, headers, version


class Upgraded:
    """The upstream switched protocols (101): ``rest`` is what followed the head."""

    __slots__ = ("head", "rest")

    def __init__(self, head: Head, rest: bytes) -> None:
        self.head, self.rest = head, rest


class ResponseReader:
    """One response from the upstream (llhttp via httptools). ``receive_data(b"")`` is EOF.

    ``next_event()`` -> ``NEED_DATA``, a :class:`Head` (1xx heads first, then the final one),
    ``bytes`` of the body, :class:`Upgraded`, or ``END``. Raises :class:`FramingError` when the
    upstream breaks HTTP/1.1 (or closes inside a message). ``reusable`` once ``END``: the
    connection may carry the next request."""

    def __init__(self, method: str) -> None:
        self._head_only = method == "HEAD"
        self._parser = httptools.HttpResponseParser(self)
        self._events: list = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._final = False  # the final (non-1xx) head was seen
        self._complete = False
        self._until_close = False
        self._extra = False  # bytes after the end: not reusable
        self._eof = False
        self._keep_alive = False
        self._bad: str | None = None
        self._in_head = True  # before the final head: its fields count against the limits
        self._head_fields = 0
        self._head_bytes = 0  # the head's fields, as llhttp reports them (name + value + 4 each)
        # bytes fed while llhttp handed nothing on: all of them before the final head, then
        # those since the last piece of body (a chunk-size line, trailers). llhttp keeps a line
        # it has not seen the end of, so this is what bounds its buffer
        self._fed_idle = 0

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self._complete:  # a second response after this one: never read, never reused
            self._extra = True
        self._headers, self._reason = [], b""

    def on_status(self, status: bytes) -> None:
        if len(self._reason) + len(status) > MAX_REASON:
            self._bad = "a reason phrase too long"
            return
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer: read (llhttp checks it) and dropped, never kept
        self._head_fields += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._head_fields > MAX_FIELDS or self._head_bytes > MAX_RESPONSE_HEAD:
            self._bad = f"a response head over {MAX_RESPONSE_HEAD} bytes or {MAX_FIELDS} fields"
            return
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._complete:
            return
        p = self._parser
        code = p.get_status_code()
        head = Head(code, self._reason, self._headers, p.get_http_version())
        self._headers = []  # trailers (chunked responses) must not join the head's fields
        self._in_head = code < 200 and code != 101  # a 1xx: the final head is still to come
        self._events.append(head)
        if code < 200 and code != 101 and any(k in (b"content-length", b"transfer-encoding") for k, _ in head.headers):
            self._bad = "a 1xx response declaring a body"
        if code >= 200 or code == 101:
            self._final = True
            self._fed_idle = 0
            self._keep_alive = p.should_keep_alive()
            if self._head_only or code in (204, 304):
                self._complete = True
                self._events.append(END)
            else:
                te = None  # the last Transfer-Encoding field
                has_length = False
                for k, v in head.headers:
                    if k == b"transfer-encoding":
                        te = v
                    elif k == b"content-length":
                        has_length = True
                chunked = te is not None and te.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
                # RFC 9112 6.3: a response neither chunked nor with a length ends with the connection
                self._until_close = not chunked and (te is not None or not has_length)

    def on_body(self, body: bytes) -> None:
        if self._final:
            self._fed_idle = 0
        if self._complete:
            self._extra = True
            return
        if not self._final:  # bytes before the final head: an upstream forging a response
            self._bad = "a body before the final response head"
            return
        self._events.append(bytes(body))

    def on_message_complete(self) -> None:
        if self._final:
            self._fed_idle = 0
        if self._final and not self._complete and not self._until_close:
            self._complete = True
            self._events.append(END)

    # -- the reader's API
    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            if self._final and not self._complete and self._until_close:
                self._complete = True  # a response framed by the connection's end
                self._keep_alive = False
                self._events.append(END)
            return
        if self._complete or self._parser is None:  # (the parser goes with the end: next_event)
            self._extra = True
            return
        # an endless line (head, chunk size, trailer) cannot grow the gate's memory. A count of
        # its own: the body that follows the head in the same read is not part of the head's
        # fields, which on_header counts against MAX_RESPONSE_HEAD
        self._fed_idle += len(data)
        if self._fed_idle > 2 * MAX_RESPONSE_HEAD + len(data):
            what = "trailers or a chunk line" if self._final else "a response head"
            raise FramingError(f"the upstream broke HTTP/1.1: {what} over {MAX_RESPONSE_HEAD} bytes")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as up:
            head = self._events.pop() if self._events and isinstance(self._events[-1], Head) else None
            if head is None or head.status != 101:
                raise FramingError("the upstream switched protocols without a 101") from None
            self._events.append(Upgraded(head, bytes(data[up.args[0]:])))
            self._complete = True
            self._parser = None  # nothing more is parsed (see next_event)
        except httptools.HttpParserError as exc:
            if self._complete:  # the message ended; what followed is garbage: not reusable
                self._extra = True
                return
            raise FramingError(f"the upstream broke HTTP/1.1: {exc}") from None
        if self._bad is not None:
            self._events.clear()
            raise FramingError(f"the upstream broke HTTP/1.1: {self._bad}")

    def next_event(self):
        if self._events:
            ev = self._events.pop(0)
            if ev is END:
                self._parser = None  # see below
            return ev
        if self._complete:
            # the parser holds this reader's bound methods and the reader holds the parser: a
            # cycle only the garbage collector would free. The response is over, so the cycle is
            # broken here and both go at once (nothing is fed to the parser after the end).
            self._parser = None
            return END
        if self._eof:
            raise FramingError("the upstream closed the connection inside a response")
        return NEED_DATA

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self._extra and not self._until_close and not self._eof


# ---------------------------------------------------------------------------- what the gate sends


# the header lines of a head the gate sends: each name a token (RFC 9110), each value free of
# control characters but HTAB - so a CR or LF in a value (a credential's real value, say) can
# never end its line and start a header of its own. Checked for the whole block at once (a
# regular expression per name and per value cost a third of building the head): with every
# byte but the controls deleted, the lines leave exactly one CRLF each, and with every token
# character deleted, the names leave nothing (and none is empty).
def _field_lines(headers) -> bytes:
    parts: list[bytes] = []
    names: list[bytes] = []
    for k, v in headers:
        parts += (k, b": ", v, b"\r\n")
        names.append(k)
    block = b"".join(parts)
    if (block.translate(None, NOT_CTL) != b"\r\n" * len(names) or b"".join(names).translate(None, TCHAR)
            or not all(names)):
        raise ValueError("a header the gate would send is malformed (CR, LF or NUL in it)")
    return block


def request_head(method: str, target: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    t = target.encode("ascii")
    if not t or TARGET_BAD_RE.search(t) or not TOKEN_RE.match(method.encode("ascii")):
        raise ValueError("a request line the gate would send is malformed")
    framing_fields = 0
    for k, _ in headers:
        if k == b"content-length" or k == b"transfer-encoding":
            framing_fields += 1
    if framing_fields > 1:
        raise ValueError("a request the gate would send declares its framing twice")
    return b"%s %s HTTP/1.1\r\n%s\r\n" % (method.encode("ascii"), t, _field_lines(headers))


def response_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    if VALUE_CTL_RE.search(reason):
        reason = b""
    return b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason, _field_lines(headers))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n" if data else b""


LAST_CHUNK = b"0\r\n\r\n"
