"""The bytes a Muon step moves (par_groups.comm.CommRecorder) are sizing/muon_comm.py's formula, exactly.

The trainer's own rank model on gloo ranks; one optimizer step recorded. Per layout: the formula of
the buckets holding Muon matrices (their padded ``N``) equals what was recorded, op by op and group by
group. The planner's estimate (simulate/collectives.py) is that formula of the rank's Muon matrices'
elements (sizing/params.py): a bucket also moves the other params it holds, so it is a lower bound.
"""

import pytest

MUON = ["train.optimizer=muon", "model.layers=2", "train.seq_len=32", "train.steps=2", "train.warmup_steps=1", "log.progress=false",
        "train.eval_every=0"]
LAYOUTS = {  # id: (world, overrides)
    "dp2-optim": (2, ["parallel.zero=optim"]),
    "dp2-no_shard": (2, ["parallel.zero=no_shard"]),
    "dp2-optim_grads_params-fp32": (2, ["parallel.zero=optim_grads_params", "train.muon_ns_dtype=fp32"]),
    "tp2-dp2": (4, ["parallel.zero=optim", "parallel.tp=2"]),
}


def recorded(overrides):
    import torch.distributed as dist

    from par_groups import comm
    from pretrain.config import load_config
    from pretrain.simulate.collectives import muon_collectives
    from pretrain.sizing.params import rank_params
    from pretrain.sizing.muon_comm import muon_split_gather_bytes, muon_step_bytes
    from pretrain.training.train_loop import Trainer

    cfg = load_config("tiny", MUON + overrides)
    trainer = Trainer(cfg)
    trainer.train_step(0)
    dp, g = trainer.model.dp, trainer.groups
    opt = dp.optimizer
    with comm.CommRecorder() as rec:
        opt.step()
    got = {}
    for r in rec.records:
        group = "tp" if r.group is g.tp else "dp"
        got[(r.op, group)] = got.get((r.op, group), 0) + r.bytes
    muon_buckets = [b for b in dp.buckets if opt.matrices[b]]
    d = dist.get_world_size(muon_buckets[0].groups.inner)
    want = {(op, "dp"): n for op, n in muon_step_bytes(sum(b.N for b in muon_buckets), d, cfg.parallel.zero,
                                                       cfg.train.muon_ns_dtype).items()}
    owned = sum(len(e) * p.shape[-2] * p.shape[-1] for b in muon_buckets
                for p, e in opt.owned[b] if p in opt.split[b][0])
    if owned:
        want[("all_gather", "tp")] = muon_split_gather_bytes(owned, dist.get_world_size(g.tp))
    layout = cfg.validate_world(dist.get_world_size())
    return got, want, dict(muon_collectives(cfg, layout, rank_params(cfg, layout, 0)))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_step_bytes_are_the_formula(dist_run, name):
    world, overrides = LAYOUTS[name]
    for got, want, planned in dist_run(world, recorded, overrides, timeout=600):
        assert got == want, (got, want)  # the implementation is the formula
        # the planner's estimate (simulate/collectives.py) takes the Muon matrices' elements: below what the
        # buckets move here, where norms and the embedding share the matrices' buckets
        assert set(planned) == set(want) and all(planned[k] <= want[k] for k in want), (planned, want)
