"""The gateway's own CA: it mints one short-lived client certificate per sandbox (or per claim)
with the sandbox's identity as the certificate's only URI SAN, and the gateway's server
certificate. Separate from the gate's interception CA (``agentvm.gate.ca``): that one signs
leaves for upstream names inside terminated tunnels and is trusted by sandboxes; this one
is trusted only by the gateway, for client authentication.

Files in the CA directory (0700): ``ca.pem``, ``ca.key`` (0600), ``server.pem``, ``server.key``.
Keys are ECDSA P-256 (a mint is one key generation and one signature: see
bench/bench_gateway.py for certificates per second)."""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import ConfigError
from agentvm.gateway.identity import Identity

DEFAULT_LIFETIME = 3600.0  # seconds: a sandbox's certificate lives an hour unless asked otherwise
MAX_LIFETIME = 7 * 86400.0
ISSUER_LIFETIME = 30 * 86400.0  # the gateway's intermediate: a month, then a new one
CA_LIFETIME_DAYS = 365
SKEW = 60  # seconds a certificate is valid before it was made (clocks of replicas and nodes differ)


@dataclass(frozen=True)
class Minted:
    identity: Identity
    cert_pem: bytes
    key_pem: bytes
    serial: int
    not_after: _dt.datetime

    @property
    def serial_hex(self) -> str:
        return format(self.serial, "x")


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


class GatewayCA:
    def __init__(self, directory: Path, key, cert) -> None:
        self.directory = Path(directory)
        self._key, self._cert = key, cert

    # -- files ---------------------------------------------------------------------------
    @property
    def cert_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert_path(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key_path(self) -> Path:
        return self.directory / "server.key"

    @property
    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def create(cls, directory: Path, *, server_names: tuple[str, ...] = ("localhost", "127.0.0.1"),
               name: str | None = None) -> "GatewayCA":
        """A new CA (refuses to overwrite one) and its server certificate for ``server_names``
        (DNS names or IP addresses: the gateway Service's names)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        directory = Path(directory)
        if (directory / "ca.key").exists():
            raise ConfigError(f"{directory} already holds a gateway CA", hint="use it, or choose another --dir",
                              code="gateway.ca-invalid")
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name or f"agentvm gateway CA {secrets.token_hex(4)}")])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _dt.timedelta(seconds=SKEW))
                .not_valid_after(now + _dt.timedelta(days=CA_LIFETIME_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)  # (1: an issuer below it)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(ski, critical=False)
                .sign(key, hashes.SHA256()))
        ca = cls(directory, key, cert)
        _write(directory / "ca.key", _key_pem(key), 0o600)
        _write(directory / "ca.pem", ca.cert_pem, 0o644)
        skey, scert = ca._issue(server_names, server=True, lifetime=CA_LIFETIME_DAYS * 86400.0)
        _write(directory / "server.key", skey, 0o600)
        _write(directory / "server.pem", scert, 0o644)
        return ca

    @classmethod
    def load(cls, directory: Path) -> "GatewayCA":
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        directory = Path(directory)
        kp = directory / "ca.key"
        try:
            st = os.stat(kp)
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(f"{kp} is readable by others", hint=f"chmod 600 {kp}", code="gateway.ca-invalid")
            key = serialization.load_pem_private_key(kp.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        except FileNotFoundError as exc:
            raise ConfigError(f"no gateway CA in {directory} ({exc.filename} missing)",
                              hint=f"agentvm gateway init --dir {directory}", code="gateway.ca-invalid") from None
        except ValueError as exc:
            raise ConfigError(f"the gateway CA in {directory} is not usable: {exc}", code="gateway.ca-invalid") from None
        return cls(directory, key, cert)

    # -- minting -------------------------------------------------------------------------
    def mint(self, identity: Identity, *, lifetime: float = DEFAULT_LIFETIME,
             now: _dt.datetime | None = None) -> Minted:
        """A client certificate for ``identity``: its URI as the only SAN, clientAuth only,
        valid for ``lifetime`` seconds (a minute of skew before now)."""
        if not 0 < lifetime <= MAX_LIFETIME:
            raise ConfigError(f"a certificate lifetime of {lifetime:g}s is out of range (0, {MAX_LIFETIME:g}]",
                              code="config.invalid")
        key_pem, cert_pem, serial, not_after = self._issue_client(identity, lifetime, now or _now())
        return Minted(identity, cert_pem, key_pem, serial, not_after)

    def _issue_client(self, identity: Identity, lifetime: float, now: _dt.datetime):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        serial = x509.random_serial_number()
        not_after = now + _dt.timedelta(seconds=lifetime)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{identity.namespace}/{identity.sandbox}")]))
                .issuer_name(self._cert.subject).public_key(key.public_key()).serial_number(serial)
                .not_valid_before(now - _dt.timedelta(seconds=SKEW)).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        from cryptography.hazmat.primitives import serialization

        return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM), serial, not_after

    def _issue(self, names: tuple[str, ...], *, server: bool, lifetime: float) -> tuple[bytes, bytes]:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        sans: list = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "gateway")]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _dt.timedelta(seconds=SKEW)).not_valid_after(now + _dt.timedelta(seconds=lifetime))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)

    def write_client(self, minted: Minted, out: Path) -> dict[str, Path]:
        """``tls.crt``, ``tls.key`` (0600) and ``ca.crt`` in ``out`` (the keys of a Kubernetes
        TLS Secret, as the proxy bridge reads them)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        files = {"tls.crt": out / "tls.crt", "tls.key": out / "tls.key", "ca.crt": out / "ca.crt"}
        _write(files["tls.key"], minted.key_pem, 0o600)
        _write(files["tls.crt"], minted.cert_pem, 0o644)
        _write(files["ca.crt"], self.cert_pem, 0o644)
        return files

    # -- the gateway's issuer (per-claim certificates, docs/scale-out.md) ------------------
    def make_issuer(self, out: Path, *, namespaces: tuple[str, ...] = (), lifetime: float = ISSUER_LIFETIME,
                    enroll_key: bool = True) -> dict[str, Path]:
        """An intermediate CA the gateway replicas hold to mint per-claim certificates, so that
        the root key (``ca.key``) stays with the operator. ``namespaces`` constrain it (X.509
        URI name constraints: the host part of ``agentvm://NAMESPACE/...``), so a replica's key
        mints only identities of its namespaces. Also writes ``enroll.key``: the HMAC key of
        bootstrap tokens (``agentvm.gateway.enroll``), shared by the gateway and whoever
        claims sandboxes. -> the files written."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        bc = self._cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        if bc.path_length is not None and bc.path_length < 1:
            raise ConfigError(f"the gateway CA in {self.directory} was made to sign no intermediate (pathlen 0)",
                              hint="make a new CA with this agentvm (agentvm gateway init) and mint again",
                              code="gateway.ca-invalid")
        if not 0 < lifetime <= CA_LIFETIME_DAYS * 86400.0:
            raise ConfigError(f"an issuer lifetime of {lifetime:g}s is out of range", code="config.invalid")
        for ns in namespaces:
            Identity(ns, "x")  # a DNS label
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"agentvm gateway issuer {secrets.token_hex(4)}")]))
             .issuer_name(self._cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - _dt.timedelta(seconds=SKEW))
             .not_valid_after(min(now + _dt.timedelta(seconds=lifetime), self._cert.not_valid_after_utc))
             .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False))
        if namespaces:
            b = b.add_extension(x509.NameConstraints(
                permitted_subtrees=[x509.UniformResourceIdentifier(ns) for ns in sorted(set(namespaces))],
                excluded_subtrees=None), critical=True)
        cert = b.sign(self._key, hashes.SHA256())
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        os.chmod(out, 0o700)
        files = {"issuer.key": out / "issuer.key", "issuer.pem": out / "issuer.pem", "ca.pem": out / "ca.pem"}
        _write(files["issuer.key"], _key_pem(key), 0o600)
        _write(files["issuer.pem"], cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(files["ca.pem"], self.cert_pem, 0o644)
        if enroll_key and not (out / "enroll.key").exists():
            files["enroll.key"] = out / "enroll.key"
            _write(files["enroll.key"], (secrets.token_hex(32) + "\n").encode(), 0o600)
        return files


class Issuer:
    """The intermediate a gateway replica holds (``issuer.pem``, ``issuer.key``, ``ca.pem``):
    it signs a sandbox's certificate signing request with the identity the gateway decided -
    the request's own subject and names are ignored, only its key is taken (after its
    signature proves the requester holds it)."""

    def __init__(self, directory: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        d = Path(directory)
        try:
            kp = d / "issuer.key"
            if os.stat(kp).st_mode & stat.S_IRWXO:  # (a Secret's 0440 with the pod's fsGroup is fine)
                raise ConfigError(f"{kp} is readable by others", hint=f"chmod 600 {kp}", code="gateway.ca-invalid")
            self._key = serialization.load_pem_private_key(kp.read_bytes(), password=None)
            self._cert = x509.load_pem_x509_certificate((d / "issuer.pem").read_bytes())
            self.issuer_pem = (d / "issuer.pem").read_bytes()
            self.ca_pem = (d / "ca.pem").read_bytes()
        except FileNotFoundError as exc:
            raise ConfigError(f"no gateway issuer in {d} ({exc.filename} missing)",
                              hint="agentvm gateway issuer --dir CA --out DIR", code="gateway.ca-invalid") from None
        except ValueError as exc:
            raise ConfigError(f"the gateway issuer in {d} is not usable: {exc}", code="gateway.ca-invalid") from None

    @property
    def not_after(self) -> _dt.datetime:
        return self._cert.not_valid_after_utc

    def sign_csr(self, csr_pem: bytes, identity: Identity, *, lifetime: float = DEFAULT_LIFETIME,
                 now: _dt.datetime | None = None) -> tuple[bytes, int, _dt.datetime]:
        """-> (the certificate followed by the issuer's, serial, notAfter). The key must be
        ECDSA P-256 and the request signed by it (proof of possession)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise ConfigError(f"not a certificate signing request: {exc}", code="gateway.enroll-refused") from None
        pub = csr.public_key()
        if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.name != "secp256r1":
            raise ConfigError("the request's key is not ECDSA P-256", code="gateway.enroll-refused")
        if not csr.is_signature_valid:
            raise ConfigError("the request is not signed by its key", code="gateway.enroll-refused")
        if not 0 < lifetime <= MAX_LIFETIME:
            raise ConfigError(f"a certificate lifetime of {lifetime:g}s is out of range", code="config.invalid")
        now = now or _now()
        not_after = min(now + _dt.timedelta(seconds=lifetime), self.not_after)
        if not_after <= now:
            raise ConfigError("the gateway's issuer has expired", hint="agentvm gateway issuer: make a new one",
                              code="gateway.ca-invalid")
        serial = x509.random_serial_number()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{identity.namespace}/{identity.sandbox}")]))
                .issuer_name(self._cert.subject).public_key(pub).serial_number(serial)
                .not_valid_before(now - _dt.timedelta(seconds=SKEW)).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM) + self.issuer_pem, serial, not_after


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)
