"""The attention kernels compiled for an NVIDIA GPU on any machine (no GPU needed): their shared memory and their
KV loop's SASS, to see what a kernel change does to the machine code before spending device time on it.

    python -m benchmarks.sass_probe [--kernel decode|prefill] [--cache bf16|fp8] [--arch 90]
        [--block-n N] [--warps N] [--stages N] [--top 12]

Compiles `_decode_split_kernel` or `_prefill_kernel` with 27B's attention heads (24 query / 4 KV heads, head_dim
256, block 16) and the tile the engine would use unless told otherwise, disassembles the cubin with the
`nvdisasm` that Triton ships, and prints the registers a thread takes (Triton's `ptxas -v`), the largest loop's
instruction count and its commonest opcodes. The eleventh session found fp8 decode reading its V tiles one byte
at a time this way (128 `LDS.U8` in a loop of 1,234 instructions; docs/performance.md).
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
    opcodes: Counter  # opcode (with its modifiers) -> count in that loop


def compile_attention(kernel: str = "decode", cache: str = "bf16", arch: int = 90, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None):
    """The compiled kernel (triton.compile's result) for `arch`, with the engine's tile where not given and the
    specializations the engine's launches get: 16-byte aligned pointers, and integer arguments divisible by 16
    where 27B's values are (strides of q and of the cache), except those the kernel does not specialize on."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
                          options={"num_warps": num_warps or tile.num_warps,
                                   "num_stages": num_stages or tile.num_stages})


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
    best = (0, Counter())
    for i, line in enumerate(lines):
        match = _BRANCH.search(line)
        if match and labels.get(match.group(1), i) < i:  # a branch back: a loop from the label to here
            body = [m.group(1) for m in map(_INSTRUCTION.match, lines[labels[match.group(1)]:i + 1]) if m]
            if len(body) > best[0]:
                best = (len(body), Counter(body))
    return LoopReport(compiled.metadata.shared, *best)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sass_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--cache", choices=sorted(CACHE_TYPES), default="bf16", help="the KV cache's dtype")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90 (H100/H200)")
    parser.add_argument("--block-n", type=int, default=None, help="KV positions per loop step (default: the engine's)")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--top", type=int, default=12, help="how many opcodes to list")
    args = parser.parse_args(argv)
    for name in ("arch", "block_n", "warps", "stages", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    compiled = compile_attention(args.kernel, args.cache, args.arch, args.block_n, args.warps, args.stages)
    report = loop_report(compiled)
    print(f"{args.kernel} over a {args.cache} cache, sm_{args.arch}: {report.shared_bytes:,} B of shared memory, "
          f"{registers(compiled, args.arch)} registers a thread; its largest loop has {report.instructions} SASS "
          f"instructions")
    for opcode, count in report.opcodes.most_common(args.top):
        print(f"  {count:5d}  {opcode}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
