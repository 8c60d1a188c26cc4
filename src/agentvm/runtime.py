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
from dataclasses import replace
from pathlib import Path
TYPE_CHECKING = False  # (typing.TYPE_CHECKING without importing typing: ~2 ms of every start)

from agentvm import defaults as D
from agentvm import identity
from agentvm.backends.base import ExitStatus, HostContext, LaunchContext, TeardownReport
from agentvm.backends.hostview import _alive  # noqa: F401 (the CLI asks the same question of the daemon)
from agentvm.lifecycle import EmbeddedGateHost, Lifecycle, RunResult  # noqa: F401 (RunResult: re-exported)
from agentvm.errors import AgentVMError, ConfigError, PolicyDenied, PrimitiveMissing
from agentvm.paths import Paths, default_paths
from agentvm.policy import SUBSTRATE_STRENGTH, MountGrant, Policy, check_tier
from agentvm.sessioncreds import session_credentials, vault_credentials  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from agentvm.backends.protocol import Backend

SUBSTRATES = ("bwrap", "gvisor")  # selectable in agent files; "fake" only in a test harness


def get_backend(name: str, paths: Paths) -> "Backend":
    if name == "bwrap":
        from agentvm.backends.bwrap import BwrapBackend

        return BwrapBackend(paths)
    if name == "gvisor":
        from agentvm.backends.gvisor import GvisorBackend

        return GvisorBackend(paths)
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
    raise ConfigError(f"unknown substrate {name!r}", hint="available: bwrap (default), gvisor")


class Runtime:
    def __init__(self, paths: Paths | None = None, backend: "Backend | None" = None, record=None) -> None:
        """``record(kind, sandbox=..., **data)``: where run records go (the daemon passes its own,
        so they are also events); by default, straight onto the audit chain."""
        self.paths = (paths or default_paths()).ensure()
        self._backend = backend
        self._backends: dict = {}
        self._gate = None
        self._record_fn = record
        self._audit = None  # the audit chain, opened on the first record
        self.images_home = self.paths.home  # where the image store is (the selftest's runtime: the operator's)
        self.check_image_signatures = True  # the selftest verifies the operator's image whole instead

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
            # no one lists it; a confined gate worker (this run's, or a daemon's sharing the home)
            # reaches its own decision log by name: 0700 here broke every later daemon run
            os.chmod(self.log_dir, 0o711)
            # comes up off the run's critical path; by default served by a confined worker process
            # (agentvm.gate.embedded_worker)
            self._gate = LazyGate(self.gate_dir, self.log_dir, self.approval_store, record=self.record,
                                  lease_dir=self.paths.runtime / "uid-leases")
        return self._gate

    def mcp_shim(self) -> str:
        """agentvm-mcp (the tool gateway as a stdio server) in agent-vm's libexec, executable,
        as shipped: refreshed when the package's copy changes."""
        src = Path(__file__).parent / "native" / "agentvm-mcp.py"
        dst = self.paths.libexec / "agentvm-mcp"
        data = src.read_bytes()
        try:
            if dst.read_bytes() == data and dst.stat().st_mode & 0o777 == 0o755:
                return str(dst)
        except OSError:
            pass
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".agentvm-mcp.{os.getpid()}")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
        return str(dst)

    def approval_store(self):
        """The approvals queue for held actions of this process's sandboxes (opened on first use)."""
        from agentvm.approvals import open_store
        from agentvm.audit import AuditLog

        audit = AuditLog(self.paths.audit_dir / "audit.db")

        def record(kind, *, actor, sandbox=None, **data):
            audit.append(kind, actor=actor, sandbox=sandbox, data=data)

        return open_store(self.paths, record)

    @property
    def vault_dir(self) -> Path:
        return self.paths.home / "vault"

    def session_credentials(self, policy: Policy, sandbox_id: str, placeholders: dict | None = None):
        """Placeholders for this session, and the gate's view of the real values.

        Every reference must resolve now (fail closed: a missing secret refuses the run).
        Returns (CredentialSet, extra env, extra files)."""
        return session_credentials(policy.credentials, self.vault_dir, sandbox_id, placeholders)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def backend_for(self, policy: Policy) -> "Backend":
        """The backend of the policy's substrate (one instance per substrate: its probes are
        cached); a backend given to the constructor serves every policy (tests, selftest)."""
        if self._backend is not None:
            return self._backend
        b = self._backends.get(policy.substrate)
        if b is None:
            b = self._backends[policy.substrate] = get_backend(policy.substrate, self.paths)
        return b

    # ------------------------------------------------------------------ preflight
    def resolve_image(self, policy: Policy) -> Policy:
        """``image: NAME`` -> ``image: sha256:...`` (what runs, and what the plan and the audit
        record carry); a signature checked when the agent file names signers or its tier is
        L4/L5. Without an image, the policy as it is."""
        if not policy.image:
            return policy
        from dataclasses import replace

        from agentvm.images import Store
        from agentvm.images.sign import require_signature

        store = Store(self.images_home)
        digest, _ = store.root_for_run(policy.image)
        if not self.check_image_signatures:
            return replace(policy, image=digest)
        if policy.image_signers or policy.risk_tier in ("L4", "L5"):
            why = (f"the agent file (imageSigners: {', '.join(policy.image_signers)})" if policy.image_signers
                   else f"risk tier {policy.risk_tier}")
            require_signature(store, digest, self.paths.home / "image-signers", policy.image_signers, why)
        return replace(policy, image=digest)

    def _image_root(self, policy: Policy) -> str:
        if not policy.image:
            return ""
        from agentvm.images import Store

        return str(Store(self.images_home).root_for_run(policy.image)[1])


    def preflight(self, policy: Policy, degrade: tuple[str, ...] = ()) -> list[str]:
        """Fail closed: every primitive the policy relies on must be present, unless waived."""
        backend = self.backend_for(policy)
        for d in degrade:
            if d not in backend.primitives:
                raise ConfigError(f"unknown --degrade {d!r} for the {backend.name} substrate",
                                  hint="one of: " + ", ".join(backend.primitives))
        if "dedicated-uid" in degrade and os.geteuid() == 0 and backend.host_local:
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
        if policy.min_substrate and backend.strength < SUBSTRATE_STRENGTH.get(policy.min_substrate, 99):
            raise PolicyDenied(
                f"the agent requires substrate {policy.min_substrate} or stronger (security.minSubstrate), "
                f"and would run on {backend.name}",
                hint=f"run it with `substrate: {policy.min_substrate}` (or `--substrate {policy.min_substrate}`); "
                "`agentvm doctor` shows which substrates this host can run",
                code="policy.min-substrate",
            )
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
            from agentvm.fsutil import check_grant_target, untrusted_symlink  # (grants only: not a plain run's)

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
    def prepare(self, policy: Policy, *, degrade: tuple[str, ...] = (), tty: bool = False,
                session_env: tuple[tuple[str, str], ...] = (), telemetry: bool = False,
                placeholders: dict | None = None):
        """Everything before launch. Returns (plan, resources) - resources must be released.
        ``session_env``: agent-vm's own per-session variables (the trace context);
        ``telemetry``: the gate relays the agent's OTLP export; ``placeholders``: credential
        placeholders to keep (a resume: see sessioncreds.session_credentials)."""
        self.preflight(policy, degrade)
        backend = self.backend_for(policy)
        sandbox_id = f"{policy.name}-{os.urandom(4).hex()}"
        root = os.geteuid() == 0
        host_resources = backend.host_local
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
            if policy.mounts:
                from agentvm import grants  # (only with grants: not on a plain run's import path)
            protected = tuple(grants.plan(os.path.realpath(m.host), m.writable_trusted) if m.writable else ()
                              for m in policy.mounts)
            creds, extra_env, extra_files = None, (), ()
            if policy.credentials:
                creds, extra_env, extra_files = (self.session_credentials(policy, sandbox_id, placeholders) if placeholders
                                                 else self.session_credentials(policy, sandbox_id))
                res.creds = creds
            run_dir = str(self.paths.sandboxes / sandbox_id)
            gate = backend.gate_attachment(sandbox_id, run_dir) if policy.egress is not None else None
            res.gate, res.host_uid = gate, (uid if host_resources else None)
            compiled = policy
            if creds is not None and host_resources:
                ssh = self._ssh_agent(policy, creds, sandbox_id, (uid, gid) if drop else None, gate is not None, res)
                if ssh is not None:  # the agent's directory, bound read-only at its own path
                    ssh_dir, ssh_env = ssh
                    compiled = replace(policy, extra_ro=policy.extra_ro + (ssh_dir,))
                    names = {e for e, _ in ssh_env}
                    extra_env = tuple(e for e in extra_env if e[0] not in names) + ssh_env
            host = None
            if host_resources:
                from agentvm.backends.hostview import etc_view

                ca_pem = self.gate_ca_pem() if gate is not None else b""
                image_root = self._image_root(policy)
                host = HostContext(uid=uid, gid=gid, dedicated=drop, run_dir=run_dir,
                                   etc_view=str(etc_view(self.paths.runtime, ca_pem, root=image_root or "/")),
                                   image_root=image_root,
                                   node_shim=_node_shim() if gate is not None else "",
                                   mcp_shim=self.mcp_shim() if gate is not None and policy.tools is not None else "")
            ctx = LaunchContext(
                sandbox_id=sandbox_id,
                workspace=ws_host,
                gate=gate,
                host=host,
                extra_env=extra_env,
                session_env=tuple(session_env),
                telemetry=bool(telemetry and gate is not None),
                extra_files=extra_files,
                tty=tty,
                degraded=tuple(degrade),
                protected=protected,
            )
            plan = backend.compile(compiled, ctx)
        except BaseException:
            res.release()
            raise
        return plan, res

    def _ssh_agent(self, policy: Policy, creds, sandbox_id: str, owner, via_gate: bool, res: "_Resources"):
        """The gate's ssh-agent for this session's ``ssh`` credentials (agentvm.gate.sshagent):
        served at ``<runtime>/ssh/<sandbox>/agent.sock`` until teardown (``res.ssh_stop``),
        its directory the sandbox user's alone (as root) and bound read-only into the sandbox.
        Beside the socket: ``known_hosts`` (the hosts the agent file lists) and ``ssh_config``
        (ssh through the gate's CONNECT with ``nc -X connect``). -> (directory, env: each ssh
        credential's variable = the socket, GIT_SSH_COMMAND unless the agent file sets it), or
        None without ssh credentials. Every signing decision goes in the sandbox's decision log
        (rule ``ssh-agent:sign`` / ``ssh-agent:refused``) and on the audit chain as ``ssh.sign`` /
        ``ssh.refuse`` (and so to the daemon's events and the trace)."""
        bindings = [b for b in creds.bindings.values() if getattr(b, "ssh_known_hosts", None) is not None]
        if not bindings:
            return None
        from agentvm.gate import sshagent

        directory = ssh_agent_dir(sandbox_id)

        decisions = self.log_dir / f"{sandbox_id}.egress.jsonl"

        def log(d) -> None:
            # the sandbox's decision log (one whole line, one O_APPEND write: never inside the
            # gate's own lines), then the audit chain (and so the daemon's events and the trace)
            line = json.dumps({"time": round(time.time(), 6), "sandbox": sandbox_id, "agent": policy.name,
                               "phase": "ssh-agent", "host": d.host, "port": 22, "method": None, "path": None,
                               "rule": "ssh-agent:sign" if d.verdict == "sign" else "ssh-agent:refused",
                               "verdict": "allow" if d.verdict == "sign" else "deny", "reason": d.reason,
                               "key": d.key, "bytes_out": 0, "bytes_in": 0}, sort_keys=True)
            try:
                fd = os.open(decisions, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)
            except OSError:
                pass
            try:
                self.record(f"ssh.{d.verdict}", sandbox=sandbox_id, agent=policy.name, key=d.key, host=d.host,
                            reason=d.reason, verdict=d.verdict)
            except Exception:  # noqa: BLE001 - the refusal or signature stands; only its record is lost
                pass

        def revoked(name: str) -> bool:
            return bool(creds.revoked(name)) or name in creds.local_revoked

        try:
            path, stop = sshagent.session_agent(bindings, creds.value, str(directory), log, revoked=revoked,
                                                owner=owner)
        except ValueError as exc:
            raise ConfigError(str(exc), hint="store the key's OpenSSH private key text (unencrypted) with "
                              "`agentvm secret set NAME < key`", code="vault.invalid-value") from None
        res.ssh_stop, res.ssh_dir = stop, directory
        known = "".join(line + "\n" for b in bindings for line in b.ssh_known_hosts)
        config = ["Host *", f"  IdentityAgent {path}", f"  UserKnownHostsFile {directory}/known_hosts",
                  "  StrictHostKeyChecking yes", "  GlobalKnownHostsFile /dev/null", "  IdentitiesOnly no",
                  "  BatchMode yes"]
        if via_gate:  # the sandbox's only route out: the gate's CONNECT (host:22 must be allowed)
            config.insert(1, f"  ProxyCommand {NC} -X connect -x {SANDBOX_PROXY} %h %p")
        for name, text in (("known_hosts", known), ("ssh_config", "\n".join(config) + "\n")):
            f = directory / name
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        env = [(b.env, path) for b in bindings]
        if not any(k == "GIT_SSH_COMMAND" for k, _ in policy.env):
            env.append(("GIT_SSH_COMMAND", f"ssh -F {directory}/ssh_config"))
        return str(directory), tuple(env)

    def preview(self, policy: Policy, *, degrade: tuple[str, ...] = ()):
        """The plan ``prepare`` would compile for ``policy``, without leasing a uid, mounting a
        workspace or resolving a secret (``agentvm compile --plan``): the same preflight, and
        placeholders where launch-time values go (uid -1, placeholder credentials)."""
        policy = self.resolve_image(policy)
        self.preflight(policy, degrade)
        backend = self.backend_for(policy)
        sandbox_id = f"{policy.name}-00000000"
        run_dir = str(self.paths.sandboxes / sandbox_id)
        gate = backend.gate_attachment(sandbox_id, run_dir) if policy.egress is not None else None
        host = None
        if backend.host_local:
            from agentvm.backends.hostview import etc_view

            ca_pem = self.gate_ca_pem() if gate is not None else b""
            image_root = self._image_root(policy)
            host = HostContext(uid=-1, gid=-1, dedicated=os.geteuid() == 0 and "dedicated-uid" not in degrade,
                               run_dir=run_dir, etc_view=str(etc_view(self.paths.runtime, ca_pem, root=image_root or "/")),
                               image_root=image_root,
                               node_shim=_node_shim() if gate is not None else "",
                               mcp_shim=self.mcp_shim() if gate is not None and policy.tools is not None else "")
        from agentvm import grants

        ctx = LaunchContext(
            sandbox_id=sandbox_id,
            workspace=str(self.paths.runtime / "ws" / policy.name) if policy.workspace and policy.agent else None,
            gate=gate,
            host=host,
            extra_env=tuple((b.env, f"<placeholder for {b.name}>") for b in policy.credentials),
            extra_files=tuple((b.file, f"<placeholder for {b.name}>\n") for b in policy.credentials if b.file),
            degraded=tuple(degrade),
            protected=tuple(grants.plan(os.path.realpath(m.host), m.writable_trusted) if m.writable else ()
                            for m in policy.mounts),
        )
        return backend.compile(policy, ctx)

    def run(
        self,
        policy: Policy,
        *,
        degrade: tuple[str, ...] = (),
        tty: bool | None = None,
        stdio: tuple[int, int, int] | None = None,
        on_launch=None,
    ) -> RunResult:
        """Run ``policy`` to completion with the embedded gate. ``on_launch(backend, handle)``
        is called once the sandbox exists."""
        if tty is None:
            tty = stdio is None and sys.stdin.isatty() and sys.stdout.isatty()
        if tty and not self.backend_for(policy).tty:
            print(f"agentvm: note: the {policy.substrate} substrate cannot give the sandbox a terminal yet: it runs "
                  "without one (its stdin and output are still this terminal; no job control, no line editing)",
                  file=sys.stderr)
            tty = False
        gc_stale(self.paths, self.backend_for(policy))
        gc_logs(self.paths)
        lc = Lifecycle(self, EmbeddedGateHost(self))
        syscalls_off = self._syscall_records()
        try:
            if policy.egress is not None and policy.credentials:
                self.embedded_gate().prefork()  # its worker forked now: before prepare reads the vault
            s = lc.prepare(policy, degrade=degrade, tty=tty, notes=lambda n: print(f"agentvm: note: {n}", file=sys.stderr))
        except BaseException:
            syscalls_off()
            raise
        old = _install_signal_handlers()
        try:
            lc.attach(s)
            if tty:
                from agentvm.ptyrelay import PtySession

                with PtySession() as pty:
                    lc.launch(s, (pty.slave, pty.slave, pty.slave))
                    pty.close_slave()
                    s.status = pty.relay(s.backend, s.handle, s.plan.timeout)
            else:
                lc.launch(s, stdio)
                if on_launch is not None:
                    on_launch(s.backend, s.handle)
                lc.wait(s)
        except _Interrupted as exc:
            lc.stop(s, grace=1.0)
            s.status = ExitStatus(exit_code=128 + exc.signum, signal=exc.signum)
        finally:
            _restore_signal_handlers(old)
            try:
                lc.teardown(s)
            finally:
                syscalls_off()
        return lc.result(s)

    def _syscall_records(self):
        """Escape probes of the sandbox this run launches (agentvm.sysaudit) on the audit chain,
        like the daemon's (``agentvm audit show``). -> the function that stops it (after the
        records taken so far have reached the chain). A Runtime whose records go elsewhere (the
        daemon's: ``record=``) leaves it to that owner's own registration."""
        if self._record_fn is not None:
            return lambda: None
        from agentvm import sysaudit
        from agentvm.audit import AuditLog

        if self._audit is None:
            self._audit = AuditLog(self.paths.audit_dir / "audit.db")
        sink = sysaudit.audit_sink(self._audit, actor=f"uid:{os.getuid()}")
        off = sysaudit.register_sink_factory(lambda sandbox_id: sink)

        def stop() -> None:
            off()
            if sysaudit._SUP is not None:  # (never start a supervisor only to flush it)
                sysaudit._SUP.flush(2.0)

        return stop


class _Resources:
    """Host resources held for one run, released after teardown."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.lease: identity.Identity | None = None
        self.workspace = None
        self.creds = None  # the session's CredentialSet (placeholders; values stay in the vault)
        self.gate = None  # the sandbox's GateAttachment (None: network none)
        self.host_uid: int | None = None  # the host uid it runs as (host-local substrates)
        self.agent_lock: int | None = None  # a named agent's uid, held when it has no workspace
        self.ssh_stop = None  # stops the session's ssh-agent (Runtime._ssh_agent), or None
        self.ssh_dir: Path | None = None

    def release(self, report: TeardownReport | None = None) -> None:
        if self.ssh_stop is not None:
            try:
                self.ssh_stop()
            except Exception:  # noqa: BLE001 - a stuck agent thread is a daemon thread; its socket goes below
                pass
            self.ssh_stop = None
        if self.ssh_dir is not None:
            import shutil

            shutil.rmtree(self.ssh_dir, ignore_errors=True)
            self.ssh_dir = None
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


def ssh_agent_dir(sandbox_id: str) -> Path:
    """A new directory for a session's ssh-agent socket, made here (never one that existed: a
    name taken - by anyone - fails, so nothing planted is followed). Under /tmp: a grant
    (``extra_ro``) may not be under agent-vm's own state or /run (agentvm.fsutil), and the
    sticky /tmp lets no other user rename or remove it. TODO(lead): a backend mount at
    ``/.agentvm/ssh`` (like the gate's socket) would keep it out of the host's /tmp."""
    d = Path("/tmp") / f"agentvm-ssh-{sandbox_id}-{os.urandom(4).hex()}"
    os.mkdir(d, 0o700)
    return d


#: the gate's proxy as the sandbox sees it (the bridge every substrate puts on its loopback)
SANDBOX_PROXY = "127.0.0.1:3128"
#: Debian's netcat-openbsd by its own name (``nc`` is an /etc/alternatives link the sandbox's
#: filtered /etc may not carry; only this one speaks ``-X connect``): scripts/install.sh
NC = "/usr/bin/nc.openbsd"


def _node_shim() -> str:
    """The undici preload for Node's fetch (installed by scripts/install.sh), if present."""
    d = os.environ.get("AGENTVM_NODE_SHIM") or "/opt/agentvm/node"
    return d if os.path.isfile(os.path.join(d, "proxy.js")) and os.path.isdir(os.path.join(d, "node_modules", "undici")) else ""


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


def gc_stale(paths: Paths, *backends) -> list[str]:
    """Tear down sandboxes whose supervisor died (e.g. ``kill -9``): each substrate reaps its
    own (``Backend.reap_stale``: cgroups, run dirs, its runtime's state); then workspace
    mounts nobody holds. Without ``backends``, every substrate this host can run."""
    if not backends:
        backends = tuple(_reapers(paths))
    cleaned: list[str] = []
    for b in backends:
        cleaned += b.reap_stale()
    cleaned += _gc_workspace_mounts(paths)
    return cleaned


def _reapers(paths: Paths):
    for name in SUBSTRATES:
        try:
            yield get_backend(name, paths)
        except AgentVMError:
            continue


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
