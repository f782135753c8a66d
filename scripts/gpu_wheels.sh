#!/usr/bin/env bash
# The wheels the H200 machines lack, into DIR (default .whl), for tests/gpu/run.sh to install there: the shared
# tool's default set plus what the server and the GPU tests import beyond it (xgrammar and its FFI for structured
# output, compressed-tensors for the quantized tests, jsonschema for the structured-output test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/tools/gpu-wheels.sh "${1:-.whl}" "xgrammar==0.2.9" apache-tvm-ffi compressed-tensors loguru psutil \
  jsonschema attrs jsonschema-specifications referencing rpds-py
