"""`pretrain plan` counts par's FP8 only when it is on: the GEMM FLOPs at FP8's rate, one GEMM's quantized
operands, the ZeRO-3 gather in FP8 against bf16's, the amax groups (none for tiles); ``--simulate``'s theory
has the amax reductions, and its rows the bytes by dtype."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.planner.costs import config_plan

SMALL = ["model.layers=2", "parallel.tp=2", "parallel.cp=2"]


WIDE = ["model.hidden=256", "model.heads=8", "model.kv_heads=8", "model.ffn_hidden=256", "train.seq_len=512"]


def _plan(*overrides):  # wide enough for 128-wide tiles per tp rank and cp chunk
    return config_plan(load_config("tiny", SMALL + WIDE + list(overrides)), 8, 8, 80.0)


def test_plan_counts_fp8_only_when_it_is_on():
    off = _plan()
    assert "fp8" not in off
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        f = _plan(f"train.fp8={recipe}")["fp8"]
        share = f["gemm_share_of_model_flops"]
        assert 0 < share < 1 and f["gemm_flops_per_step"] == pytest.approx(share * off["flops"]["per_step"])
        assert f["ideal_step_time_over_bf16"] == pytest.approx(1 - share / 2)
        assert f["zero3_fp8_weights_gather_bytes_fp8"] <= 0.52 * f["zero3_fp8_weights_gather_bytes_bf16"]
        assert f["zero3_gather_bytes_per_rank_fp8"] - f["zero3_fp8_weights_gather_bytes_fp8"] == pytest.approx(
            f["zero3_gather_bytes_per_rank_bf16"] - f["zero3_fp8_weights_gather_bytes_bf16"])  # the rest: bf16
        tiles = recipe in ("blockwise", "mxfp8")
        assert (f["amax_groups"]["column-parallel"] == "none") == tiles, f["amax_groups"]
        assert f["amax_groups"]["output layer"] == "high precision"
    res = CliRunner().invoke(app, ["plan", "tiny", "--world", "8", *sum((["--set", o] for o in SMALL), []),
                                   "--set", "train.fp8=rowwise"])
    assert res.exit_code == 0 and "fp8 (rowwise):" in res.output and "amax reduced over: column-parallel: tp" in res.output


@pytest.mark.extended
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_simulated_amax_reductions_match_the_theory_extended(recipe):
    from pretrain.simulate.report import simulate

    def rows(fp8):
        (rank,) = simulate(load_config("tiny", SMALL + [f"train.fp8={fp8}"]), 8, [0])["ranks"]
        return {(c["op"], c["group"]): c for c in rank["collectives"]}

    on, off = rows(recipe), rows("off")
    cp = on[("all_reduce", "cp")]
    assert cp["bytes"] == cp["theory_bytes"] and cp["by_dtype"] == {"float32": cp["bytes"]}
    tp_on, tp_off = on[("all_reduce", "tp")], off[("all_reduce", "tp")]
    assert tp_on["bytes"] - tp_off["bytes"] == tp_on["theory_bytes"] - tp_off["theory_bytes"]


MLA_MTP = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.mtp_depth=1"]


def test_plan_names_the_amax_groups_of_experts_and_mla_and_counts_the_fp8_gather():
    """MoE's experts (per source rank's rows, over etp), its shared experts and MLA's / MTP's replicated
    linears (tokens: tp and cp) each get their groups, the router stays high precision; with
    [train].fp8_param_gather the plan says the ZeRO-3 gather moves the FP8 bytes."""
    zero3 = ["parallel.zero=optim_grads_params", "train.fp8_param_gather=true"]
    cfg = load_config("tiny-moe", ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2", "train.fp8=tensorwise"]
                      + MLA_MTP + zero3)
    f = config_plan(cfg, 8, 8, 80.0)["fp8"]
    assert f["amax_groups"]["experts (w_gate, w_up, w_down)"] == "etp per source rank's rows"
    for name in ("attention q_a_proj, kv_a_proj_with_mqa", "shared experts (w_gate, w_up, w_down)", "MTP eh_proj"):
        assert f["amax_groups"][name] == "tp", (name, f["amax_groups"])
    assert f["amax_groups"]["router"] == "high precision" and f["fp8_param_gather"]
    assert 0 < f["zero3_fp8_weights_gather_bytes_fp8"] <= 0.52 * f["zero3_fp8_weights_gather_bytes_bf16"]
    res = CliRunner().invoke(app, ["plan", "tiny", "--world", "2", "--set", "train.fp8=blockwise",
                                   *sum((["--set", o] for o in zero3 + WIDE), [])])
    assert res.exit_code == 0 and "a ZeRO-3 gather in FP8 ([train].fp8_param_gather) moves" in res.output, res.output


@pytest.mark.extended
def test_simulated_fp8_gather_matches_the_theory_extended():
    """--simulate's ZeRO-3 gathers with [train].fp8_param_gather: FP8 bytes for the FP8 linears' weights,
    as the theory counts them (sizing/fp8.py's share of the stage's params)."""
    from pretrain.simulate.report import simulate

    cfg = load_config("tiny", ["model.layers=2", "train.fp8=tensorwise", "train.fp8_param_gather=true",
                               "parallel.zero=optim_grads_params"])
    (rank,) = simulate(cfg, 2, [0])["ranks"]
    gather = next(c for c in rank["collectives"] if c["op"] == "all_gather" and c["group"] == "dp")
    assert gather["by_dtype"]["float8_e4m3fn"] > 0 and gather["by_dtype"]["bfloat16"] > 0, gather  # the rest: bf16
    assert gather["bytes"] == pytest.approx(gather["theory_bytes"], rel=0.01), gather


def test_auto_searches_zero3_with_the_fp8_gather_and_counts_its_bytes():
    """--auto under [train].fp8_param_gather: ZeRO-3 alone (the key needs it: a candidate on another level
    would not validate) and its gathers at the FP8 linears' bytes, the rest in bf16."""
    from types import SimpleNamespace

    from pretrain.planner.estimate import zero_traffic
    from pretrain.planner.search import ZERO, gather_bytes, zeros
    from pretrain.runtime.rank_assignment import workload

    key = ["train.fp8=tensorwise", "parallel.zero=optim_grads_params"]
    on, off = load_config("llama3-8b", key + ["train.fp8_param_gather=true"]), load_config("llama3-8b", key)
    assert zeros(on) == ("optim_grads_params",) and zeros(off) == ZERO
    assert gather_bytes(off.model, off.train) == 2.0 and 1.0 < gather_bytes(on.model, on.train) < 1.2
    work = workload(on, SimpleNamespace(micro_batch=1, microbatches=4))
    assert zero_traffic("optim_grads_params", work, None, gather_bytes(on.model, on.train)) < \
        zero_traffic("optim_grads_params", work)


def test_fp8_gather_rows_are_the_trainers_and_auto_skips_the_layouts_it_refuses():
    """The FP8 parameter gather's rows per tp rank in closed form (the built models' rows: tests/
    test_fp8_param_gather_trainer.py::test_plans_weight_rows_are_the_built_models_extended); --auto never proposes
    a layout whose weights do not split into whole 128-row blocks over ZeRO-3's ranks, nor one whose
    blockwise tiles straddle tp ranks (both refused by the trainer)."""
    from pretrain.sizing.fp8_gather_rows import fp8_gather_misfit, fp8_weight_rows

    cfg = load_config("tiny", ["model.layers=2", "train.fp8=blockwise", "parallel.zero=optim_grads_params",
                               "train.fp8_param_gather=true"] + WIDE[:-1])
    rows = fp8_weight_rows(cfg.model, 2)
    assert rows["model.layers.0.self_attn.q_proj.weight"] == 128 and rows["model.layers.0.self_attn.o_proj.weight"] == 256
    assert rows["model.layers.1.mlp.gate_proj.weight"] == 128 and len(rows) == 2 * 7
    layout = cfg.validate_world(2)
    assert fp8_gather_misfit(cfg, layout, 2) is None
    assert "do not split over the 4 ZeRO-3 sharding ranks" in fp8_gather_misfit(cfg, layout, 4)
    flags = sum((["--set", o] for o in ["model.layers=2", "train.fp8=blockwise", "parallel.zero=optim_grads_params",
                                         "train.fp8_param_gather=true"] + WIDE[:-1]), [])
    res = CliRunner().invoke(app, ["plan", "tiny", "--world", "4", "--topology", "dgx-h100", "--auto", "--json",
                                   *flags])
    assert res.exit_code == 0, res.output
    best = [r["layout"] for r in json.loads(res.output)["best"]]
    assert best and all(b["tp"] <= 2 and b["dp"] * b["cp"] * b["tp"] <= 2 for b in best), best  # 256 rows / tp


def test_auto_times_the_fp8_gemms_at_fp8s_rate():
    """--auto's compute time under [train].fp8 is bf16's x the plan's ideal step time (the FP8 GEMMs'
    share at FP8's rate), and its assumptions say so; the MFU stays the model's FLOPs against bf16's peak."""
    from pretrain.sizing.fp8 import fp8_compute_time

    def best(*overrides):
        flags = sum((["--set", o] for o in ["model.layers=2", *overrides]), [])
        res = CliRunner().invoke(app, ["plan", "tiny", "--world", "2", "--topology", "dgx-h100", "--auto", "--json", *flags])
        assert res.exit_code == 0, res.output
        plan = json.loads(res.output)
        return {r["set"]: r for r in plan["best"]}, plan["assumptions"]["notes"]

    (off, off_notes), (on, on_notes) = best(), best("train.fp8=rowwise")
    cfg = load_config("tiny", ["model.layers=2", "train.fp8=rowwise"])
    time = fp8_compute_time(cfg.model, cfg.train)
    assert 0.5 < time < 1
    same = set(off) & set(on)
    assert same
    for key in same:
        assert on[key]["compute_s"] == pytest.approx(time * off[key]["compute_s"], rel=1e-9)
        assert on[key]["mfu"] > off[key]["mfu"]  # the same FLOPs in a shorter step
    assert len(on_notes) == len(off_notes) + 1 and "fp8='rowwise'" in on_notes[-1]
