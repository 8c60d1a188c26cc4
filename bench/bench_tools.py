#!/usr/bin/env python3
"""A tools/call through the tool gateway vs the same call to the same server directly.

    python3 bench/bench_tools.py [--calls N] [--rounds R]

Both clients run inside one real sandbox (bwrap), with the official mcp SDK (the test library,
`bash scripts/install.sh --test`), against the same stdio MCP server
(tests/integration/tools_server.py, tool `echo`):

  direct    the client starts the server itself, as a stdio subprocess inside the agent's
            sandbox, and calls echo N times (no gateway, no policy, no second sandbox)
  gateway   the client calls t__echo at $AGENTVM_MCP_URL: the gate's port, the tool gateway
            (decide(), rate limit, log record, result size check), the SDK's client to the
            server, which runs in a sandbox of its own

  raw-direct / raw-gateway  the same two paths with a minimal client (JSON-RPC lines on the
            server's stdin; one keep-alive stdlib HTTP connection to the gateway): what the gateway
            itself adds, without the SDK client's own cost for HTTP vs stdio

Each round measures all four, after a warm-up; the report gives the median and p99 per call,
and the added median (gateway - direct) with its target: <= 2 ms. Loopback only.
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
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))

CLIENT = r'''
import asyncio, json, os, sys, time
sys.path.insert(0, "/opt/testlib")
from mcp import Client
from mcp.client.stdio import StdioServerParameters

N, ROUNDS = int(sys.argv[1]), int(sys.argv[2])

async def timed(target, name):
    async with Client(target) as c:
        for _ in range(20):  # warm-up (the first call starts the server)
            await c.call_tool(name, {"text": "warm"})
        out = []
        for _ in range(N):
            t = time.perf_counter()
            r = await c.call_tool(name, {"text": "ping"})
            out.append((time.perf_counter() - t) * 1000)
            assert r.content[0].text == "ping", r
        return out

def raw_direct():
    """JSON-RPC lines to the server's stdin, by hand: the server's own cost, no client library."""
    import subprocess
    p = subprocess.Popen(["python3", "/work/tools_server.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={"PYTHONPATH": "/opt/testlib", "PATH": os.environ["PATH"]}, text=True, bufsize=1)
    def rpc(i, method, params):
        p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": i, "method": method, "params": params}) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())
    rpc(0, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                          "clientInfo": {"name": "bench", "version": "1"}})
    p.stdin.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}) + "\n")
    out = []
    for i in range(N + 20):
        t = time.perf_counter()
        r = rpc(i + 1, "tools/call", {"name": "echo", "arguments": {"text": "ping"}})
        if i >= 20:
            out.append((time.perf_counter() - t) * 1000)
    assert r["result"]["content"][0]["text"] == "ping", r
    p.stdin.close(); p.wait()
    return out


def raw_gateway():
    """The same JSON-RPC over one keep-alive HTTP connection to the gateway (stdlib http.client)."""
    import http.client, socket
    host, port = os.environ["AGENTVM_MCP_URL"].split("//")[1].split("/")[0].split(":")
    c = http.client.HTTPConnection(host, int(port))
    c.connect()
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
           "MCP-Protocol-Version": "2025-11-25"}
    out = []
    for i in range(N + 20):
        body = json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                           "params": {"name": "t__echo", "arguments": {"text": "ping"}}})
        t = time.perf_counter()
        c.request("POST", "/mcp", body=body, headers=hdr)
        r = json.loads(c.getresponse().read())
        if i >= 20:
            out.append((time.perf_counter() - t) * 1000)
    assert r["result"]["content"][0]["text"] == "ping", r
    return out


def http_server():
    """The same server, served over streamable HTTP on the sandbox's own loopback."""
    import socket, subprocess
    p = subprocess.Popen(["python3", "/work/tools_server.py", "--http", str(HTTP_PORT)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={"PYTHONPATH": "/opt/testlib", "PATH": os.environ["PATH"]})
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the HTTP server did not start")


HTTP_PORT = 8765


async def main():
    srv = http_server()
    direct = StdioServerParameters(command="python3", args=["/work/tools_server.py"],
                                   env={"PYTHONPATH": "/opt/testlib", "PATH": os.environ["PATH"]})
    shim = StdioServerParameters(command="agentvm-mcp", env=dict(os.environ))
    res = {"direct": [], "gateway": [], "direct-http": [], "gateway-stdio": [], "raw-direct": [], "raw-gateway": []}
    for _ in range(ROUNDS):
        res["direct"] += await timed(direct, "echo")
        res["gateway-stdio"] += await timed(shim, "t__echo")
        res["direct-http"] += await timed(f"http://127.0.0.1:{HTTP_PORT}/mcp", "echo")
        res["gateway"] += await timed(os.environ["AGENTVM_MCP_URL"], "t__echo")
        res["raw-direct"] += raw_direct()
        res["raw-gateway"] += raw_gateway()
    srv.terminate()
    print("RESULT " + json.dumps(res))

asyncio.run(main())
'''


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if not (TESTLIB / "mcp").is_dir():
        print(f"{TESTLIB} lacks the mcp SDK: run `bash scripts/install.sh --test`", file=sys.stderr)
        return 2
    d = Path(tempfile.mkdtemp(prefix="agentvm-bench-tools-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        shutil.copy(ROOT / "tests" / "integration" / "tools_server.py", d / "tools_server.py")
        (d / "client.py").write_text(CLIENT)
        for f in d.iterdir():
            os.chmod(f, 0o644)
        agent = d / "bench-tools.yaml"
        agent.write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {{name: bench-tools}}
            spec:
              riskTier: L3
              limits: {{timeout: 0, memory: 1G}}
              egress:  # /mcp requests are admitted like egress: room for the measurement
                limits: {{requestsPerSecond: 100000, burst: 100000}}
              mounts:
                - {{host: {d}, path: /work, mode: ro}}
                - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
              tools:
                - name: t
                  command: [python3, /srv/tools_server.py]
                  allow: [echo]
                  risk: {{echo: read}}
                  limits: {{callsPerMinute: 100000}}
                  mounts:
                    - {{host: {d}, path: /srv, mode: ro}}
                    - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
            """))
        env = dict(os.environ, AGENTVM_NO_DAEMON="1")
        r = subprocess.run([sys.executable, "-m", "agentvm", "run", "-f", str(agent), "--", "python3", "/work/client.py",
                            str(a.calls), str(a.rounds)], capture_output=True, text=True, env=env, timeout=1800)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(line[7:])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"tools/call, {a.calls} calls x {a.rounds} rounds each, both clients inside one bwrap sandbox")
    print(f"{'path':<12} {'median ms':>10} {'p99 ms':>8} {'mean ms':>8}")
    for k in ("direct", "gateway-stdio", "direct-http", "gateway", "raw-direct", "raw-gateway"):
        xs = res[k]
        print(f"{k:<12} {statistics.median(xs):>10.3f} {pct(xs, 99):>8.3f} {statistics.mean(xs):>8.3f}")
    med = {k: statistics.median(v) for k, v in res.items()}
    for label, g, d in (("with the mcp SDK client, stdio on both paths (agentvm-mcp)", "gateway-stdio", "direct"),
                        ("with the mcp SDK client, HTTP on both paths", "gateway", "direct-http"),
                        ("with the mcp SDK client, stdio direct against HTTP via the gateway", "gateway", "direct"),
                        ("with a minimal client (the gateway's own cost)", "raw-gateway", "raw-direct")):
        added = med[g] - med[d]
        print(f"added median {label}: {added:.3f} ms per call (target <= 2 ms: {'met' if added <= 2 else 'missed'}); "
              f"{g}/{d} = {med[g] / med[d]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
