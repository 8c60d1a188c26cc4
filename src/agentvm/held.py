"""What a held action (``action: ask``, an approval) is bound to, below the gate, the tool
gateway and the approvals queue (``agentvm.approvals``): the most a human is shown, and the
digest of what was shown."""

from __future__ import annotations

import hashlib
import json

#: a held action is shown to the human whole (every argument, the full path and query); one
#: bigger than this is refused, never held with parts the human cannot see
SHOW_MAX = 64 * 1024


def digest(value) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
