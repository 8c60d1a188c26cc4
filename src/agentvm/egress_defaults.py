"""The egress rules every gated sandbox gets, and the check that a credential's hosts are
reachable: shared by the agent's policy (``agentvm.policy``), a tool server's own egress
(``agentvm.tools.policy``) and live policy (``agentvm.policy_patch``), below all three.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

from agentvm.errors import ConfigError


def default_deny_rules() -> tuple:
    """Deny rules every gated sandbox gets: the ``doh-deny`` preset (DNS-over-HTTPS endpoints:
    the gate resolves names, so DoH could only serve to tunnel around it). Deny wins, so an
    agent cannot opt back in."""
    return _default_denies()


def _load_default_denies() -> tuple:
    """The doh-deny preset's rules. Parsing YAML costs more than starting a sandbox, and every
    gated run needs these: the parsed rules are cached as JSON in agent-vm's libexec, keyed by
    the preset file's SHA-256 (a changed preset is parsed again)."""
    from pathlib import Path
    from types import SimpleNamespace

    from agentvm.gate.policy import compile_egress

    raw = (Path(__file__).parent / "presets" / "doh-deny.yaml").read_bytes()
    cache = None
    try:
        from agentvm.paths import default_paths

        cache = default_paths().libexec / f"doh-deny-v1-{hashlib.sha256(raw).hexdigest()[:16]}.json"
        st = cache.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ValueError("not agent-vm's own cache")
        rules = json.loads(cache.read_text())
        if not (isinstance(rules, list) and rules and all(
                isinstance(r, dict) and isinstance(r.get("host"), str) and isinstance(r.get("id"), str)
                and isinstance(r.get("ports"), list) and r["ports"] and all(type(p) is int for p in r["ports"])
                for r in rules)):
            raise ValueError("malformed cache")
    except (OSError, ValueError):
        import yaml

        doc = yaml.safe_load(raw)
        rules = [{"host": r["host"], "ports": r.get("ports", [443]), "id": r.get("id")} for r in doc["spec"]["egress"]["deny"]]
        if cache is not None:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(rules))
                os.replace(tmp, cache)
            except OSError:
                pass
    ns = [SimpleNamespace(host=r["host"], ports=r["ports"], methods=[], paths=[], max_body=None, websocket=False,
                          id=r["id"]) for r in rules]
    return compile_egress(SimpleNamespace(deny=ns)).deny


_DEFAULT_DENIES: tuple | None = None


def _default_denies() -> tuple:
    global _DEFAULT_DENIES
    if _DEFAULT_DENIES is None:
        _DEFAULT_DENIES = _load_default_denies()
    return _DEFAULT_DENIES


def with_default_denies(egress):
    """``egress`` with the default deny rules it does not have yet."""
    have = {r.id for r in egress.deny}
    extra = tuple(r for r in default_deny_rules() if r.id not in have)
    return replace(egress, deny=egress.deny + extra) if extra else egress


def check_credential_hosts(credentials: tuple, egress) -> None:
    """Each host a credential is bound to must be reachable through some allow rule."""
    from agentvm.gate.policy import host_matches

    for c in credentials:
        for h in c.hosts:
            ok = any(r.host == h or (not h.startswith("*.") and host_matches(r.host, h)) for r in egress.allow)
            if not ok:
                raise ConfigError(
                    f"credential {c.name!r} is bound to {h}, but no egress allow rule covers {h}",
                    hint=f"add an egress.allow rule for {h}",
                )
