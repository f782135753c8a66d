#!/usr/bin/env bash
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
ONLY=27b-fp8-w6,27b-fp8 BUNDLE=1 BUDGET=540 bash tests/gpu/run.sh "$OUT/b" bars
