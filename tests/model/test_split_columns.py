"""layers/linear.split_columns: the column blocks of a SplitWeight's product (ops.linear.matmul_blocks) split as
the joined product would be, without a copy where a piece lies inside one block."""

import pytest
import torch

from deltaserve.layers.linear import split_columns


def test_pieces_are_views_of_their_block_and_equal_the_joined_split():
    gen = torch.Generator().manual_seed(0)
    blocks = (torch.randn(5, 7, generator=gen), torch.randn(5, 3, generator=gen))
    joined = torch.cat(blocks, dim=-1)
    for sizes in ([4, 3, 2, 1], [7, 3], [5, 4, 1], [10]):
        pieces = split_columns(blocks, sizes)
        assert [p.shape for p in pieces] == [torch.Size([5, s]) for s in sizes]
        for piece, expected in zip(pieces, joined.split(sizes, dim=-1)):
            assert torch.equal(piece, expected)
    inside = split_columns(blocks, [4, 3, 2, 1])
    assert inside[1].data_ptr() == blocks[0][:, 4:].data_ptr() and inside[2]._base is blocks[1]
    spanning = split_columns(blocks, [5, 4, 1])[1]  # columns 5..8 lie in both blocks: joined by a copy
    assert spanning._base is None


def test_sizes_that_do_not_cover_the_blocks_are_refused():
    blocks = (torch.zeros(2, 4), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"pieces of \[4, 1\] columns"):
        split_columns(blocks, [4, 1])
