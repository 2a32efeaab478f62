"""The bytes a replacement receives when it rejoins under ``[train].fault_tolerance = "replica"``, counted
where the trainer sends them: one rank of a fake world builds its real trainer on fake tensors and sends
its owned pieces (training/replica_transfer.py) to the rank at its model-parallel coordinate in the next
replica, through the counted layer (``par_groups.comm``) and torch's fake process group."""

from __future__ import annotations

import dataclasses
import warnings


def joiner_bytes_sent(cfg, world: int, rank: int) -> int:
    """The bytes global rank ``rank`` of ``world`` sends a joiner of the next replica (its owned pieces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_groups import comm, fake_world
    from par_moe import DeclaredRouting

    from ..data import load_dataset
    from ..training.replica_transfer import send_owned
    from ..training.train_loop import ShapesOnly, Trainer
    from .report import simulated_config
    from .run import check_rank

    cfg = simulated_config(cfg, cfg.validate_world(world), False)[0]  # as --simulate runs it
    check_rank(rank, world)
    dataset = load_dataset(dataclasses.replace(cfg.data, path="", blend=[]), cfg.model.vocab_size)  # shapes only
    with warnings.catch_warnings(), fake_world(rank, world):
        warnings.simplefilter("ignore", UserWarning)  # fake tensors warn about what they cannot know
        with FakeTensorMode(allow_non_fake_inputs=True):
            trainer = Trainer(cfg, dataset=dataset, shapes_only=ShapesOnly(DeclaredRouting(1.0)))
            group = next(g for g in trainer.groups.grid.ranks("dp") if rank in g)  # its coordinate in each replica
            joiner = group[(group.index(rank) + 1) % len(group)]
            with comm.CommRecorder() as rec:
                send_owned(trainer.model, joiner)
    return sum(r.bytes for r in rec.records if r.op == "send")
