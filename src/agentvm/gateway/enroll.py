"""Per-claim identities: a sandbox's proxy bridge obtains its own short-lived client
certificate from the gateway at claim time (docs/scale-out.md, "Per-claim identity").

Why this shape (and not a Secret per claim, or a CSR object in the cluster): a SandboxClaim
of agent-sandbox v1beta1 is served from a warm pool whose pods already run, all made from
one SandboxTemplate - so nothing in the pod spec can differ per claim. What a claim *can*
give its pod is metadata: ``spec.additionalPodMetadata.annotations``, which the controller
puts on the pod it hands the claim (a running pod's annotations can change) and which the
kubelet projects into a ``downwardAPI`` volume mounted **only into the bridge container**.
Through it the claim gives the bridge a **bootstrap token**:

    v1.<base64url(identity)>.<expiry unix s>.<nonce>.<HMAC-SHA256(enroll.key, "agentvm-enroll|v1|identity|expiry|nonce")>

bound to one identity (``agentvm://NAMESPACE/CLAIM``), valid for minutes, used once per
replica. The bridge makes its key pair itself (it never leaves the bridge's memory-backed
volume), sends a certificate signing request with the token to the gateway's enrollment port
(TLS, the gateway authenticated by its CA), and gets back a certificate for the token's
identity - the request's own names are ignored - signed by the gateway's **issuer** (an
intermediate of the gateway CA, name-constrained to the namespaces it serves; the root key
stays with the operator). Before it expires the bridge renews over mTLS with the certificate
it holds (no token). Enrolment and renewal are refused for an identity that is revoked or
mapped to no agent, so revoking a claim (``revoked.identities``) refuses its next request,
its renewal and any re-enrolment, while its siblings of the same template go on.

The token is not a long-lived secret: it names one claim, expires (default 30 minutes, so a
cold-started pod still enrols), and a replica refuses it a second time. Whoever can read the
pod's annotations (the namespace's operators) could use it within that window for the same
identity - never another one; a second enrolment of one token at another replica is visible
in that identity's audit chain. The agent's container does not mount the downward API
volume, has no service-account token, and cannot see the bridge's files.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import hashlib
import hmac
import json
import os
import secrets
import ssl
import time
from pathlib import Path

from agentvm.errors import ConfigError
from agentvm.gateway.identity import Identity

TOKEN_TTL = 1800.0  # seconds a bootstrap token is good for (a cold start, image pull included)
ENROLL_PORT = 8444
ANNOTATION = "agentvm.dev/enroll-token"
IDENTITY_ANNOTATION = "agentvm.dev/identity"
MAX_BODY = 16384
IO_TIMEOUT = 10.0
RENEW_AT = 2 / 3  # of a certificate's lifetime


def load_key(path: Path) -> bytes:
    """The enrolment HMAC key (``enroll.key``: 64 hex digits)."""
    try:
        text = Path(path).read_text().strip()
        key = bytes.fromhex(text)
    except FileNotFoundError:
        raise ConfigError(f"no enrolment key at {path}", hint="agentvm gateway issuer --dir CA --out DIR writes enroll.key",
                          code="gateway.ca-invalid") from None
    except ValueError:
        raise ConfigError(f"{path} is not an enrolment key (hex)", code="gateway.ca-invalid") from None
    if len(key) < 32:
        raise ConfigError(f"{path}: an enrolment key needs 32 bytes at least", code="gateway.ca-invalid")
    return key


def _mac(key: bytes, uri: str, exp: int, nonce: str) -> str:
    return hmac.new(key, f"agentvm-enroll|v1|{uri}|{exp}|{nonce}".encode(), hashlib.sha256).hexdigest()


def make_token(key: bytes, identity: Identity, *, ttl: float = TOKEN_TTL, now: float | None = None) -> str:
    exp = int((time.time() if now is None else now) + ttl)
    nonce = secrets.token_urlsafe(12)
    ident = base64.urlsafe_b64encode(identity.uri.encode()).decode().rstrip("=")
    return f"v1.{ident}.{exp}.{nonce}.{_mac(key, identity.uri, exp, nonce)}"


class Refused(Exception):
    def __init__(self, rule_id: str, reason: str) -> None:
        super().__init__(reason)
        self.rule_id, self.reason = rule_id, reason


def check_token(key: bytes, token: str, *, now: float | None = None) -> tuple[Identity, str, int]:
    """-> (identity, nonce, expiry) of a valid token, else :class:`Refused`."""
    try:
        v, ident, exp_s, nonce, mac = str(token).split(".")
        if v != "v1":
            raise ValueError
        uri = base64.urlsafe_b64decode(ident + "=" * (-len(ident) % 4)).decode()
        exp = int(exp_s)
        identity = Identity.parse(uri)
    except (ValueError, ConfigError, UnicodeDecodeError):
        raise Refused("enroll:token-invalid", "not a bootstrap token") from None
    if not hmac.compare_digest(_mac(key, uri, exp, nonce), mac):
        raise Refused("enroll:token-invalid", "the bootstrap token's signature does not verify")
    if (time.time() if now is None else now) > exp:
        raise Refused("enroll:token-expired", f"the bootstrap token of {uri} expired")
    return identity, nonce, exp


# -- the gateway's side -------------------------------------------------------------------------
def enroll_context(ca_dir: Path) -> ssl.SSLContext:
    """The enrolment listener: the gateway's server certificate; a client certificate is
    optional (a renewal presents one; a first enrolment has only its token)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(Path(ca_dir) / "server.pem", Path(ca_dir) / "server.key")
    ctx.load_verify_locations(cafile=str(Path(ca_dir) / "ca.pem"))
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


class Enroller:
    """``POST /v1/enroll`` {token, csr} and ``POST /v1/renew`` {csr} (over mTLS) on their own
    port of a gateway replica."""

    def __init__(self, gate, issuer, key: bytes, *, lifetime: float = 3600.0) -> None:
        self.gate, self.issuer, self.key, self.lifetime = gate, issuer, key, lifetime
        self.used: dict[str, int] = {}  # nonce -> expiry: a token is good once at this replica
        self.issued = 0

    def _admit(self, ident: Identity, serial: str | None):
        from agentvm.gateway.config import Refusal

        res = self.gate.registry.admit(ident, serial)
        if isinstance(res, Refusal):
            raise Refused(res.rule_id, res.reason)
        return res

    def _issue(self, ident: Identity, agent, csr: bytes, how: str) -> dict:
        try:
            chain, serial, not_after = self.issuer.sign_csr(csr, ident, lifetime=self.lifetime)
        except ConfigError as exc:
            raise Refused("enroll:csr-invalid", exc.message) from None
        self.issued += 1
        ep = self.gate._endpoint(ident, agent)  # the identity's own decision log (and audit chain) records it
        ep.log(verdict="allow", rule_id=f"identity:{how}", reason=f"certificate {serial:x} until {not_after.isoformat()}",
               host="", port=None, phase="identity")
        return {"identity": ident.uri, "certificate": chain.decode(), "ca": self.issuer.ca_pem.decode(),
                "serial": format(serial, "x"), "not_after": not_after.isoformat()}

    def handle(self, path: str, body: dict, peercert: dict | None) -> dict:
        from agentvm.gateway.identity import from_peercert

        csr = body.get("csr")
        if not isinstance(csr, str):
            raise Refused("enroll:csr-invalid", "no csr in the request")
        if path == "/v1/enroll":
            ident, nonce, exp = check_token(self.key, body.get("token", ""))
            now = time.time()
            for n, e in list(self.used.items()):
                if e < now:
                    del self.used[n]
            if nonce in self.used:
                raise Refused("enroll:token-used", f"this bootstrap token of {ident.uri} was used already")
            agent = self._admit(ident, None)
            self.used[nonce] = exp
            return self._issue(ident, agent, csr.encode(), "enrolled")
        if path == "/v1/renew":
            ident = from_peercert(peercert)
            if ident is None:
                raise Refused("identity:none", "a renewal needs the certificate it renews")
            agent = self._admit(ident, (peercert or {}).get("serialNumber"))
            return self._issue(ident, agent, csr.encode(), "renewed")
        raise Refused("enroll:not-found", f"no {path} here")

    def _refusal_record(self, exc: Refused, who: str | None) -> None:
        from agentvm.gateway.config import GATEWAY_LOG

        self.gate.emit({"time": round(time.time(), 6), "sandbox": GATEWAY_LOG, "identity": who, "phase": "enroll",
                        "rule": exc.rule_id, "verdict": "deny", "reason": exc.reason})

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        status, out, who = 200, {}, None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _v = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            n = int(headers.get("content-length", "0"))
            if method != "POST" or not 0 < n <= MAX_BODY:
                raise Refused("enroll:bad-request", "POST a JSON body of at most 16 KiB")
            body = json.loads(await asyncio.wait_for(reader.readexactly(n), IO_TIMEOUT))
            if not isinstance(body, dict):
                raise Refused("enroll:bad-request", "the body is not a JSON object")
            ssl_obj = writer.get_extra_info("ssl_object")
            peer = ssl_obj.getpeercert() if ssl_obj is not None else None
            from agentvm.gateway.identity import from_peercert

            held_ident = from_peercert(peer)
            who = held_ident.uri if held_ident is not None else None  # (a refused renewal names its identity)
            out = self.handle(path, body, peer)
        except Refused as exc:
            status, out = 403, {"error": exc.rule_id, "reason": exc.reason}
            self._refusal_record(exc, who)
        except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            status, out = 400, {"error": "enroll:bad-request", "reason": "not an enrolment request"}
        except (ConnectionError, ssl.SSLError):
            writer.close()
            return
        data = json.dumps(out).encode()
        try:
            writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Refused'}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT)
        except (ConnectionError, ssl.SSLError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def listen(self, host: str, port: int, ctx: ssl.SSLContext) -> asyncio.AbstractServer:
        return await asyncio.start_server(self.serve_connection, host, port, ssl=ctx, ssl_handshake_timeout=IO_TIMEOUT,
                                          limit=MAX_BODY)


# -- the bridge's side ----------------------------------------------------------------------------
def read_annotation(path: Path, name: str = ANNOTATION) -> str | None:
    """A value from a downwardAPI ``metadata.annotations`` file (``key="value"`` lines, Go-quoted)."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and k == name:
            try:
                return json.loads(v)
            except ValueError:
                return v.strip('"')
    return None


def _csr() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            csr.public_bytes(serialization.Encoding.PEM))


def _post(addr: tuple[str, int], server_name: str, ctx: ssl.SSLContext, path: str, body: dict) -> tuple[int, dict]:
    import socket

    data = json.dumps(body).encode()
    with socket.create_connection(addr, timeout=IO_TIMEOUT) as raw, ctx.wrap_socket(raw, server_hostname=server_name) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {server_name}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        buf = b""
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
            if len(buf) > 1 << 20:
                break
    head, _, rest = buf.partition(b"\r\n\r\n")
    try:
        return int(head.split()[1]), json.loads(rest or b"{}")
    except (IndexError, ValueError):
        return 502, {"error": "enroll:bad-response", "reason": head[:200].decode("latin-1")}


def current(out: Path) -> Path:
    """Where the files the bridge uses are: ``out/current`` (a link swapped whole on each
    enrolment or renewal) once it enrolled; ``out`` itself for a mounted Secret."""
    c = Path(out) / "current"
    return c if c.is_dir() else Path(out)


def _store(out: Path, key_pem: bytes, got: dict) -> dict:
    """tls.key (0600), tls.crt (the chain), ca.crt and identity.json in a new directory of
    ``out``, then ``out/current`` pointed at it in one rename: the bridge, which reads them per
    connection, never pairs a new certificate with an old key."""
    from agentvm.gateway.ca import _write

    out.mkdir(parents=True, exist_ok=True)
    gen = out / f"gen-{got['serial']}"
    gen.mkdir(mode=0o700, exist_ok=True)
    _write(gen / "tls.key", key_pem, 0o600)
    _write(gen / "tls.crt", got["certificate"].encode(), 0o644)
    _write(gen / "ca.crt", got["ca"].encode(), 0o644)
    (gen / "identity.json").write_text(json.dumps({k: got[k] for k in ("identity", "serial", "not_after")}))
    link = out / "current.new"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(gen.name, link)
    old = os.readlink(out / "current") if (out / "current").is_symlink() else None
    os.replace(link, out / "current")
    if old and old != gen.name:
        import shutil

        shutil.rmtree(out / old, ignore_errors=True)
    return got


def enroll(addr: tuple[str, int], server_name: str, gateway_ca: Path, token: str, out: Path) -> dict:
    """First enrolment with a bootstrap token: the key is made here and never sent."""
    key_pem, csr = _csr()
    ctx = ssl.create_default_context(cafile=str(gateway_ca))
    status, got = _post(addr, server_name, ctx, "/v1/enroll", {"token": token, "csr": csr.decode()})
    if status != 200:
        raise Refused(got.get("error", "enroll:failed"), got.get("reason", f"HTTP {status}"))
    return _store(Path(out), key_pem, got)


def renew(addr: tuple[str, int], server_name: str, gateway_ca: Path, out: Path) -> dict:
    """Renewal over mTLS with the certificate held in ``out``: a new key, the same identity."""
    out = Path(out)
    key_pem, csr = _csr()
    ctx = ssl.create_default_context(cafile=str(gateway_ca))
    ctx.load_cert_chain(str(current(out) / "tls.crt"), str(current(out) / "tls.key"))
    status, got = _post(addr, server_name, ctx, "/v1/renew", {"csr": csr.decode()})
    if status != 200:
        raise Refused(got.get("error", "enroll:failed"), got.get("reason", f"HTTP {status}"))
    return _store(out, key_pem, got)


def held(out: Path) -> dict | None:
    """The identity the bridge holds in ``out`` if its certificate is still valid."""
    try:
        d = json.loads((current(out) / "identity.json").read_text())
        if _dt.datetime.fromisoformat(d["not_after"]).timestamp() > time.time() + 30:
            return d
    except (FileNotFoundError, ValueError, KeyError):
        pass
    return None


async def keep_enrolled(addr: tuple[str, int], server_name: str, gateway_ca: Path, token_file: Path, out: Path, *,
                        poll: float = 1.0, log=print, stop: asyncio.Event | None = None) -> None:
    """The bridge's enrolment loop: wait for the claim's token (a warm pod waits here until
    claimed), enrol, then renew at 2/3 of each certificate's life. A refusal (revoked,
    unknown, token used) is logged and retried later; the bridge answers 502 meanwhile."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        cur = held(out)
        try:
            if cur is None:
                token = read_annotation(token_file)
                if not token:
                    await _sleep(stop, poll)
                    continue
                cur = await asyncio.to_thread(enroll, addr, server_name, gateway_ca, token, out)
                log(f"enrolled as {cur['identity']} (certificate {cur['serial']} until {cur['not_after']})")
            else:
                life_end = _dt.datetime.fromisoformat(cur["not_after"]).timestamp()
                issued = os.stat(current(out) / "tls.crt").st_mtime
                wait = issued + (life_end - issued) * RENEW_AT - time.time()
                if wait > 0:
                    await _sleep(stop, min(wait, 60.0))
                    continue
                cur = await asyncio.to_thread(renew, addr, server_name, gateway_ca, out)
                log(f"renewed {cur['identity']} (certificate {cur['serial']} until {cur['not_after']})")
        except Refused as exc:
            log(f"enrolment refused: {exc.rule_id}: {exc.reason}")
            await _sleep(stop, 10.0)
        except (OSError, ssl.SSLError) as exc:
            log(f"enrolment failed: {exc}")
            await _sleep(stop, 5.0)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
