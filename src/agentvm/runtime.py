"""Running a policy in a sandbox, end to end: preflight (fail closed), identity, workspace,
launch, wait (timeout), verified teardown, and a result record.

This is the library entry point ``agentvm run`` uses; it knows nothing about the CLI.
"""

from __future__ import annotations

import json
import os
import stat
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agentvm import defaults as D
from agentvm import grants, identity
from agentvm.backends.base import PRIMITIVES, ExitStatus, LaunchContext, TeardownReport
from agentvm.errors import EXIT_BACKEND, AgentVMError, BackendError, ConfigError, PolicyDenied, PrimitiveMissing
from agentvm.fsutil import check_grant_target, untrusted_symlink
from agentvm.paths import Paths, default_paths
from agentvm.policy import MountGrant, Policy, check_tier

if TYPE_CHECKING:  # pragma: no cover
    from agentvm.backends.protocol import Backend

SANDBOX_UID = 1000


@dataclass
class RunResult:
    sandbox_id: str
    agent: str
    exit_code: int
    duration: float
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    signal: int | None = None
    setup_error: dict | None = None
    teardown: dict = field(default_factory=dict)
    degraded: list[str] = field(default_factory=list)
    host_uid: int | None = None
    policy_digest: str = ""
    memory_peak: int | None = None
    limits: dict = field(default_factory=dict)  # the limits in force (memory, pids, timeout...), for the hints
    egress: dict | None = None  # gate summary: allowed, denied [{rule, target, count}], bytes, log

    @property
    def limits_hit(self) -> list[str]:
        out = []
        if self.timed_out:
            out.append("timeout")
        if self.oom_killed:
            out.append("memory")
        if self.pids_limit_hit:
            out.append("pids")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["limits_hit"] = self.limits_hit
        d["teardown_verified"] = bool(self.teardown.get("verified"))
        return d


def get_backend(name: str, paths: Paths) -> "Backend":
    if name == "bwrap":
        from agentvm.backends.bwrap import BwrapBackend

        return BwrapBackend(paths)
    if name == "fake":
        # The fake runs nothing and isolates nothing: never selectable by a spec in production.
        if os.environ.get("AGENTVM_ALLOW_FAKE") != "1":
            raise PolicyDenied(
                "substrate 'fake' provides no isolation and is for tests only",
                hint="use substrate: bwrap (set AGENTVM_ALLOW_FAKE=1 only in a test harness)",
                code="policy.fake-substrate",
            )
        from agentvm.backends.fake import FakeBackend

        return FakeBackend()
    raise ConfigError(f"unknown substrate {name!r}", hint="available: bwrap (default), fake (tests)")


class Runtime:
    def __init__(self, paths: Paths | None = None, backend: "Backend | None" = None, record=None) -> None:
        """``record(kind, sandbox=..., **data)``: where run records go (the daemon passes its own,
        so they are also events); by default, straight onto the audit chain."""
        self.paths = (paths or default_paths()).ensure()
        self._backend = backend
        self._gate = None
        self._record_fn = record
        self._audit = None  # the audit chain, opened on the first record

    def record(self, kind: str, sandbox: str | None = None, **data) -> None:
        if self._record_fn is not None:
            self._record_fn(kind, sandbox=sandbox, **data)
            return
        if self._audit is None:
            from agentvm.audit import AuditLog

            self._audit = AuditLog(self.paths.audit_dir / "audit.db")
        self._audit.append(kind, actor=f"uid:{os.getuid()}", sandbox=sandbox, data=data)

    # ------------------------------------------------------------------ egress gate
    @property
    def gate_dir(self) -> Path:
        return self.paths.home / "gate"

    @property
    def log_dir(self) -> Path:
        return self.paths.home / "logs"

    def gate_ca_pem(self) -> bytes:
        """The installation's gate CA certificate (created on first use; key stays in ``gate/ca``).

        Checking the CA (key permissions, key matches certificate, not expired) needs the
        cryptography library, which costs more than starting a sandbox. So a full check leaves a
        stamp of exactly what it checked (inode, size and mtime of key and certificate, the
        certificate's expiry); while nothing of that has changed, the certificate is read as is."""
        d = self.gate_dir / "ca"
        try:
            stamp = json.loads((d / ".verified").read_text())
            sd, sc, sk = os.stat(d), os.stat(d / "ca.crt"), os.stat(d / "ca.key")
            sv = os.stat(d / ".verified")
            if (sd.st_uid == os.geteuid() and not sd.st_mode & 0o022 and not sk.st_mode & 0o077
                    and sv.st_uid == os.geteuid() and not sv.st_mode & 0o022
                    and stamp["crt"] == _stamp_of(sc) and stamp["key"] == _stamp_of(sk)
                    and time.time() < stamp["not_after"] - 86400):
                return (d / "ca.crt").read_bytes()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        from agentvm.gate.ca import CertificateAuthority

        ca = CertificateAuthority.load_or_create(d)
        try:
            sc, sk = os.stat(d / "ca.crt"), os.stat(d / "ca.key")
            stamp = {"crt": _stamp_of(sc), "key": _stamp_of(sk), "not_after": ca._cert.not_valid_after_utc.timestamp()}
            tmp = d / ".verified.tmp"
            tmp.write_text(json.dumps(stamp))
            os.replace(tmp, d / ".verified")
        except (OSError, AttributeError):
            pass
        return ca.cert_pem

    def embedded_gate(self):
        """The gate in a thread of this process (``agentvm run`` without a daemon)."""
        if self._gate is None:
            from agentvm.gate.embedded import LazyGate

            self.log_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.log_dir, 0o700)
            self._gate = LazyGate(self.gate_dir, self.log_dir)  # comes up off the run's critical path
        return self._gate

    @property
    def vault_dir(self) -> Path:
        return self.paths.home / "vault"

    def session_credentials(self, policy: Policy, sandbox_id: str):
        """Placeholders for this session, and the gate's view of the real values.

        Every reference must resolve now (fail closed: a missing secret refuses the run).
        Returns (CredentialSet, extra env, extra files)."""
        from agentvm.gate.credentials import CredentialSet, make_placeholder
        from agentvm.vault import Vault

        vault = Vault(self.vault_dir)
        bindings = {b.name: b for b in policy.credentials}
        values: dict[str, str] = {}
        for b in policy.credentials:
            try:
                values[b.name] = vault.resolve(b.ref)
            except AgentVMError as exc:
                raise ConfigError(f"credential {b.name!r}: {exc.message}", hint=exc.hint or
                                  f"store it with `agentvm secret set {b.ref.partition(':')[2]}`") from None
        placeholders = {b.name: make_placeholder(b, len(values[b.name])) for b in policy.credentials}
        cache = {"version": vault.version(), "values": values}

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

        def revoked(name: str) -> bool:
            b = bindings[name]
            if vault.is_revoked(name, sandbox_id):
                return True
            return b.ref.startswith("vault:") and vault.is_revoked(b.ref[6:], sandbox_id)

        creds = CredentialSet(policy.credentials, placeholders, value, revoked)
        env = [(b.env, placeholders[b.name]) for b in policy.credentials]
        env += [(b.sigv4_key_env, b.sigv4_access_key_id) for b in policy.credentials if b.sigv4_access_key_id]
        files = [(b.file, placeholders[b.name] + "\n") for b in policy.credentials if b.file]
        values.clear()
        return creds, tuple(env), tuple(files)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def backend_for(self, policy: Policy) -> "Backend":
        if self._backend is not None:
            return self._backend
        self._backend = get_backend(policy.substrate, self.paths)
        return self._backend

    # ------------------------------------------------------------------ preflight
    def preflight(self, policy: Policy, degrade: tuple[str, ...] = ()) -> list[str]:
        """Fail closed: every primitive the policy relies on must be present, unless waived."""
        for d in degrade:
            if d not in PRIMITIVES:
                raise ConfigError(f"unknown --degrade {d!r}", hint="one of: " + ", ".join(PRIMITIVES))
        if "dedicated-uid" in degrade and os.geteuid() == 0 and getattr(self.backend_for(policy), "host_resources", True):
            raise ConfigError(
                "--degrade dedicated-uid cannot apply when agent-vm runs as root: a sandbox never runs as host root",
                hint="drop the flag (as root every sandbox gets a dedicated uid)",
            )
        if policy.pending_features:
            raise PolicyDenied(
                "the agent declares " + ", ".join(policy.pending_features) + ", which this version of agent-vm "
                "cannot enforce yet; refusing to run rather than run without them",
                hint="remove those sections, or upgrade agent-vm",
                code="policy.unenforceable",
            )
        check_tier(policy)
        backend = self.backend_for(policy)
        caps = backend.capabilities()
        missing = [p for p in caps.missing(backend.required_primitives(policy)) if p.name not in degrade]
        if missing:
            lines = "; ".join(f"{p.name}: {p.detail or 'missing'}" for p in missing)
            raise PrimitiveMissing(
                f"refusing to start: the {backend.name} substrate cannot give its guarantees on this host ({lines})",
                hint="run `agentvm doctor` for details; to run without a primitive anyway pass "
                "--degrade NAME (printed and recorded)",
            )
        self._check_grants(policy, degrade)
        return list(degrade)

    def _check_grants(self, policy: Policy, degrade: tuple[str, ...]) -> None:
        # Landlock's rules add up along a path: a read-write grant mounted inside the sandbox's
        # own scratch space would inherit its right to make FIFOs and sockets - on the host's disk
        scratch = list(D.SCRATCH_PATHS) + ([policy.workspace] if policy.workspace else [])
        for m in policy.mounts:
            inside = next((s for s in scratch if m.path.startswith(s.rstrip("/") + "/")), None)
            if m.writable and inside:
                raise ConfigError(
                    f"the read-write grant {m.host} is mounted at {m.path}, inside the sandbox's own {inside}: "
                    "there it would inherit rights a host folder must not have (making FIFOs and sockets)",
                    hint=f"mount it outside {inside}, e.g. at /src or /out", code="policy.grant-path")
        own = [self.paths.home.resolve(), self.paths.runtime.resolve()]
        grants = list(policy.mounts) + [MountGrant(p, p, False) for p in policy.extra_ro]
        for m in grants:
            real = Path(os.path.realpath(m.host))
            if not real.exists():
                raise ConfigError(f"granted host path {m.host} does not exist")
            link = untrusted_symlink(m.host)  # first: a link someone else controls is the problem itself
            if link is not None:
                raise PolicyDenied(
                    f"granting {m.host} goes through the symlink {link}, in a directory a non-root user can "
                    "write: it could be re-pointed anywhere after this check",
                    code="policy.grant-untrusted-link", hint="grant the resolved path, or move the link somewhere root-owned",
                )
            check_grant_target(str(real), own, m.host, m.writable)

    # ------------------------------------------------------------------ run
    def prepare(self, policy: Policy, *, degrade: tuple[str, ...] = (), tty: bool = False):
        """Everything before launch. Returns (plan, resources) - resources must be released."""
        self.preflight(policy, degrade)
        backend = self.backend_for(policy)
        caps = backend.capabilities()
        sandbox_id = f"{policy.name}-{os.urandom(4).hex()}"
        root = os.geteuid() == 0
        host_resources = getattr(backend, "host_resources", True)
        res = _Resources(self.paths)
        try:
            if not host_resources:
                uid, gid, drop = 0, 0, False
            elif root and "dedicated-uid" not in degrade:
                ident = (
                    identity.agent_identity(self.paths.state_db, policy.name)
                    if policy.agent
                    else identity.lease_identity(self.paths.runtime / "uid-leases", sandbox_id, self.paths.home)
                )
                res.lease = ident if ident.leased else None
                uid, gid, drop = ident.uid, ident.gid, True
            else:
                uid, gid, drop = os.getuid(), os.getgid(), False
            ws_host = None
            from agentvm import workspace

            if policy.agent and drop and not policy.workspace:
                # one sandbox per named agent at a time, workspace or not: they would share a
                # uid, and one's teardown sweep would kill the other's processes
                res.agent_lock = workspace.lock_agent(
                    self.paths.workspaces, policy.name, "a second sandbox would share its uid",
                    "wait for the other run to finish, or give this instance its own name")
            if policy.workspace and policy.agent and host_resources:
                res.workspace = workspace.acquire(
                    self.paths.workspaces,
                    self.paths.runtime,
                    policy.name,
                    uid=uid,
                    gid=gid,
                    size=policy.limits.disk,
                    enforce_quota="disk-quota" not in degrade,
                )
                ws_host = str(res.workspace.host_dir)
            # As root, grants are idmapped mounts the helper opens: the agent's uid needs no way
            # through the host path. Extra read-only paths (and every grant without root) are
            # bound by path as the agent's uid: a parent it cannot traverse would fail inside
            # bwrap with bwrap's own text.
            by_path = list(policy.extra_ro) + ([] if drop else [m.host for m in policy.mounts])
            for host in by_path:
                if not host_resources:
                    break
                blocker = _blocking_parent(os.path.realpath(host), uid, gid)
                if blocker is not None:
                    st = os.stat(blocker)
                    raise PolicyDenied(
                        f"the agent's uid {uid} cannot reach {host}: {blocker} (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}) does not let other users through",
                        hint=(f"grant a folder whose parents every user may traverse (e.g. under /srv, or "
                              f"`chmod o+x {blocker}` if that is acceptable on this host)"
                              + ("; as root, agent-vm idmaps grants and needs no such access" if not drop else "")),
                        code="policy.grant-unreachable",
                    )
            for m in policy.mounts:
                if m.writable and not drop and host_resources and not _uid_can_write(m.host, uid, gid):
                    raise PolicyDenied(
                        f"this uid ({uid}) cannot write the read-write grant {m.host}",
                        hint="grant a folder you own; as root, agent-vm idmaps grants so the folder's owner "
                        "is the agent inside",
                        code="policy.grant-unwritable",
                    )
            protected = tuple(grants.plan(os.path.realpath(m.host), m.writable_trusted) if m.writable else ()
                              for m in policy.mounts)
            from agentvm import native

            creds, extra_env, extra_files = None, (), ()
            if policy.credentials:
                creds, extra_env, extra_files = self.session_credentials(policy, sandbox_id)
                res.creds = creds
            etc = ""
            ca_pem = b""
            if policy.egress is not None:
                ca_pem = self.gate_ca_pem()
            if backend.name == "bwrap":
                from agentvm.backends.bwrap import etc_view

                etc = str(etc_view(self.paths.runtime, ca_pem))
            ctx = LaunchContext(
                sandbox_id=sandbox_id,
                etc_view=etc,
                gate_socket=str(self.paths.sandboxes / sandbox_id / "gate.sock") if policy.egress is not None else "",
                node_shim=_node_shim() if policy.egress is not None else "",
                extra_env=extra_env,
                extra_files=extra_files,
                host_uid=uid,
                host_gid=gid,
                workspace_host=ws_host,
                run_dir=str(self.paths.sandboxes / sandbox_id),
                helper=str(native.helper_path(self.paths.libexec)) if backend.name == "bwrap" else "agentvm-helper",
                bwrap=caps.facts.get("bwrap", "bwrap"),
                tty=tty,
                drop_privileges=drop,
                degraded=tuple(degrade),
                landlock_abi=caps.facts.get("landlock_abi", 0),
                sandbox_uid=SANDBOX_UID,
                sandbox_gid=SANDBOX_UID,
                protected=protected,
            )
            plan = backend.compile(policy, ctx)
        except BaseException:
            res.release()
            raise
        return plan, res

    def run(
        self,
        policy: Policy,
        *,
        degrade: tuple[str, ...] = (),
        tty: bool | None = None,
        stdio: tuple[int, int, int] | None = None,
        on_launch=None,
    ) -> RunResult:
        """Run ``policy`` to completion. ``on_launch(backend, handle)`` is called once the
        sandbox exists (the daemon uses it to stop a run whose client went away)."""
        if tty is None:
            tty = stdio is None and sys.stdin.isatty() and sys.stdout.isatty()
        gc_stale(self.paths)
        gc_logs(self.paths)
        try:
            plan, res = self.prepare(policy, degrade=degrade, tty=tty)
        except AgentVMError as exc:
            self.record("run.refused", agent=policy.name, code=exc.code, message=exc.message[:500])
            raise
        backend = self.backend_for(policy)
        notes = list(res.workspace.notes) if res.workspace is not None else []
        for n in notes:
            print(f"agentvm: note: {n}", file=sys.stderr)
        try:  # no run that is not on the audit chain: a chain that cannot be written refuses the run
            self.record("run.started", sandbox=plan.sandbox_id, agent=policy.name, command=_shown_argv(policy.command),
                        policy=plan.policy_digest, host_uid=plan.host_uid, degraded=list(degrade), network=policy.network,
                        grants=[f"{m.host}:{m.path}:{'rw' if m.writable else 'ro'}" for m in policy.mounts],
                        **({"notes": notes} if notes else {}))
        except Exception as exc:
            res.release()
            raise BackendError(f"cannot write the audit chain ({type(exc).__name__}: {exc}); refusing to run unrecorded",
                               hint=f"check {self.paths.audit_dir} (free space, permissions), then `agentvm audit verify`") from exc
        status: ExitStatus | None = None
        report: TeardownReport | None = None
        handle = None
        endpoint = None
        run_dir = None
        old = _install_signal_handlers()
        try:
            if policy.egress is not None:
                # the gate must be listening before the sandbox exists: no window without it
                run_dir = self.paths.sandboxes / plan.sandbox_id
                run_dir.mkdir(parents=True, exist_ok=True)
                os.chmod(run_dir, 0o711)
                endpoint = self.embedded_gate().open(
                    plan.sandbox_id, policy.name, policy.egress, run_dir / "gate.sock", plan.host_uid if plan.host_uid else None,
                    creds=res.creds,
                )
            if tty:
                from agentvm.ptyrelay import PtySession

                with PtySession() as pty:
                    handle = backend.launch(plan, stdio=(pty.slave, pty.slave, pty.slave))
                    pty.close_slave()
                    status = pty.relay(backend, handle, plan.timeout)
            else:
                handle = backend.launch(plan, stdio=stdio)
                if on_launch is not None:
                    on_launch(backend, handle)
                status = backend.wait(handle, plan.timeout or None)
        except _Interrupted as exc:
            if handle is not None:
                backend.stop(handle, grace=1.0)
            status = ExitStatus(exit_code=128 + exc.signum, signal=exc.signum)
        finally:
            _restore_signal_handlers(old)
            if handle is not None:
                report = backend.destroy(handle)
            elif run_dir is not None:
                # the sandbox never started (e.g. the gate could not open): leave nothing behind
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
            res.release(report)
            egress = None
            gate_error = None
            if endpoint is not None and endpoint.abandon_if_unused():
                # the sandbox is gone and never connected: no need to wait for the gate to be up
                endpoint = None
                egress = {"allowed": 0, "denied": [], "bytes_out": 0, "bytes_in": 0, "alerts": 0, "log": None}
            if endpoint is not None:
                try:
                    endpoint = endpoint.result()
                except AgentVMError as exc:  # the gate never served: every connection was refused
                    gate_error, endpoint = exc, None
            if endpoint is not None:
                self._gate.close(plan.sandbox_id)
                egress = {
                    "allowed": endpoint.allowed,
                    "denied": [_denial(r, t, n, *endpoint.denial_reasons.get((r, t), ("", None)))
                               for (r, t), n in sorted(endpoint.denials.items())],
                    "bytes_out": endpoint.bytes_out,
                    "bytes_in": endpoint.bytes_in,
                    "alerts": endpoint.alerts,
                    "log": str(endpoint.log_path),
                }
        result = RunResult(
            sandbox_id=plan.sandbox_id,
            agent=policy.name,
            exit_code=status.exit_code if status else EXIT_BACKEND,
            duration=status.duration if status else 0.0,
            timed_out=status.timed_out if status else False,
            oom_killed=status.oom_killed if status else False,
            pids_limit_hit=status.pids_limit_hit if status else False,
            signal=status.signal if status else None,
            setup_error=status.setup_error if status else None,
            teardown=report.to_dict() if report else {"verified": False},
            degraded=list(degrade),
            host_uid=plan.host_uid,
            policy_digest=plan.policy_digest,
            memory_peak=status.memory_peak if status else None,
            egress=egress,
            limits={"memory": policy.limits.memory, "pids": policy.limits.pids, "timeout": policy.limits.timeout,
                    "tmp": policy.limits.tmp, "shm": policy.limits.shm},
        )
        if gate_error is not None:
            result.setup_error = result.setup_error or {"step": "gate", "errno": 0, "message": gate_error.message}
            result.exit_code = EXIT_BACKEND
        if report is not None and not report.verified:
            result.exit_code = EXIT_BACKEND if result.exit_code == 0 else result.exit_code
        eg = result.egress or {}
        try:
            self._record_exit(result, report, eg)
        except Exception as exc:  # the run happened: its result is not lost for want of a record
            print(f"agentvm: warning: the run's exit could not be written to the audit chain: {exc}", file=sys.stderr)
        return result

    def _record_exit(self, result: "RunResult", report, eg: dict) -> None:
        self.record("run.exited", sandbox=result.sandbox_id, agent=result.agent, exit_code=result.exit_code,
                    duration=round(result.duration, 3), timed_out=result.timed_out, limits_hit=result.limits_hit,
                    setup_error=(result.setup_error or {}).get("step"), teardown_verified=bool(report and report.verified),
                    egress={"allowed": eg.get("allowed", 0), "denied": sum(d["count"] for d in eg.get("denied", [])),
                            "denied_hosts": sorted({d["target"] for d in eg.get("denied", [])})[:10],
                            "bytes_out": eg.get("bytes_out", 0), "bytes_in": eg.get("bytes_in", 0), "log": eg.get("log")}
                    if eg else None)


class _Resources:
    """Host resources held for one run, released after teardown."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.lease: identity.Identity | None = None
        self.workspace = None
        self.creds = None  # the session's CredentialSet (placeholders; values stay in the vault)
        self.agent_lock: int | None = None  # a named agent's uid, held when it has no workspace

    def release(self, report: TeardownReport | None = None) -> None:
        if self.agent_lock is not None:
            os.close(self.agent_lock)
            self.agent_lock = None
        if self.workspace is not None:
            left = self.workspace.release()
            if report is not None and left:
                report.mounts_left += left
                report.verified = False
            self.workspace = None
        if self.lease is not None:
            if report is None or report.verified:
                identity.release_lease(self.lease)
            elif self.lease.lease_fd is not None:
                # processes of this uid may remain: keep the file so the next leaser checks it
                os.close(self.lease.lease_fd)
            self.lease = None


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


def _install_signal_handlers():
    old = {}
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            old[s] = signal.signal(s, _raise_interrupted)
        except ValueError:  # not the main thread
            pass
    return old


def _restore_signal_handlers(old) -> None:
    for s, h in old.items():
        signal.signal(s, h)


def _node_shim() -> str:
    """The undici preload for Node's fetch (installed by scripts/install.sh), if present."""
    d = os.environ.get("AGENTVM_NODE_SHIM") or "/opt/agentvm/node"
    return d if os.path.isfile(os.path.join(d, "proxy.js")) and os.path.isdir(os.path.join(d, "node_modules", "undici")) else ""


def _denial(rule: str, target: str, count: int, reason: str, allow: str | None) -> dict:
    d = {"rule": rule, "target": target, "count": count, "reason": reason}
    if allow:
        d["how_to_allow"] = allow
    return d


def _uid_may(path: str, uid: int, gid: int, *, write: bool) -> bool:
    """May ``uid`` (no supplementary groups, as in the sandbox) search ``path`` - and, with
    ``write``, create in it? The owner/group/other mode bits that apply decide; where they
    refuse, the kernel's own answer from a probe in the agent's identity (POSIX ACLs)."""
    st = os.stat(path)
    want = 0o3 if write else 0o1  # w+x, or x
    shift = 6 if st.st_uid == uid else (3 if st.st_gid == gid else 0)
    if (st.st_mode >> shift) & want == want:
        return True
    import subprocess

    test = ["test", "-w", path, "-a", "-x", path] if write else ["test", "-x", path]
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *test], capture_output=True)
    return r.returncode == 0


def _blocking_parent(path: str, uid: int, gid: int) -> str | None:
    """The first directory above ``path`` that ``uid`` may not search, or None."""
    parents = []
    p = os.path.dirname(path.rstrip("/")) or "/"
    while True:
        parents.append(p)
        if p == "/":
            break
        p = os.path.dirname(p)
    return next((d for d in reversed(parents) if not _uid_may(d, uid, gid, write=False)), None)


def _uid_can_write(path: str, uid: int, gid: int) -> bool:
    return _uid_may(path, uid, gid, write=True)


def _stamp_of(st: os.stat_result) -> list[int]:
    """What a full CA check saw of a file: any change (content, owner, mode) changes this."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode]


def _shown_argv(argv: tuple[str, ...]) -> list[str]:
    """The command as recorded: bounded (an audit record is not a data store)."""
    out = [a if len(a) <= 200 else a[:200] + "..." for a in argv[:32]]
    return out + ([f"... ({len(argv) - 32} more)"] if len(argv) > 32 else [])


def gc_logs(paths: Paths, retention: float | None = None) -> list[str]:
    """Remove gate decision logs older than the retention (``AGENTVM_LOG_RETENTION``, a
    duration, default 30d; ``0`` keeps them forever). A running sandbox's log is kept
    whatever its age. The audit chain is never pruned: removing records would break it."""
    from agentvm.units import parse_duration

    if retention is None:
        try:
            retention = parse_duration(os.environ.get("AGENTVM_LOG_RETENTION", "30d"))
        except ValueError as exc:
            raise ConfigError(f"AGENTVM_LOG_RETENTION: {exc}", hint="a duration such as 7d, 12h, or 0 to keep logs") from None
    if not retention:
        return []
    cutoff = time.time() - retention
    removed: list[str] = []
    try:
        entries = list(os.scandir(paths.home / "logs"))
    except FileNotFoundError:
        return removed
    for e in entries:
        if not e.name.endswith(".egress.jsonl"):
            continue
        sid = e.name[: -len(".egress.jsonl")]
        try:
            if e.stat(follow_symlinks=False).st_mtime < cutoff and not (paths.sandboxes / sid).exists():
                os.unlink(e.path)
                removed.append(e.name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed supervisor lingers as a zombie
    until its parent reaps it: it supervises nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    state = stat.rpartition(")")[2].split()[:1]
    return bool(state) and state[0] not in ("Z", "X")


def gc_stale(paths: Paths) -> list[str]:
    """Tear down sandboxes whose supervisor died (e.g. ``kill -9``): cgroups, run dirs, mounts."""
    cleaned: list[str] = []
    try:
        entries = list(os.scandir(paths.sandboxes))
    except FileNotFoundError:
        return cleaned
    from agentvm import cgroups as cg

    layout = None
    for e in entries:
        pid_file = Path(e.path) / "supervisor.pid"
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            # no supervisor recorded: only reap if old (a launch in progress writes it quickly)
            try:
                if time.time() - e.stat().st_mtime < 60:
                    continue
            except OSError:
                continue
            pid = -1
        if pid > 0 and _alive(pid):
            continue
        layout = layout or cg.detect()
        group = cg.SandboxCgroup(sandbox_id=e.name, layout=layout)
        roots = [layout.v2_root] if layout.v2_root else []
        roots += list(layout.v1.values())
        group.dirs = [r / cg.PARENT / e.name for r in dict.fromkeys(roots) if (r / cg.PARENT / e.name).is_dir()]
        group.freezer_dir = next((d for d in group.dirs if "freezer" in str(d)), None)
        group.kill_dir = next((d for d in group.dirs if (d / "cgroup.kill").exists()), None)
        group.kill()
        group.destroy()
        import shutil

        grants.release_recorded(Path(e.path), paths.runtime / "grants")
        shutil.rmtree(e.path, ignore_errors=True)
        cleaned.append(e.name)
    cleaned += _gc_workspace_mounts(paths)
    return cleaned


def _gc_workspace_mounts(paths: Paths) -> list[str]:
    """Unmount workspace filesystems nobody holds (their holder died): the workspace lock is
    an flock, released by the kernel when its holder exits."""
    import fcntl

    from agentvm import workspace

    out: list[str] = []
    ws_root = paths.runtime / "ws"
    try:
        entries = list(ws_root.iterdir())
    except FileNotFoundError:
        return out
    for d in entries:
        lock = paths.workspaces / f"{d.name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # in use by a live sandbox
        try:
            lease = workspace.WorkspaceLease(d.name, d, workspace.is_mounted(d), -1)
            left = lease.release()
            if not left:
                out.append(f"ws:{d.name}")
        finally:
            os.close(fd)
    return out
