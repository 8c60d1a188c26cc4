"""The gVisor substrate: the agent runs on ``runsc``'s user-space kernel (the Sentry), so the
host kernel's syscall surface is behind a second, independent boundary.

Process chain of one sandbox::

    agentvm (supervisor, root)
      └─ agentvm-helper launch --runtime-root runsc   join cgroups, stage idmapped grants, no_new_privs
           = exec runsc run --bundle B ID               rootful OCI runtime, --network=none
               ├─ runsc-gofer                            serves the mounts (its own seccomp, chroot)
               └─ runsc-sandbox (the Sentry)              the agent's kernel (ptrace/systrap/KVM platform)
                    └─ /.agentvm/init (inside)           bridge to the gate, seccomp, exec
                         = COMMAND

The same policy as bwrap, through the same shared pieces (``hostview``): the read-only root
view (host /usr, the allowlisted /etc view), private tmpfs scratch, grants idmapped by the
helper (their owner is the agent inside, what it writes lands as the owner), the durable
workspace, the environment, the per-sandbox files. The network is ``--network=none``: the
sandbox's only route out is the gate's unix socket, bound in and bridged to 127.0.0.1:3128
by init (runsc's ``--host-uds=open`` lets a sandboxed process connect to a host socket it
was given, and nothing else). Limits are the helper's cgroups around runsc (the Sentry's own
memory counts), plus rlimits inside the Sentry.

What gVisor does not have: Landlock (the Sentry does not implement it; the gofer's mounts and
the Sentry's own checks enforce read-only), and this Debian build's platforms are ptrace and
KVM only (no systrap); see docs/threat-model.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentvm import cgroups as cg
from agentvm import seccomp as sc
from agentvm.backends import hostview as hv
from agentvm.backends.base import (
    Capabilities,
    ExitStatus,
    LaunchContext,
    LaunchPlan,
    MountOp,
    Primitive,
    SandboxHandle,
    TeardownReport,
)
from agentvm.backends.protocol import Backend
from agentvm.backends.status import drain
from agentvm.errors import EXIT_BACKEND, EXIT_POLICY, EXIT_TIMEOUT, AgentVMError, BackendError
from agentvm.policy import Policy

PRIMITIVES = (
    "runsc",  # gVisor's runsc, runnable
    "gvisor-platform",  # a platform that works here (systrap, ptrace or KVM), probed by starting a sandbox
    "seccomp",  # the filter init loads inside the Sentry (defence in depth)
    "cgroups",  # memory + pids (+cpu) limits around runsc
    "cgroup-kill",  # atomic kill of the Sentry, gofer and everything they started
    "dedicated-uid",  # the agent maps to a dedicated host uid (root: runsc is rootful here)
    "disk-quota",  # a real size limit on the durable workspace
)
SANDBOX_UID = 1000
SECCOMP_IN_SANDBOX = "/.agentvm/seccomp.bpf"
# The syscall audit (agentvm.sysaudit) is n/a here: the filter init loads inside the Sentry is
# gVisor's own seccomp emulation, which has no user notification (this runsc: a
# SECCOMP_FILTER_FLAG_NEW_LISTENER load fails, and a filter returning SECCOMP_RET_USER_NOTIF
# kills the caller with SIGSYS), so the filter here stays the plain deny list: probes are
# refused (EPERM) but not recorded. What runsc itself can report: seccheck trace points
# (`runsc trace create`, raw syscall/sysno/N/enter|exit for every number, with thread, process
# name and credentials) to a `remote` sink speaking gVisor's protobuf protocol on a unix
# socket, which agent-vm does not implement yet; and `--strace` into runsc's debug log (every
# syscall: not an audit). See docs/syscall-audit.md.
SYSCALL_AUDIT_NA = ("n/a on gvisor: the Sentry's seccomp has no user notification; probes are refused by the same "
                    "deny list but not recorded (runsc's seccheck `remote` trace sink is not wired)")
COMPAT_IN_SANDBOX = "/.agentvm/gvisor-compat.so"  # see native/gvisor-compat.c
# The agent's task limit is RLIMIT_NPROC inside the Sentry (fork fails with EAGAIN, the
# sandbox lives on). The host pids cgroup is only a backstop: when it is hit the Sentry
# panics and the whole sandbox dies. On ptrace an agent process costs ~1.75 host threads and
# the Sentry and gofer have their own (Go runtime): room for both above the agent's limit.
SENTRY_PIDS = 192


def _host_pids(pids: int) -> int:
    return 2 * pids + SENTRY_PIDS
PROBE_VERSION = 1


@dataclass(frozen=True)
class GvisorPlan:
    """The gVisor substrate's body of a LaunchPlan: runsc's command line, the OCI bundle's
    config.json (as data), the skeleton of the read-only root, and the host-side limits."""

    argv: tuple[str, ...]  # helper launch ... -- runsc FLAGS run --bundle B ID (fds as @fd:NAME@)
    runsc: tuple[str, ...]  # runsc and its global flags (exec, kill, delete reuse them)
    oci: dict  # config.json
    skeleton: tuple[tuple[str, str], ...]  # (path in the root, "dir" | "file" | "link:TARGET"): mount points
    files: tuple[tuple[str, str], ...]  # per-sandbox files: path relative to the run dir -> content
    cgroup: dict
    host_uid: int
    host_gid: int
    run_dir: str
    platform: str
    fds: dict = field(default_factory=dict, hash=False, compare=False)  # grants the helper opens and stages

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("argv", "runsc", "oci", "skeleton", "files", "cgroup", "host_uid",
                                           "host_gid", "run_dir", "platform")}
        d["argv"], d["runsc"] = list(self.argv), list(self.runsc)
        d["skeleton"] = [list(s) for s in self.skeleton]
        d["files"] = [[p, "<%d bytes>" % len(c)] for p, c in self.files]
        return d


def _runsc_path() -> str | None:
    """runsc, as an absolute path to a root-owned file no one else can write (it runs as root)."""
    import shutil

    p = os.environ.get("AGENTVM_RUNSC") or shutil.which("runsc") or (
        "/usr/bin/runsc" if os.path.exists("/usr/bin/runsc") else None)
    return os.path.realpath(p) if p else None


def _check_runsc(path: str) -> str:
    """Why ``path`` may not be run as root, or "" (absolute, a regular root-owned file that
    neither group nor others can write, in root-owned directories nobody else can write)."""
    if not os.path.isabs(path):
        return f"{path} is not an absolute path"
    if os.path.basename(path) != "runsc":
        return f"{path} is not named runsc (agent-vm's helper runs only a binary named runsc as root)"
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    import stat as st_

    if not st_.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return f"{path} must be a regular file owned by root and writable by nobody else (it runs as root)"
    d = os.path.dirname(path)
    while True:
        dst = os.stat(d)
        if dst.st_uid != 0 or dst.st_mode & 0o022 and not dst.st_mode & st_.S_ISVTX:
            return f"{d} (a directory above {path}) can be written by a user other than root"
        if d == "/":
            return ""
        d = os.path.dirname(d)


class GvisorBackend(hv.ChildProcessSandbox, Backend):
    name = "gvisor"
    primitives = PRIMITIVES
    host_local = True
    strength = 2  # a user-space kernel between the agent and the host's
    tty = False  # runsc needs a console socket for a terminal: not wired yet

    def __init__(self, paths, *, tools: dict[str, str] | None = None, platform: str | None = None) -> None:
        self.paths = paths
        self._caps: Capabilities | None = None
        self._tools = dict(tools or {})
        self._platform = platform

    # ------------------------------------------------------------------ capabilities
    def _tool(self, name: str) -> str:
        if name not in self._tools:
            if name == "runsc":
                p = _runsc_path()
                if p is None:
                    raise BackendError("runsc is not installed", hint="apt-get install runsc (Debian's gVisor)")
                why = _check_runsc(p)
                if why:
                    raise BackendError(f"refusing to run runsc as root: {why}", hint="use Debian's /usr/bin/runsc")
                self._tools[name] = p
            else:
                from agentvm import native

                fn = native.helper_path if name == "helper" else native.gvisor_compat_path
                self._tools[name] = str(fn(self.paths.libexec))
        return self._tools[name]

    @property
    def state_root(self) -> Path:
        return self.paths.runtime / "runsc"

    def capabilities(self) -> Capabilities:
        if self._caps is not None:
            return self._caps
        from agentvm import workspace

        prims: list[Primitive] = []
        facts: dict = {"root": os.geteuid() == 0}
        runsc = _runsc_path()
        probe: dict = {}
        if runsc is None:
            prims.append(Primitive("runsc", False, "runsc not installed: apt-get install runsc"))
            prims.append(Primitive("gvisor-platform", False, "needs runsc"))
        elif os.geteuid() != 0:
            prims.append(Primitive("runsc", False, "agent-vm runs runsc rootful: run as root"))
            prims.append(Primitive("gvisor-platform", False, "needs root"))
        elif _check_runsc(runsc):
            prims.append(Primitive("runsc", False, _check_runsc(runsc)))
            prims.append(Primitive("gvisor-platform", False, "needs a trustworthy runsc"))
        else:
            facts["runsc"] = runsc
            probe = self._probe(runsc)
            facts.update({k: probe.get(k) for k in ("version", "platform", "platforms_tried")})
            prims.append(Primitive("runsc", bool(probe.get("version")), probe.get("version") or probe.get("error", "")))
            plat = probe.get("platform")
            prims.append(Primitive("gvisor-platform", bool(plat),
                                   f"{plat} (started a sandbox in {probe.get('start_ms')} ms)" if plat
                                   else "no platform could start a sandbox: " + "; ".join(
                                       f"{k}: {v}" for k, v in (probe.get("platforms_tried") or {}).items())))
        try:
            sc.compiled_filter(sc.SeccompOptions(), self.paths.libexec)
            prims.append(Primitive("seccomp", True, "libseccomp filter compiled (loaded inside the Sentry)"))
            facts["syscall_audit"] = SYSCALL_AUDIT_NA
        except Exception as exc:
            prims.append(Primitive("seccomp", False, str(exc)))
        layout = cg.detect()
        facts["cgroups"] = layout.describe()
        writable = os.access(layout.v2_root if layout.mode == "v2" else layout.v1.get("memory", "/nonexistent"), os.W_OK)
        prims.append(Primitive("cgroups", layout.mode != "none" and writable, layout.mode))
        prims.append(Primitive("cgroup-kill", writable and (layout.v2_root is not None or "freezer" in layout.v1),
                               "cgroup.kill" if layout.v2_root else "v1 freezer"))
        root = os.geteuid() == 0
        prims.append(Primitive("dedicated-uid", root, "per-agent uid" if root else "needs root"))
        q_ok, q_detail = workspace.quota_supported()
        prims.append(Primitive("disk-quota", q_ok, q_detail))
        self._caps = Capabilities(self.name, tuple(prims), facts)
        return self._caps

    def _probe(self, runsc: str) -> dict:
        """runsc's version and the first platform that really starts a sandbox here (cached
        per runsc binary: a probe starts sandboxes). KVM is tried only where the CPU exposes
        virtualization (a nested PVM /dev/kvm hangs guests), with a hard timeout."""
        import hashlib

        st = os.stat(runsc)
        key = hashlib.sha256(f"{PROBE_VERSION}:{runsc}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = self.paths.libexec / f"gvisor-probe-{key}.json"
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):
            pass
        out: dict = {"platforms_tried": {}}
        try:
            v = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10)
            out["version"] = (v.stdout.splitlines() or [""])[0].strip()
            flags = subprocess.run([runsc, "help", "flags"], capture_output=True, text=True, timeout=10).stdout + \
                subprocess.run([runsc, "flags"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            out["error"] = str(exc)
            return out
        candidates = []
        if "systrap" in flags:
            candidates.append("systrap")
        candidates.append("ptrace")
        if _kvm_usable():
            candidates.insert(0, "kvm")
        import tempfile

        for plat in candidates:
            with tempfile.TemporaryDirectory(prefix="agentvm-runsc-probe-") as td:
                t0 = time.perf_counter()
                try:
                    r = subprocess.run([runsc, "--root", td, f"--platform={plat}", "--network=none", "--ignore-cgroups",
                                        "do", "/bin/true"], capture_output=True, text=True, timeout=20,
                                       stdin=subprocess.DEVNULL)
                    ok, why = r.returncode == 0, (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                except subprocess.TimeoutExpired:
                    ok, why = False, "hung (killed after 20 s)"
                ms = round((time.perf_counter() - t0) * 1000)
            out["platforms_tried"][plat] = "ok" if ok else why[:200]
            if ok:
                out["platform"], out["start_ms"] = plat, ms
                break
        try:
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(out))
            os.replace(tmp, cache)
        except OSError:
            pass
        return out

    def required_primitives(self, policy: Policy) -> tuple[str, ...]:
        req = ["runsc", "gvisor-platform", "seccomp", "cgroups", "cgroup-kill", "dedicated-uid"]
        if policy.agent and policy.workspace:
            req.append("disk-quota")
        return tuple(req)

    # ------------------------------------------------------------------ compile (pure)
    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        host = ctx.host
        if host is None:
            raise BackendError("the gvisor substrate runs on this host: the launch context has no host part")
        if not host.dedicated:
            raise BackendError("the gvisor substrate needs a dedicated uid (agent-vm as root)")
        if ctx.gate is not None and ctx.gate.kind not in self.gate_kinds:
            raise BackendError(f"the gvisor substrate cannot attach a {ctx.gate.kind!r} gate")
        from agentvm import review

        review.check_substrate(policy, self.name)  # review-mode grants: refused here, never widened to rw
        helper, runsc = self._tool("helper"), self._tool("runsc")
        platform = self._platform or self.capabilities().facts.get("platform") or "ptrace"
        lim = policy.limits
        degraded = set(ctx.degraded)
        run_dir = host.run_dir
        mounts = hv.base_mounts(policy, host)
        fd_names: list[tuple[str, str]] = []
        stages: list[tuple[str, str, str]] = []
        protects: list[tuple[str, str, tuple]] = []
        protect_args: list[str] = []
        for i, p in enumerate(policy.extra_ro):
            # opened by the supervisor and staged by the helper, like the grants (runsc binds by
            # path as root: nothing may be left to swap between the checks and the bind), but not
            # idmapped: the agent gets what other users get, as under bwrap
            real = os.path.realpath(p)
            fd_names.append((f"extra{i}", real))
            stage = f"{run_dir}/grants/x{i}"
            stages.append((f"extra{i}", "rp", stage))  # read-only, ownership as on the host (not idmapped)
            mounts.append(MountOp("ro-bind", p, stage))
        for i, m in enumerate(policy.mounts):
            real = os.path.realpath(m.host)
            fd_names.append((f"grant{i}", real))
            stage = f"{run_dir}/grants/{i}"
            stages.append((f"grant{i}", "rw" if m.writable else "ro", stage))
            mounts.append(MountOp("bind" if m.writable else "ro-bind", m.path, stage))
            if m.writable:
                prot = ctx.protected[i] if i < len(ctx.protected) else ()
                protects.append((f"grant{i}", real, prot))
                for p in prot:
                    protect_args += ["--protect", f"{len(stages) - 1},{p.kind[0]},{p.rel}"]
        if policy.workspace:
            if ctx.workspace:
                mounts.append(MountOp("bind", policy.workspace, ctx.workspace))
            else:
                mounts.append(MountOp("tmpfs", policy.workspace, size=lim.disk, perms="0700"))
        for i, (path, _) in enumerate(ctx.extra_files):
            mounts.append(MountOp("ro-bind", path, f"{run_dir}/files/{i}"))
        mounts.append(MountOp("ro-bind", hv.HELPER_IN_SANDBOX, helper))
        mounts.append(MountOp("ro-bind", COMPAT_IN_SANDBOX, self._tool("compat")))
        mounts.append(MountOp("ro-bind", "/etc/ld.so.preload", f"{run_dir}/etc/ld.so.preload"))
        seccomp_on = "seccomp" not in degraded
        if seccomp_on:
            mounts.append(MountOp("ro-bind", SECCOMP_IN_SANDBOX, f"{run_dir}/seccomp.bpf"))
        gate = policy.egress is not None
        if gate:
            if ctx.gate is None:
                raise BackendError("the policy has egress rules but no gate was attached (fail closed)")
            # read-only, as under bwrap: connecting needs no write access to the node, and a
            # writable bind would let the agent chmod the host's socket open to every local user
            mounts.append(MountOp("ro-bind", hv.GATE_IN_SANDBOX, ctx.gate.address))
            if host.node_shim:
                mounts.append(MountOp("ro-bind", hv.NODE_SHIM_IN_SANDBOX, host.node_shim))
            if host.mcp_shim and policy.tools is not None:
                mounts.append(MountOp("ro-bind", hv.MCP_SHIM_IN_SANDBOX, host.mcp_shim))
                mounts.append(MountOp("ro-bind", hv.REQUEST_IN_SANDBOX, host.mcp_shim))

        env = hv.sandbox_env(policy, ctx)
        command = list(policy.command) or ["/bin/sh"]
        init = [hv.HELPER_IN_SANDBOX, "init", "--no-landlock"]
        if seccomp_on:
            init += ["--seccomp-file", SECCOMP_IN_SANDBOX]
        if gate:
            init += ["--gate-socket", hv.GATE_IN_SANDBOX, "--gate-port", str(ctx.gate.port)]
        confine = ["--chdir", policy.cwd]
        init += confine

        # what each staged grant is (a stage does not exist before launch): the host folder's kind
        kinds = {stage: ("dir" if os.path.isdir(real) else "file")
                 for (name, _, stage), (_, real) in zip(stages, fd_names)}
        oci_mounts, skeleton = _oci_mounts(mounts, kinds)
        rlimits = [("RLIMIT_NOFILE", lim.nofile), ("RLIMIT_CORE", 0), ("RLIMIT_FSIZE", lim.disk),
                   ("RLIMIT_NPROC", lim.pids)]
        oci = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": SANDBOX_UID, "gid": SANDBOX_UID},
                "args": init + ["--"] + command,
                "env": [f"{k}={v}" for k, v in sorted(env.items())],
                "cwd": "/",
                "capabilities": {k: [] for k in ("bounding", "effective", "permitted", "inheritable", "ambient")},
                "rlimits": [{"type": t, "soft": v, "hard": v} for t, v in rlimits],
                "noNewPrivileges": True,
            },
            "root": {"path": f"{run_dir}/rootfs", "readonly": True},
            "hostname": hv.hostname(policy.name),
            "mounts": oci_mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user")],
                # the agent (1000 inside) is the dedicated host uid: what it writes in its
                # workspace is that uid's; granted folders are idmapped by the helper so their
                # owner is that uid too. Root inside maps to nothing anyone owns.
                "uidMappings": [{"containerID": 0, "hostID": _nobody_base(host.uid), "size": 1},
                                {"containerID": SANDBOX_UID, "hostID": host.uid, "size": 1}],
                "gidMappings": [{"containerID": 0, "hostID": _nobody_base(host.gid), "size": 1},
                                {"containerID": SANDBOX_UID, "hostID": host.gid, "size": 1}],
            },
        }
        runsc_global = [runsc, "--root", str(self.state_root), f"--platform={platform}", "--network=none",
                        "--host-uds=open", "--ignore-cgroups"]
        # the per-run logs: runsc's own, and (info level, ~13 KB a run) the sandbox's boot and
        # gofer processes' - the only place their reason is written when they die while starting
        runsc_argv = runsc_global + [f"--debug-log={run_dir}/runsc-debug/", "--log", f"{run_dir}/runsc.log"]
        launch = [helper, "launch", "--status-fd", "@fd:status@"]
        for name, _ in fd_names:
            launch += ["--keep-fd", f"@fd:{name}@"]
        for name, mode, stage in stages:
            launch += ["--grant", f"@fd:{name}@,{mode},{stage}"]
        launch += protect_args
        launch += ["--cgroup-procs", "@cgroups@", "--rlimit", "core=0:0", "--runtime-root", "runsc",
                   "--idmap-to", f"{host.uid}:{host.gid}"]
        argv = tuple(launch + ["--"] + runsc_argv + ["run", "--bundle", f"{run_dir}/bundle", ctx.sandbox_id])
        body = GvisorPlan(
            argv=argv,
            runsc=tuple(runsc_global),  # without the per-run logs (exec/kill/delete log to stderr)
            oci=oci,
            skeleton=tuple(skeleton),
            files=hv.sandbox_files(policy, ctx) + (("etc/ld.so.preload", COMPAT_IN_SANDBOX + "\n"),),
            cgroup={"memory": lim.memory, "pids": _host_pids(lim.pids), "cpus": lim.cpus,
                    "enabled": "cgroups" not in degraded},
            host_uid=host.uid,
            host_gid=host.gid,
            run_dir=run_dir,
            platform=platform,
            fds={"open_paths": tuple(fd_names), "stages": tuple(stages), "protects": tuple(protects),
                 "seccomp": seccomp_on, "allow_ptrace": policy.allow_ptrace, "confine": tuple(confine)},
        )
        return LaunchPlan.of(policy, ctx, substrate=self.name, command=command, env=env,
                             identity=f"gVisor sandbox uid {SANDBOX_UID} = {hv.host_uid_text(host)} ({platform} platform)",
                             body=body)

    # ------------------------------------------------------------------ launch
    def launch(self, plan: LaunchPlan, *, stdio: tuple[int, int, int] | None = None) -> SandboxHandle:
        body: GvisorPlan = plan.body
        run_dir = Path(body.run_dir)
        state: dict = {"run_dir": str(run_dir)}
        handle = SandboxHandle(plan.sandbox_id, plan, started_at=time.monotonic(), private=state)
        opened: list[int] = []
        try:
            hv.write_run_files(run_dir, body.files)
            self.state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            # the read-only root: only mount points (gVisor's root is this empty skeleton)
            root = run_dir / "rootfs"
            root.mkdir(mode=0o755, exist_ok=True)
            for path, kind in body.skeleton:
                p = root / path.lstrip("/")
                if kind.startswith("link:"):
                    p.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(kind[5:], p)
                elif kind == "dir":
                    p.mkdir(parents=True, exist_ok=True)
                else:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.touch(exist_ok=True)
            for d, _, fs in os.walk(root):
                os.chmod(d, 0o755)
            bundle = run_dir / "bundle"
            bundle.mkdir(mode=0o700, exist_ok=True)
            (bundle / "config.json").write_text(json.dumps(body.oci))
            if body.fds.get("seccomp"):
                (run_dir / "seccomp.bpf").write_bytes(
                    sc.compiled_filter(sc.SeccompOptions(allow_ptrace=body.fds.get("allow_ptrace", False), statx_fallback=True),
                                      self.paths.libexec))
                os.chmod(run_dir / "seccomp.bpf", 0o644)
            group = None
            if body.cgroup.get("enabled", True):
                group = cg.SandboxCgroup.create(plan.sandbox_id, cg.detect(), memory=body.cgroup["memory"],
                                                pids=body.cgroup["pids"], cpus=body.cgroup["cpus"])
            state["cgroup"] = group
            fds = hv.open_grants(body.fds, self.paths, run_dir, state, opened)
            st_r, st_w = os.pipe2(os.O_CLOEXEC)
            opened.append(st_w)
            state["status_r"] = st_r
            fds["status"] = st_w
            argv = hv.substitute(body.argv, fds, group.procs_files() if group else [])
            for fd in opened:
                os.set_inheritable(fd, True)
            hv.become_subreaper()
            stdio, state["relays"] = _file_safe_stdio(stdio if stdio is not None else (0, 1, 2))
            kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
            try:
                state["proc"] = subprocess.Popen(argv, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, close_fds=True,
                                                 pass_fds=tuple(opened), cwd="/", **kw)
            finally:
                _close_relay_ends(state.get("relays"))
            hv.mark_run_dir(run_dir, self.name)
            if _restores(body):  # a resume: running only once runsc has restored the image
                why = self._wait_running(handle, timeout=120.0)
                if why:
                    err = _runsc_error(run_dir / "runsc.log")
                    raise BackendError(f"runsc could not restore the checkpoint: {err or why}",
                                       hint="the checkpoint is kept; `agentvm stop NAME` drops it")
        except BaseException:
            for fd in opened:
                hv.close_fd(fd)
            opened.clear()
            self.destroy(handle)
            raise
        finally:
            for fd in opened:
                hv.close_fd(fd)
        return handle

    # ------------------------------------------------------------------ wait / poll
    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus:
        proc: subprocess.Popen = handle.private["proc"]
        timed_out = False
        try:
            proc.wait(timeout=timeout if timeout and timeout > 0 else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(handle)
            proc.wait()
        rc = proc.returncode
        _join_relays(handle.private.get("relays"))
        es = ExitStatus(exit_code=rc if rc >= 0 else 128 - rc, duration=time.monotonic() - handle.started_at)
        if rc < 0:
            es.signal = -rc
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        stats = group.stats() if group else {}
        es.oom_killed = bool(stats.get("oom_kills"))
        es.pids_limit_hit = bool(stats.get("pids_max_hits"))
        es.memory_peak = stats.get("memory_peak")
        es.cpu_time = stats.get("cpu_time")
        raw = drain(handle.private.get("status_r"))
        _, setup_error = hv.helper_status(raw)
        if setup_error:
            es.setup_error = setup_error
            es.exit_code = EXIT_POLICY if setup_error["step"] == "grant-idmap" else EXIT_BACKEND
        elif rc == 128 and not timed_out and not handle.private.get("stopping"):
            why = _runsc_error(Path(handle.private["run_dir"]) / "runsc.log")
            if why:  # runsc could not create or start the sandbox (its message is in its log)
                es.setup_error = {"step": "runsc", "errno": 0,
                                  "message": f"{why} (platform {handle.plan.body.platform})"}
                es.exit_code = EXIT_BACKEND
        if timed_out:
            es.timed_out, es.exit_code = True, EXIT_TIMEOUT
        return es

    # ------------------------------------------------------------------ exec
    def exec(self, handle: SandboxHandle, argv: list[str], *, stdio: tuple[int, int, int] | None = None,
             timeout: float | None = None) -> ExitStatus:
        """``runsc exec``: a new process in the running sandbox's Sentry, as the agent's uid,
        with the same environment, through init (the same seccomp filter)."""
        body: GvisorPlan = handle.plan.body
        if self.poll(handle):
            return ExitStatus(exit_code=EXIT_BACKEND, setup_error={"step": "exec", "errno": 0,
                                                                    "message": "the sandbox is not running"})
        why = self._wait_running(handle)
        if why:
            return ExitStatus(exit_code=EXIT_BACKEND, setup_error={"step": "exec", "errno": 0, "message": why})
        init = [hv.HELPER_IN_SANDBOX, "init", "--no-landlock"]
        if body.fds.get("seccomp"):
            init += ["--seccomp-file", SECCOMP_IN_SANDBOX]
        proc_spec = dict(body.oci["process"], args=init + list(body.fds.get("confine", ())) + ["--"] + list(argv))
        spec_path = Path(body.run_dir) / f"exec-{os.urandom(4).hex()}.json"
        spec_path.write_text(json.dumps(proc_spec))
        pid_file = spec_path.with_suffix(".pid")
        cmd = list(body.runsc) + ["exec", "--process", str(spec_path), "--internal-pid-file", str(pid_file),
                                  handle.sandbox_id]
        stdio, relays = _file_safe_stdio(stdio if stdio is not None else (0, 1, 2))
        kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, close_fds=True, cwd="/", **kw)
        finally:
            _close_relay_ends(relays)
        timed_out = False
        try:
            proc.wait(timeout=timeout if timeout and timeout > 0 else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:  # the process inside and its descendants, then the client
                self._kill_tree(handle, int(pid_file.read_text()))
            except (OSError, ValueError):
                pass
            proc.kill()
            proc.wait()
        finally:
            for p in (spec_path, pid_file):
                try:
                    p.unlink()
                except OSError:
                    pass
        rc = proc.returncode
        _join_relays(relays)
        es = ExitStatus(exit_code=rc if rc >= 0 else 128 - rc, duration=time.monotonic() - t0)
        if timed_out:
            es.timed_out, es.exit_code = True, EXIT_TIMEOUT
        return es

    def _kill_tree(self, handle: SandboxHandle, pid: int) -> None:
        """SIGKILL an exec'd process and every descendant of it inside the Sentry (``runsc
        kill --pid`` reaches one process; a shell's children would keep its output open)."""
        r = self._runsc(handle, "ps", handle.sandbox_id)
        kids: dict[int, list[int]] = {}
        for line in (r.stdout.splitlines()[1:] if r is not None and r.returncode == 0 else []):
            cols = line.split()  # UID PID PPID C TTY STIME TIME CMD
            try:
                kids.setdefault(int(cols[2]), []).append(int(cols[1]))
            except (IndexError, ValueError):
                continue
        tree, todo = [], [pid]
        while todo:
            q = todo.pop()
            tree.append(q)
            todo += kids.get(q, [])
        for q in tree:
            self._runsc(handle, "kill", "--pid", str(q), handle.sandbox_id, "KILL")

    def _wait_running(self, handle: SandboxHandle, timeout: float = 20.0) -> str:
        """Wait until runsc reports the container running (``runsc run`` returns to nobody, so
        an exec right after launch must wait for it); "" once it is, else why not."""
        if handle.private.get("running"):
            return ""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.poll(handle):
                return "the sandbox is not running (it exited)"
            r = self._runsc(handle, "state", handle.sandbox_id)
            if r is not None and r.returncode == 0:
                try:
                    status = json.loads(r.stdout).get("status")
                except ValueError:
                    status = None
                if status == "running":
                    handle.private["running"] = True
                    return ""
                last = f"runsc reports it {status}"
            elif r is not None:
                last = (r.stderr.strip().splitlines() or [""])[-1]
            time.sleep(0.02)
        return f"the sandbox did not come up within {timeout:g}s ({last or 'no state'})"

    # ------------------------------------------------------------------ inspect / limits
    def inspect(self, handle: SandboxHandle) -> dict:
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        return {
            "sandbox_id": handle.sandbox_id,
            "running": not self.poll(handle),
            "platform": handle.plan.body.platform,
            "cgroup": group.stats() if group else {},
            "uptime": time.monotonic() - handle.started_at,
        }

    def set_limits(self, handle: SandboxHandle, *, memory: int | None = None, pids: int | None = None,
                   cpus: float | None = None) -> dict:
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        if group is None:
            raise BackendError("this sandbox runs without cgroups (degraded): its limits cannot change live")
        applied = group.tighten(memory=memory, pids=_host_pids(pids) if pids is not None else None, cpus=cpus)
        if "pids" in applied:
            applied["pids"] = pids
        return applied

    # ------------------------------------------------------------------ suspend / resume (issue 37)
    # ``runsc checkpoint`` writes the Sentry's whole state (every process, its memory, open
    # files, the sandbox's own /tmp and loopback sockets) into one image and ends the sandbox:
    # ``runsc run`` returns, and the ordinary teardown frees the cgroup, the processes, the
    # gate endpoint. ``runsc restore`` (in place of ``run``, same bundle shape) brings it back.
    can_suspend = True

    def host_sockets(self, handle: SandboxHandle) -> list[dict]:
        """The host sockets the sandbox holds open: with ``--host-uds=open`` a connect to the
        gate's socket (the only host socket mounted in) is made by the gofer, in the gofer's
        network namespace, and its descriptor handed to the Sentry. So a unix socket the Sentry
        holds, of the gofer's namespace, whose peer is neither the gofer's nor the Sentry's own
        (the gofer's channels are socket pairs between the two) is a connection to the gate -
        open, or half-open (the gate closed its end, peer 0, while the agent still holds the
        bridge's). runsc 2022 cannot save one: a checkpoint then takes the sandbox down.
        [] when none; BackendError when it cannot be told (then nothing may be checkpointed)."""
        sentry, gofers = self._runtime_pids(handle)
        if sentry is None or not gofers:
            raise BackendError("cannot find the sandbox's Sentry and gofer processes to look at its open sockets")
        sentry_held = _socket_fds(sentry)
        own = set(sentry_held)
        for g in gofers:
            own.update(_socket_fds(g))
        out, seen_ns = [], set()
        host_ns = os.readlink("/proc/self/ns/net")
        for g in gofers:
            try:
                ns = os.readlink(f"/proc/{g}/ns/net")
            except OSError:
                continue
            if ns == host_ns:  # (the host's: every host socket would be looked at)
                raise BackendError("the gofer runs in the host's network namespace: the sandbox's connections "
                                   "to its gate cannot be told apart from the host's")
            if ns in seen_ns:
                continue
            seen_ns.add(ns)
            for local, peer, state in _unix_sockets_in(g):
                if local in sentry_held and peer not in own:
                    out.append({"inode": local, "sentry_fd": sentry_held[local], "state": state,
                                "peer": "closed by the gate (half-open)" if peer == 0 else "open"})
        if not seen_ns:
            raise BackendError("cannot read the gofer's sockets: whether the sandbox holds a connection open is unknown")
        return out

    def wait_quiet(self, handle: SandboxHandle, timeout: float) -> list[dict]:
        """Wait up to ``timeout`` seconds for the sandbox to hold no connection to its gate (its
        requests under way finish, its clients close what the gate closed): what it still
        holds then ([] once quiet). A census that cannot be taken is left to :meth:`suspend`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                held = self.host_sockets(handle)
            except BackendError:
                return []
            if not held or time.monotonic() >= deadline:
                return held
            time.sleep(0.2)

    def _runtime_pids(self, handle: SandboxHandle) -> tuple[int | None, list[int]]:
        """(the Sentry's pid, the gofers' pids) of this sandbox."""
        sentry = None
        r = self._runsc(handle, "state", handle.sandbox_id)
        if r is not None and r.returncode == 0:
            try:
                sentry = int(json.loads(r.stdout).get("pid") or 0) or None
            except ValueError:
                sentry = None
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        pids = sorted(group.pids()) if group is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
        gofers = []
        for p in pids:
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"runsc-gofer") and handle.sandbox_id.encode() in b" ".join(argv):
                gofers.append(p)
        return sentry, gofers

    def suspend(self, handle: SandboxHandle, image_dir: str, *, paused=None) -> None:
        """``runsc pause`` (every task of the Sentry stopped: nothing can open a connection
        now), the census of host sockets (:meth:`host_sockets`): any -> ``runsc resume`` and
        ``sandbox.suspend-busy`` naming them, the sandbox running as before; none -> ``runsc
        checkpoint`` of the paused sandbox (which ends it: its run returns). ``paused()``, if
        given, is called just before the checkpoint, nothing of the sandbox running (a memory
        snapshot reads its workspace there); if it raises, the sandbox is resumed, unchanged."""
        proc: subprocess.Popen | None = handle.private.get("proc")
        if proc is None or proc.poll() is not None:
            raise AgentVMError("the sandbox is not running: nothing to suspend", code="sandbox.not-running")
        r = self._runsc(handle, "pause", handle.sandbox_id, timeout=30.0)
        if r is None or r.returncode != 0:
            raise BackendError("runsc could not pause the sandbox before its checkpoint: "
                               + ((r.stderr.strip() if r is not None else "") or "no answer within 30 s")[-300:],
                               hint="the sandbox keeps running; try again")
        try:
            held = self.host_sockets(handle)
        except BaseException:
            self._runsc(handle, "resume", handle.sandbox_id, timeout=30.0)
            raise
        if held:
            self._runsc(handle, "resume", handle.sandbox_id, timeout=30.0)
            half = sum(1 for h in held if h["peer"] != "open")
            kinds = ([f"{len(held) - half} open (a request under way, or an idle keep-alive connection)"]
                     if len(held) > half else []) + ([f"{half} half-open (closed by the gate, still held by "
                                                      "the agent's client)"] if half else [])
            raise AgentVMError(
                f"the sandbox holds {len(held)} connection(s) to its gate: " + ", ".join(kinds)
                + " (Sentry fds " + ", ".join(str(h["sentry_fd"]) for h in held) + "). This runsc cannot save a host "
                  "socket, and a checkpoint now would take the sandbox down. Nothing was changed: it keeps running",
                code="sandbox.suspend-busy",
                hint="let the request finish, or close the connection in the agent (its client's idle timeout "
                     "does), and suspend again; or pause it (`agentvm pause NAME`: memory kept, CPU zero)")
        if paused is not None:
            try:
                paused()
            except BaseException:
                self._runsc(handle, "resume", handle.sandbox_id, timeout=30.0)
                raise
        handle.private["stopping"] = True  # its exit is ours, not runsc's failure
        r = self._runsc(handle, "checkpoint", "--image-path", image_dir, handle.sandbox_id, timeout=300.0)
        if r is None or r.returncode != 0:
            handle.private["stopping"] = False
            err = (r.stderr.strip() if r is not None else "") or "runsc did not answer within 300 s"
            why = next((ln for ln in err.splitlines() if "error" in ln.lower() or "panic" in ln.lower()), err[:300])
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            alive = proc.poll() is None
            if alive:
                self._runsc(handle, "resume", handle.sandbox_id, timeout=30.0)
            raise BackendError(
                f"runsc could not checkpoint the sandbox: {why[:400]}" + ("" if alive else
                                                                          " - and the sandbox did not survive it"),
                hint="the sandbox keeps running; stop it or try again" if alive else
                "a persistent worker is restarted afresh (its memory is lost)")
        handle.private["suspended"] = True
        # the image is whole; the Sentry, paused, would wait for its tasks to die: they never
        # run again (a write after the image was taken would not be in it), so it is killed
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self._kill(handle)

    def restoring(self, plan: LaunchPlan, image_dir: str) -> LaunchPlan:
        import dataclasses

        body: GvisorPlan = plan.body
        argv = list(body.argv)
        i = len(argv) - 4
        if argv[i:i + 2] != ["run", "--bundle"]:
            raise BackendError("this gVisor plan does not end in `run --bundle B ID`: cannot restore it")
        argv[i:i + 1] = ["restore", "--image-path", image_dir]
        return dataclasses.replace(plan, body=dataclasses.replace(body, argv=tuple(argv)))

    # ------------------------------------------------------------------ stop / destroy
    def _runsc(self, handle: SandboxHandle, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(list(handle.plan.body.runsc) + list(args), capture_output=True, text=True,
                                  timeout=timeout, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        except (OSError, subprocess.SubprocessError):
            return None

    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None:
        handle.private["stopping"] = True
        proc: subprocess.Popen | None = handle.private.get("proc")
        if proc is None or proc.poll() is not None:
            self._kill(handle)
            return
        self._runsc(handle, "kill", "--all", handle.sandbox_id, "TERM")
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._kill(handle)

    def _kill(self, handle: SandboxHandle) -> None:
        """runsc's own kill first (``runsc run`` then exits and removes its state), then the
        cgroup: everything the Sentry and gofer are, whatever runsc did."""
        group: cg.SandboxCgroup | None = handle.private.get("cgroup")
        proc: subprocess.Popen | None = handle.private.get("proc")
        if proc is not None and proc.poll() is None:
            self._runsc(handle, "kill", "--all", handle.sandbox_id, "KILL", timeout=5.0)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if group is not None:
            group.kill()
        elif proc is not None and proc.poll() is None:
            proc.kill()

    def destroy(self, handle: SandboxHandle) -> TeardownReport:
        t0 = time.monotonic()
        st = handle.private
        group: cg.SandboxCgroup | None = st.get("cgroup")
        proc: subprocess.Popen | None = st.get("proc")
        rep = TeardownReport(verified=False)
        if proc is not None and proc.poll() is None:
            self._kill(handle)
        if group is not None and not group.kill():
            rep.processes_left = sorted(group.pids())
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rep.processes_left.append(proc.pid)
        # the Sentry, gofer and platform stubs are host processes of uid 65534 (not the agent's
        # uid), re-parented to us (a subreaper) when runsc dies: reap them, or a long-lived
        # daemon would collect zombies without end
        _reap_runtime_zombies()
        if st.get("status_r") is not None:
            hv.close_fd(st.pop("status_r"))
        _join_relays(st.pop("relays", None))
        if group is not None:
            rep.cgroups_left = group.destroy()
        # runsc's own state for this container: gone when ``runsc run`` ended normally; left
        # when it was killed. Its sandbox is dead (the cgroup is empty), so the files are
        # removed directly - ``runsc delete --force`` would wait seconds for a dead sandbox
        if not rep.processes_left:
            _remove_runsc_state(self.state_root, handle.sandbox_id)
        left = _runsc_state_left(self.state_root, handle.sandbox_id)
        if left:
            rep.files_left += left
        return hv.finish_teardown(rep, st, handle.plan.body.host_uid, self.paths, t0)

    def reap_stale(self) -> list[str]:
        out = []
        for d in hv.stale_run_dirs(self.paths.sandboxes, self.name):
            hv.reap_run_dir(d, self.paths.runtime)  # kills the Sentry and gofer with the cgroup
            _remove_runsc_state(self.state_root, d.name)
            out.append(d.name)
        return out


# ---------------------------------------------------------------------- helpers


RUNSC_HOST_UID = 65534  # runsc runs the Sentry as nobody; agent-vm maps the container's root (the gofer) there too


def _nobody_base(uid: int) -> int:
    """The host id root inside a gVisor sandbox maps to: the overflow id (65534), which owns
    nothing of agent-vm's and which no process inside can become (no capabilities, no setuid)."""
    return RUNSC_HOST_UID


def _oci_mounts(mounts: list[MountOp], kinds: dict[str, str]) -> tuple[list[dict], list[tuple[str, str]]]:
    """The shared mount view as OCI mounts, and the skeleton of mount points the read-only
    root must already have (gVisor cannot create them in a read-only root)."""
    out: list[dict] = []
    skel: list[tuple[str, str]] = []
    seen: set[str] = set()

    def point(dest: str, kind: str) -> None:
        if dest not in seen:
            seen.add(dest)
            skel.append((dest, kind))

    for m in mounts:
        if m.kind == "symlink":
            point(m.dest, "link:" + m.src)
            continue
        if m.kind == "ro-bind-try":
            if not os.path.exists(m.src):
                continue
        if m.kind == "proc":
            out.append({"destination": m.dest, "type": "proc", "source": "proc"})
            point(m.dest, "dir")
        elif m.kind == "dev":
            out.append({"destination": m.dest, "type": "dev", "source": "dev"})
            point(m.dest, "dir")
        elif m.kind == "tmpfs":
            opts = ["nosuid", "nodev"]
            if m.perms:
                opts.append(f"mode={m.perms}")
            if m.size:
                opts.append(f"size={m.size}")
            if m.dest == hv.HOME_IN_SANDBOX or m.perms == "0700":
                opts += [f"uid={SANDBOX_UID}", f"gid={SANDBOX_UID}"]
            out.append({"destination": m.dest, "type": "tmpfs", "source": "tmpfs", "options": opts})
            point(m.dest, "dir")
        elif m.kind in ("ro-bind", "bind", "ro-bind-try"):
            ro = m.kind != "bind"
            out.append({"destination": m.dest, "type": "bind", "source": m.src,
                        "options": ["rbind", "ro" if ro else "rw", "nosuid", "nodev"]})
            point(m.dest, kinds.get(m.src) or _kind_of(m.src, m.dest))
        elif m.kind == "remount-ro":
            continue
        else:
            raise BackendError(f"the gvisor substrate has no mount of kind {m.kind!r}")
    return out, skel


def _kind_of(src: str, dest: str) -> str:
    """A mount point's kind from its source; sources made at launch (the per-sandbox files,
    the gate's socket, the seccomp filter) are files, the workspace a folder."""
    if os.path.isdir(src):
        return "dir"
    if os.path.exists(src) or dest.startswith(("/.agentvm/", "/etc/")) or "/files/" in src:
        return "file"
    return "dir"


def _file_safe_stdio(stdio: tuple[int, int, int]):
    """The Sentry writes a host *regular file* at its own offset from 0, overwriting what the
    file already holds (a shell's ``>`` redirection). Output that goes to a regular file goes
    through a pipe instead, copied to the file by a thread (the file's own offset and flags
    then apply). Returns (stdio, relays)."""
    import stat as st_
    import threading

    out = list(stdio)
    relays = []
    for i in (1, 2):
        try:
            regular = st_.S_ISREG(os.fstat(stdio[i]).st_mode)
        except OSError:
            regular = False
        if not regular:
            continue
        r, w = os.pipe2(os.O_CLOEXEC)
        dest = os.dup(stdio[i])  # the thread's own: the caller may close (and reuse) its number
        os.set_inheritable(dest, False)

        def copy(r=r, dest=dest) -> None:
            try:
                while chunk := os.read(r, 65536):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dest, view):]
            except OSError:
                pass
            finally:
                os.close(r)
                os.close(dest)

        t = threading.Thread(target=copy, name="agentvm-gvisor-stdio", daemon=True)
        t.start()
        relays.append((t, w))
        out[i] = w
    return tuple(out), relays


def _close_relay_ends(relays) -> None:
    """Our copies of the pipes' write ends (the runtime has its own)."""
    for k, (t, w) in enumerate(relays or ()):
        if w >= 0:
            hv.close_fd(w)
            relays[k] = (t, -1)


def _join_relays(relays, timeout: float = 5.0) -> None:
    for t, _ in relays or ():
        t.join(timeout)


def _reap_runtime_zombies(quiet_passes: int = 3, max_passes: int = 40) -> None:
    """Reap our zombie children of runsc's uid (65534: the Sentry, gofer and stubs of any
    gVisor sandbox of this process). Never a ``Popen`` child's exit status: those run as root
    (runsc) or as an agent's uid (bwrap). Live processes of that uid are not touched (they
    belong to another running sandbox; this one's cgroup was verified empty). Processes are
    re-parented to us as their parents die, a little after the cgroup empties: keep going
    until a few passes in a row find nothing."""
    from agentvm.identity import uid_processes

    me = os.getpid()
    quiet = 0
    for _ in range(max_passes):
        found = False
        for pid, ppid, state in uid_processes(RUNSC_HOST_UID):
            if ppid == me and state in ("Z", "X"):
                found = True
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        quiet = 0 if found else quiet + 1
        if quiet >= quiet_passes:
            return
        time.sleep(0.005)


def _kvm_usable() -> bool:
    if not os.path.exists("/dev/kvm"):
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " vmx" in flags or " svm" in flags


def _restores(body: GvisorPlan) -> bool:
    """Is this plan a restore (``restoring``: ``restore --image-path IMG --bundle B ID``)?"""
    return len(body.argv) >= 6 and body.argv[-6] == "restore" and body.argv[-5] == "--image-path"


def _runsc_error(log: Path) -> str:
    """The last error runsc logged (why it could not create or start the sandbox), followed,
    when the sandbox's own processes died while starting (runsc then only says "cannot read
    client sync file: ... EOF"), by the last warning or error those wrote in their logs."""
    def errors(path: Path, pick) -> list[str]:
        try:
            return [ln for ln in path.read_text(errors="replace").splitlines() if pick(ln)]
        except OSError:
            return []

    errs = errors(log, lambda ln: " E" in ln[:40] or "error" in ln.lower())
    why = (errs[-1] if errs else "")[-500:]
    if "sync" in why or "EOF" in why:
        for part in ("boot", "gofer"):
            for f in sorted(log.parent.glob(f"runsc-debug/*.{part}.txt"), reverse=True)[:1]:
                last = errors(f, lambda ln: ln[:1] in ("W", "E", "F") or "panic" in ln or "fatal" in ln)
                if last:
                    said = " | ".join(ln[-300:] for ln in last[-3:])
                    why += f"; the sandbox's {part} process said: {said}"
                else:  # no warning at all: its last words are the best clue
                    tail = errors(f, lambda ln: bool(ln.strip()))
                    if tail:
                        why += f"; the sandbox's {part} process's last line: {tail[-1][-300:]}"
    return why


def _remove_runsc_state(state_root: Path, cid: str) -> None:
    """runsc's files for a dead container (``<id>_sandbox:<id>.state`` and ``.lock``)."""
    for p in _runsc_state_left(state_root, cid):
        try:
            os.unlink(p)
        except IsADirectoryError:
            import shutil

            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _runsc_state_left(state_root: Path, cid: str) -> list[str]:
    """runsc's state files of exactly this container (``<id>_sandbox:<id>.*``, or ``<id>``)."""
    try:
        return [str(p) for p in state_root.iterdir()
                if p.name == cid or p.name.startswith(f"{cid}_sandbox:{cid}.")]
    except FileNotFoundError:
        return []


def _socket_fds(pid: int) -> dict[int, int]:
    """{socket inode: fd} of the process ``pid``."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        raise BackendError(f"cannot read the descriptors of the sandbox's process {pid} ({exc.strerror})") from None
    for fd in fds:
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            out[int(t[8:-1])] = int(fd)
    return out


def _unix_sockets_in(pid: int) -> list[tuple[int, int, str]]:
    """(inode, peer inode, state) of every unix stream socket of ``pid``'s network namespace
    (``ss`` there: the peer comes from sock_diag; 0 when the peer was closed)."""
    try:
        r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-xaH"], capture_output=True, text=True,
                           timeout=10, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"cannot list the sandbox's sockets (nsenter/ss: {exc})") from None
    if r.returncode != 0:
        raise BackendError(f"cannot list the sandbox's sockets: {r.stderr.strip()[-200:]}")
    out = []
    for ln in r.stdout.splitlines():
        cols = ln.split()
        # u_str ESTAB 0 0 <local addr|*> <inode> <peer addr|*> <peer inode>
        if len(cols) >= 8 and cols[0] == "u_str":
            try:
                out.append((int(cols[5]), int(cols[7]), cols[1].lower()))
            except ValueError:
                continue
    return out
