"""Egress policy of one sandbox, and the single place it is evaluated: :func:`decide`.

Pure, no I/O, standard library only (no pydantic: the gate imports this on its hot path).

Compilation
-----------
:func:`compile_egress` turns the validated ``spec.egress`` section (duck-typed: any object
with ``allow``, ``deny``, ``hosts``, ``upstream_ca``, ``limits`` attributes) plus CLI extras
into a frozen :class:`EgressPolicy` made of tuples, strings and numbers. Host patterns are
normalized once here (:func:`normalize_host`), so matching is a plain comparison.

Host patterns: ``"example.com"`` (exactly that name), ``"*.example.com"`` (any subdomain at
any depth, *not* the bare ``example.com``), or an IP literal (``"10.0.0.5"``, ``"::1"``).

Decisions and phases
--------------------
The gate calls :func:`decide` at up to three points of one connection; ``RequestMeta.phase``
says which (``scheme`` says what kind of traffic it is):

==============  =========  ==========================================================
phase           scheme     meaning
==============  =========  ==========================================================
``connect``     connect    A ``CONNECT host:port`` line arrived; nothing peeked yet.
                           ``method``/``path``/``sni`` are unknown (``sni`` may be
                           given; then it must match). Lets the gate answer 403
                           before any TLS. Host + port rules only.
``clienthello`` connect    The gate peeked the ClientHello. ``sni`` is the SNI, or
                           ``None`` when there was none (or no TLS at all): denied
                           ``no-sni``, except for an IP-literal host that an allow
                           rule names explicitly (TLS clients send no SNI for IPs).
                           A present SNI must equal the CONNECT host (``sni-mismatch``).
``request``     http       A plain forward-proxy request (absolute-form URI).
``request``     https      A request inside a TLS tunnel the gate terminated; ``sni``
                           is the tunnel's SNI and must equal the Host header
                           (anti domain-fronting); ``None`` only for IP tunnels.
==============  =========  ==========================================================

Any other combination is denied ``invalid-request``. At the connect phases an allow rule
matches on host + port alone; ``Decision.terminate`` is True when the gate must terminate TLS
because some matching rule (allow, or deny) has L7 fields (methods, paths, maxBody,
websocket) that can only be checked on requests. At the request phase every field counts.

Order: invalid input -> deny; deny rules first (first match wins); then allow rules (first
match wins); no match -> ``default-deny``; any exception -> ``internal-error`` deny.

Request-phase details
---------------------
* Methods: allow rules compare exactly (HTTP methods are case-sensitive: an allow of ``GET``
  does not allow ``get``); deny rules compare case-insensitively (some servers fold case).
* Paths: ``meta.path`` is the raw origin-form request-target. The query is ignored. Globs are
  matched against the percent-decoded path (``'*'`` stays within one segment, ``'**'`` spans
  segments; write globs decoded). A path the policy cannot reason about unambiguously
  (encoded ``/`` or ``\\``, dot-segments even encoded, ``//``, double encoding, control bytes,
  a ``#``, not starting with ``/``) is denied ``path-normalization`` - but only when a rule
  with ``paths`` for that host:port has to be evaluated; hosts without path rules pass the
  path through untouched (npm's ``/@scope%2fname`` keeps working there). Deny globs are
  also tried against the path with ``;params`` stripped from each segment (Tomcat-style).
* Bodies: an allow rule with ``maxBody`` does not match a request whose known body size is
  larger. When the size is unknown (chunked), the allow Decision carries ``max_body`` and
  the gate must cut the request when the streamed body exceeds it (and report
  ``body_rule_id``). A deny rule with ``maxBody`` matches bodies larger than it; with an
  unknown size it lowers ``Decision.max_body`` the same way.
* WebSocket: an upgrade request is allowed only by a rule with ``websocket: true``. On a
  spliced (non-terminated) tunnel the gate cannot see upgrades at all.

The gate must use ``Decision.host`` (the normalized name) to resolve and connect, never the
raw value it received, and then call :func:`check_address` on every resolved address.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from collections.abc import Mapping, Sequence

TYPE_CHECKING = False  # (annotations only: typing is not imported at run time, ~2 ms of every start)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

from agentvm.gate.frozen import quick_init

__all__ = [
    "Decision",
    "EgressLimits",
    "EgressPolicy",
    "RequestMeta",
    "Rule",
    "check_address",
    "canonical_path",
    "compile_egress",
    "decide",
    "host_matches",
    "normalize_host",
    "normalize_pattern",
    "parse_authority",
    "path_matches",
]

CLI_DEFAULT_PORTS = (80, 443)
PHASES = ("connect", "clienthello", "request")

# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Rule:
    """A compiled egress rule (``spec.egress.allow[]`` / ``deny[]`` entry)."""

    id: str  # the spec id, else "allow[3]" / "deny[0]" / "cli[0]"
    host: str  # normalized pattern: "example.com", "*.example.com" or an IP literal
    ports: tuple[int, ...]  # empty: every port (deny rules only; an allow rule always names its ports)
    methods: tuple[str, ...] = ()  # upper-case; empty = any
    paths: tuple[str, ...] = ()  # globs on the decoded path; empty = any
    max_body: int | None = None
    websocket: bool = False
    ask: bool = False  # allow rules: each matching request waits for a human (verdict "ask")

    @property
    def is_l7(self) -> bool:
        """True when the rule can only be checked on HTTP requests (TLS must be terminated)."""
        return bool(self.methods or self.paths or self.max_body is not None or self.websocket or self.ask)


@dataclass(frozen=True)
class EgressLimits:
    """Per-sandbox ceilings the gate enforces: connections, request rate and burst, bytes out."""
    connections: int = 64
    requests_per_second: float = 50.0
    burst: int = 100
    bytes_out: int = 1024**3


@dataclass(frozen=True)
class EgressPolicy:
    """A sandbox's compiled egress rules (allow, deny), its static host map and limits."""
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    hosts: tuple[tuple[str, str], ...] = ()  # operator static mapping (normalized name, ip), sorted
    upstream_ca: str | None = None
    limits: EgressLimits = field(default_factory=EgressLimits)

    def __post_init__(self) -> None:
        # decide()'s memo of this policy's request-phase decisions (not a field: not compared,
        # hashed or shown). A policy is immutable, so a decision never goes stale; a live policy
        # change is a new EgressPolicy, with an empty memo.
        object.__setattr__(self, "_decisions", {})

    def __getstate__(self) -> dict:
        # pickled (to a gate worker process, agentvm.gate.workers) without the memo
        return {**self.__dict__, "_decisions": {}}

    def static_address(self, host: str) -> str | None:
        """The operator-declared IP of ``host`` (raw or normalized), or None (resolve via DNS).
        If a name appears twice (``hosts`` concatenated from spec + CLI), the last entry wins."""
        try:
            name = normalize_host(host)
        except (ValueError, TypeError):
            return None
        found = None
        for n, ip in self.hosts:
            if n == name:
                found = ip
        return found

    def needs_termination(self, host: str, port: int) -> bool:
        """True if some rule (allow or deny) matching ``host:port`` has L7 fields, so the gate
        must terminate TLS to enforce it. An invalid host gives False (it is denied anyway)."""
        try:
            name = normalize_host(host)
        except (ValueError, TypeError):
            return False
        return any(r.is_l7 and _host_port(r, name, port) for r in self.allow) or any(
            r.is_l7 and _deny_host_port(r, name, port) for r in self.deny)

    def to_dict(self) -> dict:
        def rule(r: Rule) -> dict:
            return {
                "id": r.id,
                "host": r.host,
                "ports": list(r.ports),
                "methods": list(r.methods),
                "paths": list(r.paths),
                "max_body": r.max_body,
                "websocket": r.websocket,
                **({"action": "ask"} if r.ask else {}),
            }

        lim = self.limits
        return {
            "allow": [rule(r) for r in self.allow],
            "deny": [rule(r) for r in self.deny],
            "hosts": {n: ip for n, ip in self.hosts},
            "upstream_ca": self.upstream_ca,
            "limits": {
                "connections": lim.connections,
                "requests_per_second": lim.requests_per_second,
                "burst": lim.burst,
                "bytes_out": lim.bytes_out,
            },
        }


@quick_init
@dataclass(frozen=True)
class RequestMeta:
    """What the gate knows about one connection or request (see the module docstring)."""

    host: str  # as the client gave it (CONNECT host, absolute-URI host or Host header), raw
    port: int
    scheme: str  # "connect" | "http" | "https"
    method: str | None = None  # None at the connect phases
    path: str | None = None  # raw origin-form request-target (path + query); None at connect phases
    body_size: int | None = None  # Content-Length if known; None: unknown/chunked
    sni: str | None = None  # TLS SNI if known (None at clienthello: the ClientHello had none)
    websocket: bool = False  # an Upgrade: websocket was requested
    phase: str = "request"  # "connect" | "clienthello" | "request"


_make_meta = RequestMeta.make


@quick_init
@dataclass(frozen=True)
class Decision:
    """The gate's verdict on one request or connection, with the rule that made it and why."""
    # "allow" | "deny" | "ask" (request phase: an allow rule with action ask matched; the
    # request waits for a human - anything that does not handle "ask" treats it as not allowed)
    verdict: str
    rule_id: str  # the matched rule's id, or a fixed id (default-deny, invalid-host, ...)
    reason: str  # short, printable ASCII, no secrets (never the path or query)
    terminate: bool = False  # connect phases, allowed: the gate must terminate TLS
    max_body: int | None = None  # allowed with an unknown body size: cut the body beyond this
    body_rule_id: str | None = None  # the rule that set max_body (report it when cutting)
    host: str | None = None  # the normalized host (use it to resolve/connect), when known

    @property
    def allowed(self) -> bool:
        return self.verdict == "allow"


# ---------------------------------------------------------------------------- hosts

_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_IPV4_CANON_RE = re.compile(r"(?:0|[1-9][0-9]{0,2})(?:\.(?:0|[1-9][0-9]{0,2})){3}")
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0x[0-9a-f]*")
# Characters that some IDNA implementations treat as label separators.
_DOT_LIKE = "\u3002\uff0e\uff61"


def _safe(s: Any, limit: int = 80) -> str:
    """Printable-ASCII rendering of an untrusted value for reasons and error messages."""
    if type(s) is str and len(s) <= limit and s.isascii() and s.isprintable():
        return s  # already printable ASCII (0x20-0x7e) and short: the common case, per request
    if not isinstance(s, str):
        s = repr(s)
    out = "".join(c if 0x20 <= ord(c) < 0x7F else "?" for c in s)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _bad(raw: Any, why: str) -> ValueError:
    return ValueError(f"invalid host {_safe(raw)!r}: {why}")


def _idna_label(label: str, raw: str) -> str:
    """A unicode label -> its A-label (IDNA 2003 via encodings.idna), strictly: the label must
    already be in canonical form (what ToUnicode gives back), and must stay non-ASCII. Labels
    that IDNA 2003 would silently map (ß->ss, fullwidth->ASCII, Kelvin sign->k, zero-width
    removal) are rejected: IDNA 2003 and 2008 disagree on some, and we do not guess."""
    import encodings.idna as idna

    for c in label:
        if ord(c) >= 0x80 and unicodedata.category(c)[0] in "CZ":
            raise _bad(raw, "control, format or space character")
    low = label.lower()
    try:
        ace = idna.ToASCII(low).decode("ascii")
        back = idna.ToUnicode(ace)
    except (UnicodeError, ValueError) as e:
        raise _bad(raw, f"not a valid internationalized name ({_safe(str(e), 60)})") from None
    if not ace.startswith("xn--") or back != low:
        raise _bad(raw, "unicode label is not in canonical IDNA form")
    return ace


def normalize_host(raw: str) -> str:
    """Cached front of :func:`_normalize_host` (pure; the gate calls it several times per
    request). Errors are not cached."""
    if not isinstance(raw, str):
        raise ValueError("host must be a string")
    return _normalize_host_cached(raw)


@lru_cache(maxsize=4096)
def _normalize_host_cached(raw: str) -> str:
    return _normalize_host(raw)


def _normalize_host(raw: str) -> str:
    """Canonical form of a host name or IP literal, or ValueError.

    Names: lower-case, one trailing dot stripped, unicode labels IDNA-encoded to A-labels,
    labels of 1-63 ``[a-z0-9-]`` not starting or ending with ``-``, total <= 253. IP literals:
    canonical dotted-quad IPv4 only (``127.1``, ``2130706433``, ``0x7f.1``, ``017700000001``
    and leading zeros are rejected, as is any name whose last label is numeric); IPv6 bare or
    bracketed (``[::1]``), returned compressed, without zone id. Anything else (empty, ``@``,
    ``%``, ``/``, ``\\``, ``:`` in a name, ``*``, spaces, control characters, empty labels)
    raises ValueError.
    """
    if not isinstance(raw, str):
        raise ValueError(f"invalid host {_safe(raw)!r}: not a string")
    if not raw:
        raise _bad(raw, "empty")
    if len(raw) > 1024:
        raise _bad(raw, "too long")
    for c in raw:
        o = ord(c)
        if o <= 0x20 or o == 0x7F or 0x80 <= o <= 0x9F:
            raise _bad(raw, "control character or space")
        if c in "@%/\\*?#[]" and not (c in "[]" and raw.startswith("[") and raw.endswith("]")):
            raise _bad(raw, f"character {c!r} not allowed")
        if c in _DOT_LIKE:
            raise _bad(raw, "unicode full stop")
    if raw.startswith("["):
        inner = raw[1:-1]
        if "[" in inner or "]" in inner:
            raise _bad(raw, "bad brackets")
        try:
            return str(ipaddress.IPv6Address(inner))
        except ValueError:
            raise _bad(raw, "brackets must hold an IPv6 address") from None
    if ":" in raw:
        try:
            return str(ipaddress.IPv6Address(raw))
        except ValueError:
            raise _bad(raw, "':' in a name (split the port off first)") from None
    dotted = raw.endswith(".")
    name = raw[:-1] if dotted else raw
    if not name:
        raise _bad(raw, "empty")
    labels = name.split(".")
    if any(not lab for lab in labels):
        raise _bad(raw, "empty label")
    out = []
    for lab in labels:
        if lab.isascii():
            lab = lab.lower()
        else:
            lab = _idna_label(lab, raw)
        if not _LABEL_RE.fullmatch(lab):
            raise _bad(raw, "labels are 1-63 letters, digits or '-', not starting or ending with '-'")
        out.append(lab)
    host = ".".join(out)
    if _NUMERIC_LABEL_RE.fullmatch(out[-1]):
        # Looks numeric: only a canonical dotted quad is an address; anything else is a
        # non-canonical IPv4 spelling (or a numeric TLD) that resolvers disagree on.
        if dotted or not _IPV4_CANON_RE.fullmatch(host):
            raise _bad(raw, "non-canonical IPv4 address")
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise _bad(raw, "non-canonical IPv4 address") from None
    if len(host) > 253:
        raise _bad(raw, "longer than 253 characters")
    return host


def normalize_pattern(raw: str) -> str:
    """Normalize a rule's host pattern: a name, ``*.suffix`` or an IP literal. ValueError."""
    if not isinstance(raw, str):
        raise ValueError(f"invalid host pattern {_safe(raw)!r}")
    if raw.startswith("*."):
        suffix = normalize_host(raw[2:])
        if _ip(suffix) is not None:
            raise ValueError(f"invalid host pattern {_safe(raw)!r}: '*.' needs a name, not an address")
        if len(suffix) + 2 > 253:
            raise ValueError(f"invalid host pattern {_safe(raw)!r}: too long")
        return "*." + suffix
    return normalize_host(raw)


@lru_cache(maxsize=4096)
def _ip(s: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(s)
    except ValueError:
        return None


def host_matches(pattern: str, host: str) -> bool:
    """Both normalized. ``*.example.com`` matches ``a.example.com`` and ``a.b.example.com``,
    not ``example.com`` nor ``evilexample.com``; IP literals compare as addresses; otherwise
    exact equality."""
    if not pattern or not host:
        return False
    if pattern.startswith("*."):
        suffix = pattern[1:]  # ".example.com"
        return len(host) > len(suffix) and host.endswith(suffix) and _ip(host) is None
    pip = _ip(pattern)
    if pip is not None:
        hip = _ip(host)
        return hip is not None and hip == pip
    return pattern == host


def _host_port(rule: Rule, host: str, port: int) -> bool:
    """An allow rule matches its ports only (none: nothing); a deny rule without ports matches
    every port."""
    return port in rule.ports and host_matches(rule.host, host)


def _deny_host_port(rule: Rule, host: str, port: int) -> bool:
    return (not rule.ports or port in rule.ports) and host_matches(rule.host, host)


def parse_authority(raw: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``host[:port]`` (``[v6]:port``; a bare IPv6 literal has no port) into the raw host
    and the port. No port and no ``default_port``, or a bad port -> ValueError. The host is not
    normalized: pass it on as ``RequestMeta.host``."""
    if not isinstance(raw, str) or not raw:
        raise ValueError("empty authority")
    host, port_s = raw, None
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ValueError(f"invalid authority {_safe(raw)!r}: unclosed '['")
        host, rest = raw[: end + 1], raw[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"invalid authority {_safe(raw)!r}")
            port_s = rest[1:]
    elif raw.count(":") == 1:
        host, port_s = raw.split(":")
    if port_s is None:
        if default_port is None:
            raise ValueError(f"invalid authority {_safe(raw)!r}: no port")
        return host, default_port
    if not re.fullmatch(r"[0-9]{1,5}", port_s) or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"invalid authority {_safe(raw)!r}: bad port")
    return host, int(port_s)


# ---------------------------------------------------------------------------- paths


class _PathError(ValueError):
    pass


_PCT_RE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_RAW_BAD_RE = re.compile(r"[^\x21-\x7e]|\\")


def canonical_path(raw: str) -> str:
    """The percent-decoded path of an origin-form request-target (query dropped), or
    ValueError if it is ambiguous: not starting with '/', a fragment, control/non-ASCII/space
    or backslash characters, malformed or double percent-encoding, an encoded '/' or '\\',
    an empty segment ('//', except a trailing slash) or a dot-segment ('.', '..', also encoded,
    also with ';params')."""
    from urllib.parse import unquote_to_bytes

    if not isinstance(raw, str):
        raise _PathError("path is not a string")
    if "#" in raw:
        raise _PathError("fragment in request-target")
    path = raw.split("?", 1)[0]
    if not path.startswith("/"):
        raise _PathError("path does not start with '/'")
    if _RAW_BAD_RE.search(path):
        raise _PathError("control, space, non-ASCII or backslash character in path")
    if _PCT_RE.search(path):
        raise _PathError("malformed percent-encoding")
    low = path.lower()
    if "%2f" in low or "%5c" in low:
        raise _PathError("encoded path separator")
    dec = unquote_to_bytes(path)
    if b"%" in dec:
        raise _PathError("double percent-encoding")
    if any(b < 0x20 or b == 0x7F for b in dec) or b"\\" in dec:
        raise _PathError("control character or backslash in decoded path")
    segs = dec.split(b"/")[1:]
    for i, seg in enumerate(segs):
        if not seg and i != len(segs) - 1:
            raise _PathError("empty path segment")
        if seg.split(b";", 1)[0] in (b".", b".."):
            raise _PathError("dot-segment in path")
    return dec.decode("utf-8", "surrogateescape")


def _strip_params(path: str) -> str:
    return "/".join(seg.split(";", 1)[0] for seg in path.split("/"))


@lru_cache(maxsize=1024)
def _glob_re(glob: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def path_matches(glob: str, path: str) -> bool:
    """``glob`` against an already canonical (decoded) path: ``*`` within one segment, ``**``
    across segments, everything else literal; the whole path must match."""
    return _glob_re(glob).fullmatch(path) is not None


# ---------------------------------------------------------------------------- addresses

_N = ipaddress.ip_network
_METADATA = {
    ipaddress.ip_address(a): n
    for a, n in [
        ("169.254.169.254", "cloud metadata"),
        ("169.254.170.2", "cloud metadata (ECS)"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.100.100.200", "cloud metadata (Alibaba)"),
        ("192.0.0.192", "cloud metadata (Oracle)"),
    ]
}
_V4_BAD = [
    (_N("255.255.255.255/32"), "broadcast"),
    (_N("0.0.0.0/8"), "unspecified/this-network"),
    (_N("10.0.0.0/8"), "private"),
    (_N("100.64.0.0/10"), "carrier-grade NAT"),
    (_N("127.0.0.0/8"), "loopback"),
    (_N("169.254.0.0/16"), "link-local"),
    (_N("172.16.0.0/12"), "private"),
    (_N("192.0.0.0/24"), "IETF protocol assignments"),
    (_N("192.0.2.0/24"), "documentation"),
    (_N("192.88.99.0/24"), "6to4 relay anycast"),
    (_N("192.168.0.0/16"), "private"),
    (_N("198.18.0.0/15"), "benchmarking"),
    (_N("198.51.100.0/24"), "documentation"),
    (_N("203.0.113.0/24"), "documentation"),
    (_N("224.0.0.0/4"), "multicast"),
    (_N("240.0.0.0/4"), "reserved"),
]
_V6_BAD = [
    (_N("::/128"), "unspecified"),
    (_N("::1/128"), "loopback"),
    (_N("::/96"), "IPv4-compatible (deprecated)"),
    (_N("64:ff9b:1::/48"), "local-use NAT64"),
    (_N("100::/64"), "discard-only"),
    (_N("2001:2::/48"), "benchmarking"),
    (_N("2001:10::/28"), "ORCHID"),
    (_N("2001:20::/28"), "ORCHIDv2"),
    (_N("2001:db8::/32"), "documentation"),
    (_N("3fff::/20"), "documentation"),
    (_N("5f00::/16"), "SRv6 SIDs"),
    (_N("fc00::/7"), "unique-local (private)"),
    (_N("fe80::/10"), "link-local"),
    (_N("fec0::/10"), "site-local (deprecated)"),
    (_N("ff00::/8"), "multicast"),
]
_NAT64 = _N("64:ff9b::/96")
_TEREDO = _N("2001::/32")
_SIXTOFOUR = _N("2002::/16")
_GLOBAL_UNICAST = _N("2000::/3")


def _v4_problem(ip: ipaddress.IPv4Address) -> str | None:
    if ip in _METADATA:
        return _METADATA[ip]
    for net, what in _V4_BAD:
        if ip in net:
            return what
    return None


def address_problem(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` must not be connected to (a short class name), or None if it is a public
    unicast address. IPv6 embeddings of IPv4 (mapped, NAT64, 6to4, Teredo) are judged by the
    embedded address; IPv4-mapped addresses are refused outright (the gate dials IPv4)."""
    if ip.version == 4:
        return _v4_problem(ip)
    ip = ipaddress.IPv6Address(int(ip))  # drop any zone id
    if ip in _METADATA:
        return _METADATA[ip]
    if ip.ipv4_mapped is not None:
        inner = _v4_problem(ip.ipv4_mapped)
        return "IPv4-mapped" + (f" {inner}" if inner else "") + " address"
    for net, what in _V6_BAD:
        if ip in net:
            return what
    if ip in _NAT64:
        inner = _v4_problem(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return f"NAT64 of {inner}" if inner else None
    if ip in _SIXTOFOUR:
        inner = _v4_problem(ip.sixtofour)
        return f"6to4 of {inner}" if inner else None
    if ip in _TEREDO:
        server, client = ip.teredo
        inner = _v4_problem(client) or _v4_problem(server)
        return f"Teredo of {inner}" if inner else None
    if ip not in _GLOBAL_UNICAST:
        return "reserved (not global unicast)"
    return None


@lru_cache(maxsize=4096)
def _address_class(address: str):
    """(the parsed address, why it must not be reached or None); cached: pure, per address."""
    a = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    ip = ipaddress.ip_address(a)
    if ip.version == 6 and ip.scope_id:
        return ip, _ZONE_ID
    return ip, address_problem(ip)


_ZONE_ID = "zone id"


def check_address(host: str, address: str, policy: EgressPolicy) -> Decision | None:
    """After resolving ``host`` to ``address`` and before connecting: a deny Decision
    (``address-class``) for an address the sandbox must not reach (loopback, private,
    link-local, CGNAT, metadata, multicast, reserved, documentation, benchmarking, and IPv6
    embeddings of those), unless the operator mapped ``host`` to exactly this address in
    ``egress.hosts`` or an allow rule names this IP literal. None: the address is fine.
    Never raises."""
    try:
        ip, problem = _address_class(address)
        if problem is None:
            return None
        if problem is _ZONE_ID:
            return Decision("deny", "address-class", "address with a zone id refused")
        static = policy.static_address(host)
        if static is not None and _ip(static) == ip:
            return None
        for r in policy.allow:
            pip = _ip(r.host)
            if pip is not None and pip == ip:
                return None
        return Decision(
            "deny", "address-class", f"{_safe(host, 60)} resolved to {ip} ({problem}), which is not allowed"
        )
    except Exception as e:  # noqa: BLE001 - fail closed
        return Decision("deny", "address-class", f"address check failed: {type(e).__name__}")


# ---------------------------------------------------------------------------- decide

_METHOD_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}")


def _deny(rule_id: str, reason: str, host: str | None = None) -> Decision:
    return Decision("deny", rule_id, reason, host=host)


class _Req:
    """Lazily computed request views shared by rule checks."""

    __slots__ = ("meta", "_path", "_err")

    def __init__(self, meta: RequestMeta) -> None:
        self.meta = meta
        self._path: str | None = None
        self._err: str | None = None

    def path(self) -> str | None:
        """The canonical path, or None if it is ambiguous (then ``err`` says why)."""
        if self._path is None and self._err is None:
            try:
                self._path = canonical_path(self.meta.path)
            except ValueError as e:
                self._err = str(e)
        return self._path


def _deny_rule_matches(r: Rule, req: _Req) -> tuple[bool, bool]:
    """(matches, pending_body): request phase, host+port already matched. Raises _PathError
    when the rule has paths and the path is ambiguous."""
    m = req.meta
    if r.methods and m.method.upper() not in r.methods:
        return False, False
    if r.paths:
        p = req.path()
        if p is None:
            raise _PathError(req._err)
        sp = _strip_params(p)
        if not any(path_matches(g, p) or path_matches(g, sp) for g in r.paths):
            return False, False
    if r.websocket and not m.websocket:
        return False, False
    if r.max_body is not None:
        if m.body_size is None:
            return False, True
        if m.body_size <= r.max_body:
            return False, False
    return True, False


def _allow_rule_matches(r: Rule, req: _Req) -> tuple[bool, bool]:
    """(matches, skipped_for_path): request phase, host+port already matched."""
    m = req.meta
    if r.methods and m.method not in r.methods:
        return False, False
    if r.paths:
        p = req.path()
        if p is None:
            return False, True
        if not any(path_matches(g, p) for g in r.paths):
            return False, False
    if m.websocket and not r.websocket:
        return False, False
    if r.max_body is not None and m.body_size is not None and m.body_size > r.max_body:
        return False, False
    return True, False


def _decide(meta: RequestMeta, policy: EgressPolicy) -> Decision:
    phase, scheme = meta.phase, meta.scheme
    if phase in ("connect", "clienthello"):
        if scheme != "connect":
            return _deny("invalid-request", f"phase {_safe(phase)} needs scheme 'connect'")
    elif phase == "request":
        if scheme not in ("http", "https"):
            return _deny("invalid-request", "a request needs scheme 'http' or 'https'")
        if scheme == "http" and meta.sni is not None:
            return _deny("invalid-request", "plain http request with an SNI")
    else:
        return _deny("invalid-request", f"unknown phase {_safe(phase)}")
    port = meta.port
    if type(port) is not int or not 1 <= port <= 65535:
        return _deny("invalid-request", f"invalid port {_safe(port)}")

    try:
        host = normalize_host(meta.host)
    except ValueError as e:
        return _deny("invalid-host", _safe(str(e), 160))
    hp = f"{host}:{port}"
    hip = _ip(host)
    named_ip = hip is not None and any(_ip(r.host) == hip for r in policy.allow)

    if hip is not None and not named_ip:
        return _deny("ip-literal", f"IP address {host} is not named by an allow rule", host)

    # SNI
    if meta.sni is not None:
        try:
            sni = normalize_host(meta.sni)
        except ValueError:
            return _deny("sni-mismatch", f"invalid SNI for {hp}", host)
        if sni != host:
            return _deny("sni-mismatch", f"SNI {_safe(sni, 60)} does not match host {hp}", host)
    elif (phase == "clienthello" or scheme == "https") and not named_ip:
        return _deny("no-sni", f"no TLS SNI for {hp}", host)

    # ---- connect phases: host + port only
    if phase != "request":
        terminate = False
        for r in policy.deny:
            if _deny_host_port(r, host, port):
                if not r.is_l7:
                    return _deny(r.id, f"{hp} denied by rule {_safe(r.id)}", host)
                terminate = True
        for r in policy.allow:
            if _host_port(r, host, port):
                terminate = terminate or any(a.is_l7 and _host_port(a, host, port) for a in policy.allow)
                return Decision("allow", r.id, f"{hp} allowed by rule {_safe(r.id)}", terminate, host=host)
        return _deny("default-deny", f"no rule allows {hp}", host)

    # ---- request phase
    method = meta.method
    if not isinstance(method, str) or not _METHOD_RE.fullmatch(method):
        return _deny("invalid-request", f"invalid HTTP method for {hp}", host)
    if not isinstance(meta.path, str):
        return _deny("invalid-request", f"missing request path for {hp}", host)
    bs = meta.body_size
    if bs is not None and (type(bs) is not int or bs < 0):
        return _deny("invalid-request", f"invalid body size for {hp}", host)
    if not isinstance(meta.websocket, bool):
        return _deny("invalid-request", f"invalid websocket flag for {hp}", host)
    req = _Req(meta)
    cap: tuple[int, str] | None = None
    for r in policy.deny:
        if not _deny_host_port(r, host, port):
            continue
        try:
            hit, pending = _deny_rule_matches(r, req)
        except _PathError as e:
            return _deny("path-normalization", f"{method} to {hp}: {_safe(str(e), 80)} (rule {_safe(r.id)})", host)
        if hit:
            return _deny(r.id, f"{method} to {hp} denied by rule {_safe(r.id)}", host)
        if pending and (cap is None or r.max_body < cap[0]):
            cap = (r.max_body, r.id)
    skipped = False
    for r in policy.allow:
        if not _host_port(r, host, port):
            continue
        hit, skip = _allow_rule_matches(r, req)
        skipped = skipped or skip
        if hit:
            if bs is None and r.max_body is not None and (cap is None or r.max_body < cap[0]):
                cap = (r.max_body, r.id)
            return Decision(
                "ask" if r.ask else "allow",
                r.id,
                f"{method} to {hp} " + (f"needs a human approval (rule {_safe(r.id)})" if r.ask
                                        else f"allowed by rule {_safe(r.id)}"),
                max_body=cap[0] if cap else None,
                body_rule_id=cap[1] if cap else None,
                host=host,
            )
    if skipped:
        return _deny("path-normalization", f"{method} to {hp}: {_safe(req._err, 80)}", host)
    return _deny("default-deny", f"no rule allows {method} to {hp}", host)


DECISION_MEMO = 128  # request-phase decisions remembered per policy (then the memo starts over)
# the longest fields a remembered decision is keyed on: anything longer is decided every time
# (a host longer than DNS allows, a method no one sends), so one entry stays about a kilobyte
_MEMO_PATH, _MEMO_HOST, _MEMO_METHOD = 512, 255, 32
_MEMO_BODY = 10**18  # (the parser takes a Content-Length of at most 18 digits)


def decide(meta: RequestMeta, policy: EgressPolicy) -> Decision:
    """The single place egress policy is evaluated (see the module docstring). Never raises:
    any exception is a deny with rule id ``internal-error``.

    A decision is a function of ``meta`` and ``policy`` alone, and a policy never changes, so
    request-phase decisions are remembered on the policy, keyed on every field of ``meta``;
    only fields of exactly the types the parser gives are keyed (a ``True`` port or a ``0``
    websocket flag must not find the decision of ``1`` or ``False``: they are decided, and
    denied, every time), and only within the parser's ranges (see _memo_decide); an
    ``internal-error`` deny is never kept (the next request is decided afresh). At most
    DECISION_MEMO entries of about 1.5 KB: ~200 KB per policy at worst."""
    try:
        phase = meta.phase
        if type(phase) is str and phase == "request":
            return decide_request(policy, meta.host, meta.port, meta.scheme, meta.method, meta.path, meta.body_size,
                                  meta.sni, meta.websocket, meta)
    except Exception as e:  # noqa: BLE001 - not a RequestMeta: fail closed
        return _internal_error(e)
    return _decide_safely(meta, policy)


def decide_request(policy: EgressPolicy, host: str, port: int, scheme: str, method: str, path: str,
                   body_size: int | None, sni: str | None, websocket: bool, meta: RequestMeta | None = None) -> Decision:
    """``decide(RequestMeta(host, port, scheme, method, path, body_size, sni, websocket,
    "request"), policy)`` (or of ``meta``, when given: the same fields), the RequestMeta built
    only when the memo does not hold the decision. Never raises (``internal-error``)."""
    try:
        return _memo_decide(policy, host, port, scheme, method, path, body_size, sni, websocket, meta)
    except Exception as e:  # noqa: BLE001 - fail closed, and not remembered
        return _internal_error(e)


def _memo_decide(policy, host, port, scheme, method, path, body_size, sni, websocket, meta) -> Decision:
    memo = None
    if (type(host) is str and type(port) is int and type(path) is str and type(method) is str
            and type(websocket) is bool and (sni is None or type(sni) is str)
            and (body_size is None or (type(body_size) is int and 0 <= body_size < _MEMO_BODY))
            and type(scheme) is str and 0 <= port <= 65535 and len(scheme) <= 8
            and len(path) <= _MEMO_PATH and len(host) <= _MEMO_HOST and len(method) <= _MEMO_METHOD
            and (sni is None or len(sni) <= _MEMO_HOST)):
        memo = getattr(policy, "_decisions", None)  # (None: a stand-in for a policy, in a test)
    if memo is not None:
        key = (host, port, scheme, method, path, body_size, sni, websocket)
        d = memo.get(key)
        if d is not None:
            return d
    if meta is None:
        meta = _make_meta(host, port, scheme, method, path, body_size, sni, websocket, "request")
    d = _decide(meta, policy)  # (an exception: decide_request's internal-error, never remembered)
    if memo is not None:
        if len(memo) >= DECISION_MEMO:
            memo.clear()
        memo[key] = d
    return d


def _internal_error(e: Exception) -> Decision:
    return Decision("deny", "internal-error", f"policy evaluation failed ({type(e).__name__})")


def _decide_safely(meta: RequestMeta, policy: EgressPolicy) -> Decision:
    try:
        return _decide(meta, policy)
    except Exception as e:  # noqa: BLE001 - fail closed
        return _internal_error(e)


# ---------------------------------------------------------------------------- compile

_ID_RE = re.compile(r"[\x20-\x7e]{1,128}")


def _rule_id(rid: Any, default: str) -> str:
    if rid is None:
        return default
    if not isinstance(rid, str) or not _ID_RE.fullmatch(rid):
        raise ValueError(f"{default}.id {_safe(rid)!r}: must be 1-128 printable ASCII characters")
    return rid


def _compile_rule(r: Any, where: str) -> Rule:
    try:
        host = normalize_pattern(r.host)
    except ValueError as e:
        raise ValueError(f"egress.{where}.host: {e}") from None
    ports: list[int] = []
    given = getattr(r, "model_fields_set", None)
    if where.startswith("deny") and given is not None and "ports" not in given:
        pass  # a deny rule without ports denies the host on every port
    else:
        for p in getattr(r, "ports", None) or ():
            if type(p) is not int or not 1 <= p <= 65535:
                raise ValueError(f"egress.{where}.ports: invalid port {_safe(p)}")
            if p not in ports:
                ports.append(p)
        if not ports:
            raise ValueError(f"egress.{where}.ports: name at least one port"
                             + ("" if where.startswith("deny") else " (an allow rule never means every port)"))
    methods = []
    for m in getattr(r, "methods", None) or ():
        if not isinstance(m, str) or not _METHOD_RE.fullmatch(m):
            raise ValueError(f"egress.{where}.methods: invalid method {_safe(m)!r}")
        if m.upper() not in methods:
            methods.append(m.upper())
    paths = []
    for g in getattr(r, "paths", None) or ():
        if not isinstance(g, str) or not g.startswith("/"):
            raise ValueError(f"egress.{where}.paths: glob {_safe(g)!r} must start with '/'")
        paths.append(g)
    mb = getattr(r, "max_body", None)
    if mb is not None and (type(mb) is not int or mb < 0):
        raise ValueError(f"egress.{where}.maxBody: invalid size {_safe(mb)}")
    return Rule(
        id=_rule_id(getattr(r, "id", None), where),
        host=host,
        ports=tuple(ports),
        methods=tuple(methods),
        paths=tuple(paths),
        max_body=mb,
        websocket=bool(getattr(r, "websocket", False)),
        ask=getattr(r, "action", "allow") == "ask",
    )


def cli_rule(rule_id: str, s: str, default_ports: tuple[int, ...] = CLI_DEFAULT_PORTS) -> Rule:
    """``HOST[:PORT]`` as the CLI and live policy take it. Without a port: ``default_ports``
    (80 and 443 for an allow rule; ``()``, every port, for a deny rule)."""
    try:
        if not isinstance(s, str) or not s:
            raise ValueError("empty")
        if s.startswith("[") or s.count(":") == 1:
            host, port = parse_authority(s, default_port=0)
            ports = (port,) if port else default_ports
        else:  # a name, or a bare IPv6 literal (which cannot carry a port)
            host, ports = s, default_ports
        return Rule(id=rule_id, host=normalize_pattern(host), ports=ports)
    except ValueError as e:
        raise ValueError(
            f"--allow {_safe(s)!r}: expected HOST, *.SUFFIX, IP or [IPv6] with an optional :PORT ({e})"
        ) from None


def compile_egress(
    spec_egress: Any = None,
    *,
    extra_allow: Sequence[str] = (),
    extra_hosts: Mapping[str, str] | None = None,
) -> EgressPolicy:
    """``spec.egress`` (an ``agentvm.spec.models.Egress`` or None; duck-typed) plus CLI extras
    -> :class:`EgressPolicy`. Pure. Raises ValueError with the offending field on bad input.

    * Rule ids: the spec ``id``, else ``allow[i]`` / ``deny[i]`` (index in its list).
    * ``extra_allow``: ``--allow HOST[:PORT]`` strings (``*.suffix``, IPv4, ``[IPv6]:PORT`` or a
      bare IPv6 without port), appended after the spec's allow rules with ids ``cli[i]``.
      Without a port a CLI rule allows ports 80 and 443 (:data:`CLI_DEFAULT_PORTS`) - a
      convenience for quick runs; the spec's own default stays 443 only.
    * ``extra_hosts``: ``--add-host NAME=IP`` pairs; they override the spec's ``hosts``.
    """
    allow: list[Rule] = []
    deny: list[Rule] = []
    hosts: dict[str, str] = {}
    upstream_ca = None
    limits = EgressLimits()
    if spec_egress is not None:
        for i, r in enumerate(getattr(spec_egress, "allow", None) or ()):
            allow.append(_compile_rule(r, f"allow[{i}]"))
        for i, r in enumerate(getattr(spec_egress, "deny", None) or ()):
            deny.append(_compile_rule(r, f"deny[{i}]"))
        for name, ip in (getattr(spec_egress, "hosts", None) or {}).items():
            hosts.update([_host_entry(name, ip, "egress.hosts")])
        upstream_ca = getattr(spec_egress, "upstream_ca", None)
        lim = getattr(spec_egress, "limits", None)
        if lim is not None:
            limits = EgressLimits(
                connections=int(lim.connections),
                requests_per_second=float(lim.requests_per_second),
                burst=int(lim.burst),
                bytes_out=int(lim.bytes_out),
            )
    if isinstance(extra_allow, str):
        raise ValueError("extra_allow must be a sequence of strings, not a string")
    for i, s in enumerate(extra_allow):
        allow.append(cli_rule(f"cli[{i}]", s))
    for name, ip in (extra_hosts or {}).items():
        hosts.update([_host_entry(name, ip, "--add-host")])
    return EgressPolicy(
        allow=tuple(allow),
        deny=tuple(deny),
        hosts=tuple(sorted(hosts.items())),
        upstream_ca=upstream_ca,
        limits=limits,
    )


def _host_entry(name: str, ip: str, where: str) -> tuple[str, str]:
    try:
        n = normalize_host(name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if _ip(n) is not None:
        raise ValueError(f"{where}: {_safe(name)!r} is an address, not a name")
    a = None
    if isinstance(ip, str):
        a = _ip(ip[1:-1] if ip.startswith("[") and ip.endswith("]") else ip)
    if a is None or (a.version == 6 and a.scope_id):
        raise ValueError(f"{where}[{n}]: {_safe(ip)!r} is not an IP address")
    return n, str(a)


_RESOLVED = re.compile(r"resolved to (\S+) \(([^)]*)\)")
# address classes an operator may legitimately name (an internal mirror, a corporate proxy);
# never loopback, link-local, metadata or the like: the agent can make a name resolve there
_NAMEABLE = ("private", "unique-local (private)", "shared address space (CGNAT)")


def how_to_allow(rule_id: str, reason: str, host: str, port: int | None) -> str | None:
    """The exact operator action that would allow a denied request, or None where nothing
    should (credential leaks, DoH, smuggling, limits) - and never one that would open the
    host's loopback, link-local or cloud metadata addresses, whatever the agent asked for.
    Pure; used by the 403 body, the decision log and the run summary. ``host`` is untrusted:
    it is normalised, and anything that does not normalise gets no suggestion."""
    if not host or port is None:
        return None
    try:
        name = normalize_host(host)
    except ValueError:
        return None
    ip = _ip(name)
    shown = f"[{name}]" if ip is not None and ip.version == 6 else name
    hp = shown if port in (80, 443) else f"{shown}:{port}"
    if rule_id == "default-deny":
        if ip is not None:
            return None  # an address: see ip-literal
        return f"--allow {hp} (or egress.allow: [{{host: {name}, ports: [{port}]}}] in the agent file)"
    if rule_id == "address-class":
        m = _RESOLVED.search(reason)
        if m and m.group(2) in _NAMEABLE:
            return (f"{name} resolved to {m.group(1)}, a {m.group(2)} address the gate refuses unless it is named; "
                    f"if that server is really meant: --add-host {name}={m.group(1)} (egress.hosts)")
        return None
    if rule_id == "dns-failure":
        return f"the gate could not resolve {name}: --add-host {name}=ADDRESS (egress.hosts)"
    if rule_id == "ip-literal":
        if ip is None or address_problem(ip) is not None:
            return None
        return f"connect by name, or allow the address explicitly: --allow {hp}"
    return None
