"""[train].optimizer = "muon": the Muon/AdamW split (model/muon_split.py) as `pretrain plan` lists it, and the
configurations it refuses in one ``error:`` line. The training math: tests/test_muon_matches_torch.py
(against torch.optim.Muon) and tests/test_layouts_muon.py (layouts)."""

import json

from typer.testing import CliRunner

from pretrain.cli import app


def test_plan_lists_the_split_hidden_matrices_muon_the_rest_adamw():
    res = CliRunner().invoke(app, ["plan", "deepseek-v3", "--json", "--world", "2048", "--set", "train.optimizer=muon"])
    assert res.exit_code == 0, res.output
    split = json.loads(res.output)["optimizer"]
    muon, adamw = set(split["muon"]), set(split["adamw"])
    for name in ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.experts.w_gate", "mlp.experts.w_down",
                 "mlp.shared.w_up", "mlp.gate_proj.weight", "eh_proj.weight"):
        assert f"model.layers.*.{name}" in muon, name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.*.mlp.router.weight",
                 "model.layers.*.input_layernorm.weight", "model.layers.*.self_attn.kv_a_layernorm.weight"):
        assert name in adamw, name
    assert not muon & adamw and split["muon_params"] > 30 * split["adamw_params"]
    text = CliRunner().invoke(app, ["plan", "tiny-moe", "--set", "train.optimizer=muon"]).output
    assert "optimizer: Muon on" in text and "AdamW on" in text
    # Qwen3-Next's shared expert: its matrices Muon's, its one-row sigmoid gate AdamW's (as the router)
    res = CliRunner().invoke(app, ["plan", "qwen3-next-80b-a3b", "--json", "--world", "256", "--set", "train.optimizer=muon"])
    split = json.loads(res.output)["optimizer"]
    assert "model.layers.*.mlp.shared.gate.weight" in split["adamw"] and "model.layers.*.mlp.shared.w_up" in split["muon"]


def test_muon_refuses_in_one_error_line():
    for overrides, words in ((["parallel.zero=torch_fsdp2"], "not 'torch_fsdp2'"),
                             (["train.muon_adjust_lr_fn=foo"], "muon_adjust_lr_fn"),
                             (["train.muon_ns_dtype=fp16"], "muon_ns_dtype"),
                             (["train.optimizer_args={momentum=0.9}"], "muon_* keys"),
                             (["train.muon_qk_clip=-1"], "muon_qk_clip=-1.0 must be a finite logit > 0"),
                             (["train.muon_qk_clip=inf"], "muon_qk_clip=inf must be"),
                             (["train.muon_qk_clip=30", "train.optimizer=adamw"], "with optimizer='muon' (got optimizer='adamw')"),
                             (["train.muon_qk_clip=30", "model.qk_norm=true"], "qk_norm=false (its norms undo"),
                             (["train.muon_qk_clip=30", "model.backend=te"], "got attention='gqa'")):
        sets = [a for o in ["train.optimizer=muon"] + overrides for a in ("--set", o)]
        res = CliRunner().invoke(app, ["plan", *sets])
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], res.output
