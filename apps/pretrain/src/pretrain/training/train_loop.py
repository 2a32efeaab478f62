# Over 300 lines on purpose: the Trainer is the one step every layout shares; its parts read together.
"""One training run on an initialized process group: the loop every layout shares.

Per optimizer step: this dp rank's micro-batches are split over CP (par-cp's zigzag layout), run
through the pipeline schedule (par-pp) or plain accumulation, gradients are reduced (par-zero),
TP-partial grads summed, clipped by the global norm, and AdamW steps. The logged loss is the
mean over every token of the global batch, identical on every rank.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from par_cp import shard_sequence
from par_groups import comm, create_groups
from par_moe import DeclaredRouting
from par_tp import vocab_parallel_cross_entropy

from ..data.prefetch import Prefetcher
from ..data.packing import IGNORE, Documents, cu_seqlens, mask_eod_labels, positions_within_documents
from .dynamic_cp import SpanGroups, imbalance, plan_step
from ..blocks.kernels import fp8_regions, select_kernels
from ..errors import UsageError
from ..model.bias_balance import BiasBalance
from ..model.build import RankModel, build_rank_model
from ..model.mtp import mtp_streams
from ..blocks.qk_clip import clip_scales, reset_logit_max
from ..model.moe import moe_layers
from ..model.replace import ExpertReplacer
from ..sizing.replicas import declared_domains
from .schedule_lr import lr_for
from .micro_batches import NO_DOCUMENTS, MicroBatches
from .step_result import NonFinite, StepResult
from .runners import make_runner
from ..observe.step_timing import NoTimer
from ..observe.inject import Faults
from .fingerprints import RERUN
from .integrity import Integrity
from .owned_state import owned_state

# the last micro-batch's figures of each replicating MoE layer (par_moe.replicate.balance_metrics)
BALANCE_STATS = ("slots_max_over_mean_before", "slots_max_over_mean_after", "slots_per_rank", "replicated_experts",
                 "replica_fetch_bytes")


@dataclass(frozen=True)
class ShapesOnly:
    """A Trainer on fake tensors (``pretrain plan --simulate``): nothing may depend on a tensor's values.
    Pipeline messages have a declared shape (no shape header); packed documents and dynamic CP are
    off (whole sequences: the same shapes); MoE layers route as ``routing`` declares (balanced, or
    expert 0 ``imbalance`` x its share, see ``par_moe.declared``)."""

    routing: DeclaredRouting = DeclaredRouting()


class Trainer:
    """Holds this rank's model and data; ``train_step(step)`` runs one optimizer step."""

    integrity_checks = True  # the silent-corruption checks (integrity.py); off where a rerun cannot fetch the data
    drops_replicas = False  # a persistent rank stops the run (fault_replica.py: its replica leaves it instead)
    loss_weight = 1.0  # each micro-batch's loss factor (fault_replica.py: a replica's uneven share)

    def __init__(self, cfg, full_state: dict | None = None, dataset=None, device: torch.device | None = None,
                 topology=None, shapes_only: ShapesOnly | None = None, timer=None) -> None:
        """``topology``: where the ranks run (else found at start-up: NVML, then [topology], see pretrain.runtime.rank_assignment).
        ``shapes_only``: the run is on fake tensors (see :class:`ShapesOnly`). ``timer``: where each step's
        time goes (a ``step_timing.StepTimer``; default none measured)."""
        from ..data import build_sampler
        from ..config.fault_rules import replica_copies
        from ..runtime.rank_assignment import assign_run_ranks

        simulated = shapes_only is not None

        self.cfg = cfg
        self.device = device or torch.device("cpu")
        # bf16 autocast on GPUs (fp32 master weights and optimizer state stay in par-zero)
        self.autocast = cfg.train.resolved_dtype(self.device.type) == "bf16"
        self.kernels = select_kernels(cfg.model, cfg.train, self.device)
        self.layout = layout = cfg.validate_world(dist.get_world_size())
        torch.manual_seed(cfg.train.seed)
        self.assignment = assign_run_ranks(cfg, layout, topology)  # collective
        if self.assignment.permutation or self.assignment.grid.order != layout.grid.order:  # placement moved ranks:
            replica_copies(cfg, self.assignment.grid, layout.dp, self.assignment.permutation)  # as checked up front
        self.groups = g = create_groups(self.assignment.grid, timeout=timedelta(seconds=cfg.train.collective_timeout_s),
                                        permutation=self.assignment.permutation)
        self.model: RankModel = build_rank_model(cfg, layout, g, full_state, self.device,
                                                 shapes_only.routing if simulated else None)
        self.fp8_region = fp8_regions(self.kernels, g.tp_dp_cp)  # TE's FP8 autocast for one forward, or a no-op
        self._step = 0  # the step being trained (hidden dropout draws its masks per step)
        self.sampler = build_sampler(cfg, layout, g.coords()["dp"], dataset)  # logical coordinates
        # This rank's place in the CP sequence split (for a2a+p2p, outer * inner + inner rank, which
        # is its index in the cp group too), used to shard tokens like the attention expects.
        self.cp_rank, self.cp_size = g.rank_in("cp"), g.size("cp")
        shape = None  # pipeline messages' declared shape: no header to send, nothing to read on receive
        if not cfg.parallel.dynamic_cp or simulated:  # dynamic CP's rounds vary in length
            split = layout.tp if layout.sequence_parallel else 1  # activations [S/cp/tp, mb, H] between stages
            shape = ((cfg.train.seq_len // layout.cp // split, layout.micro_batch, cfg.model.hidden),
                     torch.bfloat16 if self.autocast else torch.float32)
        # Packed documents ([data] document_mask / reset_position_ids / eod_mask_loss) travel with each
        # step's MicroBatches (see packing.py).
        self.packed = cfg.data.packed and not simulated
        # Dynamic CP: every rank plans the global batch's documents over the dp x cp ranks (dynamic_cp.py).
        self.span_groups = SpanGroups(g.ranks["dp_cp"]) if cfg.parallel.dynamic_cp and not simulated else None
        self.timer = timer or NoTimer()
        self.runner = make_runner(self.model, g.pp, self.device, shape, self.callbacks, self.callbacks(NO_DOCUMENTS),
                                  self.timer)  # a pipeline schedule, or accumulation
        self.timer.stage = g.rank_in("pp")  # ranks are compared with those of their stage (observe/stragglers.py)
        self.timer.planned_layers = [len(ids) for ids in cfg.parallel.stage_layers(cfg.model.layers)]
        self.faults = Faults.from_env(dist.get_rank())  # none unless PAR_INJECT (observe/inject.py)
        self.faults.data(self.sampler, cfg.model.vocab_size)
        self.faults.modules(self.model.chunks)  # before the integrity's hooks: they see what it flips
        self.integrity = Integrity(self, off=simulated or not self.integrity_checks)  # silent corruption, at log steps
        if hasattr(self.runner, "executor"):
            self.runner.executor.send_span = self._send_span
        self.non_finite = NonFinite(self.device)
        self.prefetch = None if simulated else Prefetcher(self._read_batch, self.device)  # the next step's batch
        # expert_balance != "none": the replica plans get the EP ranks' NVLink domains (simulated: those of
        # the described cluster, as sizing plans them); "replicate+replace": experts re-placed by load
        self.expert_replacer = None if simulated else ExpertReplacer.of(
            cfg.model, self.model.chunks, self.model.dp, g, self.assignment.topology)
        self.bias_balance = BiasBalance.of(self.model.chunks, g.tp_dp_cp)  # [model].bias_update_rate > 0
        if simulated:
            domains = declared_domains(cfg, layout)
            for moe in moe_layers(self.model.chunks):
                moe.set_domains(domains)

    # ---- data ------------------------------------------------------------------------------
    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        """``[micro_batch, S]`` -> this CP rank's ``[S/cp, micro_batch]`` (sequence-first), on the device."""
        x = shard_sequence(x.t().contiguous(), self.cp_rank, self.cp_size, dim=0, layout="zigzag")
        return x.to(self.device, non_blocking=True)

    def microbatches(self, batch) -> MicroBatches:
        """This rank's micro-batches of ``batch``: sequence-first CP shards; with MTP the labels carry its token
        streams too ``[S/cp, B, 1 + 2D]``; packed data brings each micro-batch's documents. Tokens go to the device
        in one copy (asynchronous from the prefetcher's pinned memory on CUDA); segments stay on the host."""
        if self.span_groups is not None:
            return self._dynamic_microbatches(batch)
        batch = replace(batch, tokens=batch.tokens.to(self.device, non_blocking=True))
        n, depth = batch.tokens.shape[0], self.cfg.model.mtp_depth
        inputs = [self._shard(batch.inputs[m]) for m in range(n)]
        if self.packed:
            return self._packed_microbatches(batch, inputs)
        if not depth:
            return MicroBatches(inputs, [self._shard(batch.labels[m]) for m in range(n)])
        streams = [[batch.labels[m]] + mtp_streams(batch.labels[m], depth) for m in range(n)]
        return MicroBatches(inputs, [torch.stack([self._shard(s) for s in group], dim=-1) for group in streams])

    def _packed_microbatches(self, batch, inputs: list[torch.Tensor]) -> MicroBatches:
        """Each micro-batch's :class:`Documents`; the labels with the prediction at each EOS dropped
        under eod_mask_loss, and the count of tokens the loss averages."""
        d, n = self.cfg.data, batch.tokens.shape[0]
        docs, labels = [], []
        for m in range(n):
            segments = batch.input_segments[m]
            docs.append(Documents(
                cu_seqlens(segments) if d.document_mask else None,
                self._shard(positions_within_documents(segments)) if d.reset_position_ids else None))
            y = batch.labels[m]
            labels.append(self._shard(mask_eod_labels(batch.inputs[m], y, self.sampler.dataset.eos)
                                      if d.eod_mask_loss else y))
        loss_tokens = None
        if d.eod_mask_loss:  # the global batch's kept predictions, as the share of one (rank, micro-batch)
            kept = torch.stack([(y != IGNORE).sum() for y in labels[:self._counted(n)]]).sum().reshape(1).double()
            comm.all_reduce(kept, self.groups.dp_cp)
            loss_tokens = (kept / (self.groups.size("dp_cp") * n)).float().reshape(())  # on the device: no host read
        return MicroBatches(inputs, labels, docs, loss_tokens)

    def _counted(self, n: int) -> int:
        """How many of a batch's ``n`` micro-batches count in eod_mask_loss's kept predictions: all of them."""
        return n

    def _batch(self, step: int, eval: bool | str = False):
        """This rank's batch ``step``; a training step's was read during the previous one (time_data waits for it)."""
        if eval or self.prefetch is None:
            return self._read_batch(step, eval)
        return self.prefetch.get(step)

    def _read_batch(self, step: int, eval: bool | str = False):
        """This rank's share of batch ``step``; under dynamic CP the global one (every rank plans all of it).
        ``eval``: True (or "valid") a held-out batch, "test" one of [data].split's test part."""
        s, split = self.sampler, "test" if eval == "test" else "valid"
        if self.span_groups is not None:
            return s.global_eval_batch(step, split) if eval else s.global_train_batch(step)
        return s.eval_batch(step, split) if eval else s.train_batch(step)

    def rerun_batch(self, dp: int, step: int):
        """Data-parallel rank ``dp``'s share of training batch ``step`` (a suspect's, recomputed: integrity.py)."""
        sampler = copy.copy(self.sampler)
        sampler.dp_rank = dp
        return sampler.train_batch(step)

    def _dynamic_microbatches(self, batch) -> MicroBatches:
        """One micro-batch per round of the dynamic CP plan: this rank's tokens ``[T, 1]``."""
        p, d = self.cfg.parallel, self.cfg.data
        rounds, kept, work = plan_step(batch, self.sampler.dataset.eos, d.eod_mask_loss, p.max_seq_per_rank,
                                       self.span_groups)
        return MicroBatches([x.to(self.device) for x, _, _ in rounds], [y.to(self.device) for _, y, _ in rounds],
                            [replace(docs, positions=docs.positions.to(self.device)) for _, _, docs in rounds],
                            kept / (self.groups.size("dp_cp") * len(rounds)), imbalance(work))

    def forward_chunk(self, batch: MicroBatches, chunk_id: int, module, x: torch.Tensor, microbatch: int):
        """One chunk's forward of micro-batch ``microbatch`` of ``batch``, with its packed documents when
        there are any, in TE's FP8 autocast when [train].fp8 is on (one region per forward: see kernels.fp8_regions)."""
        m = self.cfg.model
        if m.hidden_dropout > 0 or m.attention_dropout > 0:  # which global samples: the dropout masks are theirs
            s = self.sampler
            first = self._step * s.global_batch + s.dp_rank * (s.global_batch // s.dp_size) + microbatch * s.micro_batch
            self.model.dropout.set(self.cfg.train.seed, self._step, first)
        prints = self.integrity.prints  # this rank's own outputs, to name where a transient fault entered
        with self.timer.span("forward"), self.fp8_region(), prints.forward(self._rerun_step(), chunk_id, microbatch):
            self.faults.at("forward")
            return prints.output(self.faults.output(module(x, docs=batch.docs[microbatch]) if batch.docs else module(x)))

    def _rerun_step(self) -> int | None:
        """The step a forward's fingerprints are kept under: a training step's, a rerun's, none for an evaluation."""
        return RERUN if self.integrity.rerunning else self._step if self.model.module.training else None

    @contextmanager
    def _send_span(self):
        """A pipeline send: timed as its own phase."""
        with self.timer.span("pp_send"):
            self.faults.at("pp_send")
            yield

    def loss(self, out, labels: torch.Tensor, batch: MicroBatches = NO_DOCUMENTS) -> torch.Tensor:
        """The next-token loss; with MTP its gradient also carries the MTP loss (not its value: logged apart).
        Under eod_mask_loss: this rank's sum over kept predictions divided by the global batch's count
        per (rank, micro-batch), so the mean over micro-batches and dp x cp ranks is the one-rank loss."""
        if batch.loss_tokens is not None:
            return vocab_parallel_cross_entropy(out, labels, self.groups.tp, reduction="sum") / batch.loss_tokens
        if not self.cfg.model.mtp_depth:
            return vocab_parallel_cross_entropy(out, labels, self.groups.tp)  # in fp32 inside
        (logits, hidden), streams = out, list(labels.unbind(-1))
        loss = vocab_parallel_cross_entropy(logits, streams[0], self.groups.tp)
        with self.fp8_region():  # MTP's layers: a forward of their own
            extra = self.model.chunks[self.model.num_chunks - 1].mtp_loss(hidden, streams[1:])
        return loss + (extra - extra.detach())

    def callbacks(self, batch: MicroBatches) -> dict:
        """The pipeline's forward and loss for this batch (par-pp calls them per action)."""
        return {"forward_fn": lambda c, module, x, m: self.forward_chunk(batch, c, module, x, m),
                "loss_fn": lambda out, labels: self.loss(out, labels, batch)}

    # ---- one step --------------------------------------------------------------------------
    def _forward_backward(self, batch: MicroBatches) -> list[torch.Tensor]:
        """Run all micro-batches; return the per-micro-batch losses (on the last stage)."""
        with self._compute_context():
            return self.runner.train(batch)

    def _compute_context(self):
        """bf16 autocast (when the run is bf16); each chunk's forward adds FP8 inside it (forward_chunk)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _mean_loss(self, losses: list[torch.Tensor], also: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over micro-batches, dp x cp ranks, shared with every pipeline stage (a device scalar).
        ``also`` (one element): summed over the same ranks in the same reductions, in place."""
        g = self.groups
        total = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        total = total.reshape(1).float()
        if also is not None:
            total = torch.cat([total, also.float()])
        comm.all_reduce(total, g.dp_cp)
        total[:1] /= g.size("dp_cp")
        if g.size("pp") > 1:  # only the rank holding the last chunk has it (rank 0 in V-shapes)
            if self.model.num_chunks - 1 not in self.model.chunks:
                total[:1].zero_()
            comm.all_reduce(total, g.pp)
        if also is not None:
            also.copy_(total[1:])
        return total[0]

    def train_step(self, step: int) -> StepResult:
        cfg, dp, g = self.cfg, self.model.dp, self.groups
        lr = lr_for(step, cfg.train)
        self._step = step
        self.model.module.train()
        timer = self.timer
        timer.start()
        self.faults.step(step, lambda: owned_state(self.model))
        batch = self.microbatches(self._batch(step))
        self.faults.at("data")
        timer.lap("data")
        losses = self._forward_backward(batch)
        timer.lap("fwd_bwd")
        dp.sum_partial_grads()
        self.faults.reduced(dp)
        norm = dp.clip_grad_norm_(cfg.train.grad_clip or math.inf, norm_groups=(g.tp, g.pp),
                                  expert_norm_groups=(g.tp_ep, g.pp))
        self.integrity.note(step, losses, getattr(getattr(dp, "buffer", None), "local_sq", None), self.loss_weight)
        elsewhere = (~torch.isfinite(norm)).float().reshape(1)  # a replica's norm (unreduced over dp): any rank's
        loss = self._mean_loss(losses, elsewhere)
        tokens = cfg.train.global_batch * cfg.train.seq_len
        norm_seen = torch.where(elsewhere[0] > 0, torch.full_like(norm, math.inf), norm)  # replicas agree to skip
        finite = self.non_finite.note(step, loss, norm_seen)  # read at the next log or checkpoint step
        if cfg.train.nan_policy == "skip" and not bool(finite):  # dropping an update: one host read per step
            dp.zero_grad()  # every rank sees the same loss and norm, so all drop the update alike
            reset_logit_max(self.model.module)
            for moe in moe_layers(self.model.chunks):
                moe.step_metrics()  # the dropped step's statistics are not the next step's
            timer.lap("optimizer")
            timer.finish()
            self.non_finite = NonFinite(self.device)  # a skipped step does not stop the run
            return StepResult(step, loss, lr, norm, tokens, {}, skipped=True)
        if self.log_step(step + 1):  # before the update: its forward's fingerprints hold for the rerun
            self.integrity.losses(self, step + 1)
        dp.set_lr(lr)
        dp.step(self._qk_clip if cfg.train.muon_qk_clip > 0 else None)
        self.integrity.prints.updated()
        dp.zero_grad()
        moe = self._update_moe()
        placement = None if self.expert_replacer is None else self.expert_replacer.after_step(step)
        if batch.cp_imbalance is not None:  # logged with the step, like the MoE imbalance
            moe["cp_imbalance"] = torch.tensor(batch.cp_imbalance, device=self.device)
        self.faults.at("optimizer")
        timer.lap("optimizer")
        timer.finish()  # read at log steps (StepTimer.gathered)
        return StepResult(step, loss, lr, norm, tokens, moe, placement=placement)

    def _qk_clip(self) -> None:
        """MuonClip: the heads whose max logit passed tau this step, scaled down (blocks/qk_clip.py)."""
        self.model.dp.scale_rows_(clip_scales(self.model.module, self.cfg.train.muon_qk_clip, self.groups.dp_cp))

    def log_step(self, done: int) -> bool:
        """Whether the step that makes ``done`` steps is logged (its values read on the host)."""
        t = self.cfg.train
        return done % self.cfg.log.every == 0 or done == (t.stop_at or t.steps)

    def check_finite(self) -> None:
        """Under [train].nan_policy=stop: the one-line stop if a step since the start was not finite (a host read).
        First the silent-corruption checks (integrity.py), which stop the run on a wrong rank or copy."""
        verdicts = self.integrity.check(self, self._step + 1)
        try:
            self.non_finite.check()
        except UsageError as e:
            if verdicts:
                raise UsageError(f"{e}; corruption check: {'; '.join(verdicts)}") from None
            raise

    # ---- checkpoints and inference ---------------------------------------------------------
    def checkpointed(self):
        """What a checkpoint saves of this rank and loads back into it (a ``checkpoint.Checkpointed``)."""
        from ..checkpoint.subject import Checkpointed  # the package itself imports DCP: only when checkpointing

        return Checkpointed(self.cfg, self.layout, self.model, self.expert_replacer)

    def save_checkpoint(self, root, step: int, keep: int = 2):
        """Write ``root/step_<step>`` after ``step`` completed steps (every rank calls it)."""
        from ..checkpoint import save_checkpoint

        return save_checkpoint(self.checkpointed(), root, step, keep)

    def load_checkpoint(self, path, model_only: bool = False) -> int:
        """Load a checkpoint saved under any layout; returns the number of steps it had completed."""
        from ..checkpoint import load_checkpoint

        return load_checkpoint(self.checkpointed(), path, model_only)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[S, B, V]`` of ``tokens [B, S]``, on every rank (forward only, cp = 1)."""
        from par_tp import gather_tensor

        g = self.groups
        if self.cp_size > 1:
            raise ValueError("Trainer.logits runs with cp=1 only")
        self.model.module.eval()
        x0 = tokens.t().contiguous().to(self.device)
        s, b = x0.shape
        last = self.model.num_chunks - 1
        out = self.runner.last_output(x0)
        full = torch.empty(s, b, self.cfg.model.vocab_size, device=self.device)
        if out is not None:
            full = gather_tensor(out.float(), -1, g.tp) if g.size("tp") > 1 else out.float()
            full = full[..., :self.cfg.model.vocab_size].contiguous()  # without the vocabulary padding
        if g.size("pp") > 1:
            src = next(r for r in range(g.size("pp")) if last in self.model.schedule.chunks_on(r))
            comm.broadcast(full, src=g.ranks["pp"][src], group=g.pp)
        self.model.module.train()
        return full

    @torch.no_grad()
    def evaluate(self, batches: int, split: str = "valid") -> float:
        """Mean loss over ``batches`` held-out (``split="test"``: test) batches (forward only)."""
        self.model.module.eval()
        losses = []
        with self._compute_context():
            for index in range(batches):
                losses += self.runner.eval_losses(self.microbatches(self._batch(index, eval=split)))
        self.model.module.train()
        return float(self._mean_loss(losses))

    def _update_moe(self) -> dict:
        """Aux-loss-free bias updates over every rank that saw other tokens; for the log, the largest
        layer's imbalance over the whole step (all its micro-batches; a device scalar, no host read), and
        under expert_balance = "replicate" the worst layer's pairs per EP rank (its last micro-batch's)."""
        imbalance, balance = [], []
        if self.bias_balance is not None:
            self.bias_balance.update()
        for moe in moe_layers(self.model.chunks):
            stats = moe.step_metrics()
            if stats:
                imbalance.append(stats["imbalance"])
            if "slots_max_over_mean_after" in moe.last_metrics:  # expert_balance = "replicate"
                balance.append(torch.stack([moe.last_metrics[k] for k in BALANCE_STATS]))
        out = {"imbalance": torch.stack(imbalance).max().float()} if imbalance else {}
        if balance:  # the worst layer's max/mean pairs per EP rank before and after (and mean); replicas, bytes summed
            per_layer = torch.stack(balance)
            out |= dict(zip(BALANCE_STATS, torch.cat([per_layer[:, :3].max(0).values, per_layer[:, 3:].sum(0)])))
        return out
