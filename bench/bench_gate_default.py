#!/usr/bin/env python3
"""What the default gate (issue 43: a confined gate worker per running agent) costs an agent.

    sudo python3 bench/bench_gate_default.py [--agents N] [--spare 1] [--json]

Measured in one run, with the daemon's own pool (``WorkerPool(0, isolate="agent",
confine="full")``, as ``agentvm up`` makes it; root: a worker switches to a uid of its own):

  first sandbox of an agent   ``pool.open`` when no worker serves the agent yet: a worker is
                              started (interpreter, imports, CA loaded, confinement) then the
                              endpoint opened - the cost paid once per agent start
  next sandbox of that agent  ``pool.open`` on the agent's running worker (the baseline)
  worker memory               VmRSS and Pss (smaps_rollup: shared pages split between the
                              workers) of each worker after it served a few requests
  retirement                  the worker gone after its agent's last sandbox closed

Printed: medians over N agents, and the ratio first/next. The per-request cost of the
separation (in-daemon gate vs confined worker) is bench/bench_gate_privsep.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def mem(pid: int) -> tuple[int, int]:
    rss = pss = 0
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            rss = int(ln.split()[1])
    try:
        for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if ln.startswith("Pss:"):
                pss = int(ln.split()[1])
    except OSError:
        pass
    return rss, pss


async def get(sock: Path, port: int) -> int:
    r, w = await asyncio.open_unix_connection(str(sock))
    w.write(f"GET http://up.test:{port}/x HTTP/1.1\r\nHost: up.test:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    return int(data.split(b" ", 2)[1])


async def main(args) -> dict:
    from agentvm.gate.policy import compile_egress
    from agentvm.gate.workers import WorkerPool

    async def handle(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pol = compile_egress(None, extra_allow=[f"up.test:{port}"], extra_hosts={"up.test": "127.0.0.1"})
    d = Path(tempfile.mkdtemp(prefix="agentvm-bench-gatedefault-"))
    os.chmod(d, 0o711)
    events: list = []
    pool = WorkerPool(0, d / "gate", d / "logs", on_record=lambda r: None,
                      on_event=lambda k, **kw: events.append((k, kw)), isolate="agent", confine="full", retire=0.2,
                      spare=args.spare)
    first, nxt, rss, pss, retire = [], [], [], [], []
    await pool.start()
    try:
        for i in range(args.agents):
            t0 = time.perf_counter()
            a = await pool.open(f"sb-{i}-a", f"agent-{i}", pol, d / f"{i}a.sock", uid=None, creds=None)
            first.append(time.perf_counter() - t0)
            if args.spare:  # (the next spare is started meanwhile: measured as the daemon sees it, between agents)
                while pool._sparing is not None and not pool._sparing.done():
                    await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            b = await pool.open(f"sb-{i}-b", f"agent-{i}", pol, d / f"{i}b.sock", uid=None, creds=None)
            nxt.append(time.perf_counter() - t0)
            assert a.worker is b.worker
            for _ in range(20):
                assert await get(d / f"{i}a.sock", port) == 200
            r, p = mem(a.worker.proc.pid)
            rss.append(r)
            pss.append(p)
        for i in range(args.agents):  # each agent's sandboxes close: its worker retires
            w = pool.workers[i]
            for ep in list(w.endpoints.values()):
                await pool.close(ep)
            t0 = time.perf_counter()
            while w.proc.returncode is None:
                await asyncio.sleep(0.01)
            retire.append(time.perf_counter() - t0)
    finally:
        await pool.stop()
        srv.close()
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    med = statistics.median
    return {"agents": args.agents, "spare": args.spare, "first_sandbox_ms": round(med(first) * 1000, 1),
            "next_sandbox_ms": round(med(nxt) * 1000, 2),
            "ratio_first_to_next": round(med(first) / med(nxt), 1),
            "worker_rss_kib": int(med(rss)), "worker_pss_kib": int(med(pss)),
            "retired_after_last_close_ms": round(med(retire) * 1000, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--spare", type=int, default=0, help="spare workers kept (the daemon keeps 1)")
    ns = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: a confined worker switches to a uid of its own")
    from agentvm.gate.server import run

    out = {}

    async def go():
        out.update(await main(ns))

    run(go())
    if ns.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>30}: {v}")
