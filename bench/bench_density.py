#!/usr/bin/env python3
"""Density with most agents suspended (issue 37), measured in one run on this machine.

    sudo /opt/agentvm/venv/bin/python bench/bench_density.py [--quick] [--json]

A private installation (AGENTVM_HOME under /tmp), the ControlPlane in this process (the
daemon's own code, no HTTP), the real substrates. Parts:

  1. gVisor: one stateful Python agent suspended and resumed N times: suspend and resume
     latency p50/p99, against a cold start of the same agent measured in the same run (the
     baseline: what `stop` + `start` costs instead); the checkpoint's size on disk.
  2. bubblewrap: pause/unpause latency p50/p99 through the ControlPlane (the cgroup freezer),
     against a stop + start of the same agent.
  3. disk per suspended agent: K gVisor agents suspended at once - checkpoint bytes and
     workspace bytes each; the host afterwards holds no process of theirs.
  4. the daemon's memory: RSS of this process before and after declaring D agents (rows,
     Managed records, a sealed checkpoint record each, 90% of them in state `suspended`), and
     per running sandbox (R bwrap agents running). 5,000 declared / 500 running / 4,500
     suspended is extrapolated from the measured slopes - said so in the output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

STATEFUL = r"""
import socket, time
n = 0
f = open('/workspace/log', 'a')
s = socket.socket(); s.bind(('127.0.0.1', 8123)); s.listen()
import os
blob = os.urandom(32 << 20)   # 32 MiB of heap the checkpoint must carry (random: no zero pages to skip)
while True:
    n += 1; f.write(f'{n}\n'); f.flush(); time.sleep(0.2)
"""


def spec(name: str, substrate: str, command: list[str]) -> str:
    return textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: persistent
          substrate: {substrate}
          command: {json.dumps(command)}
          limits: {{disk: 16M}}
        """)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def du(path: Path) -> int:
    total = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(dp, f)).st_blocks * 512
            except OSError:
                pass
    return total


async def main(args) -> dict:
    from agentvm.daemon.control import ControlPlane
    from agentvm.paths import Paths

    home = Path(tempfile.mkdtemp(prefix="agentvm-bench-density-"))
    os.chmod(home, 0o755)  # (runsc's Sentry runs as nobody and walks to its run dir)
    os.environ["AGENTVM_HOME"] = str(home)
    paths = Paths(home=home / "home", runtime=home / "run")
    cp = ControlPlane(paths)
    await cp.open()
    out: dict = {"machine": f"{os.cpu_count()} cores", "notes": []}
    try:
        n = 5 if args.quick else 20
        # ---- 1. gVisor suspend/resume vs a cold start
        await cp.create(spec("g1", "gvisor", ["python3", "-c", STATEFUL]))
        cold = []
        for _ in range(2 if args.quick else 5):
            t0 = time.perf_counter()
            await cp.start_and_wait("g1")
            m = cp.managed["g1"]  # up as resume counts it: runsc reports the container running
            await asyncio.to_thread(m.backend._wait_running, m.handle)
            cold.append(time.perf_counter() - t0)
            await asyncio.sleep(0.5)
            await cp.stop("g1")
        await cp.start_and_wait("g1")
        await asyncio.sleep(1.0)
        sus, res, ck = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            a = await cp.suspend("g1")
            sus.append(time.perf_counter() - t0)
            ck.append(a["checkpoint"]["bytes"])
            t0 = time.perf_counter()
            await cp.resume_sandbox("g1")
            res.append(time.perf_counter() - t0)
            await asyncio.sleep(0.3)
        out["gvisor"] = {"cycles": n, "cold_start_p50_s": round(pct(cold, 50), 3),
                         "suspend_p50_s": round(pct(sus, 50), 3), "suspend_p99_s": round(pct(sus, 99), 3),
                         "resume_p50_s": round(pct(res, 50), 3), "resume_p99_s": round(pct(res, 99), 3),
                         "resume_vs_cold_start": round(pct(res, 50) / pct(cold, 50), 2),
                         "checkpoint_mib_p50": round(pct(ck, 50) / 2**20, 2)}
        await cp.remove("g1")
        # ---- 2. bubblewrap pause/unpause vs stop + start
        await cp.create(spec("b1", "bwrap", ["sleep", "3600"]))
        await cp.start_and_wait("b1")
        pa, un = [], []
        for _ in range(n * 5):
            t0 = time.perf_counter()
            await cp.pause("b1")
            pa.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await cp.unpause("b1")
            un.append(time.perf_counter() - t0)
        restart = []
        for _ in range(2 if args.quick else 5):
            t0 = time.perf_counter()
            await cp.stop("b1")
            await cp.start_and_wait("b1")
            restart.append(time.perf_counter() - t0)
        out["bwrap"] = {"cycles": n * 5, "pause_p50_ms": round(pct(pa, 50) * 1000, 2),
                        "pause_p99_ms": round(pct(pa, 99) * 1000, 2), "unpause_p50_ms": round(pct(un, 50) * 1000, 2),
                        "unpause_p99_ms": round(pct(un, 99) * 1000, 2),
                        "stop_start_p50_ms": round(pct(restart, 50) * 1000, 1),
                        "unpause_vs_stop_start": round(pct(un, 50) / pct(restart, 50), 4),
                        "suspend": "refused (backend.suspend-unsupported)"}
        await cp.remove("b1")
        # ---- 3. disk per suspended agent (K gVisor agents suspended at once)
        k = 3 if args.quick else 10
        names = [f"gs{i}" for i in range(k)]
        for nm in names:
            await cp.create(spec(nm, "gvisor", ["python3", "-c", STATEFUL]))
            await cp.start_and_wait(nm)
        await asyncio.sleep(1.0)
        for nm in names:
            await cp.suspend(nm)
        ck_bytes = du(paths.home / "checkpoints") / k
        pool_bytes = du(paths.workspaces) if paths.workspaces.exists() else 0
        left = [p for p in os.listdir("/proc") if p.isdigit() and any(
            nm.encode() in _cmdline(p) for nm in names)]
        out["suspended_disk"] = {"agents": k, "checkpoint_mib_each": round(ck_bytes / 2**20, 2),
                                 "workspace_pool_allocated_mib_shared": round(pool_bytes / 2**20, 1),
                                 "host_processes_left": len(left),
                                 "extrapolated_4500_checkpoints_gib": round(4500 * ck_bytes / 2**30, 2)}
        out["notes"].append("the workspace is not counted per agent: the btrfs pool is one image shared by all "
                            "(its allocation is shown); an idle agent's workspace adds what it wrote")
        for nm in names:
            await cp.remove(nm)
        # ---- 4. the daemon's memory: declared (mostly suspended) and running
        from agentvm import checkpoint
        from agentvm.daemon.supervisor import Managed

        d = 500 if args.quick else 5000
        rss0 = rss_mib()
        t0 = time.perf_counter()
        img = checkpoint.make_private_dir(paths.home / "checkpoints" / "_bench" / "x")
        (img / "checkpoint.img").write_bytes(b"\0")
        for i in range(d):
            nm = f"decl-{i}"
            await cp.create(spec(nm, "gvisor", ["python3", "-c", "pass"]))
            cp.managed[nm] = Managed(nm)
            if i % 10:  # 90% suspended (rows and checkpoint records; their images are part 3's)
                for st in ("starting", "running", "suspended"):
                    cp.state.update(nm, state=st)
                cp.checkpoints.put(checkpoint.seal(nm, nm + "-0", "gvisor", "0" * 64, img))
        declare_s = time.perf_counter() - t0
        rss1 = rss_mib()
        t0 = time.perf_counter()
        cp.sandboxes()  # `agentvm ps` over all of them
        ps_s = time.perf_counter() - t0
        r = 5 if args.quick else 20
        run_names = [f"run-{i}" for i in range(r)]
        for nm in run_names:
            await cp.create(spec(nm, "bwrap", ["sleep", "3600"]))
            await cp.start_and_wait(nm)
        rss2 = rss_mib()
        per_declared_kib = (rss1 - rss0) * 1024 / d
        per_running_kib = (rss2 - rss1) * 1024 / r
        est = rss0 + (5000 * per_declared_kib + 500 * per_running_kib) / 1024
        out["daemon_memory"] = {"rss_start_mib": round(rss0, 1), "declared": d, "rss_after_declared_mib": round(rss1, 1),
                                "per_declared_kib": round(per_declared_kib, 2), "running": r,
                                "rss_after_running_mib": round(rss2, 1), "per_running_kib": round(per_running_kib, 1),
                                "declare_seconds": round(declare_s, 1), "ps_all_seconds": round(ps_s, 3),
                                "extrapolated_5000_declared_500_running_mib": round(est, 1),
                                "target_mib": 300}
        out["notes"].append("5,000/500/4,500 is extrapolated from the slopes measured here (declared rows + Managed "
                            "+ checkpoint records; R bwrap sandboxes running), not run whole: 500 sandboxes do not "
                            "fit 10 minutes of a 2-core machine shared with others")
        for nm in run_names:
            await cp.stop(nm)
    except BaseException:
        for lg in sorted((paths.home / "logs").glob("*.log"))[:3]:
            print(f"--- {lg.name}:", lg.read_text()[-1500:], file=sys.stderr)
        raise
    finally:
        await cp.close()
        shutil.rmtree(home, ignore_errors=True)
    return out


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_density needs root (dedicated uids, cgroups, runsc)")
    res = asyncio.run(main(a))
    print(json.dumps(res, indent=2))
