"""The gateway's configuration source: a directory (in Kubernetes, a ConfigMap mounted
read-only), the one thing replicas share besides the audit sink.

``gateway.yaml``::

    apiVersion: agentvm/v1
    kind: Gateway
    agents:
      hello-agent:
        file: agents/hello-agent.yaml          # an agent file, relative to this directory
        placeholders: {OPENAI: sk-agentvm-...} # what the sandbox holds per credential (not secrets)
        credentials: {OPENAI: env:AGENTVM_CRED_HELLO_AGENT_OPENAI}   # the gateway's reference
    identities:
      - match: agentvm://team-a/hello-*        # an identity, or a sandbox-name prefix and '*'
        agent: hello-agent
    revoked:
      identities: [agentvm://team-a/hello-7]
      serials: ["5f0c..."]                     # certificate serial numbers, hex
      credentials: [OPENAI]                    # revoked for every sandbox

and, optionally, ``revoked.yaml`` beside it with the same three lists (``identities``,
``serials``, ``credentials``), added to those: in Kubernetes a key of the same ConfigMap that
``agentvm k8s rm --revoke`` patches and the render never writes, so re-applying a render keeps
it (kubectl apply leaves fields it did not set).

Each agent file is compiled exactly as the host does it (``spec.loader`` -> ``policy``): its
egress rules, credential bindings (the reference replaced by the gateway's own, which resolves
in the gateway's environment - a Kubernetes Secret the gateway alone mounts), budget and
approval timeout. The source is looked at (a stat of each file) before every request, so a
revocation or a policy change takes effect on the next request. A source that does not load
refuses every request (``gateway:config-invalid``) until it loads again: fail closed."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentvm.errors import AgentVMError, ConfigError
from agentvm.gateway.identity import Identity

CONFIG_FILE = "gateway.yaml"
REVOKED_FILE = "revoked.yaml"  # optional, beside it: revocations kept apart from the rendered configuration
GATEWAY_LOG = "gateway"  # the sink key of refusals that name no configured identity (has no dot: no collision)


@dataclass(frozen=True)
class CompiledAgent:
    name: str
    policy: object  # agentvm.policy.Policy
    bindings: tuple  # CredentialBinding, the reference the gateway's own
    placeholders: dict
    digest: str


@dataclass(frozen=True)
class Snapshot:
    generation: int
    agents: dict = field(default_factory=dict)  # name -> CompiledAgent
    identities: tuple = ()  # (pattern, agent name)
    revoked_identities: frozenset = frozenset()
    revoked_serials: frozenset = frozenset()  # lower-case hex, no leading zeros
    revoked_credentials: frozenset = frozenset()
    error: str | None = None  # the source did not load: every request is refused
    approvals: str | None = None  # an approvals database the replicas share, or None (held requests denied)

    def agent_for(self, ident: Identity) -> CompiledAgent | None:
        for pattern, agent in self.identities:
            if pattern == ident.uri or (pattern.endswith("*") and fnmatch.fnmatchcase(ident.uri, pattern)):
                return self.agents.get(agent)
        return None


@dataclass(frozen=True)
class Refusal:
    rule_id: str
    reason: str


def _serial(s) -> str:
    text = str(s).lower().removeprefix("0x").lstrip("0")
    int(text or "0", 16)
    return text or "0"


class Registry:
    """The configuration source as the gateway reads it: :meth:`current` is the latest snapshot
    (reloaded when a file changed), :meth:`admit` says whether a certificate's identity and
    serial may be served now and under which agent."""

    def __init__(self, directory: Path, *, vault_dir: Path | None = None) -> None:
        self.directory = Path(directory)
        self.vault_dir = vault_dir
        self._stamp: tuple | None = None
        self._files: tuple[Path, ...] = (self.directory / CONFIG_FILE, self.directory / REVOKED_FILE)
        self._snap = Snapshot(0, error="not loaded yet")
        self.listeners: list = []  # called with (old, new) after a reload
        self.current()

    def _signature(self) -> tuple:
        sig = []
        for p in self._files:
            try:
                st = os.stat(p)  # (follows the ..data link of a mounted ConfigMap)
                sig.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append(None)
        return tuple(sig)

    def current(self) -> Snapshot:
        stamp = self._signature()
        if stamp != self._stamp:
            old = self._snap
            self._snap = self._load(old.generation + 1)
            self._stamp = self._signature()  # (the files the new snapshot names)
            for cb in list(self.listeners):
                cb(old, self._snap)
        return self._snap

    def _load(self, generation: int) -> Snapshot:
        try:
            return self._parse(generation)
        except AgentVMError as exc:
            return Snapshot(generation, error=exc.message)
        except Exception as exc:  # noqa: BLE001 - an unreadable source refuses, never crashes
            return Snapshot(generation, error=f"{type(exc).__name__}: {exc}")

    def _parse(self, generation: int) -> Snapshot:
        import yaml

        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent

        path = self.directory / CONFIG_FILE
        try:
            doc = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} is missing", code="gateway.config-invalid") from None
        if not isinstance(doc, dict) or doc.get("kind") != "Gateway" or doc.get("apiVersion") != "agentvm/v1":
            raise ConfigError(f"{path}: not an agentvm/v1 Gateway", code="gateway.config-invalid")
        unknown = set(doc) - {"apiVersion", "kind", "agents", "identities", "revoked", "approvals"}
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}", code="gateway.config-invalid")
        agents: dict[str, CompiledAgent] = {}
        files = [path, self.directory / REVOKED_FILE]
        for name, a in (doc.get("agents") or {}).items():
            if not isinstance(a, dict) or not isinstance(a.get("file"), str):
                raise ConfigError(f"{path}: agents.{name} needs a file", code="gateway.config-invalid")
            f = (self.directory / a["file"]).resolve()
            files.append(f)
            policy = compile_policy(load_agent(f).spec)
            if policy.egress is None:
                raise ConfigError(f"agent {name}: network none has nothing to serve at a gateway",
                                  code="gateway.config-invalid")
            refs = a.get("credentials") or {}
            phs = {str(k): str(v) for k, v in (a.get("placeholders") or {}).items()}
            bindings = []
            for b in policy.credentials:
                if b.name not in phs:
                    raise ConfigError(f"agent {name}: no placeholder for credential {b.name}",
                                      hint="agentvm k8s render writes them", code="gateway.config-invalid")
                if len(phs[b.name]) < 24:
                    raise ConfigError(f"agent {name}: the placeholder of {b.name} is shorter than 24 characters",
                                      code="gateway.config-invalid")
                bindings.append(replace(b, ref=str(refs.get(b.name, b.ref))))
            agents[name] = CompiledAgent(name, policy, tuple(bindings), {b.name: phs[b.name] for b in bindings},
                                         policy.digest() if callable(getattr(policy, "digest", None)) else str(hash(policy)))
        idents = []
        for i, e in enumerate(doc.get("identities") or ()):
            if not isinstance(e, dict) or e.get("agent") not in agents or not isinstance(e.get("match"), str):
                raise ConfigError(f"{path}: identities[{i}] needs match and an agent declared under agents",
                                  code="gateway.config-invalid")
            m = e["match"]
            Identity.parse(m[:-1] + "x" if m.endswith("*") else m)  # (the pattern's prefix is a valid identity)
            idents.append((m, e["agent"]))
        rv = doc.get("revoked") or {}
        lists = [rv]
        rpath = self.directory / REVOKED_FILE
        if rpath.exists():
            extra = yaml.safe_load(rpath.read_text()) or {}
            if not isinstance(extra, dict) or set(extra) - {"identities", "serials", "credentials"}:
                raise ConfigError(f"{rpath}: only identities, serials and credentials lists", code="gateway.config-invalid")
            lists.append(extra)
        revoked_ids = frozenset(Identity.parse(x).uri for r in lists for x in r.get("identities") or ())
        serials = frozenset(_serial(s) for r in lists for s in r.get("serials") or ())
        creds = frozenset(str(c) for r in lists for c in r.get("credentials") or ())
        self._files = tuple(files)
        return Snapshot(generation, agents, tuple(idents), revoked_ids, serials, creds,
                        approvals=doc.get("approvals"))

    def admit(self, ident: Identity | None, serial: str | None) -> CompiledAgent | Refusal:
        snap = self.current()
        if snap.error is not None:
            return Refusal("gateway:config-invalid", f"the gateway's configuration does not load: {snap.error}")
        if ident is None:
            return Refusal("identity:none", "the client certificate names no agentvm:// identity")
        if ident.uri in snap.revoked_identities:
            return Refusal("identity:revoked", f"{ident.uri} has been revoked")
        if serial is not None and _serial(serial) in snap.revoked_serials:
            return Refusal("identity:revoked", f"certificate {serial} of {ident.uri} has been revoked")
        agent = snap.agent_for(ident)
        if agent is None:
            return Refusal("identity:unknown", f"no agent is configured for {ident.uri}")
        return agent

    # -- credentials ------------------------------------------------------------------------
    def credential_set(self, agent: CompiledAgent, ident: Identity):
        """The CredentialSet of one identity: the agent's bindings and placeholders, values
        resolved from the gateway's references when a request needs them, revocation read from
        the source on every use."""
        from agentvm.gate.credentials import CredentialSet
        from agentvm.vault import Vault

        if not agent.bindings:
            return None
        vault = Vault(self.vault_dir or (self.directory / ".no-vault"))
        refs = {b.name: b.ref for b in agent.bindings}

        def value(name: str) -> str:
            return vault.resolve(refs[name])

        def revoked(name: str) -> bool:
            return name in self.current().revoked_credentials

        return CredentialSet(agent.bindings, agent.placeholders, value, revoked)


def add_revocations(text: str | None, *, identities=(), serials=(), credentials=()) -> str:
    """``revoked.yaml``'s text with these added (what ``agentvm k8s rm --revoke`` patches into
    the ConfigMap; pure)."""
    import yaml

    doc = yaml.safe_load(text or "") or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{REVOKED_FILE} is not a mapping", code="gateway.config-invalid")
    for key, new in (("identities", [Identity.parse(i).uri for i in identities]),
                     ("serials", [_serial(s) for s in serials]), ("credentials", list(credentials))):
        have = list(doc.get(key) or [])
        have += [x for x in new if x not in have]
        if have:
            doc[key] = have
    return yaml.safe_dump(doc, sort_keys=True)


def edit_revocations(directory: Path, *, identities=(), serials=(), credentials=()) -> dict:
    """Add revocations to ``gateway.yaml`` in place (written whole, atomically): what
    ``agentvm gateway revoke`` does to a configuration source on disk."""
    import yaml

    path = Path(directory) / CONFIG_FILE
    doc = yaml.safe_load(path.read_text())
    rv = doc.setdefault("revoked", {}) or {}
    doc["revoked"] = rv
    for key, new in (("identities", [Identity.parse(i).uri for i in identities]),
                     ("serials", [_serial(s) for s in serials]), ("credentials", list(credentials))):
        have = list(rv.get(key) or [])
        have += [x for x in new if x not in have]
        if have:
            rv[key] = have
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.replace(tmp, path)
    return rv
