"""An E2B-compatible API over agent-vm (docs/e2b.md).

``make_app(backend, api_keys)`` (app.py) is the ASGI app: E2B's REST API and the in-sandbox
"envd" API the ``e2b`` SDKs talk to, over an :class:`E2BBackend` (backend.py). Templates are
agent files registered by name (templates.py). ``agentvm e2b serve`` / ``agentvm e2b env``
(cli/e2b_cmds.py) serve it and print the environment the SDKs need.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def state_dir(home: Path | None = None) -> Path:
    if home is None:
        from agentvm.paths import default_paths

        home = default_paths().home
    return Path(home) / "e2b"


def api_keys(home: Path | None = None, *, create: bool = True) -> dict[str, str]:
    """``{key: tenant}`` from ``<home>/e2b/api-keys.json`` (0600); one key for the tenant
    ``default`` is made on first use."""
    d = state_dir(home)
    f = d / "api-keys.json"
    if f.is_file():
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc:
            return {str(k): str(v) for k, v in doc.items()}
    if not create:
        return {}
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    keys = {"e2b_" + secrets.token_hex(20): "default"}
    _write_keys(f, keys)
    return keys


def _write_keys(f: Path, keys: dict[str, str]) -> None:
    """``keys`` (API key -> tenant) as ``f``: written to a 0600 file beside it, renamed over it."""
    tmp = f.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(keys, fh)
    os.replace(tmp, f)


def add_tenant(tenant: str, home: Path | None = None) -> str:
    keys = api_keys(home)
    key = "e2b_" + secrets.token_hex(20)
    keys[key] = tenant
    _write_keys(state_dir(home) / "api-keys.json", keys)
    return key
