#!/usr/bin/env bash
# Install, then run the whole CPU test suite. Extra arguments go to pytest (e.g. scripts/test.sh tests/engine -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${PYTHON:-python3}" -m pytest "$@"
