# Shared by the brokered-credential examples (sourced by KIND/run.sh): start the local peers,
# store the long-lived secret in the vault, fill in the agent file, run it, say what the
# upstream saw. Needs `bash scripts/install.sh --test` (authlib, moto, Debian's awscli).
set -euo pipefail
read -r -a AGENTVM <<< "${AGENTVM:-agentvm}"   # e.g. AGENTVM="python3 -m agentvm"
PY="${AGENTVM_PYTHON:-/opt/agentvm/venv/bin/python}"
TESTLIB="${AGENTVM_TESTLIB:-/opt/agentvm/testlib}"
kind=$(basename "$PWD")
work=$(mktemp -d "/tmp/agentvm-broker-demo-XXXX"); chmod 755 "$work"
"$PY" ../peers.py "$kind" "$work" & peers=$!
trap 'kill $peers 2>/dev/null || true; wait $peers 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 300); do [ -s "$work/port" ] && break; sleep 0.1; done
[ -s "$work/port" ] || { echo "the local peers did not start" >&2; exit 1; }
# the long-lived secret goes into the vault from a file, never on a command line
"${AGENTVM[@]}" secret set "demo-$kind" < "$work/entry.json" >/dev/null
rm -f "$work/entry.json"
sed -e "s|@PORT@|$(cat "$work/port")|g" -e "s|@CA@|$work/ca/test-ca.pem|" -e "s|@TESTLIB@|$TESTLIB|" \
    -e "s|@ROLE@|$(cat "$work/role" 2>/dev/null || true)|" agent.yaml.in > "$work/agent.yaml"
"${AGENTVM[@]}" run -f "$work/agent.yaml"
"${AGENTVM[@]}" secret rm "demo-$kind" >/dev/null
kill -TERM $peers; wait $peers || true
tail -n 1 "$work/seen.txt"
