"""Re-signing of signed requests at the egress gate: pure, no I/O.

The agent inside the sandbox only ever holds a *placeholder* secret. For bearer-style
credentials the gate swaps the placeholder for the real value in a header; for *signed*
protocols that is impossible (the secret never travels, only a signature over the request
does), so the gate

1. checks that the agent's signature was computed with the **placeholder** over exactly the
   request it received (anything else - tampering, another key, a stale request - is denied),
2. computes the signature with the **real** secret over the same signed material, and
3. returns the request with only the signature replaced.

Two schemes:

* :func:`resign_sigv4` - AWS Signature Version 4, both the ``Authorization`` header form and
  presigned (query-string) URLs. The signature arithmetic (canonical request assembly, path
  normalization, canonical headers, string-to-sign, key derivation) is botocore's own
  ``SigV4Auth`` / ``S3SigV4Auth``, *steered* to sign the request as received: the signed
  header set, canonical query string, payload hash and timestamp are taken from the agent's
  request instead of being chosen by botocore, and nothing is added to the request.
  botocore is imported lazily (this module sits on the gate's hot path).
* :func:`resign_hmac` - a generic HMAC scheme described by ``spec.models.HmacSigning``.

Errors are :class:`SigningError` with a stable ``code`` (the gate logs it and answers 403
``credential:<code>``). Messages are fixed texts: they never echo request-derived values,
so neither a secret nor a placeholder can end up in a log line or an answer.

SigV4 notes
-----------
* The access key id is not secret: the agent gets the real one; only the secret key is a
  placeholder. A request naming another key id is refused (``sigv4:wrong-key``).
* ``X-Amz-Security-Token`` (session tokens) is passed through untouched: it is simply part of
  the signed material like any other header/query parameter - unless ``real_secret`` is an STS
  session's key (a brokered ``aws-sts`` credential, :class:`agentvm.gate.brokers.SessionKey`):
  then a request carrying a token of its own is refused, and the gate signs with the session
  (its key id in the scope, its token added and signed: :func:`_sign_session`).
* Payload: a hex ``x-amz-content-sha256`` must equal SHA-256 of the body (else
  ``sigv4:bad-signature``); without that header the body's SHA-256 is used (presigned S3
  URLs: ``UNSIGNED-PAYLOAD``). ``UNSIGNED-PAYLOAD`` and ``STREAMING-UNSIGNED-PAYLOAD-TRAILER``
  in the header form are refused (``sigv4:unsupported``) unless ``allow_unsigned_payload=True``
  - note that boto3 >= 1.36 uploads to S3 with ``STREAMING-UNSIGNED-PAYLOAD-TRAILER`` by
  default. Chunk-signed streaming (``STREAMING-AWS4-HMAC-SHA256-PAYLOAD*``) and SigV4a
  (``AWS4-ECDSA-P256-SHA256``) are always ``sigv4:unsupported``.
* Canonical URI: S3-family services (``s3``, ``s3-object-lambda``, ``s3-outposts``) use the
  path exactly as sent; every other service gets botocore's normalization (dot segments and
  empty segments removed) and a second round of URI encoding, as the spec demands.
* Canonical query string: two candidates are tried, and the one the agent's signature
  verifies with is re-signed: the spec form (every name and value percent-decoded, then
  re-encoded with the RFC 3986 unreserved set, sorted; empty ``&&`` segments ignored) and
  botocore's as-sent form (raw pairs, sorted). For what SDKs send they are identical.
* Timestamp: ``X-Amz-Date`` (``YYYYMMDDTHHMMSSZ``) or, without it, ``Date`` (RFC 1123);
  that header must be signed, its day must equal the credential scope's day, and it must be
  within ``max_skew`` of ``now`` (``sigv4:expired``). Presigned URLs: ``X-Amz-Date`` no more
  than ``max_skew`` in the future, ``now <= X-Amz-Date + X-Amz-Expires`` and
  ``X-Amz-Expires`` in 1..3600 (``sigv4:expires-too-long``: a URL signed with the real key
  is a bearer capability if an upstream echoes it; AWS allows 7 days).
* ``SignedHeaders`` must be lower-case, sorted, unique and include ``host``. A signed
  ``host`` missing from the headers is derived from the URL (as botocore does); a present
  ``Host`` header must match the URL's authority (``sigv4:malformed``), so what was signed
  is where the request goes. Repeated signed headers are joined with ``,`` in order.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from urllib.parse import quote, unquote_to_bytes, urlsplit

from agentvm.errors import PolicyDenied

__all__ = [
    "SigningError",
    "Request",
    "sigv4_in_request",
    "resign_sigv4",
    "resign_hmac",
    "hmac_message",
]


class SigningError(PolicyDenied):
    """A signed request the gate refuses to re-sign. ``code`` is e.g. ``sigv4:bad-signature``.

    The message is always a fixed text (never a value taken from the request or a secret).
    """

    code = "signing:error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)

    def __repr__(self) -> str:
        return f"SigningError({self.code!r}, {self.message!r})"


@dataclass(frozen=True)
class Request:
    """One HTTP request as the gate sees it after terminating the agent's TLS.

    ``url`` is the full ``https://host[:port]/path?query`` with path and query exactly as sent;
    ``headers`` keeps order and duplicates; ``body`` is the complete (de-chunked) body.
    """

    method: str
    url: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header_values(self, name: str) -> list[str]:
        lname = name.lower()
        return [v for k, v in self.headers if k.lower() == lname]


# --------------------------------------------------------------------------- helpers


def _err(code: str, message: str) -> SigningError:
    return SigningError(code, message)


def _one_header(req: Request, name: str, code: str, *, required: bool) -> str | None:
    vals = req.header_values(name)
    if len(vals) > 1:
        raise _err(code, f"more than one {name} header")
    if not vals:
        if required:
            raise _err(code, f"no {name} header")
        return None
    return vals[0]


def _split_url(url: str) -> tuple[str, str, str]:
    """``(prefix, path, query)``, raw and undecoded; ``prefix`` is ``scheme://authority``,
    ``query`` is ``""`` when there is none. ValueError for a non-absolute URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise ValueError("not an absolute URL")
    cut = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if i != -1 and i < cut:
            cut = i
    prefix = url[: len(scheme) + 3 + cut]
    tail = rest[cut:]
    path, qsep, query = tail.partition("?")
    return prefix, path, query


def _query_segments(query: str) -> list[tuple[str, str]]:
    """Raw ``(name, value)`` pairs of a query string, empty segments dropped."""
    out = []
    for seg in query.split("&"):
        if not seg:
            continue
        k, _, v = seg.partition("=")
        out.append((k, v))
    return out


def _unq(s: str) -> bytes:
    return unquote_to_bytes(s.encode("utf-8", "surrogatepass"))


def _qdecode(s: str) -> str:
    return _unq(s).decode("utf-8", "surrogateescape")


def _canonical_query(pairs: list[tuple[str, str]]) -> str:
    enc = sorted((quote(_unq(k), safe="-_.~"), quote(_unq(v), safe="-_.~")) for k, v in pairs)
    return "&".join(f"{k}={v}" for k, v in enc)


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _host_from_url(url: str) -> str:
    """The Host header value for ``url``, as botocore derives it (default port omitted)."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = u.port
    except ValueError:
        raise _err("sigv4:malformed", "request URL has an invalid authority") from None
    if ":" in host:
        host = f"[{host}]"
    if port is not None and port != {"http": 80, "https": 443}.get(u.scheme):
        host = f"{host}:{port}"
    return host


def _norm_host(h: str) -> str:
    h = h.strip().lower()
    for default in (":443", ":80"):
        if h.endswith(default):
            return h[: -len(default)]
    return h


# --------------------------------------------------------------------------- SigV4

_ALGORITHM = "AWS4-HMAC-SHA256"
_AUTH_PREFIX = _ALGORITHM + " "
_SIG_RE = re.compile(r"[0-9a-fA-F]{64}")
_AKID_RE = re.compile(r"[A-Za-z0-9]{1,128}")
_SCOPE_PART_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DATE8_RE = re.compile(r"[0-9]{8}")
_AMZ_DATE_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z")
_HEADER_NAME_RE = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")
_HEX64_RE = re.compile(r"[0-9a-fA-F]{64}")
_S3_SERVICES = frozenset({"s3", "s3-object-lambda", "s3-outposts"})
_PRESIGN_PARAMS = (
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
)
# how long a presigned URL the gate signs with a real key may stay valid: an upstream that echoes
# the URL hands the sandbox a bearer capability signed with the real key (review 8), and the
# gate's scrubbing of it (derived()) is the first line; this bounds what a miss would be worth.
# 3600 s is boto3's default ExpiresIn (AWS itself allows 7 days)
_MAX_PRESIGN_EXPIRES = 3600
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"


def sigv4_in_request(req: Request) -> bool:
    """True when the request carries a SigV4 signature (header form or presigned URL)."""
    for k, v in req.headers:
        if k.lower() == "authorization" and v.startswith(_AUTH_PREFIX):
            return True
    try:
        _, _, query = _split_url(req.url)
    except ValueError:
        return False
    return any(_qdecode(k) == "X-Amz-Signature" for k, _ in _query_segments(query))


@dataclass(frozen=True)
class _Scope:
    akid: str
    date: str
    region: str
    service: str


def _parse_credential(value: str) -> _Scope:
    parts = value.split("/")
    if len(parts) != 5 or parts[4] != "aws4_request":
        raise _err("sigv4:malformed", "SigV4 credential scope is malformed")
    akid, date, region, service, _ = parts
    if not (
        _AKID_RE.fullmatch(akid)
        and _DATE8_RE.fullmatch(date)
        and _SCOPE_PART_RE.fullmatch(region)
        and _SCOPE_PART_RE.fullmatch(service)
    ):
        raise _err("sigv4:malformed", "SigV4 credential scope is malformed")
    return _Scope(akid, date, region, service)


def _parse_signed_headers(value: str) -> list[str]:
    names = value.split(";")
    if not all(_HEADER_NAME_RE.fullmatch(n) for n in names):
        raise _err("sigv4:malformed", "SigV4 SignedHeaders is malformed")
    if names != sorted(set(names)):
        raise _err("sigv4:malformed", "SigV4 SignedHeaders must be lower-case, sorted and unique")
    if "host" not in names:
        raise _err("sigv4:malformed", "SigV4 SignedHeaders must include host")
    return names


def _parse_authorization(value: str) -> tuple[_Scope, list[str], str]:
    """``(scope, signed_headers, signature)`` from an ``AWS4-HMAC-SHA256 ...`` header value."""
    if not value.startswith(_AUTH_PREFIX):
        if value.startswith("AWS4-ECDSA-P256-SHA256"):
            raise _err("sigv4:unsupported", "SigV4a (ECDSA) signatures cannot be re-signed")
        raise _err("sigv4:malformed", "Authorization is not an AWS4-HMAC-SHA256 signature")
    fields: dict[str, str] = {}
    for part in value[len(_AUTH_PREFIX) :].split(","):
        part = part.strip(" \t")
        key, sep, val = part.partition("=")
        if not sep or key not in ("Credential", "SignedHeaders", "Signature") or key in fields:
            raise _err("sigv4:malformed", "SigV4 Authorization header is malformed")
        fields[key] = val
    if len(fields) != 3:
        raise _err("sigv4:malformed", "SigV4 Authorization header is malformed")
    if not _SIG_RE.fullmatch(fields["Signature"]):
        raise _err("sigv4:malformed", "SigV4 signature is malformed")
    return _parse_credential(fields["Credential"]), _parse_signed_headers(fields["SignedHeaders"]), fields["Signature"]


def _parse_amz_date(value: str) -> datetime:
    if not _AMZ_DATE_RE.fullmatch(value):
        raise _err("sigv4:malformed", "X-Amz-Date is malformed")
    try:
        return datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise _err("sigv4:malformed", "X-Amz-Date is malformed") from None


def _header_timestamp(req: Request, signed: list[str]) -> str:
    """The request timestamp (``YYYYMMDDTHHMMSSZ``) of a header-signed request."""
    amz = _one_header(req, "x-amz-date", "sigv4:malformed", required=False)
    if amz is not None:
        if "x-amz-date" not in signed:
            raise _err("sigv4:malformed", "X-Amz-Date must be a signed header")
        amz = amz.strip()
        _parse_amz_date(amz)
        return amz
    date = _one_header(req, "date", "sigv4:malformed", required=False)
    if date is None:
        raise _err("sigv4:malformed", "a SigV4 request needs X-Amz-Date or Date")
    if "date" not in signed:
        raise _err("sigv4:malformed", "Date must be a signed header")
    from email.utils import parsedate_to_datetime

    try:
        dt = parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError, OverflowError):
        raise _err("sigv4:malformed", "Date header is malformed") from None
    if dt is None:
        raise _err("sigv4:malformed", "Date header is malformed")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    try:
        return dt.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    except (ValueError, OverflowError):
        raise _err("sigv4:malformed", "Date header is malformed") from None


class _SignedHeaderMap:
    """The minimal mapping botocore's ``canonical_headers`` / ``signed_headers`` read."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, list[str]]) -> None:
        self._values = values

    def __iter__(self):
        return iter(self._values)

    def __contains__(self, name) -> bool:
        return name in self._values

    def get_all(self, name, failobj=None):
        return self._values.get(name, failobj)


def _signed_header_values(req: Request, signed: list[str]) -> _SignedHeaderMap:
    values: dict[str, list[str]] = {}
    url_host = _host_from_url(req.url)
    hosts = req.header_values("host")
    if len(hosts) > 1 or (hosts and _norm_host(hosts[0]) != _norm_host(url_host)):
        raise _err("sigv4:malformed", "the Host header does not match the request URL")
    for name in signed:
        vals = req.header_values(name)
        if not vals and name == "host":
            vals = [url_host]
        if not vals:
            raise _err("sigv4:malformed", "a header named in SignedHeaders is missing")
        for v in vals:
            if any(c in v for c in "\r\n\x00") or not _utf8_ok(v):
                raise _err("sigv4:malformed", "a signed header value contains a control character")
        values[name] = vals
    return _SignedHeaderMap(values)


def _payload_hash(req: Request, service: str, *, presigned: bool, allow_unsigned: bool) -> str:
    declared = _one_header(req, "x-amz-content-sha256", "sigv4:malformed", required=False)
    if declared is None:
        if presigned and service in _S3_SERVICES:
            return UNSIGNED_PAYLOAD
        return hashlib.sha256(req.body).hexdigest()
    if _HEX64_RE.fullmatch(declared):
        if not hmac.compare_digest(declared.lower(), hashlib.sha256(req.body).hexdigest()):
            raise _err("sigv4:bad-signature", "x-amz-content-sha256 does not match the body")
        return declared
    if declared == UNSIGNED_PAYLOAD:
        if presigned or allow_unsigned:
            return declared
        raise _err("sigv4:unsupported", "UNSIGNED-PAYLOAD requests are not re-signed")
    if declared == STREAMING_UNSIGNED_TRAILER:
        if allow_unsigned:
            return declared
        raise _err("sigv4:unsupported", "unsigned streaming payloads are not re-signed")
    if declared.startswith("STREAMING-"):
        raise _err("sigv4:unsupported", "chunk-signed streaming payloads are not supported")
    raise _err("sigv4:malformed", "x-amz-content-sha256 is malformed")


@functools.lru_cache(maxsize=None)
def _signer_classes():
    """botocore's SigV4 signers, steered to sign the request *as received*."""
    from botocore.auth import S3SigV4Auth, SigV4Auth

    class _AsReceived:
        # Set per use: what the agent signed, instead of botocore's own choices.
        _headers: _SignedHeaderMap
        _query: str
        _payload: str

        def headers_to_sign(self, request):
            return self._headers

        def canonical_query_string(self, request):
            return self._query

        def payload(self, request):
            return self._payload

    class Generic(_AsReceived, SigV4Auth):
        pass

    class S3(_AsReceived, S3SigV4Auth):
        pass

    return Generic, S3


def _sigv4_resign(
    req: Request,
    scope: _Scope,
    timestamp: str,
    headers: _SignedHeaderMap,
    queries: list[str],
    payload: str,
    agent_sig: str,
    placeholder_secret: str,
    real_secret: str,
) -> str | None:
    """The real-key signature of the canonical form (one per candidate canonical query) whose
    placeholder-key signature equals ``agent_sig``; ``None`` when none does."""
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    generic, s3 = _signer_classes()
    cls = s3 if scope.service in _S3_SERVICES else generic
    signer = cls(Credentials(scope.akid, placeholder_secret), scope.service, scope.region)
    signer._headers, signer._payload = headers, payload
    # No headers on the AWSRequest: botocore must not pick anything up by itself (it would
    # otherwise prefer an X-Amz-Content-SHA256 header over payload()).
    areq = AWSRequest(method=req.method, url=req.url, headers={}, data=b"")
    areq.context["timestamp"] = timestamp
    for query in queries:
        signer._query = query
        string_to_sign = signer.string_to_sign(areq, signer.canonical_request(areq))
        signer.credentials = Credentials(scope.akid, placeholder_secret)
        if hmac.compare_digest(signer.signature(string_to_sign, areq), agent_sig.lower()):
            signer.credentials = Credentials(scope.akid, real_secret)
            return signer.signature(string_to_sign, areq)
    return None


def _now_utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        return now.replace(tzinfo=timezone.utc)
    return now


def resign_sigv4(
    req: Request,
    *,
    access_key_id: str,
    placeholder_secret: str,
    real_secret: str,
    now: datetime | None = None,
    max_skew: timedelta = timedelta(minutes=15),
    allow_unsigned_payload: bool = False,
) -> Request:
    """Verify the agent's SigV4 signature made with ``placeholder_secret``; re-sign with ``real_secret``.

    Header form: the returned request differs only in the ``Signature=`` of ``Authorization``.
    Presigned form: only the ``X-Amz-Signature`` query value of ``url`` differs.
    Raises :class:`SigningError` (``sigv4:missing|malformed|wrong-key|expired|bad-signature|
    unsupported``).
    """
    try:
        prefix, path, query = _split_url(req.url)
    except ValueError:
        raise _err("sigv4:malformed", "request URL is not absolute") from None
    if "#" in req.url or not _utf8_ok(req.url) or not _utf8_ok(req.method):
        raise _err("sigv4:malformed", "request URL or method is malformed")
    if not (_utf8_ok(placeholder_secret) and _utf8_ok(real_secret)):
        # (checked here: botocore's UnicodeEncodeError would carry the secret in .object)
        raise _err("sigv4:config", "a secret key is not valid UTF-8 text")
    pairs = _query_segments(query)
    decoded_names = [_qdecode(k) for k, _ in pairs]
    auths = req.header_values("authorization")
    presigned = "X-Amz-Signature" in decoded_names
    if auths and presigned:
        raise _err("sigv4:malformed", "both an Authorization header and a presigned signature")
    now_dt = _now_utc(now)

    if presigned:
        params: dict[str, str] = {}
        for name, (_, raw_v) in zip(decoded_names, pairs):
            if name in _PRESIGN_PARAMS:
                if name in params:
                    raise _err("sigv4:malformed", "a presigned URL parameter is repeated")
                params[name] = _qdecode(raw_v)
        if len(params) != len(_PRESIGN_PARAMS):
            raise _err("sigv4:malformed", "a presigned URL parameter is missing")
        if params["X-Amz-Algorithm"] != _ALGORITHM:
            if params["X-Amz-Algorithm"] == "AWS4-ECDSA-P256-SHA256":
                raise _err("sigv4:unsupported", "SigV4a (ECDSA) signatures cannot be re-signed")
            raise _err("sigv4:malformed", "presigned URL algorithm is not AWS4-HMAC-SHA256")
        scope = _parse_credential(params["X-Amz-Credential"])
        signed = _parse_signed_headers(params["X-Amz-SignedHeaders"])
        agent_sig = params["X-Amz-Signature"]
        if not _SIG_RE.fullmatch(agent_sig):
            raise _err("sigv4:malformed", "SigV4 signature is malformed")
        timestamp = params["X-Amz-Date"]
        expires_raw = params["X-Amz-Expires"]
        if not (expires_raw.isascii() and expires_raw.isdigit() and len(expires_raw) <= 7):
            raise _err("sigv4:malformed", "X-Amz-Expires is malformed")
        expires = int(expires_raw)
        if not 1 <= expires <= _MAX_PRESIGN_EXPIRES:
            raise _err("sigv4:expires-too-long",
                       f"X-Amz-Expires {expires} is over the {_MAX_PRESIGN_EXPIRES} s a presigned URL the gate signs with "
                       f"a real key may live (ExpiresIn={_MAX_PRESIGN_EXPIRES} or less)")
    else:
        if not auths:
            raise _err("sigv4:missing", "the request carries no SigV4 signature")
        if len(auths) > 1:
            raise _err("sigv4:malformed", "more than one Authorization header")
        auth_value = auths[0]
        scope, signed, agent_sig = _parse_authorization(auth_value)
        timestamp = _header_timestamp(req, signed)
        expires = None

    if scope.akid != access_key_id:
        raise _err("sigv4:wrong-key", "the request is signed for another access key id")
    ts = _parse_amz_date(timestamp)
    if timestamp[:8] != scope.date:
        raise _err("sigv4:malformed", "credential scope date differs from the request date")
    if expires is None:
        if abs(now_dt - ts) > max_skew:
            raise _err("sigv4:expired", "the request date is outside the allowed clock skew")
    else:
        if ts - now_dt > max_skew or now_dt > ts + timedelta(seconds=expires):
            raise _err("sigv4:expired", "the presigned URL is expired or not yet valid")

    headers = _signed_header_values(req, signed)
    payload = _payload_hash(req, scope.service, presigned=presigned, allow_unsigned=allow_unsigned_payload)
    # Canonical query candidates: spec-normalized (decode, re-encode the RFC 3986 way: what
    # AWS computes) and botocore's as-sent form (raw pairs, sorted). They coincide for what
    # SDKs send; the one the agent used is the one re-signed.
    if presigned:
        kept = [p for p, n in zip(pairs, decoded_names) if n != "X-Amz-Signature"]
        raw = [s for s in query.split("&") if not (s and _qdecode(s.partition("=")[0]) == "X-Amz-Signature")]
    else:
        kept, raw = pairs, (query.split("&") if query else [])
    queries = [_canonical_query(kept)]
    as_sent = "&".join(f"{k}={v}" for k, v in sorted(s.partition("=")[::2] for s in raw))
    if as_sent != queries[0]:
        queries.append(as_sent)

    session = getattr(real_secret, "session_token", None)
    if session is not None:
        # a brokered aws-sts credential: the agent's request must carry no session token of its
        # own; the gate signs with the session's key id, secret and token
        if req.header_values("x-amz-security-token") or any(n.lower() == "x-amz-security-token" for n in decoded_names):
            raise _err("sigv4:malformed", "the request carries its own session token")
    try:
        real_sig = _sigv4_resign(
            req, scope, timestamp, headers, queries, payload, agent_sig, placeholder_secret, real_secret
        )
    except ImportError:
        raise _err("sigv4:unavailable", "botocore is required to re-sign SigV4 requests") from None
    if real_sig is None:
        raise _err("sigv4:bad-signature", "the SigV4 signature does not verify with the placeholder key")
    if session is not None:
        return _sign_session(req, scope, timestamp, signed, payload, presigned, prefix, path, pairs, decoded_names,
                             real_secret)

    if presigned:
        segs = query.split("&")
        for i, seg in enumerate(segs):
            k, sep, _ = seg.partition("=")
            if seg and _qdecode(k) == "X-Amz-Signature":
                segs[i] = f"{k}={real_sig}"
        return Request(req.method, prefix + path + "?" + "&".join(segs), list(req.headers), req.body)

    old = "Signature=" + agent_sig
    new_auth = auth_value.replace(old, "Signature=" + real_sig, 1)
    new_headers = [(k, new_auth if k.lower() == "authorization" else v) for k, v in req.headers]
    return Request(req.method, req.url, new_headers, req.body)


def _sign_session(req: Request, scope: _Scope, timestamp: str, signed: list[str], payload: str, presigned: bool,
                  prefix: str, path: str, pairs: list[tuple[str, str]], decoded_names: list[str], key) -> Request:
    """The request (whose placeholder signature verified) signed with an STS session instead:
    ``key`` is a session's secret key with ``access_key_id`` and ``session_token``
    (:class:`agentvm.gate.brokers.SessionKey`). The session token is added - to the signed
    headers (header form) or the signed query (presigned) - and the credential scope names the
    session's key id; the timestamp, payload hash and everything else the agent signed stay."""
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    akid, token = key.access_key_id, key.session_token
    if not (_AKID_RE.fullmatch(akid) and _utf8_ok(token) and not any(c in token for c in "\r\n\x00")):
        raise _err("sigv4:config", "the session credentials are malformed")
    new_scope = f"{akid}/{scope.date}/{scope.region}/{scope.service}/aws4_request"
    generic, s3 = _signer_classes()
    cls = s3 if scope.service in _S3_SERVICES else generic
    signer = cls(Credentials(akid, str(key), token), scope.service, scope.region)
    signer._payload = payload
    areq = AWSRequest(method=req.method, url=req.url, headers={}, data=b"")
    areq.context["timestamp"] = timestamp
    if presigned:
        segs = []
        for (k, v), n in zip(pairs, decoded_names):
            if n == "X-Amz-Signature":
                continue
            if n == "X-Amz-Credential":
                v = quote(new_scope, safe="-_.~")
            segs.append((k, v))
        segs.append(("X-Amz-Security-Token", quote(token, safe="-_.~")))
        signer._headers = _signed_header_values(req, signed)
        signer._query = _canonical_query(segs)
        sig = signer.signature(signer.string_to_sign(areq, signer.canonical_request(areq)), areq)
        query = "&".join(f"{k}={v}" for k, v in segs) + f"&X-Amz-Signature={sig}"
        return Request(req.method, prefix + path + "?" + query, list(req.headers), req.body)
    new_signed = sorted(set(signed) | {"x-amz-security-token"})
    headers = [(k, v) for k, v in req.headers if k.lower() != "authorization"] + [("X-Amz-Security-Token", token)]
    with_token = Request(req.method, req.url, headers, req.body)
    signer._headers = _signed_header_values(with_token, new_signed)
    _, _, query = _split_url(req.url)
    signer._query = _canonical_query(_query_segments(query))
    sig = signer.signature(signer.string_to_sign(areq, signer.canonical_request(areq)), areq)
    auth = f"{_ALGORITHM} Credential={new_scope}, SignedHeaders={';'.join(new_signed)}, Signature={sig}"
    out = []
    for k, v in req.headers:
        out.append((k, auth) if k.lower() == "authorization" else (k, v))
    out.append(("X-Amz-Security-Token", token))
    return Request(req.method, req.url, out, req.body)


# --------------------------------------------------------------------------- HMAC

_HMAC_ALGORITHMS = {"sha1": hashlib.sha1, "sha256": hashlib.sha256, "sha512": hashlib.sha512}
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_HEADER_NAME_ANY = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def _wire_bytes(s: str) -> bytes:
    """A request-derived string back to its wire bytes (the gate decodes headers as latin-1)."""
    try:
        return s.encode("latin-1")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=256)
def _parse_template(template: str) -> tuple[tuple[str, str], ...]:
    """``(kind, value)`` parts: ``("lit", text)``, ``("method"|"path"|"timestamp"|"body", "")``,
    ``("header", NAME)``. ``{{``/``}}`` are literal braces. Raises ValueError."""
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in _TEMPLATE_TOKEN.finditer(template):
        if m.start() > pos:
            parts.append(("lit", template[pos : m.start()]))
        tok = m.group(0)
        if tok == "{{":
            parts.append(("lit", "{"))
        elif tok == "}}":
            parts.append(("lit", "}"))
        elif m.group(1) is None:
            raise ValueError("unbalanced brace")
        else:
            name = m.group(1)
            if name in ("method", "path", "timestamp", "body"):
                parts.append((name, ""))
            elif name.startswith("header:") and _HEADER_NAME_ANY.fullmatch(name[7:]):
                parts.append(("header", name[7:]))
            else:
                raise ValueError("unknown placeholder")
        pos = m.end()
    if pos < len(template):
        parts.append(("lit", template[pos:]))
    return tuple(parts)


def _path_and_query(url: str) -> str:
    """The request target as sent: path plus ``?query`` (no fragment)."""
    url = url.partition("#")[0]
    prefix, _, _ = _split_url(url)
    target = url[len(prefix) :]
    return target if target.startswith("/") else "/" + target


def hmac_message(req: Request, cfg) -> bytes:
    """The bytes the generic HMAC scheme signs for ``req`` (see :func:`resign_hmac`)."""
    try:
        parts = _parse_template(cfg.message)
    except (ValueError, TypeError):
        raise _err("hmac:config", "hmac.message template is invalid") from None
    out = bytearray()
    for kind, val in parts:
        if kind == "lit":
            out += val.encode("utf-8", "surrogatepass")
        elif kind == "method":
            out += _wire_bytes(req.method)
        elif kind == "path":
            try:
                out += _wire_bytes(_path_and_query(req.url))
            except ValueError:
                raise _err("hmac:malformed", "request URL is not absolute") from None
        elif kind == "body":
            out += req.body
        elif kind == "timestamp":
            if not getattr(cfg, "timestamp_header", None):
                raise _err("hmac:config", "hmac.message uses {timestamp} but timestamp_header is not set")
            out += _wire_bytes(_one_header(req, cfg.timestamp_header, "hmac:malformed", required=True))
        else:  # header
            out += _wire_bytes(_one_header(req, val, "hmac:malformed", required=True))
    return bytes(out)


def _encode_sig(digest: bytes, encoding: str, upper: bool = False) -> str:
    if encoding == "hex":
        h = digest.hex()
        return h.upper() if upper else h
    return base64.b64encode(digest).decode("ascii")


def resign_hmac(req: Request, cfg, *, placeholder: str, real: str) -> Request:
    """Verify and re-sign a generic HMAC signature (``spec.models.HmacSigning``, duck-typed).

    The message is bytes: the template's literal text encoded UTF-8, ``{method}``, ``{path}``
    (path and query exactly as sent), ``{timestamp}`` (the value of ``cfg.timestamp_header``)
    and ``{header:NAME}`` as their wire bytes (latin-1, the way the gate decodes them; UTF-8
    for characters beyond latin-1), and ``{body}`` as the raw body bytes. ``{{``/``}}`` are
    literal braces. Header lookups are case-insensitive; a repeated header is refused.

    The key is the secret's UTF-8 bytes. The header named ``cfg.header`` must occur once and
    match ``cfg.format`` (one ``{}``) around a hex (either case) or standard base64 digest;
    the agent's digest is compared in constant time with the placeholder's, then the header
    value is replaced by ``cfg.format`` around the real digest (hex keeps the agent's case).
    Raises :class:`SigningError` ``hmac:config|missing|malformed|bad-signature``.
    """
    algorithm = getattr(cfg, "algorithm", None)
    encoding = getattr(cfg, "encoding", None)
    fmt = getattr(cfg, "format", None)
    header = getattr(cfg, "header", None)
    if algorithm not in _HMAC_ALGORITHMS or encoding not in ("hex", "base64"):
        raise _err("hmac:config", "hmac.algorithm or hmac.encoding is not supported")
    if not isinstance(fmt, str) or fmt.count("{}") != 1 or not isinstance(header, str) or not header:
        raise _err("hmac:config", "hmac.format needs exactly one '{}' and hmac.header a name")
    if not isinstance(getattr(cfg, "message", None), str):
        raise _err("hmac:config", "hmac.message template is invalid")

    vals = req.header_values(header)
    if not vals:
        raise _err("hmac:missing", "the request carries no signature header")
    if len(vals) > 1:
        raise _err("hmac:malformed", "more than one signature header")
    value = vals[0].strip(" \t")
    before, _, after = fmt.partition("{}")
    if len(value) < len(before) + len(after) or not value.startswith(before) or not value.endswith(after):
        raise _err("hmac:malformed", "signature header does not match the configured format")
    sig_text = value[len(before) : len(value) - len(after)]
    digest_size = _HMAC_ALGORITHMS[algorithm]().digest_size
    try:
        if encoding == "hex":
            if not re.fullmatch(r"[0-9a-fA-F]+", sig_text):
                raise ValueError
            agent_digest = bytes.fromhex(sig_text)
        else:
            agent_digest = base64.b64decode(sig_text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError, binascii.Error):
        raise _err("hmac:malformed", "signature is not valid hex/base64") from None
    if len(agent_digest) != digest_size:
        raise _err("hmac:malformed", "signature has the wrong length")

    message = hmac_message(req, cfg)
    digestmod = _HMAC_ALGORITHMS[algorithm]
    expected = hmac.new(placeholder.encode("utf-8", "surrogatepass"), message, digestmod).digest()
    if not hmac.compare_digest(expected, agent_digest):
        raise _err("hmac:bad-signature", "the HMAC signature does not verify with the placeholder key")
    real_digest = hmac.new(real.encode("utf-8", "surrogatepass"), message, digestmod).digest()
    upper = encoding == "hex" and sig_text == sig_text.upper() and sig_text != sig_text.lower()
    new_value = fmt.replace("{}", _encode_sig(real_digest, encoding, upper), 1)
    lname = header.lower()
    new_headers = [(k, new_value if k.lower() == lname else v) for k, v in req.headers]
    return Request(req.method, req.url, new_headers, req.body)


# a signature-like token: what re-signing changes (hex, base64, base64url, percent-encoded)
_TOKEN = re.compile(r"[A-Za-z0-9+/_%-]{16,}={0,2}")


def derived(before: list[str], after: list[str]) -> list[tuple[bytes, bytes]]:
    """The tokens re-signing changed, as (what the gate made with the real key, what the agent
    sent in its place) pairs: a signature, a presigned URL's ``X-Amz-Signature``. Each is a
    capability made with the real key - an upstream that echoes the request would hand it to
    the sandbox (review 8) - so the response is scrubbed of it like of a real value.
    ``before``/``after``: the target and the values of the headers both requests carry, in
    the same order."""
    out: list[tuple[bytes, bytes]] = []
    for a, b in zip(before, after):
        if a == b:
            continue
        ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
        if len(ta) == len(tb):
            out += [(y.encode("latin-1"), x.encode("latin-1")) for x, y in zip(ta, tb) if x != y]
        else:  # (a token added - a session's: scrubbed by its broker) the changed ones by value
            old = set(ta)
            out += [(y.encode("latin-1"), b"x" * len(y)) for y in tb if y not in old]
    return out
