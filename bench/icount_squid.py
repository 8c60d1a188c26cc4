#!/usr/bin/env python3
"""Squid's CPU instructions per proxied request, counted under valgrind's callgrind: the baseline
for icount_gate.sh's count of the gate (the same request, the same upstream, one keep-alive
connection, one request after another).

    python3 bench/icount_squid.py [--n 2000]

Squid runs as in bench_gate.py (its config, `squid -N`, no access log, no cache). It drops to its
own user, so callgrind cannot be told when to count (vgdb needs the same user): Squid is run
twice, for 300 and for 300 + N requests, each to its exit, and the difference over N is the count
per request (start-up and shut-down are the same in both). User-space instructions of the
whole Squid process, as icount_gate.sh counts the gate's; the kernel's share (system calls) is
in neither. Loopback only. Needs valgrind and squid (apt-get install valgrind squid); about a
minute.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gate as bg  # noqa: E402


def requests(port: int, upstream: int, n: int) -> None:
    req = f"GET http://{bg.NAME}:{upstream}/ HTTP/1.1\r\nHost: {bg.NAME}:{upstream}\r\n\r\n".encode()
    bg.sequential(socket.create_connection((bg.HOST, port)), req, n, "squid")


def count(upstream: int, n: int) -> int:
    """Instructions of one Squid run that serves ``n`` requests, from start to exit."""
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-icount-squid-", dir="/tmp"))
    os.chmod(tmp, 0o755)  # (squid's user reaches its folder inside)
    try:
        out = tmp / "squid"  # (start_squid makes it, owned by squid's user: it writes the count at exit)
        vg = ["valgrind", "--tool=callgrind", "--vgdb=no", f"--callgrind-out-file={out}/cg.%p", "--dump-instr=no",
              "--collect-jumps=no"]
        p, port, _ = bg.start_squid(tmp, lambda m: None, prefix=vg, ready=180)
        for f in glob.glob(f"{out}/cg.*"):  # made by root at start: removed, so squid's user can make it at exit
            os.unlink(f)
        try:
            requests(port, upstream, n)
        except BaseException:
            p.kill()
            p.wait()
            raise
        time.sleep(0.5)
        p.send_signal(2)
        p.wait(120)
        dump = glob.glob(f"{out}/cg.*")
        if not dump:
            raise SystemExit("callgrind wrote no count (squid could not write it?)")
        with open(dump[0]) as f:
            return int(next(ln.split()[1] for ln in f if ln.startswith("totals:")))
    finally:
        if os.environ.get("KEEP"):
            print("kept", tmp, file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", str(tmp)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="requests counted (default 2000)")
    args = ap.parse_args()
    if not any(os.access(os.path.join(d, "valgrind"), os.X_OK) for d in os.environ.get("PATH", "").split(":")):
        raise SystemExit("icount_squid.py: needs valgrind (apt-get install valgrind)")
    up = subprocess.Popen([sys.executable, str(HERE / "bench_gate.py"), "--role", "upstream"], stdout=subprocess.PIPE,
                          text=True)
    try:
        upstream = int(up.stdout.readline().split()[1])
        base, more = count(upstream, 300), count(upstream, 300 + args.n)
    finally:
        up.terminate()
        up.wait()
    print(f"squid: {(more - base) // args.n} instructions per request (N={args.n}; {more} - {base} instructions in "
          f"two runs of {300 + args.n} and 300 requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
