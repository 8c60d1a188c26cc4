#!/usr/bin/env python3
"""What the embedded run's confined gate costs (issue 43), against its baselines in the same run.

    python3 bench/bench_embedded_gate.py [--runs N] [--json]

Interleaved rounds (wall and CPU medians; CPU = the children's user + system time, what a
shared machine inflates less than wall time), every row a new `agentvm run` process as a user
types it (AGENTVM_NO_DAEMON=1), /bin/true or a one-request client as the payload:

  bare bwrap                      `bwrap --unshare-all --ro-bind / / /bin/true` (the baseline)
  run -- true (confined)          the default: the gate worker is forked before prepare and
                                  killed unused at the end (the sandbox never connects)
  run -- true (unconfined)        AGENTVM_GATE_UNCONFINED=1: the old in-process gate (the "before")
  run --network none -- true      no gate at all
  first request (confined)        `agentvm run -- python3 client`: the client's time from its
                                  request to the gate's answer (a 403: no upstream involved) -
                                  the worker's start (imports, CA, confinement) is in it - and
                                  the whole run's wall time
  first request (unconfined)      the same through the in-process gate
  ... credentialed                the same with an agent file binding one (fake) credential: its
                                  gate worker is forked before prepare and imports the gate
                                  while the sandbox is set up (a run without credentials forks
                                  it at the first connection: nothing to do before)

Ratios: each row against bare bwrap; confined against unconfined.
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
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CLIENT = r"""
import socket, time
t = time.perf_counter()
s = socket.create_connection(('127.0.0.1', 3128), timeout=30)
s.sendall(b'GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n')
b = s.recv(64)
print('FIRST_MS %.3f %s' % ((time.perf_counter() - t) * 1000, b[:12].decode(errors='replace')))
"""


def main() -> int:
    from _python import agentvm_python

    agentvm_python()
    from bench_startup import measure

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_embedded_gate: run as root (the confined gate switches uid)", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="agentvm-bench-embgate-", dir="/tmp"))
    os.chmod(home, 0o711)
    os.environ["AGENTVM_HOME"] = str(home)
    from agentvm import native
    from agentvm.paths import default_paths

    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "src" / "agentvm"), quiet=1)
    bwrap = str(native.bwrap_path(default_paths().ensure().libexec))
    entry = Path(sys.executable).parent / "agentvm"
    cli = [str(entry)] if entry.exists() else [sys.executable, "-m", "agentvm"]
    base = dict(os.environ, AGENTVM_NO_DAEMON="1")
    base.pop("AGENTVM_GATE_UNCONFINED", None)
    unconf = dict(base, AGENTVM_GATE_UNCONFINED="1")

    def bare():
        subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "/bin/true"], check=True)

    def run(env, *extra):
        def fn():
            r = subprocess.run(cli + ["run", *extra, "--", "/bin/true"], stdin=subprocess.DEVNULL, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            assert r.returncode == 0
        return fn

    first: dict[str, list[float]] = {"confined": [], "unconfined": [], "confined, credentialed": [],
                                     "unconfined, credentialed": []}
    r = subprocess.run(cli + ["secret", "set", "bench-key"], input=b"fake-bench-value-0123456789", env=base,
                       capture_output=True)
    assert r.returncode == 0, r.stderr
    spec = home / "cred.yaml"
    spec.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: benchcred}\nspec:\n  riskTier: L3\n"
                    "  egress:\n    hosts: {api.test: 127.0.0.1}\n    allow: [{host: api.test, ports: [9]}]\n"
                    "  credentials:\n    - {name: k, env: K, ref: 'vault:bench-key', hosts: [api.test], "
                    "inject: {header: X-Api-Key}}\n")

    def request(env, key, *extra):
        def fn():
            r = subprocess.run(cli + ["run", *extra, "--", "/usr/bin/python3", "-c", CLIENT], stdin=subprocess.DEVNULL,
                               env=env, capture_output=True, text=True)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("FIRST_MS")), None)
            assert r.returncode == 0 and line and "403" in line, (r.returncode, r.stdout[-500:], r.stderr[-500:])
            first[key].append(float(line.split()[1]))
        return fn

    rows = {
        "bare bwrap": bare,
        "run -- true (confined)": run(base),
        "run -- true (unconfined)": run(unconf),
        "run --network none -- true": run(base, "--network", "none"),
        "first request run (confined)": request(base, "confined"),
        "first request run (unconfined)": request(unconf, "unconfined"),
        "first request run (confined, credentialed)": request(base, "confined, credentialed", "-f", str(spec)),
        "first request run (unconfined, credentialed)": request(unconf, "unconfined, credentialed", "-f", str(spec)),
    }
    wall: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    for fn in rows.values():  # warm-up (the first run creates the CA, the image of /etc...)
        fn()
    for k in first:
        first[k].clear()
    for _ in range(args.runs):
        for name, fn in rows.items():
            wall[name] += measure(fn, 1, warmup=0, cpu=cpu[name])
    shutil.rmtree(home, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in wall.items()}
    out = {k: {"median_ms": round(med[k], 2), "cpu_median_ms": round(statistics.median(cpu[k]), 2),
               "x_bare_bwrap": round(med[k] / med["bare bwrap"], 2)} for k in rows}
    for k, xs in first.items():
        out[f"first answer ({k}), in the sandbox"] = {"median_ms": round(statistics.median(xs), 2)}
    out["ratio confined/unconfined, run -- true"] = round(med["run -- true (confined)"] / med["run -- true (unconfined)"], 3)
    for k in ("", ", credentialed"):
        out[f"ratio confined/unconfined, first answer{k}"] = round(statistics.median(first["confined" + k])
                                                                  / statistics.median(first["unconfined" + k]), 3)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"runs: {args.runs} (interleaved)")
    for k, v in out.items():
        if isinstance(v, dict):
            extra = "".join(f"  {f}={v[f]}" for f in ("cpu_median_ms", "x_bare_bwrap") if f in v)
            print(f"{k:44s} {v['median_ms']:9.2f} ms{extra}")
        else:
            print(f"{k:44s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
