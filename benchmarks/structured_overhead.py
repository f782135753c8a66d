"""What structured output costs a served model: TPOT of json_schema requests against the same unconstrained run, at
batch 1 and 64 (issue 35's bar: at most 5% at batch 64).

    python -m benchmarks.structured_overhead Qwen/Qwen3.5-27B --out OUT_DIR     (on the GPU machine)

It writes a synthetic byte-level tokenizer of the model's vocabulary (bench/bpe_tokenizer.py: one that can
spell JSON, unlike vocab_tokenizer's words), serves the model with dummy weights on it, and runs `deltaserve
bench serve` (random prompts, greedy, a fixed output length) once free and once with a response_format whose
schema (an array of at least 200 records with strings, integers and arrays) cannot end before the output length,
so both runs produce the same number of tokens. Prints a table and writes OUT_DIR/structured_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Records of several kinds of JSON value, too many to end within any output length used here.
SCHEMA = {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "city", "age", "tags"]}}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}}


def _wait_for_health(server: subprocess.Popen, url: str, timeout: float = 1200.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited before answering /health: see its log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"no /health answer within {timeout:.0f} s")


def _bench(url: str, tokenizer: str, batch: int, args, extra_body: dict | None) -> dict:
    from deltaserve.bench.cli import build_parser
    from deltaserve.bench.serve import run_serve

    argv = ["serve", "--base-url", url, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(max(2 * batch, args.min_prompts)), "--max-concurrency", str(batch),
            "--num-warmups", "2", "--temperature", "0", "--disable-tqdm", "--seed", "0"]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    return run_serve(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a published config (hub id or directory), served with dummy weights")
    parser.add_argument("--out", required=True, help="directory for the result and the server log")
    parser.add_argument("--batches", default="1,64", help="concurrencies, comma-separated")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--min-prompts", type=int, default=8, help="prompts per run at least (2 x batch else)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = str(out / "bpe_tokenizer")
    from deltaserve.bench import bpe_tokenizer

    bpe_tokenizer.main([args.model, tokenizer])
    url = f"http://127.0.0.1:{args.port}"
    with open(out / "structured_server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", args.model, "--load-format", "dummy",
                                   "--tokenizer", tokenizer, "--port", str(args.port), "--max-model-len",
                                   str(args.max_model_len)], stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    rows = []
    try:
        _wait_for_health(server, url)
        for batch in (int(b) for b in args.batches.split(",")):
            free = _bench(url, tokenizer, batch, args, None)
            constrained = _bench(url, tokenizer, batch, args, CONSTRAINED)
            rows.append({"batch": batch, "free": free, "json_schema": constrained,
                         "tpot_overhead": constrained["mean_tpot_ms"] / free["mean_tpot_ms"] - 1})
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"\n{'batch':>5} {'free TPOT ms':>13} {'json_schema TPOT ms':>20} {'overhead':>9} "
          f"{'free tok/s':>11} {'json tok/s':>11}")
    for row in rows:
        free, constrained = row["free"], row["json_schema"]
        print(f"{row['batch']:>5} {free['mean_tpot_ms']:>13.2f} {constrained['mean_tpot_ms']:>20.2f} "
              f"{100 * row['tpot_overhead']:>8.1f}% {free['output_throughput']:>11.0f} "
              f"{constrained['output_throughput']:>11.0f}")
    summary = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len, "schema": SCHEMA,
               "rows": [{"batch": r["batch"], "tpot_overhead": r["tpot_overhead"],
                         **{f"{mode}_{key}": r[mode].get(key) for mode in ("free", "json_schema")
                            for key in ("mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_ttft_ms",
                                        "output_throughput", "completed", "total_output_tokens")}}
                        for r in rows]}
    (out / "structured_overhead.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
