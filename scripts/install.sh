#!/usr/bin/env bash
# Install agent-vm and everything it needs on a Debian 12 host (idempotent, quiet when done).
#   - Debian packages: a C compiler + libc headers (the small agentvm-helper is built from
#     source on first use), libseccomp, e2fsprogs and btrfs-progs (workspace filesystems: the
#     images, the pool's mkfs.btrfs), util-linux, and
#     runsc (gVisor, the `substrate: gvisor` sandbox), mmdebstrap (`agentvm image build`)
#     and openssh-client (ssh-keygen: signed images and signed fleet commits).
#   - a virtualenv (default /opt/agentvm/venv) with agentvm and its test extras.
#   - /usr/local/bin/agentvm -> the venv's entry point (no pyenv shim in the hot path; a
#     compiled client for `agentvm run` through the daemon, see below).
#   --test: also the HTTP clients the end-to-end tests run inside sandboxes (curl, git, node,
#   Debian's python3-requests/httpx/aiohttp/pip) and the software the compatibility suite runs
#   (CPython's test suite, ipykernel/jupyter_client, Flask, chromium, websocket-client).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${AGENTVM_VENV:-/opt/agentvm/venv}"
case "$VENV" in
  /*[!A-Za-z0-9._/-]* | [!/]*)  # it is written into a shebang, a Python and a C string below
    echo "install: AGENTVM_VENV must be an absolute path of letters, digits and ._/- (got: $VENV)" >&2
    exit 1 ;;
esac
PY="${PYTHON:-python3}"

want=(gcc libc6-dev python3-dev libseccomp2 e2fsprogs btrfs-progs util-linux mount procps runsc mmdebstrap openssh-client)
# netcat-openbsd: the ProxyCommand (`nc -X connect`) that takes a sandbox's ssh through the gate's CONNECT
want+=(netcat-openbsd)
if [ "${1:-}" = "--test" ]; then
  # real clients the end-to-end tests run *inside* sandboxes (Debian's, under /usr)
  want+=(curl git nodejs python3-requests python3-httpx python3-aiohttp python3-pip)
  # brokered credentials and the gate's ssh-agent: a real sshd (in a network namespace the
  # test creates) for `git push` over SSH, and Debian's AWS CLI inside a sandbox (aws-sts)
  want+=(openssh-server awscli)
  # the compatibility suite (tests/compat): real software run inside sandboxes and compared
  # with the host - CPython's own tests, a Jupyter kernel, a Flask app, headless Chromium, a JDK
  # (javac and java.security through /usr links into /etc), fakeroot (chown answers)
  want+=(libpython3.11-testsuite python3-ipykernel python3-jupyter-client python3-flask chromium python3-websocket make)
  want+=(default-jdk-headless fakeroot)
  # `agentvm image export --oci` is checked by real OCI tools: skopeo copies/inspects the layout, umoci unpacks it
  want+=(skopeo umoci)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install: apt-get install ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "install: creating virtualenv $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.agentvm-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$PWD" ]; then
  echo "install: pip install -e .[test,accel] into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,accel]"
  echo "$PWD" > "$stamp"
  rm -f "$VENV/.agentvm-client"  # pip wrote its own bin/agentvm: the client below is built again
fi
# The entry point. `agentvm run -- CMD` with a daemon up is the hot path, and a Python start
# costs more than the whole round trip to the daemon: bin/agentvm is a small compiled client
# (src/agentvm/native/agentvm-client.c) that serves exactly that case and hands everything else
# to bin/agentvm-py - a lean Python entry point in place of pip's, which imports `re` on every
# start: it starts without `site` (-S), finds agent-vm where pip put it, and the CLI loads
# `site` itself on every path but the thin client's (agentvm.cli.main).
pkgdir="$("$VENV/bin/python" -c 'import agentvm, os; print(repr(os.path.dirname(os.path.dirname(os.path.abspath(agentvm.__file__)))))')"
pyentry="#!$VENV/bin/python -S
# agent-vm's Python entry point, written by scripts/install.sh (see there)
import sys
sys.path.append($pkgdir)
from agentvm.cli import main
sys.exit(main())"
if [ "$(cat "$VENV/bin/agentvm-py" 2>/dev/null)" != "$pyentry" ]; then
  printf '%s\n' "$pyentry" > "$VENV/bin/agentvm-py.new"
  chmod 755 "$VENV/bin/agentvm-py.new"
  mv -f "$VENV/bin/agentvm-py.new" "$VENV/bin/agentvm-py"
fi
client_src=src/agentvm/native/agentvm-client.c
client_stamp="$(sha256sum "$client_src" | cut -c1-64) $VENV"
if [ "$(cat "$VENV/.agentvm-client" 2>/dev/null)" != "$client_stamp" ]; then
  if gcc -O2 -Wall -Werror -o "$VENV/bin/agentvm.new" -DAGENTVM_PYTHON="\"$VENV/bin/python\"" \
       -DAGENTVM_PY_ENTRY="\"$VENV/bin/agentvm-py\"" "$client_src"; then
    mv -f "$VENV/bin/agentvm.new" "$VENV/bin/agentvm"
    echo "$client_stamp" > "$VENV/.agentvm-client"
  else
    echo "install: warning: could not build $client_src; bin/agentvm is the Python entry point" >&2
    cp -f "$VENV/bin/agentvm-py" "$VENV/bin/agentvm"
  fi
fi
# Node's fetch ignores proxy variables before Node 24: a preload with undici routes it through
# the egress gate (see src/agentvm/native/node-proxy.js). Optional: only where npm exists.
NODE_SHIM="${AGENTVM_NODE_SHIM:-$(dirname "$VENV")/node}"
if command -v npm >/dev/null 2>&1 && [ ! -f "$NODE_SHIM/node_modules/undici/package.json" ]; then
  echo "install: undici (Node fetch through the gate) into $NODE_SHIM" >&2
  mkdir -p "$NODE_SHIM"
  npm install --silent --no-audit --no-fund --prefix "$NODE_SHIM" undici@6 >/dev/null 2>&1 \
    || echo "install: warning: could not install undici; Node fetch will have no route out" >&2
fi
if [ -d "$NODE_SHIM" ]; then
  install -m 0644 src/agentvm/native/node-proxy.js "$NODE_SHIM/proxy.js"
  chmod -R a+rX "$NODE_SHIM"
fi

# --test: real SDKs for the credential and HTTP/2 tests, importable by Debian's python3 *inside*
# sandboxes (mounted read-only at run time): the openai SDK, boto3, httpx with HTTP/2, grpcio, the mcp SDK,
# the OpenTelemetry SDK and its OTLP/HTTP exporter (an agent exporting its own spans).
if [ "${1:-}" = "--test" ]; then
  TESTLIB="${AGENTVM_TESTLIB:-$(dirname "$VENV")/testlib}"
  TESTLIB_SET="openai boto3 httpx[http2] grpcio mcp==2.3.0 opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
  if [ "$(cat "$TESTLIB/.done" 2>/dev/null)" != "$TESTLIB_SET" ]; then
    echo "install: $TESTLIB_SET into $TESTLIB (for tests inside sandboxes)" >&2
    rm -rf "$TESTLIB"
    # shellcheck disable=SC2086 # one word per package
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --target "$TESTLIB" $TESTLIB_SET >/dev/null
    chmod -R a+rX "$TESTLIB"
    echo "$TESTLIB_SET" > "$TESTLIB/.done"
  fi
fi

# The gate's request path compiled with Cython from the same source (agentvm.gate.accel): about
# a sixth less CPU per request. Only modules whose current source has no build are compiled (a
# minute for all of them on 2 cores). If it fails the gate runs them as plain Python - the same
# code, slower - and `agentvm doctor` says so.
"$VENV/bin/python" -m agentvm.gate build --quiet \
  || echo "install: warning: the gate's compiled request path could not be built; it runs as plain Python (slower)" >&2
# Byte-compile our sources: the CLI's start-up is part of every sandbox launch, and an
# environment with PYTHONDONTWRITEBYTECODE=1 would otherwise recompile them on every run.
"$VENV/bin/python" -m compileall -q -j 0 src/agentvm >/dev/null
# And keep the code the dataclasses generate (agentvm.codecache): about 13 ms off every start.
AGENTVM_NO_CODECACHE=1 "$VENV/bin/python" -c 'from agentvm import codecache; raise SystemExit(codecache.main(["build", "--quiet"]))' \
  || echo "install: warning: agentvm.codecache could not be built; every start compiles the dataclasses' methods (slower)" >&2
if [ "$(id -u)" = 0 ]; then
  ln -sf "$VENV/bin/agentvm" /usr/local/bin/agentvm
fi
