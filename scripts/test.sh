#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then runs pytest.
#   bash scripts/test.sh            everything (unit, integration, attacks on the real sandbox)
#   bash scripts/test.sh --quick    the inner loop: unit and playbook tests (tests/unit), about a minute
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
VENV="${AGENTVM_VENV:-/opt/agentvm/venv}"
if [ "${1:-}" = "--quick" ]; then
    shift
    exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/unit "$@"
fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q "$@"
