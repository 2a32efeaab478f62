"""A stage frees each activation it sends (Megatron's ``deallocate_output_tensor``).

The receiving stage holds its own copy and the backward only feeds a gradient into the output, so
keeping its values would cost one activation per micro-batch in flight. One rank of a pp=2 world
on torch's fake process group (no peer needed): every sent output ends with no storage, while the
last stage's loss and a locally handed-over activation (the bottom of a V) keep theirs.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from par_pp import PipelineExecutor, build_schedule, chunks_on_rank


@pytest.mark.parametrize("name, rank", [("1f1b", 0), ("zb-h1", 0), ("zb-v", 0), ("zb-v", 1)])
def test_sent_outputs_are_freed_and_local_ones_kept(name, rank):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        schedule = build_schedule(name, 2, 4)
        chunks = {c: nn.Linear(8, 8) for c in chunks_on_rank(schedule, rank)}
        outputs = []

        def forward(c, module, x, m):
            y = module(x)
            outputs.append((c, y))
            return y

        executor = PipelineExecutor(schedule, chunks, dist.group.WORLD, loss_fn=lambda y, t: (y - t).square().mean(),
                                    forward_fn=forward, message_shape=((3, 8), torch.float32))
        data = [torch.randn(3, 8) for _ in range(4)]
        executor.step(data if 0 in chunks else None, data if schedule.last_chunk in chunks else None)
        kinds = set()
        for c, y in outputs:
            sent = c != schedule.last_chunk and schedule.output_message(_forward(schedule, rank, c)) is not None
            kinds.add("sent" if sent else "local" if c != schedule.last_chunk else "last")
            assert (y.numel() == 0) == sent, (name, c)
        assert "sent" in kinds and (rank == 0 or "local" in kinds)
        assert all(p.grad is not None for m in chunks.values() for p in m.parameters())
    finally:
        dist.destroy_process_group()


def _forward(schedule, rank, chunk):
    """The rank's first F action of ``chunk`` (every micro-batch's output goes the same way)."""
    return next(a for a in schedule.ranks[rank] if a.kind == "F" and a.chunk == chunk)
