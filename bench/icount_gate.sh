#!/bin/bash
# The gate's CPU instructions per proxied request, counted (not timed), for one or more source
# trees: an A/B that the VM's noise cannot move.
#
#   bash bench/icount_gate.sh SRC [SRC...]       e.g.  git worktree add /tmp/base HEAD~1
#                                                       bash bench/icount_gate.sh /tmp/base/src src
#   N (default 2000): requests counted; ENV_<i> (i = 1, 2, ...): extra VAR=value words for the
#   i-th tree's gate, e.g. the same tree as plain Python:  ENV_1=AGENTVM_GATE_PURE=1 ... src src
#
# Each tree's gate (bench_gate.py's role, importing agentvm from that tree via PYTHONPATH) runs
# under valgrind's callgrind. After 300 warm-up requests the counters are zeroed, N requests go
# one after another on one keep-alive connection (bench_gate.py --role sequential), and the
# count is dumped: user-space instructions of the whole gate process / N. Repeated runs agree
# within about 1%, where timed A/Bs (ab_gate.sh) drift by 30% on a shared VM. What it does not
# see: the kernel's share (system calls) and memory stalls - confirm a gain in time with
# ab_gate.sh. Needs valgrind (Debian: apt-get install valgrind). About 35 s per tree.
set -euo pipefail
N=${N:-2000}
P=${PYTHON:-/opt/agentvm/venv/bin/python}
B=$(dirname "$(realpath "$0")")/bench_gate.py
command -v valgrind >/dev/null || { echo "icount_gate.sh: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
D=$(mktemp -d /tmp/agentvm-icount.XXXX)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$D"' EXIT
"$P" "$B" --role upstream > "$D/up.out" &
for _ in $(seq 100); do [ -s "$D/up.out" ] && break; sleep 0.1; done
PORT=$(awk '{print $2}' "$D/up.out")
REQ="GET http://bench.test:$PORT/ HTTP/1.1\r\nHost: bench.test:$PORT\r\n\r\n"
i=0
for SRC in "$@"; do
  i=$((i + 1))
  SRC=$(realpath "$SRC")
  var="ENV_$i"
  extra=${!var:-}
  sock="$D/g$i.sock"
  env PYTHONPATH="$SRC" $extra valgrind --tool=callgrind --callgrind-out-file="$D/cg$i.%p" --dump-instr=no \
    --collect-jumps=no "$P" "$B" --role gate --ports "$PORT,1" --sock "$sock" --state "$D/s$i" \
    > "$D/g$i.out" 2> "$D/g$i.err" &
  vg=$!
  for _ in $(seq 600); do grep -q READY "$D/g$i.out" 2>/dev/null && break; sleep 0.2; done
  grep -q READY "$D/g$i.out" || { echo "the gate of $SRC did not start:"; tail -5 "$D/g$i.err"; exit 1; }
  "$P" "$B" --role sequential --count 300 --request "$REQ" --unix "$sock"
  callgrind_control -z "$vg" > /dev/null 2>&1
  "$P" "$B" --role sequential --count "$N" --request "$REQ" --unix "$sock"
  callgrind_control -d "$vg" > /dev/null 2>&1
  sleep 0.5
  ir=$(grep -h "^totals:" $(ls -t "$D"/cg$i.* | head -1) | awk '{print $2}')
  kill "$vg" 2>/dev/null; wait "$vg" 2>/dev/null || true
  printf '%s%s: %d instructions per request (N=%d)\n' "$SRC" "${extra:+ $extra}" $((ir / N)) "$N"
done
