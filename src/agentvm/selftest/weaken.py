"""Deliberately weakened configurations, for proving that each selftest case can fail.

``WeakenedBackend`` is the real bwrap backend with one layer removed from the compiled plan.
It is used only by the selftest's own environment (a private AGENTVM_HOME); nothing in the
product can select it.
"""

from __future__ import annotations

import dataclasses
import os

from agentvm.backends.base import LaunchContext, LaunchPlan, MountOp
from agentvm.backends.bwrap import BwrapBackend
from agentvm.policy import Policy


class WeakenedBackend(BwrapBackend):
    def __init__(self, paths, weaken: str, env) -> None:
        super().__init__(paths)
        self.weaken = weaken
        self.env = env
        if "weak-bridge" in weaken.split("+"):
            from agentvm import native

            # a helper built without the bridge's hardening (a separate binary, never the product's)
            self._tools["helper"] = str(native.helper_path(paths.libexec, ("AGENTVM_SELFTEST_WEAK_BRIDGE",)))

    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        ws = set(self.weaken.split("+"))
        degrade = set(ctx.degraded)
        if "no-seccomp" in ws:
            degrade |= {"seccomp"}
        if "no-landlock" in ws:
            degrade |= {"landlock", "landlock-net", "landlock-scope"}
        if "no-limits" in ws:
            degrade |= {"cgroups"}
        if "no-syscall-audit" in ws:
            degrade |= {"syscall-audit"}
        ctx = dataclasses.replace(ctx, degraded=tuple(sorted(degrade)))
        plan = super().compile(policy, ctx)
        body = plan.body
        host = ctx.host
        bw = list(body.bwrap_args)
        argv = list(body.argv)
        mounts = list(body.mounts)
        if "share-net" in ws:
            bw.remove("--unshare-net")
        if "no-pidns" in ws:
            bw.remove("--unshare-pid")
        if "host-etc" in ws:
            i = _find_bind(bw, host.etc_view, "/etc")
            bw[i + 1] = "/etc"
        if "no-limits" in ws:
            # no rlimits either (the launcher keeps the host's)
            while "--rlimit" in argv:
                i = argv.index("--rlimit")
                del argv[i : i + 2]
        if "shared-state" in ws:
            shared = self.env.root / "shared-state"
            for sub in ("home", "tmp"):
                (shared / sub).mkdir(parents=True, exist_ok=True)
                os.chmod(shared / sub, 0o1777)
            for dest, sub in (("/home/agent", "home"), ("/tmp", "tmp")):
                i = _find_tmpfs(bw, dest)
                # replace "[--size N] [--perms P] --tmpfs DEST" by "--bind SHARED DEST"
                start = i
                while start >= 2 and bw[start - 2] in ("--size", "--perms"):
                    start -= 2
                bw[start : i + 2] = ["--bind", str(shared / sub), dest]
        if "writable-approvals" in ws:
            from agentvm.approvals import open_store, store_path

            open_store(self.paths).close()  # the queue exists before the sandbox does
            import sqlite3

            # no -wal/-shm files (created later by the holder, 0600): the agent's uid can write it
            c = sqlite3.connect(str(store_path(self.paths)))
            c.execute("PRAGMA journal_mode=DELETE")
            c.close()
            qdir = store_path(self.paths).parent
            os.chmod(qdir, 0o777)
            for f in qdir.iterdir():
                os.chmod(f, 0o666)
            i = bw.index("--remount-ro")
            bw[i:i] = ["--bind", str(qdir), "/mnt/approvals"]
        if "writable-audit" in ws:
            logs = self.paths.home / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            os.chmod(logs, 0o777)
            for f in logs.iterdir():
                os.chmod(f, 0o666)
            audit = self.paths.home / "audit"
            os.chmod(audit, 0o777)
            for f in audit.iterdir():
                os.chmod(f, 0o666)
            i = bw.index("--remount-ro")
            bw[i:i] = ["--bind", str(logs), "/mnt/logs", "--bind", str(audit), "/mnt/audit"]
        host_uid, host_gid = body.host_uid, body.host_gid
        if "shared-state" in ws and "shared-uid" not in ws and not policy.agent and host.dedicated:
            # persistent HOME and /tmp belong to one identity across sessions (as they would on a
            # host that reuses an account): pin the uid so later sessions can use what earlier ones left
            if getattr(self, "_shared_uid", None) is None:
                self._shared_uid = (host.uid, host.gid)
            host_uid, host_gid = self._shared_uid
            argv[argv.index("--uid") + 1] = str(host_uid)
            argv[argv.index("--gid") + 1] = str(host_gid)
        if "shared-uid" in ws and not policy.agent and host.dedicated:
            # every ephemeral sandbox of this environment runs as ONE host uid (the first one
            # leased), and their /workspace is one host directory instead of a private tmpfs
            if getattr(self, "_shared_uid", None) is None:
                self._shared_uid = (host.uid, host.gid)
            host_uid, host_gid = self._shared_uid
            i = argv.index("--uid")
            argv[i + 1] = str(host_uid)
            i = argv.index("--gid")
            argv[i + 1] = str(host_gid)
            if policy.workspace:
                shared_ws = self.env.root / "shared-uid-workspace"
                shared_ws.mkdir(parents=True, exist_ok=True)
                os.chown(shared_ws, host_uid, host_gid)
                os.chmod(shared_ws, 0o700)
                i = _find_tmpfs(bw, policy.workspace)
                start = i
                while start >= 2 and bw[start - 2] in ("--size", "--perms"):
                    start -= 2
                bw[start : i + 2] = ["--bind", str(shared_ws), policy.workspace]
        if "writable-audit" in ws:
            # the agent's Landlock view must include them, or the bind is useless
            i = argv.index("--", argv.index("/.agentvm/init"))
            argv[i:i] = ["--rw", "/mnt/logs", "--rw", "/mnt/audit"]
        if "writable-approvals" in ws:
            i = argv.index("--", argv.index("/.agentvm/init"))
            argv[i:i] = ["--rw", "/mnt/approvals"]
        body = dataclasses.replace(body, bwrap_args=tuple(bw), argv=tuple(argv), mounts=tuple(mounts),
                                   host_uid=host_uid, host_gid=host_gid)
        return dataclasses.replace(plan, body=body, identity=f"host uid {host_uid}")

    def launch(self, plan: LaunchPlan, *, stdio=None):
        # a pinned uid (shared-state/shared-uid) must still reach its gate socket, which the
        # gate made connectable by the uid the runtime leased
        sock = os.path.join(plan.body.run_dir, "gate.sock")
        if getattr(self, "_shared_uid", None) is not None and os.path.exists(sock) and os.geteuid() == 0:
            os.chown(sock, plan.body.host_uid, plan.body.host_gid)
        return super().launch(plan, stdio=stdio)

    def required_primitives(self, policy: Policy) -> tuple[str, ...]:
        req = super().required_primitives(policy)
        table = {"no-seccomp": {"seccomp"}, "no-landlock": {"landlock", "landlock-net", "landlock-scope"},
                 "no-limits": {"cgroups", "cgroup-kill"}, "no-syscall-audit": {"syscall-audit"}}
        drop = set().union(*(table.get(w, set()) for w in self.weaken.split("+")))
        return tuple(r for r in req if r not in drop)


def _find_bind(args: list[str], src: str, dest: str) -> int:
    for i in range(len(args) - 2):
        if args[i] in ("--ro-bind", "--bind") and args[i + 1] == src and args[i + 2] == dest:
            return i
    raise ValueError(f"no bind of {src} on {dest} in the plan")


def _find_tmpfs(args: list[str], dest: str) -> int:
    for i in range(len(args) - 1):
        if args[i] == "--tmpfs" and args[i + 1] == dest:
            return i
    raise ValueError(f"no tmpfs on {dest} in the plan")


__all__ = ["WeakenedBackend", "MountOp"]
