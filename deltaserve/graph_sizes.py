"""Which CUDA graphs the engine captures: the decode batch sizes and the single-chunk token counts.

Below both cache/ (the memory plan counts and sizes the graphs) and worker/ (cuda_graph.py captures them), so
that neither reaches into the other for the policy. No torch.
"""

from __future__ import annotations

import os


def graph_capture_sizes(max_num_seqs: int, performance_mode: str = "balanced") -> list[int]:
    """The decode batch sizes that get a CUDA graph (worker/cuda_graph.py): 1, 2, 4, 8, then every 8; with
    --performance-mode interactivity every size up to 32 first (a batch of 5 then runs as 5, not padded to 8:
    no dummy rows reading and writing the dummy state slot)."""
    small = range(1, 33) if performance_mode == "interactivity" else (1, 2, 4, 8)
    sizes = {s for s in small if s < max_num_seqs} | set(range(max(small) + 8, max_num_seqs, 8))
    return sorted(sizes | {max_num_seqs})


# Single-chunk CUDA graphs (worker/cuda_graph.py), on unless DELTASERVE_CHUNK_GRAPHS=0: a step of one sequence
# computing 2 to 1,024 new tokens, padded to the next of these sizes. Run eagerly such a step is bound by the host
# launching its kernels one by one (fla's chunked GDN call alone takes more host time than its GPU work at these
# sizes): docs/performance.md, 'Single-chunk graphs'. Up to 128 rows the GDN layers run the recurrent kernel over
# the chunk and its padding, and a checkpoint inside the step keeps the step eager; from PADDED_CHUNK_MIN_ROWS they
# run fla over all rows with the padding masked (layers/batch.PaddedChunk), which also takes such a checkpoint.
# Up to 1,024: a longer step is nearly GPU-bound eagerly, and a 2,048-row graph would hold ~0.4 GiB of 27B
# intermediates in the graph pool (a fourth sequence slot at 262K on a 32 GB card).
CHUNK_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
PADDED_CHUNK_MIN_ROWS = 256
# A padded graph attends with the paged kernel (about half cuDNN's rate), where an eager step of a long chunk after
# a long prefix would take cuDNN: the graph serves a step only while its rows x (cached + rows) query-key pairs stay
# under this (27B: there the paged attention's extra time stays below the host time the graph saves).
PADDED_GRAPH_MAX_PAIRS = 1 << 24


def chunk_graph_sizes() -> list[int]:
    """The token counts that get a single-chunk graph: CHUNK_GRAPH_TOKENS, or none with DELTASERVE_CHUNK_GRAPHS=0."""
    value = os.environ.get("DELTASERVE_CHUNK_GRAPHS", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"DELTASERVE_CHUNK_GRAPHS must be 0 or 1, got {value!r}")
    return [] if value == "0" else list(CHUNK_GRAPH_TOKENS)


def cuda_graph_count(max_num_seqs: int, performance_mode: str = "balanced") -> int:
    return len(graph_capture_sizes(max_num_seqs, performance_mode)) + len(chunk_graph_sizes())
