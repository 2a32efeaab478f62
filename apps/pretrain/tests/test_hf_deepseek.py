"""Hugging Face DeepSeek-V3 interop: a tiny random DeepseekV3ForCausalLM (built offline; MLA with the
low-rank query, YaRN RoPE, first-k dense, group-limited sigmoid routing with a non-zero correction
bias, a shared expert) imported with `pretrain convert` gives transformers' logits and loss (fp32,
<= 1e-5 relative) on 1 rank, tp 2, ep 2 and pp 2 split unevenly (1 | 2 layers); export writes back every tensor bitwise, including the
multi-token-prediction layer ``model.layers.L.*`` of the released checkpoints."""

import json

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
SEQ, BATCH, LAYERS = 16, 2, 3


def tiny_config(**kw):
    return transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, **kw)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones, so a wrong norm mapping shows
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
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


@pytest.mark.parametrize("overrides,world", [([], 1), (["parallel.tp=2"], 2), (["parallel.ep=2"], 2),
                                             (["parallel.pp=2", "parallel.first_stage_layers=1"], 2)])
def test_imported_deepseek_gives_transformers_logits_and_loss(dist_run, hf_model, overrides, world):
    root, tokens, want, want_loss = hf_model
    for got in dist_run(world, logits_job, str(root / "ckpt"), overrides, tokens):
        got = got.permute(1, 0, 2)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), overrides
        loss = torch.nn.functional.cross_entropy(got[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item(), overrides


def _with_mtp_layer(src, dst):
    """The released layout: config num_nextn_predict_layers=1 and model.layers.L.* (block + MTP tensors)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    last = f"model.layers.{LAYERS - 1}."
    for name, t in list(state.items()):  # a MoE block like the last layer's, with its own values
        if name.startswith(last):
            state[f"model.layers.{LAYERS}." + name[len(last):]] = torch.randn(t.shape, generator=g)
    p = f"model.layers.{LAYERS}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        state[p + name + ".weight"] = 1 + 0.1 * torch.randn(32, generator=g)
    state[p + "eh_proj.weight"] = torch.randn(32, 64, generator=g)
    state[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return state


@pytest.mark.parametrize("mtp", [False, True])
def test_export_round_trip_reproduces_every_tensor_bitwise(hf_model, mtp, tmp_path):
    from safetensors.torch import load_file

    from pretrain.checkpoint.hf import read_hf

    root, _, _, _ = hf_model
    src = root / "hf"
    if mtp:
        _with_mtp_layer(src, tmp_path / "hf_mtp")
        src = tmp_path / "hf_mtp"
    for args in (["--from-hf", str(src), "--out", str(tmp_path / "ckpt")],
                 ["--to-hf", str(tmp_path / "back"), "--checkpoint", str(tmp_path / "ckpt")]):
        res = runner.invoke(app, ["convert", *args])
        assert res.exit_code == 0, res.output
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    assert read_hf(tmp_path / "back")[0] == read_hf(src)[0]
    assert read_hf(src)[0].mtp_depth == int(mtp)
    if not mtp:
        assert transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back") is not None


def test_deepseek_bad_config_is_one_clear_line(tmp_path):
    config = tiny_config().to_dict() | {"rope_interleave": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = runner.invoke(app, ["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "rope_interleave=False" in res.stderr and len(res.stderr.strip().splitlines()) == 1
