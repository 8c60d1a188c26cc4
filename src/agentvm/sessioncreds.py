"""A session's credentials: placeholders for the sandbox, and the gate's view of the real
values (a CredentialSet reading the vault). Used by the run (``agentvm.runtime``), a gate
worker process rebuilding the same set (``agentvm.gate.workers``) and a remote tool server's
gate endpoint (``agentvm.tools.gateway``): below all three.
"""

from __future__ import annotations

from agentvm.errors import AgentVMError, ConfigError


def session_credentials(bindings_: tuple, vault_dir, sandbox_id: str, placeholders: dict | None = None):
    """Placeholders for one session and the gate's view of the real values (a CredentialSet),
    for the bindings of a sandbox - or of a remote tool server's gate endpoint. Every reference
    must resolve now (fail closed: a missing secret refuses). -> (CredentialSet, env, files).
    ``placeholders``: binding name -> the placeholder to keep (a resumed sandbox: its restored
    processes hold the ones of the session it was suspended in); the others are minted."""
    from agentvm.gate.credentials import make_placeholder
    from agentvm.vault import Vault

    vault = Vault(vault_dir)
    values: dict[str, str] = {}
    for b in bindings_:
        try:
            values[b.name] = vault.resolve(b.ref)
        except AgentVMError as exc:
            raise ConfigError(f"credential {b.name!r}: {exc.message}", hint=exc.hint or
                              f"store it with `agentvm secret set {b.ref.partition(':')[2]}`") from None
    keep = placeholders or {}
    placeholders = {b.name: keep.get(b.name) or make_placeholder(b, len(values[b.name])) for b in bindings_}
    creds = vault_credentials(bindings_, placeholders, vault_dir, sandbox_id, vault=vault)
    env = [(b.env, placeholders[b.name]) for b in bindings_]
    env += [(b.sigv4_key_env, b.sigv4_access_key_id) for b in bindings_ if b.sigv4_access_key_id]
    files = [(b.file, placeholders[b.name] + "\n") for b in bindings_ if b.file]
    values.clear()
    return creds, tuple(env), tuple(files)


def vault_credentials(bindings_: tuple, placeholders: dict, vault_dir, sandbox_id: str, *, vault=None):
    """The CredentialSet of a session whose placeholders are made: real values read from the
    vault (cached until the vault changes; ``file:`` references re-read every time), revocations
    asked of the vault on every use. Its ``spec`` is what a gate worker process rebuilds the same
    set from (``agentvm.gate.workers``): bindings, placeholders, vault and session."""
    from agentvm.gate.credentials import CredentialSet
    from agentvm.vault import Vault

    if vault is None:
        vault = Vault(vault_dir)
    bindings = {b.name: b for b in bindings_}
    cache = {"version": vault.version(), "values": {}}  # (filled when a request needs a value)

    def value(name: str) -> str:
        b = bindings[name]
        if b.ref.startswith("file:"):
            return vault.resolve(b.ref)  # re-read: rotating the file needs nothing else
        v = vault.version()
        if v != cache["version"]:
            cache["values"] = {}
            cache["version"] = v
        if name not in cache["values"]:
            cache["values"][name] = vault.resolve(b.ref)
        return cache["values"][name]

    # the names a revocation of each credential may be under: its own, and its vault secret's
    revocable = {b.name: (b.name, b.ref[6:]) if b.ref.startswith("vault:") else (b.name,) for b in bindings_}

    def revoked(name: str) -> bool:  # (asked per request: one stat of the revocations file)
        return vault.any_revoked(revocable[name], sandbox_id)

    creds = CredentialSet(bindings_, placeholders, value, revoked)
    creds.spec = (tuple(bindings_), dict(placeholders), str(vault_dir), sandbox_id)
    return creds
