"""Any layout trains the same model in FP8: 20 fp32-master steps with par's FP8 GEMMs (``[train].fp8``)
under a layout against the single rank's FP8 run.

The GEMM operands are the same bytes under every layout (packages/par-tp/tests/test_fp8_bytes.py); what a
layout changes is the fp32 accumulation order (a row-parallel sum split over tp, CP's attention merges), as
in fp32 (tests/test_layouts_train_same_model.py). FP8 amplifies that: an fp32 last-bit difference that
moves a value across an FP8 rounding boundary moves it by a whole FP8 step, and from then on the runs
drift apart as two chaotic trajectories do (a step-0 loss already differs by 1.0e-6 under blockwise tp2,
a step-1 loss by 1.6e-5 under MXFP8 tp2). Measured (rowwise, tp2 x cp2, micro-batches of 2): 9.7e-5 in the
loss and 7.1e-3 in the grad norm by step 20, while the single rank itself, with only its attention kernel
changed (``attention_backend=torch``: the same math, other fp32 rounding) or its micro-batches, drifts by
1.9e-4 and 2.6e-2. So the
rule, the suite's rounding-noise clause for FP8: over the 20 steps, no more than NOISE_MARGIN x the single
rank's own largest drift under a rounding change (that attention kernel, or micro-batches of 4 sequences
instead of the runs' 2, layout_runs.noise_micro_batches). That envelope is loose (one rounding change may flip no FP8
value in 20 steps, another many); the bytes tests are the proof that the operands are the same.

That drift is the model's as much as the rounding's: at some steps a tiny model's grad norm is a small
difference of large terms, where one flipped FP8 value moves it by percents. DeepSeek-V3's MLA + MTP at 6
layers has such steps (measured, rowwise, one rank: micro-batches of 4 instead of 2 move step 10's grad
norm by 14 %, and FP8 off moves step 5's by 25 %), so the maximum over 20 steps is one sensitive step's,
and 4x of it would accept a wrong layout at every other step. The single rank's drift must therefore lie
within MEANINGFUL (up to 1e-1 in the grad norm; every case's here is below 5e-2) and above 0 (a rounding change that
changes nothing measures nothing); MLA + MTP is compared at 2 layers (measured drift 4.6e-4 / 1.7e-2), and
its operands bytewise under pp2 (tests/test_fp8_bytes_pipeline.py). The same held of the blockwise case's
4x wider model at the tiny model's learning rate: its own drift was 40 % in the grad norm (4x of it passed
anything); it trains at a width-scaled one.

The 20-step runs are in the extended tier (each is seconds of 4 ranks); the default tier checks the
wiring (which scale groups each linear gets: what the bytes tests prove right), which
catches a linear left without its tp reduction, as the 20-step comparison alone would not (that drift hides
in the rounding noise). Blockwise needs 128-wide local
dims: its model is wider (hidden 256, 8 kv heads: 128 per tp rank).
"""

import os

import pytest

from layout_runs import NOISE_MARGIN, STEPS, max_errors, noise_micro_batches, single_rank

TWO_LAYERS = ("model.layers=2",)
# 128 per tp rank; at the tiny model's learning rate the 4x wider model spikes (its own drift 40 % in the
# grad norm, 3.7 % in the loss: no tolerance), at a width-scaled one it trains calmly (2.7e-3)
WIDE = ("model.hidden=256", "model.heads=8", "model.kv_heads=8", "model.ffn_hidden=256", "train.lr=5e-4",
        "train.min_lr=5e-5")
# the balancing loss counts over the global micro-batch (every dp rank's), FP8 scales over one dp rank's: a
# single rank can take the dp ranks' micro-batches for one or the other, so the MoE runs leave the loss out
MOE = ("model.aux_loss_coeff=0",)
MX = ("model.kv_heads=8",)  # 8 x 8 / tp2 = 32: one MXFP8 block per tp rank
# DeepSeek-V3's attention and multi-token prediction (tests/test_layouts_mla_mtp.py's model): MLA's
# down-projections and MTP's eh_proj are replicated nn.Linears, their tokens reduced over tp under SP
MLA_MTP = ("model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.mtp_depth=1",
           "model.mtp_loss_weight=0.5")

# the largest own drift (loss, grad norm) of the single rank that still makes a tolerance (module docstring);
# measured, every case's lies within 4.7e-4 / 4.7e-2 (the MoE's grad norm)
MEANINGFUL = (2e-3, 1e-1)

LAYOUT_ONLY = ("train.fp8_param_gather",)  # train keys of the layout, not of the single rank's run

DEFAULT = {"rowwise-tp2-cp2": ("rowwise", ["parallel.tp=2", "parallel.cp=2"], ())}
EXTENDED = {
    "tensorwise-tp2-cp2": ("tensorwise", ["parallel.tp=2", "parallel.cp=2"], ()),
    "tensorwise-dp2-zero3-tp2": ("tensorwise", ["parallel.tp=2", "parallel.zero=optim_grads_params"], ()),
    # ZeRO-3's FP8 parameter gather (tests/test_fp8_param_gather_trainer.py: bitwise the run without it)
    "tensorwise-dp4-zero3-fp8-gather": ("tensorwise", ["parallel.zero=optim_grads_params", "train.fp8_param_gather=true"], ()),
    "rowwise-pp2-dp2": ("rowwise", ["parallel.pp=2", "parallel.schedule=1f1b"], ()),
    "blockwise-tp2-dp2-sp": ("blockwise", ["parallel.tp=2"], WIDE),
    "mxfp8-tp2-dp2-sp": ("mxfp8", ["parallel.tp=2"], MX),
    "mxfp8-cp2-dp2": ("mxfp8", ["parallel.cp=2", "train.seq_len=64", "train.micro_batch=2"], MX),
    # more of the layout matrix: HSDP, recompute, interleaved and zero-bubble pipelines
    "tensorwise-hsdp2x2": ("tensorwise", ["parallel.zero=optim_grads_params", "parallel.hsdp_replicas=2"], ()),
    "tensorwise-tp2-dp2-recompute-full": ("tensorwise", ["parallel.tp=2", "model.recompute=full"], ()),
    "rowwise-pp2-dp2-interleaved-vpp2": ("rowwise", ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"],
                                         ("model.layers=4",)),
    "rowwise-pp2-dp2-zb-v": ("rowwise", ["parallel.pp=2", "parallel.schedule=zb-v"], ("model.layers=4",)),
    # CP by all-to-all: its linears take the same zigzag chunks as the ring's (the bytes tests' cp2)
    "rowwise-cp2-a2a-dp2": ("rowwise", ["parallel.cp=2", "parallel.cp_comm_type=a2a"], ()),
    # the experts' grouped GEMMs in FP8 too, each source rank's rows apart (tests/test_fp8_experts.py)
    "rowwise-moe-ep2-dp4": ("rowwise", ["parallel.ep=2"], MOE, "tiny-moe"),
    "blockwise-moe-ep2-dp4": ("blockwise", ["parallel.ep=2"], MOE, "tiny-moe"),
    # the rest of the layout matrix (tests/test_layouts_train_same_model.py): tp4, hierarchical CP, the
    # DualPipeV schedule under ZeRO-3, torch's FSDP2, and MLA + MTP under tp2 with SP
    "rowwise-tp4": ("rowwise", ["parallel.tp=4"], ()),
    "tensorwise-cp4-a2a+p2p-hcp2x2": ("tensorwise", ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p",
                                                     "parallel.hcp=[2,2]"], ()),
    "rowwise-pp2-dp2-dualpipev-zero3": ("rowwise", ["parallel.pp=2", "parallel.schedule=dualpipev",
                                                    "parallel.zero=optim_grads_params"], ("model.layers=4",)),
    "tensorwise-dp4-torch_fsdp2": ("tensorwise", ["parallel.zero=torch_fsdp2"], ()),
    "rowwise-mla-mtp-tp2-dp2-sp": ("rowwise", ["parallel.tp=2"], MLA_MTP),
}


def train_and_wiring(config, overrides, steps: int = STEPS):
    """:func:`layout_runs.train_steps`, and for each linear of this rank's chunks whether it runs in FP8
    with the scales of the rule (tokens over cp, in_features over tp when row-parallel, out_features over
    tp when column-parallel and for the KV projections; never dp) or, the output layer, in high precision."""
    from par_tp import ColumnParallelLinear, RowParallelLinear
    from par_tp.fp8 import FP8LinearKernel
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    from layout_runs import COMMON

    trainer = Trainer(load_config(config, list(COMMON) + list(overrides)))
    g, wiring = trainer.groups, {}
    for chunk in trainer.model.chunks.values():
        for name, m in chunk.named_modules():
            if name.endswith((".wk", ".wv")):  # KV projections (nn.Linear): this rank's kv heads, rows over tp
                s = getattr(getattr(m, "fp8_kernel", None), "sharding", None)  # none with fp8 off
                wiring[name] = s is not None and s.tokens == (g.cp,) and s.in_features == () and s.out_features == (g.tp,)
                continue
            if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                continue
            kernel = m.linear_kernel
            if m is getattr(chunk, "lm_head", None):
                wiring[name] = not isinstance(kernel, FP8LinearKernel)
                continue
            row = isinstance(m, RowParallelLinear)
            s = getattr(kernel, "sharding", None)
            wiring[name] = isinstance(kernel, FP8LinearKernel) and s.tokens == (g.cp,) and \
                s.in_features == ((g.tp,) if row else ()) and s.out_features == (() if row else (g.tp,))
    results = [trainer.train_step(step) for step in range(steps)]
    return [r.loss for r in results], [r.grad_norm for r in results], wiring


def first_step(config, overrides):
    """Step 0's ([loss], [grad norm]) on every rank of a process group."""
    return train_and_wiring(config, overrides, steps=1)[:2]


def _check(dist_run, recipe, layout, model, name, config=None):
    # micro-batches of 2 sequences on every dp rank and on the single rank alike: FP8 scales are per
    # micro-batch of one dp rank (never over dp), so the single rank quantizes the same tensors only when its
    # micro-batches are the dp ranks' ones
    mb = [] if any(o.startswith("train.micro_batch") for o in layout) else ["train.micro_batch=2"]
    common = list(TWO_LAYERS) + list(model) + [f"train.fp8={recipe}"] + mb + [o for o in layout if o.startswith("train.") and not o.startswith(LAYOUT_ONLY)]
    results = dist_run(4, train_and_wiring, config, common + layout, timeout=900)
    for rank, (_, _, wiring) in enumerate(results):
        assert len(wiring) >= 5 and all(wiring.values()), (name, rank, wiring)
    reference = single_rank(dist_run, config, tuple(common))
    off = single_rank(dist_run, config, tuple(o for o in common if not o.startswith("train.fp8")), fn=first_step)
    assert off[0][0] != reference[0][0]  # FP8 is applied: already step 0 is not the high-precision run's
    variants = [("model.attention_backend=torch",)]
    if config is None:  # (MoE: a micro-batch is what the experts' scales are per, not a rounding change)
        # the other sizes than the run's own (2 is every run's here: that "variant" is the reference itself)
        own = next(o for o in reversed(common) if o.startswith("train.micro_batch="))
        variants += [(f"train.micro_batch={n}",) for n in noise_micro_batches(None, common)
                     if f"train.micro_batch={n}" != own]
    drifts = [max_errors(single_rank(dist_run, config, tuple(common) + v), reference) for v in variants]
    drift = tuple(max(d[kind] for d in drifts) for kind in (0, 1))
    # the envelope means something only between these bounds: a rounding change that moves nothing measured
    # no noise, and one that moves the grad norm by whole percents found a step where the model itself is
    # that sensitive (MEANINGFUL), where 4x of it would accept a wrong layout
    assert min(drift) > 0 and drift[0] <= MEANINGFUL[0] and drift[1] <= MEANINGFUL[1], (name, drifts)
    for rank, result in enumerate(results):
        for kind, what in enumerate(("loss", "grad norm")):
            got, want = result[kind], reference[kind]
            assert len(got) == len(want) == STEPS
        loss, norm = max_errors(result[:2], reference)
        print(f"{name} rank {rank}: max rel error loss {loss:.2e} grad norm {norm:.2e}; the single rank's own "
              f"drift under a rounding change {drift[0]:.2e} {drift[1]:.2e}")
        assert loss <= NOISE_MARGIN * drift[0] and norm <= NOISE_MARGIN * drift[1], (name, rank, loss, norm, drift)


def test_fp8_wiring(dist_run):
    """Default tier: every attention and MLP linear runs in FP8 with the rule's scale groups (the trainer's
    own tp and cp group objects in the right slots, which one rank shows as well as four), the output layer
    in high precision, and a step trains (the 20-step comparisons are extended)."""
    results = dist_run(1, train_and_wiring, None, ["model.layers=2", "train.fp8=rowwise"], steps=1, timeout=300)
    for rank, (losses, _, wiring) in enumerate(results):
        assert len(wiring) >= 5 and all(wiring.values()), (rank, wiring)
        assert 0 < losses[0] < 10


def test_fp8_on_and_off_are_distinguishable(dist_run):
    """A run with FP8 on is not the high-precision run (FP8 is applied, not only wired): every recipe's
    step-0 loss and grad norm differ from fp8=off's, and from each other's (each quantizes its own way).
    (tests/test_fp8_bytes_pipeline.py and packages/par-tp/tests/test_fp8_bytes.py show every recipe's operands.)"""
    runs = {recipe: dist_run(1, train_and_wiring, None, ["model.layers=2", f"train.fp8={recipe}"], steps=1,
                             timeout=300)[0][:2]
            for recipe in ("off", "tensorwise", "rowwise")}
    seen = [(loss[0], norm[0]) for loss, norm in runs.values()]
    assert len({loss for loss, _ in seen}) == len({norm for _, norm in seen}) == len(runs), runs


# layouts another recipe or layout already proves (rowwise-tp2-cp2, blockwise-tp2-dp2-sp; tp4's scale groups
# are tp2's rule over more ranks; the interleaved pipeline's stages quantize as 1F1B's, ZB-V's split weight
# gradients as DualPipeV's under ZeRO-3): outside
# the extended tier's time budget; PAR_FULL_MATRIX=1 runs them
REPEATS = ("tensorwise-tp2-cp2", "mxfp8-tp2-dp2-sp", "rowwise-tp4", "rowwise-pp2-dp2-interleaved-vpp2",
           "rowwise-pp2-dp2-zb-v")
_FULL = pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="a layout another recipe proves: PAR_FULL_MATRIX=1")


@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [pytest.param(n, marks=_FULL) if n in REPEATS else n
                                  for n in list(DEFAULT) + list(EXTENDED)])
def test_fp8_layout_matches_single_rank_extended(dist_run, name):
    recipe, layout, model, *config = (DEFAULT | EXTENDED)[name]
    _check(dist_run, recipe, layout, model, name, *config)
