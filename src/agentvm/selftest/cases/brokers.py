"""Brokered credentials and the gate's ssh-agent (docs/credentials.md, "SSH keys").

``ssh.unlisted-host``: the sandbox holds an ``ssh`` credential (its private key stays in the
vault; the sandbox gets only ``SSH_AUTH_SOCK``, the gate's agent). The attack speaks the agent
protocol itself: it binds the agent connection to an SSH session of a host of its own - a
genuine ``session-bind@openssh.com`` (that host's key really signs the session id) - and asks
for a publickey signature for that session. The agent must refuse: the host key is not one
the agent file lists. Under ``ssh-any-host`` the binding lists that host too, the agent
signs, and the case reports the escape (a signature the attacker can replay to that host).

``broker.echo`` and ``broker.long-lived``: an ``oauth2-refresh`` credential (the vault entry:
a refresh token and a client secret) bound to ``api.selftest``, served over real TLS by an
upstream that echoes what it was sent - the Authorization header raw and base64-encoded - and
also leaks the refresh token and the client secret in its body (as a buggy API would). The
token endpoint is a loopback HTTP server of this process; the gate mints an access token there
at attach. The agent must see its placeholder only: never the minted token (escapes under
``raw-scrub``: the base64 echo is not recognised) and never the long-lived secret (escapes
under ``cred-in-env``: the refresh token is put in the environment).
"""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import os
import secrets
import socket
import ssl
import tempfile
import threading
from pathlib import Path

from agentvm.selftest.cases.network import PRELUDE
from agentvm.selftest.framework import Env, Verdict, case

AGENT_CLIENT = r'''
import os, socket, struct, sys
def s(b): return struct.pack(">I", len(b)) + b
def call(c, kind, body=b""):
    m = bytes([kind]) + body
    c.sendall(struct.pack(">I", len(m)) + m)
    head = b""
    while len(head) < 4:
        d = c.recv(4 - len(head))
        if not d: raise SystemExit("AGENT closed")
        head += d
    n, out = struct.unpack(">I", head)[0], b""
    while len(out) < n:
        d = c.recv(n - len(out))
        if not d: raise SystemExit("AGENT closed")
        out += d
    return out
sock = os.environ.get("SSH_AUTH_SOCK", "")
print("SOCK", sock, flush=True)
c = socket.socket(socket.AF_UNIX); c.connect(sock)
ids = call(c, 11)  # REQUEST_IDENTITIES -> IDENTITIES_ANSWER (12)
n = struct.unpack(">I", ids[1:5])[0]
ln = struct.unpack(">I", ids[5:9])[0]
blob = ids[9:9 + ln]
print("KEYS", ids[0], n, flush=True)
HOSTKEY, SID, SIG = (bytes.fromhex(x) for x in sys.argv[1:4])
r = call(c, 27, s(b"session-bind@openssh.com") + s(HOSTKEY) + s(SID) + s(SIG) + b"\0")
print("BIND", r[0], flush=True)  # 6: success
alg = blob[4:4 + struct.unpack(">I", blob[:4])[0]]
data = s(SID) + bytes([50]) + s(b"git") + s(b"ssh-connection") + s(b"publickey") + b"\x01" + s(alg) + s(blob)
r = call(c, 13, s(blob) + s(data) + struct.pack(">I", 0))
print("SIGN", r[0], flush=True)  # 14: a signature; 5: refused
'''


def _keypair():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    k = ed25519.Ed25519PrivateKey.generate()
    pem = k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                          serialization.NoEncryption()).decode()
    pub = k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return k, pem, pub


@case("ssh.unlisted-host", "credentials",
      "The gate's ssh-agent signs nothing for a host the agent file does not list, even with a genuine session-bind",
      weakened_by="ssh-any-host")
def _(env: Env) -> Verdict:
    from dataclasses import replace
    from types import SimpleNamespace as NS

    from agentvm.gate import sshagent
    from agentvm.gate.credentials import compile_credentials
    from agentvm.vault import Vault

    _, user_pem, _ = _keypair()
    listed_key, _, listed_pub = _keypair()
    rogue_key, rogue_pem, rogue_pub = _keypair()
    Vault(env.paths.home / "vault").set("selftest-ssh", user_pem)
    known = ["git.selftest " + " ".join(listed_pub.split()[:2])]
    rogue_line = "rogue.selftest " + " ".join(rogue_pub.split()[:2])
    if "ssh-any-host" in env.weakens:
        known.append(rogue_line)
    creds = compile_credentials([NS(name="deploy", env="SSH_AUTH_SOCK", ref="vault:selftest-ssh", hosts=["git.selftest"],
                                    inject=NS(header=None, format="{}", basic=None, query=None), file=None,
                                    placeholder=None, sigv4=None, hmac=None, ssh=NS(known_hosts=known))])
    # the attacker's own host: its key genuinely signs the session id it binds
    sid = os.urandom(32)
    rogue = sshagent.load_key("rogue", rogue_pem, [])
    sig = sshagent.sign(rogue, sid, 0)
    policy = env.policy(["/usr/bin/python3", "-c", AGENT_CLIENT, rogue.blob.hex(), sid.hex(), sig.hex()],
                        credentials=False)
    policy = replace(policy, credentials=creds)
    o = env.run_policy(policy)
    lines = dict(ln.split(" ", 1) for ln in o.stdout.splitlines() if " " in ln)
    if "SIGN" not in lines:
        return Verdict.error(f"the attack did not reach the sign request: {o.out.strip()[-400:]}")
    if not lines.get("SOCK", "").endswith("/agent.sock") or lines.get("BIND") != "6":
        return Verdict.error(f"no agent socket, or the session-bind was not accepted: {o.out.strip()[-400:]}")
    if user_pem.split("\n")[1] in o.out or "PRIVATE KEY" in o.out:
        return Verdict.escaped("the private key reached the sandbox")
    if lines["SIGN"] == "14":
        return Verdict.escaped("the agent signed a publickey authentication for rogue.selftest, a host the agent "
                               "file does not list")
    if lines["SIGN"] != "5":
        return Verdict.error(f"unexpected answer to the sign request: {lines['SIGN']}")
    return Verdict.contained(f"session-bind to rogue.selftest ({sshagent.fingerprint(rogue.blob)}) accepted, the "
                             f"signature refused (SSH_AGENT_FAILURE); {lines.get('KEYS', '?').split()[-1]} key(s) "
                             "listed, none readable")


# -- brokered credentials (oauth2-refresh) ----------------------------------------------------
def _ca_and_cert(d: Path, host: str) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for ``host`` -> (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentvm selftest CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = []
    for name, data in (("ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
                       ("cert.pem", cert.public_bytes(serialization.Encoding.PEM)),
                       ("key.pem", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))):
        (d / name).write_bytes(data)
        os.chmod(d / name, 0o644)
        out.append(str(d / name))
    return out[0], out[1], out[2]


class _Serve:
    """An HTTP server on 127.0.0.1 in a thread (TLS when ``tls`` = (cert, key))."""

    def __init__(self, handler, tls=None):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Peers:
    """The token endpoint, the echoing API, the vault entry and the policy of one broker case."""

    def __init__(self, env: Env):
        self.dir = Path(tempfile.mkdtemp(prefix="broker-", dir=env.root))
        os.chmod(self.dir, 0o755)
        self.refresh = "CANARY-REFRESH-" + secrets.token_hex(12)
        self.client_secret = "CANARY-CLIENTSECRET-" + secrets.token_hex(12)
        self.issued: list[str] = []
        self.seen: list[str] = []
        peers = self

        class Token(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                if f"refresh_token={peers.refresh}" not in body:
                    self.send_response(400)
                    self.end_headers()
                    return
                tok = "CANARY-MINTED-" + secrets.token_hex(16)
                peers.issued.append(tok)
                out = json.dumps({"access_token": tok, "token_type": "Bearer", "expires_in": 3600}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        class Echo(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                auth = self.headers.get("Authorization") or ""
                peers.seen.append(auth)
                out = json.dumps({"authorization": auth, "b64": base64.b64encode(auth.encode()).decode(),
                                  "debug": {"refresh_token": peers.refresh, "client_secret": peers.client_secret}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.ca, cert, key = _ca_and_cert(self.dir, "api.selftest")
        self.token = _Serve(Token)
        self.api = _Serve(Echo, tls=(cert, key))
        from agentvm.vault import Vault

        Vault(env.paths.home / "vault").set("selftest-oauth", json.dumps({
            "tokenUrl": f"http://127.0.0.1:{self.token.port}/token", "clientId": "selftest",
            "clientSecret": self.client_secret, "refreshToken": self.refresh}))

    def policy(self, env: Env, script: str, extra_env: dict | None = None):
        from dataclasses import replace
        from types import SimpleNamespace as NS

        from agentvm.gate.credentials import compile_credentials

        pol = env.policy(["/usr/bin/python3", "-c", PRELUDE + "\n" + script], credentials=False,
                         allow=(f"api.selftest:{self.api.port}",), env=extra_env)
        creds = compile_credentials([NS(name="api", env="API_TOKEN", ref="vault:selftest-oauth", hosts=["api.selftest"],
                                        inject=NS(header="Authorization", format="Bearer {}", basic=None, query=None),
                                        file=None, placeholder=None, sigv4=None, hmac=None,
                                        broker=NS(kind="oauth2-refresh", scopes=["read"]))])
        return replace(pol, egress=replace(pol.egress, upstream_ca=self.ca), credentials=creds)

    def stop(self):
        self.token.stop()
        self.api.stop()


ECHO = r'''
import base64
tok = os.environ.get("API_TOKEN", "")
print("ENV " + json.dumps({k: v for k, v in os.environ.items() if k.isupper()}), flush=True)
hd, r = tunnel("api.selftest", int(os.environ["API_PORT"]), "api.selftest",
               b"GET /echo HTTP/1.1\r\nHost: api.selftest\r\nAuthorization: Bearer " + tok.encode() + b"\r\nConnection: close\r\n\r\n")
body = r.split(b"\r\n\r\n", 1)[-1]
print("RESPONSE " + body.decode(errors="replace"), flush=True)
try:
    e = json.loads(body)
    print("DECODED " + base64.b64decode(e.get("b64", "")).decode(errors="replace"), flush=True)
except ValueError:
    pass
'''


def _broker_run(env: Env, extra_env=None):
    peers = _Peers(env)
    try:
        e = {"API_PORT": str(peers.api.port), **(extra_env(peers) if extra_env else {})}
        o = env.run_policy(peers.policy(env, ECHO, e))
    finally:
        peers.stop()
    return peers, o


@case("broker.echo", "credentials",
      "An upstream echoes the minted access token (raw and base64): the agent reads back its placeholder, never the token",
      weakened_by="raw-scrub")
def _(env: Env) -> Verdict:
    peers, o = _broker_run(env)
    if not peers.issued:
        return Verdict.error(f"the gate minted no token: {o.out.strip()[-400:]}")
    if not any(a.startswith("Bearer CANARY-MINTED-") for a in peers.seen):
        return Verdict.error(f"the upstream never saw a minted token: {peers.seen} {o.out.strip()[-300:]}")
    leaked = [t for t in peers.issued if t in o.out]
    if leaked:
        return Verdict.escaped("the agent read back the minted access token " + leaked[0][:22] + "...")
    if "DECODED Bearer " not in o.stdout:
        return Verdict.error(f"the echo did not come back: {o.out.strip()[-400:]}")
    return Verdict.contained(f"the upstream saw a minted token ({len(peers.issued)} minted); the agent read back only "
                             "its placeholder (raw and base64)")


@case("broker.long-lived", "credentials",
      "The long-lived secret of a brokered credential (refresh token, client secret) never reaches the sandbox",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    weak = "cred-in-env" in env.weakens
    peers, o = _broker_run(env, (lambda p: {"LEAKED_REFRESH_TOKEN": p.refresh}) if weak else None)
    if not peers.issued or "RESPONSE " not in o.stdout:
        return Verdict.error(f"no mint or no response: {o.out.strip()[-400:]}")
    leaked = [n for n, v in (("refresh token", peers.refresh), ("client secret", peers.client_secret)) if v in o.out]
    if leaked:
        return Verdict.escaped("the sandbox saw the long-lived " + " and ".join(leaked))
    return Verdict.contained("neither the refresh token nor the client secret is in the sandbox's environment or in "
                             "the upstream's response that carried them (scrubbed)")
