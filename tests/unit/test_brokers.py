"""Brokered credentials against real peers on loopback: an Authlib OAuth 2 server, moto (STS/S3
with signature checking on) and a GitHub-shaped app-token endpoint. What the gate swaps in is
minted, cached, refreshed before expiry, dropped and revoked on revocation, and a failure is a
clear denial; the long-lived secret and the minted value never reach the sandbox's side."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from agentvm.gate import brokers, signing
from agentvm.gate.credentials import CredentialError, CredentialSet, compile_credentials, make_placeholder
from tests.unit.test_brokers_peers import Moto, github_entry, github_server, oauth_entry, oauth_server


def _cred(name, broker, *, inject=None, sigv4=None, hosts=("api.test",)):
    inj = SimpleNamespace(header=None, format="{}", basic=None, query=None)
    if inject:
        inj = SimpleNamespace(**{**vars(inj), **inject})
    b = SimpleNamespace(kind=broker.pop("kind"), scopes=broker.pop("scopes", []), role_arn=broker.pop("role_arn", None),
                        session_policy=broker.pop("session_policy", None), duration_seconds=broker.pop("duration", 900),
                        repositories=broker.pop("repositories", []), permissions=broker.pop("permissions", {}))
    return SimpleNamespace(name=name, env=name.upper(), ref=f"vault:{name}", hosts=list(hosts), inject=inj, file=None,
                           placeholder=None, sigv4=sigv4, hmac=None, inspect="strict", broker=b)


class Store:
    """The vault as the gate sees it (name -> text), with revocations and a write-back log."""

    def __init__(self, **entries):
        self.entries = {k: json.dumps(v) for k, v in entries.items()}
        self.revoked: set[str] = set()

    def creds(self, *bindings) -> CredentialSet:
        phs = {b.name: make_placeholder(b, len(self.entries[b.name])) for b in bindings}
        cs = CredentialSet(bindings, phs, lambda n: self.entries[n], lambda n: n in self.revoked)
        for b in bindings:  # write-back of a rotated entry (what a vault: reference does)
            cs.brokers[b.name].persist = lambda text, n=b.name: self.entries.__setitem__(n, text)
        return cs


def _bearer(cs, name, host="api.test"):
    ph = cs.placeholders[name]
    swap = cs.apply(host=host, scheme="https", target="/api/me", headers=[(b"authorization", f"Bearer {ph}".encode())])
    return dict(swap.headers)[b"authorization"].decode()


def _get(url, auth):
    req = urllib.request.Request(url, headers={"Authorization": auth})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def _wait(pred, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def oauth():
    st, srv = oauth_server()
    yield st, srv
    srv.stop()


def oauth_binding(scopes=("read",)):
    return compile_credentials([_cred("api", {"kind": "oauth2-refresh", "scopes": list(scopes)},
                                      inject={"header": "Authorization", "format": "Bearer {}"})])[0]


# -- oauth2-refresh -------------------------------------------------------------------------
def test_oauth2_swaps_a_minted_access_token_the_server_accepts_and_caches_it(oauth):
    st, srv = oauth
    b = oauth_binding()
    store = Store(api=oauth_entry(st, srv.port))
    cs = store.creds(b)
    auth = _bearer(cs, "api")
    token = auth[7:]
    assert token in st.access_tokens and token.startswith("fake-access-")
    assert st.access_tokens[token]["scope"] == "read", "the agent file's scopes narrowed the grant"
    code, doc = _get(f"http://127.0.0.1:{srv.port}/api/me", auth)
    assert code == 200 and doc["user"] == "test-user"
    assert _bearer(cs, "api") == auth and st.grants == 1, "cached: one refresh grant for two requests"
    # the server rotated the refresh token: the new one was written back, the old one is dead
    new_rt = json.loads(store.entries["api"])["refreshToken"]
    assert st.refresh_tokens[new_rt]["revoked"] is False
    assert sum(1 for m in st.refresh_tokens.values() if m["revoked"]) == 1


def test_oauth2_refreshes_in_the_background_before_expiry_and_synchronously_after(oauth):
    st, srv = oauth
    st.expires_in = 100
    cs = Store(api=oauth_entry(st, srv.port)).creds(oauth_binding())
    clock = [time.time()]
    cs.brokers["api"].now = lambda: clock[0]
    first = _bearer(cs, "api")
    clock[0] += 50  # half its life left: no refresh yet
    assert _bearer(cs, "api") == first and st.grants == 1
    clock[0] += 30  # 20 s left, inside the refresh margin (25 s): still served, refreshed behind
    assert _bearer(cs, "api") == first
    assert _wait(lambda: st.grants == 2 and cs.brokers["api"].current.value != first[7:])
    second = _bearer(cs, "api")
    assert second != first and second[7:] in st.access_tokens
    clock[0] += 500  # long expired: minted again before the request goes
    third = _bearer(cs, "api")
    assert third not in (first, second) and st.grants == 3


def test_oauth2_revocation_drops_the_cache_and_revokes_upstream(oauth):
    st, srv = oauth
    store = Store(api=oauth_entry(st, srv.port))
    cs = store.creds(oauth_binding())
    token = _bearer(cs, "api")[7:]
    store.revoked.add("api")
    with pytest.raises(CredentialError) as e:
        _bearer(cs, "api")
    assert e.value.rule_id == "credential:revoked:api"
    assert cs.brokers["api"].current is None
    assert _wait(lambda: token in st.revocations), "RFC 7009 revocation reached the server"
    assert _get(f"http://127.0.0.1:{srv.port}/api/me", "Bearer " + token)[0] == 401
    store.revoked.clear()  # restored: a new token is minted
    assert _bearer(cs, "api")[7:] not in (token,)


def test_oauth2_session_end_revokes(oauth):
    st, srv = oauth
    cs = Store(api=oauth_entry(st, srv.port)).creds(oauth_binding())
    token = _bearer(cs, "api")[7:]
    cs.close(wait=True)
    assert token in st.revocations and st.access_tokens[token]["revoked"]


@pytest.mark.parametrize("break_it,why", [
    ("fail", "invalid_grant"),
    ("secret", "HTTP 40"),
    ("url", "could not be reached"),
    ("notjson", "not a JSON object"),
])
def test_oauth2_failures_are_clear_denials_without_values(oauth, break_it, why):
    st, srv = oauth
    entry = oauth_entry(st, srv.port)
    if break_it == "fail":
        st.fail_next = "invalid_grant"
    elif break_it == "secret":
        entry["clientSecret"] = "fake-wrong-secret-0123456789"
    elif break_it == "url":
        from tests.unit.test_brokers_peers import free_port

        entry["tokenUrl"] = f"http://127.0.0.1:{free_port()}/token"
    store = Store(api=entry)
    if break_it == "notjson":
        store.entries["api"] = "just-a-token-0123456789abcdef"
    cs = store.creds(oauth_binding())
    with pytest.raises(CredentialError) as e:
        _bearer(cs, "api")
    assert e.value.rule_id == "credential:unavailable" and why in e.value.reason, e.value.reason
    text = e.value.reason + repr(e.value) + repr(cs) + repr(cs.brokers["api"])
    for secret in (st.client_secret, entry["refreshToken"], cs.placeholders["api"]):
        assert secret not in text


def test_oauth2_a_failed_refresh_is_not_retried_on_every_request(oauth):
    st, srv = oauth
    st.fail_next = "temporarily_unavailable"
    cs = Store(api=oauth_entry(st, srv.port)).creds(oauth_binding())
    clock = [time.time()]
    cs.brokers["api"].now = lambda: clock[0]
    calls = []
    real_minter = cs.brokers["api"].minter
    cs.brokers["api"].minter = lambda *a: calls.append(1) or real_minter(*a)
    for _ in range(5):
        with pytest.raises(CredentialError) as e:
            _bearer(cs, "api")
        assert "temporarily_unavailable" in e.value.reason
    assert len(calls) == 1, "one call to the issuer for five requests"
    clock[0] += brokers.FAIL_BACKOFF + 1
    assert _bearer(cs, "api").startswith("Bearer fake-access-") and len(calls) == 2


def test_oauth2_minted_and_long_lived_values_are_scrubbed_from_any_response(oauth):
    """The agent's echo attack: an upstream reflecting the swapped header (raw and base64), and
    a response quoting the refresh token or client secret - the sandbox gets placeholders."""
    st, srv = oauth
    entry = oauth_entry(st, srv.port)
    cs = Store(api=entry).creds(oauth_binding())
    auth = _bearer(cs, "api")
    code, doc = _get(f"http://127.0.0.1:{srv.port}/api/echo", auth)
    assert code == 200 and doc["authorization"] == auth  # the upstream really echoed the minted token
    body = json.dumps(doc).encode() + b" rt=" + json.dumps(cs.brokers["api"].long_lived).encode()
    sc = cs.scrubber()
    out = sc.feed(body) + sc.finish()
    rt_now = json.loads(Store(api=entry).entries["api"])["refreshToken"]
    for secret in (auth[7:], st.client_secret, rt_now):
        assert secret.encode() not in out
    assert cs.placeholders["api"].encode() in out and sc.hits >= 3


def test_oauth2_placeholder_sent_to_the_token_endpoint_is_a_leak(oauth):
    """The agent's other attack: asking the token endpoint itself (not a bound host) with the
    placeholder, in a header or as the refresh token in the body."""
    st, srv = oauth
    cs = Store(api=oauth_entry(st, srv.port)).creds(oauth_binding())
    ph = cs.placeholders["api"]
    with pytest.raises(CredentialError) as e:
        cs.apply(host="127.0.0.1", scheme="https", target="/token", headers=[(b"authorization", f"Bearer {ph}".encode())])
    assert e.value.rule_id == "credential:leak:api"
    scan = cs.body_scanner("127.0.0.1")
    with pytest.raises(CredentialError):
        scan.feed(f"grant_type=refresh_token&refresh_token={ph}".encode())
    assert st.grants == 0


# -- aws-sts ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moto():
    m = Moto(Moto.SETUP_ACTIONS)
    try:
        setup = m.setup()
        yield m, setup
    finally:
        m.stop()


def _signed_s3_request(url: str, akid: str, secret: str, method="GET", body=b"", presign=False):
    from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method=method, url=url, data=body)
    if presign:
        S3SigV4QueryAuth(Credentials(akid, secret), "s3", "us-east-1", expires=300).add_auth(req)
    else:
        req.headers["x-amz-content-sha256"] = __import__("hashlib").sha256(body).hexdigest()
        S3SigV4Auth(Credentials(akid, secret), "s3", "us-east-1").add_auth(req)
    return signing.Request(method=method, url=req.url, headers=list(req.headers.items()), body=body)


def _send(sreq: signing.Request):
    r = urllib.request.Request(sreq.url, data=sreq.body or None, method=sreq.method, headers=dict(sreq.headers))
    try:
        with urllib.request.urlopen(r, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def sts_binding(role_arn=None, policy=None, akid="AKIAPLACEHOLDER0001"):
    return compile_credentials([_cred("aws", {"kind": "aws-sts", "role_arn": role_arn, "session_policy": policy},
                                      sigv4=SimpleNamespace(access_key_id=akid, access_key_id_env="AWS_ACCESS_KEY_ID"),
                                      hosts=("127.0.0.1",))])[0]


def _verify_session_sig(req: signing.Request, key) -> bool:
    """An independent check (botocore, the session's secret) of a signed request, either form."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    creds = Credentials(key.access_key_id, str(key), key.session_token)
    h = {k.lower(): v for k, v in req.headers}
    u = urlsplit(req.url)
    q = parse_qsl(u.query, keep_blank_values=True)
    if "authorization" in h:
        parts = dict(p.strip().split("=", 1) for p in h["authorization"][len("AWS4-HMAC-SHA256 "):].split(","))
        signed, sig, scope, ts = parts["SignedHeaders"].split(";"), parts["Signature"], parts["Credential"], h["x-amz-date"]
        areq = AWSRequest(method=req.method, url=req.url, data=req.body, headers={n: h[n] for n in signed if n in h})
        signer = S3SigV4Auth(creds, "s3", "us-east-1")
        token_signed = "x-amz-security-token" in signed
    else:
        d = dict(q)
        sig, scope, ts = d["X-Amz-Signature"], d["X-Amz-Credential"], d["X-Amz-Date"]
        rest = urlencode([(k, v) for k, v in q if k != "X-Amz-Signature"], safe="-_.~", quote_via=__import__("urllib.parse").parse.quote)
        areq = AWSRequest(method=req.method, url=f"{u.scheme}://{u.netloc}{u.path}?{rest}", data=b"", headers={})
        signer = S3SigV4QueryAuth(creds, "s3", "us-east-1", expires=int(d["X-Amz-Expires"]))
        token_signed = d.get("X-Amz-Security-Token") == key.session_token
    areq.context["timestamp"] = ts
    expected = signer.signature(signer.string_to_sign(areq, signer.canonical_request(areq)), areq)
    return scope.split("/")[0] == key.access_key_id and token_signed and expected == sig


@pytest.mark.parametrize("use_role", [True, False])
@pytest.mark.parametrize("presign", [False, True])
def test_aws_sts_resigns_with_session_credentials_moto_accepts(moto, use_role, presign):
    """Header-signed AssumeRole requests are checked by moto itself (it knows those keys); moto
    does not track GetSessionToken keys (InvalidAccessKeyId to any) and answers 500 to every
    presigned URL with checking on (boto3's own too), so those signatures are checked
    independently with botocore and the session's secret."""
    m, setup = moto
    entry = {k: setup[k] for k in ("accessKeyId", "secretAccessKey", "region", "endpoint")}
    b = sts_binding(setup["roleArn"] if use_role else None)
    cs = Store(aws=entry).creds(b)
    url = f"{m.url}/agent-bucket?list-type=2"
    agent_req = _signed_s3_request(url, b.sigv4_access_key_id, cs.placeholders["aws"], presign=presign)
    # moto checks signatures: the agent's own (placeholder) request is refused
    assert _send(agent_req)[0] in (403, 500)
    swap = cs.apply(host="127.0.0.1", scheme="https", target=agent_req.url.split(str(m.port), 1)[1],
                    headers=[(k.encode(), v.encode()) for k, v in agent_req.headers])
    assert [x.name for x in swap.resign] == ["aws"]
    key = cs.value("aws")
    assert isinstance(key, brokers.SessionKey) and key.access_key_id != setup["accessKeyId"]
    out = signing.resign_sigv4(agent_req, access_key_id=b.sigv4_access_key_id, placeholder_secret=cs.placeholders["aws"],
                               real_secret=key, allow_unsigned_payload=True)
    assert _verify_session_sig(out, key)
    bad = out.url[:-1] + ("0" if out.url[-1] != "0" else "1") if presign else out.url
    bad_headers = out.headers if presign else [(k, v[:-1] + ("0" if v[-1] != "0" else "1")) if k.lower() == "authorization"
                                                else (k, v) for k, v in out.headers]
    assert not _verify_session_sig(signing.Request(out.method, bad, bad_headers, out.body), key), "the check can fail"
    if use_role and not presign:
        code, body = _send(out)
        assert code == 200 and b"ListBucketResult" in body, body[:300]
    wire = json.dumps(out.headers) + out.url
    assert key.access_key_id in wire and key.session_token in wire.replace("%2F", "/").replace("%3D", "=").replace("%2B", "+")
    assert setup["secretAccessKey"] not in wire and setup["accessKeyId"] not in wire and str(key) not in wire
    assert cs.brokers["aws"].mints == 1
    # scrubbed: the session's secret and token, and the long-lived secret key
    sc = cs.scrubber()
    echoed = sc.feed(f"{str(key)} {key.session_token} {setup['secretAccessKey']}".encode()) + sc.finish()
    assert str(key).encode() not in echoed and key.session_token.encode() not in echoed
    assert setup["secretAccessKey"].encode() not in echoed


def test_aws_sts_the_agent_cannot_bring_its_own_session_token(moto):
    m, setup = moto
    b = sts_binding()
    cs = Store(aws={k: setup[k] for k in ("accessKeyId", "secretAccessKey", "endpoint")}).creds(b)
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="GET", url=f"{m.url}/agent-bucket", data=b"")
    req.headers["x-amz-content-sha256"] = __import__("hashlib").sha256(b"").hexdigest()
    S3SigV4Auth(Credentials(b.sigv4_access_key_id, cs.placeholders["aws"], "agent-token"), "s3", "us-east-1").add_auth(req)
    sreq = signing.Request("GET", req.url, list(req.headers.items()), b"")
    with pytest.raises(signing.SigningError) as e:
        signing.resign_sigv4(sreq, access_key_id=b.sigv4_access_key_id, placeholder_secret=cs.placeholders["aws"],
                             real_secret=cs.value("aws"), allow_unsigned_payload=True)
    assert e.value.code == "sigv4:malformed"


def test_aws_sts_refused_by_sts_is_a_clear_denial(moto):
    m, setup = moto
    b = sts_binding()
    cs = Store(aws={"accessKeyId": setup["accessKeyId"], "secretAccessKey": "fakeWrongSecret0123456789",
                    "endpoint": m.url}).creds(b)
    with pytest.raises(CredentialError) as e:
        cs.value("aws")
    assert e.value.rule_id == "credential:unavailable" and "STS refused GetSessionToken" in e.value.reason
    assert "fakeWrongSecret" not in e.value.reason


# -- github-app -------------------------------------------------------------------------------
@pytest.fixture
def github():
    st, srv = github_server()
    yield st, srv
    srv.stop()


def gh_binding(repos=("widgets",), perms=None):
    return compile_credentials([_cred("gh", {"kind": "github-app", "repositories": list(repos),
                                             "permissions": perms or {"contents": "read"}},
                                      inject={"header": "Authorization", "format": "token {}"})])[0]


def test_github_app_mints_a_narrowed_installation_token_and_revokes_it(github):
    st, srv = github
    cs = Store(gh=github_entry(st, srv.port)).creds(gh_binding())
    auth = _bearer_gh = dict(cs.apply(host="api.test", scheme="https", target="/repos/o/widgets",
                                      headers=[(b"authorization", f"token {cs.placeholders['gh']}".encode())]).headers)[b"authorization"].decode()
    tok = auth.split(" ", 1)[1]
    assert st.issued[tok] == {"repositories": ["widgets"], "permissions": {"contents": "read"}, "revoked": False}
    assert st.requests[-1]["body"] == {"repositories": ["widgets"], "permissions": {"contents": "read"}}
    assert _get(f"http://127.0.0.1:{srv.port}/repos/o/widgets", auth)[0] == 200
    assert _get(f"http://127.0.0.1:{srv.port}/repos/o/secret-repo", auth)[0] == 404, "limited to the named repository"
    cs.close(wait=True)
    assert st.issued[tok]["revoked"] and _get(f"http://127.0.0.1:{srv.port}/repos/o/widgets", auth)[0] == 401


def test_github_app_a_wider_grant_than_asked_is_refused(github):
    st, srv = github
    st.widen = True
    cs = Store(gh=github_entry(st, srv.port)).creds(gh_binding())
    with pytest.raises(CredentialError) as e:
        cs.value("gh")
    assert "permissions that were not asked for" in e.value.reason


def test_github_app_bad_key_is_a_clear_denial(github):
    st, srv = github
    entry = github_entry(st, srv.port)
    from tests.unit.test_brokers_peers import GitHubState, github_server as gs

    other, osrv = gs(GitHubState())  # another app's key: the peer's signature check refuses it
    osrv.stop()
    entry["privateKey"] = other.private_pem
    cs = Store(gh=entry).creds(gh_binding())
    with pytest.raises(CredentialError) as e:
        cs.value("gh")
    assert "HTTP 401" in e.value.reason and "BEGIN" not in e.value.reason


def test_broker_urls_must_be_https_except_on_loopback():
    with pytest.raises(ValueError):
        brokers._check_url("http://tokens.example.com/token", "tokenUrl")
    assert brokers._check_url("http://127.0.0.1:9/token", "tokenUrl")
    assert brokers._check_url("https://tokens.example.com/token", "tokenUrl")


def test_a_placeholder_for_a_brokered_credential_is_not_as_long_as_the_vault_entry():
    b = oauth_binding()
    assert len(make_placeholder(b, 5000)) == 40


# -- `agentvm secret set --kind` ---------------------------------------------------------------
@pytest.mark.parametrize("kind,value,ok,why", [
    ("oauth2-refresh", json.dumps({"tokenUrl": "https://t.example/token", "clientId": "c", "clientSecret": "fake-cs-0123",
                                   "refreshToken": "fake-rt-0123"}), True, ""),
    ("oauth2-refresh", json.dumps({"tokenUrl": "http://t.example/token", "clientId": "c", "clientSecret": "fake-cs-0123"}),
     False, "no 'refreshToken'; tokenUrl must be an https:// URL"),
    ("aws-sts", "fake-plain-secret-0123", False, "is a JSON object"),
    ("github-app", json.dumps({"appId": "1", "installationId": "2", "privateKey": "fake-not-a-key-0123"}), False,
     "'privateKey' is not a PEM RSA private key"),
    ("ssh-key", "fake-not-a-key-0123", False, "not an unencrypted OpenSSH private key"),
])
def test_secret_set_kind_checks_the_shape_without_echoing_values(tmp_path, monkeypatch, kind, value, ok, why):
    from click.testing import CliRunner

    from agentvm.cli import cli
    from agentvm.vault import Vault

    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(cli, ["secret", "set", "e", "--kind", kind], input=value)
    if ok:
        assert r.exit_code == 0 and Vault(tmp_path / "home" / "vault").get("e") == value
        return
    assert r.exit_code == 78 and why in r.output, r.output
    assert "fake-" not in r.output and not Vault(tmp_path / "home" / "vault").exists("e")


# -- the agent file ---------------------------------------------------------------------------
@pytest.mark.parametrize("cred,why", [
    ({"inject": {"header": "Authorization"}, "broker": {"kind": "aws-sts"}}, "aws-sts goes with sigv4"),
    ({"sigv4": {"accessKeyId": "AKIAX"}, "broker": {"kind": "oauth2-refresh"}}, "aws-sts goes with sigv4"),
    ({"sigv4": {"accessKeyId": "AKIAX"}, "broker": {"kind": "aws-sts", "durationSeconds": 60}}, "greater than or equal to 900"),
    ({"inject": {"header": "Authorization"}, "broker": {"kind": "github-app", "permissions": {"contents": "own"}}}, "read"),
    ({"inject": {"header": "Authorization"}, "broker": {"kind": "vault-magic"}}, "oauth2-refresh"),
    ({"ssh": {"knownHosts": ["git.test ssh-ed25519 !!notbase64"]}}, "not base64"),
    ({"ssh": {"knownHosts": []}}, "at least 1"),
    ({"ssh": {"knownHosts": ["git.test ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"]},
      "inject": {"header": "Authorization"}}, "either injected"),
])
def test_the_spec_refuses_broker_and_ssh_mistakes(cred, why):
    from pydantic import ValidationError

    from agentvm.spec.models import Credential

    with pytest.raises(ValidationError) as e:
        Credential.model_validate({"name": "c", "env": "C", "ref": "vault:c", "hosts": ["h.test"], **cred})
    assert why in str(e.value), str(e.value)


def test_the_spec_compiles_brokers_and_ssh_keys():
    from agentvm.spec.models import Credential

    line = "git.test ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    cs = [Credential.model_validate(c) for c in (
        {"name": "a", "env": "A", "ref": "vault:a", "hosts": ["s3.test"], "sigv4": {"accessKeyId": "AKIAX"},
         "broker": {"kind": "aws-sts", "roleArn": "arn:aws:iam::1:role/r", "sessionPolicy": "{}"}},
        {"name": "k", "env": "SSH_AUTH_SOCK", "ref": "vault:k", "hosts": ["git.test"], "ssh": {"knownHosts": [line]}})]
    a, k = compile_credentials(cs)
    assert a.mode == "sigv4" and a.broker.kind == "aws-sts" and a.broker.role_arn.endswith("role/r")
    assert a.broker.duration == 900 and a.broker.session_policy == "{}"
    assert k.mode == "ssh" and k.ssh_known_hosts == (line,) and k.broker is None


def test_aws_sts_asks_for_the_role_the_session_policy_and_the_shortest_duration(monkeypatch):
    """What the gate asks STS (a recording client: moto does not evaluate session policies)."""
    import datetime

    import botocore.session

    calls = []

    class Client:
        def assume_role(self, **kw):
            calls.append(("AssumeRole", kw))
            exp = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=900)
            return {"Credentials": {"AccessKeyId": "ASIAFAKE0001", "SecretAccessKey": "fake-session-secret",
                                    "SessionToken": "fake-session-token", "Expiration": exp}}

        def close(self):
            pass

    made = []
    monkeypatch.setattr(botocore.session.Session, "create_client", lambda self, *a, **kw: made.append(kw) or Client())
    spec = brokers.BrokerSpec(kind="aws-sts", role_arn="arn:aws:iam::1:role/r", session_policy='{"Statement":[]}')
    m = brokers._aws_sts("aws", spec, {"accessKeyId": "AKIAFAKE", "secretAccessKey": "fake-long-lived"}, None)
    assert calls == [("AssumeRole", {"RoleArn": "arn:aws:iam::1:role/r", "RoleSessionName": "agentvm",
                                     "DurationSeconds": 900, "Policy": '{"Statement":[]}'})]
    assert made[0]["aws_access_key_id"] == "AKIAFAKE" and made[0]["aws_secret_access_key"] == "fake-long-lived"
    assert m.value.access_key_id == "ASIAFAKE0001" and 880 < m.lifetime <= 900
