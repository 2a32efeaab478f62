import pytest
import torch

from par_cp import merge_segments, position_ids, shard_segments, shard_sequence, unshard_sequence


def test_zigzag_rank_keeps_chunks_r_and_mirror():
    x = torch.arange(16)
    # cp=4: 8 chunks of 2; rank 1 keeps chunks 1 and 6
    assert shard_sequence(x, 1, 4, layout="zigzag").tolist() == [2, 3, 12, 13]
    assert shard_sequence(x, 0, 4, layout="zigzag").tolist() == [0, 1, 14, 15]
    assert shard_sequence(x, 3, 4, layout="contiguous").tolist() == [12, 13, 14, 15]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_unshard_inverts_shard(layout, cp):
    x = torch.randn(3, 32, 5)
    shards = [shard_sequence(x, r, cp, dim=1, layout=layout) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, dim=1, layout=layout), x)
    assert sorted(torch.cat([position_ids(32, r, cp, layout) for r in range(cp)]).tolist()) == list(range(32))


def test_position_ids_follow_tokens_and_restart_per_document():
    tokens = torch.arange(16)
    for r in range(4):
        assert torch.equal(position_ids(16, r, 4, "zigzag"), shard_sequence(tokens, r, 4, layout="zigzag"))
    # documents [0, 5) [5, 16): rank 1 holds tokens 2, 3, 12, 13
    assert position_ids(16, 1, 4, "zigzag", cu_seqlens=[0, 5, 16]).tolist() == [2, 3, 7, 8]


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="seq_len=12 must be divisible by 8"):
        shard_segments(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout='striped'"):
        shard_segments(16, 0, 4, "striped")
    assert merge_segments([(4, 6), (0, 2), (2, 4), (8, 9)]) == ((0, 6), (8, 9))
