#!/usr/bin/env bash
# FP8 skinny TMA tiles: GPU tests, then the probe at 1, 32 and 64 rows
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p "$OUT/q"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest tests/gpu/test_quant_gemm_gpu.py -k "tma or skinny_tiles" -q -rs -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/q/tma_tests.log"
TESTS=0 FORMATS=fp8 ROWS=64,32,1 PROBE_BUDGET=260 PROBE_TIMEOUT=330 bash tests/gpu/run.sh "$OUT/q" quant > /dev/null 2>&1
tail -c 6000 "$OUT/q/quant_probe.log"
