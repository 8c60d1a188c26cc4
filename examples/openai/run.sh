#!/usr/bin/env bash
# Credentials by reference, end to end: the real openai SDK in a sandbox talks to a local
# OpenAI-compatible stub with a placeholder key; the stub sees the real (fake) key.
# Needs the SDK from `bash scripts/install.sh --test` (/opt/agentvm/testlib).
set -euo pipefail
cd "$(dirname "$0")"
read -r -a AGENTVM <<< "${AGENTVM:-agentvm}"   # e.g. AGENTVM="python3 -m agentvm"
PY="${AGENTVM_PYTHON:-/opt/agentvm/venv/bin/python}"
TESTLIB="${AGENTVM_TESTLIB:-/opt/agentvm/testlib}"
work=$(mktemp -d /tmp/agentvm-openai-demo-XXXX); chmod 755 "$work"
REAL="sk-demo-REAL-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"   # a fake value
"$PY" stub.py "$work/ca" "$work/port" "$REAL" & stub=$!
trap 'kill $stub 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 50); do [ -s "$work/port" ] && break; sleep 0.1; done
printf '%s' "$REAL" | "${AGENTVM[@]}" secret set demo-openai-key >/dev/null
sed -e "s|@PORT@|$(cat "$work/port")|g" -e "s|@CA@|$work/ca/ca.pem|" -e "s|@TESTLIB@|$TESTLIB|" agent.yaml.in > "$work/agent.yaml"
"${AGENTVM[@]}" run -f "$work/agent.yaml"
