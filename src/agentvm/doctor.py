"""``agentvm doctor``: what this host can guarantee, probed for real.

Reports every primitive the default substrate relies on, plus facts for the stronger
substrates (gVisor, KVM). A primitive only counts when it works, not when its file exists:
KVM is checked through CPU flags, user namespaces and the whole sandbox through a live
smoke test that starts a sandbox with every layer on.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from agentvm.backends.base import Primitive


@dataclass
class DoctorReport:
    primitives: list[Primitive]
    required: list[str]
    extras: list[Primitive]
    facts: dict
    substrate: str = "bwrap"
    workspaces: dict | None = None  # agentvm.workspace.Usage: committed, used, free (warnings never fail)
    gate: dict | None = None  # the running daemon's gate mode (gate_containment), None: no daemon

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.primitives if p.name in self.required)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "required": self.required,
            "primitives": [p.__dict__ for p in self.primitives],
            "extras": [p.__dict__ for p in self.extras],
            "facts": self.facts,
            "substrate": self.substrate,
            "workspaces": self.workspaces,
            "gate": self.gate,
            "warnings": list((self.workspaces or {}).get("warnings", []))
            + ([self.gate["warning"]] if self.gate and self.gate.get("warning") else []),
        }


def gate_containment(paths) -> tuple[Primitive, dict | None]:
    """Whether the running daemon's gate - the code that parses what sandboxes send - is
    contained (confined gate workers, one per agent: the default) or runs in the daemon's own
    root process (``agentvm up --gate-workers 0``: an opt-in, warned here). Read from the
    file the daemon writes at start (``<runtime>/gate-mode.json``), if that daemon still runs."""
    import json

    try:
        d = json.loads((paths.runtime / "gate-mode.json").read_text())
        pid = int(d.get("pid") or 0)
        os.kill(pid, 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return Primitive("gate-contained", True, "no daemon running (`agentvm up` serves each agent's egress from a "
                         "confined gate worker of its own)"), None
    if d.get("mode") == "unconfined":
        d["warning"] = ("the daemon's gate is not contained: it runs in the daemon's own process (uid "
                        f"{d.get('uid')}; `agentvm up --gate-workers 0`), so a parser bug an agent exploits is code "
                        "running as the daemon; restart it without --gate-workers 0 / --unconfined-gate")
        return Primitive("gate-contained", False, d["warning"]), d
    detail = f"{d.get('mode')} confined gate workers ({d.get('confined')})"
    if d.get("warning"):
        detail += f"; warning: {d['warning']}"
    return Primitive("gate-contained", not d.get("warning"), detail), d


def _gate_stack() -> Primitive:
    """The gate's libraries (dependencies of agent-vm): without uvloop the gate runs on
    asyncio's own loop (slower); without httptools or h2 it cannot relay at all - every
    connection through it fails (closed, never open) - so a broken install shows here."""
    missing, have = [], []
    for mod in ("uvloop", "httptools", "h2"):
        try:
            m = __import__(mod)
            have.append(f"{mod} {getattr(m, '__version__', '?')}")
        except ImportError:
            missing.append(mod)
    if missing:
        return Primitive("gate-stack", False, f"missing {', '.join(missing)} (reinstall agent-vm: pip install -e .)")
    return Primitive("gate-stack", True, ", ".join(have))


def _gate_hot_path() -> Primitive:
    """Whether the gate's request path runs compiled (``agentvm.gate.accel``): the same source
    either way; plain Python costs about a sixth more CPU per request."""
    from agentvm.gate import accel

    ok, line = accel.summary()
    if not ok:
        line += " - the gate works, slower; scripts/install.sh (or python -m agentvm.gate build) compiles it"
    return Primitive("gate-compiled", ok, line)


def _start_code() -> Primitive:
    """Whether the code ``dataclasses`` generates is kept between runs (``agentvm.codecache``):
    the same classes either way; compiling them costs every start about 13 ms more."""
    from agentvm import codecache

    st = codecache.status()
    if st["installed"]:
        return Primitive("start-code-kept", True, f"{st['file']} ({st['modules']} modules)")
    return Primitive("start-code-kept", False, f"{st['reason']} - starts work, slower; scripts/install.sh (or python -c "
                     "'from agentvm import codecache; codecache.main([\"build\"])') keeps it")


def _kvm() -> Primitive:
    if not os.path.exists("/dev/kvm"):
        return Primitive("kvm", False, "no /dev/kvm")
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    has = " vmx" in flags or " svm" in flags
    if not has:
        return Primitive("kvm", False, "/dev/kvm exists but the CPU exposes no vmx/svm flags (nested/PVM): not usable for guests")
    return Primitive("kvm", True, "vmx/svm present (a guest boot test is the microVM backend's job)")


def _gvisor() -> Primitive:
    """The gVisor substrate, from its own probe (cached; it starts a sandbox once per runsc)."""
    from agentvm.backends.gvisor import GvisorBackend
    from agentvm.paths import default_paths

    caps = GvisorBackend(default_paths()).capabilities()
    bad = [p for p in caps.primitives if not p.ok and p.name in ("runsc", "gvisor-platform")]
    if bad:
        return Primitive("gvisor", False, "; ".join(f"{p.name}: {p.detail}" for p in bad))
    return Primitive("gvisor", True, f"runsc {caps.facts.get('version', '?')}, {caps.facts.get('platform')} platform "
                     "(substrate: gvisor; `agentvm doctor --substrate gvisor` runs its smoke test)")


def _favordynmods() -> Primitive:
    """Optional tuning: every sandbox start migrates a process into its cgroups, which takes
    the kernel's cgroup threadgroup lock for writing and waits for an RCU grace period -
    unless the cgroup2 mount has ``favordynmods`` (kernel >= 6.0)."""
    try:
        for line in open("/proc/self/mountinfo"):
            left, _, right = line.partition(" - ")
            if right.startswith("cgroup2 "):
                mnt = left.split()[4]
                on = "favordynmods" in right.split()[2].split(",")
                return Primitive(
                    "cgroup-favordynmods",
                    on,
                    "on" if on else f"off: sandbox start pays an RCU grace period per launch; "
                    f"`mount -o remount,favordynmods {mnt}` makes it ~2x faster (host-wide setting, optional)",
                )
    except OSError:
        pass
    return Primitive("cgroup-favordynmods", False, "no cgroup2 mount")


def smoke_test(runtime, substrate: str = "bwrap") -> Primitive:
    """Start a real sandbox with every layer on and check it ran as an unprivileged uid."""
    from agentvm.policy import Policy

    pol = Policy(name="doctor", command=("/bin/sh", "-c", "test \"$(id -u)\" = 1000"), substrate=substrate)
    r, w = os.pipe()
    t0 = time.perf_counter()
    try:
        res = runtime.run(pol, tty=False, stdio=(subprocess.DEVNULL, w, w))
    except Exception as exc:  # report, never crash the doctor
        os.close(w)
        os.close(r)
        return Primitive("smoke-test", False, f"{type(exc).__name__}: {exc}")
    os.close(w)
    out = os.read(r, 4096).decode(errors="replace").strip()
    os.close(r)
    ms = (time.perf_counter() - t0) * 1000
    ok = res.exit_code == 0 and bool(res.teardown.get("verified"))
    detail = f"sandbox started and torn down (verified) in {ms:.0f} ms" if ok else f"exit {res.exit_code}: {out or res.setup_error}"
    return Primitive("smoke-test", ok, detail)


def run_doctor(smoke: bool = True, substrate: str = "bwrap") -> DoctorReport:
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime

    rt = Runtime()
    backend = rt.backend_for(Policy(name="doctor", substrate=substrate))
    caps = backend.capabilities()
    prims = list(caps.primitives)
    required = list(backend.required_primitives(Policy(name="doctor", agent=True, substrate=substrate)))
    if smoke:
        if all(p.ok for p in prims if p.name in required):
            prims.append(smoke_test(rt, substrate))
        else:
            prims.append(Primitive("smoke-test", False, "skipped: required primitives missing"))
        required.append("smoke-test")
    ws = workspace_usage(rt.paths)
    gate, gate_mode = gate_containment(rt.paths)
    extras = [_gate_stack(), _gate_hot_path(), _start_code(), gate, _favordynmods(), _kvm(), _workspace_backend(ws)] + (
        [_gvisor()] if substrate != "gvisor" else [])
    facts = dict(caps.facts, kernel=os.uname().release)
    return DoctorReport(prims, required, extras, facts, substrate, ws, gate_mode)


def _workspace_backend(u: dict) -> Primitive:
    """Which workspace storage new workspaces get and why (``AGENTVM_WORKSPACE_BACKEND``), and
    the pool's reservation on the host."""
    from agentvm.workspace import human

    name, why = u.get("backend") or "none", u.get("backend_why") or ""
    detail = f"{name}: {why}"
    pool = u.get("pool")
    if pool:
        detail += (f"; pool reserved on the host: {human(pool['reserved'])}"
                   + (f", {human(pool['free'])} free of {human(pool['size'])}, {pool['count']} workspaces"
                      if pool.get("free") is not None else " (not mounted)")
                   + ("" if pool.get("mounted") else "; unmounted while no agent uses it"))
    return Primitive("workspace-backend", name != "none", detail)


def workspace_usage(paths) -> dict:
    """The disk committed to workspaces (their limits), actually used, the free space of the
    filesystem holding them, the backend new workspaces get (and why) and the pool's size and
    free space; ``warnings`` past 90% use of the host's filesystem or of the pool (reported,
    never failing)."""
    from agentvm.workspace import usage

    return usage(paths.workspaces).to_dict()
