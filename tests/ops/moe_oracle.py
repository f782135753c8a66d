"""Bounds for the MoE ops (ops/moe) derived from their computations (tests/tolerance.py's model), shared by the
CPU tests (the Triton interpreter) and tests/gpu/test_moe_gpu.py.

Routing. Per side, a probability p_j = e_j / S with e_j = exp(x_j - max): the subtraction's rounding becomes a
relative error of |x_j - max| u in exp (twice that for a GPU's exp2), exp and the divide (SOFTMAX_ROUNDINGS), and
the normaliser S a sum of E terms. Renormalised, S divides every p_j alike and cancels: w_j = p_j / sum_i p_i keeps
the roundings of p_j and of the k p_i, the k-term sum and the divide.

Experts, first order, per side, for one output element: g = x Wg^T and u = x Wu^T carry gamma(H) relative to
G = |x| |Wg|^T and U = |x| |Wu|^T; act = silu(g) u passes them on with |d act / d g| <= 1.1 |u| and
|d act / d u| = |silu(g)| <= |g| (2.1 gamma(H) G U) and adds SiLU's own roundings and its rounding to the dtype;
the down product adds gamma(I) of |act| <= G U, the routing weight's product one rounding and the k-term sum
gamma(k). All relative to M = sum_j |w_j| |Wd_j| (G_j U_j): see `experts_magnitude`.
"""

import math

import torch

from deltaserve.ops.moe import reference
from deltaserve.ops.moe.quantized import FP8_BLOCK, Fp8Experts, Int4Experts, Nvfp4Experts
from deltaserve.ops.quant_gemm.reference import (ACT_AMAX_FLOOR, E2M1_VALUES, E4M3_MAX, quantize_activation,
                                                 unpack_int4)
from tests.tolerance import SOFTMAX_ROUNDINGS, gamma, silu_chain, unit_roundoff

# Roundings to bf16 per side beyond the float32 model, relative to M. The reference: its gate/up outputs (two, each
# through the product: counted 3), silu's output and product (2), the down output (1), the output of its float32
# weighted sum (1), and cuBLAS's reduced-precision split-K partial sums (2): 9. The fused kernels: act (1) and the
# output (1).
REFERENCE_BF16_ROUNDINGS, FUSED_BF16_ROUNDINGS = 9, 2
U32 = 2.0**-24  # float32's unit roundoff


def route_bound(logits: torch.Tensor, weights: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Elementwise bound [T, k] of the routing weights of two computations (kernel vs torch)."""
    spread = math.ceil(2 * (logits.double().max(-1, keepdim=True).values - logits.double()).max().item())
    per_probability = SOFTMAX_ROUNDINGS + spread
    roundings = 2 * per_probability + top_k + 1 if renormalize else per_probability + logits.shape[1]
    one_side = gamma(roundings, torch.float32) * weights.double().abs()
    return 2 * one_side


def experts_magnitude(x, topk_ids, topk_weights, gate_up, down):
    """M [T, H] = sum_j |w_j| |Wd_j| (G_j U_j) in float64 (module docstring), and max |g| over the pairs."""
    T, H = x.shape
    inter = gate_up.shape[1] // 2
    x, ids, w = x.double().abs(), topk_ids.long(), topk_weights.double().abs()
    magnitude = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    gate_max = 0.0
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        wgu = gate_up[expert].double()
        gu = x[tokens] @ wgu.abs().T  # [n, 2I]: G | U
        gate_max = max(gate_max, (x[tokens] @ wgu[:inter].T).abs().max().item())  # |g| itself, for SiLU's exp
        act = gu[:, :inter] * gu[:, inter:]  # [n, I]
        magnitude.index_add_(0, tokens, w[tokens, slots, None] * (act @ down[expert].double().abs().T))
    return magnitude, gate_max


def experts_bound(x, topk_ids, topk_weights, gate_up, down, fused_bf16: bool = False,
                  reference_bf16: bool = False) -> torch.Tensor:
    """Elementwise bound [T, H] of fused vs grouped-matmul experts on the same routing, accumulated in float32;
    `*_bf16`: that side rounds its intermediates to bf16 as well."""
    H, inter, top_k = x.shape[1], gate_up.shape[1] // 2, topk_ids.shape[1]
    magnitude, gate_max = experts_magnitude(x, topk_ids, topk_weights, gate_up, down)
    silu_roundings = silu_chain(torch.tensor([gate_max])) + 1
    one_side = 2.1 * gamma(H, torch.float32) + gamma(silu_roundings + inter + top_k + 1, torch.float32)
    relative = 2 * one_side
    if fused_bf16:
        relative += gamma(FUSED_BF16_ROUNDINGS, torch.bfloat16)
    if reference_bf16:
        relative += gamma(REFERENCE_BF16_ROUNDINGS, torch.bfloat16)
    return relative * magnitude


def shared_bound(shared: torch.Tensor, shared_gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound [T, H] of two computations of + sigmoid(gate) * shared on the same operands: the sigmoid (as SiLU's
    chain), its product and the sum, per side, relative to |sigmoid(gate) shared|, in `dtype` (bf16: the
    reference rounds sigmoid, product and sum; fused, once at the end, counted with the experts)."""
    term = (torch.sigmoid(shared_gate.double()) * shared.double()).abs()
    roundings = silu_chain(shared_gate) + 2
    one_side = gamma(roundings, torch.float32) + (3 * unit_roundoff(torch.bfloat16) if dtype == torch.bfloat16 else 0)
    return 2 * one_side * term


def combine_exact(y, pair_rows, topk_weights, shared=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact [T, H] float64, bound [T, H]) of reference.combine's semantics on these operands: the k weighted pair
    rows (and the gated shared expert) summed exactly, and one computation's distance from it: the k (+ 1) float32
    products and sum (gamma(k + 2) of the terms' magnitude), the sigmoid's chain (`shared_bound`), and the one
    rounding to y's dtype."""
    T, k = topk_weights.shape
    rows = y.double()[pair_rows.long().view(T, k)]  # [T, k, H]
    terms = topk_weights.double()[:, :, None] * rows
    exact, magnitude = terms.sum(1), terms.abs().sum(1)
    bound = gamma(k + 2, torch.float32) * magnitude
    if shared is not None:
        out, gate = shared
        gated = torch.sigmoid(gate.double()) * out.double()
        exact = exact + gated
        bound = bound + gamma(k + 2, torch.float32) * gated.abs() + shared_bound(out, gate, torch.float32) / 2
    return exact, bound + unit_roundoff(y.dtype) * exact.abs()


def with_shared_slot(topk_ids, topk_weights, gate_up, down, shared_gate_up, shared_down, shared_gate):
    """The routed experts and the shared expert as one computation of k + 1 experts (the fused kernels' shared
    slot): ids [T, k + 1] (the shared expert as expert E), weights [T, k + 1] (its weight sigmoid(gate)), gate_up
    [E + 1, 2I, H], down [E + 1, H, I], for `experts_bound` and `experts_magnitude`."""
    T, E = topk_ids.shape[0], gate_up.shape[0]
    ids = torch.cat([topk_ids.long(), torch.full((T, 1), E, dtype=torch.long, device=topk_ids.device)], 1)
    weights = torch.cat([topk_weights.double(), torch.sigmoid(shared_gate.double())], 1)
    return ids, weights, torch.cat([gate_up, shared_gate_up[None]]), torch.cat([down, shared_down[None]])


def sparse_block_bound(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down, shared_gate,
                       fused_bf16: bool = False, reference_bf16: bool = False) -> torch.Tensor:
    """Bound [T, H] of the fused sparse block (ops/moe/cuda.fused_moe) against reference.sparse_block on the same
    operands (the same experts chosen): the k + 1 experts' bound (`with_shared_slot`: each side's products, SiLU,
    the (k + 1)-term sum); the routing weights' difference (route_bound, relative) carried through the routed
    experts' magnitude; the gate's sigmoid and its product on each side (`shared_bound`), relative to
    |sigmoid(gate)| times the shared expert's magnitude; in bf16 the reference's final sum."""
    ids, weights = reference.route(logits, top_k, renormalize)
    slot_ids, slot_weights, slot_gate_up, slot_down = with_shared_slot(ids, weights, gate_up, down, shared_gate_up,
                                                                       shared_down, shared_gate)
    bound = experts_bound(x, slot_ids, slot_weights, slot_gate_up, slot_down, fused_bf16, reference_bf16)
    routed_magnitude, _ = experts_magnitude(x, ids, weights, gate_up, down)
    relative_w = (route_bound(logits, weights, top_k, renormalize) / weights.double()).max().item()
    ones = torch.ones_like(shared_gate, dtype=torch.float64)
    shared_magnitude, _ = experts_magnitude(x, ids[:, :1] * 0, ones, shared_gate_up[None], shared_down[None])
    bound = bound + relative_w * routed_magnitude
    if reference_bf16:  # its bf16 sum of the routed experts and the gated shared expert, relative to the whole
        bound = bound + unit_roundoff(torch.bfloat16) * experts_magnitude(x, slot_ids, slot_weights, slot_gate_up,
                                                                          slot_down)[0]
    dtype = torch.bfloat16 if reference_bf16 else torch.float32
    return bound + shared_bound(shared_magnitude, shared_gate, dtype)


# ------------------------------------------------------------------------------------------ quantized experts
# The fused kernels' semantics for stacked quantized experts (ops/moe/quantized.py), in float64, and the bound of
# a float32 implementation. Per pair, stage 1: g, u = xr W^T with xr the activation as the format takes it (FP8:
# quantized per 128 columns, exactly as both sides do; int4: x itself) and W dequantized exactly. The kernels sum
# per K block and scale in float32: each block's dot of BK terms at u_dot (the CPU's float32; a GPU's tensor cores,
# tests/gpu), then its scaling and sum in float32, (BK + 3) u_dot + (blocks + groups + 3) u32 a term, of the terms'
# magnitude: |xr| |W| for FP8;
# for int4's exact codes, (OFFSET + q) x and (OFFSET + z) sum(x) are summed apart, (2 OFFSET + q + z) s |x| a term.
# NVFP4 dequantizes its tile in float32 (two roundings: scale x scale_2, then x e2m1) and rounds it to the activations'
# dtype, then sums the whole K in one float32 accumulator: (K + 5) u + u16 of |x| |W|.
# act = silu(g) u carries that on (module docstring) plus SiLU's and (16-bit x) its own rounding. Stage 2 takes act
# as rounded: int4 passes its error on through |Wd|; FP8 requantizes it per 128 columns, and where the interval of
# act's possible values straddles an e4m3 rounding boundary the code may differ by the gap (`_requantized_spread`).


def _dequantized(stack, e):
    """[N, K] float64: int4's (q - z) s (exact in float32), fp8's e4m3 * float32 scale (one float32 rounding, within
    the bound's float32 terms), NVFP4's e2m1 * e4m3 * scale_2 computed here in float64 (exact)."""
    w = stack.expert(e)
    if isinstance(stack, Nvfp4Experts):
        codes = torch.stack([w.packed & 0xF, w.packed >> 4], dim=2).reshape(w.shape[0], -1).long()  # [N, K]
        values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes]
        return values * w.scale.double().repeat_interleave(16, dim=1) * w.scale_2.double()[:, None]
    return w.dequantize(torch.float32).double()


def _term_magnitude(stack, e, offset: float):
    """[N, K] float64: what one weight contributes to a float32 sum's magnitude in the kernels."""
    w = stack.expert(e)
    if isinstance(stack, Int4Experts):
        q = unpack_int4(w.packed, w.shape[1]).double()
        z = 8.0 if w.zero is None else w.zero.double().repeat_interleave(w.group_size, dim=1)
        return (2 * offset + q + z) * w.scale.double().repeat_interleave(w.group_size, dim=1)
    return _dequantized(stack, e).abs()


def _fp8_rows(a: torch.Tensor):
    """a [R, K] float64 -> (value [R, K] = q s as quantize_activation computes it, s [R, G])."""
    q, s = quantize_activation(a.float(), 128)
    return q.double() * s.double().repeat_interleave(128, dim=1)[:, : a.shape[1]], s.double()


def _requantized_spread(a: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """[R, K]: how far the per-128-column e4m3 requantization of any a' with |a' - a| <= delta can land from that
    of a: the codes at the ends of the quotient's interval (the group's scale moving with its amax, both divisions
    rounded in float32), each times either end of the scale's interval."""
    R, K = a.shape
    G = -(-K // 128)
    pad = G * 128 - K
    mag = torch.nn.functional.pad(a.abs(), (0, pad)).view(R, G, 128)
    dg = torch.nn.functional.pad(delta, (0, pad)).view(R, G, 128)
    amax = mag.amax(dim=2, keepdim=True)
    slack = 1 + 2.0**-22  # two float32 roundings (the scale's division and the quotient's), and the cast's
    s = amax.clamp(min=ACT_AMAX_FLOOR) / E4M3_MAX
    s_lo = (amax - dg.amax(dim=2, keepdim=True)).clamp(min=ACT_AMAX_FLOOR) / E4M3_MAX / slack
    s_hi = (amax + dg.amax(dim=2, keepdim=True)).clamp(min=ACT_AMAX_FLOOR) / E4M3_MAX * slack

    def code(r):
        return r.clamp(0, E4M3_MAX).float().to(torch.float8_e4m3fn).double()

    v = code(mag / s) * s
    lo = code((mag - dg).clamp(min=0) / s_hi / slack) * s_lo
    hi = code((mag + dg) / s_lo * slack) * s_hi
    spread = torch.maximum((v - lo).abs(), (hi - v).abs())
    return spread.view(R, G * 128)[:, :K]


def quantized_experts_exact(x, topk_ids, topk_weights, gate_up, down, dtype, u_dot: float = U32):
    """(y64 [T, H], bound [T, H]) of the fused kernels on stacked quantized experts (the section above), x in dtype
    (float32: int4 codes by conversion; bf16: OFFSET 128), each K block's dot product accumulated at u_dot."""
    fp8, nvfp4 = isinstance(gate_up, Fp8Experts), isinstance(gate_up, Nvfp4Experts)
    offset = 128.0 if (dtype == torch.bfloat16 and isinstance(gate_up, Int4Experts)) else 0.0
    u = max(u_dot, U32)
    u16 = unit_roundoff(dtype) if dtype != torch.float32 else 0.0
    T, H = x.shape
    inter = gate_up.shape[1] // 2
    kb_gate_up, kb_down = (getattr(stack, "group_size", FP8_BLOCK[1]) for stack in (gate_up, down))  # K per dot

    def chain(K: int, kb: int) -> float:
        """The float32 sum of one output over K, relative to its terms' magnitude."""
        if nvfp4:
            return (K + 5) * u + u16
        return (kb + 3) * u + (-(-K // kb) + K // 16 + 3) * U32  # groups >= 16 columns
    y = torch.zeros(T, H, dtype=torch.float64)
    bound = torch.zeros(T, H, dtype=torch.float64)
    terms = torch.zeros(T, H, dtype=torch.float64)  # sum_j |w_j| |Wd_j| |act_j|: the k-term sum's magnitude
    xr = _fp8_rows(x.double())[0] if fp8 else x.double()
    per_expert = {}  # e -> its dequantized weights and terms' magnitudes, each built once

    def expert(e: int):
        if e not in per_expert:
            per_expert[e] = (_dequantized(gate_up, e), _term_magnitude(gate_up, e, offset), _dequantized(down, e),
                             _term_magnitude(down, e, offset))
        return per_expert[e]

    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e, w = int(topk_ids[t, j]), float(topk_weights[t, j])
            W, Wm, D, Dm = expert(e)
            h, hm = W @ xr[t], Wm @ xr[t].abs()  # [2I]
            c1 = chain(H, kb_gate_up)
            g, up, eg, eu = h[:inter], h[inter:], c1 * hm[:inter], c1 * hm[inter:]
            act = g / (1 + torch.exp(-g)) * up
            silu_roundings = silu_chain(torch.tensor([g.abs().max().item()])) + 1
            d_act = 1.1 * up.abs() * eg + g.abs() * eu + (gamma(silu_roundings, torch.float32) + u16) * act.abs()
            if fp8:
                a_in, _ = _fp8_rows(act[None])
                a_in, spread = a_in[0], _requantized_spread(act[None], d_act[None])[0]
            else:
                a_in, spread = act, d_act
            y[t] += w * (D @ a_in)
            terms[t] += abs(w) * (D.abs() @ (a_in.abs() + spread))
            c2 = chain(inter, kb_down)
            bound[t] += abs(w) * (c2 * (Dm @ (a_in.abs() + spread)) + D.abs() @ spread)
    k = topk_ids.shape[1]
    bound = bound * (1 + gamma(k + 2, torch.float32)) + gamma(k + 2, torch.float32) * terms + u16 * y.abs()
    return y, bound + torch.finfo(dtype).tiny
