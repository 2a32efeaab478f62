"""Aux-loss-free balancing summed before the update (fault tolerance's ``BiasBalance.fold_each_step``) moves every
expert bias bitwise as the update summed after it does, a skipped update's counts carried into the next one; a step
interrupted after its counts were summed leaves nothing of them in what a regrouped trainer or a joiner takes
(``state``/``adopt``, the kept counts as JSON). One process: the sums are over no group. The runs with a real
SIGKILL: test_replica_faults_bias.py."""

import copy
import json

import torch
from par_moe import MoEConfig
from par_moe.layer import MoELayer

from pretrain.cli import app
from pretrain.model.bias_balance import BiasBalance

E = 8


def _layers() -> list:
    config = MoEConfig(hidden=16, ffn_hidden=8, num_experts=E, top_k=2, score_func="sigmoid", bias_update_rate=0.01)
    return [MoELayer(config), MoELayer(config)]


def _route(balance: BiasBalance, seed: int) -> None:
    """A step's forwards: counts the bias-dependent routing would add (the routing itself is not the point)."""
    gen = torch.Generator().manual_seed(seed)
    for moe in balance.layers:
        moe.routed_since_update += torch.randint(0, 50, (E,), generator=gen).double()


def test_summed_before_the_update_moves_the_bias_bitwise_as_after_it_with_skips_and_a_discarded_step():
    plain = BiasBalance(_layers(), None)
    each = BiasBalance(copy.deepcopy(plain.layers), None)
    each.fold_each_step()
    skipped = {1, 2, 4}
    for step in range(6):
        _route(plain, step)
        if step not in skipped:
            plain.update()
        _route(each, step)
        each.count_step()
        if step not in skipped:
            each.update()
        each.commit()
        if step == 2:  # the next step interrupted after its summation: a regrouped trainer goes on from the boundary
            _route(each, 99)
            each.count_step()
            held = json.loads(json.dumps(each.state()))  # held after the loss; a joiner receives it as JSON
            each = BiasBalance(copy.deepcopy(each.layers), None)
            each.fold_each_step()
            for moe in each.layers:
                moe.routed_since_update.zero_()  # a fresh trainer's
            each.adopt(held)
    for a, b in zip(plain.layers, each.layers, strict=True):
        assert torch.equal(a.router.expert_bias, b.router.expert_bias)
        assert a.router.expert_bias.abs().sum() > 0
    assert each.state() is None and plain.kept is None


def test_buddy_shards_skipping_updates_with_bias_balancing_is_one_error_line(tmp_path, monkeypatch):
    """A joiner under buddy shards is re-sharded, not sent the scalars the kept counts travel with: refused."""
    from one_error_line import assert_one_error_line, snapshot
    from test_replica_refusals import SMALL, runner

    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["train", *SMALL, "--nproc", "2", "tiny-moe", "--set", "parallel.zero=optim", "--set",
                                 "train.buddy_shards=1", "--set", "train.nan_policy=skip", "--set",
                                 "model.bias_update_rate=0.1", "--set", "log.dir=run"])
    assert_one_error_line(res, "buddy shards, skip, bias", "[model].bias_update_rate=0.1: set it to 0")
    assert snapshot(tmp_path) == {}
