"""Hugging Face Qwen3-Next interop: tiny random transformers models (built offline; Gated DeltaNet layers
and a gated full-attention layer every second layer, partial RoPE, grouped value heads, zero-centred norms
set away from zero) of ``qwen3_next`` dense and MoE (softmax top-2, a sigmoid-gated shared expert twice the
experts' width, one dense layer by ``mlp_only_layers``), and of Qwen3.5's text models ``qwen3_5_moe_text``
and ``qwen3_5_text`` (their linear projections held apart) and the released form ``qwen3_5_moe`` (a
vision-language model: its language model), imported with `pretrain convert`, give
transformers' logits (fp32, <= 1e-5 relative; the chunked delta rule's rounding) on 1 rank and, for
``qwen3_next``, under tp 2 (MoE: ep 2). Export writes back every tensor bitwise but the zero-centred
norms (held as 1 + w: back within half an ulp of 1) and transformers loads it; after training steps,
the exported model's loss in transformers is the trainer's eval loss (Qwen3.5 exports as
``qwen3_next``, the same model). `plan` counts the shipped Qwen3-Next-80B-A3B's parameters as
transformers does (its linear and full-attention layers apart)."""

import importlib
import sys

import pytest
import torch
from typer.testing import CliRunner

from pretrain.cli import app

transformers = pytest.importorskip("transformers")


def _import_without_fla(names: tuple[str, ...]) -> None:
    """transformers binds flash-linear-attention's Triton kernels into its Gated DeltaNet when `fla` imports
    (it does here: fla-core is the suite's oracle for par-cp's rule), and Triton has no CPU driver: its
    modeling modules are imported with `fla` hidden, so they keep their own PyTorch path, the reference."""
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # `import fla` raises ImportError
    try:
        for name in names:
            module = f"transformers.models.{name}.modeling_{name}"
            assert module not in sys.modules, f"{module} was imported with fla before this test module"
            importlib.import_module(module)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


_import_without_fla(("qwen3_next", "qwen3_5", "qwen3_5_moe"))
runner = CliRunner()
SEQ, BATCH, LAYERS = 16, 2, 4
LINEAR = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
TYPES = dict(layer_types=["linear_attention", "full_attention"] * (LAYERS // 2))
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
VARIANTS = {  # name: (config class, model class, its keys)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", LINEAR | dict(intermediate_size=96, num_experts=0,
                                                                           full_attention_interval=2)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", LINEAR | MOE | dict(
        intermediate_size=96, full_attention_interval=2, norm_topk_prob=True, mlp_only_layers=[2])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", LINEAR | MOE | TYPES),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR | TYPES | dict(intermediate_size=96)),
    # as released: the vision-language model, of which the language model is read
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    dict(text_config=LINEAR | MOE | TYPES, vision_config=VISION)),
}
LAYOUT = {"qwen3_next": ["parallel.tp=2"], "qwen3_next_moe": ["parallel.ep=2"]}


def tiny_model(variant: str):
    config, model, keys = VARIANTS[variant]
    torch.manual_seed(0)
    model = getattr(transformers, model)(getattr(transformers, config)(**keys)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from their initial values, so a wrong norm mapping shows
                p.copy_(0.1 * torch.randn_like(p) + (1 if "linear_attn.norm" in name else 0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            else:  # routers far from uniform too: choices without near-ties
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(directory, tokens, transformers' logits and loss) of a variant saved and converted (made on first use)."""
    root, done = tmp_path_factory.mktemp("hf_qwen3_next"), {}

    def get(variant):
        if variant not in done:
            model = tiny_model(variant)
            model.save_pretrained(root / variant / "hf", safe_serialization=True)
            tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                out = model(tokens, labels=tokens)
            res = runner.invoke(app, ["convert", "--from-hf", str(root / variant / "hf"), "--out", str(root / variant / "ckpt")])
            assert res.exit_code == 0, res.output
            done[variant] = root / variant, tokens, out.logits, out.loss
        return done[variant]
    return get


def logits_job(ckpt, overrides, tokens):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(f"{ckpt}/config.toml", [f"train.seq_len={SEQ}", "train.eval_every=0"] + overrides)
    trainer = Trainer(cfg)
    trainer.load_checkpoint(ckpt, model_only=True)
    return trainer.logits(tokens)


# Qwen3.5's layouts: as Qwen3-Next's once imported (the same modules and tensors); its text models in the
# opt-in tier (the released vision-language one holds the same language model under a prefix)
OPT_IN = ("qwen3_5_moe_text", "qwen3_5_text")


@pytest.mark.parametrize("variant, layout", [pytest.param(v, "1rank", marks=pytest.mark.extended) if v in OPT_IN
                                             else (v, "1rank") for v in VARIANTS] + [(v, "layout") for v in LAYOUT])
def test_imported_qwen3_next_gives_transformers_logits_and_loss(dist_run, imported, variant, layout):
    root, tokens, want, want_loss = imported(variant)
    overrides = [] if layout == "1rank" else LAYOUT[variant]
    for got in dist_run(1 if layout == "1rank" else 2, logits_job, str(root / "ckpt"), overrides, tokens):
        got = got.permute(1, 0, 2)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), overrides
        loss = torch.nn.functional.cross_entropy(got[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item(), overrides


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_next_moe"])
def test_export_round_trip_reproduces_every_tensor_bitwise(imported, variant, tmp_path):
    from safetensors.torch import load_file

    root, _, _, _ = imported(variant)
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


def test_experts_stored_fused_read_as_stored_one_by_one(imported):
    """transformers' in-memory layout (``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``)."""
    from safetensors.torch import load_file

    from pretrain.checkpoint.hf import model_config_from_hf
    from pretrain.models.hf_fields import read_config_json
    from pretrain.models.qwen3_next.hf import from_qwen3_next_names

    root, _, _, _ = imported("qwen3_next_moe")
    m, state = model_config_from_hf(read_config_json(root / "hf" / "config.json")), load_file(str(root / "hf" / "model.safetensors"))
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for i in (0, 1, 3):  # layer 2: mlp_only_layers
        p = f"model.layers.{i}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack([torch.cat([state[f"{p}{e}.gate_proj.weight"], state[f"{p}{e}.up_proj.weight"]])
                                                 for e in range(4)])
        fused[p + "down_proj"] = torch.stack([state[f"{p}{e}.down_proj.weight"] for e in range(4)])
    a, b = from_qwen3_next_names(state, m), from_qwen3_next_names(fused, m)
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)


def train_eval_save(ckpt, out, steps):
    """``steps`` steps from the imported weights, then the eval loss of one held-out batch, its tokens,
    and a checkpoint of the trained weights in ``out``."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(f"{ckpt}/config.toml", [f"train.seq_len={SEQ}", "train.eval_every=0", "train.global_batch=4",
                                              f"train.steps={steps}", "train.warmup_steps=1", "log.progress=false"])
    trainer = Trainer(cfg)
    trainer.load_checkpoint(ckpt, model_only=True)
    for step in range(steps):
        trainer.train_step(step)
    trainer.save_checkpoint(out, steps)
    return trainer.evaluate(1), trainer.sampler.global_eval_batch(0).tokens


# qwen3_next dense: the round trip above is bitwise; the other MoE ones in the opt-in tier (the released
# Qwen3.5-MoE's export makes the proof)
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.extended) for v in ("qwen3_next_moe", "qwen3_5_moe_text")]
                         + ["qwen3_5_moe"])
def test_exported_model_loss_in_transformers_is_the_trainers_eval_loss(dist_run, imported, variant, tmp_path):
    root, _, _, _ = imported(variant)
    eval_loss, tokens = dist_run(1, train_eval_save, str(root / "ckpt"), str(tmp_path / "run"), 2)[0]
    res = runner.invoke(app, ["convert", "--to-hf", str(tmp_path / "back"), "--checkpoint", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    model = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        want = model(tokens, labels=tokens).loss.item()  # [B, S + 1]: its S predictions are the trainer's
        untrained = tiny_model(variant)(tokens, labels=tokens).loss.item()
    assert abs(want - eval_loss) <= 1e-5 * eval_loss, (want, eval_loss)
    assert abs(untrained - want) > 1e-3 * want  # the steps moved the weights the export wrote


def test_unsupported_qwen3_next_configs_are_one_error_line(imported, tmp_path):
    """A layer pattern other than every n-th layer full attention, a shared expert that is not a whole
    number of experts wide: one line, nothing written; experts without a shared one, or not routed by a
    softmax: one line."""
    import json
    import shutil

    from one_error_line import assert_one_error_line

    for variant, change, words in (("qwen3_next", {"layer_types": ["full_attention", "linear_attention"] * 2}, "layer_types="),
                                   ("qwen3_next_moe", {"shared_expert_intermediate_size": 24},
                                    "shared_expert_intermediate_size=24")):
        root, _, _, _ = imported(variant)
        base = json.loads((root / "hf" / "config.json").read_text())
        src = tmp_path / f"hf_{variant}"
        shutil.copytree(root / "hf", src)
        (src / "config.json").write_text(json.dumps(base | change))
        res = runner.invoke(app, ["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")])
        assert_one_error_line(res, words, words)
        assert not (tmp_path / "out").exists()
    for change, words in (("model.shared_experts=0", "[model].shared_experts=0 must be >= 1"),
                          ("model.score_func=sigmoid", "[model].score_func='sigmoid' is not supported")):
        res = runner.invoke(app, ["plan", "tiny-moe", "--world", "1", "--set", "model.attention=qwen3_next", "--set", change])
        assert_one_error_line(res, change.split("=")[0].split(".")[1], words)


def test_plan_counts_transformers_parameters_of_the_shipped_qwen3_next():
    """transformers' Qwen3NextForCausalLM of our export's config.json, built on the meta device."""
    import json

    from pretrain.checkpoint.hf import hf_config_from_model
    from pretrain.config import load_config

    hf = hf_config_from_model(load_config("qwen3-next-80b-a3b").model)
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{
            k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}))
    res = runner.invoke(app, ["plan", "qwen3-next-80b-a3b", "--world", "256", "--json"])
    assert res.exit_code == 0, res.output
    params = json.loads(res.output)["params"]
    assert params["total"] == sum(p.numel() for p in model.parameters())  # 79.67B
    assert round(params["active"] / 1e9, 2) == 3.56  # top-10 of 512 experts, the shared one, the head
