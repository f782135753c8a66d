#!/usr/bin/env bash
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p "$OUT/q"
TESTS=0 MODEL=qwen3.5-35b-a3b FORMATS=fp8 ROWS=1,16,64 PROBE_BUDGET=90 PROBE_TIMEOUT=130 bash tests/gpu/run.sh "$OUT/q" quant > /dev/null 2>&1
grep -E "rows=" "$OUT/q/quant_probe.log" | grep -v "bf16 cuBLAS" | awk '{k=$2" "$6; if(!(k in s)){s[k]=1; print}}'
cp "$OUT/q/quant_gemm_configs.json" deltaserve/ops/quant_gemm/configs.json
ONLY=w8-fp8 BUNDLE=1 BUDGET=200 bash tests/gpu/run.sh "$OUT/b" bars
