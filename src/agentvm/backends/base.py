"""The substrate interface every backend implements (bwrap, fake; gVisor/microVM/k8s later).

Shaped like httpx's ``BaseTransport``: a small protocol, a pure planning step and a shipped
fake. The split is deliberate:

* ``capabilities()`` - what this host/backend can guarantee (probed, cached).
* ``compile(policy, ctx) -> LaunchPlan`` - **pure**: argv, mounts, env, seccomp, Landlock
  and limits as data. Snapshot-tested; printable (``agentvm run --dry-run``).
* ``launch(plan) -> SandboxHandle`` / ``wait`` / ``exec`` / ``inspect`` / ``stop`` /
  ``destroy`` - the side effects, each one step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Primitive:
    """One isolation primitive a backend relies on, whether this host has it, and the evidence."""
    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a backend found on this host: its primitives, and facts for the plan."""
    backend: str
    primitives: tuple[Primitive, ...]
    facts: dict = field(default_factory=dict, hash=False, compare=False)

    def has(self, name: str) -> bool:
        return any(p.name == name and p.ok for p in self.primitives)

    def get(self, name: str) -> Primitive | None:
        return next((p for p in self.primitives if p.name == name), None)

    def missing(self, required: tuple[str, ...] | list[str]) -> list[Primitive]:
        out = []
        for r in required:
            p = self.get(r)
            if p is None:
                out.append(Primitive(r, False, "not probed"))
            elif not p.ok:
                out.append(p)
        return out

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "primitives": [asdict(p) for p in self.primitives],
            "facts": self.facts,
        }


@dataclass(frozen=True)
class MountOp:
    """One step of building the sandbox's filesystem view, in order."""

    kind: str  # ro-bind | bind | ro-bind-fd | bind-fd | tmpfs | proc | dev | symlink | dir | remount-ro
    dest: str
    src: str = ""
    size: int | None = None
    perms: str | None = None


@dataclass(frozen=True)
class LandlockPlan:
    """The Landlock rules init applies: which paths may be read or written, which ports used."""
    read_only: tuple[str, ...]
    read_write: tuple[str, ...]
    read_write_host: tuple[str, ...]  # granted host folders: read-write, but no FIFOs/sockets
    devices: tuple[str, ...]
    procfs: tuple[str, ...]
    tcp_connect: tuple[int, ...]
    tcp_bind: tuple[int, ...]
    scope: bool
    min_abi: int


@dataclass(frozen=True)
class GateAttachment:
    """How a sandbox reaches its egress gate - the only route out.

    ``kind`` says what the gate's end is; a backend accepts the kinds it can bridge
    (``Backend.gate_kinds``). ``unix``: a host unix socket, bridged by the backend to
    ``127.0.0.1:port`` inside (bwrap, gVisor). A remote substrate would attach a TCP or
    mTLS address instead; the gate identifies the sandbox by the connection, never by what
    the sandbox says."""

    kind: str
    address: str
    port: int = 3128  # the loopback port inside the sandbox the proxy variables name
    # the bridge's key (a bwrap sandbox): only the bridge may hand connections to the gate, and
    # only the bridge holds it - given to it through a descriptor, never in a plan or an argv
    key: str = field(default="", repr=False, compare=False)


@dataclass(frozen=True)
class HostContext:
    """What a host-local backend (bwrap, gVisor) needs of this host, resolved by the runtime
    before compiling. A remote substrate (Kubernetes) gets ``None``: nothing here is common."""

    uid: int  # the unprivileged host uid the sandbox maps to
    gid: int
    dedicated: bool  # a dedicated per-agent uid (as root); False: the operator's own uid
    run_dir: str  # per-sandbox runtime dir (per-sandbox /etc/hosts, /etc/hostname, the gate socket)
    etc_view: str  # host dir with the allowlisted, read-only /etc (agentvm.rootview)
    node_shim: str = ""  # host dir with proxy.js + undici (Node fetch through the gate), "" = none
    mcp_shim: str = ""  # host file of the agentvm-mcp stdio shim (sandboxes with tools), "" = none
    image_root: str = ""  # host dir of the agent's image (agentvm.images), "" = the host's own /usr


@dataclass(frozen=True)
class LaunchContext:
    """Everything resolved before compiling (so ``compile`` stays pure)."""

    sandbox_id: str
    workspace: str | None = None  # the durable workspace volume (a host directory here); None: fresh, lost at exit
    gate: GateAttachment | None = None  # None only for ``network: none``
    host: HostContext | None = None
    extra_env: tuple[tuple[str, str], ...] = ()  # per-session variables (credential placeholders)
    session_env: tuple[tuple[str, str], ...] = ()  # per-session variables of agent-vm's own (TRACEPARENT)
    telemetry: bool = False  # the gate relays the agent's OTLP export: point OTEL_EXPORTER_OTLP_ENDPOINT at it
    extra_files: tuple[tuple[str, str], ...] = ()  # per-session files: sandbox path -> content
    tty: bool = False
    degraded: tuple[str, ...] = ()  # primitives the operator explicitly waived
    # per policy.mounts entry: the host-trusted entries kept read-only (agentvm.grants.plan)
    protected: tuple[tuple, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """A compiled sandbox: a header every substrate shares, and the substrate's own body.

    The header is what callers may read (the daemon, the CLI, audit records); the body is
    the backend's alone - printable (``to_dict``, ``agentvm compile --plan``), never
    interpreted outside ``backends/``."""

    sandbox_id: str
    substrate: str
    policy_digest: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # the sandbox's environment
    cwd: str
    timeout: float
    limits: dict  # memory, pids, cpus as enforced
    identity: str = ""  # who the sandbox runs as, for people ("host uid 2100007", "gVisor sandbox uid 1000")
    body: object = None  # the backend's plan (a frozen dataclass with ``to_dict``)

    @classmethod
    def of(cls, policy, ctx: "LaunchContext", *, substrate: str, command, env: dict, identity: str,
           body: object) -> "LaunchPlan":
        """The header every substrate fills the same way from the policy, around its body."""
        lim = policy.limits
        return cls(sandbox_id=ctx.sandbox_id, substrate=substrate, policy_digest=policy.digest(),
                   command=tuple(command), env=tuple(sorted(env.items())), cwd=policy.cwd, timeout=lim.timeout,
                   limits={"memory": lim.memory, "pids": lim.pids, "cpus": lim.cpus}, identity=identity, body=body)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("sandbox_id", "substrate", "policy_digest", "command", "env", "cwd",
                                           "timeout", "limits", "identity")}
        d["command"], d["env"] = list(self.command), [list(e) for e in self.env]
        d["body"] = self.body.to_dict() if hasattr(self.body, "to_dict") else self.body
        return d


@dataclass
class SandboxHandle:
    """A live sandbox. ``private`` is the backend's own state: nothing outside ``backends/``
    reads it (ask the backend: ``inspect``, ``poll``, ``wait_async``...)."""

    sandbox_id: str
    plan: LaunchPlan
    started_at: float
    private: object = None


@dataclass
class ExitStatus:
    """How a sandbox ended: exit code or signal, and whether a limit ended it."""
    exit_code: int  # what `agentvm run` exits with
    signal: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    setup_error: dict | None = None  # {"step":..., "message":...} when the sandbox never started
    duration: float = 0.0
    memory_peak: int | None = None
    cpu_time: float | None = None  # seconds of CPU the whole sandbox used, measured on the host (cgroup)


@dataclass
class TeardownReport:
    """What teardown verified: processes, cgroups, mounts and files left behind (none, when verified)."""
    verified: bool
    processes_left: list[int] = field(default_factory=list)
    cgroups_left: list[str] = field(default_factory=list)
    mounts_left: list[str] = field(default_factory=list)
    files_left: list[str] = field(default_factory=list)
    duration: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
