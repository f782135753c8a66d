"""GDN ops on the GPU (our Triton conv1d, decode and recurrent prefill kernels, fla's chunked prefill) against
the CPU reference.

Shapes are Qwen3.5-27B's GDN layer: 16 key heads, 48 value heads, K = V = 128, conv_dim 10240, W = 4, over
varlen batches straddling fla's 64-token chunks. Inputs are bf16 on the GPU; the reference runs on the CPU in
float32 from the same (bf16-representable) values. The last tests print decode timings and bandwidth (not
asserted) straight to the terminal, also under pytest's output capture.
"""

import time

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")

from deltaserve.ops import conv1d, gdn  # dispatch to the CUDA kernels on CUDA tensors
from deltaserve.ops.conv1d import cuda as conv_kernels
from deltaserve.ops.gdn import cuda as gdn_kernels

DEVICE = "cuda"
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 48, 128
KEY_DIM, VALUE_DIM = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM
CONV_DIM, WIDTH = 2 * KEY_DIM + VALUE_DIM, 4  # 10240

LENGTHS = [1, 63, 64, 65, 300, 1000]
SLOTS = [9, 2, 5, 0, 7, 3]  # out of order; 1, 4, 6, 8, 10, 11 belong to nobody
HAS_INITIAL = [False, True, True, False, True, True]
NUM_SLOTS = 12
UNTOUCHED = [s for s in range(NUM_SLOTS) if s not in SLOTS]

# Our kernels accumulate in float32 like the reference: the only difference is the final rounding to bf16
# (half an ulp, 2^-9 relative) and float32 summation order (~1e-6 absolute on O(1) values).
KERNEL_TOL = {"rtol": 2**-7, "atol": 1e-4}
# fla rounds the normalised q/k and its WY factors to bf16 inside the chunk, so its error is relative to the
# tensor's scale, not per element; fla's own tests allow an RMS error ratio of 0.005 for bf16.
FLA_RMS_RATIO = 1e-2



def reference_decode(q, k, v, g, beta, pool, slots):
    """The reference decode step on the pool slots, from precomputed gates g and beta."""
    out, final = gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool[slots].float())
    pool[slots] = final.to(pool.dtype)
    return out

def rms_ratio(actual, expected):
    """RMS of the error over RMS of the expected tensor (NaN anywhere makes it NaN, failing any bound)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def varlen_batch(lengths=LENGTHS):
    """(cu_seqlens, state_slots, has_initial_state) on the GPU."""
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    return cu.to(DEVICE), torch.tensor(SLOTS, device=DEVICE), torch.tensor(HAS_INITIAL, device=DEVICE)


def fresh_nan(pool):
    """Fill the slots without an initial state with NaN, as fresh memory may hold: they must never be read."""
    for slot, has in zip(SLOTS, HAS_INITIAL):
        if not has:
            pool[slot] = float("nan")
    return pool


def cpu32(*tensors):
    """CPU copies, floating point ones as float32 (always copies: a reference pool never aliases a GPU one)."""
    out = tuple(t.to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True) for t in tensors)
    return out if len(out) > 1 else out[0]


def gdn_inputs(num_tokens, gen):
    """q, k [T, 16, 128], v [T, 48, 128], beta [T, 48] bf16; g [T, 48] float32 log decay (mostly mild)."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)
    q = randn(num_tokens, KEY_HEADS, HEAD_DIM).bfloat16()
    k = randn(num_tokens, KEY_HEADS, HEAD_DIM).bfloat16()
    v = randn(num_tokens, VALUE_HEADS, HEAD_DIM).bfloat16()
    g = F.logsigmoid(randn(num_tokens, VALUE_HEADS) + 2.0)
    beta = torch.sigmoid(randn(num_tokens, VALUE_HEADS)).bfloat16()
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_prefill_and_decode_match_reference(dtype):
    gen = torch.Generator(DEVICE).manual_seed(0)
    cu, slots, has_initial = varlen_batch()
    x = torch.randn(int(cu[-1]), CONV_DIM, generator=gen, device=DEVICE).to(dtype)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen, device=DEVICE).to(dtype)
    pool = fresh_nan(torch.randn(NUM_SLOTS, CONV_DIM, WIDTH - 1, generator=gen, device=DEVICE).to(dtype))
    original = pool.clone()
    ref_pool = cpu32(pool)

    y = conv1d.conv_prefill(x, weight, pool, slots, has_initial, cu)
    expected = conv1d.conv_prefill(*cpu32(x, weight), ref_pool, *cpu32(slots, has_initial, cu))
    torch.testing.assert_close(cpu32(y), expected, **KERNEL_TOL)
    assert torch.equal(cpu32(pool).nan_to_num(), ref_pool.nan_to_num())  # states are copies: exact
    assert torch.equal(pool[UNTOUCHED].nan_to_num(), original[UNTOUCHED].nan_to_num())

    for _ in range(3):
        step = torch.randn(len(SLOTS), CONV_DIM, generator=gen, device=DEVICE).to(dtype)
        y = conv1d.conv_decode(step, weight, pool, slots)
        expected = conv1d.conv_decode(*cpu32(step, weight), ref_pool, cpu32(slots))
        torch.testing.assert_close(cpu32(y), expected, **KERNEL_TOL)
        assert torch.equal(cpu32(pool).nan_to_num(), ref_pool.nan_to_num())


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [8, 16, 32, 64, 128])
def test_gdn_decode_matches_reference(pool_dtype, block_v):
    gen = torch.Generator(DEVICE).manual_seed(1)
    slots = torch.tensor(SLOTS, device=DEVICE)
    pool = torch.randn(NUM_SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE).to(pool_dtype)
    original = pool.clone()
    for _ in range(3):
        ref_pool = cpu32(pool)  # each step from the kernel's pool: bf16 rounding must not compound
        q, k, v, g, beta = gdn_inputs(len(SLOTS), gen)
        out = gdn_kernels.gdn_decode(q, k, v, g, beta, pool, slots, block_v=block_v)
        expected = reference_decode(*cpu32(q, k, v, g, beta), ref_pool, cpu32(slots))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(cpu32(out), expected, **KERNEL_TOL)
        torch.testing.assert_close(cpu32(pool), ref_pool, **KERNEL_TOL)
    assert torch.equal(pool[UNTOUCHED], original[UNTOUCHED])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pass_cpu_offsets", [False, True])  # with them, the short sequences skip fla
@pytest.mark.parametrize("lengths", [LENGTHS, [300, 1, 1000, 63, 65, 64]])  # long ones adjacent, or apart
def test_gdn_prefill_matches_reference(pool_dtype, pass_cpu_offsets, lengths, monkeypatch):
    pytest.importorskip("fla")
    monkeypatch.setattr(gdn_kernels, "SPLIT_MIN_SHORT_SEQS", 1)  # these batches have 4 short sequences
    gen = torch.Generator(DEVICE).manual_seed(2)
    cu, slots, has_initial = varlen_batch(lengths)
    q, k, v, g, beta = gdn_inputs(int(cu[-1]), gen)
    pool = fresh_nan(torch.randn(NUM_SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE)
                     .to(pool_dtype))
    original = pool.clone()
    ref_pool = cpu32(pool)

    cu_cpu = cu.cpu() if pass_cpu_offsets else None
    out = gdn_kernels.gdn_prefill(q, k, v, g, beta, pool, slots, has_initial, cu, cu_seqlens_cpu=cu_cpu)
    expected = gdn.gdn_prefill(*cpu32(q, k, v, g, beta), ref_pool, *cpu32(slots, has_initial, cu))
    assert out.dtype == torch.bfloat16 and out.shape == v.shape
    assert rms_ratio(out, expected) < FLA_RMS_RATIO
    for seq, slot in enumerate(SLOTS):
        assert rms_ratio(pool[slot], ref_pool[slot]) < FLA_RMS_RATIO, f"sequence {seq} (slot {slot})"
    assert torch.equal(pool[UNTOUCHED], original[UNTOUCHED])


# Short chunks (a prefix-cache hit's 16 tokens, up to the recurrent threshold) and an empty sequence.
RECURRENT_LENGTHS = [16, 1, 0, 64, 5, 33]


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.float32)])
def test_gdn_recurrent_prefill_matches_reference(dtype, pool_dtype):
    """Short chunks take our recurrent kernel (no fla): it accumulates in float32 like the reference, so the
    kernel tolerance applies, to outputs and to every touched slot (fresh ones hold NaN)."""
    assert max(RECURRENT_LENGTHS) <= gdn_kernels.RECURRENT_PREFILL_MAX_LEN
    gen = torch.Generator(DEVICE).manual_seed(6)
    cu, slots, has_initial = varlen_batch(RECURRENT_LENGTHS)

    def chunk_inputs():
        q, k, v, g, beta = gdn_inputs(int(cu[-1]), gen)
        return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)

    q, k, v, g, beta = chunk_inputs()
    pool = fresh_nan(torch.randn(NUM_SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE)
                     .to(pool_dtype))
    original = pool.clone()
    for step in range(2):  # a second chunk continues from the first's states
        ref_pool = cpu32(pool)
        out = gdn.gdn_prefill(q, k, v, g, beta, pool, slots, has_initial, cu, max_query_len=max(RECURRENT_LENGTHS))
        expected = gdn.gdn_prefill(*cpu32(q, k, v, g, beta), ref_pool, *cpu32(slots, has_initial, cu))
        assert out.dtype == dtype and out.shape == v.shape
        torch.testing.assert_close(cpu32(out), expected, **KERNEL_TOL, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(cpu32(pool)[SLOTS], ref_pool[SLOTS], **KERNEL_TOL,
                                   msg=lambda m: f"step {step}: {m}")
        assert torch.equal(pool[UNTOUCHED], original[UNTOUCHED])
        has_initial = torch.ones_like(has_initial)
        q, k, v, g, beta = chunk_inputs()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_layer_chain_prefill_then_decode(pool_dtype):
    """The layer's sequence of ops: conv prefill, q/k/v as strided views of its output, gdn prefill, then
    decode steps through the pool-level entry points, all against the same chain on the CPU."""
    pytest.importorskip("fla")
    gen = torch.Generator(DEVICE).manual_seed(3)
    _, slots, has_initial = varlen_batch()
    weight = (torch.randn(CONV_DIM, WIDTH, generator=gen, device=DEVICE) * 0.5).bfloat16()
    conv_pool = fresh_nan(torch.randn(NUM_SLOTS, CONV_DIM, WIDTH - 1, generator=gen, device=DEVICE).bfloat16())
    ssm_pool = fresh_nan(torch.randn(NUM_SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE)
                         .to(pool_dtype))
    ref_conv_pool, ref_ssm_pool = cpu32(conv_pool), cpu32(ssm_pool).to(pool_dtype)

    A_log = torch.rand(VALUE_HEADS, generator=gen, device=DEVICE).mul(15).add(1).log()
    dt_bias = torch.randn(VALUE_HEADS, generator=gen, device=DEVICE)

    def layer(qkv, a, b, conv_pool, ssm_pool, cu_seqlens, decode):
        """qkv [T, conv_dim] -> o [T, HV, V], as GatedDeltaNet.forward (no projections)."""
        if decode:
            qkv = conv1d.conv_decode(qkv, weight.to(qkv), conv_pool, slots.to(qkv.device))
        else:
            qkv = conv1d.conv_prefill(qkv, weight.to(qkv), conv_pool, slots.to(qkv.device),
                                        has_initial.to(qkv.device), cu_seqlens)
        tokens = qkv.shape[0]
        q, k, v = qkv.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        q, k = q.view(tokens, KEY_HEADS, HEAD_DIM), k.view(tokens, KEY_HEADS, HEAD_DIM)
        v = v.view(tokens, VALUE_HEADS, HEAD_DIM)
        gates = A_log.to(qkv.device), dt_bias.to(qkv.device)
        if decode:  # the raw gates: the GPU kernel computes g and beta itself
            return gdn.gdn_decode(q, k, v, a, b, *gates, ssm_pool, slots.to(qkv.device))
        g, beta = gdn.gdn_gates(a, b, *gates)
        return gdn.gdn_prefill(q, k, v, g, beta, ssm_pool, slots.to(qkv.device), has_initial.to(qkv.device),
                               cu_seqlens)

    for step, lengths in enumerate([LENGTHS] + [[1] * len(SLOTS)] * 4):
        num_tokens = sum(lengths)
        qkv = torch.randn(num_tokens, CONV_DIM, generator=gen, device=DEVICE).bfloat16()
        a = torch.randn(num_tokens, VALUE_HEADS, generator=gen, device=DEVICE).bfloat16()
        b = torch.randn(num_tokens, VALUE_HEADS, generator=gen, device=DEVICE).bfloat16()
        step_cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
        out = layer(qkv, a, b, conv_pool, ssm_pool, step_cu.to(DEVICE), decode=step > 0)
        expected = layer(*cpu32(qkv, a, b), ref_conv_pool, ref_ssm_pool, step_cu, decode=step > 0)
        assert rms_ratio(out, expected) < FLA_RMS_RATIO, f"step {step}"
        assert rms_ratio(ssm_pool[SLOTS], ref_ssm_pool[SLOTS]) < FLA_RMS_RATIO, f"step {step}"
        assert torch.equal(cpu32(conv_pool[SLOTS]), ref_conv_pool[SLOTS]), f"step {step}"


# ---------------------------------------------------------------- timings (printed, not asserted)


def report(capsys, line):
    with capsys.disabled():
        print(f"\n[gdn/conv timing] {line}")


@pytest.mark.parametrize("batch", [1, 64])
def test_print_decode_bandwidth(batch, capsys):
    """gdn_decode and conv_decode per layer at 27B shapes: microseconds and achieved GB/s (bytes that must
    be read and written: state tiles twice, q/k/v/o once; conv: state columns twice, x, y, weight once)."""
    gen = torch.Generator(DEVICE).manual_seed(4)
    slots = torch.randperm(batch + 1, generator=torch.Generator().manual_seed(4))[:batch].to(DEVICE)
    q, k, v, g, beta = gdn_inputs(batch, gen)
    for pool_dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(batch + 1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE) * 0.1
        pool = pool.to(pool_dtype)
        state_bytes = 2 * batch * VALUE_HEADS * HEAD_DIM * HEAD_DIM * pool.element_size()
        io_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta, v))  # v twice: o has its shape
        for block_v in (16, 32, 64, 128):
            def step(pool=pool, block_v=block_v):
                gdn_kernels.gdn_decode(q, k, v, g, beta, pool, slots, block_v=block_v)

            ms = triton.testing.do_bench(step)
            report(capsys, f"gdn_decode batch={batch} pool={str(pool_dtype)[6:]} block_v={block_v}: "
                           f"{ms * 1e3:.1f} us, {(state_bytes + io_bytes) / ms / 1e6:.0f} GB/s")

    x = torch.randn(batch, CONV_DIM, generator=gen, device=DEVICE).bfloat16()
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen, device=DEVICE).bfloat16()
    conv_pool = torch.randn(batch + 1, CONV_DIM, WIDTH - 1, generator=gen, device=DEVICE).bfloat16()
    ms = triton.testing.do_bench(lambda: conv_kernels.conv_decode(x, weight, conv_pool, slots))
    conv_bytes = (2 * batch * CONV_DIM * (WIDTH - 1) + 2 * batch * CONV_DIM + CONV_DIM * WIDTH) * 2
    report(capsys, f"conv_decode batch={batch}: {ms * 1e3:.1f} us, {conv_bytes / ms / 1e6:.0f} GB/s")


def test_print_conv_prefill_bandwidth(capsys):
    """conv_prefill of one 8192-token bf16 prompt (memory-bound: x read once, y written once at best)."""
    gen = torch.Generator(DEVICE).manual_seed(5)
    num_tokens = 8192
    x = torch.randn(num_tokens, CONV_DIM, generator=gen, device=DEVICE).bfloat16()
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen, device=DEVICE).bfloat16()
    pool = torch.randn(2, CONV_DIM, WIDTH - 1, generator=gen, device=DEVICE).bfloat16()
    cu = torch.tensor([0, num_tokens], device=DEVICE)
    slots, has_initial = torch.tensor([1], device=DEVICE), torch.tensor([True], device=DEVICE)
    ms = triton.testing.do_bench(lambda: conv_kernels.conv_prefill(x, weight, pool, slots, has_initial, cu))
    min_bytes = 2 * num_tokens * CONV_DIM * 2
    report(capsys, f"conv_prefill T={num_tokens} D={CONV_DIM}: {ms * 1e3:.1f} us, "
                   f"{min_bytes / ms / 1e6:.0f} GB/s of the x-once/y-once minimum")


@pytest.mark.parametrize("num_seqs,q_len", [(1, 16), (1, 64), (1, 128), (8, 16), (8, 64)])
def test_print_recurrent_prefill_against_fla(num_seqs, q_len, monkeypatch, capsys):
    """W4's GDN call (1 sequence of 16 tokens after a cached prefix, 27B heads, float32 state) and its
    neighbours, through the recurrent kernel and through fla's chunked path: GPU time per call (do_bench,
    which also counts the GPU idling on a slow host) and host time per call. Where fla wins marks
    RECURRENT_PREFILL_MAX_LEN."""
    pytest.importorskip("fla")
    monkeypatch.setattr(gdn_kernels, "RECURRENT_PREFILL_MAX_LEN", max(q_len, gdn_kernels.RECURRENT_PREFILL_MAX_LEN))
    gen = torch.Generator(DEVICE).manual_seed(7)
    q, k, v, g, beta = gdn_inputs(num_seqs * q_len, gen)
    pool = torch.randn(num_seqs + 1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, device=DEVICE) * 0.1
    slots = torch.arange(1, num_seqs + 1, device=DEVICE)
    has_initial = torch.ones(num_seqs, dtype=torch.bool, device=DEVICE)
    cu_cpu = torch.arange(num_seqs + 1) * q_len
    cu = cu_cpu.to(DEVICE)
    for name, max_query_len in (("recurrent", q_len), ("fla chunk", None)):
        def call(max_query_len=max_query_len):
            gdn_kernels.gdn_prefill(q, k, v, g, beta, pool, slots, has_initial, cu, cu_seqlens_cpu=cu_cpu,
                                    max_query_len=max_query_len)

        gpu_ms = triton.testing.do_bench(call)
        torch.cuda.synchronize()
        start, calls = time.perf_counter(), 100
        for _ in range(calls):
            call()
        host_ms = (time.perf_counter() - start) / calls * 1e3  # the loop only enqueues: the host's cost
        torch.cuda.synchronize()
        report(capsys, f"gdn_prefill {num_seqs} x {q_len} tokens, {name}: {gpu_ms * 1e3:.1f} us GPU, "
                       f"{host_ms * 1e3:.1f} us host per call")


def test_print_chunked_prefill_keeps_the_gpu_busy(capsys):
    """An 8,192-token prompt's GDN call between two matmuls (the rest of a layer, ~2 ms), as a prefill step
    queues them: with the host offsets the chunk index is built and copied without a sync, and the GPU never
    waits for fla's launches; without them fla reads the offsets back (a sync) and it does, every layer."""
    pytest.importorskip("fla")
    gen = torch.Generator(DEVICE).manual_seed(9)
    q, k, v, g, beta = gdn_inputs(8192, gen)
    pool = torch.zeros(2, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device=DEVICE)
    slots, has_initial = torch.tensor([1], device=DEVICE), torch.tensor([True], device=DEVICE)
    cu_cpu = torch.tensor([0, 8192])
    cu = cu_cpu.to(DEVICE)
    a = torch.randn(8192, 5120, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(5120, 17408, device=DEVICE, dtype=torch.bfloat16)
    for name, offsets in (("host offsets", cu_cpu), ("device offsets only", None)):
        def layer(offsets=offsets):
            a @ w
            gdn_kernels.gdn_prefill(q, k, v, g, beta, pool, slots, has_initial, cu, cu_seqlens_cpu=offsets)

        for _ in range(3):
            layer()
        torch.cuda.synchronize()
        start, layers = time.perf_counter(), 20
        for _ in range(layers):
            layer()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / layers * 1e3
        gpu_ms = triton.testing.do_bench(layer)
        report(capsys, f"matmul + gdn_prefill 1 x 8192, {name}: {wall_ms:.3f} ms wall per layer, "
                       f"{gpu_ms:.3f} ms by do_bench")
