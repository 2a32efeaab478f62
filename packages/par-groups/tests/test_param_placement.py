"""A placement turns a flat range of a local block into boxes of the full tensor."""

from math import prod

import torch
from torch import nn

from par_groups import declare_, placement_of
from par_groups.param_placement import flat_range_boxes


def test_flat_range_boxes_tile_every_range_in_order():
    for shape in [(5,), (3, 4), (2, 3, 4), (1, 1, 3), (4, 1, 2)]:
        n = prod(shape)
        idx = torch.arange(n).view(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                boxes = flat_range_boxes(shape, lo, hi)
                got = [v for off, size in boxes for v in idx[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1).tolist()]
                assert got == list(range(lo, hi)), (shape, lo, hi)
                assert len(boxes) <= 2 * len(shape) - 1


def test_declared_split_gives_global_offsets_of_the_block():
    w = declare_(nn.Parameter(torch.zeros(2, 3, 4)), {0: (1, 4), 2: (2, 3)}, expert=True)
    pl = placement_of(w)
    assert pl.full_shape == (8, 3, 12) and pl.offsets == (2, 0, 8) and pl.expert and pl.counted()
    assert pl.boxes(4, 16) == [((2, 1, 8), (1, 2, 4)), ((3, 0, 8), (1, 1, 4))]
    plain = placement_of(torch.zeros(3))
    assert plain.full_shape == (3,) and plain.offsets == (0,) and not plain.expert
