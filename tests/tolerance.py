"""Float tolerances derived from the computation under test, instead of constants that happened to pass.

The model is the classical forward-error bound of floating-point summation (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., section 3.1): a sum of n terms computed in ANY order (sequential, blocked,
pairwise, several vector lanes, with or without FMA) satisfies

    |fl(sum) - sum| <= gamma(n) * sum |terms|,      gamma(n) = n*u / (1 - n*u),  u = the unit roundoff,

and a dot product of length K, one rounding per product on top, has gamma(K) * sum_k |a_k| |b_k| (for a GEMM,
gamma(K) * (|A| @ |B|) elementwise, which the tests compute from their own operands). Because the
bound holds for every summation order, it holds for whatever blocking an instruction set (AVX2, AVX-512, AMX)
or library picks: a tolerance built from it does not pass on one CPU and fail on the next. It is a worst case
(the constant c of "c * K * u * M" is 1, no probabilistic sqrt(K) discount), so it leaves a margin over the
typical error while staying far below what a real bug (a wrong scale, a dropped term) makes; in float32 also
below a 1% change of the result (in bf16 one ulp is 0.8% already).

Helpers, from one op to a whole model:
    unit_roundoff, gamma                   the constants
    both_sides(*bounds)                    two rounded computations of one exact value (engine vs plain path)
    recurrence_bound(steps, chain, M)      a non-expansive recurrence (the GDN state): steps add up
    silu_chain(x)                          the roundings of SiLU over x
    attention_bound(q, k, v, scale, S)     softmax attention, from the operands' magnitudes
    stack_bound(K_layer, depth, M)         a residual stack: error grows linearly with depth
    assert_within(actual, expected, bound) the check, with the worst element named when it fails
"""

import math

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
                 torch.float8_e4m3fn: 2.0**-4}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number of dtype: the relative error of one rounding."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff known for dtype {dtype}")
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n chained roundings (n u < 1 required)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) undefined in {dtype}: n * u = {nu:.3g} >= 1")
    return nu / (1 - nu)


def both_sides(*bounds):
    """Two (or more) rounded computations of one exact value differ by at most the sum of their bounds."""
    return sum(bounds)


def recurrence_bound(steps: int, reduction: int, magnitude: float, dtype: torch.dtype) -> float:
    """Bound on a state carried over `steps` steps of a non-expansive update, each step one chain of
    `reduction` roundings on values of size <= magnitude.

    For the gated delta rule S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with unit keys,
    beta in [0, 1] and g <= 0, the transition's spectral norm is <= 1: an error made at step t is not amplified
    later, so the errors of the steps add up. Token by token: T steps of a K-term reduction (K the key dim).
    Chunked over C tokens: the same products reassociated, one step per chunk (ceil(T / C) steps), each a chain
    of K + 2C roundings (the C-term triangular solve inside the chunk, then the C-term state update).
    """
    return steps * gamma(reduction, dtype) * magnitude


SILU_ROUNDINGS = 8  # x / (1 + exp(-x)): exp within ~4 ulp, the add, the divide, and a product after it


def silu_chain(x: torch.Tensor) -> int:
    """Roundings, relative to its result, of SiLU over x: SILU_ROUNDINGS, plus the exp argument's own rounding,
    which exp turns into a relative error of |x| u (a GPU's exp2(x log2 e) twice that): 2 max |x| more."""
    return SILU_ROUNDINGS + math.ceil(2 * x.double().abs().max().item())


SOFTMAX_ROUNDINGS = 6  # per probability: the max subtraction, exp (within ~4 ulp), the divide


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kv_len: int,
                    dtype: torch.dtype, operands: torch.dtype | None = None,
                    probabilities: torch.dtype | None = None, scores: torch.dtype | None = None) -> float:
    """Bound on |fl(softmax(scale q k^T) v) - exact| accumulated in dtype over at most kv_len keys, for q, k and
    v of any leading shape ([..., head_dim]; the magnitudes are taken over all of them). `operands`: a coarser
    dtype that q, K and V are rounded to first (the caller's tensors being finer); `probabilities`: a coarser
    dtype the probabilities are rounded to before the weighted sum (float16 tensor-core dots); `scores`: a
    coarser dtype the scores are stored in (a bf16 matmul), one rounding of each.

    A score is a head_dim dot product: error e <= gamma(hd) * scale * max sum_d |q_d| |k_d| (plus one
    rounding of q and of k to `operands`). Softmax turns score errors of at most e into probability errors of
    at most 2e in l1, and adds its own roundings (the normaliser sums kv_len terms; one more to
    `probabilities`); the weighted sum of values is a kv_len reduction of terms p_s |v_s|, with sum p_s = 1
    (plus V's rounding to `operands`). All times max |v|.
    """
    operand = unit_roundoff(operands) if operands is not None else 0.0
    probability = unit_roundoff(probabilities) if probabilities is not None else 0.0
    head_dim = q.shape[-1]  # the largest sum_d |q_d| |k_d| over every (query row, key row) pair (test sizes):
    pairs = q.double().abs().reshape(-1, head_dim) @ k.double().abs().reshape(-1, head_dim).T
    score_magnitude = scale * pairs.max().item()
    score_rounding = unit_roundoff(scores) if scores is not None else 0.0
    score = (gamma(head_dim, dtype) + 2 * operand + score_rounding) * score_magnitude
    weights = 2 * score + gamma(kv_len + SOFTMAX_ROUNDINGS, dtype) + probability
    return v.double().abs().max().item() * (weights + gamma(kv_len, dtype) + operand)


def stack_bound(reduction_per_layer: int, depth: int, magnitude: float, dtype: torch.dtype) -> float:
    """First-order bound on the output of a pre-norm residual stack, x_{l+1} = x_l + f_l(norm(x_l)).

    Each layer adds its own rounding, gamma(reduction_per_layer) relative to the stream's magnitude, where
    reduction_per_layer is the longest chain of dependent roundings a value goes through in one layer (the
    in-projection's hidden size, the mixer's reductions over head dims and tokens, the out-projection's width,
    the MLP's two). An error already in the stream passes the residual unchanged and reaches f_l through a
    norm, which keeps it the same relative error; taking each f_l as well conditioned (relative condition
    number <= 1), the layers' errors add: depth * gamma(reduction_per_layer) * magnitude.
    """
    return depth * gamma(reduction_per_layer, dtype) * magnitude


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound, what: str = "") -> None:
    """|actual - expected| <= bound elementwise (bound a tensor broadcasting against them, or a number).
    Exact NaN/inf positions must agree; the message names the worst element against its bound. Compared on the
    CPU, so GPU results, CPU references and bounds of either kind mix."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), f"{what}: non-finite values differ"
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(expected)
    err = torch.where(finite, (actual - expected).abs(), 0.0)
    ratio = err / bound.clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(ratio.argmax())
    assert ratio.flatten()[worst] <= 1, (
        f"{what}: |diff| {err.flatten()[worst].item():.3g} > derived bound {bound.flatten()[worst].item():.3g} "
        f"at flat index {worst} ({int((ratio > 1).sum())} of {ratio.numel()} elements over)")
