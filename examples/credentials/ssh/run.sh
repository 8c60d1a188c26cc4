#!/usr/bin/env bash
# SSH without a key inside the sandbox (see agent.yaml.in and docs/credentials.md): a real sshd
# in a network namespace on loopback (peer.py), the key in the vault, `git push` over SSH from
# the sandbox through the gate. The last line says what the server received.
# Needs root (ip netns) and `bash scripts/install.sh --test` (openssh-server, netcat-openbsd).
set -euo pipefail
cd "$(dirname "$0")"
read -r -a AGENTVM <<< "${AGENTVM:-agentvm}"   # e.g. AGENTVM="python3 -m agentvm"
PY="${AGENTVM_PYTHON:-/opt/agentvm/venv/bin/python}"
work=$(mktemp -d "/tmp/agentvm-ssh-demo-XXXX"); chmod 755 "$work"
"$PY" peer.py "$work" & peer=$!
trap 'kill $peer 2>/dev/null || true; wait $peer 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 300); do [ -s "$work/ready" ] && break; sleep 0.1; done
[ -s "$work/ready" ] || { echo "the sshd did not start" >&2; exit 1; }
# the private key goes into the vault from a file, never on a command line; then it is gone
"${AGENTVM[@]}" secret set demo-ssh-key < "$work/key" >/dev/null
rm -f "$work/key" "$work/key.pub"
sed -e "s|@ADDR@|$(cat "$work/addr")|" -e "s|@KNOWN_HOST@|$(cat "$work/known_host")|" \
    -e "s|@REPO@|$(cat "$work/repo")|" agent.yaml.in > "$work/agent.yaml"
"${AGENTVM[@]}" run -f "$work/agent.yaml"
"${AGENTVM[@]}" secret rm demo-ssh-key >/dev/null
echo "sshd received: $(git --git-dir "$(cat "$work/repo")" log --format='%s (%an)' main)"
