#!/usr/bin/env python3
"""Where an embedded `agentvm run -- true` spends its time, step by step (the table of
docs/architecture.md "Start-up budget").

    python3 bench/bench_startup_steps.py [--runs N] [--src DIR]... [--network none]

Each run is a new Python process (`python -S`, as the installed entry point starts it) that
imports the run path in four groups and calls `agentvm.cli.run_cmd.main_run(["--", "true"])`
with every lifecycle step wrapped; per step, the median wall and CPU milliseconds
(`time.process_time()`: every thread of the process, not its children). "whole process" is
measured from outside (wall, and the CPU of the process and the children it waited for).
With several `--src` (source trees, e.g. one exported with `git archive` before a change),
the trees' runs are interleaved, so drift on a shared machine hits them alike. Run as root
(dedicated uids and cgroups are part of what is measured), on a machine as quiet as you can
get; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the child: imports and steps, marks to the file named by $OUT
CHILD = r'''
import sys, time, os
T0 = time.perf_counter(); C0 = time.process_time()
marks = []
def mark(name): marks.append((name, (time.perf_counter() - T0) * 1000, (time.process_time() - C0) * 1000))
import site; site.main()
sys.path.insert(0, os.environ["SRC"])
mark("site")
import agentvm.cli.run_cmd as rc
import agentvm.errors
mark("imports: cli, errors")
import agentvm.policy, agentvm.overrides
mark("imports: policy")
import agentvm.runtime as rt
mark("imports: runtime")
import agentvm.backends.bwrap as bw
mark("imports: bwrap")
import agentvm.lifecycle as lc
def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        mark(label + ">")
        try:
            return f(*a, **k)
        finally:
            mark(label + "<")
    setattr(obj, name, w)
wrap(rt.Runtime, "__init__", "Runtime()")
wrap(rt.Runtime, "run", "run")
wrap(rt, "gc_stale", "gc_stale"); wrap(rt, "gc_logs", "gc_logs")
wrap(rt.Runtime, "_syscall_records", "syscall_records")
for n in ("prepare", "attach", "launch", "wait", "teardown", "result"):
    wrap(lc.Lifecycle, n, n)
wrap(rt.Runtime, "preflight", "preflight")
wrap(rt.Runtime, "record", "record")
wrap(rt.Runtime, "prepare", "rt.prepare")
os.environ["AGENTVM_NO_DAEMON"] = "1"
r = rc.main_run(sys.argv[1:])
mark("main_run done")
import gc; gc.freeze()
import atexit, json
def fin():
    mark("atexit")
    with open(os.environ["OUT"], "w") as f:
        json.dump(marks, f)
atexit.register(fin)
sys.exit(r)
'''

STEPS = [
    ("imports: cli, errors", "site", "imports: cli, errors"),
    ("imports: policy", "imports: cli, errors", "imports: policy"),
    ("imports: runtime", "imports: policy", "imports: runtime"),
    ("imports: bwrap", "imports: runtime", "imports: bwrap"),
    ("argv, Policy, overrides, Runtime()", "imports: bwrap", "Runtime()<"),
    ("gc_stale + gc_logs", "gc_stale>", "gc_logs<"),
    ("syscall records (audit chain opened)", "syscall_records>", "syscall_records<"),
    ("prepare: preflight", "preflight>", "preflight<"),
    ("prepare: rest of rt.prepare", "preflight<", "rt.prepare<"),
    ("prepare: run.started", "record>", "record<"),
    ("attach (gate endpoint)", "attach>", "attach<"),
    ("launch", "launch>", "launch<"),
    ("wait (the sandbox runs)", "wait>", "wait<"),
    ("teardown", "teardown>", "teardown<"),
    ("result + run.exited", "result>", "result<"),
    ("rt.close, report", "result<", "main_run done"),
    ("in-process total", None, "atexit"),
]


def one(src: str, child: Path, out: Path, extra: list[str]) -> tuple[dict, float, float]:
    env = dict(os.environ, SRC=src, OUT=str(out), AGENTVM_NO_DAEMON="1")
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-S", str(child), *extra, "--", "true"], env=env, stdin=subprocess.DEVNULL,
                   check=True)
    wall = (time.perf_counter() - t) * 1000
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000
    marks = json.loads(out.read_text())
    m: dict = {}
    for name, w, c in marks:
        m.setdefault(name, (w, c))
    # run.started: the first record after rt.prepare returned
    i = next(k for k, x in enumerate(marks) if x[0] == "rt.prepare<")
    rec = [x for x in marks[i:] if x[0] in ("record>", "record<")][:2]
    m["record>"], m["record<"] = (rec[0][1], rec[0][2]), (rec[1][1], rec[1][2])
    steps = {}
    for label, a, b in STEPS:
        wa, ca = (0.0, 0.0) if a is None else m[a]
        wb, cb = m[b]
        steps[label] = (wb - wa, cb - ca)
    return steps, wall, cpu


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _python import agentvm_python

    agentvm_python()
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--src", action="append", default=[], help="a source tree's src/ (repeat to compare)")
    ap.add_argument("--network", choices=("gate", "none"), default="gate")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_startup_steps: run as root", file=sys.stderr)
        return 2
    srcs = args.src or [str(Path(__file__).resolve().parent.parent / "src")]
    import compileall

    for s in srcs:  # bytecode as an installed agent-vm has it
        compileall.compile_dir(os.path.join(s, "agentvm"), quiet=1)
    extra = ["--network", "none"] if args.network == "none" else []
    with tempfile.TemporaryDirectory(prefix="agentvm-bench-steps-") as td:
        child = Path(td) / "child.py"
        child.write_text(CHILD)
        out = Path(td) / "marks.json"
        res = {s: {label: ([], []) for label, _, _ in STEPS} for s in srcs}
        whole = {s: ([], []) for s in srcs}
        for s in srcs:
            one(s, child, out, extra)  # warm-up: caches (the /etc view, the filter) as a second run finds them
        for _ in range(args.runs):
            for s in srcs:
                steps, wall, cpu = one(s, child, out, extra)
                for label, (w, c) in steps.items():
                    res[s][label][0].append(w)
                    res[s][label][1].append(c)
                whole[s][0].append(wall)
                whole[s][1].append(cpu)
    med = statistics.median
    print(f"{'step (median ms)':40}" + "".join(f"{'wall':>9}{'CPU':>8}  " for _ in srcs))
    for label, _, _ in STEPS:
        print(f"{label:40}" + "".join(f"{med(res[s][label][0]):9.1f}{med(res[s][label][1]):8.1f}  " for s in srcs))
    print(f"{'whole process (from outside; CPU incl. children)':40}"
          + "".join(f"{med(whole[s][0]):9.1f}{med(whole[s][1]):8.1f}  " for s in srcs))
    for i, s in enumerate(srcs):
        print(f"column {i + 1}: {s}")
    print(f"runs {args.runs} each, interleaved; network {args.network}; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs (wall is noise on a loaded machine: read the CPU columns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
