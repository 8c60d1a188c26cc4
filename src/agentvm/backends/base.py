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


# Primitives a policy can rely on. ``Capabilities.missing(required)`` names what is absent.
PRIMITIVES = (
    "userns",  # unprivileged user namespaces
    "bwrap",  # bubblewrap present and new enough
    "seccomp",  # seccomp filters (libseccomp usable)
    "landlock",  # Landlock (filesystem)
    "landlock-net",  # Landlock TCP port rules (ABI >= 4)
    "landlock-scope",  # Landlock scoping of abstract unix sockets and signals (ABI >= 6)
    "cgroups",  # memory + pids (+cpu) limits
    "cgroup-kill",  # atomic kill of a whole sandbox (cgroup.kill or v1 freezer)
    "dedicated-uid",  # sandbox runs as a dedicated unprivileged host uid (needs root)
    "disk-quota",  # a real size limit on the durable workspace (loop-mounted filesystem)
)


@dataclass(frozen=True)
class Primitive:
    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Capabilities:
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
class LaunchContext:
    """Host-side facts resolved before compiling (so ``compile`` stays pure)."""

    sandbox_id: str
    host_uid: int  # the unprivileged host uid the sandbox maps to
    host_gid: int
    workspace_host: str | None  # host directory of the workspace (None: fresh tmpfs)
    run_dir: str  # per-sandbox runtime dir (per-sandbox /etc/hosts, /etc/hostname)
    helper: str  # path of agentvm-helper
    bwrap: str  # path of bwrap
    etc_view: str = ""  # host dir with the allowlisted, read-only /etc (see bwrap.etc_view)
    gate_socket: str = ""  # host path of this sandbox's egress-gate unix socket ("" = no gate)
    gate_port: int = 3128  # loopback port inside the sandbox bridged to the gate
    node_shim: str = ""  # host dir with proxy.js + undici (Node fetch through the gate), "" = none
    extra_env: tuple[tuple[str, str], ...] = ()  # per-session variables (credential placeholders)
    extra_files: tuple[tuple[str, str], ...] = ()  # per-session files: sandbox path -> content
    tty: bool = False
    drop_privileges: bool = True  # False when agentvm itself is not root
    degraded: tuple[str, ...] = ()  # primitives the operator explicitly waived
    landlock_abi: int = 0
    sandbox_uid: int = 1000
    sandbox_gid: int = 1000
    # per policy.mounts entry: the host-trusted entries kept read-only (agentvm.grants.plan)
    protected: tuple[tuple, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    sandbox_id: str
    policy_digest: str
    argv: tuple[str, ...]  # helper launch ... -- bwrap --args FD -- init ... -- CMD
    bwrap_args: tuple[str, ...]  # bwrap's options, passed through a memfd (never on a command line)
    env: tuple[tuple[str, str], ...]  # the sandbox's environment, passed to init through a memfd
    mounts: tuple[MountOp, ...]
    files: tuple[tuple[str, str], ...]  # per-sandbox files: path relative to the run dir -> content
    landlock: LandlockPlan | None
    seccomp_denied: tuple[str, ...]
    seccomp_allow_ptrace: bool
    rlimits: tuple[tuple[str, int, int], ...]
    cgroup: dict
    host_uid: int
    host_gid: int
    cwd: str
    timeout: float
    run_dir: str = ""
    fds: dict = field(default_factory=dict, hash=False, compare=False)  # name -> fd (filled at launch)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fds", None)
        return d


@dataclass
class SandboxHandle:
    sandbox_id: str
    plan: LaunchPlan
    pid: int  # host pid of the launcher/bwrap process
    started_at: float
    backend_state: dict = field(default_factory=dict)


@dataclass
class ExitStatus:
    exit_code: int  # what `agentvm run` exits with
    signal: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    setup_error: dict | None = None  # {"step":..., "message":...} when the sandbox never started
    duration: float = 0.0
    memory_peak: int | None = None


@dataclass
class TeardownReport:
    verified: bool
    processes_left: list[int] = field(default_factory=list)
    cgroups_left: list[str] = field(default_factory=list)
    mounts_left: list[str] = field(default_factory=list)
    files_left: list[str] = field(default_factory=list)
    duration: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
