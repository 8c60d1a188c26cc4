"""The selftest framework: canaries, a sink, real sandboxes, and verdicts with evidence.

A :class:`Case` is one attack. It runs real hostile code inside a real sandbox (through the
public runtime, with a canary policy) and returns a :class:`Verdict`: ``contained``,
``escaped`` or ``error``, with evidence either way. Every case names the *weakening* that
must make it escape (for example ``no-seccomp``); the test suite runs each case against its
weakened configuration and requires ``escaped``, which proves the case can fail.

Weakenings exist only here: they transform a compiled :class:`LaunchPlan` (or the policy) of
a selftest sandbox. Production code has no switch for them.

The canary environment (:class:`Env`) is private: its own ``AGENTVM_HOME`` under /tmp,
fake credentials in its own vault, canary files outside every grant, a local *sink* that
records anything reaching it (only on 127.0.0.1), and a canary DNS name mapped to the sink
for the gate. Nothing here touches the operator's state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CATEGORIES = (
    "network",
    "dns",
    "proxy",
    "credentials",
    "filesystem",
    "process",
    "resources",
    "supply-chain",
    "persistence",
    "isolation",
    "control-plane",
    "tools",
    "gate-containment",
    "state",
)

WEAKENINGS = {
    "none": "the real configuration",
    "no-seccomp": "the seccomp filter is not loaded",
    "no-landlock": "Landlock is not applied",
    "share-net": "the sandbox shares the host's network namespace",
    "no-pidns": "the sandbox shares the host's pid namespace",
    "host-etc": "the host's /etc is bound instead of the allowlisted view",
    "grant-canaries": "the canary directory (outside every grant) is granted read-write",
    "no-limits": "no cgroup limits and no rlimits",
    "cred-in-env": "the real credential value is put in the sandbox environment, and the gate does not look for real "
                   "values in what the sandbox sends",
    "permissive-gate": "the gate allows every host, including the sink's name",
    "shared-state": "the agent's HOME and /tmp are persistent host directories shared across sessions",
    "shared-uid": "two sandboxes share one uid and see each other's workspace",
    "writable-audit": "the audit and decision logs are granted read-write into the sandbox",
    "raw-scrub": "the gate scrubs responses of raw credential values only (no decoding, no encoded forms)",
    "weak-bridge": "the egress bridge inside the sandbox stays dumpable and runs without the seccomp filter",
    "permissive-tools": "the tool gateway allows every tool of the test server, with no argument constraints",
    "writable-approvals": "the approvals queue's folder is granted read-write into the sandbox",
    "no-budget": "the gate meters no LLM budget (limits.budget is dropped)",
    "no-syscall-audit": "the seccomp filter denies escape probes silently (no user notification: nothing is recorded)",
    "gate-unconfined": "a gate worker is not confined (root, the daemon's mount namespace, no Landlock, no seccomp)",
    "gate-no-seccomp": "a gate worker is confined without its seccomp filter",
    "gate-no-landlock": "a gate worker is confined without Landlock",
    "checkpoint-granted": "checkpoints are kept in a folder granted read-write into the sandbox",
    "unbound-checkpoint": "resume trusts a checkpoint as found (its binding is recomputed from the image, not read "
                          "from the daemon's state)",
    "no-lineage": "a fork's gate does not know its ancestors' placeholders",
    "ssh-any-host": "the ssh credential's knownHosts also lists the attacker's host (the gate's agent signs for it)",
}

# weakenings of the policy or the gate (not of a substrate's plan): they apply on every substrate
POLICY_WEAKENINGS = frozenset({"grant-canaries", "cred-in-env", "permissive-gate", "raw-scrub", "permissive-tools",
                               "no-budget", "gate-unconfined", "gate-no-seccomp", "gate-no-landlock",
                               "checkpoint-granted", "unbound-checkpoint", "no-lineage", "ssh-any-host"})

SINK_NAME = "canary.selftest"
CANARY_HOST = "canary-exfil.selftest"
LLM_HOST = "llm.selftest"  # an "LLM API" under a budget (the sink answers for it)


@dataclass
class Verdict:
    status: str  # "contained" | "escaped" | "error"
    evidence: str

    @classmethod
    def contained(cls, evidence: str) -> "Verdict":
        return cls("contained", evidence)

    @classmethod
    def escaped(cls, evidence: str) -> "Verdict":
        return cls("escaped", evidence)

    @classmethod
    def error(cls, evidence: str) -> "Verdict":
        return cls("error", evidence)


SUBSTRATES = ("bwrap", "gvisor")


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    title: str
    weakened_by: str
    run: Callable[["Env"], Verdict] = field(compare=False, repr=False)
    # substrate -> why this attack does not apply there (reported as n/a, counted apart)
    not_on: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"{self.id}: unknown category {self.category}")
        parts = self.weakened_by.split("+")
        if not parts or any(p not in WEAKENINGS or p == "none" for p in parts):
            raise ValueError(f"{self.id}: unknown weakening {self.weakened_by}")
        if set(self.not_on) - set(SUBSTRATES) or not all(self.not_on.values()):
            raise ValueError(f"{self.id}: not_on names unknown substrates or gives no reason")

    def applies_to(self, substrate: str) -> bool:
        return substrate not in self.not_on


REGISTRY: dict[str, Case] = {}


def case(id: str, category: str, title: str, *, weakened_by: str, not_on: dict | None = None):
    """Decorator: register ``fn(env) -> Verdict`` as a case. ``not_on``: the substrates where
    the attack does not apply, each with the reason (printed as n/a, never counted as a pass)."""

    def deco(fn):
        if id in REGISTRY:
            raise ValueError(f"duplicate case id {id}")
        REGISTRY[id] = Case(id, category, title, weakened_by, fn, dict(not_on or {}))
        return fn

    return deco


# ---------------------------------------------------------------------------- the sink


class Sink:
    """Listens on 127.0.0.1 (TCP and UDP, one port) and records every contact."""

    def __init__(self) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.tcp.listen(64)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.hits: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._stop = False
        for target in (self._tcp_loop, self._udp_loop):
            threading.Thread(target=target, daemon=True).start()

    def _tcp_loop(self) -> None:
        self.tcp.settimeout(0.2)
        while not self._stop:
            try:
                c, _ = self.tcp.accept()
            except (socket.timeout, OSError):
                continue
            c.settimeout(0.5)
            data = b""
            try:
                data = self._read_request(c)
            except OSError:
                pass
            # recorded before it is answered: when the sandbox has its answer, the hit is here
            with self._lock:
                self.hits.append(("tcp", data[:4096]))
            try:
                if data[:4] in (b"GET ", b"POST", b"PUT ", b"HEAD"):
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nsink!")
            except OSError:
                pass
            c.close()

    @staticmethod
    def _read_request(c: socket.socket, cap: int = 65536) -> bytes:
        """What a client sent: an HTTP request's head and its Content-Length body (a proxy may
        send them in two writes - one recv took only the head, and the body that carried the
        canary was never seen), or whatever arrived of anything else."""
        data = c.recv(cap)
        if data[:4] not in (b"GET ", b"POST", b"PUT ", b"HEAD"):
            return data
        while b"\r\n\r\n" not in data and len(data) < cap:
            more = c.recv(cap - len(data))
            if not more:
                return data
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                try:
                    length = min(int(value.strip()), cap)
                except ValueError:
                    length = 0
        while len(body) < length:
            try:
                more = c.recv(length - len(body))
            except OSError:
                break
            if not more:
                break
            body += more
        return head + b"\r\n\r\n" + body

    def _udp_loop(self) -> None:
        self.udp.settimeout(0.2)
        while not self._stop:
            try:
                data, _ = self.udp.recvfrom(65536)
            except (socket.timeout, OSError):
                continue
            with self._lock:
                self.hits.append(("udp", data[:4096]))

    def mark(self) -> int:
        with self._lock:
            return len(self.hits)

    def since(self, mark: int) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.hits[mark:])

    def close(self) -> None:
        self._stop = True
        for s in (self.tcp, self.udp):
            try:
                s.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    exit_code: int
    stdout: str
    stderr: str
    result: dict
    egress: list[dict]  # decision-log lines of this run
    sink: list[tuple[str, bytes]]  # what reached the sink during this run

    @property
    def out(self) -> str:
        return self.stdout + self.stderr

    def denied(self, prefix: str = "") -> list[dict]:
        return [l for l in self.egress if l.get("verdict") == "deny" and str(l.get("rule", "")).startswith(prefix)]


# ---------------------------------------------------------------------------- the environment


class Env:
    """The canary environment and a way to run attack programs in sandboxes."""

    def __init__(self, weaken: str = "none", *, keep: bool = False, substrate: str = "bwrap",
                 image: str | None = None) -> None:
        if any(w not in WEAKENINGS for w in weaken.split("+")):
            raise ValueError(f"unknown weakening {weaken}")
        if substrate not in SUBSTRATES:
            raise ValueError(f"unknown substrate {substrate}")
        if substrate != "bwrap" and weaken != "none" and not set(weaken.split("+")) <= POLICY_WEAKENINGS:
            raise ValueError("on substrates other than bwrap, only these weakenings exist: "
                             + ", ".join(sorted(POLICY_WEAKENINGS)))
        self.substrate = substrate
        self.start_failures: list[str] = []  # why runsc's sandboxes died while starting (this case)
        # an image of the operator's store (its digest, verified whole once here): every
        # sandbox of the run has it as its root
        self.image, self.images_home = None, None
        if image:
            from agentvm.images import ImageError, Store
            from agentvm.paths import default_paths

            store = Store(default_paths().home)
            self.image = store.resolve(image)
            ok, why = store.verify(self.image)
            if not ok:
                raise ImageError(f"image {self.image}: {why}", code="image.corrupt")
            self.images_home = default_paths().home
        self.weaken = weaken
        self.weakens = set(weaken.split("+"))
        self.keep = keep
        self.root = Path(tempfile.mkdtemp(prefix="agentvm-selftest-", dir="/tmp"))
        os.chmod(self.root, 0o711)
        self.home = self.root / "home"
        self.home.mkdir(mode=0o711)
        # canaries outside every grant
        self.canary_dir = self.root / "canaries"
        self.canary_dir.mkdir(mode=0o755)
        self.canary = "CANARY-FILE-" + secrets.token_hex(12)
        (self.canary_dir / "secret.txt").write_text(self.canary + "\n")
        os.chmod(self.canary_dir / "secret.txt", 0o644)
        # fake credentials: the value is a canary; it must never be seen inside
        self.cred_value = "CANARY-CRED-" + secrets.token_hex(16)
        # '/', '+' and '=' as in AWS secret keys: its percent-encoded and JSON-escaped forms differ from it
        self.aws_value = "CANARY/AWS+" + secrets.token_hex(12) + "="
        self.gh_value = "ghp_CANARY" + secrets.token_hex(16)
        self.operator_secret = "CANARY-OPERATOR-ENV-" + secrets.token_hex(8)
        self.sink = Sink()
        # a uid range of its own: never shares a uid with the operator's sandboxes or another selftest
        self._old_uid_base = os.environ.get("AGENTVM_UID_BASE")
        os.environ["AGENTVM_UID_BASE"] = str(4_000_000 + secrets.randbelow(300) * 130_000)
        self._paths = None
        self._runtime = None
        self._lock = threading.Lock()
        self._setup_vault()

    # -- plumbing -------------------------------------------------------------------------
    @property
    def paths(self):
        if self._paths is None:
            from agentvm.paths import Paths

            self._paths = Paths(home=self.home, runtime=self.home / "run").ensure()
        return self._paths

    def _setup_vault(self) -> None:
        from agentvm.vault import Vault

        v = Vault(self.paths.home / "vault")
        v.set("canary-api", self.cred_value)
        v.set("canary-github", self.gh_value)
        v.set("canary-aws", self.aws_value)

    def runtime(self):
        if self._runtime is None:
            from agentvm.runtime import Runtime

            from agentvm.selftest.weaken import WeakenedBackend

            cls = Runtime
            # the gate's credential layers a weakening turns off (raw-scrub: encoded forms;
            # cred-in-env: the check for real values in what the sandbox sends)
            off = {k: False for k, w in (("scrub_encoded", "raw-scrub"), ("check_real", "cred-in-env"))
                   if w in self.weakens}
            if off:
                class WeakCredentialsRuntime(Runtime):
                    def session_credentials(self, policy, sandbox_id, *args):
                        creds, env, files = super().session_credentials(policy, sandbox_id, *args)
                        for attr, value in off.items():
                            setattr(creds, attr, value)
                        return creds, env, files

                cls = WeakCredentialsRuntime
            if "writable-approvals" in self.weakens:
                base = cls

                class OpenQueueRuntime(base):
                    def approval_store(self):
                        from agentvm.approvals import store_path

                        store = super().approval_store()  # opening tightens the file: loosen it again
                        for f in store_path(self.paths).parent.iterdir():
                            os.chmod(f, 0o666)
                        return store

                cls = OpenQueueRuntime
            if self.substrate == "bwrap":
                backend = WeakenedBackend(self.paths, self.weaken, self)
            else:
                from agentvm.runtime import get_backend

                backend = get_backend(self.substrate, self.paths)
            self._runtime = cls(self.paths, backend)
            if self.image:
                self._runtime.images_home = self.images_home  # the operator's store
                self._runtime.check_image_signatures = False  # the image was verified whole in __init__
            self._runtime.embedded_gate()  # created up front (its log dir, and no lazy race under threads)
        return self._runtime

    def close(self) -> None:
        self.sink.close()
        if self._runtime is not None:
            self._runtime.close()
        if self._old_uid_base is None:
            os.environ.pop("AGENTVM_UID_BASE", None)
        else:
            os.environ["AGENTVM_UID_BASE"] = self._old_uid_base
        if not self.keep:
            for d in (self.home / "run" / "ws").glob("*") if (self.home / "run" / "ws").exists() else []:
                subprocess.run(["umount", "-l", str(d)], capture_output=True)
            shutil.rmtree(self.root, ignore_errors=True)

    # -- the canary policy ------------------------------------------------------------------
    def policy(
        self,
        command: list[str],
        *,
        name: str = "selftest",
        agent: bool = False,
        egress: bool = True,
        credentials: bool = True,
        mounts: tuple = (),
        env: dict | None = None,
        memory: int = 256 * 1024**2,
        pids: int = 128,
        timeout: float = 30.0,
        disk: int = 32 * 1024**2,
        allow: tuple[str, ...] = (),
        allow_ptrace: bool = False,
        tools=None,
        ask: tuple = (),
        approval_timeout: float = 300.0,
        budget=None,
    ):
        """A policy for one attack: egress allowed only to ``allowed.selftest`` (the sink is
        *not* allowed), two credentials bound to ``api.selftest``/``api.github.com``."""
        from agentvm.gate.credentials import compile_credentials
        from agentvm.gate.policy import compile_egress
        from agentvm.policy import Limits, MountGrant, Policy, _with_default_denies

        eg = None
        creds: tuple = ()
        if egress:
            extra_allow = [f"allowed.selftest:{self.sink.port}", "api.selftest:443", "api.github.com:443", *allow]
            hosts = {"allowed.selftest": "127.0.0.1", "api.selftest": "127.0.0.1", "api.github.com": "127.0.0.1",
                     SINK_NAME: "127.0.0.1", CANARY_HOST: "127.0.0.1", LLM_HOST: "127.0.0.1"}
            if "permissive-gate" in self.weakens:
                extra_allow += [f"{SINK_NAME}:{self.sink.port}", f"{CANARY_HOST}:{self.sink.port}", f"*.selftest:{self.sink.port}",
                                f"127.0.0.1:{self.sink.port}"]
            eg = _with_default_denies(compile_egress(None, extra_allow=extra_allow, extra_hosts=hosts))
            if ask:  # allow rules with action: ask, after the others (as an operator would append them)
                eg = replace(eg, allow=eg.allow + tuple(ask))
            if credentials:
                from types import SimpleNamespace as NS

                creds = compile_credentials([
                    NS(name="api", env="CANARY_API_KEY", ref="vault:canary-api", hosts=["api.selftest"],
                       inject=NS(header="Authorization", format="Bearer {}", basic=None, query=None), file=None,
                       placeholder=NS(prefix="sk-", length=None, charset="alnum"), sigv4=None, hmac=None),
                    NS(name="github", env="GITHUB_TOKEN", ref="vault:canary-github", hosts=["api.github.com"],
                       inject=NS(header="Authorization", format="token {}", basic=None, query=None), file=None,
                       placeholder=NS(prefix="ghp_", length=None, charset="alnum"), sigv4=None, hmac=None),
                    NS(name="aws-style", env="CANARY_AWS_SECRET", ref="vault:canary-aws", hosts=["api.selftest"],
                       inject=NS(header="X-Aws-Secret", format="{}", basic=None, query=None), file=None,
                       placeholder=NS(prefix="", length=None, charset="alnum"), sigv4=None, hmac=None),
                ])
        penv = dict(env or {})
        if "cred-in-env" in self.weakens:
            penv["LEAKED_API_KEY"] = self.cred_value
        grants = list(mounts)
        if "grant-canaries" in self.weakens:
            os.chmod(self.canary_dir, 0o1777)  # the over-broad grant is writable by the agent's uid
            grants.append(MountGrant(str(self.canary_dir), "/mnt/canaries", True))
        return Policy(
            name=name,
            command=tuple(command),
            substrate=self.substrate,
            image=self.image,
            agent=agent,
            risk_tier="L4",
            mounts=tuple(grants),
            env=tuple(sorted(penv.items())),
            limits=Limits(memory=memory, pids=pids, timeout=timeout, disk=disk, tmp=64 * 1024**2,
                          budget=None if "no-budget" in self.weakens else budget),
            network="gate" if egress else "none",  # egress=False: no route at all, not even the gate
            egress=eg,
            credentials=creds,
            allow_ptrace=allow_ptrace,
            tools=tools,
            approval_timeout=approval_timeout,
        )

    # -- running ----------------------------------------------------------------------------
    def sandbox(self, script: str, *, lang: str = "sh", stdin: bytes = b"", **policy_kw) -> Outcome:
        """Run ``script`` (sh or python3, Debian's) in a sandbox with the canary policy."""
        if lang == "sh":
            cmd = ["/bin/sh", "-c", script]
        elif lang == "python":
            cmd = ["/usr/bin/python3", "-c", script]
        else:
            cmd = list(script) if isinstance(script, (list, tuple)) else [script]
        return self.run_policy(self.policy(cmd, **policy_kw), stdin=stdin)

    def run_policy(self, policy, *, stdin: bytes = b"") -> Outcome:
        rt = self.runtime()
        mark = self.sink.mark()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
            inp.write(stdin)
            inp.seek(0)
            with self._lock:  # concurrent runs share one environment variable: reference-count it
                self._active = getattr(self, "_active", 0) + 1
                os.environ["SELFTEST_OPERATOR_SECRET"] = self.operator_secret  # must never reach a sandbox
            try:
                res = rt.run(policy, tty=False, stdio=(inp.fileno(), out.fileno(), err.fileno()))
            finally:
                with self._lock:
                    self._active -= 1
                    if not self._active:
                        os.environ.pop("SELFTEST_OPERATOR_SECRET", None)
            out.seek(0)
            err.seek(0)
            stdout = out.read(2_000_000).decode(errors="replace")
            stderr = err.read(2_000_000).decode(errors="replace")
        egress: list[dict] = []
        if res.egress and res.egress.get("log"):
            try:
                egress = [json.loads(l) for l in Path(res.egress["log"]).read_text().splitlines() if l.strip()]
            except OSError:
                pass
        time.sleep(0.05)  # let the sink threads record late arrivals
        why = (res.setup_error or {}).get("message", "")
        if START_FAILED in stdout + stderr + why:
            # runsc's own stderr says only "EOF": keep the backend's reason (the sandbox's boot
            # log) for the case's evidence
            with self._lock:
                self.start_failures.append(why or "(no setup error recorded)")
        return Outcome(res.exit_code, stdout, stderr, res.to_dict(), egress, self.sink.since(mark))

    def canary_seen(self, text: str) -> list[str]:
        """Which canary values appear in ``text``."""
        found = []
        for label, value in (("canary file", self.canary), ("credential", self.cred_value),
                             ("github token", self.gh_value), ("aws-style credential", self.aws_value),
                             ("operator env", self.operator_secret)):
            if value in text:
                found.append(label)
        return found


START_FAILED = "cannot read client sync file"  # runsc: the sandbox process went away while starting
# (once every start of a stretch of the full suite: a descriptor of the caller's on 256-258,
# where gVisor's sandbox process puts its stdio - fixed in the helper, pinned by
# tests/contract's test_a_caller_holding_hundreds_of_descriptors_still_starts_sandboxes)


def run_cases(cases: list[Case], env: Env) -> list[dict]:
    results = []
    for c in cases:
        t0 = time.monotonic()
        if not c.applies_to(env.substrate):
            results.append({"id": c.id, "category": c.category, "title": c.title, "status": "n/a",
                            "evidence": f"not applicable on {env.substrate}: {c.not_on[env.substrate]}", "seconds": 0.0,
                            "weakened_by": c.weakened_by})
            continue
        env.start_failures.clear()
        try:
            v = c.run(env)
        except Exception as exc:  # a crashed case is an error, never a pass
            v = Verdict.error(f"{type(exc).__name__}: {exc}")
        if v.status == "error" and env.start_failures:  # (runsc's own words are only "EOF")
            v = replace(v, evidence=v.evidence + " [backend: " + "; ".join(env.start_failures)[-600:] + "]")
        results.append({
            "id": c.id, "category": c.category, "title": c.title, "status": v.status,
            "evidence": v.evidence[:2000], "seconds": round(time.monotonic() - t0, 3), "weakened_by": c.weakened_by,
        })
    return results


def all_cases() -> list[Case]:
    from agentvm.selftest import cases  # noqa: F401  (registers every case module)

    return sorted(REGISTRY.values(), key=lambda c: (CATEGORIES.index(c.category), c.id))


def replace(obj, **kw):
    return dataclasses.replace(obj, **kw)
