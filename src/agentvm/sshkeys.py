"""SSH public-key text, parsed without any cryptography: the ``known_hosts`` lines an agent file
lists for an ``ssh`` credential (``spec.models`` validates them here; the gate's agent,
``agentvm.gate.sshagent``, turns them into the host keys it signs for)."""

from __future__ import annotations

import base64
import struct


def _string(blob: bytes, at: int) -> tuple[bytes, int]:
    """The SSH wire ``string`` at ``at`` -> (its bytes, the offset after it). ValueError if cut short."""
    if at + 4 > len(blob):
        raise ValueError("cut short")
    (n,) = struct.unpack_from(">I", blob, at)
    end = at + 4 + n
    if end > len(blob):
        raise ValueError("cut short")
    return blob[at + 4:end], end


def parse_known_host(line: str) -> tuple[str, bytes]:
    """``host keytype base64`` -> (host, key blob). ValueError when malformed."""
    parts = line.split()
    if len(parts) < 3:
        raise ValueError("a known host is 'host keytype base64'")
    host, kind, b64 = parts[:3]
    try:
        blob = base64.b64decode(b64, validate=True)
    except ValueError:
        raise ValueError("a known host's key is not base64") from None
    try:
        name, _ = _string(blob, 0)
        if name.decode() != kind:
            raise ValueError("a known host's key type does not match its key")
    except (ValueError, UnicodeDecodeError) as e:
        if "does not match" in str(e):
            raise
        raise ValueError("a known host's key is malformed") from None
    return host, blob
