#!/usr/bin/env python3
"""Named agents' workspaces: what they cost to create, start and remove, and the disk they
hold, for both backends in the same run, against a baseline measured in the same run (issue 42).

    python3 bench/bench_workspaces.py [--agents N] [--size 16M] [--declared M] [--json]

Each named agent runs a command that writes 64 KiB into its workspace, through the embedded path
(`agentvm run -f`'s library call), in a private installation under /tmp removed at the end.
Rates (agents per second), per backend (AGENTVM_WORKSPACE_BACKEND=image | pool), and "pool-held":
the pool again, with the hold the daemon keeps for its lifetime (``workspace.keep_pool``): the pool
stays mounted between runs and removals (before/after of that change, in the same run):

  anonymous run (baseline)  `agentvm run -- true`'s sandbox: tmpfs workspace, nothing on disk
  create + first start      a new named agent: its workspace made (image: fallocate + mkfs.ext4 +
                            loop mount; pool: a subvolume and its quota group), the sandbox run
  start (existing)          the same agent again, nothing else running (the pool is mounted and
                            unmounted around each run: an idle host holds no mount)
  start (another runs)      the same, while another agent runs (the pool stays mounted)
  rm (another runs)         `agentvm rm NAME` without a daemon (lock, audit record, removal) for
                            half of them, while another agent runs
  rm (workspace removed)    the other half, nothing else running

Disk per agent: what the host's filesystem holds for the workspaces (st_blocks of the images, or
of the pool's one image) divided by the agents, while they exist and after rm; loop devices used.

Density (--declared M): M workspaces made and released in the pool without a sandbox (what a
declared agent's workspace costs once it has run: its subvolume, its quota group, 64 KiB of
data), then removed; from the measured cost per declared agent: how many declared agents fit in
this host's free space (above the pool's host reserve), against the image backend's limits.disk
each (fully reserved). Running agents are bounded by the admission rule, not by this: at
overcommit 1, by the host's room / limits.disk.

Loops are bounded (--agents at most 500, --declared at most 10000, --size at most 256M; the run
refuses unless the filesystem has twice what the image phase would reserve). Run as root.
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
HELD = "pool-held"  # the pool with the daemon's hold (workspace.keep_pool), in the same run as "pool"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=50, help="named agents per phase (at most 500)")
    ap.add_argument("--size", default="16M", help="their limits.disk (at most 256M)")
    ap.add_argument("--declared", type=int, default=1000, help="pool workspaces made for the density estimate (0: skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_workspaces: needs root (loop-mounted workspace filesystems)", file=sys.stderr)
        return 77
    from agentvm import wspool
    from agentvm.units import parse_size

    n = max(1, min(args.agents, 500))
    size = min(parse_size(args.size), 256 * MiB)
    declared = max(0, min(args.declared, 10000))
    home = Path(f"/tmp/agentvm-bench-ws-{secrets.token_hex(4)}")
    home.mkdir(mode=0o711)
    os.chmod(home, 0o711)
    os.environ["AGENTVM_HOME"] = str(home)
    os.environ["AGENTVM_NO_DAEMON"] = "1"
    for k in ("AGENTVM_WORKSPACE_POOL", "AGENTVM_WORKSPACE_OVERCOMMIT", "AGENTVM_WORKSPACE_BACKEND"):
        os.environ.pop(k, None)
    free = shutil.disk_usage(home).free
    if free < 2 * n * size:
        shutil.rmtree(home, ignore_errors=True)
        print(f"bench_workspaces: {n} agents of {size // MiB}M need {2 * n * size // MiB}M free; "
              f"{free // MiB}M are", file=sys.stderr)
        return 1
    backends = ["image"] + (["pool", HELD] if wspool.supported()[0] else [])
    try:
        rows = run(home, n, size, backends, declared)
    finally:
        ws = home / "run" / "ws"
        for d in ws.glob("*") if ws.is_dir() else ():
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        wspool.Pool(home / "workspaces", home / "run").teardown()
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    report(rows, backends, n, size)
    return 0


def report(rows: dict, backends: list[str], n: int, size: int) -> None:
    base = rows["baseline"]
    print(f"{n} named agents per backend, limits.disk {size // MiB}M, 64 KiB written each ({os.uname().release})")
    print(f"anonymous run (baseline): {base:.1f}/s ({1000 / base:.1f} ms each)\n")
    others = backends[1:]
    print(f"{'agents/s':<24} " + " ".join(f"{b:>9} {'x base':>7}" for b in backends)
          + "".join(f" {b + '/image':>16}" for b in others)
          + (f" {HELD + '/pool':>15}" if HELD in backends else ""))
    for k in rows[backends[0]]["rates"]:
        vals = {b: rows[b]["rates"][k] for b in backends}
        print(f"{k:<24} " + " ".join(f"{v:>9.1f} {v / base:>7.2f}" for v in vals.values())
              + "".join(f" {vals[b] / vals['image']:>16.2f}" for b in others)
              + (f" {vals[HELD] / vals['pool']:>15.2f}" if HELD in backends else ""))
    print(f"\n{'disk per agent (MiB)':<24} " + " ".join(f"{b:>9}" for b in backends))
    for k in rows[backends[0]]["disk_per_agent"]:
        print(f"{k:<24} " + " ".join(f"{rows[b]['disk_per_agent'][k] / MiB:>9.2f}" for b in backends))
    print(f"{'loop devices at peak':<24} " + " ".join(f"{rows[b]['loops_peak']:>9}" for b in backends))
    d = rows.get("density")
    if d:
        print(f"\ndensity: {d['declared']} pool workspaces made in {d['create_s']:.1f}s ({d['create_rate']:.0f}/s), "
              f"removed in {d['rm_s']:.1f}s ({d['rm_rate']:.0f}/s); {d['bytes_per_agent'] / 1024:.0f} KiB of pool "
              f"per declared agent (its subvolume, quota group, 64 KiB of data)")
        print(f"host room for workspaces: {d['host_room'] / (1 << 30):.1f} GiB -> declared agents that fit: "
              f"pool {d['fit_pool']:,}; images of {size // MiB}M {d['fit_image']:,}; images of 1G (the default "
              f"limits.disk) {d['fit_image_1g']:,}. Running at once (admission, overcommit 1): {d['running_1g']:,} "
              f"of 1G or {d['running_size']:,} of {size // MiB}M")


def run(home: Path, n: int, size: int, backends: list[str], declared: int) -> dict:
    import contextlib

    from agentvm import workspace
    from agentvm.cli.app import cli_main
    from agentvm.policy import Policy, compile_policy
    from agentvm.runtime import Runtime
    from agentvm.spec.loader import load_agent_text

    rt = Runtime()
    ws_dir = rt.paths.workspaces
    devnull = (subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL)

    def policy(name: str):
        text = (f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                f"  command: [/bin/sh, -c, 'head -c 65536 /dev/urandom > /workspace/f']\n"
                f"  limits: {{disk: {size}, timeout: 60s}}\n")
        return compile_policy(load_agent_text(text, "<bench>").spec)

    def start(pol) -> None:
        r = rt.run(pol, tty=False, stdio=devnull)
        if r.exit_code != 0:
            raise SystemExit(f"bench_workspaces: a run failed: {r}")

    def held() -> int:
        # (pathlib's "*" matches dot files: the pool's image once, not twice)
        return sum(p.stat().st_blocks * 512 for p in set(ws_dir.glob("*.img")) | set(ws_dir.glob(".pool.img")))

    def loops() -> int:
        r = subprocess.run(["losetup", "-a"], capture_output=True, text=True)
        return sum(1 for x in r.stdout.splitlines() if str(home) in x)

    def rm(name: str) -> None:
        code = _quiet(cli_main, ["rm", name])
        if code != 0:
            raise SystemExit(f"bench_workspaces: rm {name} exited {code}")

    out: dict = {"agents": n, "size": size}
    anon = Policy(name="run", command=("/bin/true",))
    start(anon)  # warm: the helper, the /etc view, seccomp
    t0 = time.perf_counter()
    for _ in range(n):
        start(anon)
    out["baseline"] = n / (time.perf_counter() - t0)

    phases = _phases_factory(rt, ws_dir, policy, start, held, loops, rm)
    for backend in backends:
        os.environ["AGENTVM_WORKSPACE_BACKEND"] = "pool" if backend.startswith("pool") else backend
        with contextlib.ExitStack() as daemon_hold:
            if backend == HELD:  # what the daemon does for its lifetime (daemon/server.py)
                daemon_hold.enter_context(workspace.keep_pool(ws_dir, rt.paths.runtime))
            out[backend] = phases(backend, n)
        if backend == HELD and wspool_pool(home).exists():
            raise SystemExit("bench_workspaces: the pool outlived its last workspace under the daemon's hold")
    os.environ.pop("AGENTVM_WORKSPACE_BACKEND", None)
    if declared > 1 and "pool" in backends:
        out["density"] = density(rt, declared, size)
    return out


def wspool_pool(home: Path):
    from agentvm import wspool

    return wspool.Pool(home / "workspaces", home / "run")


def _phases_factory(rt, ws_dir, policy, start, held, loops, rm):
    import contextlib

    from agentvm import workspace

    def phases(backend: str, n: int) -> dict:
        rates: dict[str, float] = {}
        pols = [policy(f"bw-{backend}-{i:03d}") for i in range(n)]
        t0 = time.perf_counter()
        for p in pols:
            start(p)
        rates["create + first start"] = n / (time.perf_counter() - t0)
        exists = held() / n
        peak_loops = 0
        t0 = time.perf_counter()
        for p in pols:
            start(p)
        rates["start (existing)"] = n / (time.perf_counter() - t0)
        peak_loops = loops()  # (the last agent's still attached, if any: images detach at stop)
        with contextlib.ExitStack() as held_open:
            if backend == "pool":
                # as while any other agent runs: the pool stays mounted between these starts
                held_open.enter_context(workspace.pool_open(ws_dir, rt.paths.runtime))
            t0 = time.perf_counter()
            for p in pols:
                start(p)
            rates["start (another runs)"] = n / (time.perf_counter() - t0)
            half = pols[: n // 2]
            t0 = time.perf_counter()
            for p in half:
                rm(p.name)
            rates["rm (another runs)"] = len(half) / (time.perf_counter() - t0) if half else 0.0
        t0 = time.perf_counter()
        rest = pols[n // 2:]
        for p in rest:
            rm(p.name)
        rates["rm (workspace removed)"] = len(rest) / (time.perf_counter() - t0)
        return {"rates": rates, "disk_per_agent": {"while they exist": exists, "after rm": held() / n},
                "loops_peak": max(peak_loops, 1), "left_files": sorted(os.listdir(ws_dir))}

    return phases


def density(rt, m: int, size: int) -> dict:
    """``m`` workspaces made in the pool (as a first start makes them), 64 KiB written in each,
    released; the pool's use per workspace; then removed. The pool is held mounted throughout
    (as while any agent runs; an idle pool is unmounted between users)."""
    from agentvm import workspace, wspool

    ws, runtime = rt.paths.workspaces, rt.paths.runtime
    uid = 3_900_000
    blob = os.urandom(65536)
    lease = workspace.acquire(ws, runtime, "bd-first", uid=uid, gid=uid, size=size, enforce_quota=True)
    lease.release()
    with workspace.pool_open(ws, runtime) as pool:
        pool.sync()
        s0, f0 = pool.space()
        t0 = time.perf_counter()
        for i in range(m):
            lease = workspace.acquire(ws, runtime, f"bd-{i:05d}", uid=uid, gid=uid, size=size, enforce_quota=True)
            (lease.host_dir / "f").write_bytes(blob)
            lease.release()
        create_s = time.perf_counter() - t0
        pool.sync()
        s1, f1 = pool.space()
        reserved = pool.img.stat().st_blocks * 512
        t0 = time.perf_counter()
        for i in range(m):
            workspace.remove_workspace(ws, f"bd-{i:05d}", runtime=runtime)
        rm_s = time.perf_counter() - t0
    workspace.remove_workspace(ws, "bd-first", runtime=runtime)
    per = max(1, ((s1 - f1) - (s0 - f0)) // m)
    v = os.statvfs(ws if ws.exists() else ws.parent)
    free = v.f_bavail * v.f_frsize
    room = max(0, free - wspool.host_reserve(v.f_blocks * v.f_frsize))
    return {"declared": m, "create_s": create_s, "create_rate": m / create_s, "rm_s": rm_s,
            "rm_rate": m / rm_s if rm_s else 0.0, "bytes_per_agent": per, "pool_reserved": reserved,
            "host_room": room, "fit_pool": room // per, "fit_image": room // size, "fit_image_1g": room // (1 << 30),
            "running_1g": room // (1 << 30), "running_size": room // size}


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
