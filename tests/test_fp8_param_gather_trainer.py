"""The trainer's ZeRO-3 with ``[train].fp8_param_gather = true`` (model/fp8_gather.py): each rank quantizes
its rows of every FP8 linear's weight and the gather moves FP8 bytes + scales instead of bf16.

- the gathered weight is bitwise the single device's quantization of the whole bf16 weight (data and
  scales, ``.view(torch.uint8)``), on each rank;
- ZeRO-3 dp2 with the key trains bitwise as ZeRO-3 dp2 without it (losses, updated weights) (whose FP8 linears quantize the bf16
  weight gathered whole), which tests/test_layouts_fp8.py compares with the single rank's FP8 run;
- the gather bytes par_groups.comm records are the formula (par_tp.fp8.gather_bytes: FP8 data + fp32
  scales, tensorwise's 4-byte amax reduction) per gather of each weight, and <= 0.52 x what the run without
  the key spends gathering the same weights in bf16.
"""

import pytest
import torch

STEPS = 2
BASE = ["model.layers=2", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
        "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.dtype=bf16",
        "parallel.zero=optim_grads_params", "train.grad_clip=0"]
WIDE = ["model.hidden=256", "model.heads=4", "model.kv_heads=4", "model.ffn_hidden=256"]  # 128-row blocks per rank


def _u8(t):
    return t.contiguous().reshape(t.shape or (1,)).view(torch.uint8)


class _Recorded:
    """A bucket's gather function, its collectives recorded apart from the run's others."""

    def __init__(self, gather, records: list):
        self.gather, self.records = gather, records

    def __call__(self, shard, group):
        from par_groups import CommRecorder

        with CommRecorder() as rec:
            q = self.gather(shard, group)
        self.records += rec.records
        return q


def gather_run(recipe: str, model: list[str], key: bool):
    import torch.distributed as dist

    from par_groups import CommRecorder
    from par_tp.fp8 import gather_bytes, quantize, RECIPES
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config("tiny", BASE + model + [f"train.fp8={recipe}", f"train.fp8_param_gather={str(key).lower()}"])
    trainer = Trainer(cfg)
    dp = trainer.model.dp
    gathered, records = dp.buffer.gathered_as, []
    for b in dp.buckets:
        if b.gather_as is not None:
            b.gather_as = _Recorded(b.gather_as, records)
    with CommRecorder() as rec:
        results = [trainer.train_step(step) for step in range(STEPS)]
    reductions = {w: 1 + sum(dist.get_world_size(g) > 1 for g in gather.amax_groups) for w, gather in gathered.items()}
    out = {"loss": [r.loss for r in results], "norm": [r.grad_norm for r in results],
           "bf16_gathers": rec.bytes_by_dtype("all_gather").get("bfloat16", 0),
           "fp8_gather_ops": [(r.op, r.dtype, r.bytes) for r in records],
           "weights": [tuple(w.shape) for w in gathered],
           "layers": sum(len(list(c.decoder_layers())) for c in trainer.model.chunks.values()),
           "formula": sum(gather_bytes(*w.shape, recipe, reductions[w]) for w in gathered)}
    out["masters"] = dp.full_parameters()
    if key:  # each weight gathered now against the single device's quantization of its bf16 values
        full = out["masters"]  # fp32 masters; the bf16 params are their rounding
        names = {p: n for n, p in trainer.model.module.named_parameters()}
        same = {}
        for b in dp.buckets:
            if b.gather_as is None:
                continue
            b.unshard()
            (w,) = b.params
            q, single = w.zero3_gathered, quantize(full[names[w]].bfloat16(), RECIPES[recipe], "weight",
                                                      across=gathered[w].amax_groups)  # tp's, as the linear
            same[names[w]] = torch.equal(_u8(q.data), _u8(single.data)) and torch.equal(_u8(q.scale), _u8(single.scale))
            b.reshard()
        out["same"] = same
    return out


@pytest.fixture(scope="module")
def tensorwise_runs(dist_run):
    return {key: dist_run(2, gather_run, "tensorwise", [], key, timeout=300) for key in (False, True)}


def _check(runs, recipe, world=2):
    off, on = runs[False], runs[True]
    for rank in range(world):
        assert on[rank]["same"] and all(on[rank]["same"].values()), (rank, on[rank]["same"])
        assert len(on[rank]["same"]) == 7 * on[rank]["layers"] > 0  # q, k, v, o, gate, up, down of its layers
        # the same training: losses and updated weights bitwise (the grad norm sums its buckets' squares in
        # another order: one bucket per gathered weight)
        assert on[rank]["loss"] == off[rank]["loss"], (on[rank]["loss"], off[rank]["loss"])
        assert on[rank]["masters"].keys() == off[rank]["masters"].keys()
        assert all(torch.equal(v, off[rank]["masters"][k]) for k, v in on[rank]["masters"].items())
        assert on[rank]["norm"] == pytest.approx(off[rank]["norm"], rel=1e-6)
        ops = on[rank]["fp8_gather_ops"]
        fp8 = sum(b for op, dtype, b in ops if dtype == "float8_e4m3fn")
        scales = sum(b for op, dtype, b in ops if op == "all_gather" and dtype == "float32")
        amax = sum(b for op, dtype, b in ops if op == "all_reduce")
        assert {op for op, _, _ in ops} <= {"all_gather", "all_reduce"}
        gathers = sum(dtype == "float8_e4m3fn" for _, dtype, _ in ops)
        per_weight = gathers // len(on[rank]["weights"])  # every weight: each forward and backward
        assert per_weight * len(on[rank]["weights"]) == gathers and per_weight >= 2 * STEPS
        assert fp8 + scales + amax == per_weight * on[rank]["formula"], (fp8, scales, amax, on[rank]["formula"])
        # what the run without the key spent gathering these weights in bf16 (its other params' gathers
        # are the run with the key's bf16 ones)
        bf16 = off[rank]["bf16_gathers"] - on[rank]["bf16_gathers"]
        assert bf16 >= per_weight * 2 * sum(r * c for r, c in on[rank]["weights"])
        print(f"{recipe} rank {rank}: FP8 gather bytes {fp8 + scales + amax} (data {fp8}, scales {scales}, amax "
              f"{amax}) for bf16's {bf16}: {(fp8 + scales + amax) / bf16:.4f}x")
        assert fp8 + scales + amax <= 0.52 * bf16, (fp8 + scales + amax, bf16)
        assert recipe != "blockwise" or scales > 0


def test_zero3_fp8_gather_tensorwise(tensorwise_runs):
    _check(tensorwise_runs, "tensorwise")


EXTENDED = {  # (recipe, world, overrides): blockwise's 128-row blocks; tp2 (the amax over tp too); HSDP
    "blockwise-dp2": ("blockwise", 2, WIDE),
    "tensorwise-tp2-dp2": ("tensorwise", 4, ["parallel.tp=2"]),
    "tensorwise-hsdp2x2": ("tensorwise", 4, ["parallel.hsdp_replicas=2", "train.global_batch=8"]),
    # the recomputed forward takes the weight its unit gathers for the backward; pipeline stages' units
    "tensorwise-dp2-recompute": ("tensorwise", 2, ["model.recompute=full"]),
    "tensorwise-pp2-dp2": ("tensorwise", 4, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "tensorwise-pp2-dp2-zb-v": ("tensorwise", 4, ["parallel.pp=2", "parallel.schedule=zb-v", "model.layers=4"]),
}


@pytest.mark.extended
@pytest.mark.parametrize("name", list(EXTENDED))
def test_zero3_fp8_gather_extended(dist_run, name):
    recipe, world, overrides = EXTENDED[name]
    runs = {key: dist_run(world, gather_run, recipe, overrides, key, timeout=300) for key in (False, True)}
    _check(runs, recipe, world)


def refused_job():
    from pretrain.config import load_config
    from pretrain.errors import UsageError
    from pretrain.training.train_loop import Trainer

    try:  # the tiny model's k_proj: 32 rows, not two 128-row blocks
        Trainer(load_config("tiny", BASE + ["train.fp8=blockwise", "train.fp8_param_gather=true"]))
    except UsageError as e:
        return str(e)
    return None


def test_blockwise_shard_of_partial_blocks_is_refused(dist_run):
    for message in dist_run(2, refused_job, timeout=120):
        assert message is not None and "fp8_param_gather=true" in message and "128-row blocks" in message, message
        assert "\n" not in message


def weight_rows_job(config, overrides):
    """On this rank: the rows of each weight the FP8 gather shards (model/fp8_gather.py, the built model)
    and the plan's closed form for them (sizing/fp8_gather_rows.py), as multisets."""
    from collections import Counter

    from pretrain.config import load_config
    from pretrain.model.fp8_gather import _fp8_weights
    from pretrain.sizing.fp8_gather_rows import fp8_weight_rows
    from pretrain.training.train_loop import Trainer

    cfg = load_config(config, ["model.layers=2", "train.fp8=tensorwise"] + overrides)
    built = Counter(w.shape[0] for c in Trainer(cfg).model.chunks.values() for _, w, _ in _fp8_weights(c))
    return built, Counter(fp8_weight_rows(cfg.model, cfg.parallel.tp).values())


MLA_MTP = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.mtp_depth=1"]
ROWS = {  # (config, overrides, world): GQA with split and unsplit KV heads, MLA + MTP, shared experts, GDN
    "gqa-tp2": ("tiny", ["parallel.tp=2"], 2),
    "gqa-tp2-one-kv-head": ("tiny", ["parallel.tp=2", "model.kv_heads=1"], 2),
    "mla-mtp-tp2": (None, ["parallel.tp=2"] + MLA_MTP, 2),
    "moe-shared-experts": ("tiny-moe", ["model.shared_experts=1", "model.moe_layers_start=1"], 1),
    "qwen3_next": ("tiny", ["model.layers=4", "model.attention=qwen3_next"], 1),
}


@pytest.mark.extended
@pytest.mark.parametrize("name", list(ROWS))
def test_plans_weight_rows_are_the_built_models_extended(dist_run, name):
    """`plan` and `--auto` refuse a layout by the rows the FP8 gather would shard (planner/costs.py,
    planner/search.py): those rows, in closed form, are the built model's on every tp rank, every weight."""
    config, overrides, world = ROWS[name]
    for built, closed in dist_run(world, weight_rows_job, config, overrides, timeout=300):
        assert built == closed and built, (name, sorted(built.items()), sorted(closed.items()))
