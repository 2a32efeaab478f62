"""MoELayer: router, capacity, dispatch, grouped experts, combine, shared experts, metrics.

Tokens: ``x`` is ``[T, H]`` or ``[S, B, H]``, the tokens local to this rank (with sequence
parallelism, this rank's disjoint ``[S/tp, B, H]``). Routing and capacity run on local tokens.

Layout (par-groups' expert view, etp x ep x edp): ``ep_group`` splits the experts (rank p holds
experts ``[p E/ep, (p+1) E/ep)``), ``etp_group`` splits each expert's intermediate size F.
With etp > 1 the ranks of an etp group must hold *different* tokens of the *same count* (the
sequence-parallel layout): the layer all-gathers them over etp, every etp rank computes its F
shard of every token, and a reduce-scatter over etp sums the shards and returns each rank its
own tokens. The all-gather dispatcher also needs equal token counts over the ep group.

Gradients: expert params (placement ``expert``) get the full gradient of the ep group's tokens;
sum them over expert DP. Router and shared-expert params are replicated; each rank's gradient
comes from its own tokens (like LayerNorm under sequence parallelism: reduce over every rank that
holds different tokens). ``copies`` names the model-parallel group (e.g. TP) also holding them,
``partial_grad`` whether its ranks see different tokens (sequence parallel), so their placement
tells the data-parallel wrapper to sum their gradients over it.

Balancing losses: the returned aux loss is this rank's share: summed over ``aux_group`` (default:
this rank alone) it is the loss over the group's tokens. ``sequence_group`` (default: the aux
group) is the part of it that splits the same sequences (tp x cp in a model, while the aux group
also spans dp): the sequence-wise loss counts per sequence over it and averages over every
sequence of the aux group.

Routing: ``routing=None`` (training) routes by the data. A :class:`DeclaredRouting` (a run on
fake tensors, ``pretrain plan --simulate``) takes every token count from its declaration instead.
"""

from __future__ import annotations

import torch
from par_groups import comm
from torch import nn
from torch.distributed import ProcessGroup

from par_groups.param_placement import declare_copies_

from . import losses, replay
from .capacity import capacity_keep
from .comm import gather_no_grad, gather_tokens, group_rank, group_size, reduce_scatter_tokens
from .config import MoEConfig
from .declared import DeclaredRouting
from .dispatch import make_dispatcher, source_segments
from .experts import GroupedSwiGLU, SwiGLU
from .placement import ExpertPlacement
from .replicate import ReplicatingDispatcher, balance_metrics, expert_bytes, fetch_replicas
from .replicate_gather import ReplicatingAllGatherDispatcher
from .router import Router, tokens_per_expert

STEP_SUMS = ("dropped_pairs", "pairs", "aux_loss", "seq_aux_loss", "z_loss")  # MoELayer.step_sums, in order


class MoELayer(nn.Module):
    """``forward(x) -> (y, aux_loss)``; ``last_metrics`` holds the last forward's routing statistics,
    :meth:`step_metrics` those of every training forward since its last call (the whole step)."""

    def __init__(self, config: MoEConfig, ep_group: ProcessGroup | None = None, etp_group: ProcessGroup | None = None,
                 aux_group: ProcessGroup | None = None, sequence_group: ProcessGroup | None | str = "aux_group",
                 copies: ProcessGroup | None = None, partial_grad: bool = False,
                 routing: DeclaredRouting | None = None):
        super().__init__()
        self.config = config
        self.routing = routing  # None: the data's token counts; else the declared ones
        self.ep_group, self.etp_group, self.aux_group = ep_group, etp_group, aux_group
        self.sequence_group = aux_group if sequence_group == "aux_group" else sequence_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        if config.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide num_experts={config.num_experts}")
        if config.ffn_hidden % self.etp:
            raise ValueError(f"etp={self.etp} does not divide ffn_hidden={config.ffn_hidden}")
        self.num_local_experts = config.num_experts // self.ep
        self.first_expert = group_rank(ep_group) * self.num_local_experts
        self.ffn_shard = config.ffn_hidden // self.etp
        self.ffn_first = group_rank(etp_group) * self.ffn_shard
        self.router = declare_copies_(Router(config), copies, partial_grad)
        block = ((group_rank(ep_group), self.ep), (group_rank(etp_group), self.etp))
        self.experts = GroupedSwiGLU(self.num_local_experts, config.hidden, self.ffn_shard, block)
        self.shared = SwiGLU(config.hidden, config.shared_hidden) if config.shared_hidden else None
        if self.shared is not None:
            declare_copies_(self.shared, copies, partial_grad)
        self.replicate = config.expert_balance != "none" and self.ep > 1
        # "replicate+replace": experts may sit anywhere (placement.py); dispatch routes by their positions
        self.replace = config.expert_balance == "replicate+replace" and self.ep > 1
        self.placement = ExpertPlacement.contiguous(config.num_experts, self.ep)
        self.register_buffer("position_of", torch.arange(config.num_experts), persistent=False)
        # routed pairs per expert since the last re-placement (this rank's tokens; the trainer sums them)
        self.register_buffer("load_since_replace", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        balanced = ReplicatingAllGatherDispatcher if config.dispatcher == "allgather" else ReplicatingDispatcher
        self.dispatcher = (balanced(config.num_experts, ep_group, config.max_replicas_per_rank, config.replicate_across_domains)
                           if self.replicate else make_dispatcher(config.dispatcher, config.num_experts, ep_group))
        # Routed pairs per expert since the last update_bias (this rank's tokens only, until reduce_load sums them).
        self.register_buffer("routed_since_update", torch.zeros(config.num_experts, dtype=torch.float64), persistent=False)
        self.load_reduced = False  # reduce_load summed routed_since_update over the groups already
        self.last_metrics: dict[str, torch.Tensor] = {}
        # The step's statistics, summed on the device over its training forwards (see step_metrics):
        # routed pairs per expert, and (dropped pairs, pairs, aux loss, seq aux loss, z loss).
        self.register_buffer("step_load", torch.zeros(config.num_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("step_sums", torch.zeros(len(STEP_SUMS), dtype=torch.float64), persistent=False)
        self.step_forwards = 0

    def init_buffers_(self, device: torch.device) -> None:
        """Reset the computed (unsaved) buffers once they have storage on ``device`` (built on meta)."""
        self.routed_since_update.zero_()
        self.load_since_replace.zero_()
        self.position_of.copy_(torch.tensor(self.placement.position_of, device=device))
        self.step_load.zero_()
        self.step_sums.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, c.hidden)
        tape = replay.active()  # inside a checkpointed region: record the experts chosen, or replay them
        replaying = tape is not None and tape.replaying
        routing = self.router(tokens, tape.next() if replaying else None)
        if tape is not None and not replaying:
            tape.record(routing.indices)
        counting = self.training and not replaying  # a rerun's tokens were counted by its first run
        capacity = c.capacity(tokens.shape[0])
        declared = self.routing
        counts = (tokens_per_expert(routing.indices, c.num_experts) if declared is None
                  else declared.counts(tokens.shape[0], c.top_k, c.num_experts, x.device, capacity))
        keep = None if capacity is None else capacity_keep(routing.indices, routing.weights, c.num_experts, capacity, c.drop_policy)
        aux_loss, parts = self._balance_losses(routing, counts, shape)
        if c.bias_update_rate > 0 and counting:
            self.routed_since_update += counts.to(self.routed_since_update.dtype)
        if self.replace and counting:
            self.load_since_replace += counts

        xs, indices, weights, kept = tokens, routing.indices, routing.weights, keep
        if self.etp > 1:  # every etp rank computes its F shard for the tokens of the whole etp group
            xs, weights = gather_tokens(xs, self.etp_group), gather_tokens(weights, self.etp_group)
            indices = gather_no_grad(indices, self.etp_group)
            kept = None if keep is None else gather_no_grad(keep, self.etp_group)
        if self.replace:  # the dispatchers route to positions: rank * L + slot
            indices = self.position_of[indices]
        sizes = None  # the declared routing of xs (with etp > 1, each etp rank's tokens alike: capacity x etp)
        if declared is not None:
            sizes = declared.sizes(xs.shape[0], c.top_k, c.num_experts, self.ep, group_rank(self.ep_group),
                                   None if capacity is None else capacity * self.etp)
        if c.dispatcher == "alltoall_padded":  # static shapes: each expert padded to its capacity (x etp ranks)
            slots = (tokens.shape[0] if capacity is None else capacity) * self.etp
            expert_in, expert_counts, handle = self.dispatcher.dispatch(xs, indices, weights, kept, slots=slots)
        else:
            expert_in, expert_counts, handle = self.dispatcher.dispatch(xs, indices, weights, kept, sizes)
        max_count = handle.max_count if handle.max_count is not None else None if sizes is None else max(sizes.local)
        replicas = None
        if self.replicate:  # the replica slots' weights, from their experts' home ranks
            ex = self.experts
            replicas = fetch_replicas(ex.w_gate, ex.w_up, ex.w_down, handle.plan, self.ep_group, group_rank(self.ep_group))
        segments = None  # FP8 experts quantize each source rank's rows apart (par_tp.fp8.grouped)
        if self.experts.grouped_kernels is not None:
            segments = source_segments(handle, expert_counts.to(expert_in.device))
        expert_out = self.experts(expert_in, expert_counts, max_count, replicas, segments)
        y = self.dispatcher.combine(expert_out, handle)
        if self.etp > 1:
            y = reduce_scatter_tokens(y, self.etp_group)
        if self.shared is not None:
            y = y + self.shared(tokens)

        dropped = torch.zeros((), device=x.device) if keep is None else 1 - keep.float().mean()
        load = counts.float()
        self.last_metrics = {
            "tokens_per_expert": counts.detach(),
            "imbalance": (load.max() / load.mean()).detach(),
            "dropped_fraction": dropped.detach(),
            **{k: v.detach() for k, v in parts.items()},
            **(self._balance_metrics(handle.plan, x.device) if self.replicate else {}),
        }
        if counting:
            self._add_to_step(counts, keep, routing.indices.numel(), parts)
        return y.reshape(shape).to(x.dtype), aux_loss

    @torch.no_grad()
    def _add_to_step(self, counts, keep, pairs: int, parts) -> None:
        """Add one forward to the step's sums (device ops only: no host read)."""
        self.step_load += counts.to(self.step_load.dtype)
        dropped = counts.new_zeros(()) if keep is None else (~keep).sum()
        self.step_sums[0] += dropped.to(self.step_sums.dtype)
        self.step_sums[1] += pairs
        self.step_sums[2:] += torch.stack([parts[k] for k in STEP_SUMS[2:]]).to(self.step_sums.dtype)
        self.step_forwards += 1

    @torch.no_grad()
    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The step's routing statistics, then reset: every training forward since the last call (all
        the micro-batches of a step, not the last one's), as device tensors; {} when there was none.

        ``imbalance`` is the max over the mean of the step's routed pairs per expert, ``dropped_fraction``
        the share of the step's pairs capacity dropped, the losses the mean over the forwards. A
        recomputed (activation-checkpointed) forward counts once (``replay``).
        """
        if not self.step_forwards:
            return {}
        load, sums = self.step_load.clone(), self.step_sums.clone()
        out = {"tokens_per_expert": load, "imbalance": (load.max() / load.mean()).float(),
               "dropped_fraction": (sums[0] / sums[1]).float(),
               **{k: (v / self.step_forwards).float() for k, v in zip(STEP_SUMS[2:], sums[2:])}}
        self.step_load.zero_()
        self.step_sums.zero_()
        self.step_forwards = 0
        return out

    def _balance_metrics(self, plan, device):
        ex = self.experts
        return balance_metrics(plan, group_rank(self.ep_group), expert_bytes(ex.w_gate, ex.w_up, ex.w_down), device)

    def _balance_losses(self, routing, counts, shape):
        """This rank's share of the aux, sequence-aux and z losses (see ``losses``)."""
        c = self.config
        zero = routing.logits.new_zeros(())
        parts = {"aux_loss": zero, "seq_aux_loss": zero, "z_loss": zero}
        if not (c.aux_loss_coeff or c.seq_aux_loss_coeff or c.z_loss_coeff):
            return zero, parts
        tokens = routing.logits.shape[0]
        batch = shape[1] if len(shape) == 3 else 1
        seq_counts = None
        if c.seq_aux_loss_coeff and self.routing is None:
            seq_counts = losses.sequence_counts(routing.indices, batch, c.num_experts)
        elif c.seq_aux_loss_coeff:  # every sequence routed as declared
            seq_counts = self.routing.counts(tokens // batch, c.top_k, c.num_experts, counts.device).expand(batch, -1)
        group, seq_group = group_size(self.aux_group), group_size(self.sequence_group)
        if group > 1 and c.aux_loss_coeff:  # counts over every rank holding other tokens of the micro-batch
            counts = counts.to(torch.float64)
            comm.all_reduce(counts, self.aux_group)
        if seq_group > 1 and seq_counts is not None:  # ... and of the same sequences
            seq_counts = seq_counts.to(torch.float64)
            comm.all_reduce(seq_counts, self.sequence_group)
        probs = losses.scores_for_aux(routing.scores, c.score_func)
        if c.aux_loss_coeff:
            parts["aux_loss"] = losses.switch_aux_loss(probs, counts, tokens * group, c.top_k, c.aux_loss_coeff)
        if c.seq_aux_loss_coeff:
            seq_probs = probs.view(tokens // batch, batch, c.num_experts)
            # the mean over the aux group's sequences: this rank's batch is 1/(group/seq_group) of them
            coeff = c.seq_aux_loss_coeff * seq_group / group
            parts["seq_aux_loss"] = losses.sequence_aux_loss(seq_probs, seq_counts, (tokens // batch) * seq_group,
                                                             c.top_k, coeff)
        if c.z_loss_coeff:
            parts["z_loss"] = losses.z_loss(routing.logits, tokens * group, c.z_loss_coeff)
        return parts["aux_loss"] + parts["seq_aux_loss"] + parts["z_loss"], parts

    @torch.no_grad()
    def update_bias(self, *groups: ProcessGroup | None) -> torch.Tensor:
        """Aux-loss-free balancing, after the optimizer step: ``bias += rate * sign(mean - load)``.

        ``load`` is the routed pairs per expert since the last call summed over ``groups`` (by :meth:`reduce_load`
        already, if it ran since): pass
        every group whose ranks see different tokens (e.g. the tp-dp-cp group of the stage), so
        every rank applies the same update. Returns the load used. Every training-mode forward adds
        its counts, so a recomputed (activation-checkpointed) forward counts its tokens twice.
        """
        load = self.routed_since_update.clone()
        if not self.load_reduced:
            for group in groups:
                if group_size(group) > 1:
                    comm.all_reduce(load, group)
        self.load_reduced = False
        delta = torch.sign(load.mean() - load) * self.config.bias_update_rate
        self.router.expert_bias += delta.to(self.router.expert_bias.dtype)
        self.routed_since_update.zero_()
        return load

    @torch.no_grad()
    def reduce_load(self, *groups: ProcessGroup | None) -> None:
        """Sum the routed pairs since the last update over ``groups`` now, in place: :meth:`update_bias` then applies
        them with no collective of its own. A trainer calls it before its optimizer step, so that a step which
        fails in a collective (a lost peer) has changed no state yet and can be redone whole."""
        for group in groups:
            if group_size(group) > 1:
                comm.all_reduce(self.routed_since_update, group)
        self.load_reduced = True

    def set_domains(self, domains: tuple[int, ...] | None) -> None:
        """The EP ranks' NVLink domains (None: one), every rank alike: replicas stay in their home rank's
        domain unless ``replicate_across_domains`` (``balance.plan_replicas``)."""
        if domains is not None and len(domains) != self.ep:
            raise ValueError(f"domains={list(domains)} must name one NVLink domain per EP rank ({self.ep})")
        if self.replicate:
            self.dispatcher.domains = None if domains is None else tuple(domains)

    @torch.no_grad()
    def place_(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on (the caller moved the experts' values and optimizer state)."""
        if placement.num_local != self.num_local_experts or placement.ep != self.ep:
            raise ValueError(f"a placement of {placement.ep} x {placement.num_local} experts for ep={self.ep}")
        self.placement = placement
        self.position_of.copy_(torch.tensor(placement.position_of, device=self.position_of.device))
        self.experts.place_(placement.slots(group_rank(self.ep_group)))

    @torch.no_grad()
    def load_full_(self, router_weight, expert_w_gate, expert_w_up, expert_w_down, shared_w_gate=None, shared_w_up=None,
                   shared_w_down=None, expert_bias=None) -> "MoELayer":
        """Load FULL single-device weights (experts ``[E, F, H]`` / ``[E, H, F]``); keep this rank's slice."""
        experts = list(self.placement.slots(group_rank(self.ep_group)))
        ffn = slice(self.ffn_first, self.ffn_first + self.ffn_shard)
        self.router.weight.copy_(router_weight)
        if expert_bias is not None:
            self.router.expert_bias.copy_(expert_bias)
        self.experts.w_gate.copy_(expert_w_gate[experts, ffn])
        self.experts.w_up.copy_(expert_w_up[experts, ffn])
        self.experts.w_down.copy_(expert_w_down[experts, :, ffn])
        if self.shared is not None:
            if shared_w_gate is None:
                raise ValueError("this layer has shared experts: pass shared_w_gate, shared_w_up, shared_w_down")
            self.shared.w_gate.copy_(shared_w_gate)
            self.shared.w_up.copy_(shared_w_up)
            self.shared.w_down.copy_(shared_w_down)
        return self

    @classmethod
    def from_reference(cls, reference: nn.Module, ep_group=None, etp_group=None, aux_group=None) -> "MoELayer":
        """This rank's slice of a single-device :class:`par_moe.testing.ReferenceMoE` (same parameter names)."""
        layer = cls(reference.config, ep_group, etp_group, aux_group)
        shared = reference.shared
        return layer.load_full_(
            reference.router.weight, reference.experts.w_gate, reference.experts.w_up, reference.experts.w_down,
            *((shared.w_gate, shared.w_up, shared.w_down) if shared is not None else (None, None, None)),
            expert_bias=reference.router.expert_bias,
        )
