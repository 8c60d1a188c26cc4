#!/usr/bin/env python3
"""The syscall audit's cost on a syscall-heavy workload that makes no denied calls, against
today's silent deny list, measured in the same run (interleaved rounds).

    python3 bench/bench_syscall_audit.py [--rounds N] [--files N] [--json]

Each round runs, in a real bwrap sandbox, the same script twice - once with the notify
filter (the default) and once with ``--degrade syscall-audit`` (the plain deny list, what ran
before) - in alternating order. The script times its own workload (so sandbox start-up is
not in the numbers):

  git status   ``git status --porcelain`` x5 on a fresh repository of N files (lstat/open/
               read/mmap-heavy; ~N*10 syscalls per pass)
  cc           compiling a 200-function C file with gcc -O1 x3 (fork/exec/mmap/read/write)
  probes       1000 refused ``unshare()`` calls (the price of a *denied* call, for context:
               the notify filter adds one round trip to the supervisor per call)

Prints, per workload and filter, the minimum and median of wall time and of the sandboxed
processes' CPU time (user+system, less sensitive to other load), and the ratios notify/plain;
ratios within the spread of the plain rows are noise. Run as root on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
set -e
cd /tmp
python3 - "$1" <<'EOF'
import os, subprocess, sys, time, ctypes
n = int(sys.argv[1])
os.makedirs("/tmp/repo", exist_ok=True)
os.chdir("/tmp/repo")
subprocess.run(["git", "init", "-q"], check=True)
for i in range(n):
    d = f"d{i % 50}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}.txt", "w") as fh:
        fh.write(f"{i}\n")
env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@b")
subprocess.run(["git", "add", "-A"], check=True, env=env)
subprocess.run(["git", "commit", "-qm", "x"], check=True, env=env)
def cpu():
    t = os.times()
    return t.children_user + t.children_system + t.user + t.system
t, c = time.perf_counter(), cpu()
for _ in range(5):
    subprocess.run(["git", "status", "--porcelain"], check=True, stdout=subprocess.DEVNULL)
print("git_status", time.perf_counter() - t, cpu() - c)
src = "\n".join(f"int f{i}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += k * {i}; return s; }}" for i in range(200))
open("/tmp/c.c", "w").write(src + "\nint main(void) { return f1(3) == 3 ? 0 : 1; }\n")
t, c = time.perf_counter(), cpu()
for _ in range(3):
    subprocess.run(["gcc", "-O1", "-c", "/tmp/c.c", "-o", "/tmp/c.o"], check=True)
print("cc", time.perf_counter() - t, cpu() - c)
libc = ctypes.CDLL(None)
t, c = time.perf_counter(), cpu()
for _ in range(1000):
    libc.unshare(0x10000000)
print("probes", time.perf_counter() - t, cpu() - c)
EOF
"""


def run_once(home: str, files: int, notify: bool) -> dict[str, tuple[float, float]]:
    env = dict(os.environ, AGENTVM_HOME=home)
    argv = [sys.executable, "-m", "agentvm", "run", "--network", "none"]
    if not notify:
        argv += ["--degrade", "syscall-audit"]
    argv += ["--", "/bin/sh", "-c", SCRIPT, "sh", str(files)]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    out = {}
    for ln in r.stdout.splitlines():
        k, _, v = ln.partition(" ")
        if k in ("git_status", "cc", "probes"):
            wall, cpu = v.split()
            out[k] = (float(wall), float(cpu))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (the sandbox runs as a dedicated uid)")
    for tool in ("git", "gcc"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is needed inside the sandbox (the host's /usr)")
    home = tempfile.mkdtemp(prefix=f"agentvm-bench-sysaudit-{secrets.token_hex(3)}-", dir="/tmp")
    os.chmod(home, 0o711)
    rows: dict[str, dict[str, list[tuple[float, float]]]] = {"notify": {}, "plain": {}}
    try:
        for i in range(a.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for notify in order:
                res = run_once(home, a.files, notify)
                for k, v in res.items():
                    rows["notify" if notify else "plain"].setdefault(k, []).append(v)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report = {}
    for k in ("git_status", "cc", "probes"):
        for i, what in ((0, "wall"), (1, "cpu")):
            n = [x[i] for x in rows["notify"][k]]
            p = [x[i] for x in rows["plain"][k]]
            report[f"{k} {what}"] = {
                "plain_min_s": min(p), "notify_min_s": min(n), "ratio_min": min(n) / max(min(p), 1e-9),
                "plain_median_s": statistics.median(p), "notify_median_s": statistics.median(n),
                "ratio_median": statistics.median(n) / max(statistics.median(p), 1e-9),
                "plain_spread": (max(p) - min(p)) / max(statistics.median(p), 1e-9), "rounds": len(n)}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'workload':<17} {'plain min':>10} {'notify min':>11} {'ratio':>6} {'plain med':>10} {'notify med':>11} "
          f"{'ratio':>6} {'plain spread':>13}")
    for k, r in report.items():
        print(f"{k:<17} {r['plain_min_s']:>10.4f} {r['notify_min_s']:>11.4f} {r['ratio_min']:>6.3f} "
              f"{r['plain_median_s']:>10.4f} {r['notify_median_s']:>11.4f} {r['ratio_median']:>6.3f} "
              f"{r['plain_spread'] * 100:>12.1f}%")
    print(f"({a.rounds} interleaved rounds, {a.files} files; probes = 1000 refused unshare() calls; cpu = the "
          "sandboxed processes' user+system time; min is the least disturbed by other load on the host)")


if __name__ == "__main__":
    main()
