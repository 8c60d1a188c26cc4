"""Brokered credentials: the gate obtains and refreshes a short-lived credential itself, from a
long-lived secret that never leaves it.

A credential with a ``broker`` in the agent file has a vault entry that is a JSON object (the
long-lived secret and where to use it); the sandbox gets a placeholder as for any credential,
and what the gate swaps in (or signs with) is a *minted* credential:

* ``oauth2-refresh`` - ``{"tokenUrl", "clientId", "clientSecret", "refreshToken",
  "revocationUrl"?, "clientAuth"?: "basic"|"post"}``: the refresh grant (RFC 6749 section 6)
  with the agent file's ``scopes``; the access token is swapped in; a rotated refresh token is
  written back to the vault; at session end and on revocation the access token is revoked at
  ``revocationUrl`` (RFC 7009) where the server has one.
* ``aws-sts`` - ``{"accessKeyId", "secretAccessKey", "region"?, "endpoint"?}``: STS
  ``AssumeRole`` (``roleArn``, an optional ``sessionPolicy`` that narrows it) or
  ``GetSessionToken``, for ``durationSeconds`` (default 900 s, the shortest STS allows); the
  gate re-signs SigV4 requests with the session credentials (signing.py) and adds the session
  token. STS has no way to revoke one session: revocation drops the cache, the gate stops
  signing, and the session expires by itself.
* ``github-app`` - ``{"appId", "installationId", "privateKey", "api"?}``: an RS256 app JWT
  (10 minutes) exchanged at ``POST /app/installations/{id}/access_tokens`` for an installation
  token limited to the agent file's ``repositories`` and ``permissions``; revoked with
  ``DELETE /installation/token``.

:class:`TokenCache` holds one binding's minted credential: fetched on first use (or
:meth:`TokenCache.prepare`), refreshed in the background once its remaining life is within
:func:`refresh_margin`, fetched again (synchronously, within :data:`TIMEOUT`) when it has
expired, dropped (and revoked upstream, in the background) when the credential is revoked.
A failure is a :class:`BrokerError` - a ``CredentialError`` with rule ``credential:unavailable``
and a reason that says what failed (an HTTP status, an OAuth ``error`` code, an AWS error code),
never a value - and is answered from memory for :data:`FAIL_BACKOFF` seconds, so an agent's
requests cannot make the gate hammer the issuer. Values never appear in exceptions, reprs or logs: only names.

The caches are per process (each gate worker mints its own).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable



class CredentialError(Exception):
    """A request breaks a credential rule. ``rule_id`` is what the 403 and the log carry.
    (Defined here, below ``agentvm.gate.credentials``, which re-exports it: the credential set
    builds on the brokers, never the other way round.)"""

    def __init__(self, rule_id: str, reason: str, *, name: str, where: str, alert: bool):
        super().__init__(reason)
        self.rule_id, self.reason, self.name, self.where, self.alert = rule_id, reason, name, where, alert

KINDS = ("oauth2-refresh", "aws-sts", "github-app")
TIMEOUT = 10.0  # seconds for one call to a token endpoint
MAX_RESPONSE = 256 * 1024  # bytes read of a token endpoint's answer
KEEP_OLD = 4  # previously minted values still scrubbed from responses
FAIL_BACKOFF = 5.0  # seconds a failed mint is answered from memory (requests never hammer the issuer)
_ERR_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class BrokerSpec:
    """The agent file's ``broker`` of one credential (policy, never a secret)."""

    kind: str
    scopes: tuple[str, ...] = ()
    role_arn: str | None = None
    session_policy: str | None = None
    duration: int = 900
    repositories: tuple[str, ...] = ()
    permissions: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_model(cls, m) -> "BrokerSpec":
        pol = getattr(m, "session_policy", None)
        if isinstance(pol, dict):
            pol = json.dumps(pol, sort_keys=True, separators=(",", ":"))
        return cls(kind=m.kind, scopes=tuple(getattr(m, "scopes", ()) or ()),
                   role_arn=getattr(m, "role_arn", None), session_policy=pol,
                   duration=int(getattr(m, "duration_seconds", 900) or 900),
                   repositories=tuple(getattr(m, "repositories", ()) or ()),
                   permissions=tuple(sorted((getattr(m, "permissions", None) or {}).items())))


@dataclass
class Minted:
    """One minted credential. ``value`` is what is swapped in (an access token; for aws-sts the
    session's secret key as a :class:`SessionKey`); ``secrets`` every minted text to scrub."""

    value: str
    expires: float  # time.time()
    lifetime: float
    secrets: tuple[str, ...] = ()
    revoke: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"Minted(expires={self.expires:.0f})"


class SessionKey(str):
    """An AWS session's secret access key (the str), with its access key id and session token:
    what :func:`agentvm.gate.signing.resign_sigv4` signs with when it is given one."""

    access_key_id: str
    session_token: str

    def __new__(cls, secret: str, access_key_id: str, session_token: str):
        s = super().__new__(cls, secret)
        s.access_key_id, s.session_token = access_key_id, session_token
        return s

    def __repr__(self) -> str:
        return "SessionKey(...)"

    __str__ = str.__str__


class BrokerError(CredentialError):
    """Minting failed: the request is denied with ``credential:unavailable`` and this reason."""

    def __init__(self, name: str, reason: str):
        super().__init__("credential:unavailable", f"credential {name!r}: {reason}", name=name, where="",
                         alert=False)


def refresh_margin(lifetime: float) -> float:
    """Refresh when this much life is left: a quarter of it, between 5 s and 5 minutes."""
    return min(300.0, max(5.0, lifetime / 4))


# -- HTTP to a token endpoint ---------------------------------------------------------------
def _check_url(url: str, what: str) -> str:
    u = urllib.parse.urlsplit(url)
    if u.scheme == "https" and u.hostname:
        return url
    if u.scheme == "http" and u.hostname:
        try:
            loop = ipaddress.ip_address(u.hostname).is_loopback
        except ValueError:
            loop = u.hostname == "localhost"
        if loop:
            return url
    raise ValueError(f"{what} must be an https:// URL (http:// only on loopback)")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx stays a 3xx (urllib raises it as an HTTPError) instead of being followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        return None


def _http(name: str, method: str, url: str, *, data: bytes | None = None, headers: dict | None = None,
          ca: str | None = None, what: str = "the token endpoint") -> tuple[int, dict]:
    """One call; -> (status, JSON object or {}). Raises BrokerError for a network failure."""
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    ctx = ssl.create_default_context(cafile=ca) if url.startswith("https:") else None
    # never follow a redirect: urllib would re-send the headers (the client's Basic auth, an
    # app's JWT) to wherever the Location points
    handlers = [_NoRedirect()] + ([urllib.request.HTTPSHandler(context=ctx)] if ctx is not None else [])
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=TIMEOUT) as r:
            status, body = r.status, r.read(MAX_RESPONSE)
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            raise BrokerError(name, f"{what} answered a redirect (HTTP {e.code}), which a broker never follows "
                                    "(its request carries credentials): configure the final URL") from None
        status, body = e.code, e.read(MAX_RESPONSE)
    except (OSError, ValueError) as e:
        raise BrokerError(name, f"{what} could not be reached ({type(e).__name__})") from None
    try:
        doc = json.loads(body) if body.strip() else {}
    except ValueError:
        doc = {}
    return status, doc if isinstance(doc, dict) else {}


def _err_code(doc: dict, *keys: str) -> str:
    """A short, safe error code from an answer (never free text, which might quote a value)."""
    for k in keys:
        v = doc.get(k)
        if isinstance(v, dict):
            v = v.get("Code") or v.get("code")
        if isinstance(v, str) and _ERR_CODE.fullmatch(v):
            return v
    return "no error code"


def _field(name: str, doc: dict, key: str) -> str:
    v = doc.get(key)
    if not isinstance(v, str) or not v:
        raise BrokerError(name, f"the vault entry has no {key!r} (a JSON object with it is expected)")
    return v


# -- the three kinds ------------------------------------------------------------------------
def _oauth2(name: str, spec: BrokerSpec, entry: dict, persist: Callable[[dict], None] | None) -> Minted:
    token_url = _check_url(_field(name, entry, "tokenUrl"), "tokenUrl")
    cid, secret, rt = _field(name, entry, "clientId"), _field(name, entry, "clientSecret"), _field(name, entry, "refreshToken")
    form = {"grant_type": "refresh_token", "refresh_token": rt}
    if spec.scopes:
        form["scope"] = " ".join(spec.scopes)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}
    if entry.get("clientAuth", "basic") == "post":
        form.update(client_id=cid, client_secret=secret)
    else:
        q = urllib.parse.quote
        headers["Authorization"] = "Basic " + base64.b64encode(f"{q(cid, safe='')}:{q(secret, safe='')}".encode()).decode()
    status, doc = _http(name, "POST", token_url, data=urllib.parse.urlencode(form).encode(), headers=headers,
                        ca=entry.get("ca"))
    if status != 200 or not isinstance(doc.get("access_token"), str) or not doc["access_token"]:
        raise BrokerError(name, f"the token endpoint refused the refresh grant (HTTP {status}, "
                                f"{_err_code(doc, 'error')})")
    if str(doc.get("token_type", "bearer")).lower() != "bearer":
        raise BrokerError(name, "the token endpoint answered a token type other than Bearer")
    access = doc["access_token"]
    try:
        lifetime = float(doc.get("expires_in", 3600))
    except (TypeError, ValueError):
        lifetime = 3600.0
    lifetime = max(1.0, min(lifetime, 86400.0))
    new_rt = doc.get("refresh_token")
    if isinstance(new_rt, str) and new_rt and new_rt != rt:
        # rotation (OAuth 2.1, RFC 9700 4.14): the old one is dead; keep the new one
        entry["refreshToken"] = new_rt
        if persist is not None:
            persist(entry)
    revoke = None
    rev_url = entry.get("revocationUrl")
    if isinstance(rev_url, str) and rev_url:
        _check_url(rev_url, "revocationUrl")

        def revoke() -> None:
            rform = {"token": access, "token_type_hint": "access_token"}
            rh = {"Content-Type": "application/x-www-form-urlencoded"}
            if entry.get("clientAuth", "basic") == "post":
                rform.update(client_id=cid, client_secret=secret)
            else:
                rh["Authorization"] = headers["Authorization"]
            _http(name, "POST", rev_url, data=urllib.parse.urlencode(rform).encode(), headers=rh, ca=entry.get("ca"),
                  what="the revocation endpoint")
    return Minted(access, time.time() + lifetime, lifetime, (access,), revoke)


def _aws_sts(name: str, spec: BrokerSpec, entry: dict, persist) -> Minted:
    akid, sk = _field(name, entry, "accessKeyId"), _field(name, entry, "secretAccessKey")
    region = entry.get("region") or "us-east-1"
    endpoint = entry.get("endpoint")
    if endpoint is not None:
        endpoint = _check_url(endpoint, "endpoint")
    try:
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise BrokerError(name, "botocore is needed for aws-sts") from None
    sess = botocore.session.Session()
    sess.set_config_variable("credentials_file", "/nonexistent")  # only the vault's key, never ~/.aws
    sess.set_config_variable("config_file", "/nonexistent")
    client = sess.create_client(
        "sts", region_name=region, endpoint_url=endpoint, aws_access_key_id=akid, aws_secret_access_key=sk,
        verify=entry.get("ca") or True,
        config=Config(connect_timeout=TIMEOUT, read_timeout=TIMEOUT, retries={"max_attempts": 1}))
    try:
        if spec.role_arn:
            kw = {"RoleArn": spec.role_arn, "RoleSessionName": entry.get("sessionName") or "agentvm",
                  "DurationSeconds": spec.duration}
            if spec.session_policy:
                kw["Policy"] = spec.session_policy
            out = client.assume_role(**kw)
        else:
            out = client.get_session_token(DurationSeconds=spec.duration)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        code = code if _ERR_CODE.fullmatch(code or "") else "no error code"
        raise BrokerError(name, f"STS refused {'AssumeRole' if spec.role_arn else 'GetSessionToken'} ({code})") from None
    except (BotoCoreError, OSError) as e:
        raise BrokerError(name, f"STS could not be reached ({type(e).__name__})") from None
    finally:
        client.close()
    c = out.get("Credentials") or {}
    try:
        key = SessionKey(c["SecretAccessKey"], c["AccessKeyId"], c["SessionToken"])
        exp = c["Expiration"]
        expires = exp.timestamp() if hasattr(exp, "timestamp") else float(exp)
    except (KeyError, TypeError, ValueError):
        raise BrokerError(name, "STS answered without session credentials") from None
    lifetime = max(1.0, expires - time.time())
    return Minted(key, expires, lifetime, (str(key), key.session_token))


def _b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def app_jwt(app_id: str, private_key_pem: str, now: float | None = None) -> str:
    """A GitHub App's JWT (RS256): issued 60 s in the past (clock drift), valid 9 minutes."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    now = int(time.time() if now is None else now)
    key = serialization.load_pem_private_key(private_key_pem.encode(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("a GitHub App key is an RSA key")
    head = _b64url(json.dumps({"alg": "RS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = _b64url(json.dumps({"iat": now - 60, "exp": now + 540, "iss": str(app_id)}, separators=(",", ":")).encode())
    sig = key.sign(f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{head}.{body}.{_b64url(sig)}"


def _github_app(name: str, spec: BrokerSpec, entry: dict, persist) -> Minted:
    api = _check_url((entry.get("api") or "https://api.github.com").rstrip("/"), "api")
    app_id, inst = str(entry.get("appId") or ""), str(entry.get("installationId") or "")
    if not app_id.isdigit() or not inst.isdigit():
        raise BrokerError(name, "the vault entry needs numeric 'appId' and 'installationId'")
    try:
        jwt = app_jwt(app_id, _field(name, entry, "privateKey"))
    except (ValueError, TypeError):
        raise BrokerError(name, "the vault entry's privateKey is not a PEM RSA private key") from None
    body: dict = {}
    if spec.repositories:
        body["repositories"] = list(spec.repositories)
    if spec.permissions:
        body["permissions"] = dict(spec.permissions)
    headers = {"Authorization": f"Bearer {jwt}", "Accept": "application/vnd.github+json",
               "X-GitHub-Api-Version": "2022-11-28", "Content-Type": "application/json", "User-Agent": "agent-vm"}
    status, doc = _http(name, "POST", f"{api}/app/installations/{inst}/access_tokens",
                        data=json.dumps(body).encode(), headers=headers, ca=entry.get("ca"), what="the GitHub API")
    tok = doc.get("token")
    if status != 201 or not isinstance(tok, str) or not tok:
        raise BrokerError(name, f"the GitHub API refused an installation token (HTTP {status})")
    # what it granted must not be wider than what was asked (an API that ignores the narrowing)
    got_perms = doc.get("permissions")
    if spec.permissions and isinstance(got_perms, dict) and set(got_perms) - {k for k, _ in spec.permissions}:
        raise BrokerError(name, "the GitHub API granted permissions that were not asked for")
    got_repos = doc.get("repositories")
    if spec.repositories and isinstance(got_repos, list):
        names = {r.get("name") for r in got_repos if isinstance(r, dict)}
        if names - set(spec.repositories):
            raise BrokerError(name, "the GitHub API granted repositories that were not asked for")
    try:
        from datetime import datetime

        expires = datetime.fromisoformat(str(doc.get("expires_at")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        expires = time.time() + 3600
    lifetime = max(1.0, expires - time.time())

    def revoke() -> None:
        _http(name, "DELETE", f"{api}/installation/token", ca=entry.get("ca"), what="the GitHub API",
              headers={"Authorization": f"token {tok}", "Accept": "application/vnd.github+json", "User-Agent": "agent-vm"})

    return Minted(tok, expires, lifetime, (tok, jwt), revoke)


MINTERS: dict[str, Callable[..., Minted]] = {"oauth2-refresh": _oauth2, "aws-sts": _aws_sts, "github-app": _github_app}


def long_lived_parts(kind: str, entry: dict) -> tuple[str, ...]:
    """The texts of a vault entry that are secret (scrubbed from responses like minted values)."""
    keys = {"oauth2-refresh": ("clientSecret", "refreshToken"), "aws-sts": ("secretAccessKey",),
            "github-app": ()}[kind]
    return tuple(v for k in keys if isinstance(v := entry.get(k), str) and len(v) >= 8)


REQUIRED = {"oauth2-refresh": ("tokenUrl", "clientId", "clientSecret", "refreshToken"),
            "aws-sts": ("accessKeyId", "secretAccessKey"),
            "github-app": ("appId", "installationId", "privateKey")}


def entry_problems(kind: str, text: str) -> list[str]:
    """What is wrong with ``text`` as the vault entry of a ``kind`` broker (names only, never a
    value); [] when nothing is."""
    try:
        doc = json.loads(text)
    except ValueError:
        return [f"a {kind} entry is a JSON object"]
    if not isinstance(doc, dict):
        return [f"a {kind} entry is a JSON object"]
    out = [f"no {k!r}" for k in REQUIRED[kind] if not doc.get(k)]
    for k in ("tokenUrl", "revocationUrl", "endpoint", "api"):
        if isinstance(doc.get(k), str):
            try:
                _check_url(doc[k], k)
            except ValueError as e:
                out.append(str(e))
    if kind == "github-app" and doc.get("privateKey"):
        try:
            app_jwt(str(doc.get("appId") or "0"), str(doc["privateKey"]))
        except (ValueError, TypeError):
            out.append("'privateKey' is not a PEM RSA private key")
    return out


# -- the cache ------------------------------------------------------------------------------
@dataclass
class TokenCache:
    """One binding's minted credential (thread-safe).

    ``raw()`` gives the vault entry's text (re-read each mint: a rotation in the vault is used by
    the next mint, and a changed entry drops what was minted from the old one); ``persist(text)``
    stores a changed entry (a rotated refresh token) back, or is None."""

    name: str
    spec: BrokerSpec
    raw: Callable[[], str]
    persist: Callable[[str], None] | None = None
    now: Callable[[], float] = time.time
    minter: Callable[..., Minted] | None = None
    current: Minted | None = field(default=None, repr=False)
    old: list = field(default_factory=list, repr=False)
    long_lived: tuple = field(default=(), repr=False)
    mints: int = 0  # how many times a value was minted (tests, metrics)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _refreshing: bool = False
    _raw_seen: str | None = field(default=None, repr=False)
    _epoch: int = 0  # bumped by drop(): a mint begun before it is not kept
    _failed: tuple | None = field(default=None, repr=False)  # (until, BrokerError) after a failed mint

    def __post_init__(self):
        if self.minter is None:
            self.minter = MINTERS[self.spec.kind]

    def _entry(self) -> dict:
        try:
            text = self.raw()
        except Exception as e:
            raise BrokerError(self.name, f"its vault entry could not be read ({type(e).__name__})") from None
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise BrokerError(self.name, f"its vault entry is not a JSON object (a {self.spec.kind} broker needs one)")
        if self._raw_seen is not None and text != self._raw_seen and self.current is not None:
            self._retire()  # the operator rotated the long-lived secret: nothing minted from the old one is used
        self._raw_seen = text
        self.long_lived = long_lived_parts(self.spec.kind, doc)
        return doc

    def _mint(self) -> Minted:
        epoch = self._epoch
        entry = self._entry()

        def persist(doc: dict) -> None:
            text = json.dumps(doc, separators=(",", ":"))
            self._raw_seen = text
            self.long_lived = long_lived_parts(self.spec.kind, doc)
            if self.persist is not None:
                self.persist(text)

        m = self.minter(self.name, self.spec, entry, persist)
        m.expires = self.now() + m.lifetime  # (on this cache's clock)
        self.mints += 1
        if epoch != self._epoch:  # dropped (revoked) while minting: never used
            _revoke_quietly(m)
            raise BrokerError(self.name, "it was revoked while a token was being minted")
        return m

    def _retire(self) -> None:
        if self.current is not None:
            self.old = ([self.current] + self.old)[:KEEP_OLD]
            self.current = None

    def get(self) -> str:
        """The value to swap in now: cached; refreshed in the background near expiry; minted
        (waiting for it) when there is none or it has expired. Raises BrokerError."""
        now = self.now()
        m = self.current
        if m is not None and now < m.expires - 1.0:
            if now >= m.expires - refresh_margin(m.lifetime):
                self._refresh_in_background()
            return m.value
        with self._lock:
            m = self.current
            if m is not None and self.now() < m.expires - 1.0:
                return m.value
            if self._failed is not None and self.now() < self._failed[0]:
                raise self._failed[1]  # (the same reason, without asking the issuer again yet)
            self._retire()
            try:
                self.current = self._mint()
            except BrokerError as e:
                self._failed = (self.now() + FAIL_BACKOFF, e)
                raise
            self._failed = None
            return self.current.value

    def prepare(self) -> None:
        """Mint now if nothing valid is cached (call it off the event loop, at session start)."""
        self.get()

    def _refresh_in_background(self) -> None:
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True

        def run() -> None:
            try:
                with self._lock:
                    m = self._mint()
                    self._retire()
                    self.current = m
            except Exception:
                pass  # the current value is still valid; the next get() after expiry says why
            finally:
                self._refreshing = False

        threading.Thread(target=run, name=f"broker-refresh-{self.name}", daemon=True).start()

    def drop(self, *, revoke: bool = True, wait: bool = False) -> None:
        """Forget what was minted (revocation, session end); revoke it upstream where the kind
        can (in the background unless ``wait``)."""
        self._epoch += 1
        self._failed = None
        gone = [m for m in [self.current] + self.old if m is not None]
        self.current = None
        self.old = []
        if not revoke:
            return
        todo = [m for m in gone if m.revoke is not None and m.expires > self.now()]
        if not todo:
            return
        if wait:
            for m in todo:
                _revoke_quietly(m)
        else:
            threading.Thread(target=lambda: [_revoke_quietly(m) for m in todo], name=f"broker-revoke-{self.name}",
                             daemon=True).start()

    def scrub_values(self) -> list[str]:
        """Every minted text (current and recent) and the long-lived secret's parts: what a
        response must never carry into the sandbox. Never mints."""
        out: list[str] = []
        for m in [self.current] + self.old:
            if m is not None:
                out += [s for s in m.secrets if s]
        out += list(self.long_lived)
        return out


def _revoke_quietly(m: Minted) -> None:
    try:
        if m.revoke is not None:
            m.revoke()
    except Exception:
        pass
