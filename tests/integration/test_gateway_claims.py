"""Per-claim identities at the real gateway on loopback (agentvm.gateway.enroll).

Two claims of ONE template (the same pod spec, the same bridge command): each bridge waits for
its claim's bootstrap token in a downwardAPI-style annotations file, makes its own key,
enrols at the gateway's enrolment port and gets its own certificate (SAN = the claim). Then
each is served with its own policy and decision log; revoking one refuses its next request,
its renewal and a re-enrolment, while its sibling goes on. Tokens: good once, for their
identity only, not after expiry; a CSR cannot choose the identity; the issuer cannot mint
outside its namespace."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentvm.gate.server import new_event_loop
from agentvm.gateway import enroll as en
from agentvm.gateway import server as gs
from agentvm.gateway.ca import GatewayCA, Issuer
from agentvm.gateway.config import edit_revocations
from agentvm.gateway.identity import Identity
from tests.integration.gate_upstreams import make_test_ca
from tests.integration.test_gateway import Recorder, _agent

SECRET = "sk-test-real-value-of-hello-0000009"  # obviously fake test values
SECRET_N = "sk-test-real-value-of-narrow-000008"
PH = "sk-agentvm-placeholder-hello-zzzzzzzzzzzz"
PH_N = "sk-agentvm-placeholder-narrow-wwwwwwwwwww"

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


class Gateway:
    def __init__(self, tmp: Path, cfg: Path, ca_dir: Path, issuer: Path, key: Path, replica: str = "r1") -> None:
        self.loop = new_event_loop()
        self.stop = asyncio.Event()
        got: dict = {}
        self.done = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(gs.serve(
                    cfg, ca_dir, "127.0.0.1", 0, state_dir=tmp / f"state-{replica}", audit_dir=tmp / "audit",
                    replica=replica, ready=lambda a, g: got.update(addr=a, gate=g), stop=self.stop,
                    issuer_dir=issuer, enroll_key=key, enroll_port=0, cert_lifetime=600))
            finally:
                self.done.set()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while "addr" not in got:
            assert time.monotonic() < deadline and not self.done.is_set(), "the gateway did not start"
            time.sleep(0.02)
        self.addr, self.gate = got["addr"], got["gate"]
        self.enroll_addr = self.gate.enroll_addr
        self.state = tmp / f"state-{replica}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.done.wait(10)


class Pod:
    """One sandbox pod of the template as far as the network goes: the proxy bridge (its own
    loop and thread) with an identity directory only it writes and the annotations file the
    kubelet would project; the agent container is curl with HTTPS_PROXY set to the bridge."""

    def __init__(self, world, name: str) -> None:
        from agentvm.gateway.bridge import bridge

        self.dir = world["tmp"] / "pods" / name
        self.identity = self.dir / "identity"
        self.annotations = self.dir / "podinfo" / "annotations"
        self.annotations.parent.mkdir(parents=True)
        self.logs: list[str] = []
        self.loop = new_event_loop()
        self.stop = asyncio.Event()
        got: dict = {}
        gw = world["gw"]

        async def main() -> None:
            await asyncio.gather(
                bridge(("127.0.0.1", 0), gw.addr, "localhost", self.identity, ready=lambda a: got.update(addr=a),
                       stop=self.stop),
                en.keep_enrolled(gw.enroll_addr, "localhost", world["ca"].cert_path, self.annotations, self.identity,
                                 poll=0.05, log=self.logs.append, stop=self.stop))

        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while "addr" not in got:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        self.port = got["addr"][1]
        self.world = world

    def claim(self, token: str) -> dict:
        """What the controller and the kubelet do on a claim: the annotation appears in the file."""
        tmp = self.annotations.with_suffix(".tmp")
        tmp.write_text(f'kubernetes.io/config.seen="x"\n{en.ANNOTATION}={json.dumps(token)}\n')
        os.replace(tmp, self.annotations)
        deadline = time.monotonic() + 15
        while en.held(self.identity) is None:
            assert time.monotonic() < deadline, f"not enrolled: {self.logs}"
            time.sleep(0.05)
        return en.held(self.identity)

    def curl(self, host: str, path: str, auth: str | None = None) -> subprocess.CompletedProcess:
        up = self.world["up"]
        cmd = ["curl", "-sS", "--max-time", "10", "--proxy", f"http://127.0.0.1:{self.port}",
               "--cacert", str(self.world["gw"].gate.ca.cert_path), "-o", "/dev/null", "-w", "%{http_code}"]
        if auth:
            cmd += ["-H", f"Authorization: Bearer {auth}"]
        return subprocess.run(cmd + [f"https://{host}:{up.port}{path}"], capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwclaims")
    test_ca, cert, key = make_test_ca(tmp / "upca")
    up = Recorder(cert, key)
    ca = GatewayCA.create(tmp / "ca")
    files = ca.make_issuer(tmp / "issuer", namespaces=("team",))
    cfg = tmp / "cfg"
    (cfg / "agents").mkdir(parents=True)
    (cfg / "agents" / "hello.yaml").write_text(_agent("hello", "api.test", up.port, test_ca, "TOK"))
    (cfg / "agents" / "narrow.yaml").write_text(_agent("hello-narrow", "other.test", up.port, test_ca, "TOK"))
    os.environ["GWCLAIM_SECRET"], os.environ["GWCLAIM_SECRET_N"] = SECRET, SECRET_N
    # one template (hello); the gateway's source gives claim hello-b a narrower policy of its own
    (cfg / "gateway.yaml").write_text(f"""apiVersion: agentvm/v1
kind: Gateway
agents:
  hello: {{file: agents/hello.yaml, placeholders: {{TOK: {PH}}}, credentials: {{TOK: "env:GWCLAIM_SECRET"}}}}
  hello-narrow: {{file: agents/narrow.yaml, placeholders: {{TOK: {PH_N}}}, credentials: {{TOK: "env:GWCLAIM_SECRET_N"}}}}
identities:
  - {{match: "agentvm://team/hello-b", agent: hello-narrow}}
  - {{match: "agentvm://team/hello-*", agent: hello}}
  - {{match: "agentvm://other/hello-*", agent: hello}}
""")
    gw = Gateway(tmp, cfg, tmp / "ca", tmp / "issuer", files["enroll.key"])
    w = {"tmp": tmp, "up": up, "ca": ca, "cfg": cfg, "gw": gw, "key": en.load_key(files["enroll.key"]),
         "issuer": tmp / "issuer"}
    pods = {n: Pod(w, n) for n in ("hello-a", "hello-b")}
    w["pods"] = pods
    yield w
    for p in pods.values():
        p.close()
    gw.close()
    up.close()
    for k in ("GWCLAIM_SECRET", "GWCLAIM_SECRET_N"):
        os.environ.pop(k, None)


def _log(world, ident: str) -> list[dict]:
    gw = world["gw"]
    for ep in list(gw.gate.endpoints.values()):
        gw.loop.call_soon_threadsafe(ep.flush_log)
    time.sleep(0.2)
    p = gw.state / "logs" / "r1" / f"{Identity.parse(ident).key}.egress.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _san(pem_path: Path) -> list[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificates(pem_path.read_bytes())[0]
    return [str(u) for u in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            .get_values_for_type(x509.UniformResourceIdentifier)]


def test_two_claims_of_one_template_get_their_own_identity_policy_and_log(world):
    a, b = world["pods"]["hello-a"], world["pods"]["hello-b"]
    # a warm pod not claimed yet holds no identity: its agent's requests get 502 from the bridge
    r = a.curl("api.test", "/before-claim", PH)
    assert r.returncode != 0 and "502" in r.stderr, r
    assert "/before-claim" not in world["up"].auth
    got_a = a.claim(en.make_token(world["key"], Identity("team", "hello-a")))
    got_b = b.claim(en.make_token(world["key"], Identity("team", "hello-b")))
    assert got_a["identity"] == "agentvm://team/hello-a" and got_b["identity"] == "agentvm://team/hello-b"
    assert got_a["serial"] != got_b["serial"]
    ca_, cb_ = en.current(a.identity), en.current(b.identity)
    assert _san(ca_ / "tls.crt") == ["agentvm://team/hello-a"]
    assert _san(cb_ / "tls.crt") == ["agentvm://team/hello-b"]
    assert (ca_ / "tls.key").stat().st_mode & 0o077 == 0
    assert (ca_ / "tls.key").read_bytes() != (cb_ / "tls.key").read_bytes()
    # a: the template's policy (api.test, its credential swapped in)
    assert a.curl("api.test", "/a-ok", PH).stdout == "200"
    assert world["up"].auth.pop("/a-ok") == f"Bearer {SECRET}"
    assert a.curl("other.test", "/a-other").stdout != "200" and "/a-other" not in world["up"].auth
    # b: its own (narrower) policy and credential, from the same pod template
    assert b.curl("api.test", "/b-api", PH).stdout != "200" and "/b-api" not in world["up"].auth
    assert b.curl("other.test", "/b-ok", PH_N).stdout == "200"
    assert world["up"].auth.pop("/b-ok") == f"Bearer {SECRET_N}"
    # each its own decision log, with its enrolment in it
    la, lb = _log(world, "agentvm://team/hello-a"), _log(world, "agentvm://team/hello-b")
    assert any(r["rule"] == "identity:enrolled" for r in la) and any(r["rule"] == "identity:enrolled" for r in lb)
    assert any(r.get("path") == "/a-ok" for r in la) and not any(r.get("path") == "/a-ok" for r in lb)
    assert any(r["host"] == "api.test" and r["verdict"] == "deny" for r in lb)
    assert not any(r["host"] == "api.test" and r["verdict"] == "deny" for r in la)
    # and each its own verifiable audit chain, its enrolment the first record
    from agentvm.gateway.audit import verify

    time.sleep(1.5)  # (heads are written at most every second)
    for ident, path in (("team.hello-a", "/a-ok"), ("team.hello-b", "/b-ok")):
        merged: list = []
        v = verify(world["tmp"] / "audit", ident, merged=merged)
        assert v.ok, v.problems
        assert merged[0]["rule"] == "identity:enrolled" and all(r["sandbox"] == ident for r in merged)
        assert any(r.get("path") == path for r in merged)


def test_renewal_over_mtls_keeps_the_identity_with_a_new_key(world):
    a = world["pods"]["hello-a"]
    if en.held(a.identity) is None:
        a.claim(en.make_token(world["key"], Identity("team", "hello-a")))
    out = world["tmp"] / "renew-copy"
    shutil.copytree(a.identity, out, symlinks=True)
    before = en.held(out)
    old_gen = en.current(out).resolve()
    got = en.renew(world["gw"].enroll_addr, "localhost", world["ca"].cert_path, out)
    assert got["identity"] == "agentvm://team/hello-a" and got["serial"] != before["serial"]
    assert en.held(out)["serial"] == got["serial"] and not old_gen.exists()  # swapped whole, the old one gone
    assert (en.current(out) / "tls.key").read_bytes() != (en.current(a.identity) / "tls.key").read_bytes()
    # the bridge's own client context takes the renewed pair
    from agentvm.gateway.bridge import client_context

    client_context(out)
    # a renewal needs the certificate it renews: without one it is refused
    import ssl

    status, body = en._post(world["gw"].enroll_addr, "localhost", ssl.create_default_context(
        cafile=str(world["ca"].cert_path)), "/v1/renew", {"csr": en._csr()[1].decode()})
    assert status == 403 and body["error"] == "identity:none"


def test_tokens_are_good_once_for_their_identity_only(world):
    gw, key, cafile = world["gw"], world["key"], world["ca"].cert_path
    tok = en.make_token(key, Identity("team", "hello-c"))
    got = en.enroll(gw.enroll_addr, "localhost", cafile, tok, world["tmp"] / "c1")
    assert got["identity"] == "agentvm://team/hello-c"
    with pytest.raises(en.Refused) as exc:
        en.enroll(gw.enroll_addr, "localhost", cafile, tok, world["tmp"] / "c2")
    assert exc.value.rule_id == "enroll:token-used"
    # the identity inside a token cannot be swapped (the MAC covers it)
    parts = en.make_token(key, Identity("team", "hello-d")).split(".")
    parts[1] = base64.urlsafe_b64encode(b"agentvm://team/hello-a").decode().rstrip("=")
    with pytest.raises(en.Refused) as exc:
        en.enroll(gw.enroll_addr, "localhost", cafile, ".".join(parts), world["tmp"] / "c3")
    assert exc.value.rule_id == "enroll:token-invalid"
    # a token made with another key, an expired one, one for an identity no agent is mapped to
    with pytest.raises(en.Refused) as exc:
        en.enroll(gw.enroll_addr, "localhost", cafile, en.make_token(b"k" * 32, Identity("team", "hello-e")),
                  world["tmp"] / "c4")
    assert exc.value.rule_id == "enroll:token-invalid"
    with pytest.raises(en.Refused) as exc:
        en.enroll(gw.enroll_addr, "localhost", cafile, en.make_token(key, Identity("team", "hello-f"), ttl=-5),
                  world["tmp"] / "c5")
    assert exc.value.rule_id == "enroll:token-expired"
    with pytest.raises(en.Refused) as exc:
        en.enroll(gw.enroll_addr, "localhost", cafile, en.make_token(key, Identity("team", "nobody-1")),
                  world["tmp"] / "c6")
    assert exc.value.rule_id == "identity:unknown"
    assert en.held(world["tmp"] / "c6") is None


def test_a_csr_cannot_choose_its_identity(world):
    """The request names hello-a in its own SAN; the certificate names the token's identity."""
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
           .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("agentvm://team/hello-a")]), False)
           .sign(k, hashes.SHA256()))
    status, got = en._post(world["gw"].enroll_addr, "localhost", ssl.create_default_context(cafile=str(world["ca"].cert_path)),
                           "/v1/enroll", {"token": en.make_token(world["key"], Identity("team", "hello-g")),
                                          "csr": csr.public_bytes(serialization.Encoding.PEM).decode()})
    assert status == 200 and got["identity"] == "agentvm://team/hello-g"
    p = world["tmp"] / "g.pem"
    p.write_text(got["certificate"])
    assert _san(p) == ["agentvm://team/hello-g"]


def test_the_issuer_cannot_mint_outside_its_namespace(world):
    """The issuer is name-constrained to team: a certificate it signs for another namespace (the
    source maps agentvm://other/hello-* to an agent) fails the gateway's TLS verification."""
    from tests.integration.test_gateway import Client

    got = en.enroll(world["gw"].enroll_addr, "localhost", world["ca"].cert_path,
                    en.make_token(world["key"], Identity("other", "hello-x")), world["tmp"] / "ox")
    assert got["identity"] == "agentvm://other/hello-x"  # signed (the issuer does not check) ...
    w = dict(world)
    c = Client(w, en.current(world["tmp"] / "ox") / "tls.crt", en.current(world["tmp"] / "ox") / "tls.key")
    try:  # ... and refused at the handshake (or on first use, TLS 1.3 reports the alert late)
        with pytest.raises((ConnectionError, OSError)):
            c.connect()
    finally:
        c.close()


def test_a_revoked_claim_is_refused_while_its_sibling_works(world):
    a, b = world["pods"]["hello-a"], world["pods"]["hello-b"]
    for p, n in ((a, "hello-a"), (b, "hello-b")):
        if en.held(p.identity) is None:
            p.claim(en.make_token(world["key"], Identity("team", n)))
    assert a.curl("api.test", "/a-before", PH).stdout == "200"
    assert b.curl("other.test", "/b-before", PH_N).stdout == "200"
    edit_revocations(world["cfg"], identities=["agentvm://team/hello-a"])
    try:
        r = a.curl("api.test", "/a-after", PH)
        assert r.stdout == "403" or r.returncode != 0
        assert "/a-after" not in world["up"].auth
        assert b.curl("other.test", "/b-after", PH_N).stdout == "200"
        assert world["up"].auth.pop("/b-after") == f"Bearer {SECRET_N}"
        assert any(x["rule"] == "identity:revoked" for x in _log(world, "agentvm://team/hello-a"))
        # no way back in: its renewal and a fresh token are refused too
        with pytest.raises(en.Refused) as exc:
            en.renew(world["gw"].enroll_addr, "localhost", world["ca"].cert_path, a.identity)
        assert exc.value.rule_id == "identity:revoked"
        with pytest.raises(en.Refused) as exc:
            en.enroll(world["gw"].enroll_addr, "localhost", world["ca"].cert_path,
                      en.make_token(world["key"], Identity("team", "hello-a")), world["tmp"] / "again")
        assert exc.value.rule_id == "identity:revoked"
    finally:
        import yaml

        doc = yaml.safe_load((world["cfg"] / "gateway.yaml").read_text())
        doc.pop("revoked", None)
        (world["cfg"] / "gateway.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_the_issuer_files_and_its_constraint(world):
    iss = Issuer(world["issuer"])
    assert iss.not_after > __import__("datetime").datetime.now(__import__("datetime").timezone.utc)
    assert (world["issuer"] / "issuer.key").stat().st_mode & 0o077 == 0
    assert (world["issuer"] / "enroll.key").stat().st_mode & 0o077 == 0


def test_the_bridge_loop_renews_before_expiry_and_keeps_serving(world, monkeypatch):
    """keep_enrolled renews at RENEW_AT of the lifetime (0 here: at once) over mTLS, each time
    a new key and serial, keeping only the newest generation of files."""
    monkeypatch.setattr(en, "RENEW_AT", 0.0)
    out, ann = world["tmp"] / "loop" / "identity", world["tmp"] / "loop" / "annotations"
    ann.parent.mkdir(parents=True)
    ann.write_text(f"{en.ANNOTATION}={json.dumps(en.make_token(world['key'], Identity('team', 'hello-r')))}\n")
    logs: list[str] = []
    loop, stop = new_event_loop(), asyncio.Event()
    t = threading.Thread(target=lambda: loop.run_until_complete(en.keep_enrolled(
        world["gw"].enroll_addr, "localhost", world["ca"].cert_path, ann, out, poll=0.05, log=logs.append,
        stop=stop)), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while sum(m.startswith("renewed") for m in logs) < 2:
            assert time.monotonic() < deadline, logs
            time.sleep(0.05)
    finally:
        monkeypatch.setattr(en, "RENEW_AT", 2 / 3)
        loop.call_soon_threadsafe(stop.set)
        t.join(15)
    assert logs[0].startswith("enrolled as agentvm://team/hello-r")
    serials = [m.split("certificate ")[1].split()[0] for m in logs if "certificate " in m]
    assert len(set(serials)) == len(serials) >= 3
    assert [p.name for p in out.iterdir() if p.name.startswith("gen-")] == [en.current(out).resolve().name]


def test_a_claim_revoked_in_revoked_yaml_cannot_renew(world):
    """The revocation `agentvm k8s rm --revoke` writes (revoked.yaml beside gateway.yaml) is
    honoured by the running gateway on the next request (here: a renewal)."""
    from agentvm.gateway.config import add_revocations

    out = world["tmp"] / "ry"
    en.enroll(world["gw"].enroll_addr, "localhost", world["ca"].cert_path,
              en.make_token(world["key"], Identity("team", "hello-ry")), out)
    assert en.renew(world["gw"].enroll_addr, "localhost", world["ca"].cert_path, out)["identity"] == "agentvm://team/hello-ry"
    (world["cfg"] / "revoked.yaml").write_text(add_revocations(None, identities=["agentvm://team/hello-ry"]))
    try:
        with pytest.raises(en.Refused) as exc:
            en.renew(world["gw"].enroll_addr, "localhost", world["ca"].cert_path, out)
        assert exc.value.rule_id == "identity:revoked"
        b = world["pods"]["hello-b"]
        if en.held(b.identity) is None:
            b.claim(en.make_token(world["key"], Identity("team", "hello-b")))
        assert b.curl("other.test", "/b-ry", PH_N).stdout == "200"  # the sibling goes on
    finally:
        (world["cfg"] / "revoked.yaml").unlink()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_processes_as_rendered_enrol_and_serve(world):
    """`agentvm gateway serve --issuer --enroll-key` and `agentvm gateway bridge
    --enroll-token-file` as processes (the command lines the render gives the gateway and the
    pod), the token from `agentvm gateway token`: curl through the bridge is served as the
    claim's identity."""
    import sys

    tmp = world["tmp"] / "cli"
    tmp.mkdir()
    gport, eport, bport = _free_port(), _free_port(), _free_port()
    py = [sys.executable, "-m", "agentvm"]
    env = dict(os.environ, AGENTVM_HOME=str(tmp / "home"))
    gw = subprocess.Popen(py + ["gateway", "serve", "--config", str(world["cfg"]), "--ca", str(world["tmp"] / "ca"),
                                "--listen", f"127.0.0.1:{gport}", "--state", str(tmp / "state"), "--replica", "cli",
                                "--issuer", str(world["issuer"]), "--enroll-key", str(world["issuer"] / "enroll.key"),
                                "--enroll-port", str(eport)], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp / "gw.err", "wb"))
    ann = tmp / "podinfo" / "annotations"
    ann.parent.mkdir()
    br = subprocess.Popen(py + ["gateway", "bridge", "--listen", f"127.0.0.1:{bport}", "--gateway", f"127.0.0.1:{gport}",
                                "--server-name", "localhost", "--identity", str(tmp / "identity"),
                                "--enroll-token-file", str(ann), "--gateway-ca", str(world["ca"].cert_path),
                                "--enroll-port", str(eport)], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp / "bridge.err", "wb"))
    try:
        tok = subprocess.run(py + ["gateway", "token", "agentvm://team/hello-cli", "--enroll-key",
                                   str(world["issuer"] / "enroll.key")], capture_output=True, text=True, timeout=60, env=env)
        assert tok.returncode == 0, tok.stderr
        ann.write_text(f"{en.ANNOTATION}={json.dumps(tok.stdout.strip())}\n")
        deadline = time.monotonic() + 60
        while en.held(tmp / "identity") is None:
            assert gw.poll() is None and br.poll() is None, (tmp / "gw.err").read_text() + (tmp / "bridge.err").read_text()
            assert time.monotonic() < deadline, (tmp / "bridge.err").read_text()
            time.sleep(0.1)
        assert en.held(tmp / "identity")["identity"] == "agentvm://team/hello-cli"
        up = world["up"]
        r = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxy", f"http://127.0.0.1:{bport}", "--cacert",
                            str(tmp / "state" / "gate" / "ca" / "ca.crt"), "-H", f"Authorization: Bearer {PH}",
                            "-o", "/dev/null", "-w", "%{http_code}", f"https://api.test:{up.port}/via-cli"],
                           capture_output=True, text=True, timeout=30)
        assert r.stdout == "200", (r.stderr, (tmp / "gw.err").read_text())
        assert world["up"].auth.pop("/via-cli") == f"Bearer {SECRET}"
        assert "enrolled as agentvm://team/hello-cli" in (tmp / "bridge.err").read_text()
    finally:
        for p in (br, gw):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
