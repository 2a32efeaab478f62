"""`pretrain plan`: ZeRO numbers in the trainer's convention, DeepSeek-V3 expert sizes, formulas checked independently."""

import json
import re

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.sizing.activations import planned_activations
from pretrain.sizing.schedule_peak import ChunkBytes, stage_peak
from pretrain.sizing.flops import param_counts, training_flops_per_token

runner = CliRunner()


def plan_json(*args):
    res = runner.invoke(app, ["plan", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_model_state_only_form_prints_the_trainers_numbers():
    # 7B at dp 8, bf16 params (2 bytes), fp32 grads (4), fp32 main weights + moments (12): P 14, G 28, O 84 GB
    res = runner.invoke(app, ["plan", "--params", "7e9", "--dp", "8"])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.stdout.splitlines()[1:]]
    assert [(r[0], r[2], r[3]) for r in rows] == [("DDP", "126", "GB"), ("ZeRO-1", "52.5", "GB"),
                                                  ("ZeRO-2", "28", "GB"), ("ZeRO-3", "15.75", "GB")]
    gb = plan_json("--params", "7e9", "--dp", "8")["model_state_gb"]
    assert gb == pytest.approx({"no_shard": 126, "optim": 14 + 28 + 84 / 8, "optim_grads": 14 + 112 / 8,
                                "optim_grads_params": 126 / 8})


def test_deepseek_v3_expert_memory():
    out = plan_json("deepseek-v3")
    e = out["experts"]
    assert e["params_per_expert"] == 3 * 7168 * 2048 and round(e["params_per_expert"] / 1e6) == 44
    assert round(e["bytes_per_expert_bf16"] / 1e6) == 88
    assert round(e["routed_bytes_per_layer_bf16"] / 1e9) in (22, 23) and e["moe_layers"] == 58
    assert e["routed_bytes_all_layers_bf16"] > 1e12  # "exceed 1 TB"
    assert e["ep"] == 64 and e["experts_per_rank_per_layer"] == 4
    text = runner.invoke(app, ["plan", "deepseek-v3"]).stdout
    assert "44.04M params = 88.08 MB (bf16) each; 22.55 GB routed per MoE layer" in text
    assert "ep=64: 4 experts per rank per layer" in text
    assert 660e9 < out["params"]["total"] < 680e9  # 671B published


def test_param_count_matches_a_hand_count_of_llama3_8b():
    c = param_counts(load_config("llama3-8b").model)
    h, f, v, layers = 4096, 14336, 128256, 32
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * f + 2 * h
    assert c.total == 2 * v * h + h + layers * layer and round(c.total / 1e9, 2) == 8.03


def test_flops_per_token_by_hand_for_tiny():
    m = load_config(None).model  # h 64, 8 layers, kv 4 of 8 heads, ffn 128, vocab 257 (unpadded: model FLOPs)
    matmul = 8 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 257 * 64
    assert training_flops_per_token(m, 64) == 6 * matmul + 6 * 8 * 64 * 64


def test_activations_shrink_with_sp_cp_and_recomputation():
    def act(*sets, world=2):
        cfg = load_config("llama3-8b", ["train.global_batch=8", "train.micro_batch=1", *sets])
        return planned_activations(cfg, cfg.validate_world(world), 0)

    base = act("parallel.sequence_parallel=false", "model.recompute=none")
    sp, cp = act("model.recompute=none"), act("model.recompute=none", "parallel.cp=2", world=4)
    sel, full = act("model.recompute=selective"), act("model.recompute=full")
    assert full < sel < sp < base and cp < 0.55 * sp


def test_the_schedule_walk_counts_what_the_executor_keeps():
    unit = ChunkBytes(saved=1.0, junctions=0.0, backward=0.0)
    # 1F1B: stage s holds pp - s micro-batches in flight, and again once its gradients exist
    peaks = [stage_peak("1f1b", 4, 1, 16, s, {s: unit}) for s in range(4)]
    assert [(p.before, p.after) for p in peaks] == [(4, 4), (3, 3), (2, 2), (1, 1)]
    assert peaks[0].with_grads(10.0) == 14 and peaks[3].with_grads(0.0) == 1
    # split backward: ZB-H1's last stage keeps each saved set until its W (not its B), with the
    # junction grads its B recorded: pp of them wait for their W (1F1B's last stage: one)
    split = stage_peak("zb-h1", 4, 1, 16, 3, {3: ChunkBytes(saved=1.0, junctions=0.5, backward=0.0)})
    assert split.before == split.after == 4 * 1.5
    # pp = 1: one micro-batch's saved set; later ones meet the gradient buffer only when m > 1
    assert stage_peak("1f1b", 1, 1, 1, 0, {0: unit}).with_grads(5.0) == 1
    assert stage_peak("1f1b", 1, 1, 2, 0, {0: unit}).with_grads(5.0) == 6


def test_vocabulary_padding_rounds_up_as_megatron():
    m = load_config(None).model  # the byte tokenizer's 257
    assert [m.padded_vocab(tp) for tp in (1, 2, 4)] == [384, 512, 512]
    fixed = load_config(None, ["model.vocab_pad_to=64"]).model
    assert [fixed.padded_vocab(tp) for tp in (1, 2, 4)] == [320, 320, 320]
    llama = load_config("llama3-8b").model  # 128256 = 501 x 256: no pad at tp 2, 129024 = 126 x 1024 at tp 8
    assert [llama.padded_vocab(tp) for tp in (1, 2, 4, 8)] == [128256, 128256, 128512, 129024]


def test_decision_tree_walks_ddp_zero1_zero3_and_hsdp():
    # Llama-3-8B at tp 2, dp 32: DDP peaks at 106 GB, ZeRO-1 at 60 GB (budget: 90 % of the GPU)
    assert plan_json("llama3-8b", "--world", "64", "--gpu-memory", "200")["decision"]["zero"] == "no_shard"
    assert plan_json("llama3-8b", "--world", "64")["decision"]["zero"] == "optim"
    # tp=1, full recompute (8.8 GB of activations), one micro-batch per step: ZeRO-2 peaks at 26.9 GB,
    # HSDP in nodes of 16 at 17.8 GB
    tp1 = ["--set", "parallel.tp=1", "--set", "model.recompute=full", "--gpu-memory"]
    d = plan_json("llama3-8b", "--world", "64", "--gpus-per-node", "16", "--set", "train.global_batch=64", *tp1, "22")["decision"]
    assert d == {"zero": "optim_grads_params", "hsdp_replicas": 4, "why": d["why"]} and "HSDP" in d["why"]
    # 8 micro-batches: ZeRO-2/3 accumulate into the full fp32 gradient buffer (32 GB): nothing fits
    assert plan_json("llama3-8b", "--world", "64", "--gpus-per-node", "16", *tp1, "22")["decision"]["zero"] is None
    single_node = plan_json("llama3-8b", "--world", "8", "--set", "train.global_batch=8", *tp1, "32")
    assert single_node["decision"]["zero"] == "optim_grads_params" and single_node["decision"]["hsdp_replicas"] == 1
    # DeepSeek-V3 on 64 GPUs without pipeline parallelism fits under no strategy
    assert plan_json("deepseek-v3", "--world", "64", "--set", "parallel.pp=1", "--set", "parallel.last_stage_layers=0",
                     "--set", "parallel.ep=8")["decision"]["zero"] is None


@pytest.mark.parametrize("args, message", [
    (["--params", "7e9"], "needs both --params and --dp"),
    (["tiny", "--params", "7e9", "--dp", "8"], "leave out CONFIG"),
    (["--set", "parallel.tp=3", "--world", "3"], "[parallel].tp=3 does not divide [model].heads=8"),
    (["--world", "3", "--set", "parallel.tp=2"], "does not fit 3 ranks"),
    (["--set", "parallel.tpp=2"], "unknown key [parallel].tpp"),
    (["nope.toml"], "config file 'nope.toml' does not exist"),
    (["--set", "model.vocab_pad_to=1", "--set", "parallel.tp=2", "--world", "2"],
     "vocab_size=257 padded to a multiple of vocab_pad_to=1 is 257 rows, which [parallel].tp=2 does not divide"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 2 and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_the_model_state_rows_are_all_in_gb():  # issue 50: "params 501.91 MB" among the GB of ZeRO-3's row
    res = runner.invoke(app, ["plan", "llama3-8b", "--world", "32"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.stdout.splitlines() if line.startswith("  ") and "params" in line]
    assert len(rows) == 5 and not any(" MB" in r or " KB" in r for r in rows), rows  # DDP, ZeRO-1/2/3, HSDP
    zero3 = next(r for r in rows if "(optim_grads_params)" in r)
    assert "params 0.50 GB + grads 1.00 GB + optimizer 3.01 GB" in zero3, zero3


def test_a_zero_other_than_the_decisions_says_what_it_costs_in_memory_and_traffic():
    """Megatron's Llama-3-8B script (tp 2, pp 2, --use-distributed-optimizer) on 64 H100s: DDP fits, so the
    decision is no_shard; the plan says what the user's ZeRO-1 costs against it (by hand: 2.01B params per
    rank, fp32 grads 8.03 GB, bf16 params 4.02 GB, dp 16: all-reduce 2 x 15/16 x 8.03, ZeRO-1 15/16 x 12.05)."""
    base = ["plan", "llama3-8b", "--world", "64", "--set", "parallel.tp=2", "--set", "parallel.pp=2"]
    res = runner.invoke(app, base + ["--set", "parallel.zero=optim"])
    assert res.exit_code == 0, res.output
    *_, decision, cost = res.stdout.strip().splitlines()
    assert decision.startswith("decision: zero=no_shard"), decision
    assert cost == ("your zero=optim: peak 44.49 GB per rank (fits) vs 67.07 GB with zero=no_shard (22.59 GB less); "
                    "data-parallel traffic 11.29 GB vs 15.06 GB per rank per step (0.75x: no slower); "
                    "add --topology PRESET for the exposed time"), cost
    timed = runner.invoke(app, base + ["--set", "parallel.zero=optim", "--topology", "dgx-h100"]).stdout
    mine, theirs = map(int, re.search(r"exposed on dgx-h100: (\d+) ms vs (\d+) ms per step$", timed.strip()).groups())
    assert 0 < mine < theirs, timed  # the estimator's exposed data-parallel time: ZeRO-1 moves 0.75x the bytes
    zero3 = runner.invoke(app, base + ["--set", "parallel.zero=optim_grads_params"]).stdout.strip().splitlines()[-1]
    assert "(16.50x: slower where the data-parallel reductions are not hidden)" in zero3, zero3
    agreeing = runner.invoke(app, base + ["--set", "parallel.zero=no_shard"]).stdout.strip().splitlines()[-1]
    assert agreeing.startswith("decision: "), agreeing  # the same choice: no line


def test_a_dense_plan_prints_no_expert_figures_and_counts_agree_in_number():
    dense = runner.invoke(app, ["plan", "llama3-8b", "--world", "32"]).stdout
    assert "etp=" not in dense and "edp=" not in dense and " ep=" not in dense and "active per token" not in dense
    assert "experts" not in dense and "layout: tp=" in dense and "params: 8.03B total; per rank" in dense, dense
    moe = runner.invoke(app, ["plan", "tiny-moe", "--world", "1", "--set", "model.layers=2",
                              "--set", "model.expert_balance=replicate"]).stdout
    assert "ep=1 etp=1 edp=1" in moe and "active per token" in moe, moe
    assert "on 1 rank (" in moe and "; 1 micro-batch of 8 per dp rank" in moe and " over 1 layer;" in moe, moe
    assert " over 1 MoE layer (" in moe and "(1 micro-batch)" in moe, moe


def _plan(*sets: str, world: int = 2) -> dict:
    args = ["plan", "--world", str(world), "--json", "--set", "parallel.pp=2", "--set", "train.seq_len=256"]
    res = runner.invoke(app, args + [a for s in sets for a in ("--set", s)])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_a_module_policy_is_sized_per_stage_and_a_word_plan_has_no_policy_block():
    from pretrain.sizing.offload import offloaded_bytes

    assert "activation_policy" not in _plan("model.recompute=selective")
    none = _plan('model.recompute=["layernorm@7"]')["activation_policy"]["stages"]  # the last norm only
    mlp = _plan('model.recompute=["mlp"]')["activation_policy"]["stages"]
    off = _plan('model.offload=["layers:1"]')["activation_policy"]["stages"]
    for s in range(2):
        assert mlp[s]["recompute_flops_per_step"] > 0 and mlp[s]["activations"] < none[s]["activations"]
        assert off[s]["offloaded_bytes_per_step"] > 0 and off[s]["activations"] < none[s]["activations"]
        assert off[s]["h2d_gb_s_needed"] > 0 and mlp[s]["offloaded_bytes_per_step"] == 0
    cfg = load_config(None, ["parallel.pp=2", "train.seq_len=256", 'model.offload=["layers:1"]'])
    assert off[0]["offloaded_bytes_per_step"] == offloaded_bytes(cfg, cfg.validate_world(2), 0)


def test_auto_policy_without_auto_is_one_error_line():
    res = runner.invoke(app, ["plan", "--world", "2", "--auto-policy"])
    assert res.exit_code == 2 and "error: --auto-policy widens --auto's search" in res.output
