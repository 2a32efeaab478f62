"""Init from placements: chunks are built on the meta device and each rank draws only its pieces.

The initial weights are tiles, each from its own (seed, name, tile) generator, so a piece cut at any
offset equals that block of the full tensor (every layout starts from the same model: the layout
tests check the training), and a rank building its shard of a large model never allocates more
than that shard. The second test builds real configs at world 64 on fake tensors and counts every
allocation; drawing full tensors and slicing them (the previous init) allocates 2x (Llama's vocab
split over tp 2) and 64x (DeepSeek-V3's experts over ep 64) the largest shard, and fails it.
"""

import dataclasses
import itertools

import pytest
import torch.distributed as dist

from pretrain.config import load_config
from pretrain.model import initial_state
from pretrain.model.initial_state import init_full_state


def _cuts(n: int) -> list[tuple[int, int]]:
    """Uneven (offset, size) blocks covering 0..n, none aligned to the 4-element tiles."""
    bounds = sorted({0, n, n // 3, (2 * n) // 3 + 1} - {n + 1})
    return [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def test_pieces_at_any_offset_are_blocks_of_the_full_tensor(monkeypatch):
    monkeypatch.setattr(initial_state, "TILE", 4)  # the tiny model's tensors then span many tiles
    model = load_config("tiny-moe", []).model
    state = init_full_state(model, seed=3)
    layer = next(i for i in range(model.layers) if model.is_moe_layer(i))  # 2-D and the experts' 3-D
    drawn = [n for n in state if (n.startswith(f"model.layers.{layer}.") or "embed" in n)
             and not n.endswith(("norm.weight", "expert_bias"))]
    assert {len(state.shapes[n]) for n in drawn} == {2, 3}
    for name in drawn:
        full = state[name]
        for box in itertools.product(*(_cuts(n) for n in full.shape)):
            offsets, shape = zip(*box)
            piece = state.piece(name, offsets, shape)
            assert piece.equal(full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]), (name, box)
    # tiles are independent draws (not one stream restarted), and another seed is another model
    w = state[f"model.layers.{layer}.self_attn.q_proj.weight"]
    assert not w[:4, :4].equal(w[:4, 4:8]) and not w[:4, :4].equal(w[4:8, :4])
    assert not init_full_state(model, seed=4)[f"model.layers.{layer}.self_attn.q_proj.weight"].equal(w)


def _build_allocations(name: str, overrides: list[str], world: int, rank: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.data import load_dataset
    from pretrain.simulate.memory import MemoryTracker
    from pretrain.simulate.report import simulated_config
    from pretrain.training.train_loop import ShapesOnly, Trainer

    cfg = load_config(name, overrides)
    cfg, _, _ = simulated_config(cfg, cfg.validate_world(world), all_microbatches=False)
    dataset = load_dataset(dataclasses.replace(cfg.data, path=""), cfg.model.vocab_size)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        tracker = MemoryTracker()
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            trainer = Trainer(cfg, dataset=dataset, shapes_only=ShapesOnly())
            held = tracker.total
            shard = max(p.numel() * 4 for p in trainer.model.module.parameters())  # in fp32, as drawn
            kept = max(t.untyped_storage().nbytes() for ts in trainer.model.dp.state_tensors().values() for t in ts)
        return {"largest": tracker.largest["other"], "transient": tracker.peak - held, "shard": shard, "kept": kept}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, overrides, rank", [
    ("llama3-8b", ["model.layers=2", "train.global_batch=32", "parallel.pp=2", "parallel.zero=optim"], 32),
    ("deepseek-v3", ["model.layers=2", "model.moe_layers_start=1", "model.mtp_depth=0", "model.vocab_size=4096", "parallel.pp=1",
                     "parallel.last_stage_layers=0", "train.global_batch=64"], 0),
], ids=["llama3-8b-tp2-pp2", "deepseek-v3-ep64"])
def test_no_rank_allocates_more_than_its_shard_while_building(name, overrides, rank):
    got = _build_allocations(name, overrides, 64, rank)
    # every allocation of the build is at most the largest fp32 shard it fills (a tile is smaller)
    # or a buffer par-zero keeps (a bucket holds several shards), and what the build frees again
    # never exceeds the largest shard
    assert got["largest"] <= max(got["shard"], got["kept"]), got
    assert got["transient"] <= got["shard"], got
