"""expert_balance = "replicate+replace" in a real trainer (ep2 x edp2 ZeRO-1, ep4 ZeRO-2, tp2 x ep2 with etp 1 and 2,
cp2 x ep2, the all-gather dispatcher, pp2 x ep2, Muon, RMSprop; forced skew).

A re-placement moves experts between EP ranks and changes nothing else: every tensor of the model
and of the optimizer state, keyed by its global expert index as a checkpoint holds it, is bitwise
the same just before and just after it. A move that left a parameter's optimizer state behind (the
planted bug) leaves another expert's moments at the moved expert's global index, and fails. Every
rank computes the same map, and the logged bytes moved are what the all-to-alls carry (CommRecorder).
"""

import pytest
import torch

OVERRIDES = ["model.layers=3", "model.top_k=4", "model.expert_balance=replicate+replace", "model.replace_every=2",
             "parallel.ep=2", "parallel.zero=optim", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
             "log.progress=false", "train.seq_len=32"]
LAYOUTS = {  # on 4 ranks; "ep2-optim" (ep2 x edp2, ZeRO-1) is OVERRIDES itself
    "ep2-optim": [],
    "ep4-optim_grads": ["parallel.ep=4", "parallel.zero=optim_grads"],
    "tp2-ep2-etp1-no_shard": ["parallel.tp=2", "parallel.etp=1", "parallel.zero=no_shard"],
    "ep2-optim-muon": ["train.optimizer=muon"],
    "ep2-no_shard-rmsprop": ["train.optimizer=rmsprop", "parallel.zero=no_shard"],  # a torch.optim class's state
    "cp2-ep2-optim": ["parallel.cp=2"],
    "tp2-etp2-ep2-optim": ["parallel.tp=2", "parallel.etp=2"],
    "ep2-optim-allgather": ["model.dispatcher=allgather"],
    "pp2-ep2-optim": ["parallel.pp=2", "model.layers=4"],  # each stage re-places its own MoE layers
}


def skew(trainer) -> None:
    """Experts 0 and 1 in every token's top 4 (both on EP rank 0 before any re-placement)."""
    for chunk in trainer.model.chunks.values():
        for layer in chunk.decoder_layers():
            if layer.is_moe:
                with torch.no_grad():
                    layer.mlp.router.expert_bias[:2] += 1.0


def global_state(trainer) -> dict[str, torch.Tensor]:
    """Every trained tensor and its optimizer state as the checkpoint keys it (global expert index),
    assembled from every rank's pieces."""
    from par_groups import comm
    from pretrain.checkpoint.store import _pieces

    mine = {k: (p.full_shape, [(o, t.detach().cpu().clone()) for o, t in p.boxes])
            for k, p in _pieces(trainer, with_optim=True).items()}
    everyone = [None] * torch.distributed.get_world_size()
    comm.all_gather_object(everyone, mine, None)
    full_tensors = {}
    for rank_pieces in everyone:
        for key, (shape, boxes) in rank_pieces.items():
            full = full_tensors.setdefault(key, torch.full(tuple(shape), float("nan")))
            for offsets, t in boxes:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return full_tensors


def replace_run(overrides, bug: str | None = None):
    """Per re-placement step: (its log record, the global tensors it changed, every rank's maps, the EP ranks'
    NVLink domains, the bytes this rank's all-to-alls sent to other ranks)."""
    from par_groups import CommRecorder, comm
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config("tiny-moe", overrides)
    trainer = Trainer(cfg)
    skew(trainer)
    replacer, opt, out = trainer.expert_replacer, trainer.model.dp.optimizer, []
    after_step, seen = replacer.after_step, {}

    def watched(step):  # the state after the optimizer step, just before the re-placement
        seen["before"] = global_state(trainer) if (step + 1) % cfg.model.replace_every == 0 else None
        if bug == "state_not_moved":  # the re-placement moves the params and masters only
            opt.state_kinds = lambda: ()
        try:
            with CommRecorder() as recorder:
                return after_step(step)
        finally:
            seen["sent"] = sum(r.sent for r in recorder.records if r.op == "all_to_all")
            opt.__dict__.pop("state_kinds", None)

    replacer.after_step = watched
    for step in range(cfg.train.steps):
        result = trainer.train_step(step)
        if seen["before"] is None:
            assert result.placement is None
            continue
        before, after = seen["before"], global_state(trainer)
        assert before.keys() == after.keys()
        changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
        maps = [None] * torch.distributed.get_world_size()  # every rank's, by layer name
        comm.all_gather_object(maps, {n: m.placement.expert_at for n, m in zip(replacer.names, replacer.layers)}, None)
        out.append((result.placement, changed, maps, replacer.domains, seen["sent"]))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replacement_moves_experts_with_their_optimizer_state(dist_run, name):
    results = dist_run(4, replace_run, OVERRIDES + LAYOUTS[name], timeout=300)
    ep, pp = 4 if "ep4" in name else 2, 2 if "pp2" in name else 1
    per_rank = 8 // ep
    for rank, steps in enumerate(results):
        assert [record["step"] for record, *_ in steps] == [2, 4]
        for record, changed, maps, *_ in steps:
            assert not changed, f"rank {rank}: re-placement changed {changed[:4]}"
            for layer in {n for m in maps for n in m}:  # every rank holding a layer computed its same map
                assert len({m[layer] for m in maps if layer in m}) == 1, f"{layer}: the ranks computed different maps"
        first, _, maps, *_ = steps[0]
        # the skew: experts 0 and 1 (both on EP rank 0) are split over the two ranks by the first re-placement
        assert first["experts_moved"] > 0 and first["bytes_moved"] > 0, first
        for expert_at in maps[rank].values():
            assert expert_at.index(0) // per_rank != expert_at.index(1) // per_rank, expert_at
        print(f"{name} rank {rank}: {[record for record, *_ in steps]}; maps {maps[rank]}")
    # the logged bytes (every stage's) are what the EP groups' all-to-alls carry between ranks (CommRecorder)
    for i, (record, *_) in enumerate(results[0]):
        assert sum(steps[i][-1] for steps in results) == record["bytes_moved"] * (4 // (ep * pp)), (name, record)


def test_replacement_keeps_experts_in_their_nvlink_domain_when_it_can(dist_run, tmp_path):
    """ep4 on two nodes of two GPUs, one NVLink domain each ([topology].file): the re-placement packs with
    the EP ranks' domains (two ranks in each) and still moves the state and all."""
    topology = tmp_path / "pairs.toml"
    topology.write_text('preset = "dgx-h100"\nnodes = 2\ngpus_per_node = 2\nnvlink_domain_gpus = 2\n')
    overrides = OVERRIDES + LAYOUTS["ep4-optim_grads"] + [f"topology.file={topology}"]
    for rank, steps in enumerate(dist_run(4, replace_run, overrides, timeout=300)):
        for record, changed, maps, domains, _ in steps:
            assert sorted(domains) == [0, 0, 1, 1] and not changed and all(m == maps[0] for m in maps), (rank, record, changed)
        print(f"rank {rank}: {[s[0] for s in steps]}; maps {steps[0][2][0]}")


def test_replacement_without_the_optimizer_state_is_caught(dist_run):
    """The planted bug: the experts' params move, their AdamW moments stay in the old slots."""
    results = dist_run(4, replace_run, OVERRIDES, bug="state_not_moved", timeout=300)
    changed = results[0][0][1]
    assert changed and all(k.startswith("optim/exp_avg") for k in changed), changed


@pytest.mark.parametrize("value", ["0", "-3"])
def test_replace_every_must_be_positive(value):
    from pretrain.config import load_config
    from pretrain.errors import UsageError

    with pytest.raises(UsageError, match=rf"^\[model\]\.replace_every={value} must be >= 1"):
        load_config("tiny-moe", [f"model.replace_every={value}"])
