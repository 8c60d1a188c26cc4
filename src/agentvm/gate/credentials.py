"""Credentials by reference, at the gate: placeholders in, real values out - only where bound.

A sandbox gets a *placeholder* per credential: random, unique per session, shaped like the
real thing where a prefix is declared, and useless anywhere else. The gate, outside the
sandbox, holds the real values (looked up from the vault per use, so a rotation needs no
change inside). Pure logic here; ``server.py`` calls it:

* :meth:`CredentialSet.check_target` - a CONNECT/SNI/host that carries a placeholder is a leak.
* :meth:`CredentialSet.apply` - for one request (method, target, headers): every placeholder
  occurrence is either in its declared place on a TLS-terminated request to a bound host
  (swapped for the real value) or a leak (the request is blocked and an alert logged).
  Revoked credentials are denied. Never swaps on plain HTTP, in undeclared headers, in the
  path, for unbound hosts.
* :class:`BodyScanner` - streaming detection of placeholders in request bodies (a rolling
  window, so a placeholder split across chunks is still caught; nothing is forwarded past it).
* :class:`Scrubber` - streaming replacement of real values by placeholders in responses, so
  an upstream echoing the secret leaks nothing into the sandbox.

Secret values never appear in exceptions, reprs or log records: only credential names.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from bisect import bisect_right
from functools import lru_cache
from typing import Callable, NamedTuple
from urllib.parse import parse_qsl, quote, quote_plus, urlencode

from agentvm.gate.brokers import BrokerSpec, CredentialError, TokenCache  # (CredentialError lives there: no cycle)
from agentvm.gate.encoding import DecodeError
from agentvm.gate.policy import host_matches, normalize_host, normalize_pattern

CHARSETS = {
    "alnum": string.ascii_letters + string.digits,
    "hex": "0123456789abcdef",
    "base64url": string.ascii_letters + string.digits + "-_",
}


@dataclass(frozen=True)
class CredentialBinding:
    """A credential as compiled from the spec: where it may go; never its value."""

    name: str
    env: str
    ref: str
    hosts: tuple[str, ...]  # normalized patterns
    header: str | None = None  # lower-case
    format: str = "{}"
    basic: str | None = None  # "user" | "password"
    query: str | None = None
    file: str | None = None
    prefix: str = ""
    length: int | None = None
    charset: str = "alnum"
    sigv4_access_key_id: str | None = None
    sigv4_key_env: str = "AWS_ACCESS_KEY_ID"
    hmac: tuple[tuple[str, str], ...] | None = None  # HmacSigning fields as sorted pairs
    # a response to a request it was swapped into that the gate cannot fully inspect (a body
    # compressed without saying so, a coding it cannot decode): "strict" refuses it
    # (credential:uninspectable-*), "lenient" passes it on with only its bytes as they are scrubbed
    inspect: str = "strict"
    # a brokered credential (agentvm.gate.brokers.BrokerSpec): what is swapped in (or signed
    # with) is minted by the gate from the vault entry, never the entry itself
    broker: object = None
    # an SSH key served by the gate's ssh-agent (agentvm.gate.sshagent): the known_hosts lines
    # it may sign for; never swapped into HTTP
    ssh_known_hosts: tuple[str, ...] | None = None

    @property
    def mode(self) -> str:
        if self.ssh_known_hosts is not None:
            return "ssh"
        if self.sigv4_access_key_id is not None:
            return "sigv4"
        if self.hmac is not None:
            return "hmac"
        if self.header:
            return "header"
        if self.basic:
            return "basic"
        return "query"

    def bound_to(self, host: str) -> bool:
        # cached by (patterns, host), as policy.py caches its pure host functions: a sandbox's
        # requests go to the same few hosts
        return _bound(self.hosts, host) if type(host) is str else _bound_to(self.hosts, host)


def _bound_to(hosts: tuple[str, ...], host: str) -> bool:
    """Whether ``host`` matches one of the (normalized) patterns ``hosts``."""
    try:
        h = normalize_host(host)
    except ValueError:
        return False
    return any(host_matches(p, h) for p in hosts)


_bound = lru_cache(maxsize=1024)(_bound_to)  # (pure: patterns and host -> answer)


def compile_credentials(spec_credentials) -> tuple[CredentialBinding, ...]:
    """``spec.credentials`` (pydantic models or duck-typed) -> bindings. Raises ValueError."""
    out = []
    seen: set[str] = set()
    envs: set[str] = set()
    for c in spec_credentials or ():
        if c.name in seen:
            raise ValueError(f"credential {c.name!r} is declared twice")
        if c.env in envs:
            raise ValueError(f"two credentials use the environment variable {c.env}")
        seen.add(c.name)
        envs.add(c.env)
        inj = c.inject
        hm = None
        if getattr(c, "hmac", None) is not None:
            h = c.hmac
            hm = tuple(sorted({
                "algorithm": h.algorithm, "header": h.header, "format": h.format, "encoding": h.encoding,
                "message": h.message, "timestamp_header": h.timestamp_header or "",
            }.items()))
        ph = getattr(c, "placeholder", None)
        out.append(
            CredentialBinding(
                name=c.name,
                env=c.env,
                ref=c.ref,
                hosts=tuple(normalize_pattern(h) for h in c.hosts),
                header=inj.header.lower() if inj.header else None,
                format=inj.format,
                basic=inj.basic,
                query=inj.query,
                file=getattr(c, "file", None),
                prefix=getattr(ph, "prefix", "") or "",
                length=getattr(ph, "length", None),
                charset=getattr(ph, "charset", "alnum") or "alnum",
                sigv4_access_key_id=c.sigv4.access_key_id if getattr(c, "sigv4", None) is not None else None,
                sigv4_key_env=c.sigv4.access_key_id_env if getattr(c, "sigv4", None) is not None else "AWS_ACCESS_KEY_ID",
                hmac=hm,
                inspect=getattr(c, "inspect", None) or "strict",
                broker=_broker_spec(getattr(c, "broker", None)),
                ssh_known_hosts=(tuple(c.ssh.known_hosts) if getattr(c, "ssh", None) is not None else None),
            )
        )
    return tuple(out)


def _broker_spec(m):
    if m is None:
        return None
    return BrokerSpec.from_model(m)


def make_placeholder(b: CredentialBinding, real_length: int) -> str:
    """Random, unique per session, as long as the real value (at least 32 characters) unless a
    length is declared, starting with the declared prefix."""
    if b.broker is not None or b.ssh_known_hosts is not None:
        real_length = 40  # (the vault entry is a JSON document or a key file, not what is swapped in)
    length = b.length or max(real_length, len(b.prefix) + 32, 32)
    alphabet = CHARSETS.get(b.charset, CHARSETS["alnum"])
    body_len = max(length - len(b.prefix), 24)
    return b.prefix + "".join(secrets.choice(alphabet) for _ in range(body_len))


@dataclass
class Swap:
    """What :meth:`CredentialSet.apply` decided for one request."""

    target: str  # possibly rewritten (query swap)
    headers: list[tuple[bytes, bytes]]
    used: list[str] = field(default_factory=list)  # credential names swapped or re-signed
    resign: list[CredentialBinding] = field(default_factory=list)  # signatures to redo once the body is known


SEEN_VALUES = 4  # a static credential's values (rotations) a session keeps scrubbing
DERIVED_MAX = 64  # signatures the gate made that a session keeps scrubbing (remember_derived)


class _Derived:
    """The signatures a session's gate made with real keys, found in any letter case: a search
    of the lower-cased text (same length as the text) for the lower-cased signatures."""

    __slots__ = ("regex", "agent", "maxlen")

    def __init__(self, made: dict[bytes, bytes]):
        self.agent = made  # lower-case signature -> what the agent sent in its place
        self.regex = re.compile(b"|".join(re.escape(k) for k in sorted(made, key=len, reverse=True)))
        self.maxlen = max(len(k) for k in made)

    def sub(self, buf: bytes) -> tuple[bytes, int]:
        low = buf.lower()
        if self.regex.search(low) is None:
            return buf, 0
        out, pos, n = bytearray(), 0, 0
        for m in self.regex.finditer(low):
            out += buf[pos:m.start()] + self.agent[m.group(0)]
            pos = m.end()
            n += 1
        out += buf[pos:]
        return bytes(out), n


class CredentialSet:
    """The credentials of one sandbox session."""

    def __init__(
        self,
        bindings: tuple[CredentialBinding, ...],
        placeholders: dict[str, str],
        value: Callable[[str], str],
        revoked: Callable[[str], bool],
    ):
        self.bindings = {b.name: b for b in bindings}
        self.placeholders = dict(placeholders)  # name -> placeholder
        self._by_ph = {p.encode(): n for n, p in self.placeholders.items()}
        self._raw_value = value  # name -> the vault's value (vault-backed, may raise)
        # brokered credentials: name -> TokenCache; their value is what the gate minted
        self.brokers = {}
        for b in bindings:
            if b.broker is not None:
                self.brokers[b.name] = TokenCache(b.name, b.broker, raw=(lambda n=b.name: value(n)),
                                                  persist=(lambda text, b=b: self._persist(b, text)))
        self.value = self._brokered_value if self.brokers else value  # name -> real value (may raise)
        self.revoked = revoked
        self.local_revoked: set[str] = set()  # revoked for this session by the operator (daemon)
        self._seen_values: dict[str, list[str]] = {}  # static credentials: the values seen this session (_pairs)
        # real values in what the sandbox sends are leaks (real_leak); False only in the
        # selftest's deliberately weakened configuration (cred-in-env)
        self.check_real = True
        # signatures the gate made with a real key (lower-case) -> what the agent sent in their place;
        # every response of the session is scrubbed of them, in any case (remember_derived)
        self._derived: dict[bytes, bytes] = {}
        self._derived_match = None
        self.max_len = max((len(p) for p in self.placeholders.values()), default=0)
        # apply()'s first look at a request's headers, all of them in one search: anything it
        # must then look at header by header - a placeholder, in any case (a header name is
        # matched case-insensitively, a value exactly: this finds both), or a header named like
        # Authorization (Basic credentials are decoded). Most requests hold neither and pass
        # through in that one search.
        self._header_work = re.compile(
            b"|".join([re.escape(p) for p in sorted(self._by_ph, key=len, reverse=True)] + [b"authorization"]),
            re.IGNORECASE)
        # responses are scrubbed of every encoded form of a real value (and decoded first);
        # False only in the selftest's deliberately weakened configuration
        self.scrub_encoded = True
        self._scrub_table = None
        # a header credential's header name, and its placeholder in its format: what apply()
        # compares a request's header with (name -> (header, expected value))
        self._header_forms = {b.name: (b.header.encode(), b.format.replace("{}", self.placeholders[b.name]).encode())
                              for b in self.bindings.values() if b.mode == "header" and b.name in self.placeholders}

    def __repr__(self) -> str:  # never the values
        return f"CredentialSet({sorted(self.bindings)})"

    # -- brokered credentials -----------------------------------------------------------------
    def _brokered_value(self, name: str) -> str:
        cache = self.brokers.get(name)
        return self._raw_value(name) if cache is None else cache.get()

    def _persist(self, b: CredentialBinding, text: str) -> None:
        """A brokered credential's vault entry changed (a rotated refresh token): store it."""
        spec = getattr(self, "spec", None)
        if spec is None or not b.ref.startswith("vault:"):
            return  # (env:/file: references are the operator's to update)
        from agentvm.vault import Vault

        Vault(spec[2]).set(b.ref[6:], text)

    def prepare(self) -> None:
        """Mint every brokered credential not yet minted (blocking: call it off the event loop,
        at session start, so the first request does not wait). Errors are left for the
        request that needs the value to report."""
        for cache in self.brokers.values():
            try:
                cache.prepare()
            except Exception:
                pass

    def close(self, *, wait: bool = False) -> None:
        """Session end: minted credentials are forgotten and revoked upstream where the kind can
        (oauth2-refresh with a revocationUrl, github-app)."""
        for cache in self.brokers.values():
            cache.drop(revoke=True, wait=wait)

    # -- detection --------------------------------------------------------------------------
    def find(self, data: bytes) -> list[str]:
        return [n for p, n in self._by_ph.items() if p in data]

    def find_ci(self, data: bytes) -> list[str]:
        """Case-insensitive (header names are lower-cased on the way)."""
        low = data.lower()
        return [n for p, n in self._by_ph.items() if p.lower() in low]

    def _find_text(self, text: str) -> list[str]:
        return [n for n, p in self.placeholders.items() if p in text]

    def _leak(self, name: str, where: str, host: str) -> CredentialError:
        return CredentialError(
            f"credential:leak:{name}",
            f"placeholder of credential {name!r} sent to {where} of {host}, where it is not bound: blocked",
            name=name, where=where, alert=True,
        )

    def check_target(self, host: str, sni: str | None = None) -> None:
        """CONNECT host / SNI / plain-HTTP host carrying a placeholder: a leak attempt."""
        for text, where in ((host, "host"), (sni or "", "sni")):
            low = text.lower()  # names are case-insensitive: so is this check
            for name, p in self.placeholders.items():
                if p.lower() in low:
                    raise self._leak(name, where, host)
        # (a real value in the host was looked for with the whole request: check_request)
        if sni:
            self.real_leak(sni.encode("utf-8", "surrogateescape"), "sni", host)

    def check_request(self, host: str, target: str, headers) -> None:
        """A real value in a request's host, target or headers (any header's name or value):
        a leak. Looked for once, before anything else reads the request (exchange._real_first:
        a denial or a hold written first would carry it into the log)."""
        if not self.placeholders or not self.check_real:
            return
        t = self.scrub_table()
        self.real_leak(host.encode("utf-8", "surrogateescape"), "the host", host, t)
        self.real_leak(target.encode("utf-8", "surrogateescape"), "the path or query", host, t)
        self.real_leak(b"\n".join([k + b"\n" + v for k, v in headers]), "a header", host, t)

    # -- one request ------------------------------------------------------------------------
    def apply(self, *, host: str, scheme: str, target: str, headers: list[tuple[bytes, bytes]]) -> Swap:
        """Swap placeholders in their declared places (TLS-terminated, bound host) or raise."""
        terminated = scheme == "https"
        if type(headers) is not list:
            headers = list(headers)  # read twice below (the search, then header by header): never a spent iterator
        out_headers: list[tuple[bytes, bytes]] = []
        used: list[str] = []
        resign: list[CredentialBinding] = []
        # the request target (path + query)
        new_target = target
        for name in self._find_text(target):
            b = self.bindings[name]
            if not (terminated and b.mode == "query" and b.bound_to(host)):
                raise self._leak(name, "the path or query" if b.mode != "query" else "the query (not bound here)", host)
            self._check_revoked(name)
            new_target = self._swap_query(new_target, b)
            used.append(name)
        # headers
        if self._header_work.search(b"\n".join([k + b"\n" + v for k, v in headers])) is None:
            out_headers = list(headers)  # no placeholder anywhere, no Authorization: nothing to swap or refuse
            headers = ()
        work = self._header_work.search
        for k, v in headers:
            if work(k + b"\n" + v) is None:  # (what the search over all of them finds, header by header)
                out_headers.append((k, v))  # no placeholder, no Authorization-like name: nothing to swap
                continue
            lk = k.lower()
            names = self.find(v) + self.find_ci(k)
            basic_names: list[str] = []
            if lk in (b"authorization", b"proxy-authorization") and v[:6].lower() == b"basic ":
                try:
                    decoded = base64.b64decode(v[6:].strip(), validate=True)
                except Exception:
                    decoded = b""
                basic_names = self.find(decoded)
            if not names and not basic_names:
                out_headers.append((k, v))
                continue
            for name in names:
                b = self.bindings[name]
                form = self._header_forms.get(name)
                if terminated and form is not None and lk == form[0] and b.bound_to(host):
                    if v == form[1]:
                        self._check_revoked(name)
                        v = b.format.replace("{}", self.value(name)).encode()
                        used.append(name)
                        continue
                raise self._leak(name, f"header {k.decode('latin-1')[:40]!r}", host)
            if basic_names:
                v = self._swap_basic(decoded, basic_names, host=host, lk=lk, terminated=terminated, used=used)
            out_headers.append((k, v))
        # signed protocols: the placeholder never travels; the signature was made with it
        for b in self.bindings.values():
            if b.mode == "sigv4":
                akid = b.sigv4_access_key_id or ""
                signed = any(
                    k.lower() == b"authorization" and v.startswith(b"AWS4-HMAC-SHA256 ")
                    and f"Credential={akid}/".encode() in v
                    for k, v in out_headers
                ) or ("X-Amz-Signature=" in new_target and (f"Credential={akid}%2F" in new_target or f"Credential={akid}/" in new_target))
            elif b.mode == "hmac":
                hdr = dict(b.hmac)["header"].lower().encode()
                signed = any(k.lower() == hdr for k, _ in out_headers)
            else:
                continue
            if not signed:
                continue
            if not (terminated and b.bound_to(host)):
                raise self._leak(b.name, "a request signed with the placeholder (host not bound)", host)
            self._check_revoked(b.name)
            resign.append(b)
            used.append(b.name)
        return Swap(target=new_target, headers=out_headers, used=used, resign=resign)

    def _swap_basic(self, decoded: bytes, names: list[str], *, host: str, lk: bytes, terminated: bool,
                    used: list[str]) -> bytes:
        """``Basic base64(user:password)``: each part is either free of placeholders or exactly
        the placeholder of a credential declared for that part and bound to ``host``."""
        user, sep, pw = decoded.partition(b":")
        if not sep:
            raise self._leak(names[0], "basic auth (no user:password)", host)
        parts = {"user": user, "password": pw}
        found = {part: self.find(text) for part, text in parts.items()}
        placed = set()
        for part, text in parts.items():
            for name in found[part]:
                b = self.bindings[name]
                if not (terminated and b.bound_to(host) and b.mode == "basic" and lk == b"authorization"):
                    raise self._leak(name, "basic auth (not bound here)", host)
                if b.basic != part or text != self.placeholders[name].encode():
                    raise self._leak(name, f"basic auth (the {part}, where it is not declared)", host)
                placed.add(name)
        for name in names:
            if name not in placed:  # e.g. across the colon
                raise self._leak(name, "basic auth (wrong part)", host)
        for part in parts:
            for name in found[part]:
                self._check_revoked(name)
                parts[part] = self.value(name).encode()
                used.append(name)
        return b"Basic " + base64.b64encode(parts["user"] + b":" + parts["password"])

    def _check_revoked(self, name: str) -> None:
        if name in self.local_revoked or self.revoked(name):
            cache = self.brokers.get(name)
            if cache is not None:
                cache.drop(revoke=True)  # what was minted is forgotten (and revoked upstream)
            raise CredentialError(
                f"credential:revoked:{name}", f"credential {name!r} has been revoked", name=name, where="", alert=False
            )

    def _swap_query(self, target: str, b: CredentialBinding) -> str:
        path, sep, query = target.partition("?")
        if not sep:
            raise self._leak(b.name, "the path", "")
        pairs = parse_qsl(query, keep_blank_values=True)
        ph = self.placeholders[b.name]
        if any(ph in k for k, _ in pairs) or any(ph in v for k, v in pairs if k != b.query):
            raise self._leak(b.name, "a query parameter it is not bound to", "")
        if ph in path:
            raise self._leak(b.name, "the path", "")
        real = self.value(b.name)
        pairs = [(k, real if (k == b.query and v == ph) else v) for k, v in pairs]
        return path + "?" + urlencode(pairs, quote_via=quote, safe="")

    # -- streaming --------------------------------------------------------------------------
    def body_scanner(self, host: str) -> "BodyScanner":
        return BodyScanner(self, host)

    def scrubber(self) -> "Scrubber":
        return Scrubber(self.scrub_table(), derived=self.derived_match())

    def remember_derived(self, pairs: list[tuple[bytes, bytes]]) -> None:
        """Signatures the gate just made with a real key (signing.derived: (made, what the agent
        sent)): scrubbed from every later response of this session, whatever host or
        connection it comes on and in any letter case (review 9: an upstream that stores a
        request and shows it later, or upper-cases a hex signature, handed the sandbox a
        presigned URL signed with the real key). The last DERIVED_MAX are kept."""
        for made, agent in pairs:
            key = made.lower()
            self._derived.pop(key, None)
            self._derived[key] = agent
        while len(self._derived) > DERIVED_MAX:
            del self._derived[next(iter(self._derived))]
        self._derived_match = None

    def derived_match(self) -> "_Derived | None":
        if not self._derived:
            return None
        if self._derived_match is None:
            self._derived_match = _Derived(dict(self._derived))
        return self._derived_match

    def scrub_table(self) -> "ScrubTable":
        """Every form of every real value of this session, and whose it is: what responses are
        scrubbed of, and what a request from the sandbox must never hold."""
        pairs, names = self._pairs()
        key = (tuple(pairs), self.scrub_encoded)
        if self._scrub_table is None or self._scrub_table[0] != key:
            # built once per set of values (a rotation builds a new one), not per request
            self._scrub_table = (key, ScrubTable(pairs, encoded=self.scrub_encoded, names=names))
        return self._scrub_table[1]

    def _pairs(self) -> tuple[list[tuple[bytes, bytes]], list[str]]:
        pairs, names = [], []
        for name, ph in self.placeholders.items():
            cache = self.brokers.get(name)
            if cache is not None:
                # what was minted (never minting here) and the long-lived secret's parts
                vals = [(v.encode(), ph.encode()) for v in cache.scrub_values()]
                pairs += vals
                names += [name] * len(vals)
                continue
            try:
                real = self.value(name)
            except Exception:
                real = None  # (unavailable now: the values it had are still scrubbed, below)
            seen = self._seen_values.setdefault(name, [])
            if real and real not in seen:
                # a rotation mid-session: the values swapped before stay scrubbed (an upstream
                # may still echo one), the last few of them, as for a brokered credential
                seen.append(real)
                del seen[:-SEEN_VALUES]
            for v in seen:
                pairs.append((v.encode(), ph.encode()))
                names.append(name)
        return pairs, names

    def real_leak(self, data: bytes, where: str, host: str, table: "ScrubTable | None" = None) -> None:
        """A real value (any of its forms of 8 bytes or more) in what the sandbox sends: it never
        holds one, so it has one only through a leak (an echo, a side channel) and is sending it
        on - blocked, and an alert (review 8). Raises CredentialError."""
        if not data or not self.placeholders or not self.check_real:
            return
        t = table if table is not None else self.scrub_table()
        m = t.split_regex.search(data)
        d = self.derived_match()
        if m is None and d is not None and d.regex.search(data.lower()) is not None:
            name = "(a signature the gate made)"
            raise CredentialError(
                "credential:leak-real:signature",
                f"a signature the gate made with a real key came from the sandbox, in {where}: blocked (it never "
                "receives one; it has it through a leak)", name="signature", where=where, alert=True)
        if m is not None:
            name = t.owner.get(m.group(0), "?")
            raise CredentialError(
                f"credential:leak-real:{name}",
                f"the real value of credential {name!r} came from the sandbox, in {where}: blocked (the sandbox only "
                "ever holds its placeholder; it has the value through a leak)",
                name=name, where=where, alert=True)


class BodyScanner:
    """Forward a request body chunk by chunk, holding back just enough to see a placeholder
    split across chunks; raises CredentialError before any byte of a placeholder is released."""

    def __init__(self, creds: CredentialSet, host: str):
        self.creds, self.host = creds, host
        # a placeholder, or a real value's form (CredentialSet.real_leak), split across chunks
        self.hold = max(creds.max_len - 1, creds.scrub_table().stream_window if creds.placeholders else 0, 0)
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        buf = self.tail + data
        for name in self.creds.find(buf):
            raise self.creds._leak(name, "the request body", self.host)
        self.creds.real_leak(buf, "the request body", self.host)
        if self.hold and len(buf) > self.hold:
            out, self.tail = buf[: -self.hold], buf[-self.hold :]
        elif self.hold:
            out, self.tail = b"", buf
        else:
            out, self.tail = buf, b""
        return out

    def finish(self) -> bytes:
        out, self.tail = self.tail, b""
        return out


class _Form(NamedTuple):
    """One form of a value: its ``text``, and for a base64 fragment the bytes it encodes
    (``src``), the byte alignment ``k`` of ``src`` inside the encoded text, and the alphabet."""

    text: bytes
    src: bytes | None = None
    k: int = 0
    url: bool = False

    @property
    def lead(self) -> int:
        """base64 characters before the fragment that mix in the bytes before ``src``"""
        return _LEAD[self.k]

    @property
    def after(self) -> int:
        """base64 characters after the fragment that complete its last group"""
        return (0, 3, 2)[(self.k + len(self.src)) % 3]


_LEAD = (0, 2, 3)  # base64 characters before a fragment that mix in the bytes before src


def _b64_forms(v: bytes) -> list[_Form]:
    """The part of base64(v) that does not depend on the bytes around v, for v starting at
    each of the three byte alignments, in both alphabets: whatever longer text v is embedded in
    (``user:v`` in a Basic header, a JWT, a JSON blob), one of these is a substring of its
    base64."""
    out = []
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + v).rstrip(b"=")
        trail = 1 if (k + len(v)) % 3 else 0  # the last character mixes in the bytes after v
        frag = enc[_LEAD[k]:len(enc) - trail]
        out += [_Form(frag, v, k, False), _Form(frag.translate(_B64URL), v, k, True)]
    return out


def _same_length_mod3(j: bytes, like: bytes) -> bytes:
    """A JSON string body equal in meaning to ``j`` whose length matches ``like``'s modulo 3,
    by writing up to two of its ASCII letters or digits as ``\\u00XX`` (5 bytes more each):
    base64 of a text in which it replaces ``like`` then stays aligned, so the client decodes
    the rest intact. The escapes go after the first character (not at either end)."""
    count = {0: 0, 1: 2, 2: 1}[(len(like) - len(j)) % 3]
    if not count or len(j) < count + 2 or not j[1:1 + count].isalnum():
        return j
    return j[:1] + b"".join(b"\\u%04x" % c for c in j[1:1 + count]) + j[1 + count:]


def _json_forms(value: bytes) -> list[bytes]:
    out = []
    for ascii_only in (True, False):
        try:
            j = json.dumps(value.decode("utf-8"), ensure_ascii=ascii_only)[1:-1].encode()
        except UnicodeDecodeError:
            j = value
        out += [j, j.replace(b"/", b"\\/")]
    return out


def _all_forms(value: bytes, like: bytes | None = None) -> list[_Form]:
    """The forms of ``value``, position by position the same transformations for any value
    (so a real value's form maps to the same form of its placeholder). ``like``: the real
    value this placeholder stands for (its JSON forms inside base64 are length-matched)."""
    forms = [_Form(value)] + _b64_forms(value)
    text = value.decode("utf-8", errors="surrogateescape")
    for safe in ("", "/"):
        for q in (quote(text, safe=safe, errors="surrogateescape"),
                  quote_plus(text, safe=safe, errors="surrogateescape")):
            forms += [_Form(q.encode()), _Form(_PCT.sub(lambda m: m.group(0).lower(), q).encode())]
    jsons = _json_forms(value)
    forms += [_Form(j) for j in jsons]
    forms += [_Form(value.hex().encode()), _Form(value.hex().upper().encode())]
    # one composition common enough to name: JSON inside base64 (JWT payloads, data URLs,
    # Kubernetes secrets, an echo service that base64s its JSON answer)
    like_jsons = _json_forms(like) if like is not None else jsons
    for j, lj in zip(jsons, like_jsons):
        forms += _b64_forms(_same_length_mod3(j, lj))
    forms += _b32_forms(value) + _utf16_forms(value, jsons[0])
    return forms


def _b32_forms(v: bytes) -> list[_Form]:
    """base32 (RFC 4648, upper case as it writes it) of ``v`` at each of the five byte
    alignments: the characters that depend on ``v`` alone (as :func:`_b64_forms`). (Lower-case
    base32 is not looked for: every position of text with a lower-case letter would be the
    possible start of one, and held back at a chunk edge.)"""
    out = []
    for k in range(5):
        enc = base64.b32encode(b"\0" * k + v).rstrip(b"=")
        lead = -(-8 * k // 5)  # characters that mix in the bytes before v
        trail = 1 if (8 * (k + len(v))) % 5 else 0  # the last one mixes in the bytes after it
        frag = enc[lead:len(enc) - trail]
        out.append(_Form(frag))
    return out


def _utf16_forms(v: bytes, j: bytes) -> list[_Form]:
    """``v`` and its JSON-escaped form ``j`` in UTF-16 (either byte order): a JSON or XML
    document sent as UTF-16 (always as many forms, so a value maps to its placeholder's)."""
    try:
        t = v.decode("utf-8")
    except UnicodeDecodeError:
        t = None
    out = []
    for enc in ("utf-16-le", "utf-16-be"):
        out += [_Form(t.encode(enc) if t is not None else v), _Form(j.decode("latin-1").encode(enc))]
    return out


def encoded_forms(value: bytes) -> list[bytes]:
    """Every form of ``value`` the scrubber looks for: raw; base64 and base64url at each byte
    alignment; percent-encoding (``%20`` and ``+`` styles, either hex case, with ``/`` kept or
    encoded); JSON string escaping (ASCII-only or not, ``/`` escaped or not); hex; and base64
    of the JSON-escaped forms."""
    seen: set[bytes] = set()
    return [f.text for f in _all_forms(value) if f.text and not (f.text in seen or seen.add(f.text))]


_B64URL = bytes.maketrans(b"+/", b"-_")
_B64_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")
_PCT = re.compile(r"%[0-9A-F]{2}")


# -- text escapes ----------------------------------------------------------------------------
# A value can reach a client written with the escapes of the text around it, character by
# character, any mix of escaped and literal characters: an HTML/XML page (&#115; &#x6b;
# &quot;), a JavaScript or JSON string (\x73 \u0073 \u{73} \/), CSS (\73 ), a URL
# (%73, %2573 when encoded twice), a MIME part (quoted-printable =73, soft line breaks). Those
# cannot all be listed as forms (each character may or may not be escaped): the scrubber reads
# the text through each family's decoder instead (a *view*), finds the value there, and
# replaces the characters that spelled it - escapes and all - with the placeholder's form.
import html.entities as _entities  # noqa: E402

_NAMED = {k[:-1].encode(): v.encode("utf-8") for k, v in _entities.html5.items() if k.endswith(";")}
_JS_ONE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"b": b"\b", b"f": b"\f", b"v": b"\v"}


def _chr(n: int) -> bytes | None:
    if n > 0x10FFFF:
        return None
    return chr(n).encode("utf-8", "surrogatepass")


def _dec_html(m) -> bytes | None:
    dec, hx, name = m.group(1, 2, 3)
    if dec is not None:
        return _chr(int(dec))
    if hx is not None:
        return _chr(int(hx, 16))
    return _NAMED.get(name)


def _dec_js(m) -> bytes | None:
    hx, u4, ub, octal, one = m.group(1, 2, 3, 4, 5)
    if hx is not None:
        return _chr(int(hx, 16))
    if u4 is not None:
        return _chr(int(u4, 16))
    if ub is not None:
        return _chr(int(ub, 16))
    if octal is not None:
        return _chr(int(octal, 8))
    return _JS_ONE.get(one, one)


def _dec_css(m) -> bytes | None:
    hx, one = m.group(1, 2)
    return _chr(int(hx, 16)) if hx is not None else one


def _dec_byte(m) -> bytes:
    hx = m.group(1)
    return b"" if hx is None else bytes((int(hx, 16),))


class _Family(NamedTuple):
    name: str
    trigger: bytes  # no escape of the family without this byte
    regex: "re.Pattern[bytes]"
    decode: Callable  # match -> the bytes it stands for (None: not an escape after all)


_FAMILIES = (
    # &#115; &#x73; &quot; - and escaped again (&amp;#115;): the text of an HTML or XML document
    _Family("html", b"&", re.compile(rb"&(?:amp;)*(?:#([0-9]{1,7});?|#[xX]([0-9a-fA-F]{1,6});?|([A-Za-z][A-Za-z0-9]{1,31});)"),
            _dec_html),
    # \x73 \u0073 \u{73} \163 \/ \n: JavaScript and JSON strings (JSON inside JSON: read twice)
    _Family("js", b"\\", re.compile(rb"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]{1,6})\}|([0-7]{1,3})|(.))",
                                      re.DOTALL), _dec_js),
    # \73 (one optional white space after it), \": CSS
    _Family("css", b"\\", re.compile(rb"\\(?:([0-9a-fA-F]{1,6})(?:\r\n|[ \t\r\n\f])?|([^\r\n\f0-9a-fA-F]))"), _dec_css),
    # %73, and %2573 (percent-encoded twice, or more): URLs and forms
    _Family("pct", b"%", re.compile(rb"%(?:25)*([0-9A-Fa-f]{2})"), _dec_byte),
    # =73 and soft line breaks (=\r\n): quoted-printable (MIME)
    _Family("qp", b"=", re.compile(rb"=(?:([0-9A-Fa-f]{2})|\r?\n)"), _dec_byte),
)
# an escape that a chunk edge may have cut short (held back until the rest arrives)
_PARTIAL = re.compile(rb"(?:&(?:amp;)*(?:#[xX]?[0-9a-fA-F]{0,7}|[A-Za-z][A-Za-z0-9]{0,31})?|\\(?:x[0-9a-fA-F]?|u\{?[0-9a-fA-F]{0,5}|"
                      rb"[0-9a-fA-F]{1,5})?|%(?:25)*[0-9a-fA-F]?|=(?:\r|[0-9A-Fa-f])?)\Z")
_TOKEN_MAX = 12  # bytes one escaped character takes at most where it is held back at a chunk edge
# white space, and the last white space of a text (StreamGuard's streams: ScrubTable.stream_keep)
_WS = re.compile(rb"\s")
_LAST_WS = re.compile(rb"\s(?=\S*\Z)")
# a byte that starts an escape of some family (ScrubTable.held: a value may be spelled in escapes)
_ESC_TRIGGER = re.compile(rb"[&\\%=]")
# the end of a line that an escape goes on across: qp's soft break, a CSS hex escape's white
# space, a backslash before the line break
_ESC_BEFORE_NL = re.compile(rb"(?:=|\\|\\[0-9a-fA-F]{1,6})\r?\Z")


class _View:
    """A text read through one family's decoder, and where each decoded byte came from."""

    __slots__ = ("text", "vs", "ve", "os", "oe")

    def __init__(self, text: bytes, vs: list, ve: list, os_: list, oe: list):
        self.text, self.vs, self.ve, self.os, self.oe = text, vs, ve, os_, oe

    def start(self, v: int) -> int:
        """The original offset where view byte ``v`` starts (an escape's first byte)."""
        i = bisect_right(self.vs, v) - 1
        if i < 0:
            return v
        if v < self.ve[i]:
            return self.os[i]
        return self.oe[i] + (v - self.ve[i])

    def end(self, v: int) -> int:
        """The original offset just after view bytes ``[..v)`` (an escape's end)."""
        if v <= 0:
            return 0
        i = bisect_right(self.vs, v - 1) - 1
        if i < 0:
            return v
        if v - 1 < self.ve[i]:
            return self.oe[i]
        return self.oe[i] + (v - self.ve[i])


def _unescape(buf: bytes, fam: _Family) -> _View | None:
    """``buf`` with ``fam``'s escapes decoded; None when it holds none."""
    parts: list[bytes] = []
    vs: list[int] = []
    ve: list[int] = []
    os_: list[int] = []
    oe: list[int] = []
    pos = vpos = 0
    dec = fam.decode
    for m in fam.regex.finditer(buf):
        d = dec(m)
        if d is None:
            continue
        s, e = m.span()
        parts.append(buf[pos:s])
        vpos += s - pos
        parts.append(d)
        vs.append(vpos)
        ve.append(vpos + len(d))
        os_.append(s)
        oe.append(e)
        vpos += len(d)
        pos = e
    if not vs:
        return None
    parts.append(buf[pos:])
    return _View(b"".join(parts), vs, ve, os_, oe)


class ScrubTable:
    """What a :class:`Scrubber` looks for, compiled once per set of real values: every form
    of each value, the form of its placeholder that replaces it, one regular expression, and
    the forms by their first bytes (to know what to hold back at a chunk edge)."""

    def __init__(self, pairs: list[tuple[bytes, bytes]], *, encoded: bool = True, names: list[str] | None = None):
        self.encoded = encoded
        self.table: dict[bytes, tuple[_Form, _Form]] = {}
        self.owner: dict[bytes, str] = {}  # a form -> the name of its credential (``names``, one per pair)
        for i, (real, ph) in enumerate(pairs):
            if encoded:
                # each form of the real value -> the same form of the placeholder
                for r, p in zip(_all_forms(real), _all_forms(ph, like=real)):
                    if r.text:
                        self.table.setdefault(r.text, (r, p))
                        if names is not None:
                            self.owner.setdefault(r.text, names[i])
            elif real:
                self.table.setdefault(real, (_Form(real), _Form(ph)))
                if names is not None:
                    self.owner.setdefault(real, names[i])
        forms = sorted(self.table, key=len, reverse=True)
        self.regex = re.compile(b"|".join(re.escape(f) for f in forms)) if forms else None
        self.maxlen = max((len(f) for f in forms), default=1)
        # what the end of a piece of a response waits for, whatever it is (Scrubber.feed): the
        # longest form less a byte and the base64 group before it, or that form spelled in
        # escapes; less only where a line break ends the piece's text (no form holds one)
        self.hold_raw = self.maxlen - 1 + Scrubber.CONTEXT
        self.hold_esc = self.maxlen * _TOKEN_MAX + _TOKEN_MAX
        self.newline_free = all(b"\n" not in f for f in forms)
        # what a value split across stream events is looked for as (StreamGuard): every form of
        # 8 bytes or more (shorter ones would match by chance in running text)
        split = [f for f in forms if len(f) >= 8]
        self.split_regex = re.compile(b"|".join(re.escape(f) for f in split)) if split else re.compile(b"(?!)")
        # what a stream remembers of a field's text (StreamGuard): its trailing run of bytes that
        # are not white space, at most the longest split form less a byte - the same for any
        # text, never "what could still become a value" (an oracle, review 8); where a form
        # holds white space, simply its last bytes
        self.stream_window = max((len(f) for f in split), default=1) - 1
        self.split_ws = any(_WS.search(f) is not None for f in split)

    def stream_keep(self, text: bytes) -> int:
        """Where the part of a stream's ``text`` that a later piece could complete a form with
        starts (StreamGuard): a function of the text alone."""
        lo = max(0, len(text) - self.stream_window)
        if self.split_ws:
            return lo
        m = _LAST_WS.search(text, lo)
        return m.end() if m is not None else lo

    def held(self, buf: bytes) -> int:
        """How many bytes at the end of ``buf`` (a response, scrubbed so far) wait for the next
        piece. A function of the bytes the sandbox may see and of this table's size, never of
        whether the end of ``buf`` is the start of a value: a hold that depended on that would
        tell the sandbox, by how much of a reflected text arrives before a pause, whether its
        guess of a value's start is right - one character at a time (review 8). Everything
        after the last line break, up to the longest form (spelled in escapes, where the end
        holds an escape's first byte); nothing after a line break ending the piece."""
        n = len(buf)
        cap = self.hold_raw
        if self.encoded and _ESC_TRIGGER.search(buf, max(0, n - self.hold_esc)) is not None:
            cap = self.hold_esc
        cap = min(n, cap)
        if self.newline_free:
            lo = n - cap
            j = buf.rfind(b"\n", lo)
            # (a line break an escape goes on across - quoted-printable's "=\r\n", CSS's "\73\n",
            # JavaScript's "\\\n" - is not the end of anything: the one before it is looked for)
            while j >= 0 and self.encoded and _ESC_BEFORE_NL.search(buf, max(0, j - 9), j) is not None:
                j = buf.rfind(b"\n", lo, j)
            if j >= 0:
                return n - j - 1
        return cap


class Scrubber:
    """Replace real values by placeholders in a byte stream (responses), across chunk edges.

    With ``encoded`` (the default) every :func:`encoded_forms` of a value is replaced by the
    same form of its placeholder, so an upstream that echoes the gate's ``Basic
    base64(user:real)``, a percent-encoded query, or a JSON-escaped body hands the sandbox the
    placeholder. A base64 match is re-encoded together with the characters around it (which
    mix in the neighbouring bytes), so the client decodes the placeholder exactly and the rest
    intact. What is held back at the end of a piece is the unfinished line, up to the longest
    form (:meth:`ScrubTable.held`): a stream of lines (SSE, NDJSON) keeps streaming, and how
    much is held never depends on what the text could become (that was an oracle on the
    values' characters, review 8).
    """

    CONTEXT = 3  # base64 characters around a fragment that belong to its first/last group

    def __init__(self, table: "ScrubTable | list[tuple[bytes, bytes]]", *, encoded: bool = True,
                 derived: "_Derived | None" = None):
        self._t = table if isinstance(table, ScrubTable) else ScrubTable(table, encoded=encoded)
        self._d = derived  # the signatures the gate made (CredentialSet.remember_derived), or None
        self.tail = b""
        self.hits = 0

    def _derived(self, buf: bytes) -> bytes:
        if self._d is None:
            return buf
        buf, n = self._d.sub(buf)
        self.hits += n
        return buf

    @property
    def encoded(self) -> bool:
        """Encoded forms too (and so Content-Encoding is decoded: server.py reads this)."""
        return self._t.encoded

    @property
    def active(self) -> bool:
        return self._t.regex is not None or self._d is not None

    def _b64_region(self, buf: bytes, start: int, end: int, real: _Form, ph: _Form) -> tuple[int, int, bytes] | None:
        """The whole base64 groups around a fragment match, re-encoded with the placeholder in
        place of the value; None when the context is not all there or does not decode."""
        rs, re_ = start - real.lead, end + real.after
        if rs < 0 or re_ > len(buf):
            return None
        region = buf[rs:re_]
        try:
            raw = (base64.urlsafe_b64decode if real.url else base64.b64decode)(region)
        except (binascii.Error, ValueError):
            return None
        k = real.k
        if raw[k:k + len(real.src)] != real.src:
            return None
        new = raw[:k] + ph.src + raw[k + len(real.src):]
        enc = (base64.urlsafe_b64encode if real.url else base64.b64encode)(new)
        if not region.endswith(b"="):
            enc = enc.rstrip(b"=")
        return rs, re_, enc

    def _scan(self, buf: bytes, final: bool) -> tuple[bytes, int]:
        """Replace every form in ``buf``; returns (the new buffer, how many bytes at its end
        must wait for more input)."""
        matches = list(self._t.regex.finditer(buf)) if self._t.regex is not None else ()
        if not matches:  # (most pieces of most responses: nothing to copy)
            return bytes(buf), 0
        out = bytearray()
        pos = 0
        for i, m in enumerate(matches):
            start, end = m.span()
            real, ph = self._t.table[m.group(0)]
            next_start = matches[i + 1].start() if i + 1 < len(matches) else len(buf) + 3
            if real.src is not None:
                if not final and end + real.after > len(buf):
                    # the group after the match has not arrived: wait for it
                    hold_from = max(pos, start - real.lead)
                    out += buf[pos:hold_from]
                    return bytes(out) + buf[hold_from:], len(buf) - hold_from
                region = self._b64_region(buf, start, end, real, ph)
                # the whole groups around the fragment, unless that would swallow the start of
                # the next match (then only the fragment: the next match must be replaced too)
                if region is not None and region[0] >= pos and region[1] <= next_start:
                    rs, re_, enc = region
                    out += buf[pos:rs] + enc
                    pos = re_
                    self.hits += 1
                    continue
            out += buf[pos:start] + ph.text
            pos = end
            self.hits += 1
        out += buf[pos:]
        return bytes(out), 0

    def _views(self, buf: bytes) -> bytes:
        """``buf`` with every value spelled in a family's text escapes replaced (_FAMILIES)."""
        if self._t.regex is None:
            return buf
        for fam in _FAMILIES:
            if fam.trigger in buf:
                buf = self._view_pass(buf, fam)
        return buf

    def _view_pass(self, buf: bytes, fam: _Family) -> bytes:
        v = _unescape(buf, fam)
        if v is None:
            return buf
        t = self._t
        spans = [(v.start(m.start()), v.end(m.end()), t.table[m.group(0)][1]) for m in t.regex.finditer(v.text)]
        if not spans and fam.trigger in v.text:  # escaped twice (JSON inside a JSON string)
            v2 = _unescape(v.text, fam)
            if v2 is not None:
                spans = [(v.start(v2.start(m.start())), v.end(v2.end(m.end())), t.table[m.group(0)][1])
                         for m in t.regex.finditer(v2.text)]
        if not spans:
            return buf
        out = bytearray()
        pos = 0
        for s, e, ph in spans:
            if s < pos:
                continue
            # the escapes that spelled the value (whole escapes: an escape that also held a
            # neighbouring character goes too) become the placeholder's same form, literally
            out += buf[pos:s] + ph.text
            pos = e
            self.hits += 1
        out += buf[pos:]
        return bytes(out)

    def feed(self, data: bytes) -> bytes:
        if not self.active:
            return data
        buf, hold = self._scan(self.tail + data, final=False)
        if self.encoded:
            # (not into an escape the chunk edge may have cut short: "\\38" may go on as "\\38 ")
            cut = len(buf) - hold
            m = _PARTIAL.search(buf, max(0, cut - _TOKEN_MAX), cut)
            if m is not None:
                cut = m.start()
            buf = self._views(buf[:cut]) + buf[cut:]
        buf = self._derived(buf)
        # what waits for the next piece: the same whatever the end of buf is the start of (held();
        # _scan holds more only after a whole form, to re-encode its base64 group)
        hold = min(len(buf), max(hold, self._t.held(buf)))
        if self._d is not None:  # (a signature cut by the piece's edge: the same rule, its length)
            n = len(buf)
            cap = min(n, self._d.maxlen - 1)
            j = buf.rfind(b"\n", n - cap)
            hold = max(hold, n - j - 1 if j >= 0 else cap)
        if hold:
            out, self.tail = buf[:-hold], buf[-hold:]
        else:
            out, self.tail = buf, b""
        return out

    def finish(self) -> bytes:
        if not self.active or not self.tail:
            out, self.tail = self.tail, b""
            return out
        out, _ = self._scan(self.tail, final=True)
        self.tail = b""
        return self._derived(self._views(out) if self.encoded else out)

    def header(self, value: bytes) -> bytes:
        if not self.active:
            return value
        out = self._scan(value, final=True)[0]
        return self._derived(self._views(out) if self.encoded else out)

    def headers(self, headers) -> list[tuple[bytes, bytes]]:
        """Names and values of a response's headers, scrubbed."""
        hs = [(bytes(k), bytes(v)) for k, v in headers]
        if not self.active:
            return hs
        # one search over all of them first: a form found in one name or value is found in
        # their concatenation too, so no match there means nothing to replace (the usual case)
        joined = b"\x00".join([p for kv in hs for p in kv])
        if ((self._t.regex is None or self._t.regex.search(joined) is None)
                and not (self.encoded and self._views(joined) != joined)
                and (self._d is None or self._d.regex.search(joined.lower()) is None)):
            return hs
        return [(self.header(k), self.header(v)) for k, v in hs]


# -- values split across the events of a stream --------------------------------------------
# a JSON string literal, and whether it is an object key (a colon follows)
_JSTR = re.compile(rb'"([^"\\\n]*(?:\\.[^"\\\n]*)*)"(\s*:)?')
# the media types of streams read event by event (and a response that names none)
STREAM_TYPES = frozenset((b"text/event-stream", b"application/x-ndjson", b"application/ndjson", b"application/jsonl",
                          b"application/x-jsonlines", b"application/json-seq", b"application/stream+json",
                          b"application/x-ldjson", b""))


def is_stream_type(content_type: bytes | None) -> bool:
    return (content_type or b"").split(b";", 1)[0].strip().lower() in STREAM_TYPES


class StreamGuard:
    """A real value split across the events of a streamed response - server-sent events'
    ``data:`` lines, newline-delimited JSON, and the JSON string deltas of LLM-style streams
    (``{"delta": "sk-"}`` then ``{"delta": "REAL..."}``) - never reaches the sandbox.

    Fed what the :class:`Scrubber` releases (a value inside one event is already replaced), it
    reads the body line by line; each line that is an SSE ``data:`` payload or a JSON document
    adds its text to a *stream*: the concatenated ``data:`` payloads, and per JSON field (its
    key and its place among the fields of that key in the document) the concatenated string
    values of that field in consecutive events. A stream that then holds a form of a value
    cuts the response (``credential:echo-split``). The events that the end of a stream came in
    are held back while that end is a run of :attr:`MIN_HOLD` bytes or more that are not white
    space (at most the longest form): so no more than 3 bytes of a value ever go out before
    it is known. What is held is a function of the text alone, never of whether it could
    become a value - that told the sandbox, by what arrived before a pause, whether its guess
    of a value's start was right (review 8). The cost: an event whose field ends in a word is
    held until the next event (one event's latency), on responses to requests a credential
    went into. A field an event repeats unchanged (an id, a model's name) holds nothing back,
    and a field that events stop carrying holds nothing back after :attr:`STALE_EVENTS` of
    them; both are still followed, so a value split across events with others between them is
    still cut. Bounded: a line longer than
    :attr:`LINE_MAX` is no event (it streams as the scrubber releases it), and more than
    :attr:`HOLD_MAX` held bytes cut the response (``credential:uninspectable-stream``)."""

    LINE_MAX = 64 * 1024
    HOLD_MAX = 1 << 20
    STREAMS_MAX = 1024
    STALE_EVENTS = 2  # events without a field after which it holds nothing back (it is still followed)
    MIN_HOLD = 4  # a shorter start of a value ("sk-") goes out; the stream still remembers it

    def __init__(self, table: ScrubTable):
        self._t = table
        self.buf = bytearray()  # not yet released
        self.base = 0  # the body offset of buf[0]
        self.parsed = 0  # the body offset of the line being read
        self.long_line = False  # that line is over LINE_MAX: not an event
        # key -> [text that may still become a form, [(text offset, body offset of its event)]];
        # only streams that hold something are kept
        self.streams: dict[bytes, list] = {}

    def feed(self, data: bytes) -> bytes:
        if data:
            self.buf += data
            self._lines(final=False)
        return self._release()

    def finish(self) -> bytes:
        self._lines(final=True)
        out = bytes(self.buf)
        self.base += len(out)
        self.buf.clear()
        return out

    def _lines(self, final: bool) -> None:
        buf, base = self.buf, self.base
        while True:
            i = buf.find(b"\n", self.parsed - base)
            if i < 0:
                break
            if self.long_line:
                self.long_line = False
            else:
                self._event(bytes(buf[self.parsed - base:i]), self.parsed)
            self.parsed = base + i + 1
        rest = base + len(buf) - self.parsed
        if final and rest and not self.long_line:
            self._event(bytes(buf[self.parsed - base:]), self.parsed)
            self.parsed = base + len(buf)
        elif rest > self.LINE_MAX:
            self.long_line = True

    def _event(self, line: bytes, at: int) -> None:
        line = line.rstrip(b"\r")
        sse = line[:5] == b"data:"
        p = (line[6:] if line[5:6] == b" " else line[5:]) if sse else line
        if b'"' in p and p.lstrip()[:1] in (b"{", b"[", b","):
            # a JSON document (or an element of a streamed array): each string value joins the
            # stream of its field (the pieces of one field line up, event by event: "content"
            # of choices[0].delta, "text" of a content_block_delta)
            key = b"json:"
            seen: dict[bytes, int] = {}
            for m in _JSTR.finditer(p):
                text, colon = m.group(1, 2)
                if colon:
                    key = b"json:" + text
                    continue
                if b"\\" in text:
                    try:
                        text = json.loads(b'"' + text + b'"').encode("utf-8", "surrogatepass")
                    except ValueError:
                        pass
                n = seen.get(key, 0)
                seen[key] = n + 1
                self._add(key + b"#%d" % n, text, at)
            self._end_fields(seen)
            return
        if sse:
            self._end_fields({})
            self._add(b"data:", p, at)

    def _end_fields(self, seen: dict) -> None:
        """An event's fields are in: a JSON field it does not carry is still followed (a value
        split across events may go on after other events: a ping, an empty delta - review 9)
        but after STALE_EVENTS such events it holds nothing back any more (a field an event
        carried once, like a role, would otherwise hold that event for ever)."""
        for k, st in self.streams.items():
            if k[:5] == b"json:" and k[:k.rindex(b"#")] not in seen:
                st[3] += 1

    def _add(self, key: bytes, piece: bytes, at: int) -> None:
        if not piece:
            return
        t = self._t
        st = self.streams.get(key)
        if st is None:
            text, marks = piece, [(0, at)]
        else:
            text, marks = st[0] + piece, st[1]
            marks.append((len(st[0]), at))
        if t.split_regex.search(text) is not None:
            raise DecodeError("credential:echo-split", "a credential's real value arrived split across the events "
                              "of a streamed response: the stream is cut")
        keep = t.stream_keep(text)
        if keep >= len(text):
            if st is not None:
                del self.streams[key]
            return
        # the same text again (a field every event repeats: an id, a model's name) is followed
        # but holds nothing back; a field that changes holds its events while it ends in a run
        stale = self.STALE_EVENTS if st is not None and len(piece) >= self.MIN_HOLD and piece == st[2] else 0
        if key not in self.streams and len(self.streams) >= self.STREAMS_MAX:
            self._evict()
        j = len(marks) - 1
        while marks[j][0] > keep:
            j -= 1
        self.streams[key] = [text[keep:], [(max(0, off - keep), a) for off, a in marks[j:]], piece, stale]

    def _evict(self) -> None:
        """Room for one more field: the stalest field that holds nothing back is forgotten; when
        every one holds, the response is cut (never followed partly)."""
        idle = [k for k, st in self.streams.items() if st[3] >= self.STALE_EVENTS]
        if not idle:
            raise DecodeError("credential:uninspectable-stream", f"over {self.STREAMS_MAX} fields of a streamed "
                              "response are being followed at once")
        del self.streams[max(idle, key=lambda k: self.streams[k][3])]

    def _release(self) -> bytes:
        end = self.base + len(self.buf)
        upto = end if self.long_line else self.parsed  # the line being read waits for its end
        for text, marks, _, stale in self.streams.values():
            if stale < self.STALE_EVENTS and len(text) >= self.MIN_HOLD:
                upto = min(upto, marks[0][1])
        n = max(0, upto - self.base)
        if end - self.base - n > self.HOLD_MAX:
            raise DecodeError("credential:uninspectable-stream", f"over {self.HOLD_MAX} bytes of a streamed response "
                              "would have to be held back to look for a credential's value split across its events")
        if not n:
            return b""
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.base += n
        return out
