#!/usr/bin/env python3
"""The gate over cores: one gate process against gate workers (``agentvm up --gate-workers``),
measured in the same run.

    python3 bench/bench_gate_workers.py [--quick] [--json] [--workers N] [--sandboxes K]

Two gate layouts serve the same K sandbox endpoints (unix sockets), the same policy and the same
load, in interleaved rounds (medians printed):

  one process   agentvm.gate.server.Gate, every endpoint on one loop: the daemon's gate today
                without workers (a subscriber takes every decision record, as the daemon does)
  workers       agentvm.gate.workers.WorkerPool(N) in a host process standing in for the daemon:
                sockets bound by the host and handed over, records streamed back to it

The load: one loadgen process per sandbox (bench_gate.py's: keep-alive connections, one request
in flight each, absolute-form GET to bench_gate.py's fixed-answer upstream), the concurrency
split between them. Printed: aggregate req/s, p99, the gate's CPU per request (every gate process
plus the host's share), and the busiest gate process's CPU (one core is 100%: the ceiling of a
one-process gate). Everything runs on loopback; no other address is used. On a machine with few
cores the load generators and the upstream compete with the gate for them: the ratio is what the
host's spare cores buy, not the gate's scaling alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

TARGET_VS_ONE = 1.0  # workers must not be slower than one process (a floor, not the goal: see the docstring)


def _policy(port: int):
    from agentvm.gate.policy import EgressLimits, compile_egress

    pol = compile_egress(None, extra_allow=[f"{bg.NAME}:{port}"], extra_hosts={bg.NAME: bg.HOST})
    return dataclasses.replace(pol, limits=EgressLimits(connections=4096, requests_per_second=1e9, burst=10**9,
                                                        bytes_out=1 << 60))


def role_gates(args) -> None:
    """Serve K endpoints, in one process (--workers 0) or on a WorkerPool; print READY <pids>."""
    bg.raise_fd_limit()
    pol = _policy(args.port)
    d = Path(args.state)
    socks = [f"{args.sock}.{i}" for i in range(args.sandboxes)]
    records = [0]

    def on_record(rec):
        records[0] += 1

    async def main():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if args.workers == 0:
            from agentvm.gate.server import Gate

            gate = Gate(d / "state", d / "logs")
            gate.subscribers.append(on_record)
            for i, s in enumerate(socks):
                await gate.open_endpoint(f"bench-{i}", "bench", pol, Path(s))
            pids = [os.getpid()]
        else:
            from agentvm.gate.workers import WorkerPool

            pool = WorkerPool(args.workers, d / "state", d / "logs", on_record=on_record,
                              on_event=lambda kind, **data: print(kind, data, file=sys.stderr))
            await pool.start()
            for i, s in enumerate(socks):
                await pool.open(f"bench-{i}", "bench", pol, Path(s), uid=None, creds=None)
            pids = [os.getpid()] + pool.pids()
        print("READY", json.dumps({"pids": pids, "socks": socks}), flush=True)
        await stop.wait()
        if args.workers:
            await pool.stop()

    from agentvm.gate.server import run

    run(main())


def cpu(pids: list[int]) -> list[float]:
    return [bg.cpu_seconds(p) or 0.0 for p in pids]


def round_once(gates: bg.Child, conc: int, warmup: float, duration: float) -> dict:
    info = json.loads(gates.info)
    socks, pids = info["socks"], info["pids"]
    per = max(1, conc // len(socks))
    procs = []
    for s in socks:
        argv = bg.me("loadgen", "--conc", str(per), "--warmup", str(warmup), "--duration", str(duration),
                     "--request", gates.request, "--unix", s)
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(warmup)
    c0, t0 = cpu(pids), time.perf_counter()
    time.sleep(duration)
    c1, el = cpu(pids), time.perf_counter() - t0
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=warmup + duration + 60)
        if p.returncode != 0:
            raise RuntimeError("loadgen failed: " + (err.strip().splitlines() or ["?"])[-1])
        outs.append(json.loads(out.strip().splitlines()[-1]))
    rps = sum(o["rps"] for o in outs)
    shares = [(b - a) / el for a, b in zip(c0, c1)]
    return {"rps": rps, "p99_ms": max(o["p99_ms"] or 0 for o in outs), "bad": sum(o["bad_status"] + o["errors"] for o in outs),
            "cpu_total": sum(shares), "cpu_host": shares[0], "cpu_busiest": max(shares[1:] or shares),
            "cpu_us_per_request": sum(shares) / rps * 1e6 if rps else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", nargs="?")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workers", type=int, default=max(2, len(os.sched_getaffinity(0))))
    ap.add_argument("--sandboxes", type=int, default=0, help="endpoints (default: 2 per worker)")
    ap.add_argument("--conc", type=int, default=0, help="connections in all (default: 5 per sandbox)")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--duration", type=float, default=0)
    # roles (internal)
    ap.add_argument("--port", type=int)
    ap.add_argument("--state")
    ap.add_argument("--sock")
    args = ap.parse_args()
    if args.role == "gates":
        return role_gates(args) or 0
    k = args.sandboxes or 2 * args.workers
    conc = args.conc or 5 * k
    rounds = args.rounds or (2 if args.quick else 4)
    duration = args.duration or (2.0 if args.quick else 5.0)
    warmup = 1.0
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-workers-"))
    up = bg.Child("upstream", bg.me("upstream"))
    port = int(up.info)
    request = f"GET http://{bg.NAME}:{port}/ HTTP/1.1\\r\\nHost: {bg.NAME}:{port}\\r\\n\\r\\n"
    layouts = {"one process": 0, f"{args.workers} workers": args.workers}
    res: dict[str, list[dict]] = {k_: [] for k_ in layouts}
    children = {}
    try:
        for name, n in layouts.items():
            argv = [sys.executable, __file__, "gates", "--workers", str(n), "--sandboxes", str(k), "--port", str(port),
                    "--state", str(tmp / f"s{n}"), "--sock", str(tmp / f"g{n}.sock")]
            c = bg.Child(name, argv, ready_timeout=60)
            c.request = request
            children[name] = c
        for r in range(rounds):  # interleaved: the machine's drift lands on both
            for name in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
                res[name].append(round_once(children[name], conc, warmup, duration))
    finally:
        for c in children.values():
            c.stop()
        up.stop()
        subprocess.run(["rm", "-rf", str(tmp)])

    def med(name, key):
        xs = [x[key] for x in res[name] if x.get(key) is not None]
        return statistics.median(xs) if xs else None

    out = {name: {key: med(name, key) for key in ("rps", "p99_ms", "cpu_total", "cpu_host", "cpu_busiest",
                                                  "cpu_us_per_request")} | {"bad": sum(x["bad"] for x in res[name]),
                                                                            "rounds_rps": [x["rps"] for x in res[name]]}
           for name in layouts}
    one, many = out["one process"], out[f"{args.workers} workers"]
    ratio = many["rps"] / one["rps"] if one["rps"] else None
    if args.json:
        print(json.dumps({"sandboxes": k, "conc": conc, "cores": len(os.sched_getaffinity(0)), "layouts": out,
                          "workers_vs_one": ratio}, indent=2))
        return 0
    print(f"gate over cores: {k} sandboxes, {conc} connections in all, {rounds} interleaved rounds of {duration:g} s, "
          f"{len(os.sched_getaffinity(0))} cores (shared with the load generators and the upstream)")
    print(f"{'layout':<14} {'req/s':>9} {'p99 ms':>7} {'gate CPU':>9} {'busiest':>8} {'of it host':>10} {'us/req':>7}")
    for name, o in out.items():
        print(f"{name:<14} {o['rps']:>9,.0f} {o['p99_ms']:>7.2f} {o['cpu_total'] * 100:>8.0f}% {o['cpu_busiest'] * 100:>7.0f}% "
              f"{(o['cpu_host'] if name != 'one process' else 0) * 100:>9.0f}% {o['cpu_us_per_request']:>7.1f}"
              + (f"  (errors: {o['bad']})" if o["bad"] else ""))
    print(f"workers / one process: {ratio:.2f}x req/s (floor {TARGET_VS_ONE:.1f}x: "
          f"{'met' if ratio and ratio >= TARGET_VS_ONE else 'MISSED'}); rounds: "
          + "; ".join(f"{n}: " + ", ".join(f"{x:,.0f}" for x in o["rounds_rps"]) for n, o in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
