#!/usr/bin/env bash
# Install deltaserve and what it needs into the current Python environment (a fresh machine included).
# torch: kept if an installed torch >= 2.11 is there (GPU machines); otherwise the CPU build 2.13.0 is pinned,
# since an open version range can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
# Triton: kept if installed (GPU machines have the one their torch needs); otherwise 3.6.0, the GPU machine's, whose
# CPU interpreter runs our kernels in the CPU tests (the CPU build of torch does not bring it).
if ! "$PYTHON" -c 'import triton' 2>/dev/null; then
  "$PYTHON" -m pip install -q "triton==3.6.0"
fi
"$PYTHON" -m pip install -q -e ".[test]"
