#!/usr/bin/env python3
"""Instructions per TLS-terminated, credential-swapped request of the gate (the counterpart of
icount_gate.sh for bench_credentials.py's path): counted under valgrind's callgrind, not timed.

    python3 bench/icount_swap.py SRC [SRC...] [--n 1000]

The gate and the upstream run on PYTHON (default /opt/agentvm/venv/bin/python, which has the
gate's dependencies: uvloop, httptools), as in icount_gate.sh.

For each source tree: bench_credentials.py's upstream (HTTPS, checks the real value) and its
gate (one credential bound to bench.test, every CONNECT terminated) importing agentvm from
that tree; one client opens a CONNECT tunnel, TLS to the gate's CA, and sends requests with the
placeholder one after another; after 200 warm-up requests the counters are zeroed, N requests
are counted, and the gate's user-space instructions / N are printed. Loopback and unix sockets
only. Needs valgrind (apt-get install valgrind); about a minute per tree. ICOUNT_KEEP=FILE keeps
the (last tree's) callgrind profile there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = os.environ.get("PYTHON", "/opt/agentvm/venv/bin/python")
sys.path.insert(0, str(HERE))

import bench_credentials as bc  # noqa: E402
from bench_gate import connect_through  # noqa: E402


def count(src: Path, n: int) -> int:
    env = dict(os.environ, PYTHONPATH=str(src))
    code = ("import json,sys; from agentvm.gate.credentials import compile_credentials, make_placeholder; "
            "sys.path.insert(0, sys.argv[1]); import bench_credentials as bc; "
            "print(make_placeholder(compile_credentials([bc.cred_spec()])[0], int(sys.argv[2])))")
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-icount-swap-", dir="/tmp"))
    os.chmod(tmp, 0o700)
    procs: list[subprocess.Popen] = []
    try:
        ca, leaf, key = bc.make_test_ca(tmp)
        real = "sk-bench-REAL-" + secrets.token_urlsafe(24)
        ph = subprocess.run([PY, "-c", code, str(HERE), str(len(real))], env=env, check=True,
                            capture_output=True, text=True).stdout.strip()
        (tmp / "cred.json").write_text(json.dumps({"real": real, "placeholder": ph}))
        me = [PY, str(HERE / "bench_credentials.py")]
        up = subprocess.Popen(me + ["--role", "upstream", "--cert", leaf, "--key", key, "--cred-file",
                                    str(tmp / "cred.json")], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(up)
        port = int(up.stdout.readline().split()[1])
        gate = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p", "--dump-instr=no",
                                 "--collect-jumps=no"] + me + ["--role", "gate", "--ports", str(port), "--sock",
                                                                str(tmp / "g.sock"), "--state", str(tmp / "st"),
                                                                "--cred-file", str(tmp / "cred.json"), "--upstream-ca", ca],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(gate)
        line = gate.stdout.readline()
        if not line.startswith("READY"):
            raise SystemExit(f"the gate of {src} did not start")
        ctx = bc.client_ctx(json.loads(line.split(None, 1)[1])["ca"])
        req = f"GET / HTTP/1.1\r\nHost: {bc.NAME}:{port}\r\nAuthorization: Bearer {ph}\r\n\r\n".encode()
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(tmp / "g.sock"))
        connect_through(s, port)
        tls = ctx.wrap_socket(s, server_hostname=bc.NAME)
        buf = bytearray()

        def one() -> None:
            tls.sendall(req)
            while True:
                r = bc.parse_response(buf)
                if r is not None:
                    del buf[:r[0]]
                    if r[1] != 200:
                        raise SystemExit(f"not a 200: {r}")
                    return
                data = tls.recv(65536)
                if not data:
                    raise SystemExit("the gate closed the tunnel")
                buf.extend(data)

        for _ in range(200):
            one()
        subprocess.run(["callgrind_control", "-z", str(gate.pid)], capture_output=True, check=True)
        for _ in range(n):
            one()
        subprocess.run(["callgrind_control", "-d", str(gate.pid)], capture_output=True, check=True)
        time.sleep(0.5)
        dump = max(glob.glob(f"{tmp}/cg.*"), key=os.path.getmtime)
        if os.environ.get("ICOUNT_KEEP"):  # the profile itself, for callgrind_annotate
            shutil.copy(dump, os.environ["ICOUNT_KEEP"])
        with open(dump) as f:
            total = int(next(ln.split()[1] for ln in f if ln.startswith("totals:")))
        tls.close()
        return total // n
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="+", type=Path)
    ap.add_argument("--n", type=int, default=1000)
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        print("icount_swap.py: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    for src in args.src:
        print(f"{src.resolve()}: {count(src.resolve(), args.n)} instructions per terminated, swapped request "
              f"(N={args.n})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
