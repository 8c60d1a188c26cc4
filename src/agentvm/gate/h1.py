"""HTTP/1.1 proxy protocol pieces, sans-IO: bytes in, values out; nothing here touches a socket.

* :class:`HeadReader` accumulates bytes until a complete request head, with a size cap.
* :func:`check_head` rejects what h11 would tolerate but a security proxy must not forward:
  obs-fold, bare LF, both Content-Length and Transfer-Encoding, repeated Content-Length,
  Transfer-Encoding other than exactly ``chunked``, NUL/control bytes, absurd header counts.
  (CL.TE / TE.CL / CL.CL request smuggling all reduce to these.)
* :func:`parse_request` parses a checked head into a :class:`ProxyRequest`: the target split
  into scheme/host/port/path, exactly one Host (required for HTTP/1.1) cross-checked with it.
* :func:`deny_response` / :func:`error_response` build the gate's own answers: a 403 with a
  machine-readable JSON body and ``X-Agentvm-Denied: <rule-id>``, so the agent and the
  operator can tell *why* (sandbox-runtime's "blocked means explained").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agentvm.gate.framing import RequestBody
from agentvm.gate.frozen import quick_init
from agentvm.gate.httpsyntax import NOT_CTL, TARGET_BAD_RE, TCHAR, TOKEN_RE, VALUE_CTL_RE  # noqa: F401 (re-exported)


MAX_HEAD = 64 * 1024
MAX_HEADERS = 128
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_CONNECTION_BAD = re.compile(rb"(?:^|[,\s])(?:content-length|transfer-encoding|host)\s*(?:,|$)")
_RULE_ID_SAFE = re.compile(rb"[^A-Za-z0-9._:\[\]/*-]")


class ProtocolError(ValueError):
    """The client sent something the gate refuses to interpret (answered with 400)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class HeadReader:
    """Feed bytes; ``head`` is set once ``\\r\\n\\r\\n`` arrived; ``rest`` holds what followed."""

    def __init__(self, limit: int = MAX_HEAD) -> None:
        self._buf = bytearray()
        self.limit = limit
        self.head: bytes | None = None
        self.rest = b""

    def feed(self, data: bytes) -> bool:
        if self.head is not None:
            self.rest += data
            return True
        if not self._buf:  # the usual case: a whole head in the first piece - taken without a buffer
            end = data.find(b"\r\n\r\n")
            if 0 <= end and end + 4 <= self.limit:
                self.head, self.rest = bytes(data[: end + 4]), bytes(data[end + 4 :])
                return True
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > self.limit:
                raise ProtocolError("head-too-large", f"request head larger than {self.limit} bytes")
            return False
        if end + 4 > self.limit:
            raise ProtocolError("head-too-large", f"request head larger than {self.limit} bytes")
        self.head = bytes(self._buf[: end + 4])
        self.rest = bytes(self._buf[end + 4 :])
        self._buf.clear()
        return True




def check_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """Reject ambiguous or smuggling-prone request heads before anything interprets them.
    Returns the request line and the header fields (names lower-case, values trimmed)."""
    text = head[:-4]
    crlf = text.count(b"\r\n")
    # The usual head's only control bytes are the CRLFs between its lines: one pass says so
    # (then there is no NUL, no bare CR or LF, and no control byte in any field: the checks
    # below for them, and the per-field search VALUE_CTL_RE, are skipped). Any other head is
    # checked as before, in order: the same error for the same head.
    if head[-4:] == b"\r\n\r\n" and text.translate(None, NOT_CTL) == b"\r\n" * crlf:
        ctl_free = True
    else:
        if b"\x00" in head:
            raise ProtocolError("bad-bytes", "NUL byte in request head")
        if text.count(b"\r") != crlf or text.count(b"\n") != crlf:
            raise ProtocolError("bare-lf", "bare CR or LF in request head")
        ctl_free = None
    lines = text.split(b"\r\n")
    if len(lines) - 1 > MAX_HEADERS:
        raise ProtocolError("too-many-headers", f"more than {MAX_HEADERS} header fields")
    if ctl_free is None:  # (whether any field holds a control byte)
        ctl_free = text[len(lines[0]):].translate(None, NOT_CTL) == b"\r\n" * (len(lines) - 1)
    cl = te = upgrades = 0
    fields = []
    for ln in lines[1:]:
        if ln[:1] in (b" ", b"\t"):
            raise ProtocolError("obs-fold", "obsolete line folding in a header")
        name, sep, value = ln.partition(b":")
        if not sep or not name or name.strip(TCHAR):
            raise ProtocolError("bad-header", "malformed header name")
        lname = name.lower()
        if lname == b"content-length":
            cl += 1
            v = value.strip()
            if not v.isdigit() or len(v) > 18:
                raise ProtocolError("bad-content-length", "Content-Length is not a single number (at most 18 digits)")
        elif lname == b"upgrade":
            upgrades += 1
        elif lname == b"transfer-encoding":
            te += 1
            if value.strip().lower() != b"chunked":
                raise ProtocolError("bad-transfer-encoding", "only 'Transfer-Encoding: chunked' is accepted")
        if not ctl_free and VALUE_CTL_RE.search(value):
            raise ProtocolError("bad-bytes", "control character in a header value")
        if lname == b"connection" and _CONNECTION_BAD.search(value.lower()):
            raise ProtocolError("bad-connection", "Connection names a framing or Host header (request smuggling)")
        fields.append((lname, value.strip(b" \t")))
    if upgrades > 1:
        raise ProtocolError("duplicate-upgrade", "more than one Upgrade header")
    if cl > 1:
        raise ProtocolError("duplicate-content-length", "more than one Content-Length header")
    if te > 1:
        raise ProtocolError("duplicate-transfer-encoding", "more than one Transfer-Encoding header")
    if cl and te:
        raise ProtocolError("cl-and-te", "both Content-Length and Transfer-Encoding (request smuggling)")
    return lines[0], fields


@quick_init
@dataclass(frozen=True)
class ProxyRequest:
    method: str
    target: str  # raw request-target
    scheme: str  # "connect" | "http" | "origin" (origin-form: only valid inside a terminated tunnel)
    host: str  # raw host as given (not normalized)
    port: int
    path: str  # origin-form path+query for forwarding ("" for CONNECT)
    headers: tuple[tuple[bytes, bytes], ...]
    content_length: int | None
    chunked: bool
    upgrade_websocket: bool
    http_version: str
    explicit_port: bool = True  # origin-form: whether the Host header named a port

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


_make_request = ProxyRequest.make


def _split_authority(auth: str, default_port: int) -> tuple[str, int]:
    if not auth or "@" in auth:
        raise ProtocolError("bad-authority", "authority is empty or carries userinfo")
    if auth.startswith("["):
        end = auth.find("]")
        if end < 0:
            raise ProtocolError("bad-authority", "unterminated IPv6 literal")
        host, rest = auth[1:end], auth[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ProtocolError("bad-authority", "garbage after IPv6 literal")
        port_s = rest[1:] if rest else ""
        host = "[" + host + "]"
    else:
        host, sep, port_s = auth.rpartition(":")
        if not sep:
            host, port_s = auth, ""
    if port_s:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ProtocolError("bad-port", f"invalid port {port_s!r}")
        port = int(port_s)
    else:
        port = default_port
    if not host:
        raise ProtocolError("bad-authority", "empty host")
    return host, port


def parse_request(head: bytes) -> ProxyRequest:
    """A checked head -> ProxyRequest (raises ProtocolError)."""
    return parse_head(head)[0]




def parse_head(head: bytes, rest: bytes = b"") -> tuple[ProxyRequest, "RequestBody"]:
    """Check and parse one request head; also returns the reader of its body (fed with
    ``rest``), whose ``trailing`` is the next request once the body is read."""
    request_line, headers = check_head(head)
    parts = request_line.split(b" ")
    if len(parts) != 3:
        raise ProtocolError("bad-request", "malformed request line")
    method, target, version = parts
    if not TOKEN_RE.match(method):
        raise ProtocolError("bad-request", "malformed method")
    if not target or TARGET_BAD_RE.search(target):
        raise ProtocolError("bad-target", "non-ASCII or control bytes in the request target")
    if version == b"HTTP/1.1":
        http_version = "1.1"
    elif version == b"HTTP/1.0":
        http_version = "1.0"
    else:
        raise ProtocolError("bad-request", "only HTTP/1.0 and HTTP/1.1 requests are accepted")
    hosts = 0
    for k, _ in headers:
        if k == b"host":
            hosts += 1
    if hosts > 1:
        raise ProtocolError("bad-request", "Found multiple Host: headers")
    if hosts == 0 and http_version == "1.1":
        raise ProtocolError("bad-request", "Missing mandatory Host: header")
    req = _request(method.decode("ascii"), target.decode("ascii"), tuple(headers), http_version)
    return req, RequestBody(req.content_length, req.chunked, rest)


_ABSOLUTE_HTTP = re.compile(r"(?i)(http)://([^/?#]*)([^#]*)")
_ABSOLUTE_HTTPS = re.compile(r"(?i)https://")


def _request(method: str, target: str, headers: tuple[tuple[bytes, bytes], ...], http_version: str) -> ProxyRequest:
    hmap: dict[bytes, bytes] = {}
    for k, v in headers:
        hmap.setdefault(k, v)
    cl = hmap.get(b"content-length")
    chunked = hmap.get(b"transfer-encoding", b"").lower() == b"chunked"
    upgrade = hmap.get(b"upgrade", b"").lower() == b"websocket"
    host_hdr = hmap.get(b"host", b"").decode("latin-1")
    explicit = True
    if method == "CONNECT":
        host, port = _split_authority(target, 443)
        if ":" not in target.rsplit("]", 1)[-1]:
            raise ProtocolError("bad-connect", "CONNECT target must be host:port")
        scheme, path = "connect", ""
    elif target.startswith("/"):
        scheme, path = "origin", target
        host, port = _split_authority(host_hdr, 80) if host_hdr else ("", 0)
        explicit = bool(host_hdr) and ":" in host_hdr.rsplit("]", 1)[-1]
    else:
        m = _ABSOLUTE_HTTP.fullmatch(target)
        if not m:
            if _ABSOLUTE_HTTPS.match(target):
                raise ProtocolError("https-absolute-form", "use CONNECT for https:// URLs")
            raise ProtocolError("bad-target", "request target must be http://host/... or host:port (CONNECT)")
        scheme = "http"
        host, port = _split_authority(m.group(2), 80)
        path = m.group(3) or "/"
        if not path.startswith("/"):
            path = "/" + path
        if host_hdr and host_hdr != m.group(2):  # (the same text as the URI's authority: the same host)
            hh, hp = _split_authority(host_hdr, 80)
            if hh.lower().rstrip(".") != host.lower().rstrip(".") or hp != port:
                raise ProtocolError("host-mismatch", "Host header does not match the request URI")
    # ProxyRequest(method, target, scheme, host, port, path, headers, content_length, chunked,
    # upgrade_websocket, http_version, explicit_port), without the class call (frozen.quick_init)
    return _make_request(method, target, scheme, host, port, path, headers, int(cl) if cl is not None else None,
                         chunked, upgrade, http_version, explicit if scheme == "origin" else True)


_FRAMING = (b"content-length", b"transfer-encoding")


def forward_headers(req: ProxyRequest, host_value: str, *, keep_upgrade: bool = False) -> list[tuple[bytes, bytes]]:
    """Headers to send upstream: hop-by-hop removed (and those named in Connection), Host set,
    and the body's framing declared by the gate itself from what it parsed - never the
    sandbox's own framing headers (a ``Connection: content-length`` must not leave a body
    without a length upstream: that is request smuggling)."""
    named = set()
    for k, v in req.headers:
        if k == b"connection":
            named |= {t.strip().lower() for t in v.split(b",") if t.strip()}
    out: list[tuple[bytes, bytes]] = [(b"host", host_value.encode("ascii"))]
    for k, v in req.headers:
        if k == b"host" or k in _FRAMING:
            continue
        if keep_upgrade and k in (b"upgrade", b"connection"):
            out.append((k, v))
            continue
        if k in HOP_BY_HOP or k in named or k == b"expect" or k.startswith(b"x-agentvm-"):
            continue  # the gate answers Expect: 100-continue itself; x-agentvm-* is ours
        out.append((k, v))
    if req.chunked:
        out.append((b"transfer-encoding", b"chunked"))
    elif req.content_length is not None:
        out.append((b"content-length", str(req.content_length).encode("ascii")))
    return out


def response_headers(headers, *, keep_upgrade: bool = False) -> list[tuple[bytes, bytes]]:
    """A response's headers to pass on: names lower-case, hop-by-hop fields (and those its
    Connection names) removed. Names and values as bytes (a bytes-like one is copied)."""
    fields = []
    named: set[bytes] = set()
    for k, v in headers:
        k = (k if type(k) is bytes else bytes(k)).lower()
        if type(v) is not bytes:
            v = bytes(v)
        if k == b"connection":
            named |= {t.strip().lower() for t in v.split(b",") if t.strip()}
        fields.append((k, v))
    out = []
    for k, v in fields:
        if keep_upgrade and k in (b"upgrade", b"connection"):
            out.append((k, v))
        elif k not in HOP_BY_HOP and k not in named:
            out.append((k, v))
    return out


_H2_DROP = HOP_BY_HOP | {b"host"}


def request_from_h2(headers) -> ProxyRequest:
    """An HTTP/2 request (its header list, as the ``h2`` library validated it) as the same
    :class:`ProxyRequest` an HTTP/1.1 request inside a tunnel gives: origin-form, its host
    from ``:authority`` (or ``host``). ``CONNECT`` (tunnels inside a tunnel) is refused."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[tuple[bytes, bytes]] = []
    for k, v in headers:
        k, v = bytes(k), bytes(v)
        if k.startswith(b":"):
            if k in pseudo:
                raise ProtocolError("bad-request", f"repeated pseudo-header {k.decode('latin-1')}")
            pseudo[k] = v
        else:
            regular.append((k.lower(), v))
    method = pseudo.get(b":method", b"").decode("latin-1")
    if method == "CONNECT":
        raise ProtocolError("h2-connect", "CONNECT inside an HTTP/2 tunnel is not supported")
    path = pseudo.get(b":path", b"")
    if not method or not TOKEN_RE.match(method.encode("latin-1")) or not path.startswith(b"/") or TARGET_BAD_RE.search(path):
        raise ProtocolError("bad-request", "HTTP/2 request without a valid :method and origin-form :path")
    if pseudo.get(b":scheme", b"https") != b"https":
        raise ProtocolError("bad-request", "HTTP/2 request with a :scheme other than https")
    auth = (pseudo.get(b":authority") or dict(regular).get(b"host") or b"").decode("latin-1")
    if not auth:
        raise ProtocolError("bad-request", "HTTP/2 request without :authority")
    host, port = _split_authority(auth, 443)
    cls = [v for k, v in regular if k == b"content-length"]
    if len(set(cls)) > 1 or (cls and (not cls[0].strip().isdigit() or len(cls[0].strip()) > 18)):
        raise ProtocolError("bad-content-length", "Content-Length is not a single number")
    return ProxyRequest(method=method, target=path.decode("ascii"), scheme="origin", host=host, port=port,
                        path=path.decode("ascii"), headers=tuple(regular),
                        content_length=int(cls[0]) if cls else None, chunked=False, upgrade_websocket=False,
                        http_version="2", explicit_port=":" in auth.rsplit("]", 1)[-1])


def h2_forward_headers(req: ProxyRequest, host_value: str) -> list[tuple[bytes, bytes]]:
    """What an HTTP/2 request carries upstream: the pseudo-headers, then its headers without
    connection-specific ones (``te: trailers`` stays: gRPC needs it), without ``x-agentvm-*``,
    and without ``content-length``: HTTP/2 ends a body with END_STREAM, and a length the gate
    passed on but an HTTP/2-to-1.1 front trusted over the bytes sent would let a body's end
    spill into the next request (H2.CL smuggling)."""
    out = [(b":method", req.method.encode("ascii")), (b":scheme", b"https"),
           (b":authority", host_value.encode("ascii")), (b":path", req.path.encode("ascii"))]
    for k, v in req.headers:
        if k == b"te":
            if v.strip().lower() == b"trailers":
                out.append((k, b"trailers"))
            continue
        if k in _H2_DROP or k in _FRAMING or k == b"expect" or k.startswith(b"x-agentvm-"):
            continue
        out.append((k, v))
    return out


def deny_document(rule_id: str, reason: str, *, host: str, port: int, allow: str | None = None) -> tuple[str, bytes]:
    """(the sanitised rule id, the JSON body) of the gate's denial."""
    rid = safe_rule_id(rule_id)
    body = {"error": "egress-denied", "rule": rid, "reason": reason, "host": host, "port": port}
    if allow:
        body["how_to_allow"] = allow  # what the operator would change (the agent cannot)
    return rid, json.dumps(body, sort_keys=True).encode()


def _json_response(status: int, reason: str, body: dict, extra: list[tuple[str, str]]) -> bytes:
    return _raw_json_response(status, reason, json.dumps(body, sort_keys=True).encode(), extra)


def _raw_json_response(status: int, reason: str, payload: bytes, extra: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    lines += [f"{k}: {v}" for k, v in extra]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


def safe_rule_id(rule_id: str) -> str:
    return _RULE_ID_SAFE.sub(b"_", rule_id.encode("utf-8", "replace")).decode("ascii")[:200] or "unknown"


def deny_response(rule_id: str, reason: str, *, host: str, port: int, status: int = 403, allow: str | None = None) -> bytes:
    rid, body = deny_document(rule_id, reason, host=host, port=port, allow=allow)
    return _raw_json_response(status, "Forbidden" if status == 403 else "Too Many Requests", body, [("X-Agentvm-Denied", rid)])


def budget_response(rule_id: str, reason: str) -> bytes:
    """429 for a spent LLM budget, shaped as OpenAI- and Anthropic-compatible APIs answer errors
    (``error.message``), so an SDK shows the reason; ``x-should-retry: false`` stops the SDKs'
    automatic retries (waiting does not refill a budget)."""
    if rule_id == "budget:reserved":  # the rest is held by requests in flight: worth a retry soon
        msg = f"{reason} (agent-vm {rule_id})"
        retry = [("x-should-retry", "true"), ("Retry-After", "1")]
    else:
        msg = f"{reason} (agent-vm {rule_id}: the operator raises it with `agentvm policy NAME budget`)"
        retry = [("x-should-retry", "false")]
    body = {"type": "error", "error": {"type": "budget_exceeded", "code": rule_id, "message": msg},
            "rule": rule_id, "reason": reason}
    return _json_response(429, "Too Many Requests", body, [("X-Agentvm-Denied", safe_rule_id(rule_id)), *retry])


def error_response(status: int, code: str, message: str) -> bytes:
    reasons = {400: "Bad Request", 413: "Payload Too Large", 502: "Bad Gateway", 504: "Gateway Timeout", 429: "Too Many Requests"}
    return _json_response(status, reasons.get(status, "Error"), {"error": code, "reason": message}, [("X-Agentvm-Denied", safe_rule_id(code))])
