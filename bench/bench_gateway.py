#!/usr/bin/env python3
"""The shared egress gateway against the per-host gate, measured in the same run; certificates
minted per second.

    python3 bench/bench_gateway.py [--quick] [--json] [--duration S] [--identities N]

Loopback only (127.0.0.1 and a unix socket). Processes (no two share a GIL):

  upstream  an asyncio-Protocol HTTP/1.1 server: a fixed 13-byte 200 answer, keep-alive
  gate      agentvm.gate.server.Gate, one endpoint on a unix socket (the per-host gate: the baseline)
  gateway   agentvm.gateway.server.GatewayGate: the same core behind an mTLS TCP listener, one
            endpoint per identity; the configuration source is checked (a stat per file) before
            every request, the audit sink chains every record
  loadgen   N keep-alive connections, one request in flight each, absolute-form GET http://bench.test/
            - over the unix socket (gate), or over TLS with a client certificate (gateway; the
            connections spread over --identities identities)

Rows: req/s at concurrency 1 and 10 for both, the ratio gateway/gate, p50 latency; mints/s of
client certificates (ECDSA P-256 key + signature), and the TLS handshakes/s the gateway accepts
(a new mTLS connection per request). Each server runs on one core: its req/s is per core. On
this 2-core machine the load generator shares the cores: read the ratio, not the absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _python import agentvm_python  # noqa: E402

agentvm_python()

HOST = "127.0.0.1"
NAME = "bench.test"
BODY = b"hello, world\n"
RESP = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY


# -- child processes -------------------------------------------------------------------------
def _upstream(port_file: str) -> None:
    class P(asyncio.Protocol):
        def connection_made(self, t):
            self.t, self.buf = t, b""

        def data_received(self, d):
            self.buf += d
            while b"\r\n\r\n" in self.buf:
                _, _, self.buf = self.buf.partition(b"\r\n\r\n")
                self.t.write(RESP)

    async def main():
        srv = await asyncio.get_running_loop().create_server(P, HOST, 0, backlog=1024)
        Path(port_file).write_text(str(srv.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    from agentvm.gate.server import run

    run(main())


def _agent_file(d: Path, port: int) -> Path:
    p = d / "bench-agent.yaml"
    p.write_text(f"""apiVersion: agentvm/v1
kind: Agent
metadata: {{name: bench}}
spec:
  command: ["true"]
  egress:
    hosts: {{{NAME}: {HOST}}}
    allow: [{{host: {NAME}, ports: [{port}]}}]
    limits: {{connections: 10000, requestsPerSecond: 1000000, burst: 1000000}}
""")
    return p


def _gate(tmp: str, up_port: int, sock: str, ready: str) -> None:
    from agentvm.gate.server import Gate, run
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent

    policy = compile_policy(load_agent(_agent_file(Path(tmp), up_port)).spec)

    async def main():
        g = Gate(Path(tmp) / "gate-state", Path(tmp) / "gate-logs")
        await g.open_endpoint("bench", "bench", policy.egress, Path(sock))
        Path(ready).write_text("ok")
        await asyncio.Event().wait()

    run(main())


def _gateway(tmp: str, up_port: int, ready: str) -> None:
    from agentvm.gate.server import run
    from agentvm.gateway.server import serve

    cfg = Path(tmp) / "cfg"
    cfg.mkdir(exist_ok=True)
    _agent_file(cfg, up_port)
    (cfg / "gateway.yaml").write_text("apiVersion: agentvm/v1\nkind: Gateway\nagents:\n  bench: {file: bench-agent.yaml}\n"
                                      "identities:\n  - {match: 'agentvm://bench/*', agent: bench}\n")
    run(serve(cfg, Path(tmp) / "ca", HOST, 0, state_dir=Path(tmp) / "gw-state", audit_dir=(None if os.environ.get("BENCH_NO_AUDIT") else Path(tmp) / "audit"),
              replica="r1", ready=lambda a, g: Path(ready).write_text(str(a[1]))))


# -- load -------------------------------------------------------------------------------------
async def _one_conn(open_conn, port: int, deadline: float, lat: list[float], new_each: bool) -> int:
    req = f"GET http://{NAME}:{port}/ HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n".encode()
    n = 0
    r = w = None
    while time.perf_counter() < deadline:
        if r is None:
            r, w = await open_conn()
        t0 = time.perf_counter()
        w.write(req)
        head = await r.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(head[:200])
        await r.readexactly(len(BODY))
        lat.append(time.perf_counter() - t0)
        n += 1
        if new_each:
            w.close()
            r = w = None
    if w is not None:
        w.close()
    return n


def _load(open_conns, port: int, conc: int, seconds: float, new_each: bool = False) -> tuple[float, float]:
    async def main():
        lat: list[float] = []
        await asyncio.gather(*[_one_conn(open_conns[i % len(open_conns)], port, time.perf_counter() + 0.3, [], new_each)
                               for i in range(conc)])  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[_one_conn(open_conns[i % len(open_conns)], port, t0 + seconds, lat, new_each)
                                        for i in range(conc)])
        return sum(counts) / (time.perf_counter() - t0), statistics.median(lat) * 1e3

    import uvloop

    return uvloop.run(main())


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _wait(path: Path, what: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)
    return path.read_text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--identities", type=int, default=10)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {"upstream": _upstream, "gate": _gate, "gateway": _gateway}[a.role](*a.args)
        return
    seconds = a.duration or (1.5 if a.quick else 4.0)
    from agentvm.gateway.ca import GatewayCA
    from agentvm.gateway.identity import Identity

    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-gw-"))
    procs = []
    me = [sys.executable, __file__, "--role"]
    try:
        procs.append(subprocess.Popen(me + ["upstream", "--args", str(tmp / "up.port")]))
        up_port = int(_wait(tmp / "up.port", "upstream"))
        sock = tmp / "gate.sock"
        procs.append(subprocess.Popen(me + ["gate", "--args", str(tmp), str(up_port), str(sock), str(tmp / "gate.ready")]))
        ca = GatewayCA.create(tmp / "ca")
        procs.append(subprocess.Popen(me + ["gateway", "--args", str(tmp), str(up_port), str(tmp / "gw.port")]))
        _wait(tmp / "gate.ready", "gate")
        gw_port = int(_wait(tmp / "gw.port", "gateway"))

        # certificates minted per second (this process, one core)
        n_mint = 100 if a.quick else 400
        t0 = time.perf_counter()
        minted = [ca.mint(Identity("bench", f"sb-{i}")) for i in range(n_mint)]
        mint_rate = n_mint / (time.perf_counter() - t0)
        ctxs = []
        for m in minted[: a.identities]:
            d = ca.write_client(m, tmp / "ids" / m.identity.sandbox)
            c = ssl.create_default_context(cafile=str(d["ca.crt"]))
            c.load_cert_chain(str(d["tls.crt"]), str(d["tls.key"]))
            ctxs.append(c)

        def gate_open():
            return asyncio.open_unix_connection(str(sock))

        gw_opens = [(lambda c=c: asyncio.open_connection(HOST, gw_port, ssl=c, server_hostname="localhost")) for c in ctxs]
        rows = {}
        gate_pid, gw_pid = procs[1].pid, procs[2].pid
        for conc in (1, 10):
            c0 = _cpu(gate_pid)
            g_rps, g_p50 = _load([gate_open], up_port, conc, seconds)
            g_cpu = _cpu(gate_pid) - c0
            c0 = _cpu(gw_pid)
            w_rps, w_p50 = _load(gw_opens, up_port, conc, seconds)
            w_cpu = _cpu(gw_pid) - c0
            # requests per CPU-second of the server process (warm-up included in both counts: 0.3 s)
            g_pc = g_rps * (seconds + 0.3) / g_cpu if g_cpu else None
            w_pc = w_rps * (seconds + 0.3) / w_cpu if w_cpu else None
            rows[f"c{conc}"] = {"gate_rps": round(g_rps), "gate_p50_ms": round(g_p50, 3), "gateway_rps": round(w_rps),
                                "gateway_p50_ms": round(w_p50, 3), "ratio": round(w_rps / g_rps, 3),
                                "gate_req_per_cpu_s": round(g_pc) if g_pc else None,
                                "gateway_req_per_cpu_s": round(w_pc) if w_pc else None,
                                "cpu_ratio": round(w_pc / g_pc, 3) if g_pc and w_pc else None}
        c0 = _cpu(gw_pid)
        hs_rps, _ = _load(gw_opens, up_port, 10, seconds, new_each=True)
        hs_cpu = _cpu(gw_pid) - c0
        result = {"cores": os.cpu_count(), "seconds": seconds, "identities": a.identities,
                  "mints_per_s": round(mint_rate), "gateway_new_mtls_conn_per_s": round(hs_rps),
                  "gateway_new_mtls_conn_per_cpu_s": round(hs_rps * (seconds + 0.3) / hs_cpu) if hs_cpu else None, **rows}
        (tmp / "audit").mkdir(exist_ok=True)
        audit = sum(p.stat().st_size for p in (tmp / "audit").rglob("*.jsonl"))
        recs = sum(1 for p in (tmp / "audit").rglob("*.jsonl") for _ in open(p, "rb"))
        result["audit_bytes_per_record"] = round(audit / recs) if recs else None
        if a.json:
            print(json.dumps(result))
        else:
            print(f"certificates minted: {result['mints_per_s']}/s (ECDSA P-256, one core)")
            for conc in (1, 10):
                r = rows[f"c{conc}"]
                print(f"concurrency {conc:>2}: gate {r['gate_rps']:>6} req/s (p50 {r['gate_p50_ms']} ms)   "
                      f"gateway {r['gateway_rps']:>6} req/s (p50 {r['gateway_p50_ms']} ms)   ratio {r['ratio']}")
                print(f"                per CPU-second of the server: gate {r['gate_req_per_cpu_s']}   "
                      f"gateway {r['gateway_req_per_cpu_s']}   ratio {r['cpu_ratio']}")
            print(f"gateway, a new mTLS connection per request (concurrency 10): {result['gateway_new_mtls_conn_per_s']}/s "
                  f"({result['gateway_new_mtls_conn_per_cpu_s']} per CPU-second of the gateway)")
            print(f"audit sink: {result['audit_bytes_per_record']} bytes per chained record")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
