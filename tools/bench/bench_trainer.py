"""The whole-trainer race: pretrain's training step against torchtitan 0.3.0's on the same model,
batch and layout, CPU gloo ranks, fp32, no compile.

    uv run python tools/bench/bench_trainer.py [--layouts dp2 tp2 tp2-sp pp2] [--repeats 7] [--warmup 2]
        [--hidden 256 --layers 6 --heads 16 --kv-heads 16 --ffn 768 --vocab 2048 --seq 128 --batch 8]

The default shape is torchtitan's llama3 ``debugmodel`` flavor (dim 256, 6 layers, 16 heads, ffn
768, vocab 2048) with a CPU-sized batch (8 sequences of 128). torchtitan's ``Trainer`` cannot run
here: ``torchtitan.tools.utils`` falls back to ``device_type = "cuda"`` and ``Trainer.__init__``
calls ``torch.cuda.set_device``. So its side is torchtitan's own pieces driven by a hand loop as
its ``Trainer.train_step`` drives them: its ``Llama3Model`` (built by the debug flavor's config
code at our shape), its ``parallelize_llama`` (FSDP2 ``fully_shard`` per block on a ``dp_shard``
mesh, or its TP plan on a ``tp`` mesh) or ``pipeline_llm`` (pp), its ``cross_entropy_loss``
summed and divided by the global token count (grads summed over dp, as its trainer), its
``clip_grad_norm_``, the optimizer its trainer builds (its ``OptimizersContainer`` from
``default_adamw``: one catch-all AdamW group with ``implementation = "fused"``, its default, so
``torch.optim.AdamW(fused=True)``; its eps 1e-8; our lr, betas and weight decay, which do not
change the speed) and a warm-up + cosine LambdaLR per optimizer. Until commit 156cd2b the peer ran
the for-loop ``torch.optim.AdamW`` (2.5-4x slower than fused on these shapes): the ratios published
before then flatter us. Three changes make it run on the CPU:
``torchtitan.distributed.parallel_dims.device_type = "cpu"``; each block's inner attention is its
``ScaledDotProductAttention`` (causal: its language-model backends flex and varlen have no CPU
backward and ``attn_backend="sdpa"`` is refused, so the flavor is built with flex and swapped);
``set_force_sum_reduction_for_comms(True)`` on its FSDP modules (its divide factor of 1 is a
PREMUL_SUM, which gloo lacks; a plain SUM is the same sum). Ours: ``pretrain.training.train_loop.Trainer``'s
``train_step`` with the same shape, at its fastest on the CPU: ``train.fused_adamw=on`` (torch's
fused AdamW kernel on its flat shards instead of the explicit ops that match ``foreach=False``
bitwise, ~4x faster on a 3.3 M-element shard), no step timing (the Trainer is built without a
timer), no compile (neither side). Both sides draw a fresh batch per step (ours: its generated
byte data; theirs: ``torch.randint`` over the vocabulary).

Layouts: ``dp2`` (ours ZeRO-3 ``optim_grads_params`` vs torchtitan FSDP2), ``tp2`` (ours TP vs
its TP plan, sequence parallel off on both sides), ``tp2-sp`` (on on both; torchtitan's default),
``pp2`` (1F1B, microbatches of 2 sequences on both sides: ours ``parallel.pp=2 schedule=1f1b
train.micro_batch=2``, theirs its ``pipeline_llm`` schedule, the loss on the last stage). Both
trainers live in the same two processes; each repeat runs one step of each in alternating order
after a barrier (tools/bench/paired_timing.py), the slowest rank's time counts, the warm-up
repeats are dropped. Inits differ (each side its own): both first losses are printed next to
ln(vocab).

Prints the commit, then per layout ``RESULT trainer layout=<name> ratio= ratio_min= ratio_max=
ci95= repeats=``: the median [min, max] of the per-repeat ratios of tokens/s ours / torchtitan (above
1: ours is faster; the inverse of the step-time ratio), the median's 95 % confidence interval, both
sides' median tokens/s and losses.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ranks import add_model_arguments, launch_with_load  # noqa: E402
from commit import print_commit  # noqa: E402
from paired_timing import Summary, paired_times  # noqa: E402

LAYOUTS = {  # name: (our overrides, torchtitan's (dp_shard, tp, sequence parallel))
    "dp2": (["parallel.zero=optim_grads_params"], (2, 1, False)),
    "tp2": (["parallel.tp=2", "parallel.sequence_parallel=false"], (1, 2, False)),
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], (1, 2, True)),
    "pp2": (["parallel.pp=2", "parallel.schedule=1f1b"], (1, 1, False)),
}
PP = {"pp2": 2}  # pipeline layouts: their degree
PP_MICRO = 2  # sequences per pipeline microbatch, both sides
WORLD = 2


def our_trainer(args, layout: str, steps: int):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    cfg = load_config(None, [
        f"model.hidden={args.hidden}", f"model.layers={args.layers}", f"model.heads={args.heads}",
        f"model.kv_heads={args.kv_heads}", f"model.ffn_hidden={args.ffn}", f"model.vocab_size={args.vocab}",
        f"model.rope_theta={args.rope_theta}", "model.tie_embeddings=false",
        f"train.seq_len={args.seq}", f"train.global_batch={args.batch}",
        f"train.micro_batch={PP_MICRO if layout in PP else args.batch // dp_of(layout)}", f"train.steps={steps}", "train.warmup_steps=2",
        "train.eval_every=0", "train.dtype=fp32", "log.progress=false", "train.fused_adamw=on", *LAYOUTS[layout][0]])
    return Trainer(cfg), cfg


def dp_of(layout: str) -> int:
    return LAYOUTS[layout][1][0]


def titan_model_config(args):
    """torchtitan's llama3 debugmodel config (models/llama3/__init__.py ``_debugmodel``) with our shape."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)

    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim = args.hidden
    config = Llama3Model.Config(
        dim=dim, vocab_size=args.vocab,
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=args.vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=args.layers, dim=dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
            hidden_dim=args.ffn,
            rope=ComplexRoPE.Config(dim=dim // args.heads, max_seq_len=args.seq, theta=args.rope_theta, scaling="none"),
            attn_backend="flex"))
    for layer in config.layers:  # flex has no CPU backward; torchtitan's SDPA module (causal) has one
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


class TitanStep:
    """torchtitan's model and parallelisms, one optimizer step per call (as its Trainer.train_step).

    ``layout``: one of LAYOUTS, or ``"single"`` (one device, no parallelism: what tools/gpu/llama_1b.py
    races on one GPU). ``bf16``: its mixed precision (FSDP's param dtype; on a single device, as its
    trainer does there, torch.autocast). ``micro``: sequences per forward/backward (gradient
    accumulation as its train_step: each micro-batch's summed loss over the global token count)."""

    def __init__(self, args, layout: str, cfg, device=None, bf16: bool = False, micro: int | None = None):
        import types

        import torch
        import torchtitan.distributed.parallel_dims as parallel_dims_module

        device = torch.device(device or "cpu")
        if device.type == "cpu":
            parallel_dims_module.device_type = "cpu"  # its default is "cuda" when no accelerator is found
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("partial_dtensor")  # as its Trainer.__init__ does with parallelism.spmd_backend
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.llama3 import parallelize_llama

        dp_shard, tp, sp = LAYOUTS[layout][1] if layout != "single" else (1, 1, False)
        pp = PP.get(layout, 1)
        precision = "bfloat16" if bf16 else "float32"
        parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                                        enable_sequence_parallel=sp, spmd_backend="partial_dtensor",
                                        pipeline_parallel_degree=pp, pipeline_parallel_schedule="1F1B",
                                        pipeline_parallel_microbatch_size=PP_MICRO)
        training = TrainingConfig(local_batch_size=args.batch // dp_shard, seq_len=args.seq, dtype="float32",
                                  mixed_precision_param=precision, mixed_precision_reduce="float32")
        self.dims = ParallelDims.from_config(parallelism, dp_shard * tp * pp)
        self.dims.build_mesh()
        model_cfg = titan_model_config(args)
        model_cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
        with torch.device("meta"):
            model = model_cfg.build()
        self.pp = None
        if pp > 1:
            from torchtitan.components.loss import CrossEntropyLoss
            from torchtitan.distributed.pipeline_parallel import pipeline_llm

            loss_fn = CrossEntropyLoss.Config().build()
            self.pp, parts, self.first, self.last = pipeline_llm(
                model, parallel_dims=self.dims, training=training, parallelism=parallelism,
                compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="/tmp",
                device=device, model_config=model_cfg, parallelize_fn=parallelize_llama, loss_fn=loss_fn)
            assert len(parts) == 1
            model = parts[0]
        else:
            model = parallelize_llama(model, parallel_dims=self.dims, training=training, parallelism=parallelism,
                                      compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="/tmp")
        for m in model.modules():  # torchtitan sets a divide factor of 1 (PREMUL_SUM), which gloo lacks: plain SUM
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model, self.args, self.t, self.local_batch = model, args, cfg.train, args.batch // dp_shard
        self.device, self.micro = device, micro or self.local_batch
        self.autocast = bf16 and dp_shard == 1 and pp == 1  # its single-device / DDP mixed precision
        # the optimizer its trainer builds: its OptimizersContainer from default_adamw (one catch-all AdamW group,
        # implementation "fused", its default: torch.optim.AdamW(fused=True)), our lr, betas, weight decay
        from torchtitan.components.optimizer import default_adamw

        self.optimizer = default_adamw(lr=self.t.lr, betas=(self.t.beta1, self.t.beta2),
                                       weight_decay=self.t.weight_decay).build(model_parts=[model])
        self.fused = all(g.get("fused") for o in self.optimizer for g in o.param_groups)
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o, self._lr_factor) for o in self.optimizer]
        self.generator = torch.Generator().manual_seed(1234 + self.dims.get_mesh("fsdp").get_local_rank()
                                                       if dp_shard > 1 else 1234)
        self.losses = []

    def _lr_factor(self, step: int) -> float:
        t = self.t
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return (t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))) / t.lr

    def __call__(self) -> None:
        import torch
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.distributed.utils import clip_grad_norm_

        a = self.args
        tokens = torch.randint(0, a.vocab, (self.local_batch, a.seq + 1), generator=self.generator).to(self.device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        self.optimizer.zero_grad()
        if self.pp is not None:  # its pipeline schedule, microbatches of PP_MICRO, loss on the last stage
            n = self.local_batch // PP_MICRO
            losses = [] if self.last else None
            self.pp.step(arg_mbs=[(x,) for x in inputs.chunk(n)] if self.first else None, kwarg_mbs=[{}] * n,
                         target_mbs=list(labels.chunk(n)) if self.last else None, losses=losses,
                         loss_kwargs={"global_valid_tokens": torch.tensor(float(a.batch * a.seq))},
                         return_outputs=False)
            loss = torch.stack(losses).sum() if self.last else torch.zeros(())
            clip_grad_norm_(list(self.model.parameters()), self.t.grad_clip or math.inf, foreach=True,
                            pp_mesh=self.dims.get_mesh("pp"))
        else:
            loss = torch.zeros((), device=self.device)
            for x, y in zip(inputs.split(self.micro), labels.split(self.micro)):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    logits = self.model(x)  # SDPA: causal, no mask; positions default to 0..seq-1
                # as its trainer: summed over this rank's tokens / the global token count, the grads summed over dp
                # (its cross_entropy_loss: sum reduction; vocab-parallel on TP's Shard(-1) logits)
                part = cross_entropy_loss(logits, y) / (a.batch * a.seq)
                part.backward()
                loss = loss + part.detach()
            clip_grad_norm_(list(self.model.parameters()), self.t.grad_clip or math.inf, foreach=True)
        self.optimizer.step()
        for schedule in self.schedules:
            schedule.step()
        self.losses.append(loss.detach())


def measure(args):
    import torch
    import torch.distributed as dist

    out = {}
    for layout in args.layouts:
        steps = 2 * (args.warmup + args.repeats) + 4
        ours, cfg = our_trainer(args, layout, steps)
        try:
            theirs = TitanStep(args, layout, cfg)
        except Exception as e:  # noqa: BLE001 - reported, the other layouts still run
            out[layout] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
            continue
        our_losses, step = [], iter(range(steps))
        pairs = paired_times(lambda: our_losses.append(ours.train_step(next(step)).loss), theirs,
                             repeats=args.repeats, warmup=args.warmup)
        their_losses = [float(x) for x in theirs.losses]
        if dp_of(layout) > 1 or layout in PP:  # each dp rank's share (pp: the last stage's, 0 elsewhere) of the global mean: sum them
            t = torch.tensor(their_losses, dtype=torch.float64)
            dist.all_reduce(t)
            their_losses = t.tolist()
        out[layout] = {"pairs": pairs, "ours": our_losses, "theirs": their_losses, "fused": theirs.fused,
                       "ours_fused": ours.kernels.fused_adamw}
        del ours, theirs
        dist.barrier()
    return out


def report(args, results: dict) -> None:
    tokens = args.batch * args.seq
    print(f"shape: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads} kv, ffn {args.ffn}, "
          f"vocab {args.vocab}, seq {args.seq}, global batch {args.batch} ({tokens} tokens/step), fp32, no compile, "
          f"{WORLD} CPU gloo ranks, {args.threads} intra-op thread(s) each")
    print(f"ln(vocab) = {math.log(args.vocab):.3f} (a random init's expected first loss; inits differ per side)")
    for layout, r in results.items():
        if "error" in r:
            print(f"layout {layout}: torchtitan cannot run it on the CPU here: {r['error']}")
            continue
        speed = Summary.of([(t_peer, t_ours) for t_ours, t_peer in r["pairs"]])  # tokens/s ours / theirs
        ours_tps, theirs_tps = tokens / speed.peer_s, tokens / speed.ours_s
        fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"layout {layout}: losses ours   {fmt(r['ours'])}")
        print(f"layout {layout}: losses theirs {fmt(r['theirs'])}")
        print(f"RESULT trainer layout={layout} {speed.spread(3)} ours_tok_s={ours_tps:.0f} "
              f"torchtitan_tok_s={theirs_tps:.0f} first_loss_ours={r['ours'][0]:.3f} "
              f"first_loss_torchtitan={r['theirs'][0]:.3f} torchtitan_adamw={'fused' if r['fused'] else 'not-fused'} "
              f"ours_adamw={'fused' if r['ours_fused'] else 'explicit'} metric=tokens_per_s_higher_is_better")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    add_model_arguments(p, layers=6, heads=16, repeats=7)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    args = p.parse_args()
    print_commit()
    report(args, launch_with_load(measure, args, WORLD))


if __name__ == "__main__":
    main()
