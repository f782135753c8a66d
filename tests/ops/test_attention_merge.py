"""The log-sum-exp merge that joins attention computed over separate parts of the keys (GPU long-chunk path)."""

import torch

from deltaserve.ops.attention.cuda import _merge_parts


def part(q, k, v):
    """softmax(q k^T) v over these keys alone, and its natural log-sum-exp: [L, H, D], [L, H]."""
    scores = torch.einsum("lhd,shd->lhs", q, k)
    return torch.einsum("lhs,shd->lhd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_merging_parts_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    k = 2 * torch.randn(23, 3, 8, generator=gen, dtype=torch.float64)  # peaky scores
    v = torch.randn(23, 3, 8, generator=gen, dtype=torch.float64)
    expected, _ = part(q, k, v)
    acc = lse = None
    for start, end in ((0, 9), (9, 10), (10, 23)):  # uneven parts, one of a single key
        acc, lse = _merge_parts(acc, lse, *part(q, k[start:end], v[start:end]))
    torch.testing.assert_close(acc.double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), part(q, k, v)[1], atol=1e-6, rtol=1e-6)
