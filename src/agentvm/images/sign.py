"""SSH signatures of images (``ssh-keygen -Y``), verified offline against the operator's
allowed-signers file.

What is signed is the text ``agentvm-image:sha256:<hex>\\n`` under the namespace
``agentvm-image``: a signature binds a key to exactly one tree's content, and cannot be
replayed as a signature of anything else (a git commit, a file) made with the same key.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from agentvm.errors import ConfigError, PolicyDenied
from agentvm.images import SIGN_NAMESPACE, ImageError, Store

TIMEOUT = 30


def message(digest: str) -> bytes:
    return f"agentvm-image:{digest}\n".encode()


def _keygen() -> str:
    from agentvm.sshsig import keygen

    return keygen()


def sign(store: Store, ref: str, key: Path) -> Path:
    digest = store.resolve(ref)
    if not Path(key).is_file():
        raise ConfigError(f"no key at {key}", hint="an SSH private key (ssh-keygen -t ed25519 -f KEY)")
    with tempfile.TemporaryDirectory() as td:
        msg = Path(td) / "image"
        msg.write_bytes(message(digest))
        r = subprocess.run([_keygen(), "-Y", "sign", "-f", str(key), "-n", SIGN_NAMESPACE, str(msg)],
                           capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise ImageError(f"ssh-keygen could not sign: {r.stderr.decode(errors='replace').strip()[:300]}",
                             code="image.sign-failed", hint="a key with a passphrase needs ssh-agent")
        sig = (Path(td) / "image.sig").read_bytes()
    d = store.sig_dir(digest)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    out = d / f"{hashlib.sha256(sig).hexdigest()[:16]}.sig"
    out.write_bytes(sig)
    return out


def verified_principals(store: Store, digest: str, signers: Path) -> list[str]:
    """Principals of ``signers`` (allowed_signers format) whose signature of ``digest`` verifies."""
    from agentvm.sshsig import principals

    d = store.sig_dir(digest)
    found: list[str] = []
    if d.is_dir():
        for sig in sorted(d.glob("*.sig")):
            for p in principals(sig.read_bytes(), message(digest), signers, SIGN_NAMESPACE):
                if p not in found:
                    found.append(p)
    return found


def require_signature(store: Store, digest: str, signers_file: Path, identities: tuple[str, ...], why: str) -> str:
    """The principal of a valid signature of ``digest`` (one of ``identities`` when given), or
    PolicyDenied with the reason."""
    if not signers_file.is_file():
        raise PolicyDenied(f"{why} requires a signed image, and no signers are configured ({signers_file} is missing)",
                           hint="list the operator's signers there in ssh-keygen's allowed_signers format",
                           code="image.unsigned")
    from agentvm.sshsig import check_signers_file

    check_signers_file(signers_file, "the image signers file")  # root's, writable by nobody else
    got = verified_principals(store, digest, signers_file)
    ok = [p for p in got if not identities or p in identities]
    if not ok:
        want = f" by one of {', '.join(identities)}" if identities else ""
        have = f" (valid signatures by: {', '.join(got)})" if got else ""
        raise PolicyDenied(f"image {digest} has no valid signature{want}{have}; {why} requires one",
                           hint="sign it with `agentvm image sign REF --key KEY` using a key listed in "
                                f"{signers_file}", code="image.unsigned")
    return ok[0]
