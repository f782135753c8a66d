#!/usr/bin/env bash
# Install, then start the OpenAI-compatible server. With no arguments it serves the built-in tiny demo
# model on 127.0.0.1:8000; any `vllm serve` style arguments are passed on (e.g. scripts/serve.sh MODEL_DIR --port 8001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${PYTHON:-python3}" -m deltaserve serve "$@"
