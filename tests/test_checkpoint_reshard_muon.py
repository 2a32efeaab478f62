"""A Muon checkpoint reshards like an AdamW one: saved under tp2 x pp2 (ZeRO-1), loaded under dp4
ZeRO-3, training continues with the uninterrupted run's losses (test_checkpoint_reshard's rule).

The momentum is saved as pieces of each param (``optim/momentum_buffer/<name>``, the full matrix
whatever the layout), so the load reshards it; a momentum lost or misplaced on the load changes the
next update of every matrix, and the first resumed loss after it."""

import pytest

STEPS, SAVE_AT = 6, 3
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false", "model.layers=4",
          "train.optimizer=muon", "train.muon_ns_dtype=fp32"]
SAVED, RESUMED = ["parallel.tp=2", "parallel.pp=2", "parallel.zero=optim"], ["parallel.zero=optim_grads_params"]
STATE = ("optim/momentum_buffer/", "optim/exp_avg/", "optim/exp_avg_sq/")


def _trainer(overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    return Trainer(load_config(None, COMMON + overrides))


def reshard_job(root):
    import os

    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint.full_model import read_full_tensors

    out = {}
    t = _trainer(SAVED)
    losses = []
    for step in range(STEPS):
        losses.append(t.train_step(step).loss)
        if step + 1 == SAVE_AT:
            t.save_checkpoint(root, SAVE_AT)
    out["reference"] = losses
    t = _trainer(RESUMED)
    out["start"] = t.load_checkpoint(latest_checkpoint(root))
    again = os.path.join(root, "again")
    t.save_checkpoint(again, out["start"])  # what dp4 ZeRO-3 holds after the load, in full
    for prefix in ("model/",) + STATE:
        a, b = (read_full_tensors(latest_checkpoint(r), prefix) for r in (root, again))
        out[prefix] = (sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a),
                       {k: float(v.abs().sum()) for k, v in a.items()})
    out["losses"] = [t.train_step(step).loss for step in range(out["start"], STEPS)]
    return out


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
def test_muon_save_tp2pp2_load_dp4_zero3_continues_like_the_uninterrupted_run(dist_run, tmp_path):
    res = dist_run(4, reshard_job, str(tmp_path / "ckpt"), timeout=600)[0]
    ref = res["reference"]
    assert ref[-1] < ref[0] and res["start"] == SAVE_AT
    momentum = res["optim/momentum_buffer/"][1]  # |m| summed per param: Muon's matrices only
    assert momentum["model.layers.3.self_attn.q_proj.weight"] > 0 < momentum["model.layers.0.mlp.down_proj.weight"]
    assert momentum["model.embed_tokens.weight"] == 0 == momentum["model.layers.0.input_layernorm.weight"]
    for prefix in ("model/",) + STATE:
        equal, mass = res[prefix]
        assert mass and equal and sum(mass.values()) > 0, prefix  # every piece back, bitwise, and not all zero
    got = res["losses"]
    for a, b in zip(got, ref[SAVE_AT:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, ref[SAVE_AT:])
