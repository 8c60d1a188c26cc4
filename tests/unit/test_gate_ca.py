"""The gate's per-installation CA: files, modes, reload, refusals, leaves and their cache."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import agentvm.gate.ca as ca_mod
from agentvm.errors import ConfigError
from agentvm.gate.ca import CAError, CAKeyInsecure, CertificateAuthority, normalize_host


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def cadir(tmp_path) -> Path:
    return tmp_path / "state" / "ca"


@pytest.fixture
def ca(cadir) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(cadir)


def test_creates_files_with_modes(ca, cadir):
    assert mode(cadir) == 0o700
    assert mode(cadir / "ca.key") == 0o600
    assert mode(cadir / "ca.crt") == 0o644
    assert ca.cert_path == cadir / "ca.crt"
    assert ca.cert_path.read_bytes() == ca.cert_pem
    assert not [p for p in cadir.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave nothing behind


def test_ca_certificate_fields(ca):
    cert = x509.load_pem_x509_certificate(ca.cert_pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn.startswith("agent-vm egress gate CA ") and len(cn.rsplit(" ", 1)[1]) == 8
    assert cn == ca.name
    assert cert.issuer == cert.subject
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.NameConstraints)
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=3649) < life < dt.timedelta(days=3652)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    cert.verify_directly_issued_by(cert)


def test_reload_keeps_the_same_ca(ca, cadir):
    again = CertificateAuthority.load_or_create(cadir)
    assert again.cert_pem == ca.cert_pem
    assert again.name == ca.name
    assert again.fingerprint_sha256 == ca.fingerprint_sha256
    # a leaf minted by the reloaded CA chains to the original certificate
    leaf = x509.load_pem_x509_certificate(again.leaf("x.test")[0])
    leaf.verify_directly_issued_by(ca.certificate)


def test_two_installations_differ(tmp_path):
    a = CertificateAuthority.load_or_create(tmp_path / "a")
    b = CertificateAuthority.load_or_create(tmp_path / "b")
    assert a.name != b.name and a.fingerprint_sha256 != b.fingerprint_sha256


@pytest.mark.parametrize("bad_mode", [0o644, 0o640, 0o604, 0o660])
def test_key_readable_by_others_is_refused(ca, cadir, bad_mode):
    os.chmod(cadir / "ca.key", bad_mode)
    with pytest.raises(CAKeyInsecure) as info:
        CertificateAuthority.load_or_create(cadir)
    assert "chmod 600" in info.value.hint
    assert isinstance(info.value, ConfigError) and info.value.code == "gate.ca-key-insecure"


def test_owner_only_read_key_is_accepted(ca, cadir):
    os.chmod(cadir / "ca.key", 0o400)
    assert CertificateAuthority.load_or_create(cadir).cert_pem == ca.cert_pem


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the key to another uid")
def test_key_owned_by_another_uid_is_refused(ca, cadir):
    os.chown(cadir / "ca.key", 54321, -1)
    with pytest.raises(CAKeyInsecure, match="owned by uid 54321") as info:
        CertificateAuthority.load_or_create(cadir)
    assert "chown" in info.value.hint


def test_directory_writable_by_others_is_refused(ca, cadir):
    os.chmod(cadir, 0o777)
    with pytest.raises(CAError, match="writable") as info:
        CertificateAuthority.load_or_create(cadir)
    assert "chmod 700" in info.value.hint


def test_certificate_without_key_is_refused(ca, cadir):
    (cadir / "ca.key").unlink()
    with pytest.raises(CAError, match="does not") as info:
        CertificateAuthority.load_or_create(cadir)
    assert "remove" in info.value.hint


def test_key_without_certificate_gets_a_new_certificate(ca, cadir):
    key_before = (cadir / "ca.key").read_bytes()
    (cadir / "ca.crt").unlink()
    again = CertificateAuthority.load_or_create(cadir)
    assert (cadir / "ca.key").read_bytes() == key_before
    assert mode(cadir / "ca.crt") == 0o644
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert again.certificate.public_key().public_bytes(*spki) == ca.certificate.public_key().public_bytes(*spki)


def test_mismatched_pair_is_refused(tmp_path, ca, cadir):
    other = CertificateAuthority.load_or_create(tmp_path / "other")
    (cadir / "ca.crt").write_bytes(other.cert_pem)
    with pytest.raises(CAError, match="does not belong"):
        CertificateAuthority.load_or_create(cadir)


def test_garbage_key_is_refused(ca, cadir):
    (cadir / "ca.key").write_bytes(b"not a key")
    with pytest.raises(CAError, match="not an unencrypted PEM"):
        CertificateAuthority.load_or_create(cadir)


def test_expired_ca_is_refused(ca, cadir):
    later = lambda: dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=3700)  # noqa: E731
    with pytest.raises(CAError, match="expired"):
        CertificateAuthority.load_or_create(cadir, clock=later)


# ----------------------------------------------------------------------------- leaves


def test_leaf_fields(ca):
    cert_pem, key_pem = ca.leaf("allowed.test")
    leaf = x509.load_pem_x509_certificate(cert_pem)
    leaf.verify_directly_issued_by(ca.certificate)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["allowed.test"]
    assert leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    now = dt.datetime.now(dt.timezone.utc)
    assert now - dt.timedelta(hours=1, minutes=1) < leaf.not_valid_before_utc < now - dt.timedelta(minutes=59)
    assert now + dt.timedelta(days=6, hours=23) < leaf.not_valid_after_utc <= now + dt.timedelta(days=7, seconds=5)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(*spki) == leaf.public_key().public_bytes(*spki)


def test_leaf_for_ip_literal_uses_ip_san(ca):
    for host, ip in [("192.0.2.7", "192.0.2.7"), ("[2001:db8::1]", "2001:db8::1"), ("2001:DB8:0::1", "2001:db8::1")]:
        leaf = x509.load_pem_x509_certificate(ca.leaf(host)[0])
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ip)]
        assert san.get_values_for_type(x509.DNSName) == []


def test_long_host_gets_no_common_name(ca):
    host = ".".join(["a" * 60] * 3) + ".test"
    leaf = x509.load_pem_x509_certificate(ca.leaf(host)[0])
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME) == []
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [host]


def test_leaf_cache_same_host_same_cert(ca):
    a = ca.leaf("cache.test")
    assert ca.leaf("cache.test") == a
    assert ca.leaf("CACHE.test.") == a  # normalised before caching
    b = ca.leaf("other.test")
    assert b[0] != a[0]
    assert b[1] == a[1]  # one leaf key per process, shared by every leaf


def test_leaf_cache_is_bounded(ca, monkeypatch):
    monkeypatch.setattr(ca_mod, "LEAF_CACHE_SIZE", 3)
    first = ca.leaf("h0.test")
    for i in range(1, 5):
        ca.leaf(f"h{i}.test")
    assert len(ca._leaves) == 3
    assert ca.leaf("h0.test") != first  # evicted, minted again


def test_leaf_is_renewed_before_it_expires(cadir):
    now = [dt.datetime.now(dt.timezone.utc)]
    ca = CertificateAuthority.load_or_create(cadir, clock=lambda: now[0])
    a = ca.leaf("renew.test")
    now[0] += dt.timedelta(days=4)
    assert ca.leaf("renew.test") == a  # 3 days left: still served
    now[0] += dt.timedelta(days=1, hours=1)
    b = ca.leaf("renew.test")  # under 2 days left: re-minted
    assert b != a
    assert x509.load_pem_x509_certificate(b[0]).not_valid_after_utc > now[0] + dt.timedelta(days=6)


@pytest.mark.parametrize("host", ["", "*.example.com", "a..b", "-a.test", "a-.test", "a b.test", "_dmarc.x.test", "127.1",
                                  "x" * 64 + ".test", "a.test/", "a\x00.test", ".", " a.test", "a" * 250 + ".test"])
def test_invalid_hosts_are_refused(ca, host):
    with pytest.raises(ValueError):
        ca.leaf(host)


def test_normalize_host_is_the_policys():
    """One canonical form of a host for rules and certificates (a name the policy would refuse
    never gets a leaf; a unicode name gets the leaf of its A-label, the name TLS carries)."""
    from agentvm.gate import policy

    assert normalize_host is policy.normalize_host
    assert normalize_host("Example.COM.") == "example.com"
    assert normalize_host("[::FFFF:1.2.3.4]") == "::ffff:102:304"
    assert normalize_host("10.0.0.1") == "10.0.0.1"


def test_a_unicode_name_gets_the_leaf_of_its_a_label(ca):
    assert ca.leaf("bücher.test") == ca.leaf("xn--bcher-kva.test")


def test_leaf_files(ca, cadir):
    certfile, keyfile = ca.leaf_files("files.test")
    leaves = cadir / "leaves"
    assert certfile.parent == leaves and keyfile.parent == leaves
    assert mode(leaves) == 0o700
    assert mode(keyfile) == 0o600 and mode(certfile) == 0o600
    assert certfile.read_bytes() == ca.leaf("files.test")[0]
    assert keyfile.read_bytes() == ca.leaf("files.test")[1]
    assert ca.leaf_files("FILES.test") == (certfile, keyfile)  # reused
    other_cert, other_key = ca.leaf_files("other-files.test")
    assert other_key == keyfile and other_cert != certfile
    certfile.unlink()
    assert ca.leaf_files("files.test") == (certfile, keyfile) and certfile.exists()  # rewritten
    # the files load into an ssl context
    import ssl

    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(certfile), str(keyfile))
    ca.remove_leaf_files()
    assert list(leaves.iterdir()) == []
    assert ca.leaf_files("files.test")[0].exists()  # recreated on demand


def test_stale_leaf_files_are_pruned_on_load(ca, cadir):
    certfile, keyfile = ca.leaf_files("stale.test")
    old = 1_000_000_000
    os.utime(certfile, (old, old))
    CertificateAuthority.load_or_create(cadir)
    assert not certfile.exists() and keyfile.exists()


# ----------------------------------------------------------------------------- trust bundle


def test_bundle_with_system(ca, tmp_path):
    system = tmp_path / "system.pem"
    system.write_bytes(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----")  # no final newline
    bundle = ca.bundle_with_system(system)
    assert bundle.startswith(system.read_bytes() + b"\n")
    assert bundle.endswith(ca.cert_pem.strip() + b"\n")
    assert ca.name.encode() in bundle
    system.write_bytes(bundle)
    assert ca.bundle_with_system(system) == bundle  # not appended twice


def test_bundle_with_real_system_store_parses(ca):
    real = ca_mod.SYSTEM_BUNDLE
    if not real.exists():
        pytest.skip("no system CA bundle on this host")
    import ssl

    bundle = ca.bundle_with_system(real)
    assert bundle.endswith(ca.cert_pem.strip() + b"\n")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=bundle.decode("ascii", "replace"))
    assert ctx.cert_store_stats()["x509_ca"] > 1


def test_bundle_missing_system_store(ca, tmp_path):
    with pytest.raises(CAError, match="cannot read the system CA bundle"):
        ca.bundle_with_system(tmp_path / "nope.pem")


def test_import_is_cheap():
    code = (
        "import sys; import agentvm.gate.ca, agentvm.gate.tls; "
        "bad = [m for m in ('cryptography', 'ssl') if m in sys.modules]; print(bad)"
    )
    baseline = subprocess.run([sys.executable, "-c", "import sys; print('ssl' in sys.modules)"],
                              capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    expected = "['ssl']" if baseline == "True" else "[]"
    assert out == expected
