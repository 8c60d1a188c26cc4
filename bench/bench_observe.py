#!/usr/bin/env python3
"""What observing a gate decision costs the daemon, against what the gate already pays for it.

Every decision the gate makes is written to its NDJSON log (``json.dumps`` + a line write);
that is the baseline, measured in the same run. On top of it the daemon observes each one:

* ``metrics``: ``Observer.observe`` (Prometheus counters, the console's recent list and
  per-host summary);
* ``metrics + tracing``: the same plus ``Tracing.observe`` (an egress span and, for a swap,
  a credential span, built on the tracing worker thread), exported to a throw-away OTLP
  receiver on loopback; the loop's own share (the hand-off) is shown apart;
* ``budget meter``: reading usage from a streamed OpenAI-style response (per response).

Prints microseconds per decision and the ratio to the baseline. No network but loopback.

    python3 bench/bench_observe.py [--n 20000] [--json]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

REC = {"time": 0.0, "sandbox": "bench-1a2b3c4d", "agent": "bench", "phase": "request", "host": "api.test", "port": 443,
       "method": "GET", "path": "/v1/users/12345/items?page=2", "rule": "allow[0]", "verdict": "allow",
       "reason": "GET to api.test:443 allowed by rule allow[0]", "bytes_out": 120, "bytes_in": 2048,
       "upstream_ms": 1.7, "credentials": ["k"]}


def per_op(fn, n: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def receiver() -> tuple[http.server.ThreadingHTTPServer, int]:
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s, s.server_address[1]


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _python import agentvm_python

    agentvm_python()  # python3 without agentvm: again on its venv's python
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from agentvm.gate.budget import Meter
    from agentvm.observe.metrics import Observer
    from agentvm.observe.tracing import Tracing

    tmp = Path(tempfile.mkdtemp(prefix="bench-observe-"))
    log = open(tmp / "x.egress.jsonl", "a", buffering=1, encoding="utf-8")
    rec = dict(REC)

    def baseline():
        rec["time"] = time.time()
        log.write(json.dumps(rec, sort_keys=True, ensure_ascii=True) + "\n")

    obs = Observer(sandboxes_by_state=dict, approvals_pending=lambda: 0, audit_status=lambda: (0, True))
    ev = {"kind": "egress", **REC}

    def metrics():
        baseline()
        ev["time"] = rec["time"]
        obs.observe(ev)

    srv, port = receiver()
    tr = Tracing(f"http://127.0.0.1:{port}")
    from types import SimpleNamespace

    st = tr.begin(SimpleNamespace(name="bench", substrate="bwrap", credentials=()))
    st.bind(REC["sandbox"])

    def traced_batch(n: int) -> float:
        """metrics on the loop + spans on the tracing worker: the whole CPU cost per decision
        (submit n, then wait until the worker has turned every one into spans)."""
        t0 = time.perf_counter()
        for _ in range(n):
            metrics()
            tr.observe(ev)
        tr.flush(timeout=600)
        return (time.perf_counter() - t0) / n * 1e6

    def submit_only(n: int) -> float:
        """what the loop itself pays to hand a decision to the tracing worker"""
        t0 = time.perf_counter()
        for _ in range(n):
            tr.submit(("noop",))
        return (time.perf_counter() - t0) / n * 1e6

    chunks = [b"data: " + json.dumps({"model": "gpt-x", "choices": [{"delta": {"content": "tok " * 4}}]}).encode() + b"\n\n"
              for _ in range(200)]
    chunks.append(b"data: " + json.dumps({"model": "gpt-x", "choices": [], "usage": {"prompt_tokens": 50,
                                                                                   "completion_tokens": 800}}).encode()
                  + b"\n\ndata: [DONE]\n\n")

    def meter():
        m = Meter()
        m.head(200, [(b"content-type", b"text/event-stream")])
        for c in chunks:
            m.feed(c)
        m.finish(300)

    base = per_op(baseline, a.n)
    rows = [("decision log write (baseline)", base), ("+ metrics (on the loop)", per_op(metrics, a.n)),
            ("  tracing hand-off (on the loop)", submit_only(a.n)),
            ("+ metrics + tracing (all CPU)", traced_batch(a.n // 10))]
    meter_us = per_op(meter, max(a.n // 100, 50))
    tr.shutdown()
    srv.shutdown()
    log.close()
    out = {"n": a.n, "rows": [{"what": w, "us": round(us, 2), "x_baseline": round(us / base, 2)} for w, us in rows],
           "meter_us_per_streamed_response_201_events": round(meter_us, 1)}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"per gate decision, n={a.n} (pid {os.getpid()}):")
    for r in out["rows"]:
        print(f"  {r['what']:<34} {r['us']:>8.2f} us   {r['x_baseline']:>5.2f}x baseline")
    print(f"budget meter: {out['meter_us_per_streamed_response_201_events']} us per streamed response (201 SSE events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
