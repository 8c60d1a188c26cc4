#!/usr/bin/env bash
# A brokered credential end to end (see agent.yaml.in and docs/credentials.md): the sandbox
# holds a placeholder; the gate mints the real, short-lived credential from the long-lived one
# in the vault. The last line says what the upstream saw.
cd "$(dirname "$0")"
source ../common.sh
