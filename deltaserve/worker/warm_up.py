"""GPU start-up warm-ups: every kernel variant that serving can meet is compiled (Triton) or planned (cuDNN)
before the first request, so that no user's request pays for it (docs/architecture.md, start-up).

    before_capture(model)                the quantized GEMMs' variants at every row class (ops.quant_gemm)
    after_capture(model, device, tokens) variants that steps outside the CUDA graphs launch: the skinny GEMM's
                                         row buckets, the fused MoE tiles of every bucket, the gated output
                                         norm, the one-split decode attention, the grammar mask kernel,
                                         cuDNN's attention plans
    engine_steps(engine)                 a few real steps through the whole engine (LLMEngine.warm_up)
    check_memory(plan, device)           after them: the device memory in use against the plan's budget
    eager_memory_ceiling(plan, in_use)   and the memory above which eager steps hand back torch's cached blocks
    watch_compiles()                     from then on, a warning for each kernel variant a served step compiles
"""

from __future__ import annotations

import logging
import math
import time

import torch

from deltaserve.cache.planner import MemoryPlan
from deltaserve.layers.mlp import SparseMoE
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.ops import quant_gemm
from deltaserve.ops.linear import warm_up_skinny
from deltaserve.sampling import SamplingParams
from deltaserve.structured import bitmask as grammar_bitmask

logger = logging.getLogger(__name__)
ALIGNED_PROMPT = 1024  # engine_steps' prompt of a multiple of 16 tokens (W1's prompt length)


def before_capture(model: HybridForCausalLM) -> None:
    """The quantized GEMMs' variants at every row class, compiled before the graphs capture them."""
    quant_gemm.warm_up([w.prepared for w in model.quantized_weights()], model.model.embed_tokens.weight.dtype)


def after_capture(model: HybridForCausalLM, device: torch.device, max_num_batched_tokens: int) -> None:
    """Kernel variants that steps outside the graphs may launch, compiled now rather than while serving."""
    from deltaserve.ops.attention.cuda_sdpa import warm_up_cudnn_attention  # GPU only

    warm_up_skinny(model.projection_weights())
    moe_blocks = [module for module in model.modules() if isinstance(module, SparseMoE)]
    if moe_blocks:  # every MoE layer launches the same variants
        moe_blocks[0].warm_up_fused(max_num_batched_tokens)
    if model.gdn_layers:  # every GDN layer launches the same variants
        model.gdn_layers[0].warm_up_output_norm(max_num_batched_tokens)
    attention = model.attention_layers[0]  # every attention layer launches the same variants
    attention.warm_up_one_split_decode()
    grammar_bitmask.warm_up(model.config.vocab_size, device)  # structured output's mask kernel
    try:
        warm_up_cudnn_attention(attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                attention.q_norm.weight.dtype, device, max_num_batched_tokens)
    except Exception:  # a speed-up only: the first requests pay for it instead, never a failed start
        logger.exception("warming up cuDNN attention failed; continuing")


def engine_steps(engine) -> None:
    """Run once, before serving, the kind of steps whose kernels compile (Triton) or get planned (cuDNN)
    at their first use: a prompt of a multiple of 16 tokens alone, a prompt of two full chunks and a short tail
    (chunks over a cached prefix, a checkpoint inside the step), a few short requests, then a prompt that joins
    while they all decode (one step of decodes and a prompt, with enough decoding sequences for the GDN op to split
    it), then a resend of that prompt with a new ending (a prefix-cache hit). The short requests take the sampler's
    paths in turn (greedy, sampled, penalties, logprobs). Their outputs are dropped and the
    prefix cache is emptied after them. First, xgrammar's view of the vocabulary is built (structured output's; a
    first such request would wait)."""
    from deltaserve.ops.gdn.cuda import SPLIT_MIN_SHORT_SEQS

    if engine.tokenizer is not None:
        engine.grammar_compiler.prepare()

    longest = engine.max_model_len - 8  # room for the outputs and for the resend's longer ending
    if longest < 16:
        return
    start = time.perf_counter()
    vocab = engine.model_config.vocab_size
    budget, block = engine.config.max_num_batched_tokens, engine.config.block_size

    def prompt(length: int, salt: int) -> list[int]:
        return [(i * 7919 + salt * 104729) % vocab for i in range(length)]

    def run_until(done) -> None:
        while engine.has_unfinished() and not done(engine.step()):
            pass

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # the decoding requests' sampler paths beside the greedy argmax, whose torch kernels a first chat request (Qwen's
    # generation defaults sample) would otherwise load: temperature with top-k / top-p / min-p and a seed, the
    # penalties with min_tokens, the logprobs' top-k
    decode_params = [params,
                     SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, seed=0, max_tokens=8,
                                    ignore_eos=True),
                     SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                    min_tokens=2, stop_token_ids=[0], max_tokens=8, ignore_eos=True),
                     SamplingParams(temperature=0, logprobs=5, max_tokens=8, ignore_eos=True)]
    # a prompt alone of a multiple of 16 tokens, run to its end: Triton specializes integer arguments (a step's
    # token count) on divisibility by 16, and the long prompt's one chunk below may not be (4,088 tokens at
    # --max-model-len 4096), where a served 1,024-token prompt is
    engine.add_request("deltaserve-warm-up-aligned", prompt(min(ALIGNED_PROMPT, longest) // 16 * 16, 5), params)
    run_until(lambda outputs: False)
    engine.add_request("deltaserve-warm-up-long", prompt(min(2 * budget + 2 * block + 3, longest), 1), params)
    run_until(lambda outputs: bool(outputs))  # its first token: it decodes from now on
    for i in range(SPLIT_MIN_SHORT_SEQS):
        engine.add_request(f"deltaserve-warm-up-decode-{i}", prompt(min(20, longest), 10 + i),
                           decode_params[i % len(decode_params)])
    run_until(lambda outputs: len(outputs) > 1)  # the short ones decode too
    # longer than the recurrent GDN path takes, and enough to fill the GPU with unsplit attention programs (the
    # kernel variant a batch of prompts meets)
    joining = prompt(min(max(300, budget // 2), longest), 2)
    engine.add_request("deltaserve-warm-up-joining", joining, params)
    run_until(lambda outputs: False)
    engine.add_request("deltaserve-warm-up-hit", joining[:-5] + prompt(9, 3), params)
    run_until(lambda outputs: False)
    engine.reset_prefix_cache()
    logger.info("warm-up (the first use of each kind of step) took %.1f s", time.perf_counter() - start)


def watch_compiles() -> None:
    """Log a warning for every Triton kernel variant compiled (or loaded from Triton's disk cache) from now on: the
    warm-ups above should have met them all, and a step that meets a new one stalls every stream while it compiles.
    The line names the kernel and what it specialized on, which says what to warm up. A hook installed before (the
    offline bench's compile log) still runs; a second call (another engine in the same process, as tests build)
    keeps the one watch, which then also reports that engine's start-up compiles."""
    import triton

    previous = triton.knobs.runtime.jit_cache_hook
    if getattr(previous, "watches_compiles", False):
        return

    def warn(*, fn, compile, **kwargs) -> bool:
        logger.warning("Triton compiled kernel variant %s after the start-up warm-up: %s %s", fn.name,
                       compile["signature"], compile["configs"])
        return previous(fn=fn, compile=compile, **kwargs) if previous is not None else False  # False: compile it

    warn.watches_compiles = True
    triton.knobs.runtime.jit_cache_hook = warn


def check_memory(plan: MemoryPlan, device: torch.device) -> int | None:
    """Log the device memory in use once start-up's steps have run, with the activations the plan reserved for the
    eager steps beside it, against the budget the caches were sized from; a warning when they are over (see
    memory_report). Returns the bytes in use, None where no budget was planned (a flag sized the cache, not a share
    of the device)."""
    if plan.budget_bytes is None:
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    over, message = memory_report(total - free, plan.budget_bytes, total, plan.gpu_memory_utilization,
                                  plan.activation_bytes)
    (logger.warning if over else logger.info)("%s", message)
    return total - free


def eager_memory_ceiling(plan: MemoryPlan, in_use: int) -> int:
    """The device memory above which an eager step hands back torch's free cached blocks (ModelRunner's
    memory_ceiling): what start-up left in use, its steps' activations handed back, plus the activations the plan
    reserved for such steps, or the budget where that is more. A step's planned working set is never handed back and
    mapped again at the next step's start."""
    return max(plan.budget_bytes, in_use + plan.activation_bytes)


def memory_report(in_use: int, budget: int, total: int, utilization: float,
                  activations: int = 0) -> tuple[bool, str]:
    """(over the budget, the line to log). in_use counts the whole device (other processes too, as the plan's
    measured overhead did), the eager steps' planned activations (handed back after start-up's steps) added to it;
    an overshoot is what the plan's figures missed, measured before the warm-up steps ran (their allocations'
    gaps, the libraries' workspaces), and the utilization named keeps the process in the bytes that were asked
    for."""
    gib = 2**30
    line = (f"device memory in use after start-up: {in_use / gib:.2f} GiB"
            + (f" + {activations / gib:.2f} GiB of the steps' planned activations" if activations else "")
            + f" of the {budget / gib:.2f} GiB budget ({utilization:g} x {total / gib:.2f} GiB)")
    needed = in_use + activations
    if needed <= budget:
        return False, line
    fitting = (budget - (needed - budget)) / total
    return True, (f"{line}: {(needed - budget) / gib:.2f} GiB over, which start-up's measured figures did not "
                  f"foresee; --gpu-memory-utilization {math.floor(fitting * 1000) / 1000:g} would keep it within "
                  f"{budget / gib:.2f} GiB")
