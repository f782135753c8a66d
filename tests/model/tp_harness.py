"""Shared pieces of the tensor-parallel tests on the CPU: one rank's build and load of a checkpoint, a quantized
projection's dequantized weight, a greedy run served by TP gloo processes (sharded) next to tp_size 1, and the
bound the two runs' logits must keep."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaserve.config import ModelConfig
from deltaserve.layers.quant import detect_weight_format
from deltaserve.layers.quant.weight import fuse_quantized
from deltaserve.model.loader import build_model, load_model, load_safetensors
from deltaserve.worker.distributed import ParallelContext
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.model.helpers import BLOCK_SIZE, SequenceRunner

TP = 2
EPS32 = torch.finfo(torch.float32).eps


def load_rank(path, parallel: ParallelContext, quantized: bool = True):
    """This rank's float32 model of the checkpoint at `path` on the CPU, in its detected weight format (quantized)
    or with every weight in float32, loaded but not fused, so that each projection's loaded tensors stay apart."""
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, torch.float32, "cpu", detect_weight_format(path) if quantized else None, parallel)
    load_safetensors(model, path)
    return model


def dequantize(scheme, raw: dict, shape: tuple[int, int]) -> torch.Tensor:
    """One projection's loaded tensors -> its float32 weight [N, K], as the scheme prepares and dequantizes it."""
    return fuse_quantized([(scheme, dict(raw), shape[0])], shape[1], "cpu").dequantize(torch.float32)


def bind_float32_caches(model) -> None:
    """Float32 KV and state pools on the CPU, enough for a few short sequences."""
    bind_caches(model, CacheShape(num_blocks=32, block_size=BLOCK_SIZE, num_state_slots=4,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")


def greedy(model, vocab: int, prefill_plan: list[dict[int, int]],
           decode_steps: int) -> tuple[list[torch.Tensor], dict[int, list[int]]]:
    """Batched prefill steps (each {state slot: that many random prompt tokens}, drawn from seed 0), then
    decode_steps greedy steps of every sequence: (every step's logits [tokens, V], in slot order within a step;
    each slot's greedy tokens)."""
    runner, gen = SequenceRunner(model), torch.Generator().manual_seed(0)
    for slot in dict.fromkeys(slot for step in prefill_plan for slot in step):
        runner.add(slot)
    logits, last = [], {}  # last: each sequence's logits row [V] for the token after its latest one
    for step in prefill_plan:
        out = runner.step({slot: torch.randint(0, vocab, (n,), generator=gen).tolist() for slot, n in step.items()})
        logits += [out[slot] for slot in sorted(out)]
        last.update({slot: rows[-1] for slot, rows in out.items()})
    tokens = {slot: [] for slot in last}
    for _ in range(decode_steps):
        chosen = {slot: int(row.argmax()) for slot, row in last.items()}
        for slot, token in chosen.items():
            tokens[slot].append(token)
        out = runner.step({slot: [token] for slot, token in chosen.items()})
        logits += [out[slot] for slot in sorted(out)]
        last.update({slot: rows[-1] for slot, rows in out.items()})
    return logits, tokens


def assert_within_reordered_sums(sharded: list[torch.Tensor], single: list[torch.Tensor], num_layers: int,
                                 n_max: int, what: str) -> None:
    """Each of rank 0's logits (sharded) within the float32 reordering bound of the tp_size 1 run's (single):
    2 * (2 * num_layers reduced blocks) * n_max (the widest sum) * eps * max|logit| (test_tensor_parallel's
    docstring derives it)."""
    assert len(sharded) == len(single)
    for ours, truth in zip(sharded, single):
        bound = 2 * (2 * num_layers) * n_max * EPS32 * truth.abs().max().item()
        err = (ours - truth).abs().max().item()
        assert err <= bound, f"{what}: max |tp2 - tp1| = {err:.3g} > {bound:.3g}"


def _serve_on_rank(rank: int, store: str, checkpoints: dict[str, str], prefill_plan: list[dict[int, int]],
                   decode_steps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=TP)
    parallel = ParallelContext(tp_rank=rank, tp_size=TP, tp_group=dist.group.WORLD)
    results = {}
    with torch.no_grad():
        for name, path in checkpoints.items():
            cfg = ModelConfig.from_pretrained(path)
            fmt = detect_weight_format(path)  # None for a float checkpoint: load_model's default
            model = load_model(path, cfg, torch.float32, "cpu", weight_format=fmt, parallel=parallel)
            bind_float32_caches(model)
            sharded = greedy(model, cfg.vocab_size, prefill_plan, decode_steps)
            if rank == 0:
                single = load_model(path, cfg, torch.float32, "cpu", weight_format=fmt)
                bind_float32_caches(single)
                results[name] = (sharded, greedy(single, cfg.vocab_size, prefill_plan, decode_steps))
    if rank == 0:  # its sharded runs needed every collective of rank 1: both ranks' work is in them
        torch.save(results, os.path.join(out_dir, "results.tmp"))
        os.replace(os.path.join(out_dir, "results.tmp"), os.path.join(out_dir, "results.pt"))
    dist.barrier()  # no rank tears gloo down while the results are being written
    dist.destroy_process_group()


def serve_sharded_and_single(root, checkpoints: dict[str, str], prefill_plan: list[dict[int, int]],
                             decode_steps: int) -> dict[str, tuple]:
    """One spawn of TP gloo processes (files under the directory `root`) serving every checkpoint (name -> path)
    with greedy(prefill_plan, decode_steps): name -> (rank 0's sharded run, the tp_size 1 run, the checkpoint's
    ModelConfig), each run greedy's (logits, tokens)."""
    try:
        mp.spawn(_serve_on_rank, args=(str(root / "store"), checkpoints, prefill_plan, decode_steps, str(root)),
                 nprocs=TP, join=True)
    except mp.ProcessExitedException:
        # gloo's teardown has aborted a rank at exit in full-suite runs ("terminate called without an active
        # exception") after every result was computed: the results file says the work itself completed
        if not (root / "results.pt").is_file():
            raise
    runs = torch.load(root / "results.pt")
    return {name: (*runs[name], ModelConfig.from_pretrained(path)) for name, path in checkpoints.items()}
