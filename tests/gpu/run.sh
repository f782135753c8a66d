#!/usr/bin/env bash
# Everything GPU in one command, on an H200 machine: GPU tests, then the benchmarks.
#   tests/gpu/run.sh OUTDIR [full|quick|tests|ops|bench|serve|bars|memory|structured|tune|quant|moe]
#   full   every GPU test, then all benchmarks (more than one 10-minute device call: use tests, then bench)
#   quick  every GPU test, a kernel profile and a short benchmark
#   tests  the GPU tests alone (tests/gpu, ~8 min on an H200); TESTS="paths" runs those instead
#   ops    the op tests (tests/ops) on the GPU's compiled kernels instead of CI's interpreter (~3 min)
#   bench  the benchmarks alone; WORKLOADS=W1,W3 chooses them, PROFILE=0 leaves out their kernel profiles
#          (every workload with profiles ~8 min, without ~6)
#   serve  a workload through the HTTP server: `deltaserve serve` on a published config with dummy weights and a
#          synthetic tokenizer (bench/vocab_tokenizer.py), driven by `deltaserve bench serve`; MODEL (default
#          qwen3.5-27b), IN/OUT_LEN (1024/512), PROMPTS (256), CONCURRENCY (64), MAX_MODEL_LEN (4096) choose it;
#          RUNS="1024:512:5:1 8192:1024:64:16:0.8" runs several (IN:OUT_LEN:PROMPTS:CONCURRENCY[:RANGE_RATIO])
#          against one server start, IN as PREFIX+SUFFIX a shared prefix (W4: "36864+16:1:5:1"); SERVE_ARGS adds
#          flags to `deltaserve serve` ("--quantization fp8");
#          OUTDIR/step_summary.txt sums each run's steps by kind (benchmarks/step_trace_summary.py);
#          BASE_TAR=.base.tar (`git archive REV -o .base.tar`, carried) runs them on that tree first, then on this
#          one (OUTDIR/base, OUTDIR/new), this tree's run.sh driving both: a baseline on the same machine
#   bars   the open issues' bars served (benchmarks/bars.py): one serve-mode start a model with its bar workloads,
#          in the order the bars need them, within BUDGET (540) s, skipping what the card cannot hold; ONLY="w7,w8-fp8"
#          chooses starts; OUTDIR/bars.txt has each figure beside its bar and what was skipped
#   quant  the quantized GEMMs: their GPU tests, then benchmarks/quant_gemm_probe.py at Qwen3.5-27B's shapes (every
#          kernel and tile, TB/s and TFLOP/s beside the limits) writing OUTDIR/quant_gemm_configs.json (for
#          deltaserve/ops/quant_gemm/configs.json); ~6-7 min on an H200: the probe starts no shape after
#          PROBE_BUDGET (240) s and is killed at PROBE_TIMEOUT (300) s, keeping what it measured (merged into
#          the shipped table); FORMATS="int4,nvfp4", ROWS="1" and ONLY="gdn_out,attn_o" (projection names) narrow
#          it, MODEL="qwen3.5-35b-a3b" takes another model's dense shapes (a MoE model's GDN and attention
#          projections), TESTS=0 leaves out the tests
#   moe    the fused MoE path: its GPU tests and the tests/ops MoE tests, then benchmarks/moe_probe.py on MODEL (default
#          qwen3.5-35b-a3b): torch path vs fused vs the bandwidth limit at 1-64 tokens and the tile sweep, writing
#          OUTDIR/moe_configs.json (for deltaserve/ops/moe/configs.json); FORMATS="bf16 fp8 int4" probes and sweeps
#          each weight format in turn (default bf16), each starting no bucket after PROBE_BUDGET (90) s and killed at
#          PROBE_TIMEOUT (300) s; TOKENS="1,2" times and sweeps those token counts' buckets; KERNELS=1 adds each
#          kernel's time (quantized formats); TESTS=0 leaves out the tests
#   memory where start-up memory goes (benchmarks/startup_memory_probe.py by stage) at the users' 32 GB-card
#          configuration (MODEL, default qwen3.5-27b-nvfp4, at 0.94 of an RTX 5090 and 200K context), then
#          tests/gpu/test_quant_engine_gpu.py's 200,000-token request in a child, its figures in OUTDIR (~2 min)
#   structured  what structured output costs a served model: TPOT of json_schema requests against the same free
#          run at batch 1 and 64 (benchmarks/structured_overhead.py); MODEL (default qwen3.5-27b) chooses it (~6 min)
#   tune   the tables this GPU should ship: fla-core's pinned kernel configurations as OUTDIR/fla_configs.tgz
#          (unpack into deltaserve/ops/gdn/fla_configs/) and the skinny GEMM's tiles as OUTDIR/skinny_configs.json
#          (for deltaserve/ops/linear/); TUNE=fla makes fla's alone (~2 min), TUNE=skinny the skinny table alone
#          (~3 min), then a GDN layer's recurrent step and out-proj together and apart (`--gdn-tail 64`);
#          TUNE=small the small bf16 products of the quantized checkpoints alone (batch_probe --small, ~2 min);
#          TUNE=gemv the batch-1 fused GEMVs of MODEL (benchmarks.gemv_probe; ONLY=rms_norm_and: a MoE model's
#          router in its norm's launch) as OUTDIR/gemv_configs.json (for deltaserve/ops/linear/configs.json)
# BUNDLE=1 leaves OUTDIR as the one file OUTDIR/bundle.tgz (every mode: the device returns at most 8 files a call).
# Wheels the machine lacks (fla-core, the server stack, xgrammar) are installed from .whl/ when present
# (scripts/gpu_wheels.sh); the published configs are the ones shipped in deltaserve/model_configs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: tests/gpu/run.sh OUTDIR [quick|full|tests|ops|bench|serve|bars|memory|structured|tune|quant|moe]}
MODE=${2:-full}
case "$MODE" in
  full|quick|tests|ops|bench|serve|bars|memory|structured|tune|quant|moe) ;;
  *) echo "tests/gpu/run.sh: unknown mode '$MODE' (full, quick, tests, ops, bench, serve, bars, memory, structured," \
       "tune, quant or moe)" >&2
     exit 2 ;;
esac
mkdir -p "$OUT"
if [ "${BUNDLE:-0}" = 1 ]; then
  bundle() {
    local dir
    dir=$(cd "$OUT" && pwd)
    tar czf "/tmp/bundle.$$.tgz" -C "$dir" . && rm -rf "${dir:?}"/* && mv "/tmp/bundle.$$.tgz" "$dir/bundle.tgz"
  }
  trap bundle EXIT
fi
export DELTASERVE_GPU_OUT="$(cd "$OUT" && pwd)"  # where GPU tests write their figures (memory_plan.json)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CONFIGS=deltaserve/model_configs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' >> "$OUT/device.txt" 2>&1
status=0
if [ "$MODE" = tune ] && [ "${TUNE:-all}" = gemv ]; then
  cp deltaserve/ops/linear/configs.json "$OUT/gemv_configs.json"  # the probe merges into the shipped table
  python3 -m benchmarks.gemv_probe "$CONFIGS/${MODEL:-qwen3.5-27b}" ${ONLY:+--only "$ONLY"} \
    --out "$OUT/gemv_configs.json" 2>&1 | tee "$OUT/tune.log"
  exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" = tune ]; then
  if [ "${TUNE:-all}" != skinny ] && [ "${TUNE:-all}" != small ]; then
    rm -rf /tmp/fla_configs
    python3 -m benchmarks.fla_tune "$CONFIGS/qwen3.5-27b" --out /tmp/fla_configs 2>&1 | tee "$OUT/tune.log"
    tar czf "$OUT/fla_configs.tgz" -C /tmp/fla_configs .
  fi
  [ "${TUNE:-all}" = fla ] && exit 0
  cp deltaserve/ops/linear/skinny_configs.json "$OUT/skinny_configs.json"
  if [ "${TUNE:-all}" = small ]; then
    python3 -m benchmarks.batch_probe "$CONFIGS/qwen3.5-27b" --rows "" --gdn-batches "" --gdn-chunks "" --small \
      --out "$OUT/skinny_configs.json" 2>&1 | tee "$OUT/tune.log"
    exit 0
  fi
  python3 -m benchmarks.batch_probe "$CONFIGS/qwen3.5-27b" --gdn-batches "" --gdn-chunks "" --gdn-tail 64 \
    --out "$OUT/skinny_configs.json" 2>&1 | tee -a "$OUT/tune.log"
  exit 0
fi
if [ "$MODE" = quant ]; then
  [ "${TESTS:-1}" = 0 ] || python3 -m pytest tests/gpu/test_quant_gemm_gpu.py -q -rs --timeout=300 \
    -p no:cacheprovider 2>&1 | tee "$OUT/quant_tests.log"
  status=${PIPESTATUS[0]}
  cp deltaserve/ops/quant_gemm/configs.json "$OUT/quant_gemm_configs.json"  # the probe merges into the shipped table
  timeout "${PROBE_TIMEOUT:-300}" python3 benchmarks/quant_gemm_probe.py "$CONFIGS/${MODEL:-qwen3.5-27b}" \
    --formats "${FORMATS:-fp8,int4,nvfp4}" --rows "${ROWS:-1,8,16,32,64,512,8192}" --only "${ONLY:-}" \
    --budget-s "${PROBE_BUDGET:-240}" --out "$OUT/quant_gemm_configs.json" 2>&1 | tee "$OUT/quant_probe.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  exit $status
fi
if [ "$MODE" = moe ]; then
  [ "${TESTS:-1}" = 0 ] || python3 -m pytest tests/gpu/test_moe_gpu.py tests/ops/test_moe_routing.py tests/ops/test_moe_experts.py tests/ops/test_moe_shared_slot.py -q -rs \
    --timeout=300 -p no:cacheprovider 2>&1 | tee "$OUT/moe_tests.log"
  status=${PIPESTATUS[0]}
  cp deltaserve/ops/moe/configs.json "$OUT/moe_configs.json"
  for format in ${FORMATS:-bf16}; do
    timeout "${PROBE_TIMEOUT:-300}" python3 -m benchmarks.moe_probe "$CONFIGS/${MODEL:-qwen3.5-35b-a3b}" --sweep \
      --format "$format" --tokens "${TOKENS:-1,2,4,8,16,32,64}" ${KERNELS:+--kernels} --budget-s "${PROBE_BUDGET:-90}" --out "$OUT/moe_configs.json" 2>&1 \
      | tee -a "$OUT/moe_probe.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  exit $status
fi
if [ "$MODE" = memory ]; then
  # start-up memory by stage, then the 32 GB-card test's child (its figures: OUTDIR/memory_200k.json)
  model="$CONFIGS/${MODEL:-qwen3.5-27b-nvfp4}"
  share=$(python3 -c 'import torch; print(0.94 * 33_672_921_088 / torch.cuda.mem_get_info()[1])')  # a 5090's 94%
  python3 -m benchmarks.startup_memory_probe "$model" --gpu-memory-utilization "$share" --max-model-len 200000 \
    --kv-cache-dtype fp8 2>&1 | tee "$OUT/startup_memory.log"
  status=${PIPESTATUS[0]}
  python3 -m tests.gpu.test_quant_engine_gpu "$model" "$OUT/memory_200k.json" > "$OUT/memory_200k.log" 2>&1 || status=1
  exit $status
fi
if [ "$MODE" = structured ]; then
  python3 -m benchmarks.structured_overhead "$CONFIGS/${MODEL:-qwen3.5-27b}" --out "$OUT" 2>&1 \
    | tee "$OUT/structured_bench.log"
  exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" = bars ]; then
  python3 -m benchmarks.bars "$OUT" ${ONLY:+--only "$ONLY"} ${BUDGET:+--budget-s "$BUDGET"}
  exit $?
fi
if [ "$MODE" = serve ] && [ -n "${BASE_TAR:-}" ]; then
  # the same runs on an earlier tree first (a `git archive` tarball carried beside this one), then on this one:
  # OUTDIR/base and OUTDIR/new, each with its server.log and serve_bench.log
  out=$(cd "$OUT" && pwd)
  rm -rf /tmp/deltaserve-base && mkdir -p /tmp/deltaserve-base || exit 1
  tar xf "$BASE_TAR" -C /tmp/deltaserve-base || exit 1
  cp tests/gpu/run.sh /tmp/deltaserve-base/tests/gpu/run.sh  # one driver of the runs for both trees
  (cd /tmp/deltaserve-base && BASE_TAR= BUNDLE= bash tests/gpu/run.sh "$out/base" serve > /dev/null 2>&1) || status=1
  BASE_TAR= BUNDLE= bash tests/gpu/run.sh "$out/new" serve > /dev/null 2>&1 || status=1
  for tree in base new; do
    echo "== $tree"
    grep -E "Median TTFT|Median TPOT|Total Token throughput|Output token throughput" "$out/$tree/serve_bench.log"
  done
  exit $status
fi
if [ "$MODE" = serve ]; then
  model="$CONFIGS/${MODEL:-qwen3.5-27b}"
  python3 -m deltaserve.bench.vocab_tokenizer "$model" /tmp/vocab_tokenizer || exit 1
  rm -rf /tmp/step_trace && mkdir -p /tmp/step_trace
  DELTASERVE_STEP_TRACE=/tmp/step_trace python3 -m deltaserve serve "$model" --load-format dummy \
    --tokenizer /tmp/vocab_tokenizer --port 8000 --max-model-len "${MAX_MODEL_LEN:-4096}" ${SERVE_ARGS:-} \
    > "$OUT/server.log" 2>&1 &
  server=$!
  python3 - "$server" <<'WAIT' || { kill $server 2>/dev/null; tail -n 25 "$OUT/server.log"; exit 1; }
import os, sys, time, httpx
pid, deadline = int(sys.argv[1]), time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before answering /health; the end of server.log:")
    try:
        if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(1)
sys.exit("no /health answer within 900 s")
WAIT
  # RUNS: several workloads against the one server, "IN:OUT_LEN:PROMPTS:CONCURRENCY[:RANGE_RATIO]" each
  windows=()
  for run in ${RUNS:-${IN:-1024}:${OUT_LEN:-512}:${PROMPTS:-256}:${CONCURRENCY:-64}}; do
    IFS=: read -r in_len out_len prompts concurrency range_ratio <<< "$run"
    began=$(python3 -c 'import time; print(time.monotonic_ns())')
    if [[ $in_len == *+* ]]; then  # PREFIX+SUFFIX: W4's shared prefix (prefix_repetition, one prefix)
      dataset=(--dataset-name prefix_repetition --prefix-repetition-prefix-len "${in_len%+*}"
               --prefix-repetition-suffix-len "${in_len#*+}" --prefix-repetition-num-prefixes 1
               --prefix-repetition-output-len "$out_len")
    else
      dataset=(--dataset-name random --random-input-len "$in_len" --random-output-len "$out_len"
               --random-range-ratio "${range_ratio:-0}")
    fi
    python3 -m deltaserve bench serve --base-url http://127.0.0.1:8000 --tokenizer /tmp/vocab_tokenizer \
      "${dataset[@]}" --num-prompts "$prompts" --max-concurrency "$concurrency" --ignore-eos --temperature 0 2>&1 \
      | tee -a "$OUT/serve_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    windows+=(--window "$began:$(python3 -c 'import time; print(time.monotonic_ns())')")
  done
  kill -INT $server; wait $server
  # where each run's time went, by kind of step (the engine's step trace)
  python3 -m benchmarks.step_trace_summary /tmp/step_trace "${windows[@]}" > "$OUT/step_summary.txt" 2>&1
  exit $status
fi
if [ "$MODE" = ops ]; then
  python3 -m pytest tests/ops -q -rs --timeout=300 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" != bench ]; then
  if [ -n "${TESTS:-}" ]; then
    python3 -m pytest $TESTS -q -rs --timeout=300 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
    status=${PIPESTATUS[0]}
  else
    # The compile test first, in a process of its own: Triton keeps what it compiled for the life of the
    # process, so after the other tests a variant that start-up fails to warm up could already be there.
    compile_test=tests/gpu/test_engine_gpu.py::test_serving_compiles_no_kernel_after_start_up
    grammar_compile_test=tests/gpu/test_structured_gpu.py::test_constrained_traffic_compiles_no_kernel_after_start_up
    python3 -m pytest "$compile_test" "$grammar_compile_test" -q -rs --timeout=300 -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests.log"
    status=${PIPESTATUS[0]}
    python3 -m pytest tests/gpu --deselect "$compile_test" --deselect "$grammar_compile_test" -q -rs \
      --timeout=300 -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu_tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi
if [ "$MODE" = quick ]; then
  python3 -m benchmarks.offline "$CONFIGS/qwen3.5-27b" --workloads W1,W3,W4 --scale 0.34 --profile \
    --profile-dir "$OUT" --max-model-len 140000 --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
elif [ "$MODE" = full ] || [ "$MODE" = bench ]; then
  profile=(--profile --profile-dir "$OUT")
  [ "${PROFILE:-1}" = 0 ] && profile=()
  python3 -m benchmarks.offline "$CONFIGS/qwen3.5-27b" --workloads "${WORKLOADS:-W4,W1,W3,W2,W6,W5}" \
    ${profile[@]+"${profile[@]}"} --max-model-len 140000 --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
fi
exit $status
