#!/usr/bin/env bash
# The wheels the H200 machines lack, into DIR (default .whl), for tests/gpu/run.sh to install there: the shared
# tool's default set plus what the server and the GPU tests import beyond it (xgrammar and its FFI for structured
# output, compressed-tensors for the quantized tests, jsonschema for the structured-output test). DIR is replaced
# only once the download has finished: a wheel left from an earlier download beside a newer one of the same
# package makes pip refuse the whole install on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
bash ../shared/tools/gpu-wheels.sh "$fresh" "xgrammar==0.2.9" apache-tvm-ffi compressed-tensors loguru psutil \
  jsonschema attrs jsonschema-specifications referencing rpds-py
rm -rf "$dir"
cp -r "$fresh" "$dir"
