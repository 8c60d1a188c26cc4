#!/usr/bin/env python3
"""Named agents' workspaces: what they cost to create, start and remove, and the disk they
hold - with baselines measured in the same run (issue 42).

    python3 bench/bench_workspaces.py [--agents N] [--size 16M] [--json]

Each named agent runs `/bin/true` through the embedded path (`agentvm run -f`'s library call),
in a private installation under /tmp that is removed at the end. Rows (rate = agents per second):

  anonymous run (baseline)  `agentvm run -- true`'s sandbox: tmpfs workspace, nothing on disk
  create + first start      a new named agent: its image made (fallocate + mkfs.ext4), checked,
                            loop-mounted, the sandbox run, the image unmounted
  start (existing)          the same agent again: its image checked and mounted, no mkfs
  rm (workspace removed)    `agentvm rm NAME` without a daemon: lock, audit record, unlink

Disk per agent (blocks the host's filesystem holds for it, st_blocks * 512):

  while it exists           each image is fully reserved (fallocate): its limits.disk
  after rm, before          agent-vm before issue 42: `rm` kept the image - N removed agents
                            still hold N * limits.disk (emulated here with --keep-workspace)
  after rm, now             `rm` removes it: 0

Ratios are against the baseline row (rates) and against "while it exists" (disk). Loops are
bounded (--agents at most 500, --size at most 256M, and the run refuses unless the filesystem
has twice what it would reserve). Run as root on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=50, help="named agents per phase (at most 500)")
    ap.add_argument("--size", default="16M", help="their limits.disk (at most 256M)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_workspaces: needs root (loop-mounted workspace images)", file=sys.stderr)
        return 77
    from agentvm.units import parse_size

    n = max(1, min(args.agents, 500))
    size = min(parse_size(args.size), 256 * MiB)
    home = Path(f"/tmp/agentvm-bench-ws-{secrets.token_hex(4)}")
    home.mkdir(mode=0o711)
    os.chmod(home, 0o711)
    os.environ["AGENTVM_HOME"] = str(home)
    os.environ["AGENTVM_NO_DAEMON"] = "1"
    free = shutil.disk_usage(home).free
    if free < 2 * n * size:
        shutil.rmtree(home, ignore_errors=True)
        print(f"bench_workspaces: {n} agents of {size // MiB}M need {2 * n * size // MiB}M free; "
              f"{free // MiB}M are", file=sys.stderr)
        return 1
    try:
        rows = run(home, n, size)
    finally:
        ws = home / "run" / "ws"
        for d in ws.glob("*") if ws.is_dir() else ():
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    base = rows["rates"]["anonymous run (baseline)"]
    print(f"{n} named agents, limits.disk {size // MiB}M, /bin/true ({os.uname().release})")
    print(f"{'':<28} {'agents/s':>9} {'ms each':>8} {'x baseline':>10}")
    for k, r in rows["rates"].items():
        print(f"{k:<28} {r:>9.1f} {1000 / r:>8.1f} {r / base:>10.2f}")
    d = rows["disk_per_agent"]
    whole = d["while it exists"] or 1
    print(f"\n{'disk per agent':<28} {'MiB':>9} {'x image':>8}")
    for k, v in d.items():
        print(f"{k:<28} {v / MiB:>9.2f} {v / whole:>8.2f}")
    print(f"\nafter {n} removed agents: before {rows['left_after_rm']['before'] / MiB:.0f} MiB left on the disk, "
          f"now {rows['left_after_rm']['now'] / MiB:.0f} MiB")
    return 0


def run(home: Path, n: int, size: int) -> dict:
    from agentvm.cli.app import cli_main
    from agentvm.policy import Policy, compile_policy
    from agentvm.runtime import Runtime
    from agentvm.spec.loader import load_agent_text

    rt = Runtime()
    ws_dir = rt.paths.workspaces
    devnull = (subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL)

    def policy(name: str):
        text = (f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                f"  command: [/bin/true]\n  limits: {{disk: {size}, timeout: 60s}}\n")
        return compile_policy(load_agent_text(text, "<bench>").spec)

    def start(pol) -> None:
        r = rt.run(pol, tty=False, stdio=devnull)
        if r.exit_code != 0:
            raise SystemExit(f"bench_workspaces: a run failed: {r}")

    def held() -> int:
        return sum(p.stat().st_blocks * 512 for p in ws_dir.glob("*.img"))

    def rm(name: str, *extra: str) -> None:
        code = _quiet(cli_main, ["rm", name, *extra])
        if code != 0:
            raise SystemExit(f"bench_workspaces: rm {name} exited {code}")

    rates: dict[str, float] = {}
    anon = Policy(name="run", command=("/bin/true",))
    start(anon)  # warm: the helper, the /etc view, seccomp
    t0 = time.perf_counter()
    for _ in range(n):
        start(anon)
    rates["anonymous run (baseline)"] = n / (time.perf_counter() - t0)

    for phase in ("before", "now"):
        pols = [policy(f"bw-{phase}-{i:03d}") for i in range(n)]
        t0 = time.perf_counter()
        for p in pols:
            start(p)
        if phase == "now":
            rates["create + first start"] = n / (time.perf_counter() - t0)
        exists = held() / n
        if phase == "now":
            t0 = time.perf_counter()
            for p in pols:
                start(p)
            rates["start (existing)"] = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in pols:
            # before: rm kept the image (as every rm did until issue 42); now: rm removes it
            rm(p.name, *(["--keep-workspace"] if phase == "before" else []))
        if phase == "now":
            rates["rm (workspace removed)"] = n / (time.perf_counter() - t0)
            left_now = held()
        else:
            left_before = held()
            for p in pols:  # clean up the emulated leftovers before the next phase
                _quiet(cli_main, ["workspace", "rm", p.name])
    return {
        "agents": n, "size": size, "rates": rates,
        "disk_per_agent": {"while it exists": exists, "after rm, before": left_before / n, "after rm, now": left_now / n},
        "left_after_rm": {"before": left_before, "now": left_now},
        "left_files": sorted(os.listdir(ws_dir)),
    }


def _quiet(fn, argv):
    with open(os.devnull, "w") as null:
        old = sys.stdout
        sys.stdout = null
        try:
            return fn(argv)
        finally:
            sys.stdout = old


if __name__ == "__main__":
    sys.exit(main())
