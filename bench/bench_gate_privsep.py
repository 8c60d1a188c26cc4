#!/usr/bin/env python3
"""The cost of the gate's privilege separation (issue 43), per request, measured in one run.

    python3 bench/bench_gate_privsep.py [--quick] [--json] [--sandboxes K] [--conc C]

Three layouts serve the same K sandbox endpoints, the same policy and the same load (bench_gate.py's
load generators and fixed-answer upstream, on loopback), in interleaved rounds (medians printed):

  in-daemon gate      agentvm.gate.server.Gate in the host process (the default without --gate-workers)
  unconfined worker   WorkerPool(1, confine=None): one worker process, root, the daemon's namespace
  confined worker     WorkerPool(1, confine="auto"): the same worker confined (agentvm.gate.confine:
                      own mount namespace, its own uid, no capabilities, Landlock, seccomp allowlist)

Printed per layout: req/s, p50/p99 latency, the gate's CPU per request (every gate process plus the
host's share) - and the ratios confined/unconfined (what confinement costs: seccomp's filter runs
on every system call, Landlock on every open) and confined/in-daemon (what the whole separation
costs: the record channel, the extra process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gate as bg  # noqa: E402
import bench_gate_workers as bw  # noqa: E402

LAYOUTS = {"in-daemon gate": "daemon", "unconfined worker": "unconfined", "confined worker": "confined"}


def role_gates(args) -> None:
    bg.raise_fd_limit()
    pol = bw._policy(args.port)
    d = Path(args.state)
    socks = [f"{args.sock}.{i}" for i in range(args.sandboxes)]
    records = [0]

    def on_record(rec):
        records[0] += 1

    async def main():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        pool = None
        if args.layout == "daemon":
            from agentvm.gate.server import Gate

            gate = Gate(d / "state", d / "logs")
            gate.subscribers.append(on_record)
            for i, s in enumerate(socks):
                await gate.open_endpoint(f"bench-{i}", "bench", pol, Path(s))
            pids = [os.getpid()]
        else:
            from agentvm.gate.workers import WorkerPool

            pool = WorkerPool(1, d / "state", d / "logs", on_record=on_record,
                              on_event=lambda kind, **data: print(kind, data, file=sys.stderr),
                              confine="auto" if args.layout == "confined" else None)
            await pool.start()
            for i, s in enumerate(socks):
                await pool.open(f"bench-{i}", "bench", pol, Path(s), uid=None, creds=None)
            pids = [os.getpid()] + pool.pids()
            if args.layout == "confined":
                st = Path(f"/proc/{pool.pids()[0]}/status").read_text()
                uid = next(ln.split()[1] for ln in st.splitlines() if ln.startswith("Uid:"))
                assert uid != "0", "the confined worker runs as root"
        print("READY", json.dumps({"pids": pids, "socks": socks}), flush=True)
        await stop.wait()
        if pool is not None:
            await pool.stop()

    from agentvm.gate.server import run

    run(main())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", nargs="?")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sandboxes", type=int, default=2)
    ap.add_argument("--conc", type=int, default=0, help="connections in all (default: 4 per sandbox)")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--duration", type=float, default=0)
    ap.add_argument("--layout")
    ap.add_argument("--port", type=int)
    ap.add_argument("--state")
    ap.add_argument("--sock")
    args = ap.parse_args()
    if args.role == "gates":
        return role_gates(args) or 0
    if os.geteuid() != 0:
        print("note: not root - the 'confined worker' applies Landlock, seccomp and no_new_privs only", file=sys.stderr)
    k = args.sandboxes
    conc = args.conc or 4 * k
    rounds = args.rounds or (2 if args.quick else 4)
    duration = args.duration or (2.0 if args.quick else 5.0)
    warmup = 1.0
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-privsep-"))
    os.chmod(tmp, 0o711)
    up = bg.Child("upstream", bg.me("upstream"))
    port = int(up.info)
    request = f"GET http://{bg.NAME}:{port}/ HTTP/1.1\\r\\nHost: {bg.NAME}:{port}\\r\\n\\r\\n"
    res: dict[str, list[dict]] = {n: [] for n in LAYOUTS}
    children = {}
    try:
        for name, layout in LAYOUTS.items():
            argv = [sys.executable, __file__, "gates", "--layout", layout, "--sandboxes", str(k), "--port", str(port),
                    "--state", str(tmp / layout), "--sock", str(tmp / f"{layout}.sock")]
            c = bg.Child(name, argv, ready_timeout=60)
            c.request = request
            children[name] = c
        for r in range(rounds):  # interleaved: the machine's drift lands on every layout
            order = list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS)[::-1]
            for name in order:
                res[name].append(bw.round_once(children[name], conc, warmup, duration))
    finally:
        for c in children.values():
            c.stop()
        up.stop()
        subprocess.run(["rm", "-rf", str(tmp)])

    def med(name, key):
        xs = [x[key] for x in res[name] if x.get(key) is not None]
        return statistics.median(xs) if xs else None

    out = {n: {key: med(n, key) for key in ("rps", "p99_ms", "cpu_total", "cpu_us_per_request")}
           | {"bad": sum(x["bad"] for x in res[n]), "rounds_rps": [x["rps"] for x in res[n]]} for n in LAYOUTS}
    conf, unconf, daemon = out["confined worker"], out["unconfined worker"], out["in-daemon gate"]
    ratios = {"confined/unconfined us per request": conf["cpu_us_per_request"] / unconf["cpu_us_per_request"],
              "confined/in-daemon us per request": conf["cpu_us_per_request"] / daemon["cpu_us_per_request"],
              "confined/unconfined req/s": conf["rps"] / unconf["rps"],
              "confined/in-daemon req/s": conf["rps"] / daemon["rps"]}
    if args.json:
        print(json.dumps({"sandboxes": k, "conc": conc, "layouts": out, "ratios": ratios}, indent=2))
        return 0
    print(f"gate privilege separation: {k} sandboxes, {conc} connections, {rounds} interleaved rounds of {duration:g} s, "
          f"{len(os.sched_getaffinity(0))} cores (shared with the load generators and the upstream)")
    print(f"{'layout':<18} {'req/s':>9} {'p99 ms':>7} {'gate CPU':>9} {'us/req':>7}")
    for name, o in out.items():
        print(f"{name:<18} {o['rps']:>9,.0f} {o['p99_ms']:>7.2f} {o['cpu_total'] * 100:>8.0f}% "
              f"{o['cpu_us_per_request']:>7.1f}" + (f"  (errors: {o['bad']})" if o["bad"] else ""))
    for k_, v in ratios.items():
        print(f"{k_}: {v:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
