"""The vocabulary-parallel token embedding: under tensor parallelism each rank holds the rows [start, start + n)
of the vocabulary; an id outside them looks up zeros, and the all-reduce sums the one rank's row that holds it."""

import torch
from torch import nn

from deltaserve.worker.distributed import ParallelContext


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocab_size / tp_size rows of the embedding (parameter `weight`, as nn.Embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext):
        start, rows = parallel.shard(vocab_size, "vocab_size")
        super().__init__(rows, hidden_size)
        self.start, self.parallel = start, parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] (global ids) -> [T, H], the same on every rank."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)  # [T]
        h = super().forward(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)  # [T, H]
        return self.parallel.all_reduce(h)
