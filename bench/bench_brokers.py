#!/usr/bin/env python3
"""A brokered credential's swap against a static one, measured in the same run.

    python3 bench/bench_brokers.py [--quick] [--duration S] [--json]

Everything on loopback. Reuses bench_credentials.py's upstream, load generator and cell runner
(one process each, so no two share a GIL):

  upstream   HTTPS keep-alive server that answers 200 only to `Authorization: Bearer <value>`
             (bench_credentials' role_upstream), counting ok / mismatched / missing
  token      an OAuth 2 token endpoint (stdlib, this process, a thread) answering the refresh
             grant with that value as the access token (expires_in 3600), counting grants
  gate       agentvm.gate.server.Gate + one credential-holding endpoint, in two flavours:
               static    - the real value from a `value` callable (what credentials by reference do)
               brokered  - `broker: {kind: oauth2-refresh}`: the value is minted by the gate
                           (agentvm.gate.brokers.TokenCache) from a vault entry naming the token
                           endpoint; cached, so a request pays a cache lookup, not a round trip

Parts:
  1. req/s at c=1 and c=10 through each gate flavour (same upstream, same loadgen, same run,
     interleaved rounds, the best round per cell) and the ratio brokered / static
  2. in process: CredentialSet.apply() + a response scrub per request, static vs brokered
     (cached), in microseconds, and their ratio
  3. one mint: the refresh grant's round trip to the local token endpoint (median of N), what
     the first request of a session (or one after the token expired) waits for
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
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HOST = "127.0.0.1"


def me(role: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--role", role, *extra]


def cred_spec(brokered: bool):
    import bench_credentials as bc

    s = bc.cred_spec()
    s.inspect = "strict"
    s.broker = SimpleNamespace(kind="oauth2-refresh", scopes=[], role_arn=None, session_policy=None,
                               duration_seconds=900, repositories=[], permissions={}) if brokered else None
    return s


def token_server(real: str):
    """A refresh-grant endpoint on loopback answering ``real`` as the access token."""
    import http.server
    import urllib.parse

    stats = {"grants": 0}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            form = dict(urllib.parse.parse_qsl(self.rfile.read(n).decode()))
            ok = form.get("grant_type") == "refresh_token" and form.get("refresh_token") == "bench-refresh-token-0123"
            body = json.dumps({"access_token": real, "token_type": "Bearer", "expires_in": 3600} if ok
                              else {"error": "invalid_grant"}).encode()
            stats["grants"] += ok
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer((HOST, 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, stats


def entry_for(port: int) -> str:
    return json.dumps({"tokenUrl": f"http://{HOST}:{port}/token", "clientId": "bench", "clientSecret": "bench-secret-0123",
                       "refreshToken": "bench-refresh-token-0123", "clientAuth": "post"})


def role_gate(args) -> None:
    import dataclasses

    from agentvm.gate.credentials import CredentialSet, compile_credentials
    from agentvm.gate.policy import EgressLimits, compile_egress
    from agentvm.gate.server import Gate

    cred = json.loads(Path(args.cred_file).read_text())
    brokered = args.mode == "brokered"
    bindings = compile_credentials([cred_spec(brokered)])
    value = (lambda n: cred["entry"]) if brokered else (lambda n: cred["real"])
    creds = CredentialSet(bindings, {bindings[0].name: cred["placeholder"]}, value=value, revoked=lambda n: False)
    pol = compile_egress(None, extra_allow=[f"bench.test:{args.ports}"], extra_hosts={"bench.test": HOST})
    pol = dataclasses.replace(pol, upstream_ca=args.upstream_ca,
                              limits=EgressLimits(connections=4096, requests_per_second=1e9, burst=10**9,
                                                  bytes_out=1 << 60))

    async def main():
        import asyncio
        import signal

        d = Path(args.state)
        gate = Gate(d / "state", d / "logs")
        gate.server_ctx()
        await gate.open_endpoint("bench", "bench", pol, Path(args.sock), creds=creds)
        creds.prepare()  # (minted before the cells: the warm-up would do it anyway)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("READY", json.dumps({"sock": args.sock, "ca": str(gate.ca.cert_path)}), flush=True)
        await stop.wait()
        await gate.close_endpoint("bench")

    from agentvm.gate.server import run

    run(main())


def in_process(real: str, placeholder: str, entry: str, n: int) -> dict:
    """µs per request: apply() on a request carrying the placeholder, then a 1 KiB response scrub."""
    from agentvm.gate.credentials import CredentialSet, compile_credentials

    out = {}
    body = b'{"ok": true, "items": [' + b", ".join(b'"item-%d"' % i for i in range(100)) + b"]}"
    headers = [(b"host", b"bench.test"), (b"user-agent", b"bench"), (b"authorization", f"Bearer {placeholder}".encode()),
               (b"accept", b"*/*")]
    for mode in ("static", "brokered"):
        b = compile_credentials([cred_spec(mode == "brokered")])
        cs = CredentialSet(b, {b[0].name: placeholder}, (lambda n: entry) if mode == "brokered" else (lambda n: real),
                           lambda n: False)
        cs.apply(host="bench.test", scheme="https", target="/", headers=headers)  # (mints once, brokered)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                s = cs.apply(host="bench.test", scheme="https", target="/", headers=headers)
                sc = cs.scrubber()
                sc.feed(body)
                sc.finish()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        assert dict(s.headers)[b"authorization"] == f"Bearer {real}".encode()
        out[mode] = statistics.median(runs)
    return out


def one_mint(entry: str, n: int) -> dict:
    from agentvm.gate.brokers import BrokerSpec, TokenCache

    times = []
    for _ in range(n):
        c = TokenCache("bench", BrokerSpec(kind="oauth2-refresh"), raw=lambda: entry)
        t0 = time.perf_counter()
        c.get()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * (n - 1))]}


def main() -> int:
    from _python import agentvm_python

    agentvm_python()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter cells (about 15 s)")
    ap.add_argument("--duration", type=float, help="seconds per req/s cell (default 3, --quick 1.5)")
    ap.add_argument("--json", action="store_true")
    for a in ("--role", "--ports", "--sock", "--state", "--cred-file", "--upstream-ca", "--mode"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "gate":
        role_gate(args)
        return 0

    import secrets

    import bench_credentials as bc
    from agentvm.gate.credentials import compile_credentials, make_placeholder

    duration = args.duration or (1.5 if args.quick else 3.0)
    warmup = 0.5 if args.quick else 1.0
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-brokers-", dir="/tmp"))
    os.chmod(tmp, 0o700)
    children = []
    res: dict = {"http": {}, "gate_hot_path": bc.gate_hot_path()}
    srv = None
    try:
        test_ca, leaf, leaf_key = bc.make_test_ca(tmp)
        real = "at-bench-MINTED-" + secrets.token_urlsafe(24)
        placeholder = make_placeholder(compile_credentials([cred_spec(False)])[0], len(real))
        srv, tstats = token_server(real)
        entry = entry_for(srv.server_address[1])
        cred_file = tmp / "cred.json"
        cred_file.write_text(json.dumps({"real": real, "placeholder": placeholder, "entry": entry}))
        os.chmod(cred_file, 0o600)
        up = bc.Child("upstream", bc.me("upstream", "--cert", leaf, "--key", leaf_key, "--cred-file", str(cred_file)))
        children.append(up)
        up_port = int(up.info)
        tgts = {}
        for mode in ("static", "brokered"):
            g = bc.Child(f"gate-{mode}", me("gate", "--mode", mode, "--ports", str(up_port), "--sock",
                                             str(tmp / f"{mode}.sock"), "--state", str(tmp / mode), "--cred-file",
                                             str(cred_file), "--upstream-ca", test_ca))
            children.append(g)
            info = json.loads(g.info)
            tgts[mode] = {"mode": "proxy", "unix": info["sock"], "cafile": info["ca"], "auth": placeholder,
                          "pid": g.p.pid, "upstream_port": up_port}
        # interleaved rounds (static, brokered, static, ...): a busy machine's drift hits both alike;
        # each cell reports its best round
        rounds = 2 if args.quick else 3
        for r in range(rounds):
            for conc in (1, 10):
                for mode, tgt in tgts.items():
                    print(f"[bench_brokers] round {r + 1}/{rounds} {mode} c={conc} ({warmup:g} s warm-up + "
                          f"{duration:g} s)", flush=True)
                    cell = bc.http_cell(tgt, conc, warmup, duration, up)
                    best = res["http"].setdefault(mode, {}).get(f"c{conc}")
                    if best is None or cell["rps"] > best["rps"]:
                        res["http"][mode][f"c{conc}"] = cell
                    bad = cell["upstream"]
                    if bad["mismatch"] or bad["missing"]:
                        res.setdefault("bad", []).append((mode, conc))
        res["token_grants_during_cells"] = tstats["grants"]
        n = 2000 if args.quick else 10000
        res["in_process_us"] = in_process(real, placeholder, entry, n)
        res["mint"] = one_mint(entry, 20 if args.quick else 50)
    finally:
        for c in children:
            c.stop()
        if srv is not None:
            srv.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print("| cell | static req/s | brokered req/s | brokered / static | upstream ok (static, brokered) |")
    print("|---|---|---|---|---|")
    for c in ("c1", "c10"):
        s, b = res["http"]["static"][c], res["http"]["brokered"][c]
        print(f"| {c} | {s['rps']:.0f} | {b['rps']:.0f} | {b['rps'] / s['rps']:.2f}x | "
              f"{s['upstream']['ok']}, {b['upstream']['ok']} |")
    ip = res["in_process_us"]
    print(f"\nin process, apply() + 1 KiB scrub per request: static {ip['static']:.1f} us, brokered (cached) "
          f"{ip['brokered']:.1f} us ({ip['brokered'] / ip['static']:.2f}x)")
    print(f"one mint (refresh grant to a loopback token endpoint): median {res['mint']['median_ms']:.2f} ms, "
          f"p90 {res['mint']['p90_ms']:.2f} ms; grants during the req/s cells: {res['token_grants_during_cells']} "
          f"(one per gate: the token is cached)")
    bad = res.get("bad")
    if bad:
        print(f"WARNING: the upstream got a wrong or missing value in {bad}")
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
