"""Pydantic models of the agent file (``apiVersion: agentvm/v1``, ``kind: Agent``).

These models are the contract between the operator's YAML and everything else: the loader
(`agentvm.spec.loader`) validates YAML into them, `agentvm.policy.compile_policy` turns a
validated :class:`AgentSpec` into a frozen runtime :class:`~agentvm.policy.Policy`.

Every model forbids unknown fields, so a typo is an error, not a silently ignored setting.
Field names are camelCase in YAML (Kubernetes style); Python attributes are snake_case.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

from agentvm import defaults as D
from agentvm.units import parse_duration, parse_size

API_VERSION = "agentvm/v1"
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# Sandbox paths that agent-vm owns and a grant may not cover or shadow.
RESERVED_SANDBOX_PATHS = D.RESERVED_SANDBOX_PATHS


# Sizes and durations are ints/floats at runtime, but the YAML (and so the JSON schema that
# editors use) also accepts human strings: "256M", "2G", "30s", "1h30m".
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*[kKmMgGtT]?[iI]?[bB]?\s*$"
DURATION_PATTERN = r"^\s*(\d+(\.\d+)?|(\d+(\.\d+)?([mM][sS]|[sSmMhHdD]))+)\s*$"
Size = Annotated[
    int,
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": SIZE_PATTERN}]}
    ),
]
Duration = Annotated[
    float,
    WithJsonSchema(
        {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "pattern": DURATION_PATTERN}]}
    ),
]


def _clip(v, limit: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _size(v) -> int:
    try:
        return parse_size(v)
    except OverflowError:  # "1000...000G" parses to an infinite float
        raise ValueError(f"size {_clip(v)} is too large") from None


def _duration(v) -> float:
    d = parse_duration(v)
    if not math.isfinite(d):
        raise ValueError(f"duration {_clip(v)} is too large")
    return d


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        str_strip_whitespace=False,
    )


class Lifecycle(str, Enum):
    persistent = "persistent"
    ephemeral = "ephemeral"


class RiskTier(str, Enum):
    """Risk tiers: the higher the tier, the more an agent may be granted (see docs/concepts.md)."""

    L0 = "L0"
    L1 = "L1"
    L2 = "L2"
    L3 = "L3"
    L4 = "L4"
    L5 = "L5"

    @property
    def level(self) -> int:
        return int(self.value[1])


_abs_path = D.abs_path
_sandbox_path = D.sandbox_path


class Mount(_Model):
    """A granted host folder, visible in the sandbox at ``path``."""

    host: str = Field(description="Absolute host path to grant.")
    path: str = Field(description="Absolute path inside the sandbox.")
    mode: Literal["ro", "rw", "review"] = Field(
        "ro", description="Read-only (default), read-write, or review: edited as rw, but the writes land in a layer "
        "outside the folder until `agentvm accept` (bwrap substrate; see docs/concepts.md).")
    writable_trusted: list[str] = Field(
        default_factory=list,
        description="In an rw grant, host-trusted names the agent may change (e.g. '.git/config'); "
        "all others (.git/hooks, .git/config, .envrc, .vscode, .claude, .mcp.json, shell rc files...) "
        "stay read-only inside. See docs/policy.md.",
    )

    @field_validator("writable_trusted")
    @classmethod
    def _trusted_names(cls, v: list[str]) -> list[str]:
        from agentvm.grants import TRUSTED_NAMES

        for n in v:
            if n not in TRUSTED_NAMES:
                raise ValueError(f"mounts[].writableTrusted: {n!r} is not a protected name (one of: {', '.join(TRUSTED_NAMES)})")
        return v

    @field_validator("host")
    @classmethod
    def _host_abs(cls, v: str) -> str:
        return _abs_path(v, "mounts[].host")

    @field_validator("path")
    @classmethod
    def _path_abs(cls, v: str) -> str:
        return _sandbox_path(v, "mounts[].path")


class RootfsView(_Model):
    """What of the host's system directories the sandbox sees (always read-only)."""

    view: Literal["host-ro"] = Field(
        "host-ro", description="host-ro: the host's /usr and a filtered /etc, read-only."
    )
    extra_paths: list[str] = Field(
        default_factory=list,
        description="More host paths exposed read-only at the same path (e.g. /opt/toolchain).",
    )

    @field_validator("extra_paths")
    @classmethod
    def _extra_abs(cls, v: list[str]) -> list[str]:
        out = [_abs_path(p, "rootfs.extraPaths[]") for p in v]
        for p in out:
            if p in D.FORBIDDEN_EXTRA_PATHS:
                raise ValueError(f"rootfs.extraPaths may not expose {p}")
        return out


class Workspace(_Model):
    """The durable per-agent workspace, stored outside the sandbox."""

    enabled: bool = Field(True, description="Mount the durable workspace (false: no workspace at all).")
    path: str = Field(D.WORKSPACE_PATH, description="Where the workspace appears inside the sandbox.")
    keep: bool = Field(False, description="Keep the workspace when the agent is removed (`agentvm rm`); a kept one "
                       "is listed by `agentvm workspace ls` and removed by `agentvm workspace rm|prune`.")

    @field_validator("path")
    @classmethod
    def _ws_abs(cls, v: str) -> str:
        return _sandbox_path(v, "workspace.path")

    @model_validator(mode="after")
    def _keep_needs_workspace(self):
        if self.keep and not self.enabled:
            raise ValueError("keep: true needs a workspace (enabled: false has none to keep)")
        return self


class BudgetPrice(_Model):
    """A model's price, per million tokens (any currency: the budget's ``cost`` is in the same)."""

    input: float = Field(ge=0, allow_inf_nan=False, description="Price per million input (prompt) tokens.")
    output: float = Field(ge=0, allow_inf_nan=False, description="Price per million output (completion) tokens.")


class Budget(_Model):
    """LLM usage and spend, counted by the gate from the responses of LLM APIs (OpenAI- and
    Anthropic-compatible) and enforced before each request: past a limit, ``429 budget:exceeded``."""

    tokens: int | None = Field(None, ge=1, description="Input + output tokens, in total.")
    requests: int | None = Field(None, ge=1, description="Requests to the budget's hosts, in total.")
    cost: float | None = Field(None, gt=0, allow_inf_nan=False, description="Money, in total, priced with `prices`.")
    hosts: list[str] = Field(default_factory=lambda: list(_llm_hosts()),
                             description="The LLM API hosts the budget meters (exact or '*.suffix'); the default is "
                             "the common OpenAI- and Anthropic-compatible APIs.")
    prices: dict[str, BudgetPrice] = Field(default_factory=dict, description="Model name or glob -> price per million "
                                           "tokens; '*' prices every other model (required with `cost`).")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a budget meters at least one host")
        for h in v:
            name = h[2:] if h.startswith("*.") else h
            if not name or "*" in name or "/" in name or ":" in name or " " in name or "." not in name.strip("."):
                raise ValueError(f"{h!r} is not a host name or '*.suffix'")
        return [h.lower().rstrip(".") for h in v]

    @model_validator(mode="after")
    def _some_limit(self):
        if self.tokens is None and self.requests is None and self.cost is None:
            raise ValueError("a budget sets at least one of tokens, requests, cost")
        if self.cost is not None and "*" not in self.prices:
            raise ValueError("a budget with `cost` needs a price for '*' (every model not listed): a response whose "
                             "model has no price could not be counted")
        return self


def _llm_hosts():
    return D.LLM_HOSTS


class Limits(_Model):
    """Resource limits. Sizes accept ``256M``/``2G``; durations ``30s``/``5m``."""

    memory: Size = Field(D.MEMORY, description="Memory limit (cgroup), e.g. 512M.")
    cpus: float = Field(D.CPUS, gt=0, le=256, description="CPU quota in cores (cgroup cpu quota).")
    pids: int = Field(D.PIDS, ge=8, le=65536, description="Max tasks (cgroup pids + RLIMIT_NPROC backstop).")
    disk: Size = Field(D.DISK, description="Size of the workspace filesystem, e.g. 1G.")
    timeout: Duration = Field(D.TIMEOUT, ge=0, description="Wall-clock timeout; 0 means none.")
    tmp: Size = Field(D.TMP, description="Size of the private /tmp tmpfs.")
    shm: Size = Field(D.SHM, description="Size of the private /dev/shm tmpfs.")
    nofile: int = Field(D.NOFILE, ge=64, le=1048576, description="Open files (RLIMIT_NOFILE).")
    budget: Budget | None = Field(None, description="LLM usage/spend budget enforced at the gate (tokens, requests, "
                                  "cost).")

    @field_validator("memory", "disk", "tmp", "shm", mode="before")
    @classmethod
    def _sizes(cls, v):
        return _size(v)

    @field_validator("timeout", mode="before")
    @classmethod
    def _dur(cls, v):
        return _duration(v)

    @field_validator("memory")
    @classmethod
    def _mem_min(cls, v: int) -> int:
        if v < 16 * 1024**2:
            raise ValueError("memory must be at least 16M")
        return v

    @field_validator("disk")
    @classmethod
    def _disk_min(cls, v: int) -> int:
        if v < 8 * 1024**2:
            raise ValueError("disk must be at least 8M")
        return v


class Security(_Model):
    """Second-layer knobs. Every default is the strict one."""

    allow_ptrace: bool = Field(
        False, description="Allow ptrace/process_vm_* inside the sandbox (debuggers). Needs tier >= L4."
    )
    local_ports: list[int] = Field(
        default_factory=list,
        description="Loopback TCP ports the agent may bind and connect to inside its sandbox (Landlock).",
    )
    min_substrate: Literal["bwrap", "gvisor"] | None = Field(
        None,
        description="The weakest substrate this agent may run on: 'gvisor' refuses to run it on bwrap "
        "(a user-space kernel between the agent and the host's).",
    )
    on_escape_probe: Literal["log", "alert", "pause", "stop"] = Field(
        "log",
        description="Every escape probe the seccomp filter refuses (unshare, mount, ptrace, bpf, a raw socket...) "
        "is recorded; 'alert' makes each record an alert, 'pause' freezes the sandbox and 'stop' kills it once it "
        "has made 3 such calls (docs/syscall-audit.md).",
    )

    @field_validator("local_ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} out of range 1-65535")
        return sorted(set(v))


# ---- sections the later issues fill (validated now, enforced when their feature lands) ----


class EgressRule(_Model):
    host: str = Field(description="Exact host, '*.suffix' (any subdomain, not the bare suffix) or an IP literal.")
    ports: list[int] = Field(default_factory=lambda: [443], description="Allowed TCP ports.")
    methods: list[str] = Field(
        default_factory=list, description="HTTP methods (empty: any). Any L7 field makes the gate terminate TLS."
    )
    paths: list[str] = Field(
        default_factory=list, description="URL path globs, e.g. '/repos/*' ('*' stays within a segment, '**' spans)."
    )
    max_body: Size | None = Field(None, description="Largest request body allowed, e.g. 10M.")
    websocket: bool = Field(False, description="Allow WebSocket upgrades to this host.")
    action: Literal["allow", "ask"] = Field(
        "allow", description="allow rules only: 'ask' holds each matching request until a human approves it "
        "(`agentvm approvals`); unanswered within approvals.timeout, it is denied.")
    id: str | None = Field(None, description="Rule id reported in decisions and 403 responses.")

    @field_validator("max_body", mode="before")
    @classmethod
    def _mb(cls, v):
        return None if v is None else _size(v)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} out of range 1-65535")
        return v

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        out = []
        for m in v:
            if not re.fullmatch(r"[A-Za-z]{1,20}", m):
                raise ValueError(f"invalid HTTP method {m!r}")
            out.append(m.upper())
        return out

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/"):
                raise ValueError(f"path glob {p!r} must start with '/'")
        return v


class EgressLimits(_Model):
    connections: int = Field(64, ge=1, le=10000, description="Concurrent connections through the gate.")
    requests_per_second: float = Field(50.0, gt=0, description="Sustained request rate (token bucket).")
    burst: int = Field(100, ge=1, description="Requests allowed in a burst above the rate.")
    bytes_out: Size = Field(1024**3, description="Total bytes the sandbox may send out, e.g. 1G.")

    @field_validator("bytes_out", mode="before")
    @classmethod
    def _bo(cls, v):
        return _size(v)


class Egress(_Model):
    allow: list[EgressRule] = Field(default_factory=list, description="Rules a request must match to leave.")
    deny: list[EgressRule] = Field(default_factory=list, description="Rules that block a request; deny wins.")
    hosts: dict[str, str] = Field(
        default_factory=dict,
        description="Operator-declared static name -> IP mapping, used instead of DNS (may point at loopback).",
    )
    upstream_ca: str | None = Field(None, description="Extra CA file (PEM) the gate trusts for upstream TLS.")
    limits: EgressLimits = Field(default_factory=EgressLimits)

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: dict[str, str]) -> dict[str, str]:
        import ipaddress

        for name, ip in v.items():
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ValueError(f"egress.hosts[{name!r}]: {ip!r} is not an IP address") from None
        return v

    @field_validator("upstream_ca")
    @classmethod
    def _ca(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "egress.upstreamCA")

    @field_validator("deny")
    @classmethod
    def _deny_no_ask(cls, v: list[EgressRule]) -> list[EgressRule]:
        for r in v:
            if r.action != "allow":
                raise ValueError("action: ask belongs on allow rules (a deny rule always denies)")
        return v


class CredentialInject(_Model):
    """Where the gate may swap the placeholder for the real value (exactly one place)."""

    header: str | None = Field(None, description="Header name, e.g. Authorization.")
    format: str = Field("{}", description="Header value format with one '{}', e.g. 'Bearer {}'.")
    basic: Literal["user", "password"] | None = Field(None, description="The user or password of HTTP basic auth.")
    query: str | None = Field(None, description="A query parameter name.")

    @model_validator(mode="after")
    def _one_place(self):
        places = [p for p in (self.header, self.basic, self.query) if p]
        if len(places) > 1:
            raise ValueError("inject: choose one of header, basic, query")
        if self.format.count("{}") != 1:
            raise ValueError("inject.format must contain exactly one '{}'")
        if self.header is not None and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", self.header):
            raise ValueError(f"invalid header name {self.header!r}")
        return self


class SigV4(_Model):
    """AWS Signature Version 4: the agent signs with the placeholder secret key; the gate
    checks that signature, then re-signs with the real key."""

    access_key_id: str = Field(description="The access key id (not secret) the agent gets in AWS_ACCESS_KEY_ID.")
    access_key_id_env: str = Field("AWS_ACCESS_KEY_ID", description="Env var for the access key id.")


class HmacSigning(_Model):
    """A generic HMAC request signature the gate recomputes with the real secret."""

    algorithm: Literal["sha1", "sha256", "sha512"] = "sha256"
    header: str = Field(description="Header carrying the signature, e.g. X-Signature.")
    format: str = Field("{}", description="Signature header value format, e.g. 'sha256={}'.")
    encoding: Literal["hex", "base64"] = "hex"
    message: str = Field(
        "{method}\n{path}\n{timestamp}\n{body}",
        description="What is signed: {method}, {path} (with query), {timestamp}, {body}, {header:NAME}.",
    )
    timestamp_header: str | None = Field(None, description="Header with the request timestamp (signed as {timestamp}).")


class Placeholder(_Model):
    prefix: str = Field("", description="Fixed start of the placeholder so it looks like the real format, e.g. 'sk-'.")
    length: int | None = Field(None, ge=16, le=512, description="Total length (default: the real value's, at least 32).")
    charset: Literal["alnum", "hex", "base64url"] = "alnum"


class CredentialBroker(_Model):
    """The gate mints a short-lived credential from the long-lived one in the vault entry (a
    JSON object, docs/credentials.md) and swaps in / signs with that instead."""

    kind: Literal["oauth2-refresh", "aws-sts", "github-app"] = Field(description="What the gate mints.")
    scopes: list[str] = Field(default_factory=list, description="oauth2-refresh: the scopes asked for (narrowing).")
    role_arn: str | None = Field(None, description="aws-sts: AssumeRole this role (else GetSessionToken).")
    session_policy: str | None = Field(None, description="aws-sts: a JSON session policy that narrows the role.")
    duration_seconds: int = Field(900, ge=900, le=43200, description="aws-sts: session length (900 is STS's shortest).")
    repositories: list[str] = Field(default_factory=list, description="github-app: repositories the token is limited to.")
    permissions: dict[str, Literal["read", "write", "admin"]] = Field(
        default_factory=dict, description="github-app: permissions the token is limited to, e.g. {contents: read}.")


class SshAgentKey(_Model):
    """An SSH private key (the vault entry) served by the gate's ssh-agent: it signs only for
    the host keys listed here (checked with session-bind@openssh.com)."""

    known_hosts: list[str] = Field(min_length=1, description="known_hosts lines 'host keytype base64': the hosts "
                                   "(and their host keys) this key may authenticate to.")

    @field_validator("known_hosts")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        from agentvm.sshkeys import parse_known_host

        for line in v:
            parse_known_host(line)
        return v


class Credential(_Model):
    name: str = Field(description="Name of the credential (unique per agent).")
    env: str = Field(description="Environment variable that receives the placeholder.")
    ref: str = Field(description="Where the real value lives: vault:NAME, env:VAR (of agent-vm's environment) or file:/path.")
    hosts: list[str] = Field(description="Hosts the real secret may be sent to (exact or '*.suffix').")
    inject: CredentialInject = Field(default_factory=CredentialInject, description="Where the secret is swapped in.")
    file: str | None = Field(None, description="Also write the placeholder to this file inside the sandbox.")
    placeholder: Placeholder = Field(default_factory=Placeholder)
    sigv4: SigV4 | None = Field(None, description="Re-sign AWS SigV4 requests instead of swapping a header.")
    hmac: HmacSigning | None = Field(None, description="Re-sign a generic HMAC signature instead of swapping.")
    ssh: SshAgentKey | None = Field(None, description="An SSH key served by the gate's ssh-agent (env gets the "
                                    "agent's socket path, e.g. SSH_AUTH_SOCK); never injected into HTTP.")
    broker: CredentialBroker | None = Field(None, description="Mint a short-lived credential from the vault "
                                            "entry (oauth2-refresh, aws-sts, github-app) instead of sending it.")
    inspect: Literal["strict", "lenient"] = Field(
        "strict", description="A response to a request this credential was swapped into that the gate cannot fully "
        "inspect for the real value (a body compressed without a Content-Encoding saying so, a coding the gate cannot "
        "decode): strict refuses it (502 credential:uninspectable-*), lenient passes it on, logged as uninspected.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            raise ValueError("credential name: 1-64 of letters, digits, '_', '.', '-'")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"invalid environment variable name {v!r}")
        return v

    @field_validator("ref")
    @classmethod
    def _ref(cls, v: str) -> str:
        kind, sep, rest = v.partition(":")
        if not sep or kind not in ("vault", "env", "file") or not rest:
            raise ValueError("ref must be vault:NAME, env:VAR or file:/absolute/path")
        if kind == "file" and not rest.startswith("/"):
            raise ValueError("file: references need an absolute path")
        return v

    @field_validator("file")
    @classmethod
    def _file(cls, v: str | None) -> str | None:
        return None if v is None else _sandbox_path(v, "credentials[].file")

    @model_validator(mode="after")
    def _mode(self):
        modes = [m for m in (self.sigv4, self.hmac, self.ssh) if m is not None]
        has_inject = bool(self.inject.header or self.inject.basic or self.inject.query)
        if len(modes) > 1 or (modes and has_inject):
            raise ValueError("a credential is either injected (inject) or re-signed (sigv4 / hmac), not both")
        if not modes and not has_inject:
            raise ValueError("say where the secret goes: inject.header, inject.basic, inject.query, sigv4, hmac or ssh")
        if self.ssh is not None and (self.broker is not None or self.file is not None):
            raise ValueError("an ssh key is served by the gate's agent: no broker, no file")
        if not self.hosts:
            raise ValueError("a credential must be bound to at least one host")
        if self.broker is not None and (self.broker.kind == "aws-sts") != (self.sigv4 is not None):
            raise ValueError("broker kind aws-sts goes with sigv4; oauth2-refresh and github-app with inject")
        if self.broker is not None and self.hmac is not None:
            raise ValueError("a brokered credential is not re-signed with hmac")
        return self


TOOL_NAME_GLOB_RE = re.compile(r"^[A-Za-z0-9_.*?/-]{1,128}$")


def _tool_globs(v: list[str], where: str) -> list[str]:
    for g in v:
        if isinstance(g, str) and not g.isascii():
            # said first and plainly: a fullwidth 'read＊' reads as 'read*' but is not one (tool
            # names are ASCII; an allow glob is compared exactly, a deny glob in normal form)
            c = next(c for c in g if not c.isascii())
            raise ValueError(f"{where}: {_clip(g)} has a non-ASCII character (U+{ord(c):04X}): tool names and globs "
                             "are ASCII letters, digits, _ . - / and * ?")
        if not isinstance(g, str) or not TOOL_NAME_GLOB_RE.fullmatch(g):
            raise ValueError(f"{where}: {_clip(g)} is not a tool name or glob (letters, digits, _ . - / and * ?)")
    return v


class ToolArgRule(_Model):
    """A constraint on one named argument of a tool call. Every field given must hold."""

    path: str | None = Field(None, description="The argument is a path inside this folder (normalized; '..' "
                             "that leaves it, and any other string, is denied).")
    pattern: str | None = Field(None, description="The argument (a string) fully matches this regular expression.")
    enum: list[str | int | float | bool] | None = Field(None, description="The argument is one of these values.")
    max_length: int | None = Field(None, ge=0, description="The argument (a string) has at most this many characters.")
    required: bool = Field(False, description="The argument must be present.")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "arguments[].path")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"pattern {_clip(v)} is not a regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _some(self):
        if self.path is None and self.pattern is None and self.enum is None and self.max_length is None \
                and not self.required:
            raise ValueError("an argument rule needs path, pattern, enum, maxLength or required")
        return self


class ToolLimits(_Model):
    calls_per_minute: int = Field(60, ge=1, le=100000, description="Calls to this server per minute (all tools).")
    timeout: Duration = Field(60.0, gt=0, description="Longest a call may take before it is answered with an error.")
    max_arguments: Size = Field(256 * 1024, ge=1, description="Largest arguments of a call (JSON bytes).")
    max_result: Size = Field(1024 * 1024, ge=1, description="Largest result of a call (JSON bytes).")

    @field_validator("timeout", mode="before")
    @classmethod
    def _t(cls, v):
        return _duration(v)

    @field_validator("max_arguments", "max_result", mode="before")
    @classmethod
    def _s(cls, v):
        return _size(v)


class ToolServer(_Model):
    """One MCP server the agent may use through the gateway (``spec.tools[]``)."""

    name: str = Field(description="The server's name: tools appear to the agent as NAME__TOOL.")
    command: list[str] = Field(default_factory=list, description="Local server: the stdio MCP server's argv, run in "
                               "a sandbox of its own (its own grants, egress and credentials).")
    url: str | None = Field(None, description="Remote server: an https:// streamable-HTTP MCP endpoint, reached "
                            "by the gateway through an egress gate endpoint of its own (only that URL's host and "
                            "path; credentials swapped in there).")
    allow: list[str] = Field(default_factory=list, description="Tool names or globs the agent may see and call; "
                             "anything else is hidden and denied.")
    deny: list[str] = Field(default_factory=list, description="Tool names or globs always denied (deny wins).")
    approve: list[str] = Field(default_factory=list, description="Tool names or globs whose every call waits for "
                               "a human (they are visible like allowed tools).")
    risk: dict[str, Literal["read", "write", "destructive"]] = Field(
        default_factory=dict, description="Tool name or glob -> class (read, write, destructive); unlisted tools "
        "are 'write'. The risk tier decides which classes always need a human; server hints are never used.")
    arguments: dict[str, dict[str, ToolArgRule]] = Field(
        default_factory=dict, description="Tool name -> argument name -> constraint.")
    resources: list[str] = Field(default_factory=list, description="Resource URI globs the agent may list and read.")
    prompts: list[str] = Field(default_factory=list, description="Prompt names or globs the agent may list and get.")
    limits: ToolLimits = Field(default_factory=ToolLimits, description="Rate, time and size limits of this server.")
    mounts: list[Mount] = Field(default_factory=list, description="Local server: folders granted to its sandbox.")
    env: dict[str, str] = Field(default_factory=dict, description="Local server: its environment.")
    egress: Egress = Field(default_factory=Egress, description="Local server: its own egress rules (default: none).")
    credentials: list[Credential] = Field(default_factory=list, description="Local server: credentials by reference, "
                                          "swapped in by its own gate (the agent never holds them).")
    memory: Size = Field(D.MEMORY, ge=1, description="Local server: memory limit of its sandbox.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", v):
            raise ValueError("tool server name: 1-32 of a-z, 0-9 and '-' (no leading/trailing '-')")
        return v

    @field_validator("allow", "deny", "approve", "prompts")
    @classmethod
    def _globs(cls, v: list[str]) -> list[str]:
        return _tool_globs(v, "tools[]")

    @field_validator("risk", "arguments")
    @classmethod
    def _keys(cls, v: dict) -> dict:
        _tool_globs(list(v), "tools[]")
        return v

    @field_validator("resources")
    @classmethod
    def _res(cls, v: list[str]) -> list[str]:
        for g in v:
            if not g or len(g) > 512 or any(ord(c) < 0x21 for c in g):
                raise ValueError(f"resource glob {_clip(g)} is empty, too long or has spaces/control characters")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https://[^\s/?#]+(/[^\s#]*)?", v):
            raise ValueError("url must be https://HOST[:PORT]/PATH")
        return v

    @field_validator("memory", mode="before")
    @classmethod
    def _mem(cls, v):
        return _size(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\x00" in val:
                raise ValueError(f"invalid environment variable {k!r}")
        return v

    @model_validator(mode="after")
    def _kind(self):
        if bool(self.command) == bool(self.url):
            raise ValueError(f"tool server {self.name!r}: give either command (a local stdio server) or url (remote)")
        if self.url and (self.mounts or self.env or self.egress.allow or self.egress.deny):
            raise ValueError(f"tool server {self.name!r}: mounts, env and egress rules are for local servers (a remote "
                             "server's egress is its url; egress.hosts and egress.upstreamCa may be given)")
        if self.url and any(c.sigv4 or c.hmac or not c.inject.header for c in self.credentials):
            raise ValueError(f"tool server {self.name!r}: a remote server's credentials go in a header (inject.header)")
        if not (self.allow or self.approve):
            raise ValueError(f"tool server {self.name!r}: allow or approve at least one tool (nothing else is reachable)")
        return self


class Approvals(_Model):
    """How held actions (tool calls in ``approve``, egress rules with ``action: ask``) are answered."""

    timeout: Duration = Field(300.0, gt=0, le=7 * 86400, description="Unanswered this long: denied.")
    webhook: str | None = Field(None, description="POST each pending request (JSON) to this URL (http:// on "
                                "loopback or https://); answers come back through `agentvm approvals`.")

    @field_validator("timeout", mode="before")
    @classmethod
    def _t(cls, v):
        return _duration(v)

    @field_validator("webhook")
    @classmethod
    def _wh(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(https://[^\s/?#]+|http://(127\.0\.0\.1|localhost|\[::1\])(:\d+)?)"
                                               r"(/[^\s#]*)?", v):
            raise ValueError("webhook must be https://... or http:// on loopback")
        return v


class IdlePolicy(_Model):
    """``lifecycle: {kind: persistent, idle: {after: 15m, action: suspend}}``: what happens to a
    persistent worker after ``after`` without activity (no allowed gate request, exec or cp).
    An exec, a cp or an operator command wakes it again (docs/concepts.md, "Lifecycle")."""

    after: Duration = Field(gt=0, description="Inactivity before the action (e.g. 15m).")
    action: Literal["suspend", "pause", "stop"] = Field(
        description="suspend: checkpoint to disk, every host resource freed (gvisor only); pause: cgroup freezer, "
        "memory kept; stop: end it (not restarted).")

    @field_validator("after", mode="before")
    @classmethod
    def _after(cls, v):
        return _duration(v)


class AgentSpecBody(_Model):
    @model_validator(mode="before")
    @classmethod
    def _lifecycle_mapping(cls, data):
        """``lifecycle: {kind: persistent, idle: {...}}`` -> ``lifecycle: persistent`` + ``idle``."""
        if isinstance(data, dict) and isinstance(data.get("lifecycle"), dict):
            data = dict(data)
            lc = dict(data.pop("lifecycle"))
            unknown = set(lc) - {"kind", "idle"}
            if unknown:
                raise ValueError(f"lifecycle takes kind and idle, not {sorted(unknown)}")
            data["lifecycle"] = lc.get("kind", "persistent")
            if "idle" in lc:
                data["idle"] = lc["idle"]
        return data

    presets: list[str] = Field(default_factory=list, description="Preset names, merged in order before this spec.")
    command: list[str] = Field(default_factory=list, description="Argv of the agent's process.")
    lifecycle: Lifecycle = Field(
        Lifecycle.ephemeral, description="ephemeral: one task, then destroyed; persistent: a long-lived worker."
    )
    substrate: Literal["bwrap", "gvisor", "fake"] = Field(
        "bwrap", description="Sandbox backend: bwrap (namespaces, seccomp, Landlock), gvisor (runsc), fake (tests only).")
    idle: IdlePolicy | None = Field(
        None, description="lifecycle.idle: what a persistent worker does after a while without activity "
        "(written `lifecycle: {kind: persistent, idle: {after: 15m, action: suspend|pause|stop}}`).")
    risk_tier: RiskTier = Field(RiskTier.L2, description="Risk tier L0-L5: the ceiling of what may be granted.")
    image: str | None = Field(
        None, description="The read-only root: an image of `agentvm image ls` by name or by digest (sha256:...). "
        "Without it the sandbox sees the host's /usr and a filtered /etc.")
    image_signers: list[str] = Field(
        default_factory=list, description="Principals of the operator's image-signers file, one of whom must have "
        "signed the image (`agentvm image sign`). Tiers L4 and L5 require a signature by any of them anyway.")
    workdir: str | None = Field(None, description="Working directory inside the sandbox (default: the workspace).")
    rootfs: RootfsView = Field(default_factory=RootfsView, description="The read-only system view.")
    mounts: list[Mount] = Field(default_factory=list, description="Granted host folders.")
    workspace: Workspace = Field(default_factory=Workspace, description="The durable per-agent workspace.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the agent process.")
    limits: Limits = Field(default_factory=Limits, description="Resource limits.")
    security: Security = Field(default_factory=Security, description="Second-layer security knobs.")
    network: Literal["gate", "none"] = Field(
        "gate",
        description="gate: every request goes through the egress gate, which denies (with an explanation, "
        "logged) whatever egress does not allow; none: no route out at all, not even to the gate.",
    )
    egress: Egress = Field(default_factory=Egress, description="Network egress rules (default: deny all).")
    credentials: list[Credential] = Field(default_factory=list, description="Credentials by reference.")
    tools: list[ToolServer] = Field(default_factory=list, description="MCP servers the agent may use, through "
                                    "the tool gateway (fail closed: only allowed tools are visible and callable).")
    approvals: Approvals = Field(default_factory=Approvals, description="How held actions are answered.")

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"invalid environment variable name {k!r}")
            if "\x00" in val:
                raise ValueError(f"env {k} contains NUL")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not (re.fullmatch(r"sha256:[0-9a-f]{64}", v) or re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", v)):
            raise ValueError("an image is a name (lower-case letters, digits, '.', '_', '-') or sha256:<64 hex>")
        return v

    @field_validator("image_signers")
    @classmethod
    def _signers(cls, v: list[str]) -> list[str]:
        for p in v:
            if not re.fullmatch(r"[A-Za-z0-9@._+-]{1,128}", p):
                raise ValueError(f"{p!r} is not a signer principal (as in an allowed_signers file)")
        return v

    @field_validator("workdir")
    @classmethod
    def _wd(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "workdir")

    @model_validator(mode="after")
    def _idle_fits(self):
        if self.idle is not None and self.lifecycle != Lifecycle.persistent:
            raise ValueError("lifecycle.idle is for persistent workers (an ephemeral agent ends on its own)")
        if self.idle is not None and self.idle.action == "suspend" and self.substrate != "gvisor":
            raise ValueError(f"lifecycle.idle.action: suspend needs the gvisor substrate (backend.suspend-unsupported: "
                             f"{self.substrate} cannot restore a sandbox's Landlock domain, so it would come back "
                             "weaker); use action: pause (memory kept, CPU zero) or substrate: gvisor")
        return self

    @model_validator(mode="after")
    def _network_none_has_no_egress(self):
        if self.network == "none" and (self.egress.allow or self.egress.deny or self.credentials):
            raise ValueError("network: none has no route out: egress rules and credentials need network: gate")
        return self

    @model_validator(mode="after")
    def _no_duplicate_mount_paths(self):
        seen: dict[str, str] = {}
        for m in self.mounts:
            if m.path in seen:
                raise ValueError(f"two mounts target the same sandbox path {m.path}")
            if self.workspace.enabled and (m.path == self.workspace.path):
                raise ValueError(f"mount path {m.path} shadows the workspace")
            seen[m.path] = m.host
        return self


class Metadata(_Model):
    name: str = Field(description="DNS-label name of the agent (lower-case, digits, '-').")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form string labels.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("name must be a DNS label: lower-case letters, digits and '-', 1-63 chars")
        return v


class AgentSpec(_Model):
    """A whole agent file."""

    api_version: Literal["agentvm/v1"] = Field(alias="apiVersion")
    kind: Literal["Agent"]
    metadata: Metadata
    spec: AgentSpecBody = Field(default_factory=AgentSpecBody)


class PresetSpec(_Model):
    """A preset file: ``kind: Preset``; its ``spec`` is a partial agent spec."""

    api_version: Literal["agentvm/v1"] = Field(alias="apiVersion")
    kind: Literal["Preset"]
    metadata: Metadata
    description: str = ""
    spec: dict = Field(default_factory=dict)


# What each tier may ever be granted (ceilings). Checked by `check_tier`.
TIER_CEILINGS: dict[str, dict] = {
    "L0": {"rw_mounts": False, "egress": False, "credentials": False, "ptrace": False, "tools": False},
    "L1": {"rw_mounts": True, "egress": False, "credentials": False, "ptrace": False, "tools": False},
    "L2": {"rw_mounts": True, "egress": True, "credentials": False, "ptrace": False, "tools": True},
    "L3": {"rw_mounts": True, "egress": True, "credentials": True, "ptrace": False, "tools": True},
    "L4": {"rw_mounts": True, "egress": True, "credentials": True, "ptrace": True, "tools": True},
    "L5": {"rw_mounts": True, "egress": True, "credentials": True, "ptrace": True, "tools": True},
}
# Tool classes (``tools[].risk``) whose every call needs a human at each tier, whatever the
# agent file says: the tier is the ceiling, an agent file can only add approvals.
TIER_TOOL_APPROVAL: dict[str, frozenset[str]] = {
    "L0": frozenset({"read", "write", "destructive"}),
    "L1": frozenset({"read", "write", "destructive"}),
    "L2": frozenset({"write", "destructive"}),
    "L3": frozenset({"destructive"}),
    "L4": frozenset({"destructive"}),
    "L5": frozenset(),
}


def check_tier(body: AgentSpecBody) -> list[tuple[str, str]]:
    """Return ``(field, message)`` for every grant that exceeds the spec's risk tier."""
    tier = body.risk_tier.value
    ceil = TIER_CEILINGS[tier]
    out: list[tuple[str, str]] = []
    if not ceil["rw_mounts"]:
        for i, m in enumerate(body.mounts):
            if m.mode in ("rw", "review"):  # a review grant is writable too (into its layer): as policy.check_tier
                out.append((f"spec.mounts[{i}].mode", f"{m.mode} grants need risk tier >= L1 (agent is {tier})"))
    if not ceil["egress"] and (body.egress.allow):
        out.append(("spec.egress.allow", f"egress needs risk tier >= L2 (agent is {tier})"))
    if not ceil["credentials"] and body.credentials:
        out.append(("spec.credentials", f"credentials need risk tier >= L3 (agent is {tier})"))
    if not ceil["ptrace"] and body.security.allow_ptrace:
        out.append(("spec.security.allowPtrace", f"allowPtrace needs risk tier >= L4 (agent is {tier})"))
    if not ceil["tools"] and body.tools:
        out.append(("spec.tools", f"tools need risk tier >= L2 (agent is {tier})"))
    return out

