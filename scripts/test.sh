#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
VENV="${AGENTVM_VENV:-/opt/agentvm/venv}"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q "$@"
