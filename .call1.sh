#!/usr/bin/env bash
# one device call: bars for the card we got
set -u
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name"
if [[ "$name" == *H200* ]]; then
  ONLY=w7,w8-fp8,next-80b-fp8 BUNDLE=1 BUDGET=530 bash tests/gpu/run.sh "$OUT/b" bars
else
  ONLY=27b-fp8-w6,w8-fp8 BUNDLE=1 BUDGET=530 bash tests/gpu/run.sh "$OUT/b" bars
fi
