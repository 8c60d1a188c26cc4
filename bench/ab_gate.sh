#!/bin/bash
# A/B of the gate's CPU per request between two source trees, on this machine, interleaved.
#
#   bash bench/ab_gate.sh OLD_SRC NEW_SRC [ROUNDS] [SECONDS]
#   e.g.  git worktree add /tmp/base 38670fd && bash bench/ab_gate.sh /tmp/base/src src 10
#   OLD_ENV / NEW_ENV: extra VAR=value words for one side's gate, e.g. the same tree pure Python
#   against compiled:  OLD_ENV=AGENTVM_GATE_PURE=1 bash bench/ab_gate.sh src src
#
# One upstream and two gates (bench_gate.py's roles; each gate imports agentvm from its own
# tree via PYTHONPATH) run side by side; the load generator (c=10, keep-alive) alternates
# between them, SECONDS (default 1.5) per cell, ROUNDS (default 10) times. Timings on a shared
# 2-core VM drift by 30% over minutes: interleaving puts both trees in the same moments, so
# the difference survives the drift where two separate bench_gate.py runs do not.
# Prints, per tree, the gate's CPU per request (min and median), p99 latency and req/s.
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "$2"); ROUNDS=${3:-10}; DUR=${4:-1.5}
P=${PYTHON:-/opt/agentvm/venv/bin/python}
B=$(dirname "$(realpath "$0")")/bench_gate.py
D=$(mktemp -d /tmp/agentvm-ab.XXXX)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$D"' EXIT
"$P" "$B" --role upstream > "$D/up.out" &
for _ in $(seq 100); do [ -s "$D/up.out" ] && break; sleep 0.1; done
PORT=$(awk '{print $2}' "$D/up.out")
env PYTHONPATH="$OLD" ${OLD_ENV:-} "$P" "$B" --role gate --ports "$PORT,1" --sock "$D/a.sock" --state "$D/sa" > "$D/a.out" &
AP=$!
env PYTHONPATH="$NEW" ${NEW_ENV:-} "$P" "$B" --role gate --ports "$PORT,1" --sock "$D/b.sock" --state "$D/sb" > "$D/b.out" &
BP=$!
for _ in $(seq 100); do grep -q READY "$D/a.out" && grep -q READY "$D/b.out" && break; sleep 0.1; done
REQ="GET http://bench.test:$PORT/ HTTP/1.1\r\nHost: bench.test:$PORT\r\n\r\n"
for _ in $(seq "$ROUNDS"); do
  for s in a b; do
    pid=$AP; [ $s = b ] && pid=$BP
    echo "$s $("$P" "$B" --role loadgen --conc 10 --warmup 0.3 --duration "$DUR" --request "$REQ" --unix "$D/$s.sock" --watch-pid $pid)"
  done
done > "$D/res"
"$P" - "$D/res" "$OLD" "$NEW" "${OLD_ENV:-}" "${NEW_ENV:-}" <<'PY'
import json, statistics as st, sys
rows = {"a": [], "b": []}
for line in open(sys.argv[1]):
    s, j = line.split(" ", 1)
    d = json.loads(j)
    rows[s].append((1e6 * d["proxy_cpu"] / d["rps"], d["p99_ms"], d["rps"]))
for s, name in (("a", sys.argv[2] + (" " + sys.argv[4] if sys.argv[4] else "")),
                ("b", sys.argv[3] + (" " + sys.argv[5] if sys.argv[5] else ""))):
    us = [r[0] for r in rows[s]]
    print(f"{name}: CPU/request min {min(us):.1f} us, median {st.median(us):.1f} us; "
          f"p99 median {st.median([r[1] for r in rows[s]]):.2f} ms; req/s median {st.median([r[2] for r in rows[s]]):.0f}")
PY
