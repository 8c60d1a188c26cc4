"""The embedded default substrate: Linux namespaces via bubblewrap, plus seccomp, Landlock,
cgroups and a dedicated unprivileged uid.

Process chain of one sandbox::

    agentvm (supervisor, root)
      └─ agentvm-helper launch      join cgroups, rlimits, drop to the agent uid, no_new_privs
           = exec bwrap             user/pid/mount/ipc/uts/net/cgroup namespaces, mount view
               └─ agentvm-helper init   (inside) Landlock, seccomp, exec
                    = exec COMMAND

``compile`` is pure; fds (grants, seccomp filter, status pipes) are referenced in the argv as
``@fd:NAME@`` and substituted at launch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from dataclasses import asdict, dataclass, field

from agentvm import cgroups as cg
from agentvm import defaults as D
from agentvm import seccomp as sc
from agentvm import sysaudit
from agentvm.backends import hostview as hv
from agentvm.backends.base import (
    Capabilities,
    ExitStatus,
    GateAttachment,
    LandlockPlan,
    LaunchContext,
    LaunchPlan,
    MountOp,
    Primitive,
    SandboxHandle,
    TeardownReport,
)
from agentvm.backends.protocol import Backend
from agentvm.backends.status import JsonStatusParser, drain, read_until
from agentvm.errors import EXIT_BACKEND, EXIT_POLICY, EXIT_TIMEOUT, BackendError, LaunchError
from agentvm.policy import Policy

SANDBOX_UID = 1000  # the agent's uid inside (the shared /etc view's accounts assume it)
# git's own default excludes file ($XDG_CONFIG_HOME/git/ignore) in the sandbox's home
GIT_EXCLUDES = hv.HOME_IN_SANDBOX + "/.config/git/ignore"
MQUEUE = "/dev/mqueue"  # POSIX message queues: the sandbox's IPC namespace's own (bwrap --mqueue)


def seccomp_options(allow_ptrace: bool, notify: bool = False, watch: tuple[str, ...] = ()) -> sc.SeccompOptions:
    """The filter of a bwrap sandbox: its user namespace maps one uid and one gid
    (SANDBOX_UID), so a chown to any other id is refused with EPERM (see seccomp.chown_prefix).
    ``notify``: escape probes are user notifications answered by agentvm.sysaudit."""
    return sc.SeccompOptions(allow_ptrace=allow_ptrace, chown_mapped=(SANDBOX_UID, SANDBOX_UID), notify=notify,
                             watch=tuple(watch) if notify else ())


def _notify_available() -> tuple[bool, str]:
    """Whether the kernel has SECCOMP_RET_USER_NOTIF (seccomp(SECCOMP_GET_ACTION_AVAIL))."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.c_uint32(0x7FC00000)
        rc = libc.syscall(317 if os.uname().machine == "x86_64" else 277, 2, 0, ctypes.byref(action))
        if rc == 0:
            return True, "SECCOMP_RET_USER_NOTIF available"
        return False, f"the kernel has no seccomp user notification ({os.strerror(ctypes.get_errno())}; needs Linux 5.0)"
    except Exception as exc:  # noqa: BLE001
        return False, str(exc)

# the primitives this substrate probes (the names --degrade accepts for it)
PRIMITIVES = (
    "userns",  # unprivileged user namespaces
    "bwrap",  # bubblewrap present and new enough
    "seccomp",  # seccomp filters (libseccomp usable)
    "syscall-audit",  # seccomp user notification: denied escape probes are recorded (agentvm.sysaudit)
    "landlock",  # Landlock (filesystem)
    "landlock-net",  # Landlock TCP port rules (ABI >= 4)
    "landlock-scope",  # Landlock scoping of abstract unix sockets and signals (ABI >= 6)
    "cgroups",  # memory + pids (+cpu) limits
    "cgroup-kill",  # atomic kill of a whole sandbox (cgroup.kill or v1 freezer)
    "dedicated-uid",  # sandbox runs as a dedicated unprivileged host uid (needs root)
    "disk-quota",  # a real size limit on the durable workspace (loop-mounted filesystem)
)


def landlock_abi() -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        return max(int(v), 0)
    except Exception:
        return 0


APPARMOR_USERNS = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")


def _userns_ok(bwrap: str = "<agent-vm's bwrap, see `agentvm doctor --json` facts.bwrap>",
               apparmor: Path = APPARMOR_USERNS) -> tuple[bool, str]:
    try:
        n = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        return False, "/proc/sys/user/max_user_namespaces unreadable"
    if n <= 0:
        return False, "user.max_user_namespaces is 0: fix with `sysctl -w user.max_user_namespaces=15000`"
    try:
        if apparmor.read_text().strip() == "1":
            # Ubuntu 23.10+ (24.04 LTS): unconfined programs may not create user namespaces
            return False, (
                "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1, "
                "Ubuntu 23.10 and later). Fix, for agent-vm's bwrap only: write /etc/apparmor.d/agentvm-bwrap with\n"
                "    abi <abi/4.0>,\n    include <tunables/global>\n"
                f"    profile agentvm-bwrap {bwrap} flags=(unconfined) {{\n      userns,\n    }}\n"
                "  then run `apparmor_parser -r /etc/apparmor.d/agentvm-bwrap`. Or, host-wide (weaker): "
                "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`."
            )
    except OSError:
        pass
    return True, f"max_user_namespaces={n}"


@dataclass(frozen=True)
class BwrapPlan:
    """The bwrap substrate's body of a LaunchPlan: the launcher's argv (fds referenced as
    ``@fd:NAME@``, filled in at launch), bwrap's options, the mount view, Landlock, seccomp,
    rlimits and cgroup limits, as data."""

    argv: tuple[str, ...]  # helper launch ... -- bwrap --args FD -- init ... -- CMD
    bwrap_args: tuple[str, ...]  # bwrap's options, passed through a memfd (never on a command line)
    mounts: tuple[MountOp, ...]
    files: tuple[tuple[str, str], ...]  # per-sandbox files: path relative to the run dir -> content
    landlock: LandlockPlan | None
    seccomp_denied: tuple[str, ...]
    seccomp_allow_ptrace: bool
    rlimits: tuple[tuple[str, int, int], ...]
    cgroup: dict
    host_uid: int
    host_gid: int
    run_dir: str
    helper: str = ""  # the launcher/enter helper on the host
    confine: tuple[str, ...] = ()  # init's confinement options, for the first process and every exec
    seccomp: bool = True
    # escape probes denied through user notification and recorded (agentvm.sysaudit); the
    # watched rule ids; security.onEscapeProbe
    seccomp_notify: bool = False
    seccomp_watch: tuple[str, ...] = ()
    on_escape_probe: str = "log"
    fds: dict = field(default_factory=dict, hash=False, compare=False, repr=False)  # what launch opens: grants, stages, the bridge key

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fds", None)
        return d


# ------------------------------------------------------------------ the first cgroup migration
# Moving a task into a cgroup takes the kernel's cgroup_threadgroup_rwsem for writing; a writer
# after a quiet moment waits for an RCU grace period first (rcu_sync_enter: ~8-12 ms here, the
# "cgroup migration" row of bench/bench_startup.py), and one that comes while another writer is
# in, or within a grace period after the last one left, does not. The helper's move into the
# sandbox's cgroups is such a first writer on every start. MigrationWarmup pays that grace
# period off the critical path, while the run is still being prepared: a thread of ours moves
# itself - that one thread, by its thread id - into the cgroup it is already in (v1 ``tasks``,
# v2 ``cgroup.threads``; the cgroup checked to be ours by finding this process's pid in its
# cgroup.procs) every WARM_INTERVAL seconds until the sandbox is launched. A no-op: nothing
# changes cgroup (were the check ever wrong, only that thread, which does nothing else, would
# move); no limit or check of the sandbox changes; the helper's migration is the same kind of
# write, it just does not wait. One thread per process, however many runs are being prepared
# at once (a daemon's burst: one no-op move every WARM_INTERVAL, not one per run). Where the
# cgroup cannot be found or written (not root, no cgroups) nothing happens and the helper
# waits as before.
WARM_INTERVAL = 0.003  # s: well inside one grace period, so the fast path never closes
WARM_MAX = 0.5  # s: a warm-up never stopped (its run failed before launch) ends by itself


def _own_cgroup_dir() -> str | None:
    """The directory of this process's cgroup in one hierarchy (the lock is global: any will
    do), checked by finding this process's pid in its cgroup.procs; None where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    layout = cg.detect()
    me = str(os.getpid())
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:
            base = layout.v2_root
        else:
            base = next((layout.v1[c] for c in ctrls.split(",") if c in layout.v1), None)
        if base is None or not path.startswith("/"):
            continue
        d = os.path.join(str(base), path.lstrip("/"))
        try:
            with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                listed = f.read().split()
        except OSError:
            continue
        if me.encode() in listed:
            return d
    return None


class MigrationWarmup:
    """See above: one thread per process whatever the number of runs being prepared at once
    (:func:`warm_launch` holds it), writing until the last holder lets go or WARM_MAX after
    the newest hold."""

    def __init__(self) -> None:
        import _thread

        self._stop = threading.Event()
        self.done = threading.Event()  # set when the thread has ended
        self.holders = 0
        self.deadline = time.monotonic() + WARM_MAX
        # a bare thread: threading.Thread.start() waits until the new thread runs, which on a
        # busy machine is a scheduler round trip on the run's critical path
        _thread.start_new_thread(self._main, ())

    def stop(self) -> None:
        self._stop.set()

    def _main(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001 - an optimisation only: the helper waits as before
            pass
        finally:
            self._stop.set()  # (a hold arriving now starts a new one)
            self.done.set()

    def _run(self) -> None:
        d = _own_cgroup_dir()
        if d is None or self._stop.is_set():
            return
        fd = None
        for name in ("tasks", "cgroup.threads"):  # v1, v2: one thread, by its id
            try:
                fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CLOEXEC)
                break
            except OSError:
                continue
        if fd is None:
            return  # not ours to write (not root): the helper pays the grace period as before
        try:
            tid = str(threading.get_native_id()).encode()
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                try:
                    os.write(fd, tid)
                except OSError:
                    return
                self._stop.wait(WARM_INTERVAL)
        finally:
            os.close(fd)


_WARM: list = []  # the process's running MigrationWarmup, if any
_WARM_LOCK = threading.Lock()


def warm_launch():
    """Hold the process's cgroup warm-up (started if none runs) until a launch is done ->
    the function that lets go (idempotent); the thread stops when the last holder has."""
    with _WARM_LOCK:
        w = _WARM[0] if _WARM else None
        if w is None or w._stop.is_set():
            w = MigrationWarmup()
            _WARM[:] = [w]
        w.holders += 1
        w.deadline = time.monotonic() + WARM_MAX
    held = [True]

    def release() -> None:
        with _WARM_LOCK:
            if not held[0]:
                return
            held[0] = False
            w.holders -= 1
            if w.holders <= 0:
                w.stop()

    return release


class BwrapBackend(hv.ChildProcessSandbox, Backend):
    name = "bwrap"
    primitives = PRIMITIVES
    host_local = True
    strength = 1  # namespaces + seccomp + Landlock: the host kernel is the boundary

    def gate_attachment(self, sandbox_id: str, run_dir: str) -> GateAttachment:
        """The gate's socket, and a key for this sandbox's bridge: with it the bridge hands each
        connection to the gate (agentvm-helper.c, gate.server.HANDOFF_PREFIX)."""
        # (os.urandom is what secrets.token_hex reads: importing secrets costs a start ~1 ms)
        return GateAttachment("unix", f"{run_dir}/gate.sock", key=os.urandom(16).hex())

    def __init__(self, paths, *, tools: dict[str, str] | None = None) -> None:
        """``tools``: paths of ``helper`` and ``bwrap`` (tests); by default agent-vm's own."""
        self.paths = paths
        self._caps: Capabilities | None = None
        self._tools = dict(tools or {})
        if os.geteuid() == 0 and tools is None:
            paths.check_traversable()

    def prewarm_launch(self):
        """Called as a run starts being prepared (agentvm.lifecycle): the next launch's first
        cgroup migration does not wait for a grace period (MigrationWarmup) -> the function
        to call once it is launched (or will not be)."""
        return warm_launch()

    def _tool(self, name: str) -> str:
        if name not in self._tools:
            from agentvm import native

            fn = native.helper_path if name == "helper" else native.bwrap_path
            self._tools[name] = str(fn(self.paths.libexec))
        return self._tools[name]

    # ------------------------------------------------------------------ capabilities
    def capabilities(self) -> Capabilities:
        if self._caps is not None:
            return self._caps
        from agentvm import native, workspace

        prims: list[Primitive] = []
        facts: dict = {"kernel": os.uname().release, "root": os.geteuid() == 0}
        try:
            b = str(native.bwrap_path(self.paths.libexec))
            bwrap_prim = Primitive("bwrap", True, b)
            facts["bwrap"] = b
        except BackendError as exc:
            bwrap_prim = Primitive("bwrap", False, exc.message)
        # the userns hint names this bwrap (an AppArmor profile is per binary)
        ok, detail = _userns_ok(facts.get("bwrap", "/usr/bin/bwrap"))
        prims += [Primitive("userns", ok, detail), bwrap_prim]
        try:
            with open("/proc/self/status") as fh:
                has_sc = any(line.startswith("Seccomp:") for line in fh)
            sc.compiled_filter(sc.SeccompOptions(), self.paths.libexec)
            prims.append(Primitive("seccomp", has_sc, "libseccomp filter compiled" if has_sc else "kernel lacks seccomp"))
        except Exception as exc:
            prims.append(Primitive("seccomp", False, str(exc)))
        prims.append(Primitive("syscall-audit", *_notify_available()))
        abi = landlock_abi()
        facts["landlock_abi"] = abi
        prims.append(Primitive("landlock", abi >= 1, f"ABI {abi}" if abi else "not available"))
        prims.append(Primitive("landlock-net", abi >= 4, f"ABI {abi} (needs 4)"))
        prims.append(Primitive("landlock-scope", abi >= 6, f"ABI {abi} (needs 6)"))
        layout = cg.detect()
        facts["cgroups"] = layout.describe()
        writable = os.access(layout.v2_root if layout.mode == "v2" else layout.v1.get("memory", "/nonexistent"), os.W_OK)
        prims.append(
            Primitive(
                "cgroups",
                layout.mode != "none" and writable,
                f"{layout.mode}" + ("" if writable else " (not writable: needs root or delegation)"),
            )
        )
        kill_ok = writable and (layout.v2_root is not None or "freezer" in layout.v1)
        prims.append(Primitive("cgroup-kill", kill_ok, "cgroup.kill" if layout.v2_root else "v1 freezer"))
        root = os.geteuid() == 0
        prims.append(
            Primitive("dedicated-uid", root, "per-agent uid" if root else "not root: sandbox runs as the invoking uid")
        )
        q_ok, q_detail = workspace.quota_supported()
        prims.append(Primitive("disk-quota", q_ok, q_detail))
        try:
            h = native.helper_path(self.paths.libexec)
            facts["helper"] = str(h)
        except BackendError as exc:
            prims.append(Primitive("helper", False, exc.message))
        self._caps = Capabilities(self.name, tuple(prims), facts)
        return self._caps

    def required_primitives(self, policy: Policy) -> tuple[str, ...]:
        req = ["userns", "bwrap", "seccomp", "syscall-audit", "landlock", "landlock-scope", "cgroups", "cgroup-kill"]
        if policy.local_ports:  # the explicit TCP port restriction is enforced by Landlock
            req.insert(4, "landlock-net")
        req.append("dedicated-uid")
        if policy.agent and policy.workspace:
            req.append("disk-quota")
        return tuple(req)

    # ------------------------------------------------------------------ compile (pure)
    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        host = ctx.host
        if host is None:
            raise BackendError("the bwrap substrate runs on this host: the launch context has no host part")
        if ctx.gate is not None and ctx.gate.kind not in self.gate_kinds:
            raise BackendError(f"the bwrap substrate cannot attach a {ctx.gate.kind!r} gate")
        helper, bwrap = self._tool("helper"), self._tool("bwrap")
        lim = policy.limits
        degraded = set(ctx.degraded)
        mounts = hv.base_mounts(policy, host)
        # the IPC namespace's own mqueue filesystem, mounted so Landlock has a rule for it:
        # mq_open(3) opens the queue on that filesystem, which no other rule covers (EACCES)
        mounts.insert(next(i for i, m in enumerate(mounts) if m.kind == "dev") + 1, MountOp("mqueue", MQUEUE))
        # (fd name, host path) opened O_PATH at launch - the path as resolved now, after the
        # grant checks: at launch, what is opened must still be exactly this
        fd_names: list[tuple[str, str]] = []
        for i, p in enumerate(policy.extra_ro):
            fd_names.append((f"extra{i}", os.path.realpath(p)))
            mounts.append(MountOp("ro-bind-fd", p, f"@fd:extra{i}@"))
        # As root, grants are idmapped (the folder's owner is the agent inside; what the agent
        # writes is the owner's on the host): the helper stages each one at run_dir/grants/N
        # before dropping privileges, and bwrap binds the staged mount. Without root (the
        # operator's own uid), bwrap binds the opened folder as it is.
        idmap = host.dedicated
        stages: list[tuple[str, str, str]] = []  # (fd name, ro|rw, stage path)
        protects: list[tuple[str, str, tuple]] = []  # every rw grant: (fd name, host path, grants.Protect...)
        protect_args: list[str] = []  # as root: the helper's --protect GRANT,KIND,REL
        reviews: list[dict] = []  # review-mode grants: an overlay whose upper layer is agent-vm's (agentvm.review)
        if policy.mounts:
            from agentvm import review  # (only with grants: not on a plain run's import path)
        for i, m in enumerate(policy.mounts):
            real = os.path.realpath(m.host)
            fd_names.append((f"grant{i}", real))
            in_review = review.is_review(m)
            if idmap:
                src = f"{host.run_dir}/grants/{i}"
                # a review grant's folder is staged read-only: the overlay's lower layer
                stages.append((f"grant{i}", "rw" if m.writable and not in_review else "ro", src))
                if not in_review:
                    mounts.append(MountOp("bind" if m.writable else "ro-bind", m.path, src))
            else:
                src = real
                if not in_review:
                    mounts.append(MountOp("bind-fd" if m.writable else "ro-bind-fd", m.path, f"@fd:grant{i}@"))
            if in_review:
                kind, lname = review.layer_key(policy, ctx.sandbox_id)
                gdir = str(review.grant_dir(self.paths.home, kind, lname, i))
                mounts.append(MountOp("overlay-src", "", src))
                mounts.append(MountOp("overlay", m.path, gdir))
            if m.writable:
                prot = ctx.protected[i] if i < len(ctx.protected) else ()
                protects.append((f"grant{i}", real, prot))
                if in_review:
                    reviews.append({"fd": f"grant{i}", "index": i, "host": real, "path": m.path,
                                    "writable_trusted": tuple(m.writable_trusted), "protect": tuple(p.rel for p in prot)})
                for p in prot:
                    if idmap and not in_review:  # the helper makes it read-only in the staged grant itself
                        protect_args += ["--protect", f"{len(stages) - 1},{p.kind[0]},{p.rel}"]
                    else:  # (over a review grant's overlay: the host's own entry, read-only, from the lower layer)
                        mounts.append(MountOp("ro-bind", f"{m.path}/{p.rel}", f"{src}/{p.rel}"))
        if policy.workspace:
            if ctx.workspace:
                fd_names.append(("workspace", ctx.workspace))
                mounts.append(MountOp("bind-fd", policy.workspace, "@fd:workspace@"))
            else:
                mounts.append(MountOp("tmpfs", policy.workspace, size=lim.disk, perms="0700"))
        for i, (path, _) in enumerate(ctx.extra_files):
            mounts.append(MountOp("ro-bind", path, f"{host.run_dir}/files/{i}"))
        # git's default excludes file in the sandbox's home, naming the placeholders of the rw
        # grants (written at launch, once they exist): they are not untracked files to git
        git_excludes = tuple((f"grant{i}", m.path) for i, m in enumerate(policy.mounts) if m.writable)
        if git_excludes:
            mounts.append(MountOp("file", GIT_EXCLUDES, "@fd:gitexcludes@", perms="0644"))
        mounts.append(MountOp("ro-bind", hv.HELPER_IN_SANDBOX, helper))
        gate = policy.egress is not None
        if gate:
            if ctx.gate is None:
                raise BackendError("the policy has egress rules but no gate was attached (fail closed)")
            mounts.append(MountOp("ro-bind", hv.GATE_IN_SANDBOX, ctx.gate.address))
            if host.node_shim:
                mounts.append(MountOp("ro-bind", hv.NODE_SHIM_IN_SANDBOX, host.node_shim))
            if host.mcp_shim and policy.tools is not None:
                mounts.append(MountOp("ro-bind", hv.MCP_SHIM_IN_SANDBOX, host.mcp_shim))
                mounts.append(MountOp("ro-bind", hv.REQUEST_IN_SANDBOX, host.mcp_shim))
        mounts.append(MountOp("remount-ro", "/"))

        ro = ["/usr", "/etc", "/.agentvm", *policy.extra_ro] + [m.path for m in policy.mounts if not m.writable]
        rw = list(D.SCRATCH_PATHS) + [MQUEUE]
        if policy.workspace:
            rw.append(policy.workspace)
        rw_host = [m.path for m in policy.mounts if m.writable]  # no FIFOs or sockets on the host's disk
        # The sandbox's network namespace is its own: its loopback reaches nothing but itself
        # and the gate's relay, so servers on any port work as on a normal machine. Landlock's
        # TCP rules apply only as the explicit restriction `security.localPorts` asks for.
        use_net = "landlock-net" not in degraded and bool(policy.local_ports)
        use_scope = "landlock-scope" not in degraded
        landlock = None
        if "landlock" not in degraded:
            landlock = LandlockPlan(
                read_only=tuple(ro),
                read_write=tuple(rw),
                read_write_host=tuple(rw_host),
                devices=("/dev",),
                procfs=("/proc",),
                tcp_connect=tuple(sorted(set(policy.local_ports) | ({ctx.gate.port} if gate else set())))
                if use_net
                else (),
                tcp_bind=tuple(policy.local_ports) if use_net else (),
                scope=use_scope,
                min_abi=6 if use_scope else (4 if use_net else 1),
            )
            if not use_net:
                landlock = LandlockPlan(**{**landlock.__dict__, "tcp_connect": (), "tcp_bind": ()})

        rlimits = [("nofile", lim.nofile, lim.nofile), ("core", 0, 0), ("fsize", lim.disk, lim.disk)]
        if host.dedicated:
            # per-uid counter: a correct backstop only when the uid is the sandbox's own
            # above pids.max, so the cgroup refuses first and records it (pids.events)
            rlimits.append(("nproc", lim.pids + 16, lim.pids + 16))

        env = hv.sandbox_env(policy, ctx)

        launch = [helper, "launch", "--status-fd", "@fd:status@"]
        for name, _ in fd_names:
            launch += ["--keep-fd", f"@fd:{name}@"]
        for name, mode, stage in stages:
            launch += ["--grant", f"@fd:{name}@,{mode},{stage}"]
        launch += protect_args
        if git_excludes:
            launch += ["--keep-fd", "@fd:gitexcludes@"]
        # the bridge's key (GateAttachment.key): init gets it through a descriptor, launch opens it
        bridge_key = ctx.gate.key if gate and ctx.gate is not None else ""
        notify = "seccomp" not in degraded and "syscall-audit" not in degraded
        if notify:
            launch += ["--keep-fd", "@fd:sysaudit@"]
        if bridge_key:
            launch += ["--keep-fd", "@fd:bridgekey@"]
        launch += ["--keep-fd", "@fd:seccomp@", "--keep-fd", "@fd:json@", "--keep-fd", "@fd:bwrapargs@",
                   "--keep-fd", "@fd:env@", "--argv0", "bwrap"]
        launch += ["--cgroup-procs", "@cgroups@"]
        for rname, soft, hard in rlimits:
            launch += ["--rlimit", f"{rname}={soft}:{hard}"]
        if host.dedicated:
            launch += ["--uid", str(host.uid), "--gid", str(host.gid)]
        bw = [
            "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", hv.hostname(policy.name),
            "--json-status-fd", "@fd:json@",
        ]
        for m in mounts:
            if m.size is not None:
                bw += ["--size", str(m.size)]
            if m.perms is not None:
                bw += ["--perms", m.perms]
            if m.kind in ("proc", "dev", "tmpfs", "remount-ro", "mqueue"):
                bw += ["--" + m.kind, m.dest]
            elif m.kind == "symlink":
                bw += ["--symlink", m.src, m.dest]
            elif m.kind == "overlay-src":
                bw += ["--overlay-src", m.src]
            elif m.kind == "overlay":  # src: the review layer's grant directory (upper/, work/)
                bw += ["--overlay", f"{m.src}/upper", f"{m.src}/work", m.dest]
            else:
                bw += ["--" + m.kind, m.src, m.dest]
        # the confinement init applies (Landlock, working directory): the same for the first
        # process and for every exec
        confine = ["--chdir", policy.cwd]
        if landlock is None:
            confine += ["--no-landlock"]
        else:
            confine += ["--min-abi", str(landlock.min_abi), "--list", "/"]
            for p in landlock.read_only:
                confine += ["--ro", p]
            confine += ["--ro-try", "/sys"]
            for p in landlock.read_write:
                confine += ["--rw", p]
            for p in landlock.read_write_host:
                confine += ["--rw-host", p]
            confine += ["--dev", "/dev", "--proc", "/proc"]
            if use_net:
                confine += ["--net"]
                for p in landlock.tcp_connect:
                    confine += ["--tcp-connect", str(p)]
                for p in landlock.tcp_bind:
                    confine += ["--tcp-bind", str(p)]
            if landlock.scope:
                confine += ["--scope"]
        init = [hv.HELPER_IN_SANDBOX, "init", "--status-fd", "@fd:status@", "--env-fd", "@fd:env@"]
        if "seccomp" not in degraded:
            init += ["--seccomp-fd", "@fd:seccomp@"]
        if notify:
            init += ["--sysaudit-fd", "@fd:sysaudit@"]
        if ctx.tty:
            init += ["--tty"]
        if gate:
            # the bridge hands each connection to the gate and leaves the data path (the sockets
            # are the host kernel's; gVisor's bridge relays instead: see agentvm-helper.c)
            init += ["--gate-socket", hv.GATE_IN_SANDBOX, "--gate-port", str(ctx.gate.port)]
            if bridge_key:  # (the bridge hands connections over, with this key: see agentvm-helper.c)
                init += ["--bridge-key-fd", "@fd:bridgekey@"]
        init += confine
        command = list(policy.command) or ["/bin/sh"]
        # bwrap's options (host paths included) go through --args FD: the sandbox's pid 1 is
        # bwrap, and its command line is readable inside.
        argv = tuple(launch + ["--", bwrap, "--args", "@fd:bwrapargs@", "--"] + init + ["--"] + command)

        body = BwrapPlan(
            argv=argv,
            bwrap_args=tuple(bw),
            mounts=tuple(mounts),
            files=hv.sandbox_files(policy, ctx),
            landlock=landlock,
            seccomp_denied=tuple(sc.denied_syscalls(sc.SeccompOptions(allow_ptrace=policy.allow_ptrace)))
            if "seccomp" not in degraded
            else (),
            seccomp_allow_ptrace=policy.allow_ptrace,
            rlimits=tuple(rlimits),
            cgroup={"memory": lim.memory, "pids": lim.pids, "cpus": lim.cpus, "enabled": "cgroups" not in degraded},
            host_uid=host.uid,
            host_gid=host.gid,
            run_dir=host.run_dir,
            helper=helper,
            confine=tuple(confine),
            seccomp="seccomp" not in degraded,
            seccomp_notify=notify,
            seccomp_watch=sc.DEFAULT_WATCH if notify else (),
            on_escape_probe=policy.on_escape_probe,
            fds={"open_paths": tuple(fd_names), "stages": tuple(stages), "protects": tuple(protects),
                 "git_excludes": git_excludes, "bridge_key": bridge_key,
                 "reviews": {"home": str(self.paths.home), "kind": kind, "name": lname, "uid": host.uid,
                             "gid": host.gid, "sandbox": ctx.sandbox_id, "grants": tuple(reviews)} if reviews else None},
        )
        return LaunchPlan.of(policy, ctx, substrate=self.name, command=command, env=env,
                             identity=hv.host_uid_text(host) + ("" if host.dedicated else " (the operator's own)"),
                             body=body)

    # ------------------------------------------------------------------ launch
    def launch(self, plan: LaunchPlan, *, stdio: tuple[int, int, int] | None = None) -> SandboxHandle:
        if not plan.body.run_dir:
            raise LaunchError("plan", "the plan has no run dir")
        run_dir = Path(plan.body.run_dir)
        state: dict = {"run_dir": str(run_dir), "fds": []}
        handle = SandboxHandle(plan.sandbox_id, plan, started_at=time.monotonic(), private=state)
        opened: list[int] = []
        audit_end = None
        try:
            # 1. synthetic files
            hv.write_run_files(run_dir, plan.body.files)
            # 2. cgroups
            group = None
            if plan.body.cgroup.get("enabled", True):
                group = cg.SandboxCgroup.create(
                    plan.sandbox_id,
                    cg.detect(),
                    memory=plan.body.cgroup["memory"],
                    pids=plan.body.cgroup["pids"],
                    cpus=plan.body.cgroup["cpus"],
                )
            state["cgroup"] = group
            # 3. fds: grants (O_PATH, opened by the supervisor so the agent uid needs no
            # traversal rights on the host path), the seccomp filter, the status pipes.
            fds = hv.open_grants(plan.body.fds, self.paths, run_dir, state, opened)
            if plan.body.fds.get("git_excludes"):
                fds["gitexcludes"] = _memfd("agentvm-git-excludes", _git_excludes(plan.body.fds, state, self.paths))
                opened.append(fds["gitexcludes"])
            allow_ptrace = plan.body.seccomp_allow_ptrace
            sopts = seccomp_options(allow_ptrace, plan.body.seccomp_notify, plan.body.seccomp_watch)
            sfd = sc.filter_fd(sopts, self.paths.libexec)
            opened.append(sfd)
            fds["seccomp"] = sfd
            if plan.body.seccomp_notify:
                # the listener of the notify filter comes back on this socket (agentvm.sysaudit)
                audit_end, fds["sysaudit"] = sysaudit.handoff_pair()
                opened.append(fds["sysaudit"])
            st_r, st_w = os.pipe2(os.O_CLOEXEC)
            js_r, js_w = os.pipe2(os.O_CLOEXEC)
            opened += [st_w, js_w]
            state["status_r"], state["json_r"] = st_r, js_r
            fds["status"], fds["json"] = st_w, js_w
            cgroup_files = group.procs_files() if group else []
            bwargs = hv.substitute(plan.body.bwrap_args, fds, cgroup_files)
            fds["bwrapargs"] = _memfd("agentvm-bwrap-args", b"".join(a.encode() + b"\0" for a in bwargs))
            opened.append(fds["bwrapargs"])
            fds["env"] = _memfd("agentvm-env", b"".join(f"{k}={v}".encode() + b"\0" for k, v in plan.env))
            opened.append(fds["env"])
            if plan.body.fds.get("bridge_key"):  # (read by init for its bridge, closed before the agent runs)
                fds["bridgekey"] = _memfd("agentvm-bridge-key", plan.body.fds["bridge_key"].encode())
                opened.append(fds["bridgekey"])
            argv = hv.substitute(plan.body.argv, fds, cgroup_files)
            for fd in opened:
                os.set_inheritable(fd, True)
            # 4. spawn
            hv.become_subreaper()
            kw: dict = {}
            if stdio is not None:
                kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
            proc = subprocess.Popen(
                argv,
                env={},  # the sandbox's env reaches only the command, through init's --env-fd
                close_fds=True,
                pass_fds=tuple(opened),
                cwd="/",
                **kw,
            )
            state["proc"] = proc
            if audit_end is not None:
                state["sysaudit"] = self._sysaudit(plan, state)
                sysaudit.supervisor().attach(audit_end, state["sysaudit"], sopts)
                audit_end = None
            hv.mark_run_dir(run_dir, self.name)
        except BaseException:
            if audit_end is not None:
                audit_end.close()
            # close our ends now (the fds must not outlive a failed launch) and forget them:
            # closing a number twice could close a descriptor another thread opened meanwhile
            for fd in opened:
                hv.close_fd(fd)
            opened.clear()
            self.destroy(handle)
            raise
        finally:
            for fd in opened:
                hv.close_fd(fd)
        return handle

    def _sysaudit(self, plan: LaunchPlan, state: dict) -> "sysaudit.SandboxAudit":
        """The sandbox's syscall audit: its JSONL log, and pause/stop on its cgroup
        (security.onEscapeProbe). Callers add the audit chain / trace with
        ``sysaudit.add_sink(backend.syscall_audit(handle), ...)``."""
        group: cg.SandboxCgroup | None = state.get("cgroup")
        proc = state.get("proc")
        logs = self.paths.home / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        # the policy's name is the sandbox id's prefix for people; the plan header has no name
        audit = sysaudit.SandboxAudit(
            plan.sandbox_id, on_probe=plan.body.on_escape_probe,
            sinks=[sysaudit.jsonl_sink(sysaudit.log_path(self.paths.home, plan.sandbox_id)),
                   *sysaudit.sinks_for(plan.sandbox_id)],
            freeze=sysaudit.freezer(group),
            kill=(lambda: group.kill()) if group is not None else (lambda: proc.kill()),
        )
        return audit

    def syscall_audit(self, handle: SandboxHandle) -> "sysaudit.SandboxAudit | None":
        """The sandbox's syscall audit (None: the filter is not notifying - degraded)."""
        return handle.private.get("sysaudit")

    # ------------------------------------------------------------------ wait
    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus:
        proc: subprocess.Popen = handle.private["proc"]
        timed_out = False
        try:
            proc.wait(timeout=timeout if timeout and timeout > 0 else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(handle)
            proc.wait()
        duration = time.monotonic() - handle.started_at
        rc = proc.returncode
        ready, setup_error = hv.helper_status(drain(handle.private.get("status_r")))
        # bwrap's JSON status: a complete document with child-pid means the sandbox existed
        status = _json_status(handle)
        status.feed(drain(handle.private.get("json_r")))
        status.close()
        started = status.first("child-pid") is not None
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        stats = group.stats() if group else {}
        es = ExitStatus(exit_code=rc if rc >= 0 else 128 - rc, duration=duration)
        if rc < 0:
            es.signal = -rc
        es.oom_killed = bool(stats.get("oom_kills"))
        es.pids_limit_hit = bool(stats.get("pids_max_hits"))
        es.memory_peak = stats.get("memory_peak")
        es.cpu_time = stats.get("cpu_time")
        exit_code = status.first("exit-code")
        if exit_code is not None:
            es.exit_code = int(exit_code)
        if setup_error:
            es.setup_error = setup_error
            if setup_error["step"] == "grant-idmap":
                es.setup_error = _idmap_refusal(handle.plan, setup_error)
                es.exit_code = EXIT_POLICY
            elif setup_error["step"] != "exec":
                es.exit_code = EXIT_BACKEND
        elif not started and not timed_out:
            es.setup_error = {"step": "bwrap", "errno": 0, "message": "bubblewrap failed to create the sandbox"}
            es.exit_code = EXIT_BACKEND
        elif not ready and not timed_out and not es.signal and 0 < es.exit_code < 128 and not handle.private.get("stopping"):
            # the sandbox existed but its setup died inside bwrap (a mount it could not make):
            # bwrap's exit code 1 is not the command's
            es.setup_error = {"step": "bwrap-setup", "errno": 0,
                              "message": "bubblewrap could not set the sandbox up (its own message is on stderr)"}
            es.exit_code = EXIT_BACKEND
        if timed_out:
            es.timed_out = True
            es.exit_code = EXIT_TIMEOUT
        return es

    def sandbox_pid(self, handle: SandboxHandle, timeout: float = 5.0) -> int:
        """Host pid of the sandbox's first process (the agent), from bwrap's JSON status."""
        st = handle.private
        if st.get("agent_pid"):
            return st["agent_pid"]
        deadline = time.monotonic() + timeout
        status = _json_status(handle)
        if st.get("json_r") is not None:
            read_until(st["json_r"], status, lambda: status.first("child-pid") is not None, deadline)
        pid1 = status.first("child-pid")
        if pid1 is None:
            why = "its status stream ended" if status.eof else "it reported nothing in time"
            raise BackendError(f"the sandbox is not running (no child pid reported: {why})")
        # bwrap's pid 1 reaps; the agent is its (first) child
        while time.monotonic() < deadline:
            try:
                kids = Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split()
            except OSError:
                kids = []
            if kids:
                pid = int(kids[0])
                try:  # the sandbox's identity, so a reused pid number is never entered
                    st["agent_userns"] = os.stat(f"/proc/{pid}/ns/user").st_ino
                except OSError:
                    time.sleep(0.005)
                    continue
                st["agent_pid"] = pid
                return pid
            time.sleep(0.005)
        raise BackendError("the sandbox's first process is gone")

    def exec(self, handle: SandboxHandle, argv: list[str], *, stdio: tuple[int, int, int] | None = None,
             timeout: float | None = None) -> ExitStatus:
        """Run ``argv`` inside the running sandbox: same namespaces, cgroup, uid, Landlock
        and seccomp as its first process (``agentvm-helper enter``)."""
        plan = handle.plan
        body: BwrapPlan = plan.body
        target = self.sandbox_pid(handle)
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        opened: list[int] = []
        try:
            fds: dict[str, int] = {}
            st_r, st_w = os.pipe2(os.O_CLOEXEC)
            opened += [st_r, st_w]
            fds["status"] = st_w
            fds["env"] = _memfd("agentvm-env", b"".join(f"{k}={v}".encode() + b"\0" for k, v in plan.env))
            opened.append(fds["env"])
            seccomp_on = body.seccomp
            audit_end = None
            audit = handle.private.get("sysaudit")
            sopts = seccomp_options(body.seccomp_allow_ptrace, body.seccomp_notify and audit is not None,
                                    body.seccomp_watch)
            if seccomp_on:
                fds["seccomp"] = sc.filter_fd(sopts, self.paths.libexec)
                opened.append(fds["seccomp"])
                if sopts.notify:
                    audit_end, fds["sysaudit"] = sysaudit.handoff_pair()
                    opened.append(fds["sysaudit"])
            enter = [body.helper, "enter", "--target", str(target), "--expect-userns", str(handle.private["agent_userns"]),
                     "--uid", "1000", "--gid", "1000", "--status-fd", str(st_w)]
            for f in (group.procs_files() if group else []):
                enter += ["--cgroup-procs", f]
            for rname, soft, hard in plan.body.rlimits:
                enter += ["--rlimit", f"{rname}={soft}:{hard}"]
            init_args = [hv.HELPER_IN_SANDBOX, "init", "--status-fd", str(st_w), "--env-fd", str(fds["env"])]
            if seccomp_on:
                init_args += ["--seccomp-fd", str(fds["seccomp"])]
            if audit_end is not None:
                init_args += ["--sysaudit-fd", str(fds["sysaudit"])]
            init_args += list(body.confine)
            cmdline = enter + ["--"] + init_args + ["--"] + list(argv)
            for fd in opened:
                if fd != st_r:
                    os.set_inheritable(fd, True)
            kw: dict = {}
            if stdio is not None:
                kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(cmdline, env={}, close_fds=True,
                                        pass_fds=tuple(fd for fd in opened if fd != st_r), cwd="/", **kw)
            except BaseException:
                if audit_end is not None:
                    audit_end.close()
                raise
            if audit_end is not None:
                sysaudit.supervisor().attach(audit_end, audit, sopts)
            for fd in opened:
                if fd != st_r:
                    hv.close_fd(fd)
            opened = [st_r]
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
            es = ExitStatus(exit_code=proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
                            duration=time.monotonic() - t0)
            es.setup_error = _setup_error(drain(st_r))
            if timed_out:
                es.timed_out, es.exit_code = True, EXIT_TIMEOUT
            return es
        finally:
            for fd in opened:
                hv.close_fd(fd)

    def inspect(self, handle: SandboxHandle) -> dict:
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        proc: subprocess.Popen | None = handle.private.get("proc")
        return {
            "sandbox_id": handle.sandbox_id,
            "pid": handle.private["proc"].pid if handle.private.get("proc") else None,
            "running": proc is not None and proc.poll() is None,
            "pids": sorted(group.pids()) if group else [],
            "cgroup": group.stats() if group else {},
            "uptime": time.monotonic() - handle.started_at,
        }

    def set_limits(self, handle: SandboxHandle, *, memory: int | None = None, pids: int | None = None,
                   cpus: float | None = None) -> dict:
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        if group is None:
            raise BackendError("this sandbox runs without cgroups (degraded): its limits cannot change live")
        return group.tighten(memory=memory, pids=pids, cpus=cpus)

    def reap_stale(self) -> list[str]:
        out = []
        for d in hv.stale_run_dirs(self.paths.sandboxes, self.name):
            hv.reap_run_dir(d, self.paths.runtime)
            out.append(d.name)
        return out

    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None:
        handle.private["stopping"] = True  # an early stop is not a failed setup
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        proc: subprocess.Popen | None = handle.private.get("proc")
        if group is not None:
            group.signal_all(signal.SIGTERM)
        if proc is not None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._kill(handle)

    def _kill(self, handle: SandboxHandle) -> None:
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        proc: subprocess.Popen | None = handle.private.get("proc")
        if group is not None:
            group.kill()
        elif proc is not None and proc.poll() is None:
            proc.kill()

    # ------------------------------------------------------------------ destroy
    def destroy(self, handle: SandboxHandle) -> TeardownReport:
        t0 = time.monotonic()
        st = handle.private
        group: cg.SandboxCgroup | None = st.get("cgroup")
        proc: subprocess.Popen | None = st.get("proc")
        rep = TeardownReport(verified=False)
        if group is not None:
            if not group.kill():
                rep.processes_left = sorted(group.pids())
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rep.processes_left.append(proc.pid)
        for key in ("status_r", "json_r"):
            if st.get(key) is not None:
                hv.close_fd(st.pop(key))
        if group is not None:
            rep.cgroups_left = group.destroy()
        return hv.finish_teardown(rep, st, handle.plan.body.host_uid, self.paths, t0)


# ---------------------------------------------------------------------- helpers


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _git_excludes(plan_fds: dict, state: dict, paths) -> bytes:
    """The sandbox's git excludes: each rw grant's placeholders (made by open_grants, or by
    another sandbox using the same folder), at the grant's path in the sandbox."""
    from agentvm import grants

    where = dict(plan_fds.get("git_excludes", ()))
    holds = state.get("grant_holds") or []
    found = []
    for (name, _, _), hold in zip(plan_fds.get("protects", ()), holds):
        if name in where:
            found.append((where[name], grants.placeholder_files(hold, paths.runtime / "grants")))
    return grants.git_excludes(found).encode()


def _json_status(handle: SandboxHandle) -> JsonStatusParser:
    """The one parser of this sandbox's bwrap status stream (``sandbox_pid`` and ``wait``
    both read from it, so neither loses what the other consumed)."""
    return handle.private.setdefault("json_status", JsonStatusParser())


def _idmap_refusal(plan: LaunchPlan, err: dict) -> dict:
    """The helper could not idmap a grant: name the grant and its filesystem, say what to do."""
    from agentvm.fsutil import mount_of

    try:
        n = int(err["message"].split()[1].rstrip(":"))
        fd_name = plan.body.fds["stages"][n][0]
        host = dict(plan.body.fds["open_paths"])[fd_name]
    except (IndexError, KeyError, ValueError):
        return err
    mnt, fstype = mount_of(host)
    return {**err, "message": f"the grant {host} is on a {fstype} filesystem (mounted at {mnt}), which cannot be "
            "idmapped: agent-vm refuses rather than let files land owned by a throwaway uid",
            "hint": "grant a folder on a filesystem that supports idmapped mounts (ext4, xfs, btrfs, tmpfs, "
            "overlayfs...), or copy the files in with `agentvm cp`"}


def _setup_error(raw: bytes) -> dict | None:
    return hv.helper_status(raw)[1]
