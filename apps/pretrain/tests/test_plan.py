"""`pretrain plan`: the explainer's ZeRO numbers, DeepSeek-V3 expert sizes, formulas checked independently."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.flops import activation_bytes, param_counts, training_flops_per_token

runner = CliRunner()


def plan_json(*args):
    res = runner.invoke(app, ["plan", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_model_state_only_form_prints_the_explainers_numbers():
    res = runner.invoke(app, ["plan", "--params", "7e9", "--dp", "8"])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.stdout.splitlines()[1:]]
    assert [(r[0], r[2], r[3]) for r in rows] == [("DDP", "84", "GB"), ("ZeRO-1", "35", "GB"),
                                                  ("ZeRO-2", "22.75", "GB"), ("ZeRO-3", "10.5", "GB")]
    gb = plan_json("--params", "7e9", "--dp", "8")["model_state_gb"]
    assert gb == pytest.approx({"no_shard": 84, "optim": 35, "optim_grads": 22.75, "optim_grads_params": 10.5})


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
    m = load_config(None).model  # h 64, 8 layers, kv 4 of 8 heads, ffn 128, vocab 256
    matmul = 8 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 256 * 64
    assert training_flops_per_token(m, 64) == 6 * matmul + 6 * 8 * 64 * 64


def test_activations_shrink_with_sp_cp_and_recomputation():
    m = load_config("llama3-8b").model
    kw = dict(seq_len=8192, micro_batch=1)
    base = activation_bytes(m, tp=2, sequence_parallel=False, recompute="none", **kw)
    sp = activation_bytes(m, tp=2, sequence_parallel=True, recompute="none", **kw)
    cp = activation_bytes(m, tp=2, cp=2, sequence_parallel=True, recompute="none", **kw)
    sel = activation_bytes(m, tp=2, sequence_parallel=True, recompute="selective", **kw)
    full = activation_bytes(m, tp=2, sequence_parallel=True, recompute="full", **kw)
    # by hand, bf16 per token per layer: SP splits the 4h norm-side tensors; tp splits q/k/v, attn out, SwiGLU
    per_token = 2 * (4 * 4096 / 2 + (4096 + 2 * 1024 + 4096) / 2 + 3 * 14336 / 2)
    assert sp.dense_layer == pytest.approx(8192 * per_token)
    assert base.dense_layer - sp.dense_layer == pytest.approx(8192 * 2 * 4 * 4096 / 2)
    assert cp.dense_layer == pytest.approx(sp.dense_layer / 2)
    assert full.dense_layer == pytest.approx(8192 * 2 * 4096 / 2)
    assert full.dense_layer < sel.dense_layer < sp.dense_layer
    pp = activation_bytes(m, tp=2, pp=4, schedule="1f1b", microbatches=16, **kw)
    inter = activation_bytes(m, tp=2, pp=4, vpp=2, schedule="interleaved", microbatches=16, **kw)
    assert pp.in_flight == 4 and inter.in_flight == 4 + 3 / 2


def test_decision_tree_walks_ddp_zero1_zero3_and_hsdp():
    assert plan_json("llama3-8b", "--world", "64")["decision"]["zero"] == "no_shard"
    assert plan_json("llama3-8b", "--world", "64", "--gpu-memory", "40")["decision"]["zero"] == "optim"
    # tp=1, full recompute: ZeRO-2 needs 17.3 + 7.5 GB, HSDP (8 nodes x 8) 12.05 + 7.5 GB
    d = plan_json("llama3-8b", "--world", "64", "--gpu-memory", "22", "--set", "parallel.tp=1",
                  "--set", "model.recompute=full")["decision"]
    assert d == {"zero": "optim_grads_params", "hsdp_replicas": 8, "why": d["why"]} and "HSDP" in d["why"]
    single_node = plan_json("llama3-8b", "--world", "8", "--gpu-memory", "22", "--set", "parallel.tp=1",
                            "--set", "model.recompute=full")
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
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 2 and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output
