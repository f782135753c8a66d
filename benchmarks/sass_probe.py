"""The attention kernels and the one-row 4-bit GEMVs compiled for an NVIDIA GPU on any machine (no GPU needed):
their shared memory and their main loop's SASS, to see what a kernel change does to the machine code before
spending device time on it.

    python -m benchmarks.sass_probe [--kernel decode|prefill|int4-row|int4-dp4a|nvfp4-gemv|nvfp4-dp4a|moe-gate-up|
        moe-down|fp8-skinny|rms-norm|align] [--cache bf16|fp8] [--format bf16|fp8|int4|nvfp4] [--arch 90] [--rows 64]
        [--block-n N] [--block-k N] [--warps N] [--stages N] [--split-k N] [--tma 0|1] [--norm fp8-kept|fp8|bf16]
        [--out-chunk N] [--count N] [--top 12]

Compiles `_decode_split_kernel` or `_prefill_kernel` with 27B's attention heads (24 query / 4 KV heads, head_dim
256, block 16), or `cuda_gemv._int4_row_kernel` / `_int4_dp4a_row_kernel` / NVFP4's `_weight_only_gemv_kernel` at
one row / `_nvfp4_dp4a_row_kernel` at 27B's gate/up (34,816 x 5,120; int4 groups of 128 with zero points), with the
tile the engine would use unless told otherwise (the GEMVs: the tuned
table's gate/up and down entries), or the MoE one-token GEMV kernels (`ops/moe/cuda.py` A1 and B1, --format) at
35B-A3B's experts (default 8 rows, K steps of 256), or the FP8 skinny decode GEMM (`cuda_fp8._skinny_kernel`) at 27B's
gate/up and --rows rows with the tuned table's tile (--tma 1 / 0: its tiles copied by TMA or not), disassembles
the cubin with the `nvdisasm` that Triton ships, and prints the registers a thread takes (Triton's `ptxas -v`), the
largest loop's instruction count (for a GEMV also per weight) and its commonest opcodes; for the skinny GEMM also
how many of its programs an SM holds and the waves of its launch on an H100 / H200's 132 SMs. `--kernel rms-norm`
compiles the prompt step's RMS norm (`ops/norm/cuda._rms_norm_kernel`, a row of 27B's 5,120 a program, --norm: what
it writes) and prints the rows its registers let the SMs hold at once and its whole (loop-free) instruction count;
`--kernel align` the MoE grouping launch (`ops/moe/cuda._align_kernel`), whose counting loop takes --count pairs a
step (at 512 and more its largest loop).
The eleventh session found fp8 decode reading its V tiles one byte at a time this way (128 `LDS.U8` in a loop of
1,234 instructions; docs/performance.md); the GEMVs' layout conversions through shared memory show as `BAR.SYNC`
and `LDS` in the loop.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import NamedTuple

import triton
import triton.language as tl

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 24, 4, 256, 16
CACHE_TYPES = {"bf16": ("bf16", tl.bfloat16, 2), "fp8": ("fp8e4nv", tl.float16, 1)}  # Triton type, dot dtype, bytes

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


class LoopReport(NamedTuple):
    shared_bytes: int
    instructions: int  # in the largest loop (a label and a later branch back to it)
    opcodes: Counter  # opcode (with its modifiers) -> count in that loop (in the kernel where it has none)
    kernel_instructions: int  # in the whole kernel


def compile_attention(kernel: str = "decode", cache: str = "bf16", arch: int = 90, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None):
    """The compiled kernel (triton.compile's result) for `arch`, with the engine's tile where not given and the
    specializations the engine's launches get: 16-byte aligned pointers, and integer arguments divisible by 16
    where 27B's values are (strides of q and of the cache), except those the kernel does not specialize on."""
    from deltaserve.ops.attention import cuda_decode, cuda_prefill

    cache_type, dot_dtype, size = CACHE_TYPES[cache]
    group = HEADS // KV_HEADS
    # 27B's values: q a view of the fused q/gate/k/v projection (14,336 wide), the cache [blocks, 16, 4, 256]
    ints = {"num_heads": HEADS, "stride_q_tok": 14336, "stride_q_head": HEAD_DIM, "stride_o_tok": HEADS * HEAD_DIM,
            "stride_o_head": HEAD_DIM, "stride_g_tok": 14336, "stride_g_head": HEAD_DIM,
            "stride_block": BLOCK * KV_HEADS * HEAD_DIM, "stride_slot": KV_HEADS * HEAD_DIM, "stride_kv_head": HEAD_DIM,
            "stride_table": 8750, "num_seqs": 3, "num_splits": 66}
    types = {"q": "*bf16", "k_cache": f"*{cache_type}", "v_cache": f"*{cache_type}", "out": "*bf16", "gate": "*bf16",
             "partial_out": "*fp32", "partial_lse": "*fp32", "block_tables": "*i32", "cu_seqlens_q": "*i64",
             "seq_lens": "*i64", "qk_scale": "fp32", "v_tile_scale": "fp32", "v_out_scale": "fp32"}
    if kernel == "decode":
        fn, tile = cuda_decode._decode_split_kernel, cuda_decode.DECODE_TILES[size]
        constants = {"GROUP": group, "HEADS_PAD": 16, "HEAD_DIM": HEAD_DIM, "HEAD_DIM_PAD": HEAD_DIM,
                     "BLOCK_SIZE": BLOCK, "BLOCK_N": block_n or tile.block_n,
                     "MIN_TOKENS_PER_SPLIT": cuda_decode.DECODE_ACTIVE_SPLIT_MIN_TOKENS, "DOT_DTYPE": dot_dtype,
                     "PRECISION": "tf32", "V_SCALE_IN_TILE": size == 1, "DIRECT": False}  # the split path
    elif kernel == "prefill":
        fn, tile = cuda_prefill._prefill_kernel, cuda_prefill.prefill_tiles(HEAD_DIM, group)
        constants = {"GROUP": group, "HEAD_DIM": HEAD_DIM, "HEAD_DIM_PAD": HEAD_DIM, "BLOCK_SIZE": BLOCK,
                     "BLOCK_M": tile.block_m, "BLOCK_N": block_n or tile.block_n, "DOT_DTYPE": tl.bfloat16,
                     "PRECISION": "tf32", "SPLIT_KV": False, "V_SCALE_IN_TILE": size == 1,
                     "partial_out": None, "partial_lse": None}  # unsplit: the engine passes None (a constexpr)
    else:
        raise ValueError(f"kernel must be decode or prefill, got {kernel!r}")
    return _compile(fn, constants, types, ints, arch, num_warps or tile.num_warps, num_stages or tile.num_stages)


# The one-row 4-bit GEMVs: (block_n, block_k, warps, stages) as the tuned table has them at gate/up (int4's dp4a:
# down); NVFP4's few-rows kernel at one row, and its dp4a kernel at a tile of the probe's sweep
GEMV_TILES = {"int4-row": (32, 128, 2, 4), "int4-dp4a": (16, 512, 2, 3), "nvfp4-gemv": (8, 4096, 4, 1),
              "nvfp4-dp4a": (16, 512, 2, 3)}
# the dp4a kernels' plain-block pointers (a launch's first TAIL_ROWS programs; none here)
TAIL_TYPES = {"tail_x": "*bf16", "tail_w": "*bf16", "tail_out": "*bf16"}


def compile_gemv(kernel: str = "int4-row", arch: int = 90, block_n: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
    """The compiled one-row 4-bit GEMV at 27B's gate/up (34,816 x 5,120; int4 groups of 128 with zero points, no K
    split), with the specializations its launches get (27B's integer arguments where divisible by 16)."""
    from deltaserve.ops.quant_gemm import cuda_gemv

    tile = dict(zip(("block_n", "block_k", "warps", "stages"), GEMV_TILES[kernel]))
    block_n, block_k = block_n or tile["block_n"], block_k or tile["block_k"]
    stages = num_stages or tile["stages"]
    if kernel == "nvfp4-gemv":
        constants = {"FORMAT": cuda_gemv.NVFP4.value, "GROUP": 16, "HAS_ZERO": False, "BLOCK_M": 1,
                     "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_N": True, "PDL": False}
        types = {"x": "*bf16", "words": "*i32", "scale": "*fp8e4nv", "zero": "*fp8e4nv", "scale_2": "*fp32",
                 "out": "*bf16"}
        ints = {"M": 1, "N": 34816, "K": 5120, "stride_xm": 5120, "stride_om": 34816, "stride_wn": 640,
                "stride_sn": 320}
        return _compile(cuda_gemv._weight_only_gemv_kernel, constants, types, ints, arch, num_warps or tile["warps"],
                        stages)
    if kernel == "nvfp4-dp4a":
        constants = {"BLOCK_N": block_n, "GROUPS_PER_STEP": max(1, block_k // 16), "SPLIT": False, "EVEN_N": True,
                     "STAGES": stages, "TAIL_ROWS": 0, "TAIL_K": 0, "PDL": False}
        types = {"parts": "*i32", "x_scale": "*fp32", "v_sum": "*i32", "words": "*i32", "scale": "*fp8e4nv",
                 "scale_2": "*fp32", "out": "*bf16", "partial": "*fp32", "counters": "*i32", **TAIL_TYPES}
        tables = (*cuda_gemv.E2M1_POSITIVE.value, *cuda_gemv.E2M1_NEGATIVE.value)
        ints = {"N": 34816, "K_WORDS": 640, "STEPS": 320 // constants["GROUPS_PER_STEP"], "stride_wn": 640,
                "stride_sn": 320,
                **dict(zip(("pos_lo", "pos_hi", "neg_lo", "neg_hi"), tables))}
        return _compile(cuda_gemv._nvfp4_dp4a_row_kernel, constants, types, ints, arch, num_warps or tile["warps"],
                        stages)
    constants = {"GROUP": 128, "BLOCK_N": block_n, "GROUPS_PER_STEP": max(1, block_k // 128), "HAS_ZERO": True,
                 "SPLIT": False, "EVEN_N": True, "STAGES": stages, "PDL": False}
    types = {"x": "*bf16", "parts": "*i32", "x_scale": "*fp32", "v_sum": "*i32", "words": "*i32",
             "scale": "*bf16", "zero": "*u8", "out": "*bf16", "partial": "*fp32", "counters": "*i32"}
    if kernel == "int4-dp4a":  # no plain block in the launch (its TAIL_ROWS programs)
        constants.update(TAIL_ROWS=0, TAIL_K=0)
        types.update(TAIL_TYPES)
    ints = {"N": 34816, "K_WORDS": 640, "STEPS": 40 // constants["GROUPS_PER_STEP"], "stride_wn": 640, "stride_sn": 40,
            "magic": cuda_gemv.MAGIC_2048.value, "shift": 12}
    fn = cuda_gemv._int4_row_kernel if kernel == "int4-row" else cuda_gemv._int4_dp4a_row_kernel
    return _compile(fn, constants, types, ints, arch, num_warps or tile["warps"], stages)


# the MoE one-token GEMV kernels (ops/moe/cuda.py A1 / B1) at 35B-A3B's experts: weight format -> (the weight's,
# its scales' and its zeros' Triton types, the format's GROUP)
MOE_ROW_FORMATS = {"bf16": ("*bf16", "*bf16", "*bf16", 1), "fp8": ("*fp8e4nv", "*fp32", "*fp32", 128),
                   "int4": ("*i32", "*bf16", "*u8", 128), "nvfp4": ("*i32", "*fp8e4nv", "*fp32", 16)}
MOE_ROW_KERNELS = ("moe-gate-up", "moe-down")
MOE_H, MOE_I, MOE_E, MOE_K = 2048, 512, 256, 8


def compile_moe_row(kernel: str = "moe-gate-up", fmt: str = "fp8", arch: int = 90, block_n: int = 8,
                    block_k: int = 256, num_warps: int = 4):
    """The compiled one-token MoE kernel A1 (gate/up + SiLU, routing inside, as at one token with the shared slot)
    or B1 (down + combine over the 8 routed slots and the shared one) at 35B-A3B's experts (H 2,048, I 512) in a
    weight format, with the specializations its launches get."""
    from deltaserve.ops.moe import cuda as moe_cuda

    weight, scales, zeros, group = MOE_ROW_FORMATS[fmt]
    wformat = {"bf16": moe_cuda.PLAIN, "fp8": moe_cuda.FP8, "int4": moe_cuda.INT4, "nvfp4": moe_cuda.NVFP4}[fmt]
    constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_N": True, "EVEN_K": True, "WFORMAT": wformat.value,
                 "GROUP": group, "HAS_ZERO": fmt == "int4", "PDL": False, "TOP_K": MOE_K}
    types = {"scales": scales, "zeros": zeros, "shared_scales": scales, "shared_zeros": zeros, "ids": "*i32",
             "topk_weights": "*fp32"}
    words = 8 if fmt in ("int4", "nvfp4") else 1  # weights a stored element holds
    if kernel == "moe-gate-up":
        constants.update(ROUTE=True, RENORMALIZE=True, BLOCK_E=MOE_E, BLOCK_TOP_K=MOE_K)
        types.update(x="*bf16", gate_up=weight, shared_gate_up=weight, act="*bf16", logits="*bf16")
        ints = {"H": MOE_H, "I": MOE_I, "stride_we": 2 * MOE_I * MOE_H // words, "stride_wn": MOE_H // words,
                "E": MOE_E, "stride_logits": MOE_E + 1, "stride_se": 2 * MOE_I * MOE_H // group,
                "stride_sn": MOE_H // group, "stride_ze": 2 * MOE_I * MOE_H // group}
        fn = moe_cuda._gate_up_row_kernel
    else:
        constants.update(HAS_SHARED=False, SHARED_SLOT=True)
        types.update(act="*bf16", down=weight, shared_down=weight, shared="*bf16", shared_gate="*bf16", out="*bf16")
        ints = {"H": MOE_H, "I": MOE_I, "stride_we": MOE_I * MOE_H // words, "stride_wn": MOE_I // words,
                "stride_se": MOE_I * MOE_H // group, "stride_sn": MOE_I // group, "stride_ze": MOE_I * MOE_H // group}
        fn = moe_cuda._down_row_kernel
    return _compile(fn, constants, types, ints, arch, num_warps, 1)


SKINNY_N, SKINNY_K, SMS = 34816, 5120, 132  # 27B's gate/up; an H100 SXM's or H200's SMs
SM_SHARED_BYTES, SM_REGISTERS, BLOCK_RESERVED_SHARED = 228 * 1024, 65536, 1024  # sm_90
SM_WARPS = 64  # sm_90: 2,048 threads an SM
NORM_D = 5120  # 27B's hidden size
# the prompt step's norms by what they write: (FP8 scale block or 0 for bf16, the unquantized row kept beside)
NORM_VARIANTS = {"fp8-kept": (128, True), "fp8": (128, False), "bf16": (0, False)}


def skinny_tile(rows: int, block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                split_k: int | None = None, tma: int | None = None) -> dict:
    """The FP8 skinny tile at 27B's gate/up and `rows` rows: the tuned table's, with what is given instead."""
    from deltaserve.ops.quant_gemm import configs

    tile = configs.config_for("fp8", SKINNY_N, SKINNY_K, rows)
    if tile.get("kind") != "skinny":  # the table runs another kind at these rows: the kernel's default tile
        tile = configs.skinny_config(SKINNY_N, SKINNY_K)
    given = dict(block_n=block_n, warps=num_warps, stages=num_stages, split_k=split_k, tma=tma)
    return dict(tile, **{name: value for name, value in given.items() if value is not None})


def compile_skinny(rows: int, tile: dict, arch: int = 90):
    """The compiled FP8 skinny kernel at 27B's gate/up (activations quantized before it, as the engine runs it)."""
    from deltaserve.ops.quant_gemm import cuda_fp8

    block_m, tma = max(16, 1 << (rows - 1).bit_length()), bool(tile.get("tma", 0))
    constants = {"BN_W": 128, "BLOCK_M": block_m, "BLOCK_N": tile["block_n"],
                 "BK": 128, "SPLIT": tile["split_k"] > 1, "QUANT_X": False, "EVEN_N": True, "EVEN_K": True,
                 "FLOOR": cuda_fp8.ACT_AMAX_FLOOR, "QMAX": cuda_fp8.E4M3_MAX, "TAIL_ROWS": 0, "TAIL_K": 0, "PDL": False,
                 "TMA": tma}
    types = {"x": "*bf16", "xq": "*fp8e4nv", "sx": "*fp32", "w": "*fp8e4nv", "ws": "*fp32", "out": "*bf16",
             "partial": "*fp32", "counters": "*i32", "tail_x": "*bf16", "tail_w": "*bf16", "tail_out": "*bf16"}
    if tma:  # host descriptors over xq [M, K] and w [N, K] in their tiles' boxes
        types.update(xq_desc=f"tensordesc<fp8e4nv[{block_m}, 128]>",
                     w_desc=f"tensordesc<fp8e4nv[{tile['block_n']}, 128]>")
    else:
        constants.update(xq_desc=None, w_desc=None)
    ints = {"M": rows, "N": SKINNY_N, "K": SKINNY_K, "stride_xm": SKINNY_K, "stride_out_m": SKINNY_N,
            "stride_tn": SKINNY_K}
    return _compile(cuda_fp8._skinny_kernel, constants, types, ints, arch, tile["warps"], tile["stages"])


def rms_norm_out_chunk(variant: str, out_chunk: int | None = None) -> int:
    """The columns at a time in which the norm writing `variant` writes its outputs: `out_chunk`, else the
    engine's PROMPT_OUT_CHUNK; 0 for a bf16 output (only quantized outputs are written in chunks)."""
    from deltaserve.ops.norm import cuda as norm

    return (norm.PROMPT_OUT_CHUNK if out_chunk is None else out_chunk) if NORM_VARIANTS[variant][0] else 0


def compile_rms_norm(variant: str = "fp8-kept", num_warps: int | None = None, arch: int = 90,
                     out_chunk: int | None = None):
    """The compiled prompt-step RMS norm (`ops/norm/cuda._rms_norm_kernel`, a row of 27B's 5,120 a program, the
    residual added) writing `variant`'s outputs: NORM_VARIANTS. Warps and the quantized outputs' chunk
    (rms_norm_out_chunk): the engine's unless given."""
    from deltaserve.ops.norm import cuda as norm

    quant_bk, keep = NORM_VARIANTS[variant]
    block = max(triton.next_power_of_2(NORM_D), quant_bk)
    constants = {"HAS_RESIDUAL": True, "BLOCK": block, "QUANT_BK": quant_bk, "KEEP_Y": keep, "PARTS_GROUP": 0,
                 "PARTS_LOW_HIGH": False, "SLICE": 0, "OUT_CHUNK": rms_norm_out_chunk(variant, out_chunk),
                 "PDL": False}
    types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp8e4nv" if quant_bk else "*bf16",
             "res_out_ptr": "*bf16", "sx_ptr": "*fp32", "y_kept_ptr": "*bf16", "parts_ptr": "*i32",
             "x_scale_ptr": "*fp32", "v_sum_ptr": "*fp32", "eps": "fp32"}
    ints = {"D": NORM_D, "x_stride": NORM_D, "res_stride": NORM_D, "y_stride": NORM_D}
    return _compile(norm._rms_norm_kernel, constants, types, ints, arch, num_warps or norm._warps(block), 1)


def compile_align(count: int, num_experts: int = 256, arch: int = 90, num_warps: int | None = None):
    """The compiled MoE align kernel (`ops/moe/cuda._align_kernel`) at 35B-A3B's 256 experts (BLOCK_M 64, the
    shipped CHUNK), counting `count` pairs a loop step (the launch's: min(ALIGN_COUNT, the pairs rounded up to a
    power of two))."""
    from deltaserve.ops.moe import cuda as moe_cuda

    constants = {"BLOCK_M": 64, "BLOCK_E": triton.next_power_of_2(num_experts), "CHUNK": moe_cuda.ALIGN_CHUNK,
                 "COUNT": count, "PDL": False}
    types = {name: "*i32" for name in ("topk_ids", "sorted_pairs", "block_expert", "block_first", "block_rows")}
    return _compile(moe_cuda._align_kernel, constants, types, {}, arch, num_warps or moe_cuda.ALIGN_WARPS, 1)


def programs_per_sm(shared_bytes: int, registers_per_thread: int, num_warps: int) -> int:
    """Programs an sm_90 SM holds at once: by shared memory (each also reserves 1 KB), by registers and by
    threads (2,048)."""
    by_shared = SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED)
    by_registers = SM_REGISTERS // (registers_per_thread * 32 * num_warps)
    return max(0, min(by_shared, by_registers, SM_WARPS // num_warps, 32))


def _compile(fn, constants: dict, types: dict, ints: dict, arch: int, num_warps: int, num_stages: int):
    """triton.compile of `fn` for sm_`arch`: `constants` as constexprs, the other parameters typed by `types`
    (default i32), pointers and the integers whose `ints` value is divisible by 16 specialized as such."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "params"):
        raise RuntimeError("sass_probe compiles kernels: unset TRITON_INTERPRET")
    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        aligned = signature[name].startswith("*") or ints.get(name, 1) % 16 == 0
        if aligned and not param.do_not_specialize:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def nvdisasm() -> str:
    """The nvdisasm that Triton's NVIDIA backend ships."""
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")


def registers(compiled, arch: int = 90) -> int:
    """Registers a thread of the compiled kernel takes (Triton's ptxas on its PTX): with the warps they fix how
    many programs an SM holds, so how many loads are in flight."""
    import triton.backends.nvidia as nvidia

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        log = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx.name, "-o", os.devnull], check=True,
                             capture_output=True, text=True).stderr
    return int(re.search(r"Used (\d+) registers", log).group(1))


def loop_report(compiled) -> LoopReport:
    """The largest loop of a compiled kernel's SASS: instruction count and opcodes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([nvdisasm(), "-c", cubin.name], check=True, capture_output=True, text=True).stdout
    lines = sass.splitlines()
    labels = {match.group(1): i for i, line in enumerate(lines) if (match := _LABEL.match(line))}
    everything = [m.group(1) for m in map(_INSTRUCTION.match, lines) if m]
    best = (0, Counter(everything))
    for i, line in enumerate(lines):
        match = _BRANCH.search(line)
        if match and labels.get(match.group(1), i) < i:  # a branch back: a loop from the label to here
            body = [m.group(1) for m in map(_INSTRUCTION.match, lines[labels[match.group(1)]:i + 1]) if m]
            if len(body) > max(best[0], 1):  # (a lone branch to itself ends every kernel: not a loop)
                best = (len(body), Counter(body))
    return LoopReport(compiled.metadata.shared, *best, len(everything))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sass_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["decode", "prefill", *GEMV_TILES, *MOE_ROW_KERNELS, "fp8-skinny",
                                             "rms-norm", "align"], default="decode")
    parser.add_argument("--count", type=int, default=None,
                        help="the align kernel's pairs counted a step (a power of two; default: ALIGN_COUNT)")
    parser.add_argument("--norm", choices=sorted(NORM_VARIANTS), default="fp8-kept",
                        help="what the RMS norm writes: FP8 with the bf16 row kept (GDN's input), FP8, or bf16")
    parser.add_argument("--out-chunk", type=int, default=None,
                        help="the RMS norm's quantized outputs written this many columns at a time (0: whole rows "
                             "at once, the form the engine replaced; default: the engine's)")
    parser.add_argument("--rows", type=int, default=64, help="the skinny GEMM's rows (1 to 64)")
    parser.add_argument("--split-k", type=int, default=None, help="the skinny GEMM's K splits (default: the table's)")
    parser.add_argument("--tma", type=int, choices=(0, 1), default=None,
                        help="the skinny GEMM's tiles copied by TMA (1) or pointer loads (0); default: the table's")
    parser.add_argument("--format", choices=sorted(MOE_ROW_FORMATS), default="fp8",
                        help="the MoE kernels' weight format")
    parser.add_argument("--cache", choices=sorted(CACHE_TYPES), default="bf16", help="the KV cache's dtype")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90 (H100/H200)")
    parser.add_argument("--block-n", type=int, default=None,
                        help="KV positions (a GEMV: weight rows) per program step (default: the engine's)")
    parser.add_argument("--block-k", type=int, default=None, help="a GEMV's columns per step (a multiple of 128)")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--top", type=int, default=12, help="how many opcodes to list")
    args = parser.parse_args(argv)
    for name in ("arch", "block_n", "block_k", "warps", "stages", "top", "rows", "split_k", "count"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.kernel in GEMV_TILES:
        compiled = compile_gemv(args.kernel, args.arch, args.block_n, args.block_k, args.warps, args.stages)
        options = compiled.metadata
        block_n, block_k = args.block_n or GEMV_TILES[args.kernel][0], args.block_k or GEMV_TILES[args.kernel][1]
        columns = block_k if args.kernel.startswith("nvfp4") else max(128, block_k)  # a step (int4: whole groups)
        weights = block_n * columns / (32 * options.num_warps)  # a thread's weights a loop step
        what = (f"{args.kernel} ({block_n} rows x {columns} columns a step, {options.num_warps} warps, "
                f"{options.num_stages} stages)")
    elif args.kernel == "fp8-skinny":
        if args.rows > 64:
            parser.error(f"--rows must be at most 64 (the skinny kernel's rows), got {args.rows}")
        tile = skinny_tile(args.rows, args.block_n, args.warps, args.stages, args.split_k, args.tma)
        compiled, weights = compile_skinny(args.rows, tile, args.arch), None
        held = programs_per_sm(compiled.metadata.shared, registers(compiled, args.arch), tile["warps"])
        programs = -(-SKINNY_N // tile["block_n"]) * tile["split_k"]
        waves = f"{programs / (SMS * held):.2f} waves" if held else "no program fits an SM"
        what = (f"fp8-skinny at {args.rows} rows (27B's gate/up, {tile['block_n']} columns a program, K split "
                f"{tile['split_k']}, {tile['warps']} warps, {tile['stages']} stages"
                f"{', TMA' if tile.get('tma') else ''}; {held} programs an SM, "
                f"{programs} programs: {waves} of {SMS} SMs)")
    elif args.kernel == "rms-norm":
        if args.out_chunk is not None and (args.out_chunk < 0 or args.out_chunk % 128):
            parser.error(f"--out-chunk must be 0 or a multiple of 128 (the FP8 block), got {args.out_chunk}")
        compiled, weights = compile_rms_norm(args.norm, args.warps, args.arch, args.out_chunk), None
        chunk, warps = rms_norm_out_chunk(args.norm, args.out_chunk), compiled.metadata.num_warps
        held = programs_per_sm(compiled.metadata.shared, registers(compiled, args.arch), warps)
        what = (f"rms-norm writing {args.norm} (a row of {NORM_D:,} a program, {warps} warps"
                f"{f', outputs {chunk} columns at a time' if chunk else ''}; {held} programs an SM: "
                f"{SMS * held} rows in flight on {SMS} SMs)")
    elif args.kernel == "align":
        from deltaserve.ops.moe import cuda as moe_cuda

        count = args.count or moe_cuda.ALIGN_COUNT
        if count & (count - 1):
            parser.error(f"--count must be a power of two, got {count}")
        compiled = compile_align(count, arch=args.arch, num_warps=args.warps)
        weights = None
        what = f"align counting {count} pairs a step (256 experts, {compiled.metadata.num_warps} warps)"
    elif args.kernel in MOE_ROW_KERNELS:
        block_n, block_k = args.block_n or 8, args.block_k or 256
        compiled = compile_moe_row(args.kernel, args.format, args.arch, block_n, block_k, args.warps or 4)
        threads = 32 * compiled.metadata.num_warps
        # A1's loop is one K step of gate and up rows; B1's largest, one slot (its K loop unrolled where I / BK is 1)
        weights = (2 * block_n * block_k if args.kernel == "moe-gate-up" else block_n * MOE_I) / threads
        what = f"{args.kernel} on {args.format} experts ({block_n} rows, K steps of {block_k}, {threads // 32} warps)"
    else:
        compiled = compile_attention(args.kernel, args.cache, args.arch, args.block_n, args.warps, args.stages)
        weights, what = None, f"{args.kernel} over a {args.cache} cache"
    report = loop_report(compiled)
    per_weight = f" ({report.instructions / weights:.2f} a weight)" if weights else ""
    body = (f"its largest loop has {report.instructions} SASS instructions{per_weight}" if report.instructions
            else f"no loop: {report.kernel_instructions} SASS instructions")
    print(f"{what}, sm_{args.arch}: {report.shared_bytes:,} B of shared memory, {registers(compiled, args.arch)} "
          f"registers a thread; {body}")
    for opcode, count in report.opcodes.most_common(args.top):
        print(f"  {count:5d}  {opcode}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
