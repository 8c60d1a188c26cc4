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
import stat
import subprocess
import time
from pathlib import Path

from agentvm import cgroups as cg
from agentvm import defaults as D
from agentvm import grants
from agentvm import seccomp as sc
from agentvm.backends.base import (
    Capabilities,
    ExitStatus,
    LandlockPlan,
    LaunchContext,
    LaunchPlan,
    MountOp,
    Primitive,
    SandboxHandle,
    TeardownReport,
)
from agentvm.backends.status import JsonStatusParser, drain, read_until
from agentvm.errors import EXIT_BACKEND, EXIT_POLICY, EXIT_TIMEOUT, AgentVMError, BackendError, LaunchError
from agentvm.fsutil import check_grant_target
from agentvm.policy import Policy, append_env

HOME_IN_SANDBOX = D.HOME_PATH
HELPER_IN_SANDBOX = "/.agentvm/init"
GATE_IN_SANDBOX = "/.agentvm/gate.sock"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # system CAs + the gate's CA (see etc_view)
GATE_CA_FILE = "/etc/ssl/certs/agentvm-gate-ca.pem"
NODE_SHIM_IN_SANDBOX = "/.agentvm/node"
# /etc entries visible in the sandbox (read-only, if they exist). Everything else of the
# host's /etc - shadow, sudoers, ssh keys, machine-id, pip/npm configs with tokens - is absent.
ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf",
    # Debian's chromium wrapper sources chromium.d (default flags, Debian's public API keys);
    # not /etc/chromium/policies (managed policies may hold enrollment tokens)
    "chromium.d", "chromium/master_preferences",
    "debian_version", "fonts",
    "gai.conf", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias",
    "localtime", "magic", "magic.mime", "mime.types", "os-release", "profile", "protocols", "python3",
    "python3.11", "services", "ssl", "terminfo", "timezone", "vim", "wgetrc", "xattr.conf",
)
PER_SANDBOX_ETC = ("hosts", "hostname")
# Synthetic files in the shared view: the sandbox never sees the host's accounts or resolver.
VIEW_SYNTHETIC = {
    "passwd": "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    "agent:x:1000:1000:agent:/home/agent:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n",
    "resolv.conf": "# agent-vm: no resolver inside the sandbox; names resolve at the egress gate\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}
ETC_VIEW_VERSION = 1
MERGED_USR = (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin"))
BASE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin"


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


class BwrapBackend:
    name = "bwrap"

    def __init__(self, paths) -> None:
        self.paths = paths
        self._caps: Capabilities | None = None
        if os.geteuid() == 0:
            paths.check_traversable()

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
        req = ["userns", "bwrap", "seccomp", "landlock", "landlock-scope", "cgroups", "cgroup-kill"]
        if policy.local_ports:  # the explicit TCP port restriction is enforced by Landlock
            req.insert(4, "landlock-net")
        req.append("dedicated-uid")
        if policy.agent and policy.workspace:
            req.append("disk-quota")
        return tuple(req)

    # ------------------------------------------------------------------ compile (pure)
    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        lim = policy.limits
        degraded = set(ctx.degraded)
        mounts: list[MountOp] = [MountOp("ro-bind", "/usr", "/usr")]
        for name, target in MERGED_USR:
            mounts.append(MountOp("symlink", "/" + name, target))
        mounts.append(MountOp("ro-bind", "/etc", ctx.etc_view))
        for e in PER_SANDBOX_ETC:
            mounts.append(MountOp("ro-bind", "/etc/" + e, f"{ctx.run_dir}/etc/{e}"))
        mounts += [
            MountOp("proc", "/proc"),
            MountOp("dev", "/dev"),
            MountOp("tmpfs", "/dev/shm", size=lim.shm, perms="1777"),
            MountOp("tmpfs", "/tmp", size=lim.tmp, perms="1777"),
            MountOp("tmpfs", HOME_IN_SANDBOX, size=min(lim.tmp, 64 * 1024**2), perms="0700"),
            MountOp("ro-bind-try", "/sys/devices/system/cpu", "/sys/devices/system/cpu"),
        ]
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
        idmap = ctx.drop_privileges
        stages: list[tuple[str, str, str]] = []  # (fd name, ro|rw, stage path)
        protects: list[tuple[str, str, tuple]] = []  # every rw grant: (fd name, host path, grants.Protect...)
        protect_args: list[str] = []  # as root: the helper's --protect GRANT,KIND,REL
        for i, m in enumerate(policy.mounts):
            real = os.path.realpath(m.host)
            fd_names.append((f"grant{i}", real))
            if idmap:
                src = f"{ctx.run_dir}/grants/{i}"
                stages.append((f"grant{i}", "rw" if m.writable else "ro", src))
                mounts.append(MountOp("bind" if m.writable else "ro-bind", m.path, src))
            else:
                src = real
                mounts.append(MountOp("bind-fd" if m.writable else "ro-bind-fd", m.path, f"@fd:grant{i}@"))
            if m.writable:
                prot = ctx.protected[i] if i < len(ctx.protected) else ()
                protects.append((f"grant{i}", real, prot))
                for p in prot:
                    if idmap:  # the helper makes it read-only in the staged grant itself
                        protect_args += ["--protect", f"{len(stages) - 1},{p.kind[0]},{p.rel}"]
                    else:
                        mounts.append(MountOp("ro-bind", f"{m.path}/{p.rel}", f"{src}/{p.rel}"))
        if policy.workspace:
            if ctx.workspace_host:
                fd_names.append(("workspace", ctx.workspace_host))
                mounts.append(MountOp("bind-fd", policy.workspace, "@fd:workspace@"))
            else:
                mounts.append(MountOp("tmpfs", policy.workspace, size=lim.disk, perms="0700"))
        for i, (path, _) in enumerate(ctx.extra_files):
            mounts.append(MountOp("ro-bind", path, f"{ctx.run_dir}/files/{i}"))
        mounts.append(MountOp("ro-bind", HELPER_IN_SANDBOX, ctx.helper))
        gate = policy.egress is not None
        if gate:
            if not ctx.gate_socket:
                raise BackendError("the policy has egress rules but no gate socket was provided (fail closed)")
            mounts.append(MountOp("ro-bind", GATE_IN_SANDBOX, ctx.gate_socket))
            if ctx.node_shim:
                mounts.append(MountOp("ro-bind", NODE_SHIM_IN_SANDBOX, ctx.node_shim))
        mounts.append(MountOp("remount-ro", "/"))

        ro = ["/usr", "/etc", "/.agentvm", *policy.extra_ro] + [m.path for m in policy.mounts if not m.writable]
        rw = list(D.SCRATCH_PATHS)
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
                tcp_connect=tuple(sorted(set(policy.local_ports) | ({ctx.gate_port} if gate else set())))
                if use_net
                else (),
                tcp_bind=tuple(policy.local_ports) if use_net else (),
                scope=use_scope,
                min_abi=6 if use_scope else (4 if use_net else 1),
            )
            if not use_net:
                landlock = LandlockPlan(**{**landlock.__dict__, "tcp_connect": (), "tcp_bind": ()})

        rlimits = [("nofile", lim.nofile, lim.nofile), ("core", 0, 0), ("fsize", lim.disk, lim.disk)]
        if ctx.drop_privileges:
            # per-uid counter: a correct backstop only when the uid is the sandbox's own
            # above pids.max, so the cgroup refuses first and records it (pids.events)
            rlimits.append(("nproc", lim.pids + 16, lim.pids + 16))

        env = {
            "PATH": BASE_PATH,
            "HOME": HOME_IN_SANDBOX,
            "LANG": "C.UTF-8",
            "TERM": os.environ.get("TERM", "dumb") if ctx.tty else "dumb",
            "USER": "agent",
            "LOGNAME": "agent",
            "SHELL": "/bin/sh",
            "TMPDIR": "/tmp",
            "AGENTVM": "1",
            "AGENTVM_SANDBOX_ID": ctx.sandbox_id,
            "AGENTVM_AGENT": policy.name,
        }
        if gate:
            proxy = f"http://127.0.0.1:{ctx.gate_port}"
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
                env[k] = env[k.lower()] = proxy
            env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
            # trust the gate's CA (TLS-terminated hosts) through every common knob
            for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT", "AWS_CA_BUNDLE"):
                env[k] = CA_BUNDLE
            env["NODE_EXTRA_CA_CERTS"] = GATE_CA_FILE
            env["NODE_USE_ENV_PROXY"] = "1"  # Node >= 24 honours the proxy variables natively
            if ctx.node_shim:
                env["NODE_OPTIONS"] = f"--require {NODE_SHIM_IN_SANDBOX}/proxy.js"
        spec_env = dict(policy.env)
        if "NODE_OPTIONS" in env and spec_env.get("NODE_OPTIONS"):
            # the agent's Node options (a preset's heap size...) join the gate's preload: a
            # replaced NODE_OPTIONS would leave Node's fetch with no route out
            spec_env["NODE_OPTIONS"] = append_env("NODE_OPTIONS", env["NODE_OPTIONS"], spec_env["NODE_OPTIONS"])
        env.update(spec_env)
        env.update(dict(ctx.extra_env))  # placeholders win: the spec cannot shadow them

        launch = [ctx.helper, "launch", "--status-fd", "@fd:status@"]
        for name, _ in fd_names:
            launch += ["--keep-fd", f"@fd:{name}@"]
        for name, mode, stage in stages:
            launch += ["--grant", f"@fd:{name}@,{mode},{stage}"]
        launch += protect_args
        launch += ["--keep-fd", "@fd:seccomp@", "--keep-fd", "@fd:json@", "--keep-fd", "@fd:bwrapargs@",
                   "--keep-fd", "@fd:env@", "--argv0", "bwrap"]
        launch += ["--cgroup-procs", "@cgroups@"]
        for rname, soft, hard in rlimits:
            launch += ["--rlimit", f"{rname}={soft}:{hard}"]
        if ctx.drop_privileges:
            launch += ["--uid", str(ctx.host_uid), "--gid", str(ctx.host_gid)]
        bw = [
            "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--disable-userns",
            "--uid", str(ctx.sandbox_uid), "--gid", str(ctx.sandbox_gid), "--hostname", _hostname(policy.name),
            "--json-status-fd", "@fd:json@",
        ]
        for m in mounts:
            if m.size is not None:
                bw += ["--size", str(m.size)]
            if m.perms is not None:
                bw += ["--perms", m.perms]
            if m.kind in ("proc", "dev", "tmpfs", "remount-ro"):
                bw += ["--" + m.kind, m.dest]
            elif m.kind == "symlink":
                bw += ["--symlink", m.src, m.dest]
            else:
                bw += ["--" + m.kind, m.src, m.dest]
        init = [HELPER_IN_SANDBOX, "init", "--status-fd", "@fd:status@", "--env-fd", "@fd:env@"]
        if "seccomp" not in degraded:
            init += ["--seccomp-fd", "@fd:seccomp@"]
        if ctx.tty:
            init += ["--tty"]
        if gate:
            init += ["--gate-socket", GATE_IN_SANDBOX, "--gate-port", str(ctx.gate_port)]
        init += ["--chdir", policy.cwd]
        if landlock is None:
            init += ["--no-landlock"]
        else:
            init += ["--min-abi", str(landlock.min_abi), "--list", "/"]
            for p in landlock.read_only:
                init += ["--ro", p]
            init += ["--ro-try", "/sys"]
            for p in landlock.read_write:
                init += ["--rw", p]
            for p in landlock.read_write_host:
                init += ["--rw-host", p]
            init += ["--dev", "/dev", "--proc", "/proc"]
            if use_net:
                init += ["--net"]
                for p in landlock.tcp_connect:
                    init += ["--tcp-connect", str(p)]
                for p in landlock.tcp_bind:
                    init += ["--tcp-bind", str(p)]
            if landlock.scope:
                init += ["--scope"]
        command = list(policy.command) or ["/bin/sh"]
        # bwrap's options (host paths included) go through --args FD: the sandbox's pid 1 is
        # bwrap, and its command line is readable inside.
        argv = tuple(launch + ["--", ctx.bwrap, "--args", "@fd:bwrapargs@", "--"] + init + ["--"] + command)

        if ctx.sandbox_uid != 1000 or ctx.sandbox_gid != 1000:
            raise BackendError("the shared /etc view assumes sandbox uid/gid 1000")
        files = (
            ("etc/hosts", f"127.0.0.1\tlocalhost {_hostname(policy.name)}\n::1\tlocalhost ip6-localhost\n"),
            ("etc/hostname", _hostname(policy.name) + "\n"),
        ) + tuple((f"files/{i}", content) for i, (_, content) in enumerate(ctx.extra_files))
        return LaunchPlan(
            sandbox_id=ctx.sandbox_id,
            policy_digest=policy.digest(),
            argv=argv,
            bwrap_args=tuple(bw),
            env=tuple(sorted(env.items())),
            mounts=tuple(mounts),
            files=files,
            landlock=landlock,
            seccomp_denied=tuple(sc.denied_syscalls(sc.SeccompOptions(allow_ptrace=policy.allow_ptrace)))
            if "seccomp" not in degraded
            else (),
            seccomp_allow_ptrace=policy.allow_ptrace,
            rlimits=tuple(rlimits),
            cgroup={"memory": lim.memory, "pids": lim.pids, "cpus": lim.cpus, "enabled": "cgroups" not in degraded},
            host_uid=ctx.host_uid,
            host_gid=ctx.host_gid,
            cwd=policy.cwd,
            timeout=lim.timeout,
            run_dir=ctx.run_dir,
            fds={"open_paths": tuple(fd_names), "stages": tuple(stages), "protects": tuple(protects)},
        )

    # ------------------------------------------------------------------ launch
    def launch(self, plan: LaunchPlan, *, stdio: tuple[int, int, int] | None = None) -> SandboxHandle:
        if not plan.run_dir:
            raise LaunchError("plan", "the plan has no run dir")
        run_dir = Path(plan.run_dir)
        state: dict = {"run_dir": str(run_dir), "fds": []}
        handle = SandboxHandle(plan.sandbox_id, plan, pid=-1, started_at=time.monotonic(), backend_state=state)
        opened: list[int] = []
        try:
            # 1. synthetic files
            etc = run_dir / "etc"
            etc.mkdir(parents=True, exist_ok=True)
            os.chmod(run_dir, 0o711)
            os.chmod(etc, 0o755)
            for rel, content in plan.files:
                f = run_dir / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(f.parent, 0o755)
                f.write_text(content)
                os.chmod(f, 0o644)
            # 2. cgroups
            group = None
            if plan.cgroup.get("enabled", True):
                group = cg.SandboxCgroup.create(
                    plan.sandbox_id,
                    cg.detect(),
                    memory=plan.cgroup["memory"],
                    pids=plan.cgroup["pids"],
                    cpus=plan.cgroup["cpus"],
                )
            state["cgroup"] = group
            # 3. fds: grants (O_PATH, opened by the supervisor so the agent uid needs no
            # traversal rights on the host path), the seccomp filter, the status pipes.
            fds: dict[str, int] = {}
            for name, host in plan.fds.get("open_paths", ()):
                try:
                    fd = os.open(host, os.O_PATH | os.O_CLOEXEC)
                except OSError as exc:
                    raise LaunchError("grant", f"cannot open {host}: {exc.strerror}") from exc
                opened.append(fd)
                fds[name] = fd
                # what was opened is what gets mounted: check *that* (not the name we checked
                # earlier), so swapping a path component in between gains nothing
                if name == "workspace":
                    continue  # agent-vm's own mount, not a grant
                actual = os.readlink(f"/proc/self/fd/{fd}")
                if actual != host:
                    raise LaunchError("grant", f"{host} changed since it was checked (it now leads to {actual}): refused")
                try:
                    writable = any(n == name for n, _, _ in plan.fds.get("protects", ()))  # every rw grant has an entry
                    check_grant_target(actual, [self.paths.home.resolve(), self.paths.runtime.resolve()], host, writable)
                except AgentVMError as exc:
                    raise LaunchError("grant", exc.message) from None
            # 3b. staging points for idmapped grants (the helper mounts onto them in a mount
            # namespace of its own; here they stay empty), and placeholders for the host-trusted
            # names a read-write grant lacks, so the agent cannot create them
            for name, _, stage in plan.fds.get("stages", ()):
                Path(stage).parent.mkdir(mode=0o711, exist_ok=True)
                if stat.S_ISDIR(os.fstat(fds[name]).st_mode):
                    os.mkdir(stage, 0o700)
                else:
                    os.close(os.open(stage, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            state["grant_holds"] = []
            for name, host, prot in plan.fds.get("protects", ()):
                state["grant_holds"].append(grants.ensure(fds[name], host, prot, self.paths.runtime / "grants"))
            grants.save(run_dir, state["grant_holds"])
            allow_ptrace = plan.seccomp_allow_ptrace
            sfd = sc.filter_fd(sc.SeccompOptions(allow_ptrace=allow_ptrace), self.paths.libexec)
            opened.append(sfd)
            fds["seccomp"] = sfd
            st_r, st_w = os.pipe2(os.O_CLOEXEC)
            js_r, js_w = os.pipe2(os.O_CLOEXEC)
            opened += [st_w, js_w]
            state["status_r"], state["json_r"] = st_r, js_r
            fds["status"], fds["json"] = st_w, js_w
            cgroup_files = group.procs_files() if group else []
            bwargs = _substitute(plan.bwrap_args, fds, cgroup_files)
            fds["bwrapargs"] = _memfd("agentvm-bwrap-args", b"".join(a.encode() + b"\0" for a in bwargs))
            opened.append(fds["bwrapargs"])
            fds["env"] = _memfd("agentvm-env", b"".join(f"{k}={v}".encode() + b"\0" for k, v in plan.env))
            opened.append(fds["env"])
            argv = _substitute(plan.argv, fds, cgroup_files)
            for fd in opened:
                os.set_inheritable(fd, True)
            # 4. spawn
            become_subreaper()
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
            handle.pid = proc.pid
            state["proc"] = proc
            (run_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")
        except BaseException:
            # close our ends now (the fds must not outlive a failed launch) and forget them:
            # closing a number twice could close a descriptor another thread opened meanwhile
            for fd in opened:
                _close(fd)
            opened.clear()
            self.destroy(handle)
            raise
        finally:
            for fd in opened:
                _close(fd)
        return handle

    # ------------------------------------------------------------------ wait
    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus:
        proc: subprocess.Popen = handle.backend_state["proc"]
        timed_out = False
        try:
            proc.wait(timeout=timeout if timeout and timeout > 0 else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(handle)
            proc.wait()
        duration = time.monotonic() - handle.started_at
        rc = proc.returncode
        ready, setup_error = _helper_status(drain(handle.backend_state.get("status_r")))
        # bwrap's JSON status: a complete document with child-pid means the sandbox existed
        status = _json_status(handle)
        status.feed(drain(handle.backend_state.get("json_r")))
        status.close()
        started = status.first("child-pid") is not None
        group: cg.SandboxCgroup | None = handle.backend_state.get("cgroup")
        stats = group.stats() if group else {}
        es = ExitStatus(exit_code=rc if rc >= 0 else 128 - rc, duration=duration)
        if rc < 0:
            es.signal = -rc
        es.oom_killed = bool(stats.get("oom_kills"))
        es.pids_limit_hit = bool(stats.get("pids_max_hits"))
        es.memory_peak = stats.get("memory_peak")
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
        elif not ready and not timed_out and not es.signal and 0 < es.exit_code < 128 and not handle.backend_state.get("stopping"):
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
        st = handle.backend_state
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
        target = self.sandbox_pid(handle)
        full = list(plan.argv)
        b = full.index(_bwrap_arg0(plan))
        init_start = full.index("--", b) + 1
        # the init segment ends at the "--" before the original command
        seg = full[init_start:]
        cmd_sep = _last_sep(seg)
        init = [a for a in seg[:cmd_sep]]
        init = _drop_opts(init, {"--gate-socket": 1, "--gate-port": 1, "--tty": 0, "--status-fd": 1, "--env-fd": 1,
                                 "--seccomp-fd": 1})
        group: cg.SandboxCgroup | None = handle.backend_state.get("cgroup")
        opened: list[int] = []
        try:
            fds: dict[str, int] = {}
            st_r, st_w = os.pipe2(os.O_CLOEXEC)
            opened += [st_r, st_w]
            fds["status"] = st_w
            fds["env"] = _memfd("agentvm-env", b"".join(f"{k}={v}".encode() + b"\0" for k, v in plan.env))
            opened.append(fds["env"])
            seccomp_on = "--seccomp-fd" in seg[:cmd_sep]
            if seccomp_on:
                fds["seccomp"] = sc.filter_fd(sc.SeccompOptions(allow_ptrace=plan.seccomp_allow_ptrace), self.paths.libexec)
                opened.append(fds["seccomp"])
            enter = [full[0], "enter", "--target", str(target), "--expect-userns", str(handle.backend_state["agent_userns"]),
                     "--uid", "1000", "--gid", "1000", "--status-fd", str(st_w)]
            for f in (group.procs_files() if group else []):
                enter += ["--cgroup-procs", f]
            for rname, soft, hard in plan.rlimits:
                enter += ["--rlimit", f"{rname}={soft}:{hard}"]
            init_args = [init[0], init[1], "--status-fd", str(st_w), "--env-fd", str(fds["env"])]
            if seccomp_on:
                init_args += ["--seccomp-fd", str(fds["seccomp"])]
            init_args += init[2:]
            cmdline = enter + ["--"] + init_args + ["--"] + list(argv)
            for fd in opened:
                if fd != st_r:
                    os.set_inheritable(fd, True)
            kw: dict = {}
            if stdio is not None:
                kw = {"stdin": stdio[0], "stdout": stdio[1], "stderr": stdio[2]}
            t0 = time.monotonic()
            proc = subprocess.Popen(cmdline, env={}, close_fds=True, pass_fds=tuple(fd for fd in opened if fd != st_r),
                                    cwd="/", **kw)
            for fd in opened:
                if fd != st_r:
                    _close(fd)
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
                _close(fd)

    def inspect(self, handle: SandboxHandle) -> dict:
        group: cg.SandboxCgroup | None = handle.backend_state.get("cgroup")
        proc: subprocess.Popen | None = handle.backend_state.get("proc")
        return {
            "sandbox_id": handle.sandbox_id,
            "pid": handle.pid,
            "running": proc is not None and proc.poll() is None,
            "pids": sorted(group.pids()) if group else [],
            "cgroup": group.stats() if group else {},
            "uptime": time.monotonic() - handle.started_at,
        }

    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None:
        handle.backend_state["stopping"] = True  # an early stop is not a failed setup
        group: cg.SandboxCgroup | None = handle.backend_state.get("cgroup")
        proc: subprocess.Popen | None = handle.backend_state.get("proc")
        if group is not None:
            group.signal_all(signal.SIGTERM)
        if proc is not None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._kill(handle)

    def _kill(self, handle: SandboxHandle) -> None:
        group: cg.SandboxCgroup | None = handle.backend_state.get("cgroup")
        proc: subprocess.Popen | None = handle.backend_state.get("proc")
        if group is not None:
            group.kill()
        elif proc is not None and proc.poll() is None:
            proc.kill()

    # ------------------------------------------------------------------ destroy
    def destroy(self, handle: SandboxHandle) -> TeardownReport:
        t0 = time.monotonic()
        st = handle.backend_state
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
                _close(st.pop(key))
        if group is not None:
            rep.cgroups_left = group.destroy()
        if handle.plan.host_uid != os.getuid():
            # a dedicated uid: nothing of it may remain on the host
            for pid in _sweep_uid(handle.plan.host_uid):
                if pid not in rep.processes_left:
                    rep.processes_left.append(pid)
        # the sandbox's processes are gone: release its granted folders (the last sandbox out
        # removes their placeholders)
        for hold in st.pop("grant_holds", None) or []:
            grants.release(hold, self.paths.runtime / "grants")
        run_dir = Path(st.get("run_dir", ""))
        if run_dir.name and run_dir.exists():
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
            if run_dir.exists():
                rep.files_left.append(str(run_dir))
        rep.verified = not (rep.processes_left or rep.cgroups_left or rep.mounts_left or rep.files_left)
        rep.duration = time.monotonic() - t0
        return rep


# ---------------------------------------------------------------------- helpers


def _etc_fingerprint(extra_ca: bytes = b"") -> str:
    """Cheap identity of the host's allowlisted /etc entries (lstat of each and of the
    entries one level down), so the view is rebuilt when the host changes them."""
    import hashlib

    h = hashlib.sha256(f"v{ETC_VIEW_VERSION}:{sorted(VIEW_SYNTHETIC.items())}".encode())
    h.update(extra_ca)
    for name in ETC_ALLOW:
        p = "/etc/" + name
        try:
            st = os.lstat(p)
        except OSError:
            continue
        h.update(f"{name}:{st.st_mode}:{st.st_mtime_ns}:{st.st_size}:{st.st_ino}".encode())
        if os.path.isdir(p) and not os.path.islink(p):
            with os.scandir(p) as it:
                for e in sorted(it, key=lambda e: e.name):
                    try:
                        est = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    h.update(f"{e.name}:{est.st_mode}:{est.st_mtime_ns}:{est.st_size}".encode())
    return h.hexdigest()[:16]


def etc_view(runtime: Path, gate_ca_pem: bytes = b"") -> Path:
    """A host directory holding copies of the allowlisted /etc entries plus synthetic
    accounts/resolver files, bound read-only as the sandbox's /etc in one mount.

    Private key directories are never copied; file modes and owners are kept, so what the
    host's root keeps unreadable stays unreadable to the sandbox's uid. With ``gate_ca_pem``
    the view's CA bundle also trusts the egress gate's CA (for TLS-terminated hosts), and the
    CA alone is at ``/etc/ssl/certs/agentvm-gate-ca.pem`` (for NODE_EXTRA_CA_CERTS)."""
    import shutil

    fp = _etc_fingerprint(gate_ca_pem)
    view = runtime / f"etc-view-{fp}"
    if view.is_dir():
        return view
    runtime.mkdir(parents=True, exist_ok=True)
    tmp = runtime / f".etc-view-{fp}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    ignore = shutil.ignore_patterns("private", "*.key", "*.pem.key")
    for name in ETC_ALLOW:
        src = Path("/etc") / name
        dst = tmp / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            elif src.is_dir():
                shutil.copytree(src, dst, symlinks=True, ignore=ignore)
            elif src.is_file():
                shutil.copy2(src, dst)
        except FileNotFoundError:
            continue
    for name, content in VIEW_SYNTHETIC.items():
        (tmp / name).write_text(content)
        os.chmod(tmp / name, 0o644)
    if gate_ca_pem:
        certs = tmp / "ssl" / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        bundle = certs / "ca-certificates.crt"
        try:
            system = Path(CA_BUNDLE).read_bytes()
        except OSError:
            system = b""
        if bundle.exists() or bundle.is_symlink():
            bundle.unlink()
        bundle.write_bytes(system.rstrip(b"\n") + b"\n" + gate_ca_pem)
        (certs / "agentvm-gate-ca.pem").write_bytes(gate_ca_pem)
        for f in (bundle, certs / "agentvm-gate-ca.pem"):
            os.chmod(f, 0o644)
    for name in PER_SANDBOX_ETC:  # bind targets, overmounted per sandbox
        (tmp / name).write_text("")
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, view)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another launch won the race
    # Old views may still be bound in running sandboxes: only remove day-old ones.
    for old in runtime.glob("etc-view-*"):
        if old != view:
            try:
                if time.time() - old.stat().st_mtime > 86400:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass
    return view


def become_subreaper() -> None:
    """Orphans of a sandbox (its killed descendants) are re-parented to us, so we can reap
    them and verify teardown instead of leaving zombies to the host's init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def _sweep_uid(uid: int, timeout: float = 2.0) -> list[int]:
    """Kill what is left of ``uid`` and reap the zombies re-parented to us (we are a
    subreaper). Returns live pids that survived (teardown NOT verified)."""
    from agentvm.identity import uid_processes

    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        live = []
        for pid, ppid, state in uid_processes(uid):
            if state in ("Z", "X"):
                if ppid == me:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                continue
            live.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.002)


def _hostname(name: str) -> str:
    return (name or "sandbox")[:63]


def _substitute(argv: tuple[str, ...], fds: dict[str, int], cgroup_files: list[str]) -> list[str]:
    """Fill in the launch-time values: ``@fd:NAME@`` tokens (a whole argument, or the head of a
    ``--grant`` value) and ``@cgroups@``. The agent's command (after init's own ``--``) is
    never touched: its arguments are the agent's, whatever they look like."""
    out: list[str] = []
    items = list(argv)
    seps = [k for k, a in enumerate(items) if a == "--"]
    # launch opts -- bwrap --args FD -- init opts -- COMMAND: the third separator starts the command
    stop = seps[2] + 1 if len(seps) >= 3 else len(items)
    i = 0
    while i < len(items):
        a = items[i]
        if i >= stop:
            out += items[i:]
            break
        if a == "--cgroup-procs" and i + 1 < len(items) and items[i + 1] == "@cgroups@":
            for f in cgroup_files:
                out += ["--cgroup-procs", f]
            i += 2
            continue
        if a.startswith("@fd:") and "@" in a[4:]:
            name, _, rest = a[4:].partition("@")
            if name not in fds:
                raise LaunchError("plan", f"no fd for {name}")
            a = str(fds[name]) + rest
        out.append(a)
        i += 1
    return out


def _bwrap_arg0(plan: LaunchPlan) -> str:
    a = list(plan.argv)
    return a[a.index("--args") - 1]


def _last_sep(seg: list[str]) -> int:
    """Index of the "--" that separates init's options from the command."""
    i = 0
    while i < len(seg):
        if seg[i] == "--":
            return i
        i += 1
    raise BackendError("malformed plan: no command separator")


def _drop_opts(args: list[str], opts: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in opts:
            i += 1 + opts[args[i]]
            continue
        out.append(args[i])
        i += 1
    return out


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _json_status(handle: SandboxHandle) -> JsonStatusParser:
    """The one parser of this sandbox's bwrap status stream (``sandbox_pid`` and ``wait``
    both read from it, so neither loses what the other consumed)."""
    return handle.backend_state.setdefault("json_status", JsonStatusParser())


def _helper_status(raw: bytes) -> tuple[bool, dict | None]:
    """The helper's status pipe, read after the writer exited (so the pipe holds all of it):
    ``ready`` once init has put every layer in place and is about to exec the command, and
    ``STEP\tERRNO\tMESSAGE`` lines on failure (the first names the cause).
    Returns (ready, setup_error)."""
    lines = [ln for ln in raw.decode(errors="replace").splitlines() if ln.strip()]
    ready = "ready" in lines
    errors = [ln for ln in lines if ln != "ready"]
    return ready, (_setup_error_line(errors[0]) if errors else None)


def _idmap_refusal(plan: LaunchPlan, err: dict) -> dict:
    """The helper could not idmap a grant: name the grant and its filesystem, say what to do."""
    from agentvm.fsutil import mount_of

    try:
        n = int(err["message"].split()[1].rstrip(":"))
        fd_name = plan.fds["stages"][n][0]
        host = dict(plan.fds["open_paths"])[fd_name]
    except (IndexError, KeyError, ValueError):
        return err
    mnt, fstype = mount_of(host)
    return {**err, "message": f"the grant {host} is on a {fstype} filesystem (mounted at {mnt}), which cannot be "
            "idmapped: agent-vm refuses rather than let files land owned by a throwaway uid",
            "hint": "grant a folder on a filesystem that supports idmapped mounts (ext4, xfs, btrfs, tmpfs, "
            "overlayfs...), or copy the files in with `agentvm cp`"}


def _setup_error(raw: bytes) -> dict | None:
    return _helper_status(raw)[1]


def _setup_error_line(line: str) -> dict:
    step, _, rest = line.partition("\t")
    err, _, msg = rest.partition("\t")
    try:
        errno_ = int(err or 0)
    except ValueError:
        errno_ = 0
    return {"step": step, "errno": errno_, "message": msg}
