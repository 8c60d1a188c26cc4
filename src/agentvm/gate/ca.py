"""The per-installation certificate authority of the egress gate.

The gate terminates TLS for hosts that have L7 rules or credentials; the sandbox trusts
this CA (see :meth:`CertificateAuthority.bundle_with_system`) and the gate presents a
leaf minted for the SNI the agent sent.

Files in the CA directory (mode 0700)::

    ca.key            EC P-256 private key, PKCS#8 PEM, mode 0600, written atomically
    ca.crt            self-signed CA certificate, PEM, mode 0644
    .lock             flock taken while creating/loading (two gates starting at once)
    leaves/           0700; leaf files for ``ssl.SSLContext.load_cert_chain``
      key-<kid>.pem     this process's leaf key (0600)
      <h>-<kid>.crt     the leaf for host h (sha256 of the name), signed by ca.key

The CA: ``CN=agent-vm egress gate CA <random id>``, basicConstraints CA:TRUE pathlen:0,
keyUsage keyCertSign+cRLSign (critical), valid 10 years. No nameConstraints: it must be
able to sign any host the policy allows.

Leaves: **one EC P-256 key per CertificateAuthority instance (i.e. per gate process) is
shared by every leaf** - generating a key per host would cost far more than signing, and
the key never leaves the gate. SAN is the host (dNSName, or iPAddress for IP literals),
EKU serverAuth, notBefore now-1h, notAfter now+7d, random serial. Leaves are cached in
memory (LRU 1024) and re-minted when less than 2 days of validity remain.

Leaf *files* exist only because the stdlib ``ssl`` module cannot load a certificate or
key from memory. They live under ``leaves/`` (0700) in the CA directory, which already
holds the far more powerful CA key. Files whose mtime is older than the leaf lifetime
(+1 day) are pruned when the CA is loaded; :meth:`CertificateAuthority.remove_leaf_files`
removes this process's files.

``cryptography`` is imported lazily inside functions: importing this module is cheap.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import ipaddress
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agentvm.fsutil import write_atomic
from typing import Any, Callable, Iterator

from agentvm.errors import ConfigError
from agentvm.gate.policy import normalize_host  # the one canonical form of a host, for rules and certificates

__all__ = [
    "CAError",
    "CAKeyInsecure",
    "CertificateAuthority",
    "normalize_host",
    "LEAF_CACHE_SIZE",
    "LEAF_LIFETIME",
    "SYSTEM_BUNDLE",
]

CA_KEY = "ca.key"
CA_CERT = "ca.crt"
LEAVES = "leaves"
CA_LIFETIME = _dt.timedelta(days=3650)
LEAF_LIFETIME = _dt.timedelta(days=7)
LEAF_BACKDATE = _dt.timedelta(hours=1)
#: A cached leaf is re-minted when it has less than this left.
LEAF_RENEW_BEFORE = _dt.timedelta(days=2)
LEAF_CACHE_SIZE = 1024
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

class CAError(ConfigError):
    """The gate's CA cannot be created or loaded as it is on disk."""

    code = "gate.ca-invalid"


class CAKeyInsecure(CAError):
    """The CA key file is readable by others or owned by someone else."""

    code = "gate.ca-key-insecure"


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


@dataclass(slots=True)
class _Leaf:
    cert_pem: bytes
    not_after: _dt.datetime
    files: tuple[Path, Path] | None = None


class CertificateAuthority:
    """The CA; build it with :meth:`load_or_create`."""

    def __init__(self, directory: Path, key: Any, cert: Any, cert_pem: bytes, *,
                 clock: Callable[[], _dt.datetime] = _utcnow) -> None:
        self.directory = Path(directory)
        self._key = key
        self._cert = cert
        self.cert_pem: bytes = cert_pem
        self._clock = clock
        self._lock = threading.Lock()
        self._files_lock = threading.Lock()
        self._leaves: OrderedDict[str, _Leaf] = OrderedDict()
        self._leaf_key: Any = None
        self._leaf_key_pem: bytes | None = None
        self._leaf_kid: str = ""
        self._ski: Any = None

    # ------------------------------------------------------------------ properties
    @property
    def cert_path(self) -> Path:
        return self.directory / CA_CERT

    @property
    def key_path(self) -> Path:
        return self.directory / CA_KEY

    @property
    def leaves_dir(self) -> Path:
        return self.directory / LEAVES

    @property
    def name(self) -> str:
        from cryptography.x509.oid import NameOID

        return self._cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value

    @property
    def fingerprint_sha256(self) -> str:
        from cryptography.hazmat.primitives import hashes

        return self._cert.fingerprint(hashes.SHA256()).hex()

    @property
    def certificate(self) -> Any:
        """The CA certificate as a ``cryptography.x509.Certificate``."""
        return self._cert

    # ------------------------------------------------------------------ creation / loading
    @classmethod
    def load_or_create(cls, directory: Path, *, clock: Callable[[], _dt.datetime] = _utcnow) -> "CertificateAuthority":
        """Load the CA in ``directory``, creating directory, key and certificate if absent.

        Refuses (:class:`CAKeyInsecure`) a key file with group/other permission bits or
        not owned by the current uid, and (:class:`CAError`) a directory that others can
        write, a certificate without its key, or a certificate that does not match the
        key / is not a CA / has expired. A key without a certificate gets a new one.
        """
        directory = Path(directory)
        _ensure_private_dir(directory, create_parents=True)
        with _flock(directory / ".lock"):
            key_path, cert_path = directory / CA_KEY, directory / CA_CERT
            key_exists, cert_exists = key_path.exists(), cert_path.exists()
            if cert_exists and not key_exists:
                raise CAError(
                    f"{cert_path} exists but {key_path} does not",
                    hint=f"restore {key_path}, or remove {cert_path} to create a new CA "
                    "(sandboxes that trust the old certificate must then be restarted)",
                )
            if key_exists:
                key = _load_key(key_path)
            else:
                key = _generate_key()
                _write_atomic(key_path, _key_pem(key), 0o600)
            if cert_exists:
                cert_pem = _read_cert_file(cert_path)
                cert = _load_and_check_cert(cert_path, cert_pem, key, clock())
            else:
                cert = _make_ca_cert(key, clock())
                cert_pem = _cert_pem(cert)
                _write_atomic(cert_path, cert_pem, 0o644)
        ca = cls(directory, key, cert, cert_pem, clock=clock)
        ca._prune_leaf_files()
        return ca

    # ------------------------------------------------------------------ leaves
    def leaf(self, host: str) -> tuple[bytes, bytes]:
        """``(cert_pem, key_pem)`` of a leaf for ``host`` (cached; shared leaf key)."""
        entry = self._leaf_entry(normalize_host(host))
        assert self._leaf_key_pem is not None
        return entry.cert_pem, self._leaf_key_pem

    def leaf_files(self, host: str) -> tuple[Path, Path]:
        """``(certfile, keyfile)`` of the leaf for ``host``, for ``load_cert_chain``.

        Written under ``leaves/`` on first use (and after a re-mint); rewritten if removed.
        """
        h = normalize_host(host)
        entry = self._leaf_entry(h)
        with self._files_lock:
            return self._write_leaf_files(h, entry)

    def _write_leaf_files(self, h: str, entry: _Leaf) -> tuple[Path, Path]:
        files = entry.files
        if files is not None and files[0].exists() and files[1].exists():
            return files
        leaves = self.leaves_dir
        _ensure_private_dir(leaves, create_parents=False)
        keyfile = leaves / f"key-{self._leaf_kid}.pem"
        if not keyfile.exists():
            assert self._leaf_key_pem is not None
            _write_atomic(keyfile, self._leaf_key_pem, 0o600)
        certfile = leaves / f"{hashlib.sha256(h.encode()).hexdigest()[:32]}-{self._leaf_kid}.crt"
        _write_atomic(certfile, entry.cert_pem, 0o600)
        entry.files = (certfile, keyfile)
        return entry.files

    def remove_leaf_files(self) -> None:
        """Delete this process's leaf files (e.g. at gate shutdown). Safe to call twice."""
        if not self._leaf_kid:
            return
        try:
            names = os.listdir(self.leaves_dir)
        except FileNotFoundError:
            return
        for name in names:
            if self._leaf_kid in name:
                try:
                    os.unlink(self.leaves_dir / name)
                except FileNotFoundError:
                    pass
        with self._lock:
            for entry in self._leaves.values():
                entry.files = None

    def _ensure_leaf_key(self) -> None:
        if self._leaf_key is not None:
            return
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509 import SubjectKeyIdentifier

        key = _generate_key()
        pub = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self._leaf_kid = hashlib.sha256(pub).hexdigest()[:16]
        self._leaf_key_pem = _key_pem(key)
        self._ski = SubjectKeyIdentifier.from_public_key(self._cert.public_key())
        self._leaf_key = key

    def _leaf_entry(self, host: str) -> _Leaf:
        now = self._clock()
        with self._lock:
            entry = self._leaves.get(host)
            if entry is not None and entry.not_after - now > LEAF_RENEW_BEFORE:
                self._leaves.move_to_end(host)
                return entry
            self._ensure_leaf_key()
            cert = self._make_leaf(host, now)
            entry = _Leaf(_cert_pem(cert), now + LEAF_LIFETIME)
            self._leaves[host] = entry
            self._leaves.move_to_end(host)
            while len(self._leaves) > LEAF_CACHE_SIZE:
                self._leaves.popitem(last=False)
            return entry

    def _make_leaf(self, host: str, now: _dt.datetime) -> Any:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        try:
            san: Any = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agent-vm egress gate")]
        if len(host) <= 64:  # X.520 ub-common-name
            attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, host))
        pub = self._leaf_key.public_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._cert.subject)
            .public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - LEAF_BACKDATE)
            .not_valid_after(now + LEAF_LIFETIME)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=False,
                    crl_sign=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski), critical=False)
        )
        return builder.sign(self._key, hashes.SHA256())

    def _prune_leaf_files(self) -> None:
        """Remove leaf files older than any leaf could be valid (crashed processes)."""
        limit = time.time() - (LEAF_LIFETIME + _dt.timedelta(days=1)).total_seconds()
        try:
            with os.scandir(self.leaves_dir) as it:
                for e in it:
                    try:
                        if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_mtime < limit:
                            os.unlink(e.path)
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ trust bundle
    def bundle_with_system(self, system_bundle: Path = SYSTEM_BUNDLE) -> bytes:
        """The system CA bundle followed by this CA (PEM), for the sandbox's trust store."""
        try:
            system = Path(system_bundle).read_bytes()
        except OSError as exc:
            raise CAError(
                f"cannot read the system CA bundle {system_bundle}: {exc.strerror or exc}",
                hint="install the ca-certificates package, or pass the bundle path of this distribution",
            ) from exc
        ours = self.cert_pem.strip()
        if ours in system:
            return system
        if system and not system.endswith(b"\n"):
            system += b"\n"
        return system + f"# {self.name}\n".encode() + ours + b"\n"


# ---------------------------------------------------------------------- helpers


def _generate_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _make_ca_cert(key: Any, now: _dt.datetime) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agent-vm"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"agent-vm egress gate CA {secrets.token_hex(4)}"),
    ])
    pub = key.public_key()
    ski = x509.SubjectKeyIdentifier.from_public_key(pub)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - LEAF_BACKDATE)
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )


def _ensure_private_dir(path: Path, *, create_parents: bool) -> None:
    """Create ``path`` 0700 if absent; refuse one owned by another uid or writable by others."""
    try:
        if create_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # umask may have removed bits, never added: make it exact
    except FileExistsError:
        pass
    except OSError as exc:
        raise CAError(f"cannot create the CA directory {path}: {exc.strerror or exc}",
                      hint="choose a directory the gate's user can write") from exc
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CAError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise CAError(f"{path} is owned by uid {st.st_uid}, not by the gate's uid {os.getuid()}",
                      hint=f"chown {os.getuid()} {path}")
    if st.st_mode & 0o022:
        raise CAError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                      hint=f"chmod 700 {path}")


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with exactly ``mode`` (see :func:`agentvm.fsutil.write_atomic`)."""
    write_atomic(path, data, mode)


def _load_key(path: Path) -> Any:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CAError(f"cannot open the CA key {path}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CAError(f"the CA key {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise CAKeyInsecure(
                f"the CA key {path} is owned by uid {st.st_uid}, not by the gate's uid {os.getuid()}",
                hint=f"chown {os.getuid()} {path} (and check who else could have read it)",
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise CAKeyInsecure(
                f"the CA key {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600",
                hint=f"chmod 600 {path} - and if others could read it, treat the CA as "
                "compromised: remove ca.key and ca.crt to create a new one",
            )
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            if sum(map(len, chunks)) > 1 << 20:
                raise CAError(f"the CA key {path} is implausibly large")
    finally:
        os.close(fd)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    try:
        key = serialization.load_pem_private_key(b"".join(chunks), password=None)
    except (ValueError, TypeError) as exc:
        raise CAError(f"the CA key {path} is not an unencrypted PEM private key: {exc}",
                      hint="restore the key, or remove ca.key and ca.crt to create a new CA") from exc
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CAError(f"the CA key {path} is a {type(key).__name__}; EC or RSA is needed")
    return key


def _read_cert_file(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CAError(f"cannot read the CA certificate {path}: {exc.strerror or exc}") from exc
    return data


def _load_and_check_cert(path: Path, pem: bytes, key: Any, now: _dt.datetime) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CAError(f"{path} is not a PEM certificate: {exc}",
                      hint="restore it, or remove it to issue a new CA certificate for the existing key") from exc
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise CAError(f"{path} does not belong to the key {path.with_name(CA_KEY)}",
                      hint="restore the matching pair, or remove both files to create a new CA")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise CAError(f"{path} is not a CA certificate (basicConstraints CA:TRUE missing)")
    if cert.not_valid_after_utc <= now:
        raise CAError(f"the CA certificate {path} expired on {cert.not_valid_after_utc:%Y-%m-%d}",
                      hint=f"remove {path} to issue a new one for the same key, then restart the sandboxes")
    return cert
