"""Hugging Face Qwen3-Next interop: a tiny random Qwen3NextForCausalLM (built offline; Gated DeltaNet layers
and a gated full-attention layer every second layer, partial RoPE, grouped value heads, zero-centred norms
set away from zero) imported with `pretrain convert` gives transformers' logits (fp32, <= 1e-5 relative;
the chunked delta rule's rounding) on 1 rank and under tp 2; export writes back every tensor
bitwise but the zero-centred norms (held as 1 + w: back within half an ulp of 1) and transformers
loads it."""

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
SEQ, BATCH, LAYERS = 16, 2, 4


def tiny_config():
    return transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0, full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_qwen3_next")
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from their initial values, so a wrong norm mapping shows
                p.copy_(0.1 * torch.randn_like(p) + (1 if "linear_attn.norm" in name else 0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "hf", safe_serialization=True)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    res = runner.invoke(app, ["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt")])
    assert res.exit_code == 0, res.output
    return root, tokens, out.logits, out.loss


def logits_job(ckpt, overrides, tokens):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(f"{ckpt}/config.toml", [f"train.seq_len={SEQ}", "train.eval_every=0"] + overrides)
    trainer = Trainer(cfg)
    trainer.load_checkpoint(ckpt, model_only=True)
    return trainer.logits(tokens)


@pytest.mark.parametrize("overrides,world", [([], 1), (["parallel.tp=2"], 2)])
def test_imported_qwen3_next_gives_transformers_logits_and_loss(dist_run, hf_model, overrides, world):
    root, tokens, want, want_loss = hf_model
    for got in dist_run(world, logits_job, str(root / "ckpt"), overrides, tokens):
        got = got.permute(1, 0, 2)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), overrides
        loss = torch.nn.functional.cross_entropy(got[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item(), overrides


def test_export_round_trip_reproduces_every_tensor_bitwise(hf_model, tmp_path):
    from safetensors.torch import load_file

    root, _, _, _ = hf_model
    res = runner.invoke(app, ["convert", "--to-hf", str(tmp_path / "back"), "--checkpoint", str(root / "ckpt")])
    assert res.exit_code == 0, res.output
    a, b = load_file(str(root / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    centred = [k for k in a if "layernorm" in k or k == "model.norm.weight" or k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert all(a[k].equal(b[k]) for k in a if k not in centred), [k for k in a if k not in centred and not a[k].equal(b[k])]
    # the zero-centred norms went through 1 + w in fp32: each value within half an ulp of 1
    assert len(centred) == 2 * LAYERS + 1 + 2 * (LAYERS // 2)
    assert max((a[k] - b[k]).abs().max().item() for k in centred) <= 2 ** -24
    assert transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "back") is not None


def test_unsupported_qwen3_next_configs_are_one_error_line(hf_model, tmp_path):
    """A layer pattern other than every n-th layer full attention, or routed experts: one line, nothing written."""
    import json
    import shutil

    from one_error_line import assert_one_error_line

    root, _, _, _ = hf_model
    base = json.loads((root / "hf" / "config.json").read_text())
    for change, words in (({"layer_types": ["full_attention", "linear_attention"] * 2}, "layer_types="),
                          ({"num_experts": 8}, "num_experts=8")):
        src = tmp_path / f"hf_{len(words)}"
        shutil.copytree(root / "hf", src)
        (src / "config.json").write_text(json.dumps(base | change))
        res = runner.invoke(app, ["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")])
        assert_one_error_line(res, words, words)
        assert not (tmp_path / "out").exists()
    res = runner.invoke(app, ["plan", "--world", "1", "--set", "model.attention=qwen3_next", "--set", "model.num_experts=4"])
    assert_one_error_line(res, "num_experts", "[model].num_experts and mtp_depth must be 0")
