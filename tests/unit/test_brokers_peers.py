"""Real peers for the brokered-credential tests, on loopback: an OAuth 2 authorization server
built with Authlib (refresh grant with rotation, RFC 7009 revocation, a protected resource
that checks access tokens), moto in server mode (STS, S3, IAM, with signature checking on),
and a GitHub-shaped peer for the app installation-token endpoint (it checks the app JWT's
RS256 signature with the app's public key). Obviously fake values only."""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Thread:
    def __init__(self, app, tls: tuple | None = None):
        from werkzeug.serving import make_server

        ctx = None
        if tls is not None:  # (cert, key): HTTPS, as an upstream behind the gate must be
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
        self.srv = make_server("127.0.0.1", 0, app, threaded=True, ssl_context=ctx)
        self.port = self.srv.server_port
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.t.start()

    def stop(self):
        self.srv.shutdown()


# -- OAuth 2 (Authlib) ----------------------------------------------------------------------
@dataclass
class OAuthState:
    client_id: str = "agentvm-test-client"
    client_secret: str = field(default_factory=lambda: "fake-client-secret-" + secrets.token_hex(12))
    refresh_tokens: dict = field(default_factory=dict)  # token -> {"scope", "revoked"}
    access_tokens: dict = field(default_factory=dict)  # token -> {"scope", "expires", "revoked"}
    expires_in: int = 3600
    rotate: bool = True
    grants: int = 0
    revocations: list = field(default_factory=list)
    seen_by_resource: list = field(default_factory=list)  # Authorization headers the resource got
    fail_next: str | None = None


def oauth_server(state: OAuthState | None = None):
    """-> (state, running server with .port). Token URL /token, revocation /revoke, resource /api/me."""
    from authlib.integrations.flask_oauth2 import AuthorizationServer
    from authlib.oauth2.rfc6749 import ClientMixin, grants
    from authlib.oauth2.rfc7009 import RevocationEndpoint
    from flask import Flask, jsonify, request

    st = state or OAuthState()
    st.refresh_tokens.setdefault("fake-refresh-" + secrets.token_hex(16), {"scope": "read write", "revoked": False})

    class Client(ClientMixin):
        client_id = st.client_id

        def get_client_id(self):
            return st.client_id

        def get_default_redirect_uri(self):
            return None

        def get_allowed_scope(self, scope):
            return " ".join(s for s in (scope or "").split() if s in ("read", "write"))

        def check_redirect_uri(self, uri):
            return False

        def check_client_secret(self, secret):
            return secrets.compare_digest(secret, st.client_secret)

        def check_endpoint_auth_method(self, method, endpoint):
            return method in ("client_secret_basic", "client_secret_post")

        def check_response_type(self, rt):
            return False

        def check_grant_type(self, gt):
            return gt == "refresh_token"

    class Tok:
        def __init__(self, value, meta, kind):
            self.value, self.meta, self.kind = value, meta, kind

        def check_client(self, client):
            return True

        def get_scope(self):
            return self.meta["scope"]

        def get_expires_in(self):
            return st.expires_in

        def is_expired(self):
            return False

        def is_revoked(self):
            return self.meta["revoked"]

        def get_user(self):
            return object()

    class Refresh(grants.RefreshTokenGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]
        INCLUDE_NEW_REFRESH_TOKEN = st.rotate

        def authenticate_refresh_token(self, refresh_token):
            m = st.refresh_tokens.get(refresh_token)
            return Tok(refresh_token, m, "refresh") if m and not m["revoked"] else None

        def authenticate_user(self, credential):
            return object()

        def revoke_old_credential(self, credential):
            credential.meta["revoked"] = True

    class Revoke(RevocationEndpoint):
        CLIENT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

        def query_token(self, token, hint):
            for kind, store in (("access", st.access_tokens), ("refresh", st.refresh_tokens)):
                if token in store:
                    return Tok(token, store[token], kind)
            return None

        def revoke_token(self, token, request):
            token.meta["revoked"] = True
            st.revocations.append(token.value)

    def query_client(cid):
        return Client() if cid == st.client_id else None

    def save_token(token, request):
        st.grants += 1
        st.access_tokens[token["access_token"]] = {"scope": token.get("scope", ""), "revoked": False,
                                                   "expires": time.time() + st.expires_in}
        if token.get("refresh_token"):
            st.refresh_tokens[token["refresh_token"]] = {"scope": token.get("scope", ""), "revoked": False}

    app = Flask("oauth-test")
    server = AuthorizationServer(app, query_client=query_client, save_token=save_token)

    def gen_token(**kw):
        return "fake-access-" + secrets.token_hex(20)

    server.register_token_generator("default", lambda *a, **kw: None)
    from authlib.oauth2.rfc6750 import BearerTokenGenerator

    server.register_token_generator("default", BearerTokenGenerator(
        access_token_generator=lambda *a, **kw: "fake-access-" + secrets.token_hex(20),
        refresh_token_generator=lambda *a, **kw: "fake-refresh-" + secrets.token_hex(16),
        expires_generator=lambda *a, **kw: st.expires_in))
    server.register_grant(Refresh)
    server.register_endpoint(Revoke)

    @app.route("/token", methods=["POST"])
    def token():
        if st.fail_next:
            code, st.fail_next = st.fail_next, None
            return jsonify({"error": code, "error_description": "refused by the test"}), 400
        return server.create_token_response()

    @app.route("/revoke", methods=["POST"])
    def revoke():
        return server.create_endpoint_response("revocation")

    @app.route("/api/<path:rest>", methods=["GET", "POST"])
    def resource(rest):
        auth = request.headers.get("Authorization", "")
        st.seen_by_resource.append(auth)
        tok = auth[7:] if auth.startswith("Bearer ") else ""
        m = st.access_tokens.get(tok)
        if not m or m["revoked"] or m["expires"] < time.time():
            return jsonify({"error": "invalid_token"}), 401
        if rest == "echo":  # an upstream that reflects the request (the agent's echo attack)
            return jsonify({"authorization": auth, "b64": base64.b64encode(auth.encode()).decode()})
        return jsonify({"user": "test-user", "scope": m["scope"]})

    srv = _Thread(app)
    srv.app = app
    return st, srv


def oauth_entry(st: OAuthState, port: int, **extra) -> dict:
    rt = next(t for t, m in st.refresh_tokens.items() if not m["revoked"])
    d = {"tokenUrl": f"http://127.0.0.1:{port}/token", "revocationUrl": f"http://127.0.0.1:{port}/revoke",
         "clientId": st.client_id, "clientSecret": st.client_secret, "refreshToken": rt}
    d.update(extra)
    return d


# -- moto (STS, S3, IAM) --------------------------------------------------------------------
class TlsFront:
    """TLS in front of a plain HTTP peer on loopback (moto's server speaks HTTP only)."""

    def __init__(self, cert, key, port: int):
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.ctx, self.back = ctx, port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            t = self.ctx.wrap_socket(c, server_side=True)
            u = socket.create_connection(("127.0.0.1", self.back))
        except OSError:
            c.close()
            return

        def pump(a, b):
            try:
                while (d := a.recv(65536)):
                    b.sendall(d)
            except OSError:
                pass
            finally:
                for x in (a, b):
                    try:
                        x.close()
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(t, u), daemon=True).start()
        pump(u, t)

    def stop(self):
        self.lsock.close()


class Moto:
    """moto's server on loopback (its own process), with IAM signature checking switched on once
    the setup is done: after ``setup_actions`` unauthenticated calls, every request must be signed
    with a key moto issued (an IAM user's key or an STS session's), with the right secret."""

    def __init__(self, setup_actions: int):
        self.port = free_port()
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(setup_actions), MOTO_ALLOW_NONEXISTENT_REGION="true", S3_IGNORE_SUBDOMAIN_BUCKETNAME="true",
                   AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("moto server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, service: str, akid="testing", secret="testing", token=None):
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=akid,
                            aws_secret_access_key=secret, aws_session_token=token)

    def setup(self) -> dict:
        """An IAM user with a key (the long-lived secret), a role it may assume, a bucket.
        Exactly ``SETUP_ACTIONS`` calls."""
        iam = self.client("iam")
        iam.create_user(UserName="agent-broker")
        key = iam.create_access_key(UserName="agent-broker")["AccessKey"]
        admin = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
        iam.put_user_policy(UserName="agent-broker", PolicyName="all", PolicyDocument=admin)
        trust = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})
        role = iam.create_role(RoleName="agent-role", AssumeRolePolicyDocument=trust)["Role"]
        iam.put_role_policy(RoleName="agent-role", PolicyName="all", PolicyDocument=admin)
        self.client("s3").create_bucket(Bucket="agent-bucket")
        return {"accessKeyId": key["AccessKeyId"], "secretAccessKey": key["SecretAccessKey"],
                "region": "us-east-1", "endpoint": self.url, "roleArn": role["Arn"]}

    SETUP_ACTIONS = 6

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- GitHub-shaped app token endpoint -------------------------------------------------------
@dataclass
class GitHubState:
    app_id: str = "424242"
    installation_id: str = "777"
    public_key: object = None
    private_pem: str = ""
    issued: dict = field(default_factory=dict)  # token -> {"repositories", "permissions", "revoked"}
    requests: list = field(default_factory=list)
    seen_by_api: list = field(default_factory=list)
    widen: bool = False  # misbehave: grant more than asked


def github_server(state: GitHubState | None = None):
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa
    from flask import Flask, jsonify, request

    st = state or GitHubState()
    if st.public_key is None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        st.private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()).decode()
        st.public_key = key.public_key()
    app = Flask("github-test")

    def b64d(s: str) -> bytes:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))

    def jwt_ok(auth: str) -> bool:
        if not auth.startswith("Bearer "):
            return False
        try:
            h, p, s = auth[7:].split(".")
            st.public_key.verify(b64d(s), f"{h}.{p}".encode(), padding.PKCS1v15(), hashes.SHA256())
            claims = json.loads(b64d(p))
        except Exception:
            return False
        now = time.time()
        return (json.loads(b64d(h)).get("alg") == "RS256" and claims.get("iss") == st.app_id
                and claims["iat"] <= now + 5 and claims["exp"] > now and claims["exp"] - claims["iat"] <= 600)

    @app.route("/app/installations/<inst>/access_tokens", methods=["POST"])
    def access_tokens(inst):
        st.requests.append({"inst": inst, "body": request.get_json(silent=True)})
        if inst != st.installation_id or not jwt_ok(request.headers.get("Authorization", "")):
            return jsonify({"message": "Bad credentials"}), 401
        body = request.get_json(silent=True) or {}
        repos = body.get("repositories") or ["everything"]
        perms = body.get("permissions") or {"contents": "write", "administration": "write"}
        if st.widen:
            perms = dict(perms, administration="write")
        tok = "ghs_fake" + secrets.token_hex(18)
        st.issued[tok] = {"repositories": repos, "permissions": perms, "revoked": False}
        exp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
        return jsonify({"token": tok, "expires_at": exp, "permissions": perms,
                        "repositories": [{"name": r} for r in repos]}), 201

    @app.route("/installation/token", methods=["DELETE"])
    def revoke():
        auth = request.headers.get("Authorization", "")
        tok = auth.split(" ", 1)[-1]
        if tok in st.issued:
            st.issued[tok]["revoked"] = True
            return "", 204
        return jsonify({"message": "Bad credentials"}), 401

    @app.route("/repos/<owner>/<repo>", methods=["GET"])
    def repo(owner, repo):
        auth = request.headers.get("Authorization", "")
        st.seen_by_api.append(auth)
        tok = auth.split(" ", 1)[-1]
        m = st.issued.get(tok)
        if not m or m["revoked"]:
            return jsonify({"message": "Bad credentials"}), 401
        if repo not in m["repositories"]:
            return jsonify({"message": "Not Found"}), 404
        return jsonify({"full_name": f"{owner}/{repo}", "permissions": m["permissions"]})

    srv = _Thread(app)
    srv.app = app
    return st, srv


def github_entry(st: GitHubState, port: int) -> dict:
    return {"appId": st.app_id, "installationId": st.installation_id, "privateKey": st.private_pem,
            "api": f"http://127.0.0.1:{port}"}


@pytest.mark.parametrize("unused", [0])
def test_the_peers_refuse_what_they_should(unused):
    """The peers are strict: a wrong client secret, a forged app JWT and an unknown access token
    are refused (so a broker test that passes did present the right credentials)."""
    import urllib.error
    import urllib.request

    st, srv = oauth_server()
    try:
        rt = next(iter(st.refresh_tokens))
        data = f"grant_type=refresh_token&refresh_token={rt}&client_id={st.client_id}&client_secret=wrong".encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/token", data=data, timeout=5)
        assert e.value.code in (400, 401)
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/api/me", headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401
    finally:
        srv.stop()
    gst, gsrv = github_server()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{gsrv.port}/app/installations/777/access_tokens", data=b"{}",
                                     headers={"Authorization": "Bearer a.b.c", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401
    finally:
        gsrv.stop()
