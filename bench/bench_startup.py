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
  agentvm run -- true    the whole CLI, end to end, as a user types it (new Python process),
                         embedded (AGENTVM_NO_DAEMON=1; target: <= 60 ms median), through the
                         compiled entry point built from this source tree (as installed); the default
                         routes through the gate. Interleaved with bare bwrap and python -c pass,
                         each with its CPU time (children's user + system): on a shared machine
                         wall time is noise, CPU time much less so
  ... --network none     the same with no route at all (no gate): the gate's cost is the
                         difference between these two rows (target: <= 5 ms)
  run via daemon         `agentvm run -- true` with a daemon up: the CLI is a thin client
                         (the compiled entry point; target: <= 20 ms median); the daemon runs
                         the same lifecycle
  run via daemon, stdin a pipe
                         `echo | agentvm run -- true` with a daemon up: the compiled client
                         relays the pipe in an interactive session (POST /v1/run/attach,
                         docs/daemon.md); before, a pipe on stdin fell back to the embedded run
                         (the row "embedded, stdin a pipe" is that old path, same run). Target
                         <= 20 ms median; interleaved with "run via daemon" (stdin /dev/null) as
                         the same-run baseline. `--daemon-only` measures just these rows; the
                         client is built from src/agentvm/native/agentvm-client.c into the
                         bench's home when gcc is there (the source as it is, not an old install)
  quiet start, no warm-up / cgroup warm-up
                         the lifecycle in-process (prepare with run.started, attach, launch, wait),
                         each after 50 ms of quiet (as a CLI start is), without and with the
                         backend's warm-up (bwrap.MigrationWarmup, which Lifecycle.prepare starts):
                         the first cgroup migration's RCU grace period paid while the run is
                         prepared, or on the critical path (interleaved). The CLI's lead is longer
                         (its prepare pays the imports too): there the helper's move no longer
                         waits at all (strace: 7-17 ms -> 0.03 ms)
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


def measure(fn, runs: int, warmup: int = 3, cpu: list[float] | None = None) -> list[float]:
    """Wall milliseconds of ``runs`` calls of ``fn``; with ``cpu``, each call's CPU milliseconds
    (user + system of the child processes it waited for: what a shared machine cannot inflate
    the way it inflates wall time) are appended to it."""
    import resource

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
        if cpu is not None:
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000)
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
    ap.add_argument("--daemon-only", action="store_true", help="only the rows through a daemon (stdin /dev/null "
                    "and a pipe) and their embedded baseline")
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

    if args.daemon_only:
        rows = daemon_stdin_rows(home, args.runs)
        shutil.rmtree(home, ignore_errors=True)
        return print_daemon_rows(rows, args.json)
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

    # the compiled entry point built from this source tree, as scripts/install.sh lays it out
    # (with AGENTVM_NO_DAEMON=1 it execs `python -S` on the lean Python entry): what an
    # installed agent-vm runs, whatever state this machine's install is in; else the entry
    # point next to this interpreter (a venv's), never a pyenv shim
    entry = Path(sys.executable).parent / "agentvm"
    cli = compiled_client(home) or ([str(entry)] if entry.exists() else [sys.executable, "-m", "agentvm"])

    # embedded, whatever the caller's environment says: this row is the Python CLI doing it all
    embedded = dict(os.environ, AGENTVM_NO_DAEMON="1")

    def e2e():
        r = subprocess.run(cli + ["run", "--", "/bin/true"], stdin=subprocess.DEVNULL, env=embedded)
        assert r.returncode == 0

    def e2e_none():
        r = subprocess.run(cli + ["run", "--network", "none", "--", "/bin/true"], stdin=subprocess.DEVNULL,
                           env=embedded)
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

    # the first cgroup migration of a start after a quiet moment waits for an RCU grace period
    # unless the warm-up Lifecycle.prepare starts (bwrap.MigrationWarmup) paid it while the run
    # was being prepared: the lifecycle's prepare (run.started on the chain included) + attach +
    # launch + wait, each after 50 ms of quiet, with the backend's warm-up and without it,
    # interleaved. (The CLI's lead is longer than this: its prepare pays the imports too.)
    from agentvm.lifecycle import EmbeddedGateHost, Lifecycle

    prewarm = backend.prewarm_launch

    def quiet_start(warm: bool, out: list[float]):
        backend.prewarm_launch = prewarm if warm else (lambda: (lambda: None))
        try:
            time.sleep(0.05)
            lc = Lifecycle(rt, EmbeddedGateHost(rt))
            t = time.perf_counter()
            s = lc.prepare(pol)
            lc.attach(s)
            lc.launch(s, (subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL))
            lc.wait(s)
            out.append((time.perf_counter() - t) * 1000)
            lc.teardown(s)
            assert lc.result(s).exit_code == 0
        finally:
            backend.prewarm_launch = prewarm

    rows = {}
    rows["bare bwrap"] = summary(measure(bare, args.runs))
    cold: list[float] = []
    warmed: list[float] = []
    for _ in range(max(10, args.runs // 2)):
        quiet_start(False, cold)
        quiet_start(True, warmed)
    rows["quiet start, no warm-up"] = summary(cold)
    rows["quiet start, cgroup warm-up"] = summary(warmed)
    full = measure(sandbox_full, args.runs)
    start_exit[:] = start_exit[-args.runs :]
    rows["sandbox start-to-exit"] = summary(start_exit)
    rows["sandbox + teardown"] = summary(full)
    rows["... + gate"] = summary(measure(sandbox_gated, args.runs))
    # interleaved with bare bwrap and python -c pass, so drift on a shared machine hits every
    # row alike; CPU time (children's user + system) beside wall time
    a: list[float] = []
    b: list[float] = []
    bw: list[float] = []
    pc: list[float] = []
    cpu = {"agentvm run -- true": [], "... --network none": [], "bare bwrap (interleaved)": [],
           "python -c pass": []}
    for _ in range(max(10, args.runs // 2)):
        a += measure(e2e, 1, warmup=0, cpu=cpu["agentvm run -- true"])
        bw += measure(bare, 1, warmup=0, cpu=cpu["bare bwrap (interleaved)"])
        b += measure(e2e_none, 1, warmup=0, cpu=cpu["... --network none"])
        pc += measure(py, 1, warmup=0, cpu=cpu["python -c pass"])
    rows["agentvm run -- true"] = summary(a)
    rows["... --network none"] = summary(b)
    rows["bare bwrap (interleaved)"] = summary(bw)
    rows["python -c pass"] = summary(pc)
    for name, xs in cpu.items():
        rows[name]["cpu_median_ms"] = statistics.median(xs)
        rows[name]["cpu_p90_ms"] = sorted(xs)[int(0.9 * (len(xs) - 1))]
    # through a daemon (a private one in this bench's home): the CLI as a thin client
    env = dict(os.environ, AGENTVM_NO_DAEMON="0")
    up = subprocess.run(cli + ["up"], env=env, capture_output=True, text=True)
    if up.returncode == 0:
        def via_daemon():
            r = subprocess.run(cli + ["run", "--", "/bin/true"], stdin=subprocess.DEVNULL, env=env)
            assert r.returncode == 0

        try:
            rows["run via daemon"] = summary(measure(via_daemon, args.runs))
        except AssertionError:
            print("bench_startup: no daemon row: a run through the daemon failed (its error is above)",
                  file=sys.stderr)
        finally:
            subprocess.run(cli + ["down"], env=env, capture_output=True)
    else:
        print(f"bench_startup: no daemon row (agentvm up failed: {up.stderr.strip()[-200:]})", file=sys.stderr)
    try:
        rows.update(daemon_stdin_rows(home, args.runs))
    except AssertionError:
        print("bench_startup: no daemon stdin rows: a run through the daemon failed (its error is above)",
              file=sys.stderr)
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
    print(f"{'':32} {'median ms':>10} {'p90 ms':>8} {'x bare bwrap':>13} {'x bare runsc':>13} {'CPU ms':>8}")
    for name, r in rows.items():
        xr = f"{r['x_bare_runsc']:13.2f}" if "x_bare_runsc" in r else f"{'':13}"
        c = f"{r['cpu_median_ms']:8.1f}" if "cpu_median_ms" in r else ""
        print(f"{name:32} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} {r['x_bare_bwrap']:13.2f} {xr} {c}")
    run = rows["agentvm run -- true"]
    bb = rows["bare bwrap (interleaved)"]
    print(f"agentvm run -- true (embedded, AGENTVM_NO_DAEMON=1): {run['median_ms']:.1f} ms median wall "
          f"(target <= 60 ms: {'met' if run['median_ms'] <= 60 else 'NOT met'}), {run['cpu_median_ms']:.1f} ms CPU; "
          f"bare bwrap in the same run {bb['median_ms']:.1f} ms wall, {bb['cpu_median_ms']:.1f} ms CPU "
          f"({run['median_ms'] / bb['median_ms']:.1f}x); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"cgroup warm-up: {rows['quiet start, no warm-up']['median_ms'] - rows['quiet start, cgroup warm-up']['median_ms']:+.2f} "
          "ms off a start after a quiet moment (the lifecycle in-process, interleaved)")
    gate_ms = rows["agentvm run -- true"]["median_ms"] - rows["... --network none"]["median_ms"]
    print(f"gate cost per run: {gate_ms:+.2f} ms end to end, "
          f"{rows['... + gate']['median_ms'] - rows['sandbox + teardown']['median_ms']:+.2f} ms in-process (target <= 5 ms)")
    print(f"(cli: {' '.join(cli)}; targets: start-to-exit <= 1.5x bare bwrap, agentvm run -- true <= 60 ms, "
          "run via daemon <= 20 ms)")
    return 0


def compiled_client(home: Path) -> list[str] | None:
    """The compiled entry point built from the source as it is (None without gcc)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    root = Path(__file__).resolve().parent.parent
    py_entry = home / "agentvm-py"  # as scripts/install.sh writes it, for this source tree
    py_entry.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.append({str(root / 'src')!r})\n"
                        "from agentvm.cli import main\nsys.exit(main())\n")
    py_entry.chmod(0o755)
    exe = home / "agentvm-client"
    src = root / "src" / "agentvm" / "native" / "agentvm-client.c"
    r = subprocess.run([gcc, "-O2", "-o", str(exe), f'-DAGENTVM_PYTHON="{sys.executable}"',
                        f'-DAGENTVM_PY_ENTRY="{py_entry}"', str(src)], capture_output=True)
    return [str(exe)] if r.returncode == 0 else None


def daemon_stdin_rows(home: Path, runs: int) -> dict:
    """`agentvm run -- true` through a daemon with stdin /dev/null and a pipe (interleaved),
    and the embedded run with a pipe (the path a pipe took before interactive sessions)."""
    entry = Path(sys.executable).parent / "agentvm"
    cli = compiled_client(home) or ([str(entry)] if entry.exists() else [sys.executable, "-m", "agentvm"])
    env = dict(os.environ, AGENTVM_NO_DAEMON="0")
    embedded = dict(os.environ, AGENTVM_NO_DAEMON="1")
    up = subprocess.run(cli + ["up"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        print(f"bench_startup: no daemon rows (agentvm up failed: {up.stderr.strip()[-200:]})", file=sys.stderr)
        return {}

    def null():
        assert subprocess.run(cli + ["run", "--", "/bin/true"], stdin=subprocess.DEVNULL, env=env).returncode == 0

    def pipe():
        assert subprocess.run(cli + ["run", "--", "/bin/true"], input=b"x\n", env=env).returncode == 0

    def pipe_embedded():
        assert subprocess.run(cli + ["run", "--", "/bin/true"], input=b"x\n", env=embedded).returncode == 0

    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    cpu: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    try:
        for f in (null, pipe, pipe_embedded):
            measure(f, 0, warmup=2)
        for i in range(runs):
            a += measure(null, 1, warmup=0, cpu=cpu["a"])
            b += measure(pipe, 1, warmup=0, cpu=cpu["b"])
            if i % 3 == 0:
                c += measure(pipe_embedded, 1, warmup=0, cpu=cpu["c"])
    finally:
        subprocess.run(cli + ["down"], env=env, capture_output=True)
    rows = {"run via daemon": summary(a), "run via daemon, stdin a pipe": summary(b),
            "embedded, stdin a pipe (before)": summary(c)}
    for r, k in zip(rows.values(), "abc"):
        r["x_daemon_devnull"] = r["median_ms"] / rows["run via daemon"]["median_ms"]
        r["client_cpu_median_ms"] = statistics.median(cpu[k])  # the client's (and an embedded run's) own CPU
    rows["run via daemon"]["client"] = " ".join(cli)
    return rows


def print_daemon_rows(rows: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'':34} {'median ms':>10} {'p90 ms':>8} {'x via daemon (/dev/null)':>25} {'client CPU ms':>14}")
    for name, r in rows.items():
        print(f"{name:34} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} {r['x_daemon_devnull']:25.2f} "
              f"{r['client_cpu_median_ms']:14.2f}")
    if rows:
        p = rows["run via daemon, stdin a pipe"]["median_ms"]
        print(f"stdin a pipe through the daemon: {p:.1f} ms median (target <= 20 ms: {'met' if p <= 20 else 'NOT met'}); "
              f"client {rows['run via daemon']['client']}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
