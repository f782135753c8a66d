#!/usr/bin/env bash
# Install, then run the whole CPU test suite, on up to 4 processes. Extra arguments go to pytest (e.g.
# scripts/test.sh tests/engine -x) and run that alone, in one process. Without arguments a second, short pass
# follows: the numerically sensitive tests (the model against transformers, the reference ops against float64
# oracles) under ATEN_CPU_CAPABILITY=default, torch's baseline kernels, so that CI checks the derived float
# tolerances on a second instruction set (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PYTHON=${PYTHON:-python3}
if [ "$#" -gt 0 ]; then
  exec "$PYTHON" -m pytest "$@"
fi
# the suite on up to 4 processes (pytest-xdist; tests are independent: each takes its own ports and temp dirs)
workers=$(nproc)
[ "$workers" -gt 4 ] && workers=4
"$PYTHON" -m pytest -n "$workers"
echo "second pass: ATEN_CPU_CAPABILITY=default"
ATEN_CPU_CAPABILITY=default exec "$PYTHON" -m pytest -p no:cacheprovider tests/model tests/ops/test_attention.py \
  tests/ops/test_attention_merge.py tests/ops/test_conv1d.py tests/ops/test_gdn.py \
  tests/test_demo_model.py::test_demo_model_logits_match_transformers
