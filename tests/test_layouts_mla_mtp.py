"""DeepSeek-V3's pieces train the same model under every layout: multi-head latent attention (MLA)
and multi-token prediction (MTP), 10 fp32 steps, loss and global grad norm equal to the single-rank
run at 1e-6 (the tolerance of test_layouts_train_same_model). Also: the single-rank MLA + MTP model
equals the plain-PyTorch reference (loss and every gradient); MLA's TP communication is what the
latent widths predict; MLA's parameter count is DeepSeek's formula; `plan deepseek-v3` gives the
published totals; bad MLA/MTP input is one line."""


import dataclasses

import pytest
import torch

import layout_runs

STEPS = 10
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false"]
# fp32: layouts differ by rounding only, at most 8.0e-7 over these 10 steps (`pytest -s` prints
# each), except step 8 of tp2-pp2-1f1b at 1.25e-6, where the single rank moves by 6.2e-7 when only its
# micro-batching changes: such a step is judged against that noise (layout_runs.rounding_noise)
RTOL = 1e-6


def train_losses(config, overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config(config, COMMON + list(overrides)))
    results = [trainer.train_step(step) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results]


def _check(result, reference, name, noise=None):
    layout_runs.assert_close_steps(result, reference, RTOL, name, noise, steps=STEPS)

MLA = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.layers=6",
       "model.mtp_depth=1", "model.mtp_loss_weight=0.5"]
LAYOUTS = {
    # SP's exit reduce-scatters as rings under o_proj and the head (tp_comm_overlap), rerun by recompute
    "tp2-dp2-sp-overlap-recompute-full": ["parallel.tp=2", "model.recompute=full", "parallel.tp_comm_overlap=true"],
    # ZeRO-3 with MTP: MTP calls its layer's parts one by one, so each is a gather unit of its own;
    # at pp=1 MTP's embedding is the input embedding's unit
    "dp4-zero3": ["parallel.zero=optim_grads_params"],
    "cp2-dp2-p2p-recompute-selective": ["parallel.cp=2", "model.recompute=selective"],
    "cp2-tp2-a2a-no-sp": ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm_type=a2a",
                          "parallel.sequence_parallel=false"],
    "pp2-dp2-dualpipev-uneven": ["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.first_stage_layers=2",
                                 "parallel.last_stage_layers=4"],
}
# MTP under non-V schedules: the last stage keeps a copy of the input embedding, summed over the
# embedding group (build.py's _share_embedding_); 4 micro-batches keep the message count small
MTP_PP = {
    "pp2-dp2-1f1b-zero2": ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4", "parallel.zero=optim_grads"],
    "pp2-dp2-1f1b-zero3": ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4", "parallel.zero=optim_grads_params"],
    "tp2-pp2-1f1b": ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"],
    # tied head: on the last stage it is that same embedding copy (its grad adds the head's and MTP's)
    "tp2-pp2-1f1b-tied": ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4",
                          "model.tie_embeddings=true"],
}
MOE = ["model.aux_loss_coeff=0.0", "model.seq_aux_loss_coeff=0.01", "model.bias_update_rate=0.001",
       "model.score_func=sigmoid", "model.n_groups=2", "model.topk_groups=1", "model.moe_layers_start=1"]


def single_rank(dist_run, config, overrides):
    """The 1-rank run of :func:`train_losses`, once per session (layout_runs' cache)."""
    return layout_runs.single_rank(dist_run, config, overrides, fn=train_losses)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_mtp_layout_matches_single_rank(dist_run, name):
    for result in dist_run(4, train_losses, None, MLA + LAYOUTS[name], timeout=600):
        _check(result, single_rank(dist_run, None, tuple(MLA)), name,
               layout_runs.deferred_noise(dist_run, None, MLA, train_losses))


def mtp_pp_job(overrides):
    """Losses and grad norms of the run, and whether the embedding's two copies stayed bitwise equal."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config(None, COMMON + list(overrides)))
    results = [trainer.train_step(step) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results], _embedding_copies_equal(trainer)


def _embedding_copies_equal(trainer) -> bool:
    """Whether the input embedding on the first stage and its copy on the last are bitwise equal."""
    import torch.distributed as dist

    g, chunks, last = trainer.model.groups, trainer.model.chunks, trainer.model.num_chunks - 1
    copy = chunks[0].embed_tokens if 0 in chunks else chunks[last].shared_embedding
    # the fp32 master values this rank's optimizer owns (both stages shard the copies alike)
    mine = torch.cat([t.reshape(-1) for _, t in trainer.model.dp.owned_pieces()[copy.weight].boxes])
    theirs = mine.clone()
    dist.broadcast(theirs, dist.get_global_rank(g.embedding, 0), group=g.embedding)
    return bool(theirs.equal(mine))


def mtp_checkpoint_job(root, model):
    """Train 2 steps under pp2-1f1b, save; load under pp1 and save again; load that under pp2.
    ``model``: extra [model] overrides (tied embeddings)."""
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint.full_model import read_full_tensors
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    def trainer(layout):
        return Trainer(load_config(None, COMMON + MLA + model + layout))

    pp2, out = MTP_PP["pp2-dp2-1f1b-zero2"], {}
    t = trainer(pp2)
    for step in range(2):
        t.train_step(step)
    t.save_checkpoint(f"{root}/pp2", 2)
    for name, layout, src in (("pp1", [], "pp2"), ("pp2-again", pp2, "pp1")):
        t = trainer(layout)
        t.load_checkpoint(latest_checkpoint(f"{root}/{src}"))
        t.save_checkpoint(f"{root}/{name}", 2)
        for prefix in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
            a, b = (read_full_tensors(latest_checkpoint(f"{root}/{d}"), prefix) for d in (src, name))
            out[name, prefix] = sorted(a) == sorted(b) and len(a) > 0 and all(a[k].equal(b[k]) for k in a)
    out["copies equal after load"] = _embedding_copies_equal(t)
    return out


@pytest.mark.parametrize("model", [[], ["model.tie_embeddings=true"]], ids=["untied", "tied"])
def test_mtp_checkpoint_pp2_1f1b_to_pp1_and_back_keeps_every_tensor(dist_run, tmp_path, model):
    for rank, out in enumerate(dist_run(4, mtp_checkpoint_job, str(tmp_path), model, timeout=600)):
        assert all(out.values()), (rank, out)


# tp2-pp2 untied in the extended tier: zero2 / zero3 prove MTP over untied stages, the tied case tp2 x pp2
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n == "tp2-pp2-1f1b" else n
                                  for n in MTP_PP])
def test_mtp_under_1f1b_keeps_the_embedding_copies_equal_and_matches_single_rank(dist_run, name):
    model = [o for o in MTP_PP[name] if o.startswith("model.")]
    for losses, norms, copies_equal in dist_run(4, mtp_pp_job, MLA + MTP_PP[name], timeout=600):
        reference = tuple(MLA + model)
        _check((losses, norms), single_rank(dist_run, None, reference), name,
               layout_runs.deferred_noise(dist_run, None, reference, train_losses))
        assert copies_equal, f"{name}: the embedding on the first and last stage differ after training"


def test_mla_mtp_moe_ep2_matches_single_rank(dist_run):
    overrides = MLA + MOE
    for result in dist_run(4, train_losses, "tiny-moe", overrides + ["parallel.ep=2"], timeout=600):
        _check(result, single_rank(dist_run, "tiny-moe", tuple(overrides)), "mla-mtp-moe-ep2")


def matches_reference_job():
    """One rank: the trainer's loss (with MTP's gradient) and every gradient equal plain PyTorch's.
    The reference (tests/plain_llama.py) shares only the initial weights and the batch: its MLA,
    interleaved RoPE with YaRN, softmax scale, MTP streams and MTP loss are written out there."""
    import torch.nn.functional as F

    from plain_llama import build_plain
    from pretrain.config import load_config

    # depth 2: the second module reads the first's hidden state and t[i+2], and the loss weight is split
    cfg = load_config(None, MLA + ["train.global_batch=2", "model.mtp_depth=2", 'model.rope_scaling={rope_type = "yarn", '
                                   'factor = 4.0, original_max_position_embeddings = 16, mscale = 1.0, mscale_all_dim = 1.0}'])
    trainer, chunk, grads, batch = layout_runs.one_rank_first_batch(cfg)
    inputs, labels = batch.inputs, batch.labels
    loss = trainer.loss(chunk(inputs[0]), labels[0], batch)
    loss.backward()
    ref = build_plain(cfg.model, cfg.train.seed)
    logits, _ = ref(inputs[0])
    want = F.cross_entropy(logits.flatten(0, 1), labels[0][..., 0].flatten())
    (want + ref.mtp_loss(inputs[0], labels[0][..., 0])).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = layout_runs.worst_grad_error(grads, ref_grads)  # one rank: the whole tensor
    return loss.item(), want.item(), worst, len(grads), len(ref_grads)


def test_single_rank_mla_mtp_equals_plain_pytorch(dist_run):
    loss, want, worst, n, n_ref = dist_run(1, matches_reference_job)[0]
    assert n == n_ref
    assert abs(loss - want) <= 1e-6 * want
    assert worst <= 1e-5, worst


def comm_job(sp):
    import torch.distributed as dist

    from par_groups import RankGrid, comm, create_groups
    from pretrain.config import load_config
    from pretrain.blocks.context import ChunkContext, context_attention
    from pretrain.models.deepseek.mla import ContextMLACore, TPMLAttention

    a = load_config(None, MLA).model
    g = create_groups(RankGrid(dist.get_world_size(), tp=2))
    layout = ChunkContext(g, sp, "p2p", 8, "none")
    attn = TPMLAttention(a, g.tp, sp, ContextMLACore(a, context_attention(layout), 8, False))
    s, b = 8, 2
    x = torch.randn(s // (2 if sp else 1), b, a.hidden, requires_grad=True)
    with comm.CommRecorder() as rec:
        attn(x).sum().backward()
    return [(r.op, r.bytes) for r in rec.records]


@pytest.mark.parametrize("sp", [True, False])
def test_mla_tp_communication_is_the_latent_and_the_output(dist_run, sp):
    """Forward: the latents [cq | ckv | k_rope] enter the TP region in one collective (all-gather with
    SP, a copy without), o_proj leaves it (reduce-scatter / all-reduce of hidden); backward the duals."""
    s, b, h, latent, fp32 = 8, 2, 64, 32 + 16 + 4, 4
    if sp:
        want = sorted([("all_gather", s * b * latent * fp32), ("reduce_scatter", s * b * h * fp32),
                       ("all_gather", s * b * h * fp32), ("reduce_scatter", s * b * latent * fp32)])
    else:
        want = sorted([("all_reduce", s * b * h * fp32), ("all_reduce", s * b * latent * fp32)])
    for got in dist_run(2, comm_job, sp):
        assert sorted(got) == want


def test_mla_params_per_layer_is_deepseeks_formula():
    """The sizing's count of a layer's attention (its MLA and the layer's two norms) is DeepSeek's formula."""
    from pretrain.config import load_config
    from plain_llama import MLA as PlainMLA
    from pretrain.sizing.params import layer_parts

    def mla_params(model):
        return layer_parts(model, 0)["attention"] - 2 * model.hidden

    h, n, rq, rkv, dn, dr, dv = 7168, 128, 1536, 512, 128, 64, 128
    formula = h * rq + rq + rq * n * (dn + dr) + h * (rkv + dr) + rkv + rkv * n * (dn + dv) + n * dv * h
    assert mla_params(load_config("deepseek-v3").model) == formula == 187_107_328
    tiny = load_config(None, MLA).model
    assert mla_params(tiny) == sum(p.numel() for p in PlainMLA(tiny).parameters())


def test_plan_deepseek_v3_gives_the_published_totals():
    from pretrain.config import load_config
    from pretrain.sizing.flops import mtp_params, param_counts

    cfg = load_config("deepseek-v3")
    c = param_counts(cfg.model)
    assert abs(c.total - 671e9) <= 0.01 * 671e9, c.total
    # 36.63B: top-8 experts and one embedding row; published "37B" (-1.01%); whole table: 37.55B
    assert round(c.active / 1e9) == 37 and abs(c.active - 37e9) <= 0.0102 * 37e9, c.active
    assert cfg.model.mtp_depth == 1 and mtp_params(cfg.model) > 11e9  # the report's D = 1, on pp 16 x 1F1B
    # the same count gives DeepSeek-V2's published 236B total / 21B active (20.85B; whole table 21.38B)
    v2 = dataclasses.replace(cfg.model, vocab_size=102400, hidden=5120, layers=60, ffn_hidden=12288,
                             moe_layers_start=1, num_experts=160, top_k=6, moe_ffn_hidden=1536,
                             shared_experts=2, max_route_nodes=3, topk_groups=1, mtp_depth=0)
    c2 = param_counts(v2)
    assert round(c2.total / 1e9) == 236 and round(c2.active / 1e9) == 21, (c2.total, c2.active)
    assert c2.active == c2.total - 59 * 154 * 3 * 5120 * 1536 - 102399 * 5120  # 154 experts idle, 1 row read


@pytest.mark.parametrize("overrides,needle", [
    (MLA + ["model.qk_rope_head_dim=5"], "qk_rope_head_dim=5 must be even"),
    (MLA + ["model.kv_lora_rank=0"], "kv_lora_rank=0 must be >= 1 with attention='mla'"),
    (MLA + ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.first_stage_layers=2", "parallel.last_stage_layers=2"],
     "must add up"),
])
def test_bad_mla_mtp_input_is_one_line_exit_2(overrides, needle):
    from typer.testing import CliRunner

    from pretrain.cli import app

    args = ["plan", "--world", "2"] + [a for o in overrides for a in ("--set", o)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
