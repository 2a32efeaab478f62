"""`pretrain plan` sizes Muon's optimizer state: one fp32 momentum for each param Muon steps (AdamW's
two fp32 moments for the rest), beside the fp32 main weights of a bf16 run. On one rank per pipeline
(pp = tp = 1, every rank holding the whole model) the state bytes are the formula of model/muon_split.py's
counts; AdamW's plan is unchanged; the search (--auto) sizes with it too."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

MAIN, MOMENTUM, MOMENTS = 4, 4, 8  # fp32 main weights (bf16 params), Muon's momentum, AdamW's moments
CASES = {  # id: (preset, world, overrides): every rank holds the whole model, dp = world
    "llama3-8b-dp8": ("llama3-8b", 8, ["parallel.tp=1"]),
    "deepseek-v3-dp64": ("deepseek-v3", 64, ["parallel.pp=1", "parallel.ep=1", "parallel.last_stage_layers=0"]),
}


def plan(preset, world, overrides, *extra):
    sets = [a for o in overrides for a in ("--set", o)]
    res = CliRunner().invoke(app, ["plan", preset, "--world", str(world), "--json", *sets, *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_state_is_one_momentum_for_muon_two_moments_for_adamw(case):
    preset, world, overrides = CASES[case]
    muon = plan(preset, world, overrides + ["train.optimizer=muon"])
    adamw = plan(preset, world, overrides)
    split = muon["optimizer"]
    total = split["muon_params"] + split["adamw_params"]
    assert total == muon["params"]["per_rank_dense"] + muon["params"]["per_rank_experts"]  # no vocabulary padding
    state = split["muon_params"] * (MAIN + MOMENTUM) + split["adamw_params"] * (MAIN + MOMENTS)
    assert muon["model_state"]["no_shard"]["optim"] == state
    assert muon["model_state"]["optim"]["optim"] == state / world  # ZeRO-1 shards it over dp
    assert adamw["model_state"]["no_shard"]["optim"] == total * (MAIN + MOMENTS)
    for zero in ("no_shard", "optim", "optim_grads", "optim_grads_params"):  # params and grads as AdamW's
        for kind in ("params", "grads"):
            assert muon["model_state"][zero][kind] == adamw["model_state"][zero][kind]
    assert "one fp32 momentum" in muon["convention"] and "momentum" not in adamw["convention"]


def test_auto_search_sizes_muon_state():
    """`plan --auto` (planner/search.py) sizes the same best layout 4 bytes per Muon param lighter, sharded as it is."""
    from pretrain.config import load_config
    from pretrain.sizing.params import rank_params

    args = ["--topology", "dgx-h100", "--auto", "--gpu-memory", "40"]
    best = {o: plan("llama3-8b", 64, [f"train.optimizer={o}"], *args)["best"][0] for o in ("adamw", "muon")}
    layout = best["muon"]["layout"]
    assert layout == best["adamw"]["layout"] and layout["zero"] == "optim", best  # ZeRO-1: state over dp x cp
    cfg = load_config("llama3-8b", best["muon"]["set"].replace("--set ", "").split() + ["train.optimizer=muon"])
    stages = [rank_params(cfg, cfg.validate_world(64), s).muon_dense for s in range(layout["pp"])]
    lighter = (best["adamw"]["memory_gb"] - best["muon"]["memory_gb"]) * 1e9
    assert any(lighter == pytest.approx((MOMENTS - MOMENTUM) * s / (layout["dp"] * layout["cp"])) for s in stages), (lighter, stages)
    # its cost model adds the owners' exchange to ZeRO-1's dp traffic: fp32 update gathered (4 bytes) and bf16
    # results reduce-scattered (2) per param, as much again as the fp32 grads' reduce-scatter (4) + bf16 params' gather (2)
    dp = "dp_cp" if layout["cp"] > 1 else "dp"
    assert best["muon"]["comm_s"][dp] == pytest.approx(2 * best["adamw"]["comm_s"][dp])


def test_simulate_measures_muon_state_and_collectives_as_planned():
    """`plan --simulate` (the trainer's real Muon on fake tensors): the optimizer bytes it holds are the
    plan's, within 1 %, and so are the data-parallel gathers and reduce-scatters (grads, params and the
    Muon owners' exchange together). Llama-3-8B's 2 layers, tp 2 x pp 2 x dp 16, ZeRO-1 (the TP split's
    blocks located without an object gather, which has no values on fake tensors)."""
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", ["model.layers=2", "train.global_batch=32", "parallel.tp=2", "parallel.pp=2",
                                    "parallel.zero=optim", "train.optimizer=muon"])
    for rank in simulate(cfg, 64, [0, 32])["ranks"]:
        assert rank["measured"]["optim"] == pytest.approx(rank["planned"]["optim"], rel=0.01)
        rows = {(c["op"], c["group"]): c for c in rank["collectives"]}
        for key in (("reduce_scatter", "dp"), ("all_gather", "dp")):
            assert rows[key]["bytes"] == pytest.approx(rows[key]["theory_bytes"], rel=0.01), key
