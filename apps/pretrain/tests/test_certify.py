"""`pretrain certify`: a correct layout certifies; a planted bug is named at its module and dimension."""

from __future__ import annotations

import time

import pytest

MLA_MTP = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.layers=6",
           "model.mtp_depth=1", "model.mtp_loss_weight=0.5", "model.rope_scaling={rope_type = \"yarn\", factor = 4.0, original_max_position_embeddings = 16}"]
MOE_BALANCING = ["model.aux_loss_coeff=0.01", "model.seq_aux_loss_coeff=1.0", "model.z_loss_coeff=0.001",
                 "model.bias_update_rate=0.001", "model.layers=2"]
# The must-show layouts, each at 4 CPU ranks (the default tiny.toml, tiny-moe.toml for MoE).
CONFIGS = {
    "tp2-dp2-sp": (None, ["parallel.tp=2", "model.layers=2"]),
    "pp2-dp2-zb-v-uneven": (None, ["parallel.pp=2", "parallel.schedule=zb-v", "model.layers=6",
                                   "parallel.first_stage_layers=2", "train.global_batch=4"]),
    "cp2-dp2-ring": (None, ["parallel.cp=2", "parallel.cp_comm_type=p2p", "model.layers=2"]),
    "cp2-dp2-a2a": (None, ["parallel.cp=2", "parallel.cp_comm_type=a2a", "model.layers=2"]),
    "tp2-ep2-moe": ("tiny-moe", ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"] + MOE_BALANCING),
    # without SP each tp rank routes its 1/tp of the tokens (issue 53: experts' gradients were 2x)
    "tp2-ep2-moe-nosp": ("tiny-moe", ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1",
                                      "parallel.sequence_parallel=false"] + MOE_BALANCING),
    "dp4-zero2": (None, ["parallel.zero=optim_grads", "model.layers=2"]),
    "dp4-zero3": (None, ["parallel.zero=optim_grads_params", "model.layers=2"]),
    "pp2-dp2-zb-v-mla-mtp": (None, MLA_MTP + ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.first_stage_layers=2", "train.global_batch=4"]),
}

# gpt-oss (its window past 128 of 160 tokens, sinks, biased experts): the opt-in tier, one case a layout.
# pp2 without the balancing loss: it is per micro-batch, and certify's reference does not take the
# pipeline's micro-batches (with it on, the router's bias gradient differed by 8e-5 at stage 1)
GPT_OSS = ["model.attention=gpt_oss", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.kv_channels=16",
           "model.moe_layers_start=0", "model.shared_experts=0", "model.num_experts=4", "model.top_k=2",
           "model.moe_ffn_hidden=32", "model.norm_topk_prob=true", "train.seq_len=160"]
GPT_OSS_CONFIGS = {"gpt-oss-" + name: ("tiny-moe", GPT_OSS + layout) for name, layout in {
    "tp2-dp2-sp": ["parallel.tp=2", "parallel.etp=1"], "cp2-dp2-ring": ["parallel.cp=2"],
    "cp2-dp2-a2a": ["parallel.cp=2", "parallel.cp_comm_type=a2a"], "ep2-dp2": ["parallel.ep=2"],
    "pp2-dp2": ["parallel.pp=2", "model.aux_loss_coeff=0.0"], "dp4-zero3": ["parallel.zero=optim_grads_params"]}.items()}

# Qwen3-Next (Gated DeltaNet + gated attention), dense and MoE (its gated shared expert), narrowed as certify does
QWEN3_NEXT = ["model.attention=qwen3_next", "model.full_attention_interval=2", "model.partial_rotary_factor=0.5",
              "model.heads=4", "model.kv_heads=2", "model.linear_key_heads=2", "model.linear_value_heads=4",
              "model.layers=4"]
QWEN3_NEXT_CONFIGS = {  # opt-in, as its layout tests: the default tier has its narrowing and fp64 twin below
    "qwen3-next-tp2-dp2-sp": (None, QWEN3_NEXT + ["parallel.tp=2"]),
    "qwen3-next-moe-ep2-dp2": ("tiny-moe", QWEN3_NEXT + ["parallel.ep=2", "model.moe_layers_start=0",
                                                        "model.num_experts=4", "model.bias_update_rate=0.001"]),
    # the linear layers' state pass (p2p, cp 2 and 4), their key heads over the ranks (a2a), pp, ZeRO-3, and
    # packed documents (the embedded data's) resetting the state and the conv at each start under cp
    "qwen3-next-cp2-dp2-p2p": (None, QWEN3_NEXT + ["parallel.cp=2", "parallel.cp_comm_type=p2p"]),
    "qwen3-next-cp2-dp2-a2a": (None, QWEN3_NEXT + ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
    "qwen3-next-cp4-p2p": (None, QWEN3_NEXT + ["parallel.cp=4"]),
    "qwen3-next-pp2-dp2": (None, QWEN3_NEXT + ["parallel.pp=2"]),
    "qwen3-next-dp4-zero3": (None, QWEN3_NEXT + ["parallel.zero=optim_grads_params"]),
    "qwen3-next-cp2-dp2-packed": (None, QWEN3_NEXT + ["parallel.cp=2", "data.document_mask=true",
                                                      "data.reset_position_ids=true", "data.eod_mask_loss=true"]),
}


# The one-rank reference's directory by what it runs (its resolved config: every degree 1, the layout's
# global micro-batch; the vocabulary ids its batches hold; the steps): the layouts with the same reference
# (cp, dp and ZeRO ones of one model) compare with one run of it. A layout's ranks only read it.
_REFERENCES: dict = {}


def certify(dist_run, tmp_path, config, overrides, world=4, steps=2, bug=None):
    from pretrain.certify.coverage import edge_ids
    from pretrain.certify.narrow import narrowed_overrides, reference_overrides
    from pretrain.certify.ranks import run_reference
    from pretrain.certify.verdict import MARGIN, verdict_line
    from pretrain.config import load_config

    import certify_ranks

    start = time.time()
    ov = narrowed_overrides(config, overrides, world)
    cfg = load_config(config, ov)
    layout = cfg.validate_world(world)
    ids = edge_ids(cfg.model, layout.tp)
    ref_ov = ov + reference_overrides(cfg, layout)
    key = (repr(load_config(config, ref_ov)), tuple(ids), steps)
    if key not in _REFERENCES:  # (a test's tmp_path lasts the session)
        dist_run(1, run_reference, config, ref_ov, steps, str(tmp_path), ids, timeout=600)
        _REFERENCES[key] = str(tmp_path)
    work = _REFERENCES[key]
    t_ref = time.time() - start
    records = dist_run(world, certify_ranks.layout_with_bug, bug, config, ov, steps, work, MARGIN, ids,
                       timeout=600)[0]
    line, code = verdict_line(records, "layout")
    print(f"{line} [reference {t_ref:.1f} s, total {time.time() - start:.1f} s]")
    return records, line, code


@pytest.mark.parametrize("name", list(CONFIGS) + [pytest.param(n, marks=[pytest.mark.extended, pytest.mark.timeout(600)])
                                                  for n in [*QWEN3_NEXT_CONFIGS, *GPT_OSS_CONFIGS]])
def test_correct_layout_certifies_at_4_ranks(dist_run, tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    config, overrides = (CONFIGS | QWEN3_NEXT_CONFIGS | GPT_OSS_CONFIGS)[name]
    records, line, code = certify(dist_run, tmp_path, config, overrides)
    assert all(r["tensors_compared"]["outputs"] and r["tensors_compared"]["gradients"] for r in records)
    assert code == 0, line


def test_narrowing_keeps_a_hybrids_layer_kinds_and_narrows_its_widths():
    """Qwen3-Next-80B narrowed for 4 ranks: one whole repeat of its layer kinds (three linear layers and a
    full-attention one, not two linear layers alone), 8 channels a head in both kinds of layer."""
    from pretrain.certify.narrow import narrowed_overrides
    from pretrain.config import load_config
    from pretrain.models.qwen3_next.pattern import is_full_attention

    layout = ["parallel.pp=2", "parallel.ep=2", "train.global_batch=8", "train.micro_batch=1"]
    m = load_config("qwen3-next-80b-a3b", narrowed_overrides("qwen3-next-80b-a3b", layout, 4)).model
    assert m.layers == 4 and [is_full_attention(m, i) for i in range(4)] == [False, False, False, True]
    assert (m.hidden, m.head_dim, m.linear_key_dim, m.linear_value_dim, m.moe_ffn_hidden) == (128, 8, 8, 8, 128)
    assert (m.num_experts, m.top_k, m.linear_key_heads, m.linear_value_heads) == (512, 10, 16, 32)


def test_fp64_twin_keeps_new_tensors_asked_in_fp32_in_fp64():
    """The Gated DeltaNet's rule makes its states with ``new_zeros(..., dtype=torch.float32)``: in the fp64
    twin they stay fp64, as ``float()`` and ``to(torch.float32)`` do (else fp32 meets fp64 in a matmul)."""
    import torch

    from pretrain.certify.fp64 import fp64_compute

    x, y = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.bfloat16)
    with fp64_compute():
        made = [getattr(x, name)(*args, dtype=torch.float32) for name, args in
                (("new_zeros", (3,)), ("new_ones", (3,)), ("new_empty", (3,)), ("new_full", ((3,), 1.0)))]
        assert all(t.dtype == torch.float64 for t in made) and y.new_zeros(3, dtype=torch.float32).dtype == torch.float32
    assert x.new_zeros(3, dtype=torch.float32).dtype == torch.float32  # and only while open


# par's FP8 ([train].fp8): the operands are the single rank's bytes, so the layout certifies like fp32 does
FP8 = {
    "tp2-dp2-sp-rowwise": (None, ["parallel.tp=2", "model.layers=2", "train.fp8=rowwise"]),
    "cp2-dp2-tensorwise": (None, ["parallel.cp=2", "model.layers=2", "train.fp8=tensorwise"]),
}


@pytest.mark.extended  # repeats the certify proof with FP8 GEMMs (tests/test_layouts_fp8.py has the default tier's)
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_layout_certifies_at_4_ranks(dist_run, tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    config, overrides = FP8[name]
    records, line, code = certify(dist_run, tmp_path, config, overrides)
    assert code == 0, line


# One planted bug per parallel dimension: (layout, bug, what the named module must contain, dimension).
BUGS = {
    "tp_norm_partial_grads_not_summed": ("tp2-dp2-sp", "norm", "tp"),
    "vocab_padding_not_masked": ("tp2-dp2-sp", "logits", "tp"),
    "ep_permutation_off_by_one": ("tp2-ep2-moe", "mlp", "ep"),
    "mtp_target_shifted": ("pp2-dp2-zb-v-mla-mtp", "model.layers.6.", "pp"),  # MTP layer 0 = layers.6 (HF)
    "sp_reduce_scatter_missing": ("tp2-dp2-sp", "layers.0.self_attn.wo", "tp"),  # the first SP row layer to run
    "pp_stale_activation": ("pp2-dp2-zb-v-uneven", "layers.1.", "pp stage 1"),  # chunk 1's first layer
    "cp_causal_offset_wrong": ("cp2-dp2-ring", "layers.0.self_attn.core", "cp"),
    # dp rank 0's shard of the first bucket reduced (the last layers') holds lm_head, first in backward order
    "zero2_shard_reduced_twice": ("dp4-zero2", "lm_head", "dp"),
    "router_picks_next_expert": ("tp2-ep2-moe", "layers.1.mlp", "ep"),  # routing counted on both sides
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_not_certified_and_named(dist_run, tmp_path, monkeypatch, bug):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    layout, module, dimension = BUGS[bug]
    config, overrides = CONFIGS[layout]
    records, line, code = certify(dist_run, tmp_path, config, overrides, bug=bug)
    assert code == 3, line
    first = next(r for r in records if not r["certified"])["first_divergence"]
    assert first is not None, line
    assert module in first["module"] and first["dimension"].startswith(dimension), line


def _certify(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pretrain", "certify", *args], capture_output=True, text=True)


CLI_CERTIFY = ("--steps", "2", "--set", "parallel.tp=2", "--set", "model.layers=2")


@pytest.mark.timeout(300)  # a whole certify in its own process
def test_cli_certifies_and_writes_the_report(tmp_path):
    """The command itself: one verdict line, exit 0, the JSON report per step; bad input is one error line, exit 2."""
    import json

    out = tmp_path / "c"
    p = _certify("--nproc", "4", *CLI_CERTIFY, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("certified: tp=2 cp=1 pp=1 dp=2"), p.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["certified"] and len(report["steps"]) == 2
    for key in ("loss", "grad_norm", "loss_difference", "loss_band", "grad_norm_difference", "grad_norm_band"):
        assert key in report["steps"][0]
    bad = _certify("--nproc", "4", "--set", "parallel.tp=3", "--out", str(out))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.extended  # the launcher's own certify above makes the proof; this is the same under torchrun
@pytest.mark.timeout(600)
def test_torchrun_certifies_as_the_launcher_does(tmp_path):
    """Under torchrun: the same verdict line and the same report as `certify --nproc 4` (that one in this
    process: its ranks fork from a forkserver that imported torch once, no new interpreter imports it again)."""
    import json
    import subprocess
    import sys

    from typer.testing import CliRunner

    from pretrain.cli import app

    p = CliRunner().invoke(app, ["certify", "--nproc", "4", *CLI_CERTIFY, "--out", str(tmp_path / "c")])
    assert p.exit_code == 0, p.output
    t = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "pretrain", "certify",
                        *CLI_CERTIFY, "--out", str(tmp_path / "t")], capture_output=True, text=True)
    assert t.returncode == 0, t.stderr[-2000:]
    assert t.stdout.split(" [report")[0] == p.stdout.split(" [report")[0]
    assert json.loads((tmp_path / "t" / "report.json").read_text()) == json.loads((tmp_path / "c" / "report.json").read_text())


@pytest.mark.timeout(300)  # alone, it starts the harness's ranks
def test_a_bug_at_a_vocabulary_shard_edge_is_not_certified(dist_run, tmp_path, monkeypatch):
    """Every TP vocabulary shard's first and last id is in certify's batches: the last id of each shard
    (255 at tp=2: a byte the embedded text never holds) looked up wrong is found, at the embedding, tp."""
    from pretrain.certify.coverage import edge_ids
    from pretrain.config import load_config
    from pretrain.data import build_sampler, load_dataset

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    overrides = ["parallel.tp=2", "model.layers=2"]
    cfg = load_config(None, ["model.layers=2"])  # one rank: its batch is the whole step's
    natural = build_sampler(cfg, cfg.validate_world(1), 0, load_dataset(cfg.data, cfg.model.vocab_size)).train_batch(0)
    assert 255 in edge_ids(cfg.model, 2) and not (natural.tokens == 255).any()  # the data alone never shows the bug
    records, line, code = certify(dist_run, tmp_path, None, overrides, world=2, steps=1, bug="embedding_shard_edge")
    assert code == 3, line
    first = records[0]["first_divergence"]
    assert "embed" in first["module"] and first["dimension"] == "tp", line
