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


def test_placed_rows_map_every_range_to_the_full_rows_in_order():
    """A block whose dim-0 rows are other rows of the full tensor (re-placed experts): every flat range's
    boxes, read from the full tensor, are the local elements in order; consecutive rows stay one box."""
    full = torch.arange(8 * 2 * 3).view(8, 2, 3)
    rows = (6, 7, 1, 4)  # local rows 0..3 of block 1 (rows 4..7 before re-placement) hold these full rows
    t = declare_(nn.Parameter(torch.empty(4, 2, 3)), {0: (1, 2)})
    assert placement_of(t).boxes() == [((4, 0, 0), (4, 2, 3))]
    local = full[list(rows)]
    from par_groups import place_rows_

    place_rows_(t, rows)
    pl = placement_of(t)
    assert pl.boxes() == [((6, 0, 0), (2, 2, 3)), ((1, 0, 0), (1, 2, 3)), ((4, 0, 0), (1, 2, 3))]
    n = local.numel()
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            got = [v for off, size in pl.boxes(lo, hi) for v in full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1).tolist()]
            assert got == local.reshape(-1)[lo:hi].tolist(), (lo, hi)
