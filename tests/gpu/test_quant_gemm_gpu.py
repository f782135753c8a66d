"""The quantized GEMMs (ops/quant_gemm) compiled on the GPU against the float64 value of each format's semantics, at
Qwen3.5-27B's projection shapes: every kernel (the CUDA-core GEMV of each format, FP8 skinny with the activation
quantized in its prologue and apart, FP8 tiled GEMM, torch's block-scaled F.scaled_mm where torch has it; int4 and
NVFP4 skinny, tiled GEMM, dequantize + cuBLAS) and the dispatch at 1 to 8192 rows; decode kernels inside a CUDA graph equal to eager.

Bounds (tests/ops/quant_gemm_oracle.py): 16-bit tensor-core products accumulate at 2^-23 (a truncating float32);
FP8 ones at 2^-12 within a K block (Hopper keeps ~14 bits; DeepSeek-V3 section 3.3.2), which is why each block is
its own dot added in float32.
Run on an H200 by `tests/gpu/run.sh OUT quant`.
"""

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.model_configs import shipped_config
from deltaserve.ops import quant_gemm
from deltaserve.ops.quant_gemm import configs, cuda_fp8, cuda_gemv, cuda_weight_only
from deltaserve.ops.quant_gemm import reference as ref
from tests.ops import quant_gemm_oracle as oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

U_TC16 = 2.0**-23
U_TC8 = 2.0**-12
DECODE_ROWS = [1, 2, 8, 16, 64]
# tiles the probe (benchmarks/quant_gemm_probe.py) also sweeps, so that it finds them compiled
SKINNY_TILES = [dict(block_n=64, block_k=128, split_k=1, warps=4, stages=6, quant_x=1),
                dict(block_n=128, block_k=128, split_k=4, warps=4, stages=4, quant_x=0)]
# FP8's skinny kernel with its tiles copied by TMA: the activation quantized before (split K too) and inside
FP8_TMA_TILES = [dict(block_n=64, block_k=128, split_k=1, warps=4, stages=4, quant_x=0, tma=1),
                 dict(block_n=128, block_k=128, split_k=2, warps=8, stages=3, quant_x=0, tma=1),
                 dict(block_n=64, block_k=128, split_k=1, warps=4, stages=4, quant_x=1, tma=1)]
# the GEMV's first tiles in the probe's sweep: (format class, rows bucket) -> tile
GEMV_TILES = {("fp8", 1): dict(block_n=8, block_k=1024, warps=4, stages=1),
              ("int4", 1): dict(block_n=256, block_k=128, split_k=8, warps=4, stages=3),
              ("weight_only", 1): dict(block_n=16, block_k=1024, warps=4, stages=1),
              ("weight_only", 8): dict(block_n=8, block_k=512, warps=4, stages=1)}
GEMM_TILES = [dict(block_m=128, block_n=128, block_k=128, group_m=8, warps=8, stages=3),
              dict(block_m=64, block_n=128, block_k=64, group_m=8, warps=4, stages=4)]


def projections() -> list[tuple[int, int]]:
    """(N, K) of 27B's quantized projections, fused as the bf16 path fuses them (GDN's in_proj_a/b stay bf16)."""
    cfg = ModelConfig.from_pretrained(str(shipped_config("Qwen/Qwen3.5-27B")))  # shipped in the package
    h, attn = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    qkv = 2 * attn + 2 * cfg.num_kv_heads * cfg.head_dim  # q with its output gate, k, v
    shapes = [(2 * cfg.intermediate_size, h), (h, cfg.intermediate_size), (cfg.conv_dim + cfg.gdn_value_dim, h),
              (h, cfg.gdn_value_dim), (qkv, h), (h, attn)]
    return list(dict.fromkeys(shapes))  # the attention o_proj shares the GDN out-proj's shape


def make_weight(fmt: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "fp8":
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        return ref.prepare_fp8_block(*ref.fp8_block_quantize(w, (128, 128)), (128, 128))
    if fmt == "int4":
        g = 128
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", generator=gen, dtype=torch.int32)
        scale = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3 + 1e-4).to(torch.bfloat16)
        zero = torch.randint(-2**31, 2**31 - 1, (-(-n // 8), k // g), device="cuda", generator=gen, dtype=torch.int32)
        return ref.prepare_int4(packed, scale, zero, g, None, (n, k))
    packed = torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, device="cuda", generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    return ref.prepare_nvfp4(packed, scale, 1e-5)


def activations(m, k, dtype=torch.bfloat16, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


def weight_rounding(fmt, kind):
    """(u_w, exact_codes) of a kernel kind: FP8 and int4 on the CUDA cores or as exact codes round no weight;
    NVFP4's GEMV rounds its group scale products in float32 (3 roundings); bf16 tiles round each weight."""
    if fmt == "fp8" or (fmt == "int4" and kind in ("gemv", "skinny")):
        return 0.0, fmt == "int4" and kind == "skinny"
    return (3 * 2.0**-24 if kind == "gemv" else 2.0**-8), False


def check(fmt, x, w, got, what, u_w=0.0, exact_codes=False):
    if fmt == "fp8":
        y64, terms = oracle.fp8_exact(x, w)
        bound = oracle.fp8_bound(x, w, y64, terms, u_dot=U_TC8)
    else:
        y64, terms = oracle.weight_only_exact(x, w)
        bound = oracle.weight_only_bound(x, w, y64, terms, u_dot=U_TC16, u_w=u_w, exact_codes=exact_codes)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0]), what
    oracle.assert_within(got, y64, bound, what)


@pytest.fixture(scope="module")
def weights():
    """One weight per (format, shape), made once (~8 GB of FP8 and 4-bit weights at most alive)."""
    return {(fmt, n, k): make_weight(fmt, n, k) for fmt in ("fp8", "int4", "nvfp4") for n, k in projections()}


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_dispatch_at_every_row_count(fmt, weights):
    """The op as the engine calls it (the tuned table or the defaults) at decode and prefill row counts; 8192 rows
    at the widest and the longest shape."""
    shapes = projections()
    for n, k in shapes:
        w = weights[(fmt, n, k)]
        for m in DECODE_ROWS + [512] + ([8192] if (n, k) in (shapes[0], shapes[1]) else []):
            op = {"fp8": quant_gemm.fp8_block_linear, "int4": quant_gemm.int4_linear,
                  "nvfp4": quant_gemm.nvfp4_linear}[fmt]
            x = activations(m, k)
            kind = configs.config_for(fmt, n, k, m)["kind"]
            u_w, exact_codes = weight_rounding(fmt, kind)
            check(fmt, x, w, op(x, w), f"{fmt} {kind} N={n} K={k} M={m}", u_w=u_w, exact_codes=exact_codes)


@pytest.mark.parametrize("tile", SKINNY_TILES)
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_skinny_tiles(fmt, tile, weights):
    for n, k in projections()[:2]:
        w = weights[(fmt, n, k)]
        kernel = cuda_fp8.skinny if fmt == "fp8" else cuda_weight_only.skinny
        for m in (1, 17, 64):
            x = activations(m, k)
            u_w, exact_codes = weight_rounding(fmt, "skinny")
            check(fmt, x, w, kernel(x, w, tile), f"{fmt} skinny {tile} N={n} K={k} M={m}", u_w=u_w,
                  exact_codes=exact_codes)


@pytest.mark.parametrize("tile", FP8_TMA_TILES)
def test_fp8_skinny_tma_tiles(tile, weights):
    """The TMA copies give the sums of the pointer loads, bit for bit (the same tiles, the same dots)."""
    for n, k in projections()[:2]:
        w = weights[("fp8", n, k)]
        for m in (1, 17, 64):
            x = activations(m, k)
            got = cuda_fp8.skinny(x, w, tile)
            check("fp8", x, w, got, f"fp8 skinny {tile} N={n} K={k} M={m}")
            assert torch.equal(got, cuda_fp8.skinny(x, w, dict(tile, tma=0))), f"TMA against pointers N={n} M={m}"


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_gemv_tiles(fmt, weights):
    """The CUDA-core GEMV at the widest and the longest shape: one row (every format; int4 and NVFP4 by their float
    and dp4a kernels, NVFP4's at 512 columns a step, K split in 2), 3 and 8 rows (int4, NVFP4)."""
    for n, k in projections()[:2]:
        w = weights[(fmt, n, k)]
        for m in (1,) if fmt == "fp8" else (1, 3, 8):
            bucket = configs.row_bucket(m)
            tile = GEMV_TILES.get((fmt, bucket), GEMV_TILES.get(("weight_only", bucket)))
            assert cuda_gemv.supports(w, tile, m)
            x = activations(m, k)
            u_w, _ = weight_rounding(fmt, "gemv")
            check(fmt, x, w, cuda_gemv.gemv(x, w, tile), f"{fmt} gemv {tile} N={n} K={k} M={m}", u_w=u_w)
            if fmt == "fp8":  # the weight tiles streamed 2 steps ahead through shared memory: the same sums
                assert torch.equal(cuda_gemv.gemv(x, w, dict(tile, stages=3)), cuda_gemv.gemv(x, w, tile))
            if fmt != "fp8" and m == 1:  # the dp4a kernels: x in 16-bit fixed point, the codes dotted in int32
                y64, _ = oracle.weight_only_exact(x, w)
                # a narrow step (threads across rows), then one a warp's threads span (each holds 8 rows)
                for dp4a in (dict(tile, block_k=512, dp4a=1, split_k=2),
                             dict(block_n=8, block_k=1024, warps=1, stages=1, dp4a=1, split_k=2)):
                    group = w.group_size if fmt == "int4" else cuda_gemv.NVFP4_GROUP
                    splits = cuda_gemv._row_steps(k, group, dp4a)[1]
                    bound = (oracle.int4_dp4a_bound if fmt == "int4" else oracle.nvfp4_dp4a_bound)(x, w, y64, splits)
                    oracle.assert_within(cuda_gemv.gemv(x, w, dp4a), y64, bound, f"{fmt} gemv {dp4a} N={n} K={k}")


@pytest.mark.parametrize("tile", GEMM_TILES)
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_prefill_kernels(fmt, tile, weights):
    n, k = projections()[3]  # 5120 x 6144
    w = weights[(fmt, n, k)]
    for m in (65, 600):
        x = activations(m, k)
        if fmt == "fp8":
            check(fmt, x, w, cuda_fp8.gemm(x, w, tile), f"fp8 gemm {tile} M={m}")
        else:
            check(fmt, x, w, cuda_weight_only.gemm(x, w, tile), f"{fmt} gemm {tile} M={m}", u_w=2.0**-8)
            check(fmt, x, w, cuda_weight_only.cublas(x, w), f"{fmt} cublas M={m}", u_w=2.0**-8)


def test_torch_block_scaled_mm_where_torch_has_it(weights):
    n, k = projections()[3]
    w = weights[("fp8", n, k)]
    if not cuda_fp8.torch_supports(w):
        pytest.skip(f"torch {torch.__version__} has no F.scaled_mm")
    x = activations(600, k)
    check("fp8", x, w, cuda_fp8.torch_scaled_mm(x, w), "torch F.scaled_mm")


def test_fp16_activations(weights):
    """fp16 takes its own int4 codes (1024 + q) and output rounding."""
    n, k = projections()[3]
    for fmt in ("fp8", "int4", "nvfp4"):
        w = weights[(fmt, n, k)]
        for m in (1, 40, 300):
            x = activations(m, k, torch.float16)
            kind = configs.config_for(fmt, n, k, m)["kind"]
            op = {"fp8": quant_gemm.fp8_block_linear, "int4": quant_gemm.int4_linear,
                  "nvfp4": quant_gemm.nvfp4_linear}[fmt]
            u_w, exact_codes = weight_rounding(fmt, kind)
            check(fmt, x, w, op(x, w), f"{fmt} fp16 M={m}", u_w=min(u_w, 2.0**-11), exact_codes=exact_codes)


def test_act_order_and_odd_shapes():
    """An int4 weight with act order, NVFP4 with per-row scale_2, FP8 with N and K off the 128 grid."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    n, k, g = 1000, 1024, 64
    g_idx = torch.empty(k, dtype=torch.int32, device="cuda")
    g_idx[torch.randperm(k, device="cuda", generator=gen)] = torch.arange(k, dtype=torch.int32, device="cuda") // g
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3).to(torch.bfloat16)
    w4 = ref.prepare_int4(packed, scale, None, g, g_idx, (n, k))
    nv = ref.prepare_nvfp4(torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen, dtype=torch.uint8),
                           (torch.rand(n, k // 16, device="cuda", generator=gen) * 100).to(torch.float8_e4m3fn),
                           torch.rand(n, device="cuda", generator=gen) * 1e-4)
    q, s = ref.fp8_block_quantize(torch.randn(1000, 1000, device="cuda", generator=gen), (128, 128))
    f8 = ref.prepare_fp8_block(q, s, (128, 128))
    for m in (1, 5, 9, 130):
        x = activations(m, k)
        for fmt, w, op in (("int4", w4, quant_gemm.int4_linear), ("nvfp4", nv, quant_gemm.nvfp4_linear)):
            u_w, exact_codes = weight_rounding(fmt, configs.config_for(fmt, n, k, m)["kind"])
            check(fmt, x, w, op(x, w), f"{fmt} odd M={m}", u_w=u_w, exact_codes=exact_codes)
        x = activations(m, 1000)
        check("fp8", x, f8, quant_gemm.fp8_block_linear(x, f8), f"fp8 1000x1000 M={m}")


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_cuda_graph_replay_equals_eager(fmt, weights):
    """Products captured in a CUDA graph (as the engine replays decode steps and prefill chunks of up to 1,024
    tokens) give the eager bits: split K, the GEMV, F.scaled_mm and the weight-only prefill's scratch included."""
    op = {"fp8": quant_gemm.fp8_block_linear, "int4": quant_gemm.int4_linear, "nvfp4": quant_gemm.nvfp4_linear}[fmt]
    cuda_weight_only.reserve_scratch(max(n * k for n, k in projections()), torch.bfloat16, "cuda")  # as warm_up
    for n, k in projections()[:2]:
        w = weights[(fmt, n, k)]
        for m in (1, 8, 64, 600):
            x = activations(m, k)
            eager = op(x, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = op(x, w)
            x.copy_(activations(m, k, seed=5))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, op(x, w)), f"{fmt} N={n} K={k} M={m}: graph != eager after new inputs"
            assert not torch.equal(captured, eager)


def test_fp8_prologues_write_the_activation_the_product_reads(weights, capsys):
    """On the H200, in bf16: ops.linear's RMS norm, SiLU and gated-norm projections onto an FP8 weight, whose kernels
    write the activation quantized (no quantize kernel), at the table's one-row, skinny and prefill row counts of
    27B's gate/up, down and GDN out-projection (F.scaled_mm takes it quantized at a multiple of 4 rows): the codes
    and scales written are the quantize kernel's of the op's output, and the product is the FP8 product of that
    activation, bit for bit wherever the product repeats its own bits (cuBLASLt's block-scaled GEMM need not).

    The SiLU and the gated norm write the unfused op's very output. The RMS norm's quantizing variant may add its
    float32 sum of squares in another order (Triton lays its row out for the scale groups): measured on an H100,
    at 2,048 rows 12 of 10.5M codes came out one step apart. So its normed row (kept beside the codes) is checked
    within one bf16 ulp of the unfused norm's, the rounding a reordered float32 sum can flip."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight
    from deltaserve.ops.activation import silu_and_mul
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda
    from deltaserve.ops.norm import gated_rms_norm, rms_norm
    from deltaserve.ops.quant_gemm import cuda_fp8

    (n_up, k_up), (n_down, k_down), _, (n_out, k_out) = projections()[:4]
    up, down, out = (QuantWeight(weights[("fp8", n, k)], quant_gemm.fp8_block_linear)
                     for n, k in ((n_up, k_up), (n_down, k_down), (n_out, k_out)))
    norm_w, head_w = activations(1, k_up, seed=3)[0] * 0.1, activations(1, 128, seed=6)[0] * 0.1
    unrepeatable = []

    def check(name, m, weight, fused, written, op_output):
        """written: the Fp8Activation the prologue wrote (None where the product quantized it), op_output the
        unquantized activation it stands for."""
        if written is not None:
            xq, sx = cuda_fp8.quantize(op_output, 128)
            assert torch.equal(written.xq.view(torch.uint8), xq.view(torch.uint8)), f"{name} codes M={m}"
            assert torch.equal(written.sx, sx), f"{name} scales M={m}"
        reference = weight.matmul(written if written is not None else op_output)
        if torch.equal(reference, weight.matmul(written if written is not None else op_output)):
            assert torch.equal(fused, reference), f"{name} M={m}"
        else:
            unrepeatable.append(f"{name} M={m}")

    for m in (1, 3, 16, 64, 68, 301, 2048):
        x, res, gate_up = activations(m, k_up), activations(m, k_up, seed=4), activations(m, 2 * k_down, seed=5)
        fused, h = linear.rms_norm_linear(x, norm_w, 1e-6, up, res)
        normed, h_ref = rms_norm(x, norm_w, 1e-6, res)
        assert torch.equal(h, h_ref), f"residual M={m}"
        block = up.fp8_input_block(m)
        torch_kind = configs.config_for("fp8", n_up, k_up, m)["kind"] == "torch"
        assert (block is not None) == (not torch_kind or m % 4 == 0), f"M={m}"
        written = None
        if block:
            written = norm_cuda.rms_norm(x, norm_w, 1e-6, res, quant_block=block)[0]
            kept = norm_cuda.rms_norm(x, norm_w, 1e-6, res, quant_block=block, keep_unquantized=True)[0]
            assert torch.equal(kept.xq.view(torch.uint8), written.xq.view(torch.uint8)), f"kept codes M={m}"
            larger = torch.maximum(kept.unquantized.float().abs(), normed.float().abs())
            ulp = torch.exp2(torch.floor(torch.log2(larger.clamp(min=2.0**-126))) - 7)  # bf16: 8 significant bits
            assert ((kept.unquantized.float() - normed.float()).abs() <= ulp).all(), f"normed row M={m}"
        check("gate/up", m, up, fused, written, kept.unquantized if block else normed)
        block = down.fp8_input_block(m)
        check("down", m, down, linear.silu_mul_linear(gate_up, down),
              block and activation_cuda.silu_and_mul(gate_up, quant_block=block), silu_and_mul(gate_up))
        heads, gate = (activations(m, k_out, seed=s).view(m, k_out // 128, 128) for s in (7, 8))  # GDN's out-proj
        block = out.fp8_input_block(m)
        check("GDN out", m, out, linear.gated_norm_linear(heads, gate, head_w, 1e-6, out),
              block and norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6, quant_block=block),
              gated_rms_norm(heads, gate, head_w, 1e-6).reshape(m, k_out))
    with capsys.disabled():
        print(f"\n[fp8 prologues] products that did not repeat their own bits (inputs compared): {unrepeatable}")


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_prologues_write_the_dp4a_parts_the_product_reads(fmt, weights):
    """On the H200, in bf16, one row: ops.linear's RMS norm, SiLU and gated-norm projections onto 27B's int4 / NVFP4
    gate/up, down and GDN out-projection, where the table runs the dp4a GEMVs: the prologue writes the row's
    fixed-point parts (those _x_parts_kernel makes of the row it wrote, bit for bit), the product reads them (no
    parts launch of its own) and returns what it returns making them itself."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    op = quant_gemm.int4_linear if fmt == "int4" else quant_gemm.nvfp4_linear
    (n_up, k_up), (n_down, k_down), _, (n_out, k_out) = projections()[:4]
    up, down, out = (QuantWeight(weights[(fmt, n, k)], op) for n, k in ((n_up, k_up), (n_down, k_down), (n_out, k_out)))
    spec = up.dp4a_input(1)
    assert spec is not None and down.dp4a_input(1) == spec and out.dp4a_input(1) == spec, "the table's dp4a tiles"
    x, res, gate_up = activations(1, k_up), activations(1, k_up, seed=4), activations(1, 2 * k_down, seed=5)
    heads, gate = (activations(1, k_out, seed=s).view(1, k_out // 128, 128) for s in (7, 8))
    norm_w, head_w = activations(1, k_up, seed=3)[0] * 0.1, activations(1, 128, seed=6)[0] * 0.1
    written = [norm_cuda.rms_norm(x, norm_w, 1e-6, res, dp4a=spec)[0],
               activation_cuda.silu_and_mul(gate_up, dp4a=spec),
               norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6, dp4a=spec)]
    for act in written:
        for mine, theirs in zip((act.parts, act.x_scale, act.v_sum), cuda_gemv.x_parts(act.x, *spec, {})):
            assert torch.equal(mine, theirs)
    fused = [linear.rms_norm_linear(x, norm_w, 1e-6, up, res)[0], linear.silu_mul_linear(gate_up, down),
             linear.gated_norm_linear(heads, gate, head_w, 1e-6, out)]
    for name, weight, act, got in zip(("gate/up", "down", "GDN out"), (up, down, out), written, fused):
        assert torch.equal(got, weight.matmul(act)), name
        assert torch.equal(got, weight.matmul(act.x)), f"{name}: the product making its own parts"


@pytest.mark.parametrize("output", ["fp8", "int4", "nvfp4"])
def test_one_row_norm_in_slices_writes_the_bits_of_one_program(output, monkeypatch):
    """On the H200, 27B's hidden row (5,120 columns, bf16, with the residual): the RMS norm written quantized for an
    FP8 product (and kept) or with its dp4a parts by a program per ROW_SLICE columns gives every output bit of the
    one-program launch (each slice sums the whole row's squares with the same code and warps)."""
    from deltaserve.ops.norm import cuda as norm_cuda

    k = ModelConfig.from_pretrained(str(shipped_config("Qwen/Qwen3.5-27B"))).hidden_size
    x, res, w = activations(1, k, seed=5), activations(1, k, seed=6), activations(1, k, seed=7)[0] * 0.1
    kwargs = {"fp8": dict(quant_block=128, keep_unquantized=True), "int4": dict(dp4a=(128, False)),
              "nvfp4": dict(dp4a=(16, True))}[output]

    def outputs():
        act, h = norm_cuda.rms_norm(x, w, 1e-6, res, **kwargs)
        if isinstance(act, ref.Fp8Activation):
            return [act.xq.view(torch.uint8), act.sx, act.unquantized, h]
        return [act.x, act.parts, act.x_scale, act.v_sum, h]

    assert k > norm_cuda.ROW_SLICE
    sliced = outputs()
    monkeypatch.setattr(norm_cuda, "ROW_SLICE", 1 << 20)
    whole = outputs()
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


@pytest.mark.parametrize("keep", [False, True])
def test_prompt_rows_normed_in_chunks_write_the_bits_of_each_row_alone(keep):
    """On the H200, 27B's hidden rows (5,120 columns, bf16, with the residual), 300 of them: the RMS norm written
    quantized for an FP8 product (and kept), PROMPT_OUT_CHUNK columns at a time after the sum of squares, gives
    every output bit that each row alone gets from its ROW_SLICE programs (a decode step's launch): the compiled
    sums of squares agree, so a row's FP8 input does not depend on the rows beside it."""
    from deltaserve.ops.norm import cuda as norm_cuda

    k = ModelConfig.from_pretrained(str(shipped_config("Qwen/Qwen3.5-27B"))).hidden_size
    x, res, w = activations(300, k, seed=8), activations(300, k, seed=9), activations(1, k, seed=10)[0] * 0.1
    assert k > norm_cuda.ROW_SLICE

    def outputs(rows):
        act, h = norm_cuda.rms_norm(x[rows], w, 1e-6, res[rows], quant_block=128, keep_unquantized=keep)
        return [act.xq.view(torch.uint8), act.sx.t(), h] + ([act.unquantized] if keep else [])

    together = outputs(slice(None))
    alone = [torch.cat(parts) for parts in zip(*(outputs(slice(i, i + 1)) for i in range(x.shape[0])))]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_gdn_in_projection_runs_its_plain_block_in_the_quantized_launch(fmt, weights):
    """On the H200, in bf16, one row: 27B's GDN in-projection, the int4 / NVFP4 / FP8 [q|k|v|z] beside the bf16 [b|a]
    (a SplitWeight), after the RMS norm that writes the row's parts (FP8: the row quantized, and kept): the [b|a]
    rows come from the quantized product's launch (quant_gemm.linear_with_tail), the [q|k|v|z] block bit for bit as
    its launch alone, the [b|a] block within a float32 dot's bound of cuBLAS's product (both float32 sums of the same
    bf16 products, rounded to bf16), and graph replay repeats it."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight, SplitWeight
    from deltaserve.ops.norm import cuda as norm_cuda
    from tests.tolerance import gamma, unit_roundoff

    cfg = ModelConfig.from_pretrained(str(shipped_config("Qwen/Qwen3.5-27B")))
    op = {"int4": quant_gemm.int4_linear, "nvfp4": quant_gemm.nvfp4_linear, "fp8": quant_gemm.fp8_block_linear}[fmt]
    n, k = cfg.conv_dim + cfg.gdn_value_dim, cfg.hidden_size
    quant = QuantWeight(weights[(fmt, n, k)], op)
    ba = activations(2 * cfg.gdn_num_v_heads, k, seed=9) * 0.02
    split = SplitWeight((quant, ba))
    x, res = activations(1, k), activations(1, k, seed=4)
    norm_w = activations(1, k, seed=3)[0] * 0.1

    def run():
        return linear.rms_norm_linear(x, norm_w, 1e-6, split, res, blocks=True)

    if fmt == "fp8":
        block = split.fp8_input_block(1)
        assert block is not None, "the table's skinny tile, reading the row quantized by the norm"
        row = norm_cuda.rms_norm(x, norm_w, 1e-6, res, quant_block=block, keep_unquantized=True)[0]
        plain_row = row.unquantized
    else:
        spec = quant.dp4a_input(1)
        assert spec is not None, "the table's dp4a tile"
        row = norm_cuda.rms_norm(x, norm_w, 1e-6, res, dp4a=spec)[0]
        plain_row = row.x
    both = quant_gemm.linear_with_tail(row, quant.prepared, ba)
    assert both is not None
    (qkvz, ba_out), _ = run()
    assert torch.equal(qkvz, both[0]) and torch.equal(ba_out, both[1]), "the SplitWeight's one launch"
    assert torch.equal(qkvz, quant.matmul(row))
    expected = plain_row.double() @ ba.double().T
    u = unit_roundoff(torch.bfloat16)  # per side: a float32 dot within gamma(k) of exact, then rounded once
    magnitudes = plain_row.double().abs() @ ba.double().abs().T
    bound = 2 * gamma(k, torch.float32) * magnitudes * (1 + u) + 2 * u * expected.abs()
    oracle.assert_within(ba_out, torch.nn.functional.linear(plain_row, ba), bound, "[b|a] in the launch vs cuBLAS")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (g_qkvz, g_ba), _ = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_qkvz, qkvz) and torch.equal(g_ba, ba_out)


def test_warm_up_compiles_every_variant(weights):
    """warm_up runs every row count, and reserves the weight-only prefill's scratch for the largest weight (a
    later "cublas" product writes its bf16 copy there, not into memory of its own)."""
    n, k = projections()[3]
    quant_gemm.warm_up([weights[(fmt, n, k)] for fmt in ("fp8", "int4", "nvfp4")])
    assert cuda_weight_only.scratch_bytes() >= n * k * 2
