#!/usr/bin/env python3
"""Sandbox start-up cost, with baselines measured in the same run.

    python3 bench/bench_startup.py [--runs N] [--json]

Rows (median and p90 of N runs, /bin/true as the payload):
  bare bwrap            `bwrap --unshare-all --ro-bind / / /bin/true` (the baseline)
  sandbox start-to-exit  launch + wait of a sandbox with every layer on (userns/pid/net/...
                         namespaces, dedicated uid, cgroups, seccomp, Landlock, the /etc view,
                         tmpfs /tmp, workspace tmpfs), measured in-process
  sandbox + teardown     the above plus verified teardown (cgroup kill, rmdir, uid sweep)
  ... + gate             the above with the egress gate attached (every sandbox has one unless
                         `network: none`): endpoint opened before launch, closed after
  agentvm run -- true    the whole CLI, end to end, as a user types it (new Python process);
                         the default routes through the gate
  ... --network none     the same with no route at all (no gate): the gate's cost is the
                         difference between these two rows (target: <= 5 ms)
  run via daemon         `agentvm run -- true` with a daemon up: the CLI is a thin client
                         (the compiled entry point; target: <= 30 ms median); the daemon runs
                         the same lifecycle
  python -c pass         the interpreter's own start-up, for context
  cgroup migration       the kernel's cost of moving one new process into a cgroup after a
                         quiet moment (every sandbox start pays it once): on this kernel a
                         writer of cgroup_threadgroup_rwsem waits for an RCU grace period
                         (~8 ms) unless a cgroup hierarchy was mounted with `favordynmods`
                         (then ~0.4 ms, at some cost to every fork and exit on the host)
  gvisor rows            bare `runsc do /bin/true` (the gVisor baseline), a gVisor sandbox's
                         start-to-exit in-process, and `agentvm run --substrate gvisor -- true`
                         (skipped, and said so, where runsc cannot run)

Ratios are against the bare bwrap row (the gvisor rows also against bare runsc). Run as root
on an idle machine; numbers from a loaded machine are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(fn, runs: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def cgroup_migration(runs: int) -> list[float]:
    """Milliseconds to write a new process's pid into a fresh cgroup's cgroup.procs, each after
    30 ms of quiet (the first migration of a sandbox start); [] where there is no cgroup to use."""
    root = next((Path(p) for p in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup")
                 if (Path(p) / "cgroup.procs").exists()), None)
    if root is None:
        return []
    d = root / f"agentvm-bench-migration-{os.getpid()}"
    try:
        d.mkdir()
    except OSError:
        return []
    out = []
    try:
        for _ in range(runs):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.read(r, 1)
                os._exit(0)
            time.sleep(0.03)
            t = time.perf_counter()
            with open(d / "cgroup.procs", "w") as f:
                f.write(str(pid))
            out.append((time.perf_counter() - t) * 1000)
            os.write(w, b"x")
            os.waitpid(pid, 0)
            os.close(r)
            os.close(w)
    finally:
        d.rmdir()
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs), "p90_ms": xs[int(0.9 * (len(xs) - 1))], "runs": len(xs)}


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _python import agentvm_python

    agentvm_python()  # python3 without agentvm: again on its venv's python
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_startup: run as root (dedicated uids and cgroups are part of what is measured)", file=sys.stderr)
        return 2

    home = Path(tempfile.mkdtemp(prefix="agentvm-bench-", dir="/tmp"))
    os.chmod(home, 0o711)
    os.environ["AGENTVM_HOME"] = str(home)
    from agentvm import native
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime

    rt = Runtime()
    bwrap = str(native.bwrap_path(rt.paths.libexec))
    pol = Policy(name="bench", command=("/bin/true",), network="none")
    gated = Policy(name="bench", command=("/bin/true",))
    backend = rt.backend_for(pol)

    def bare():
        subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "/bin/true"], check=True)

    def full_run(policy, start_exit: list[float]):
        """One sandbox of ``policy`` launched, waited for (timed into ``start_exit``), torn down."""

        def run():
            plan, res = rt.prepare(policy, tty=False)
            b = rt.backend_for(policy)
            t = time.perf_counter()
            h = b.launch(plan, stdio=(subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL))
            st = b.wait(h)
            start_exit.append((time.perf_counter() - t) * 1000)
            rep = b.destroy(h)
            res.release(rep)
            assert st.exit_code == 0 and rep.verified, (st, rep)

        return run

    start_exit: list[float] = []
    sandbox_full = full_run(pol, start_exit)

    def sandbox_gated():
        plan, res = rt.prepare(gated, tty=False)
        run_dir = rt.paths.sandboxes / plan.sandbox_id
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o711)
        ep = rt.embedded_gate().open(plan.sandbox_id, "bench", gated.egress, run_dir / "gate.sock", res.host_uid)
        h = backend.launch(plan, stdio=(subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL))
        st = backend.wait(h)
        rep = backend.destroy(h)
        res.release(rep)
        if not ep.abandon_if_unused():  # as Runtime.run does
            ep.result()
            rt.embedded_gate().close(plan.sandbox_id)
        assert st.exit_code == 0 and rep.verified, (st, rep)

    # bytecode as an installed agent-vm has it (an environment with PYTHONDONTWRITEBYTECODE
    # would otherwise recompile every changed module on every run and measure that)
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "src" / "agentvm"), quiet=1)

    # the entry point next to this interpreter (a venv's), never a pyenv shim
    entry = Path(sys.executable).parent / "agentvm"
    cli = [str(entry)] if entry.exists() else [sys.executable, "-m", "agentvm"]

    def e2e():
        r = subprocess.run(cli + ["run", "--", "/bin/true"], stdin=subprocess.DEVNULL)
        assert r.returncode == 0

    def e2e_none():
        r = subprocess.run(cli + ["run", "--network", "none", "--", "/bin/true"], stdin=subprocess.DEVNULL)
        assert r.returncode == 0

    def py():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    runsc = shutil.which("runsc")
    gv_pol = Policy(name="bench", command=("/bin/true",), network="none", substrate="gvisor")
    gv_start: list[float] = []
    gvisor_full = full_run(gv_pol, gv_start)

    def bare_runsc():
        with tempfile.TemporaryDirectory(prefix="agentvm-bench-runsc-") as td:
            subprocess.run([runsc, "--root", td, "--platform=ptrace", "--network=none", "--ignore-cgroups", "do",
                            "/bin/true"], check=True, stdin=subprocess.DEVNULL)

    def e2e_gvisor():
        r = subprocess.run(cli + ["run", "--substrate", "gvisor", "--", "/bin/true"], stdin=subprocess.DEVNULL)
        assert r.returncode == 0

    rows = {}
    rows["bare bwrap"] = summary(measure(bare, args.runs))
    full = measure(sandbox_full, args.runs)
    start_exit[:] = start_exit[-args.runs :]
    rows["sandbox start-to-exit"] = summary(start_exit)
    rows["sandbox + teardown"] = summary(full)
    rows["... + gate"] = summary(measure(sandbox_gated, args.runs))
    # interleaved, so drift on a shared machine hits both rows alike
    a: list[float] = []
    b: list[float] = []
    for _ in range(max(10, args.runs // 2)):
        a += measure(e2e, 1, warmup=0)
        b += measure(e2e_none, 1, warmup=0)
    rows["agentvm run -- true"] = summary(a)
    rows["... --network none"] = summary(b)
    # through a daemon (a private one in this bench's home): the CLI as a thin client
    env = dict(os.environ, AGENTVM_NO_DAEMON="0")
    up = subprocess.run(cli + ["up"], env=env, capture_output=True, text=True)
    if up.returncode == 0:
        def via_daemon():
            r = subprocess.run(cli + ["run", "--", "/bin/true"], stdin=subprocess.DEVNULL, env=env)
            assert r.returncode == 0

        rows["run via daemon"] = summary(measure(via_daemon, args.runs))
        subprocess.run(cli + ["down"], env=env, capture_output=True)
    else:
        print(f"bench_startup: no daemon row (agentvm up failed: {up.stderr.strip()[-200:]})", file=sys.stderr)
    rows["python -c pass"] = summary(measure(py, max(10, args.runs // 2)))
    mig = cgroup_migration(max(10, args.runs // 2))
    if mig:
        rows["cgroup migration"] = summary(mig)
    gv_runs = max(5, args.runs // 3)
    if runsc and rt.backend_for(gv_pol).capabilities().has("gvisor-platform"):
        rows["gvisor: bare runsc do"] = summary(measure(bare_runsc, gv_runs))
        gv_full = measure(gvisor_full, gv_runs)
        gv_start[:] = gv_start[-gv_runs:]
        rows["gvisor start-to-exit"] = summary(gv_start)
        rows["gvisor + teardown"] = summary(gv_full)
        rows["agentvm run --substrate gvisor"] = summary(measure(e2e_gvisor, gv_runs))
    else:
        print("bench_startup: no gvisor rows (runsc cannot run here: `agentvm doctor --substrate gvisor`)",
              file=sys.stderr)
    base = rows["bare bwrap"]["median_ms"]
    rbase = rows.get("gvisor: bare runsc do", {}).get("median_ms")
    for name, r in rows.items():
        r["x_bare_bwrap"] = r["median_ms"] / base
        if rbase and name.startswith(("gvisor", "agentvm run --substrate gvisor")):
            r["x_bare_runsc"] = r["median_ms"] / rbase
    shutil.rmtree(home, ignore_errors=True)

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'':32} {'median ms':>10} {'p90 ms':>8} {'x bare bwrap':>13} {'x bare runsc':>13}")
    for name, r in rows.items():
        xr = f"{r['x_bare_runsc']:13.2f}" if "x_bare_runsc" in r else f"{'':13}"
        print(f"{name:32} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} {r['x_bare_bwrap']:13.2f} {xr}")
    gate_ms = rows["agentvm run -- true"]["median_ms"] - rows["... --network none"]["median_ms"]
    print(f"gate cost per run: {gate_ms:+.2f} ms end to end, "
          f"{rows['... + gate']['median_ms'] - rows['sandbox + teardown']['median_ms']:+.2f} ms in-process (target <= 5 ms)")
    print(f"(cli: {' '.join(cli)}; targets: start-to-exit <= 1.5x bare bwrap, agentvm run -- true <= 100 ms, "
          "run via daemon <= 30 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
