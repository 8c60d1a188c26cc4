"""SSH signatures (``ssh-keygen -Y``), checked by agent-vm itself against an operator's
allowed-signers file: fleet commits (namespace ``git``) and images (``agentvm-image``).

No program named by a repository or an image is ever run: the only verifier is
``/usr/bin/ssh-keygen`` (or the first on the daemon's own PATH), given the signature, the
signed bytes and the operator's file.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from agentvm.errors import ConfigError

TIMEOUT = 30
BEGIN = b"-----BEGIN SSH SIGNATURE-----"


def keygen() -> str:
    exe = "/usr/bin/ssh-keygen" if os.path.exists("/usr/bin/ssh-keygen") else shutil.which("ssh-keygen")
    if exe is None:
        raise ConfigError("ssh-keygen is not installed (Debian: openssh-client)", code="sshsig.no-ssh-keygen")
    return exe


def check_signers_file(path: str | Path, what: str) -> Path:
    """The operator's allowed-signers file: an absolute path, a regular file, and (when agent-
    vm runs as root) root's and not writable by anyone else - whoever can write it chooses
    whose signatures count."""
    p = Path(path)
    if not p.is_absolute():
        raise ConfigError(f"{what} {path!r} must be an absolute path",
                          hint="a relative path would be looked up wherever the check happens to run")
    try:
        st = os.stat(p)
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {p} is not a regular file")
    if st.st_mode & 0o022 or (os.geteuid() == 0 and st.st_uid != 0):
        raise ConfigError(f"{what} {p} may be written by others than root: refused",
                          hint=f"chown root {p} && chmod go-w {p}")
    return p


def principals(signature: bytes, payload: bytes, signers: Path, namespace: str) -> list[str]:
    """The principals of ``signers`` for whom ``signature`` is a valid signature of
    ``payload`` under ``namespace`` (empty: none)."""
    if not signature.lstrip().startswith(BEGIN):
        return []
    exe = keygen()
    found: list[str] = []
    with tempfile.TemporaryDirectory(prefix="agentvm-sig-") as td:
        sig = Path(td) / "sig"
        sig.write_bytes(signature)
        data = Path(td) / "payload"
        data.write_bytes(payload)
        r = subprocess.run([exe, "-Y", "find-principals", "-s", str(sig), "-f", str(signers)],
                           capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            return []
        for principal in r.stdout.decode(errors="replace").split():
            with open(data, "rb") as f:
                v = subprocess.run([exe, "-Y", "verify", "-f", str(signers), "-I", principal, "-n", namespace,
                                    "-s", str(sig)], stdin=f, capture_output=True, timeout=TIMEOUT)
            if v.returncode == 0 and principal not in found:
                found.append(principal)
    return found
