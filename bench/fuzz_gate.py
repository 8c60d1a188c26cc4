"""Long fuzzing of the gate's parsers (issue 43): the CI runs tests/fuzz/ for a few seconds per
target with fixed examples; this runs them for as long as you give it.

Two engines:

* ``--engine atheris`` (default when installed): coverage-guided (libFuzzer) over raw bytes,
  one target at a time, on the pure-Python modules (``AGENTVM_GATE_PURE=1``: the compiled
  request path in gate/_accel gives atheris no coverage; ``--compiled`` fuzzes it blind), each target a function below that must only ever raise the parser's
  own refusal. A crash is written to ``--crash-dir`` (libFuzzer's ``crash-*`` file) and printed:
  turn it into a regression test under tests/fuzz/ and fix it.
* ``--engine hypothesis``: the grammars of tests/fuzz/grammar.py, random seeds, many examples
  (``AGENTVM_FUZZ_EXAMPLES``, ``AGENTVM_FUZZ_RANDOM=1``), each target's test file run by pytest
  in a subprocess until the time is up.

    /opt/agentvm/venv/bin/python bench/fuzz_gate.py --seconds 60            # every target, 60 s each
    /opt/agentvm/venv/bin/python bench/fuzz_gate.py --target h1-head --seconds 600
    /opt/agentvm/venv/bin/python bench/fuzz_gate.py --engine hypothesis --seconds 120

Prints, per target: executions (or examples), seconds, crashes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------- atheris targets
def t_h1_head(data: bytes) -> None:
    from agentvm.gate import framing, h1

    hr = h1.HeadReader()
    try:
        if not hr.feed(data):
            return
        req, body = h1.parse_head(hr.head, hr.rest)
        h1.forward_headers(req, req.host)
    except (h1.ProtocolError, framing.FramingError):
        return
    assert not any(c in req.host for c in "\r\n\x00 "), req.host


def t_chunked(data: bytes) -> None:
    from agentvm.gate import framing

    b = framing.RequestBody(None, True)
    try:
        for i in range(0, len(data), 7):
            b.receive_data(data[i:i + 7])
            while b.next_event() not in (framing.END, framing.NEED_DATA):
                pass
        b.receive_data(b"")
        while b.next_event() not in (framing.END, framing.NEED_DATA):
            pass
    except (framing.FramingError, EOFError):
        pass


def t_response(data: bytes) -> None:
    from agentvm.gate import framing

    r = framing.ResponseReader("GET")
    try:
        r.receive_data(data)
        r.receive_data(b"")
        while r.next_event() not in (framing.END, framing.NEED_DATA):
            pass
    except framing.FramingError:
        pass


def t_decoder(data: bytes) -> None:
    from agentvm.gate import encoding

    if not data:
        return
    codings = [b"gzip", b"deflate", b"br", b"zstd", b"gzip, br", b"zstd, gzip", b"x-gzip", b"deflate, deflate"]
    try:
        d = encoding.Decoder(codings[data[0] % len(codings)])
        n = 0
        for p in d.feed(data[1:]):
            n += len(p)
            assert len(p) <= encoding.PIECE + (1 << 20)
            if n > 64 << 20:
                return  # (a bomb: bounded pieces is what is checked)
        for p in d.finish():
            assert len(p) <= encoding.PIECE + (1 << 20)
    except encoding.DecodeError:
        pass
    s = encoding.Sniffer()
    s.feed(data, final=True)


def t_otlp(data: bytes) -> None:
    from agentvm.gate.telemetry import ExportRefused, stamp

    if not data:
        return
    ctype = b"application/json" if data[0] & 1 else b"application/x-protobuf"
    coding = b"gzip" if data[0] & 2 else b""
    try:
        stamp(data[1:], ctype, coding, "traces", "sb", "ag")
    except ExportRefused:
        pass


def t_h2(data: bytes) -> None:
    from tests.fuzz import test_fuzz_h2 as t

    policy = t.compile_egress(None, extra_allow=["api.test:443"], extra_hosts={"api.test": "127.0.0.1"})
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    async def main():
        ep = t.Endpoint(t._GATE, "sb-fuzz", "fuzz", policy, t._DIR / "sb.sock", t._DIR / "logs" / "sb-fuzz.egress.jsonl")
        client = t._Side([preface + data])
        upstream = t._Side([], until=client.done)
        try:
            await asyncio.wait_for(t.H2Bridge(ep, client, upstream, t.ex.Tunnel("api.test", 443, "127.0.0.1",
                                                                                  "api.test")).run(), 10)
        finally:
            ep.close_log()

    asyncio.run(main())


TARGETS = {"h1-head": t_h1_head, "chunked": t_chunked, "response": t_response, "decoder": t_decoder,
           "otlp": t_otlp, "h2": t_h2}
HYPOTHESIS = {"h1-head": "test_fuzz_h1.py", "chunked": "test_fuzz_h1.py", "response": "test_fuzz_h1.py",
              "decoder": "test_fuzz_encoding.py", "otlp": "test_fuzz_telemetry.py", "h2": "test_fuzz_h2.py",
              "jsonrpc": "test_fuzz_jsonrpc.py"}


def run_atheris_child(target: str, seconds: int, crash_dir: Path) -> None:
    """(in a child process: libFuzzer exits the process when it is done or finds a crash)"""
    import atheris

    with atheris.instrument_imports(include=["agentvm"]):
        import agentvm.gate.encoding  # noqa: F401
        import agentvm.gate.framing  # noqa: F401
        import agentvm.gate.h1  # noqa: F401
        import agentvm.gate.telemetry  # noqa: F401
        if target == "h2":
            import agentvm.gate.h2relay  # noqa: F401
    fn = TARGETS[target]
    crash_dir.mkdir(parents=True, exist_ok=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", f"-artifact_prefix={crash_dir}/{target}-",
                   "-print_final_stats=1", "-max_len=4096", "-rss_limit_mb=1024"], fn)
    atheris.Fuzz()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("atheris", "hypothesis"), default=None)
    ap.add_argument("--target", choices=sorted(set(TARGETS) | set(HYPOTHESIS)), action="append")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--crash-dir", default="/tmp/agentvm-fuzz-crashes")
    ap.add_argument("--compiled", action="store_true",
                    help="atheris: fuzz the compiled request path (gate/_accel, what production loads) - no coverage "
                         "feedback from it; by default the same modules as plain Python (AGENTVM_GATE_PURE=1), which "
                         "atheris instruments")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        run_atheris_child(ns.child, ns.seconds, Path(ns.crash_dir))
        return 0
    engine = ns.engine
    if engine is None:
        try:
            import atheris  # noqa: F401
            engine = "atheris"
        except ImportError:
            engine = "hypothesis"
    targets = ns.target or (sorted(TARGETS) if engine == "atheris" else sorted(set(HYPOTHESIS.values())))
    failures = 0
    print(f"engine {engine}, {ns.seconds} s per target")
    for target in targets:
        t0 = time.monotonic()
        if engine == "atheris":
            if target not in TARGETS:
                print(f"{target:10s} (hypothesis only: --engine hypothesis)")
                continue
            import shutil
            import tempfile

            scratch = tempfile.mkdtemp(prefix="agentvm-test-fuzzrun-")  # (libFuzzer exits without atexit: removed here)
            env = dict(os.environ) if ns.compiled else {**os.environ, "AGENTVM_GATE_PURE": "1"}
            env["TMPDIR"] = scratch
            try:
                r = subprocess.run([sys.executable, __file__, "--child", target, "--seconds", str(ns.seconds),
                                    "--crash-dir", ns.crash_dir], capture_output=True, text=True, env=env)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            stats = [ln for ln in r.stderr.splitlines() if ln.startswith("stat::number_of_executed_units")]
            runs = stats[-1].split(":")[-1].strip() if stats else "?"
            crashed = r.returncode != 0
            print(f"{target:10s} {runs:>10s} executions {time.monotonic() - t0:6.1f} s  "
                  f"{'CRASH: ' + ns.crash_dir if crashed else 'no crash'}")
            if crashed:
                failures += 1
                print("\n".join(r.stderr.splitlines()[-30:]))
        else:
            test = HYPOTHESIS.get(target, target)
            env = {**os.environ, "AGENTVM_FUZZ_EXAMPLES": "2000", "AGENTVM_FUZZ_RANDOM": "1"}
            rounds = 0
            while time.monotonic() - t0 < ns.seconds:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                    str(ROOT / "tests" / "fuzz" / test)], env=env, cwd=ROOT, capture_output=True,
                                   text=True)
                rounds += 1
                if r.returncode != 0:
                    failures += 1
                    print(r.stdout[-4000:])
                    break
            print(f"{test:24s} {rounds} rounds of 2000 examples {time.monotonic() - t0:6.1f} s "
                  f"{'FAILED' if r.returncode else 'no failure'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
