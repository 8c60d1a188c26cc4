#!/usr/bin/env bash
# The main job: check the host, then run a demo agent in a sandbox and show a few escape
# attempts being contained. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
AGENTVM="${AGENTVM_VENV:-/opt/agentvm/venv}/bin/agentvm"

echo "== agentvm doctor"
"$AGENTVM" doctor
echo
echo "== a demo agent (examples/hello-agent.yaml): python inside the sandbox, durable /workspace"
"$AGENTVM" run -f examples/hello-agent.yaml
echo
echo "== a hostile process tries to get out (every line should say DENIED)"
AWS_SECRET_ACCESS_KEY=fake-demo-operator-secret "$AGENTVM" run --timeout 30s --memory 128M -- /usr/bin/python3 - <<'PY' || true
import os, socket, sys
def attempt(what, fn):
    try:
        fn()
        print(f"ESCAPED  {what}")
    except Exception as e:
        print(f"DENIED   {what}: {type(e).__name__}: {e}")
attempt("read /etc/shadow", lambda: open("/etc/shadow").read())
attempt("list /root", lambda: os.listdir("/root"))
attempt("write /usr/bin/evil", lambda: open("/usr/bin/evil", "w"))
attempt("connect out (TCP 192.0.2.1:443)", lambda: socket.create_connection(("192.0.2.1", 443), timeout=2))
attempt("raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
def userns():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
attempt("new user namespace", userns)
def secret_env():
    leaked = [k for k in os.environ if "SECRET" in k or "TOKEN" in k]
    if not leaked:
        raise PermissionError("no operator secrets in the environment")
attempt("steal the operator's env", secret_env)
PY
