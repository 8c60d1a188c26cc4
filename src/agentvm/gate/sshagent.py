"""An ssh-agent served by the gate: SSH keys that never enter the sandbox.

The sandbox gets ``SSH_AUTH_SOCK`` pointing at a unix socket this module serves; the private
keys are vault entries (OpenSSH private key files), read by the gate only. Each signature is a
policy decision:

* The client must first bind the agent connection to the SSH session it authenticates
  (``session-bind@openssh.com``, sent by OpenSSH >= 8.9 after key exchange): the server's host
  key, the session identifier, and the host key's signature over that identifier - verified
  here, so the binding names the host that really holds that key.
* A key signs only for a bound host key that the agent file lists for it (``knownHosts``,
  known_hosts lines: ``host keytype base64``); anything else is refused (SSH_AGENT_FAILURE) and
  logged with the reason.
* What is signed must be an SSH ``publickey`` user-authentication request for that same session
  and that same key (RFC 4252 section 7): the agent is no signing oracle for other data (a git
  commit signature, an sshsig, a forged session).
* Forwarded bindings (``is_forwarding``), a second binding on one connection, and everything that
  would change the agent (add/remove keys, lock) are refused.

Limits: a message is at most :data:`MAX_MESSAGE` bytes (as OpenSSH's agent), at most
:data:`MAX_CONNECTIONS` connections at once, :data:`MAX_SIGNS` signatures per connection, and a
connection idle for :data:`IDLE_TIMEOUT` seconds is closed. Parsing is strict: a message with
trailing or missing bytes is refused.

:class:`AgentSession` is the sans-IO core (bytes in, bytes out, decisions logged);
:class:`SshAgentServer` serves it on a unix socket (asyncio); :func:`serve_in_thread` runs one
in a thread of its own (for a caller that has no event loop).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable

from agentvm.sshkeys import parse_known_host  # (the pure parser; re-exported here)

MAX_MESSAGE = 256 * 1024
MAX_CONNECTIONS = 16
MAX_SIGNS = 64
IDLE_TIMEOUT = 600.0

# message numbers (draft-miller-ssh-agent)
FAILURE, SUCCESS = 5, 6
REQUEST_IDENTITIES, IDENTITIES_ANSWER = 11, 12
SIGN_REQUEST, SIGN_RESPONSE = 13, 14
EXTENSION = 27
RSA_SHA2_256, RSA_SHA2_512 = 2, 4
USERAUTH_REQUEST = 50
HOSTBOUND = b"publickey-hostbound-v00@openssh.com"


class ProtocolError(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes):
        self.d, self.i = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.i + n > len(self.d):
            raise ProtocolError("truncated")
        out = self.d[self.i:self.i + n]
        self.i += n
        return out

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def byte(self) -> int:
        return self.take(1)[0]

    def string(self) -> bytes:
        return self.take(self.u32())

    def end(self) -> None:
        if self.i != len(self.d):
            raise ProtocolError("trailing bytes")


def _s(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _mpint(n: int) -> bytes:
    if n == 0:
        return _s(b"")
    b = n.to_bytes((n.bit_length() + 8) // 8, "big")  # a leading 0 when the top bit is set
    return _s(b)


def _msg(kind: int, body: bytes = b"") -> bytes:
    return struct.pack(">IB", len(body) + 1, kind) + body


def fingerprint(blob: bytes) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# -- keys -----------------------------------------------------------------------------------
@dataclass
class AgentKey:
    """One private key the agent holds (never leaves this process) and where it may sign."""

    name: str  # the credential's name
    private: object  # a cryptography private key
    blob: bytes  # the public key in SSH wire form
    comment: str
    allowed: dict = field(default_factory=dict)  # host key blob -> host name

    def __repr__(self) -> str:
        return f"AgentKey({self.name!r}, {fingerprint(self.blob)})"


def load_key(name: str, pem: str, known_hosts: list[str] | tuple[str, ...]) -> AgentKey:
    """An OpenSSH private key (unencrypted) and the known_hosts lines it may sign for."""
    from cryptography.hazmat.primitives import serialization

    try:
        priv = serialization.load_ssh_private_key(pem.encode(), password=None)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"credential {name!r}: the vault entry is not an unencrypted OpenSSH private key") from None
    pub = priv.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    kind, b64 = pub.split()[:2]
    blob = base64.b64decode(b64)
    allowed = {}
    for line in known_hosts:
        host, hkey = parse_known_host(line)
        allowed[hkey] = host
    return AgentKey(name, priv, blob, f"agent-vm:{name}", allowed)


def _public_from_blob(blob: bytes):
    from cryptography.hazmat.primitives import serialization

    kind = _Reader(blob).string()
    return serialization.load_ssh_public_key(kind + b" " + base64.b64encode(blob)), kind.decode()


def verify(blob: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` (SSH wire form) is the key ``blob``'s over ``data``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, utils

    try:
        key, kind = _public_from_blob(blob)
        r = _Reader(signature)
        alg, sig = r.string().decode(), r.string()
        r.end()
        if isinstance(key, ed25519.Ed25519PublicKey) and alg == "ssh-ed25519":
            key.verify(sig, data)
        elif isinstance(key, ec.EllipticCurvePublicKey) and alg == kind:
            h = {256: hashes.SHA256(), 384: hashes.SHA384(), 521: hashes.SHA512()}[key.curve.key_size]
            rr = _Reader(sig)
            rv, sv = int.from_bytes(rr.string(), "big"), int.from_bytes(rr.string(), "big")
            rr.end()
            key.verify(utils.encode_dss_signature(rv, sv), data, ec.ECDSA(h))
        elif isinstance(key, rsa.RSAPublicKey) and alg in ("rsa-sha2-256", "rsa-sha2-512"):
            key.verify(sig, data, padding.PKCS1v15(), hashes.SHA256() if alg == "rsa-sha2-256" else hashes.SHA512())
        else:
            return False
        return True
    except (InvalidSignature, ProtocolError, ValueError, KeyError, UnicodeDecodeError, TypeError):
        return False


def sign(key: AgentKey, data: bytes, flags: int) -> bytes:
    """``data`` signed with ``key``, in SSH wire form. RSA only with SHA-2 (never SHA-1)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, utils

    k = key.private
    if isinstance(k, ed25519.Ed25519PrivateKey):
        return _s(b"ssh-ed25519") + _s(k.sign(data))
    if isinstance(k, ec.EllipticCurvePrivateKey):
        bits = k.curve.key_size
        h = {256: hashes.SHA256(), 384: hashes.SHA384(), 521: hashes.SHA512()}[bits]
        r, s = utils.decode_dss_signature(k.sign(data, ec.ECDSA(h)))
        return _s(f"ecdsa-sha2-nistp{bits}".encode()) + _s(_mpint(r) + _mpint(s))
    if isinstance(k, rsa.RSAPrivateKey):
        if flags & RSA_SHA2_512:
            return _s(b"rsa-sha2-512") + _s(k.sign(data, padding.PKCS1v15(), hashes.SHA512()))
        if flags & RSA_SHA2_256:
            return _s(b"rsa-sha2-256") + _s(k.sign(data, padding.PKCS1v15(), hashes.SHA256()))
        raise ProtocolError("an RSA signature with SHA-1 (ssh-rsa) is refused")
    raise ProtocolError("unsupported key type")


# -- the sans-IO core -------------------------------------------------------------------------
@dataclass
class Decision:
    verdict: str  # "sign" | "refuse"
    key: str  # credential name ("" when the key is unknown)
    host: str  # the bound host's name as the agent file lists it, or its host key fingerprint, or ""
    reason: str


class AgentSession:
    """One connection to the agent: :meth:`feed` bytes, get the replies; ``log(Decision)`` is
    called for every signature asked for and every refused binding."""

    def __init__(self, keys: list[AgentKey], log: Callable[[Decision], None] | None = None,
                 revoked: Callable[[str], bool] | None = None):
        self.keys = {k.blob: k for k in keys}
        self.log = log or (lambda d: None)
        self.revoked = revoked  # name -> revoked now (the vault's and the operator's: asked at each sign)
        self.buf = b""
        self.session_id: bytes | None = None
        self.host_key: bytes | None = None
        self.poisoned = ""  # why this connection signs nothing any more
        self.signs = 0
        self.closed = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = b""
        while len(self.buf) >= 4 and not self.closed:
            n = struct.unpack(">I", self.buf[:4])[0]
            if n == 0 or n > MAX_MESSAGE:
                self.closed = True  # a length no agent message has: the connection ends
                break
            if len(self.buf) < 4 + n:
                break
            body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
            out += self._one(body)
        if len(self.buf) > MAX_MESSAGE + 4:
            self.closed = True
        return out

    def _one(self, body: bytes) -> bytes:
        kind, r = body[0], _Reader(body[1:])
        try:
            if kind == REQUEST_IDENTITIES:
                r.end()
                ids = b"".join(_s(k.blob) + _s(k.comment.encode()) for k in self.keys.values())
                return _msg(IDENTITIES_ANSWER, struct.pack(">I", len(self.keys)) + ids)
            if kind == SIGN_REQUEST:
                return self._sign(r)
            if kind == EXTENSION:
                return self._extension(r)
        except ProtocolError:
            return _msg(FAILURE)
        return _msg(FAILURE)  # add/remove/lock/smartcard...: this agent is read-only

    def _refuse(self, key: str, reason: str) -> bytes:
        self.log(Decision("refuse", key, self._host_name(), reason))
        return _msg(FAILURE)

    def _host_name(self) -> str:
        if self.host_key is None:
            return ""
        for k in self.keys.values():
            if self.host_key in k.allowed:
                return k.allowed[self.host_key]
        return fingerprint(self.host_key)

    def _extension(self, r: _Reader) -> bytes:
        name = r.string()
        if name != b"session-bind@openssh.com":
            return _msg(FAILURE)
        hostkey, sid, sig = r.string(), r.string(), r.string()
        forwarding = r.byte()
        r.end()
        if self.session_id is not None:
            self.poisoned = "a second session-bind on one agent connection"
            return self._refuse("", self.poisoned)
        if forwarding:
            self.poisoned = "a forwarded agent connection (agent forwarding is not offered)"
            return self._refuse("", self.poisoned)
        if not (1 <= len(sid) <= 128) or not verify(hostkey, sig, sid):
            self.poisoned = "a session-bind whose host key signature does not verify"
            return self._refuse("", self.poisoned)
        self.session_id, self.host_key = sid, hostkey
        return _msg(SUCCESS)

    def _sign(self, r: _Reader) -> bytes:
        blob, data, flags = r.string(), r.string(), r.u32()
        r.end()
        key = self.keys.get(blob)
        if key is None:
            return self._refuse("", "a key this agent does not hold")
        if self.poisoned:
            return self._refuse(key.name, self.poisoned)
        if self.revoked is not None:
            try:
                gone = bool(self.revoked(key.name))
            except Exception:  # (cannot tell: fail closed)
                gone = True
            if gone:
                return self._refuse(key.name, "the credential is revoked")
        if self.session_id is None:
            return self._refuse(key.name, "no session-bind@openssh.com before the sign request (OpenSSH >= 8.9 "
                                          "sends one; the host it signs for must be known)")
        if self.host_key not in key.allowed:
            return self._refuse(key.name, f"host key {fingerprint(self.host_key)} is not one the agent file lists "
                                          "for this key (knownHosts)")
        why = _userauth_problem(data, self.session_id, blob, self.host_key)
        if why:
            return self._refuse(key.name, why)
        if self.signs >= MAX_SIGNS:
            return self._refuse(key.name, f"over {MAX_SIGNS} signatures on one connection")
        try:
            sig = sign(key, data, flags)
        except ProtocolError as e:
            return self._refuse(key.name, str(e))
        self.signs += 1
        self.log(Decision("sign", key.name, key.allowed[self.host_key], "publickey authentication"))
        return _msg(SIGN_RESPONSE, _s(sig))


def _userauth_problem(data: bytes, session_id: bytes, blob: bytes, host_key: bytes) -> str:
    """Why ``data`` is not a publickey userauth request of this session for this key, or ''.
    Both ``publickey`` (RFC 4252) and OpenSSH's ``publickey-hostbound-v00@openssh.com`` (which
    ends with the server's host key: it must be the bound one)."""
    r = _Reader(data)
    try:
        if r.string() != session_id:
            return "what is to be signed is not for the bound session"
        if r.byte() != USERAUTH_REQUEST:
            return "what is to be signed is not a user authentication request"
        r.string()  # user
        service, method = r.string(), r.string()
        if service != b"ssh-connection" or method not in (b"publickey", HOSTBOUND) or r.byte() != 1:
            return "what is to be signed is not a publickey authentication"
        alg, kblob = r.string(), r.string()
        if method == HOSTBOUND and r.string() != host_key:
            return "what is to be signed names another host key than the bound one"
        r.end()
    except ProtocolError:
        return "what is to be signed is malformed"
    if kblob != blob:
        return "what is to be signed names another key"
    if not alg:
        return "what is to be signed names no algorithm"
    return ""


# -- serving ----------------------------------------------------------------------------------
class SshAgentServer:
    """The agent on a unix socket (mode 0600 unless ``mode`` says otherwise: the sandbox's user
    must be able to connect, e.g. through a bind mount of its directory)."""

    def __init__(self, path: str, keys: list[AgentKey], log: Callable[[Decision], None] | None = None,
                 mode: int = 0o600, revoked: Callable[[str], bool] | None = None):
        self.path, self.keys, self.log, self.mode, self.revoked = path, keys, log, mode, revoked
        self.server: asyncio.AbstractServer | None = None
        self.active = 0

    async def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.server = await asyncio.start_unix_server(self._client, path=self.path, limit=MAX_MESSAGE + 8)
        os.chmod(self.path, self.mode)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= MAX_CONNECTIONS:
            writer.close()
            return
        self.active += 1
        sess = AgentSession(self.keys, self.log, self.revoked)
        try:
            while not sess.closed:
                data = await asyncio.wait_for(reader.read(65536), IDLE_TIMEOUT)
                if not data:
                    break
                out = sess.feed(data)
                if out:
                    writer.write(out)
                    await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self.active -= 1
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def keys_for(bindings, value: Callable[[str], str]) -> list[AgentKey]:
    """The agent's keys for a session: every credential with ``ssh`` (its known hosts) whose
    vault value is its private key. Raises ValueError (naming the credential, never a value)."""
    return [load_key(b.name, value(b.name), b.ssh_known_hosts) for b in bindings
            if getattr(b, "ssh_known_hosts", None) is not None]


def serve_in_thread(path: str, keys: list[AgentKey], log=None, mode: int = 0o600, revoked=None):
    """Serve the agent from a thread with its own event loop; -> stop() (closes it, joins)."""
    loop = asyncio.new_event_loop()
    srv = SshAgentServer(path, keys, log, mode, revoked)
    ready = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, name="ssh-agent", daemon=True)
    t.start()
    if not ready.wait(10):
        raise RuntimeError("the ssh agent did not start")

    def stop():
        fut = asyncio.run_coroutine_threadsafe(srv.close(), loop)
        fut.result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)

    return stop


def session_agent(bindings, value: Callable[[str], str], directory: str, log=None, *, revoked=None,
                  owner: tuple[int, int] | None = None):
    """The agent of one sandbox session, for the launch to wire in: the session's ``ssh``
    credentials (``bindings``: CredentialBindings; ``value``: name -> vault value, as
    ``CredentialSet``'s) served at ``directory/agent.sock`` (the socket 0666, the directory the
    sandbox user's alone - see ``owner``: bind-mount the directory into the sandbox, read-only, and set each ssh credential's ``env``
    to the socket's path inside). -> ``(socket path, stop)``, or ``(None, None)`` without ssh
    credentials. ValueError names a credential whose vault value is no usable key.

    ``revoked(name)`` is asked at every signature (a revoked credential signs nothing more);
    ``owner`` (uid, gid): the sandbox's user, who alone may enter the directory (it is then
    0500 and theirs); without one the directory is 0700 (the sandbox runs as this process's
    user): no other user of the host reaches the socket."""
    keys = keys_for(bindings, value)
    if not keys:
        return None, None
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)  # (closed while the socket is made 0666; opened to its user below)
    path = os.path.join(directory, "agent.sock")
    stop = serve_in_thread(path, keys, log, mode=0o666, revoked=revoked)
    try:  # the sandbox's user alone (root's daemon needs no mode bits): no other host user reaches it
        if owner is not None:
            os.chown(directory, *owner)
            os.chmod(directory, 0o500)
        else:
            os.chmod(directory, 0o700)
    except BaseException:
        stop()
        raise
    return path, stop
