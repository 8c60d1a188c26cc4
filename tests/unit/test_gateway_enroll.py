"""Per-claim enrolment without a network: bootstrap tokens (bound to one identity, expiring,
MAC'd), the downwardAPI annotations file as the kubelet writes it, and the issuer (an
intermediate of the gateway CA that signs only a P-256 key whose request proves possession,
with the identity it is told - never the request's)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from agentvm.errors import ConfigError
from agentvm.gateway import enroll as en
from agentvm.gateway.ca import GatewayCA, Issuer
from agentvm.gateway.identity import Identity

KEY = bytes(range(32))


def test_a_token_names_one_identity_and_expires():
    tok = en.make_token(KEY, Identity("team", "hello-1"), ttl=60, now=1000)
    ident, nonce, exp = en.check_token(KEY, tok, now=1030)
    assert ident == Identity("team", "hello-1") and exp == 1060 and nonce
    with pytest.raises(en.Refused) as e:
        en.check_token(KEY, tok, now=1061)
    assert e.value.rule_id == "enroll:token-expired"
    v, ident_b64, exp_s, nonce, mac = tok.split(".")
    for forged in (".".join([v, base64.urlsafe_b64encode(b"agentvm://team/hello-2").decode().rstrip("="), exp_s, nonce, mac]),
                   ".".join([v, ident_b64, str(int(exp_s) + 3600), nonce, mac]),
                   ".".join([v, ident_b64, exp_s, nonce + "x", mac]),
                   ".".join(["v2", ident_b64, exp_s, nonce, mac]),
                   "", "v1.a.b", tok + ".x"):
        with pytest.raises(en.Refused) as e:
            en.check_token(KEY, forged, now=1030)
        assert e.value.rule_id == "enroll:token-invalid"
    with pytest.raises(en.Refused):
        en.check_token(b"another key of 32 bytes at least!", tok, now=1030)
    assert en.make_token(KEY, Identity("team", "hello-1")) != en.make_token(KEY, Identity("team", "hello-1"))


def test_the_enrolment_key_file(tmp_path):
    (tmp_path / "k").write_text(KEY.hex() + "\n")
    assert en.load_key(tmp_path / "k") == KEY
    (tmp_path / "short").write_text("abcd")
    for bad in ("short", "missing"):
        with pytest.raises(ConfigError):
            en.load_key(tmp_path / bad)


def test_the_annotations_file_as_the_kubelet_writes_it(tmp_path):
    tok = en.make_token(KEY, Identity("team", "hello-1"))
    p = tmp_path / "annotations"
    p.write_text('kubectl.kubernetes.io/last-applied-configuration="{\\"a\\":\\"b=c\\"}"\n'
                 f"{en.ANNOTATION}={json.dumps(tok)}\nagentvm.dev/identity=\"agentvm://team/hello-1\"\n")
    assert en.read_annotation(p) == tok
    assert en.read_annotation(p, "agentvm.dev/identity") == "agentvm://team/hello-1"
    assert en.read_annotation(tmp_path / "none") is None
    p.write_text('other="1"\n')
    assert en.read_annotation(p) is None  # a warm pod not claimed yet


def _csr(key=None, *, san: str | None = None) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(san)]), False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_the_issuer_signs_the_identity_it_is_told_for_a_key_proven_held(tmp_path):
    ca = GatewayCA.create(tmp_path / "ca")
    files = ca.make_issuer(tmp_path / "iss", namespaces=("team",))
    assert {p.name for p in files.values()} == {"issuer.pem", "issuer.key", "ca.pem", "enroll.key"}
    assert (tmp_path / "iss" / "issuer.key").stat().st_mode & 0o077 == 0
    iss = Issuer(tmp_path / "iss")
    chain, serial, not_after = iss.sign_csr(_csr(san="agentvm://team/victim"), Identity("team", "hello-1"), lifetime=600)
    certs = x509.load_pem_x509_certificates(chain)
    assert len(certs) == 2  # the certificate and the issuer (the gateway trusts only the root)
    leaf = certs[0]
    assert leaf.serial_number == serial
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier) == ["agentvm://team/hello-1"]
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).total_seconds() <= 600 + 60
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    nc = certs[1].extensions.get_extension_for_class(x509.NameConstraints).value
    assert [str(u.value) for u in nc.permitted_subtrees] == ["team"]
    # refused: an RSA key, a request its key did not sign, no request at all
    with pytest.raises(ConfigError):
        iss.sign_csr(_csr(rsa.generate_private_key(public_exponent=65537, key_size=2048)), Identity("team", "x"))
    good = x509.load_pem_x509_csr(_csr())
    forged = good.public_bytes(serialization.Encoding.DER)
    forged = forged[:-8] + bytes(8)  # the signature's tail zeroed
    with pytest.raises(ConfigError):
        iss.sign_csr(x509.load_der_x509_csr(forged).public_bytes(serialization.Encoding.PEM), Identity("team", "x"))
    with pytest.raises(ConfigError):
        iss.sign_csr(b"not a request", Identity("team", "x"))


def test_a_ca_made_for_no_intermediate_is_refused_clearly(tmp_path):
    import datetime as dt

    from cryptography.x509.oid import NameOID

    from agentvm.gateway.ca import _key_pem

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(key, hashes.SHA256()))
    d = tmp_path / "old"
    d.mkdir(mode=0o700)
    (d / "ca.key").write_bytes(_key_pem(key))
    (d / "ca.key").chmod(0o600)
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ConfigError) as e:
        GatewayCA.load(d).make_issuer(tmp_path / "iss")
    assert e.value.code == "gateway.ca-invalid" and "pathlen 0" in e.value.message


def test_revocations_kept_apart_in_revoked_yaml(tmp_path):
    """``revoked.yaml`` beside gateway.yaml (a ConfigMap key the render never writes) adds to the
    revocations; one that does not parse refuses everything (fail closed)."""
    from agentvm.gateway.config import Registry, add_revocations
    from agentvm.k8s.cluster import revoke_request

    (tmp_path / "a.yaml").write_text("""apiVersion: agentvm/v1
kind: Agent
metadata: {name: hello}
spec:
  command: ["true"]
  egress:
    allow:
      - {host: api.test, ports: [443]}
""")
    (tmp_path / "gateway.yaml").write_text("""apiVersion: agentvm/v1
kind: Gateway
agents:
  hello: {file: a.yaml}
identities:
  - {match: "agentvm://team/hello-*", agent: hello}
""")
    reg = Registry(tmp_path)
    assert reg.admit(Identity("team", "hello-1"), None).name == "hello"
    text = add_revocations(None, identities=["agentvm://team/hello-1"])
    assert add_revocations(text, identities=["team/hello-1"]) == text  # idempotent
    (tmp_path / "revoked.yaml").write_text(text)
    assert reg.admit(Identity("team", "hello-1"), None).rule_id == "identity:revoked"
    assert reg.admit(Identity("team", "hello-2"), None).name == "hello"
    (tmp_path / "revoked.yaml").write_text("identities: [agentvm://team/hello-1]\nsurprise: 1\n")
    assert reg.admit(Identity("team", "hello-2"), None).rule_id == "gateway:config-invalid"
    (tmp_path / "revoked.yaml").unlink()
    assert reg.admit(Identity("team", "hello-1"), None).name == "hello"
    # what `k8s rm --revoke` patches: that one key, the existing revocations kept
    req = revoke_request("agentvm://team/hello-2", "team", {"revoked.yaml": text, "gateway.yaml": "untouched"})
    assert req["name"] == "agentvm-gateway-config" and req["namespace"] == "team"
    assert set(req["body"]["data"]) == {"revoked.yaml"}
    import yaml

    assert yaml.safe_load(req["body"]["data"]["revoked.yaml"])["identities"] == ["agentvm://team/hello-1",
                                                                                 "agentvm://team/hello-2"]
