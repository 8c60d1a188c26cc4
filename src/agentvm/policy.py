"""The compiled, frozen, versioned policy of one sandbox.

``compile_policy(spec)`` is pure: a validated :class:`~agentvm.spec.models.AgentSpec` (plus
CLI overrides) becomes a :class:`Policy` made only of tuples, strings and numbers, so it can
be hashed, snapshot-tested, stored and sent to a backend. Backends consume a ``Policy``;
nothing below this layer reads YAML.

This module must not import pydantic: the CLI's fast path (``agentvm run -- CMD`` with no
agent file) builds a ``Policy`` from defaults directly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
TYPE_CHECKING = False  # (typing.TYPE_CHECKING without importing typing: ~2 ms of every start)

from agentvm import defaults as D
from agentvm.egress_defaults import check_credential_hosts as _check_credential_hosts
from agentvm.egress_defaults import default_deny_rules  # noqa: F401 (re-exported)
from agentvm.egress_defaults import with_default_denies as _with_default_denies
from agentvm.errors import ConfigError, PolicyDenied

if TYPE_CHECKING:  # pragma: no cover
    from agentvm.gate.policy import EgressPolicy
    from agentvm.spec.models import AgentSpec
    from agentvm.tools.policy import ToolPolicy

POLICY_VERSION = 1
TIER_LEVEL = {f"L{i}": i for i in range(6)}



# Environment variables that hold lists: composing two values appends instead of replacing
# (presets and the agent file; agent-vm's own Node preload and the agent's NODE_OPTIONS).
APPEND_ENV = {"NODE_OPTIONS": " ", "PYTHONPATH": ":", "NODE_PATH": ":", "PYTHONWARNINGS": ","}


def append_env(name: str, first: str, then: str) -> str:
    """``first`` followed by ``then`` for a list-like variable (``name`` in APPEND_ENV).
    Space-separated options keep whole values (``--require X`` stays one piece); other lists
    drop parts already present."""
    sep = APPEND_ENV[name]
    if sep == " ":
        a, b = first.strip(), then.strip()
        return a if (b == a or a.endswith(" " + b) or not b) else f"{a} {b}".strip()
    parts = [p for p in first.split(sep) if p]
    parts += [p for p in then.split(sep) if p and p not in parts]
    return sep.join(parts)

@dataclass(frozen=True)
class MountGrant:
    """A host folder granted to the sandbox: where it appears, and how it may be written."""
    host: str
    path: str
    writable: bool = False
    # host-trusted names (agentvm.grants.TRUSTED_NAMES) the agent may change in an rw grant
    writable_trusted: tuple[str, ...] = ()
    # mode: review - writable, but the writes land in a layer outside the folder (agentvm.review)
    review: bool = False


@dataclass(frozen=True)
class Limits:
    """The sandbox's resource limits (memory, CPUs, processes, disk, time...), in base units."""
    memory: int = D.MEMORY
    cpus: float = D.CPUS
    pids: int = D.PIDS
    disk: int = D.DISK
    timeout: float = D.TIMEOUT
    tmp: int = D.TMP
    shm: int = D.SHM
    nofile: int = D.NOFILE
    budget: "BudgetSpec | None" = None  # agentvm.gate.budget: LLM usage/spend, enforced at the gate


@dataclass(frozen=True)
class Policy:
    """Everything a run is allowed, from the agent file and the command line: a launch plan's one input."""
    name: str  # the agent's name; for anonymous runs "run"
    command: tuple[str, ...] = ()
    agent: bool = False  # True: a declared agent with a durable, named workspace
    lifecycle: str = "ephemeral"
    substrate: str = "bwrap"
    min_substrate: str | None = None  # the weakest substrate this agent may run on (security.minSubstrate)
    # the read-only root: an image (a name, or sha256:... - a launch resolves a name to its
    # digest and runs exactly that), or None for the host's /usr and filtered /etc
    image: str | None = None
    image_signers: tuple[str, ...] = ()  # principals one of whom must have signed the image
    risk_tier: str = D.RISK_TIER
    workdir: str | None = None
    extra_ro: tuple[str, ...] = ()
    mounts: tuple[MountGrant, ...] = ()
    workspace: str | None = D.WORKSPACE_PATH  # sandbox path of the workspace, None = no workspace
    env: tuple[tuple[str, str], ...] = ()
    limits: Limits = field(default_factory=Limits)
    allow_ptrace: bool = False
    # security.onEscapeProbe: what a denied escape syscall does beyond its record (agentvm.sysaudit)
    on_escape_probe: str = "log"
    local_ports: tuple[int, ...] = ()
    # "gate": every sandbox routes through the egress gate (no rules = deny all, explained and
    # logged); "none": no route at all, not even to the gate (then egress is None).
    network: str = "gate"
    # The egress gate's compiled rules; None exactly when network is "none".
    egress: "EgressPolicy | None" = None
    # Credentials by reference (bindings only: never a value).
    credentials: tuple = ()
    # MCP tool servers through the tool gateway (agentvm.tools.policy.ToolPolicy), or None.
    tools: "ToolPolicy | None" = None
    # How long a held action (a tool call or an egress request that needs a human) waits.
    approval_timeout: float = 300.0
    approval_webhook: str | None = None  # POSTed each pending request (approvals.webhook)
    # Declared but not yet enforceable sections: a run that needs them is refused.
    pending_features: tuple[str, ...] = ()
    version: int = POLICY_VERSION

    def __post_init__(self) -> None:
        if self.network not in ("gate", "none"):
            raise ConfigError(f"unknown network {self.network!r}", hint="gate (the default) or none")
        if self.network == "gate" and self.egress is None:
            from agentvm.gate.policy import compile_egress

            object.__setattr__(self, "egress", _with_default_denies(compile_egress(None)))
        elif self.network == "none" and self.egress is not None:
            raise ConfigError("network none has no route out, so it cannot have egress rules",
                              hint="drop --network none (or network: none) to route through the gate")

    def to_dict(self) -> dict:
        # asdict() field by field, but the egress policy (hundreds of rules) only once, by its own
        # to_dict: the same dict as asdict(self) with egress replaced, at a fraction of the cost
        # (the digest is computed for every run)
        d = {f.name: (self.egress.to_dict() if self.egress is not None else None) if f.name == "egress"
             else _plain(getattr(self, f.name)) for f in fields(self)}
        if self.limits.budget is None:  # fields added later are left out when unset: digests stay stable
            d["limits"].pop("budget", None)
        for m in d["mounts"]:
            if not m.get("review"):
                m.pop("review", None)
        if self.image is None:
            d.pop("image", None)
        if not self.image_signers:
            d.pop("image_signers", None)
        if self.on_escape_probe == "log":
            d.pop("on_escape_probe", None)
        return d

    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    @property
    def cwd(self) -> str:
        return self.workdir or self.workspace or "/"


def _plain(v):
    """What ``dataclasses.asdict`` makes of a field's value."""
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, dict):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    import copy

    return copy.deepcopy(v)


def _budget(b):
    if b is None:
        return None
    from agentvm.gate.budget import compile_budget

    return compile_budget(b)


def compile_policy(spec: "AgentSpec") -> Policy:
    """AgentSpec -> Policy. Pure; no I/O."""
    body = spec.spec
    pending = []
    egress = None
    if body.network == "gate":
        from agentvm.gate.policy import compile_egress

        egress = _with_default_denies(compile_egress(body.egress))
    credentials: tuple = ()
    if body.credentials:
        from agentvm.gate.credentials import compile_credentials

        try:
            credentials = compile_credentials(body.credentials)
        except ValueError as exc:
            raise ConfigError(f"spec.credentials: {exc}") from exc
        if egress is None:
            raise ConfigError(
                "spec.credentials needs spec.egress: a credential is only ever sent through the gate to hosts it allows",
                hint="add egress.allow rules for the credential's hosts",
            )
        _check_credential_hosts(credentials, egress)
    tools = None
    if body.tools:
        from agentvm.tools.policy import compile_tools

        if body.network != "gate":
            raise ConfigError("spec.tools needs network: gate (the tool gateway is reached through the gate's port)",
                              hint="drop network: none, or drop spec.tools")
        try:
            tools = compile_tools(body, spec.metadata.name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if any(s.remote_credentials for s in tools.servers) and TIER_LEVEL[body.risk_tier.value] < 3:
            raise ConfigError("a remote tool server's credentials need risk tier L3 or higher",
                              hint=f"raise riskTier, or drop the credentials of the remote server")
    lim = body.limits
    return Policy(
        name=spec.metadata.name,
        command=tuple(body.command),
        agent=True,
        lifecycle=body.lifecycle.value,
        substrate=body.substrate,
        image=body.image,
        image_signers=tuple(body.image_signers),
        risk_tier=body.risk_tier.value,
        workdir=body.workdir,
        extra_ro=tuple(body.rootfs.extra_paths),
        mounts=tuple(MountGrant(m.host, m.path, m.mode in ("rw", "review"), tuple(m.writable_trusted),
                                review=m.mode == "review") for m in body.mounts),
        workspace=body.workspace.path if body.workspace.enabled else None,
        env=tuple(sorted(body.env.items())),
        limits=Limits(
            memory=lim.memory,
            cpus=lim.cpus,
            pids=lim.pids,
            disk=lim.disk,
            timeout=lim.timeout,
            tmp=lim.tmp,
            shm=lim.shm,
            nofile=lim.nofile,
            budget=_budget(lim.budget),
        ),
        allow_ptrace=body.security.allow_ptrace,
        on_escape_probe=body.security.on_escape_probe,
        min_substrate=body.security.min_substrate,
        local_ports=tuple(body.security.local_ports),
        network=body.network,
        egress=egress,
        credentials=credentials,
        tools=tools,
        approval_timeout=body.approvals.timeout,
        approval_webhook=body.approvals.webhook,
        pending_features=tuple(pending),
    )


def parse_mount_arg(text: str) -> MountGrant:
    """``HOST:PATH[:ro|rw]`` -> MountGrant (the ``--mount`` CLI syntax)."""
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3 and parts[2] in ("ro", "rw", "review"):
        mode = parts.pop()
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise ConfigError(f"invalid --mount {text!r}", hint="use HOST:PATH[:ro|rw], e.g. --mount $PWD:/src:ro")
    try:
        host = D.abs_path(parts[0], "--mount host")
        path = D.sandbox_path(parts[1], "--mount path")
    except ValueError as exc:
        raise ConfigError(f"invalid --mount {text!r}: {exc}") from exc
    return MountGrant(host, path, mode in ("rw", "review"), review=mode == "review")


def with_overrides(
    policy: Policy,
    *,
    command: tuple[str, ...] | None = None,
    mounts: tuple[MountGrant, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    memory: int | None = None,
    allow: tuple[str, ...] = (),
    hosts: dict[str, str] | None = None,
    network: str | None = None,
    substrate: str | None = None,
    image: str | None = None,
) -> Policy:
    """Apply CLI overrides; the result is re-checked against the policy's risk tier."""
    changes: dict = {}
    if image is not None:
        from agentvm.images import DIGEST_RE, check_name

        if not DIGEST_RE.fullmatch(image):
            check_name(image)
        changes["image"] = image
    if substrate is not None:
        if substrate not in SUBSTRATE_STRENGTH or substrate == "fake":
            raise ConfigError(f"unknown --substrate {substrate!r}", hint="bwrap (the default) or gvisor")
        changes["substrate"] = substrate
    if network == "none":
        if allow or hosts or policy.credentials:
            raise ConfigError("--network none has no route out: it cannot go with --allow, --add-host or credentials",
                              hint="drop --network none to route through the gate")
        changes.update(network="none", egress=None)
    elif network not in (None, "gate"):
        raise ConfigError(f"invalid --network {network!r}", hint="gate (the default) or none")
    if allow or hosts:
        from agentvm.gate.policy import compile_egress

        try:
            extra = compile_egress(None, extra_allow=allow, extra_hosts=hosts or {})
        except ValueError as exc:
            raise ConfigError(f"invalid --allow/--add-host: {exc}") from exc
        base = policy.egress
        if base is None:
            changes["egress"] = _with_default_denies(extra)
        else:
            changes["egress"] = replace(base, allow=base.allow + extra.allow, hosts=base.hosts + extra.hosts)
    if command:
        changes["command"] = tuple(command)
    if mounts:
        by_path = {m.path: m for m in policy.mounts}
        for m in mounts:
            by_path[m.path] = m
        if policy.workspace and policy.workspace in by_path:
            raise ConfigError(f"--mount target {policy.workspace} shadows the workspace")
        changes["mounts"] = tuple(by_path.values())
    if env:
        merged = dict(policy.env)
        for k, v in env.items():
            if not k or not (k[0].isalpha() or k[0] == "_") or not all(c.isalnum() or c == "_" for c in k):
                raise ConfigError(f"invalid environment variable name {k!r}")
            if "\x00" in v:
                raise ConfigError(f"--env {k} contains NUL")
            merged[k] = v
        changes["env"] = tuple(sorted(merged.items()))
    lim = policy.limits
    if timeout is not None:
        lim = replace(lim, timeout=timeout)
    if memory is not None:
        if memory < 16 * 1024**2:
            raise ConfigError("--memory must be at least 16M")
        lim = replace(lim, memory=memory)
    changes["limits"] = lim
    out = replace(policy, **changes)
    check_tier(out)
    return out


# How strong each substrate's isolation boundary is (``security.minSubstrate`` compares these).
SUBSTRATE_STRENGTH = {"fake": 0, "bwrap": 1, "gvisor": 2}


def check_tier(policy: Policy) -> None:
    """Refuse a policy that grants more than its risk tier allows (same table as the spec)."""
    level = TIER_LEVEL.get(policy.risk_tier, -1)
    if level < 0:
        raise ConfigError(f"unknown risk tier {policy.risk_tier!r}")
    if level < 1 and any(m.writable for m in policy.mounts):
        raise PolicyDenied(f"read-write grants need risk tier >= L1 (policy is {policy.risk_tier})")
    if level < 2 and policy.egress is not None and policy.egress.allow:
        raise PolicyDenied(f"egress needs risk tier >= L2 (policy is {policy.risk_tier})")
    if level < 4 and policy.allow_ptrace:
        raise PolicyDenied(f"allowPtrace needs risk tier >= L4 (policy is {policy.risk_tier})")
