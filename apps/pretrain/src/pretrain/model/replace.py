"""``[model].expert_balance = "replicate+replace"``: every ``replace_every`` steps, experts re-placed by load.

Each MoE layer counts its routed pairs per expert on the device (``MoELayer.load_since_replace``).
At a re-placement step (after the optimizer step) the counts are summed over every rank of the
stage, read once, and every rank computes the same new map from them (``par_moe.pack_experts``);
the moved experts' rows of w_gate / w_up / w_down travel over the EP group with their fp32 masters
and optimizer state (``par_zero.move_rows_``), and the layer routes by the new map.

Checkpoints are keyed by the global expert index (each expert param's placement names the global
expert of every local slot), so any placement loads under any other. A save also folds the counts
into the global load since the last re-placement, and the state file keeps it with each layer's map:
a resume under the same ep re-places its experts as saved and counts on from there, so it continues
the uninterrupted run bitwise; under another ep it keeps the placement it loaded into. Under pp each
stage re-places its own layers; the state file keeps every stage's maps, keyed by layer name.

Under ``[train].fault_tolerance = "replica"`` (:meth:`ExpertReplacer.fold_each_step`) the counts are summed over
the stage every step, before the optimizer step, and folded into the global load once the step completes: at a
step boundary every replica holds the same placement and load (no rank's own counts), which is what a regrouped
trainer keeps and a joiner receives (:meth:`~ExpertReplacer.state`, :meth:`~ExpertReplacer.adopt`); a step a lost
replica interrupted folds nothing, so its redo is counted once, and a re-placement step reads no collective after
its update.

Node awareness: where the topology (``[topology]`` or NVML) puts the EP ranks in NVLink domains,
and every EP group of the stage sees the same pattern of them, the packing keeps experts in their
domain unless a swap across domains lowers the most loaded one (``pack_experts(domains=...)``).
The same domains keep every balanced layer's replicas in their home domain (``set_replica_domains``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import comm
from par_moe import ExpertPlacement, pack_experts
from par_zero import RowMove, move_rows_

from .moe import moe_layers


class ExpertReplacer:
    """The re-placement of a stage's MoE layers (those with ``expert_balance = "replicate+replace"``)."""

    def __init__(self, layers: list, names: list[str], dp, every: int, groups,
                 domains: tuple[int, ...] | None = None) -> None:
        """``layers``: this stage's re-placed MoE layers (under pp a stage may hold none), ``names`` their
        keys in the state file; ``groups``: the run's (the counts are summed over the stage's tp_dp_cp
        ranks, the experts move over ep, the stages' maps meet over pp); ``domains``: each EP rank's NVLink
        domain (None: one domain)."""
        self.layers, self.names, self.dp, self.every, self.domains = layers, names, dp, every, domains
        self.load_group, self.ep_group, self.ep = groups.tp_dp_cp, groups.ep, groups.size("ep")
        self.pp_group = groups.pp if groups.size("pp") > 1 else None
        self.carried = [[0] * layer.config.num_experts for layer in layers]  # global load folded at saves
        self.noted: dict | None = None  # what the last save folded, for its state file (rank 0 writes it)
        self.each_step = False  # fold_each_step: the stage's counts summed every step
        self.pending = None  # each_step: the step's summed counts (device), folded once the step completes (commit)
        self.folded = None  # each_step: the completed steps' summed counts not yet in carried (device: no host read)

    @classmethod
    def of(cls, model_cfg, chunks, dp, groups, topology) -> "ExpertReplacer | None":
        """The re-placement of ``chunks`` (this rank's ``{chunk id: ModelChunk}``, trained under ``dp``; None:
        no layer re-places); gives every balanced layer the EP ranks' NVLink domains in ``topology`` first,
        for its replica plan too. Under pp every stage has one, its layers or none."""
        domains = set_replica_domains(moe_layers(chunks), topology, groups.tp_dp_cp)
        if not model_cfg.is_moe or model_cfg.expert_balance != "replicate+replace":
            return None
        named = [(f"{kind}.{key}", layer.mlp) for chunk in chunks.values()
                 for kind, modules in (("layers", chunk.layers), ("mtp", chunk.mtp))
                 for key, layer in modules.items() if layer.is_moe and layer.mlp.replace]
        return cls([layer for _, layer in named], [name for name, _ in named], dp, model_cfg.replace_every,
                   groups, domains)

    def _summed(self) -> torch.Tensor:
        """The layers' device counts summed over the stage (one all-reduce); they restart from zero."""
        load = torch.stack([layer.load_since_replace for layer in self.layers])
        comm.all_reduce(load, self.load_group)
        for layer in self.layers:
            layer.load_since_replace.zero_()
        return load

    def _global_load(self) -> list[list[int]]:
        """Each layer's pairs per expert since the last re-placement, over the whole stage: one all-reduce
        and one host read (each_step: the folded load, no collective); the device counts restart from zero."""
        if not self.layers:
            return []
        if self.each_step:
            return self._fold()
        totals = [[a + b for a, b in zip(row, carried)] for row, carried in zip(self._summed().tolist(), self.carried)]
        self.carried = totals
        return totals

    def fold_each_step(self) -> None:
        """Sum the counts every step (:meth:`count_step`) rather than at re-placement and save steps only."""
        self.each_step = True

    def count_step(self) -> None:
        """each_step, before the step's update: its counts summed over the stage, folded by :meth:`commit`."""
        if self.each_step and self.layers:
            summed = self._summed()
            self.pending = summed if self.pending is None else self.pending + summed

    def commit(self) -> None:
        """The completed step's summed counts into the global load (on the device)."""
        if self.pending is not None:
            self.folded = self.pending if self.folded is None else self.folded + self.pending
            self.pending = None

    def _fold(self) -> list[list[int]]:
        """The global load, the committed counts read into it (one host read); a step not committed stays out."""
        if self.folded is not None:
            self.carried = [[a + b for a, b in zip(row, carried)]
                            for row, carried in zip(self.folded.tolist(), self.carried)]
            self.folded = None
        return self.carried

    def state(self) -> tuple[list[list[int]], list[list[int]], tuple[int, ...] | None]:
        """At a step boundary (each_step): each layer's placement (``expert_at``), the global load since the last
        re-placement (a step interrupted before its commit is not in it) and the EP ranks' NVLink domains the
        packing keeps to, alike on every replica."""
        return ([list(layer.placement.expert_at) for layer in self.layers], [list(row) for row in self._fold()],
                self.domains)

    def adopt(self, state: tuple) -> None:
        """Route by ``state``'s placement (this rank's experts' values and optimizer state are already in its slots,
        copied or received) and go on counting from its load, packing by its domains (those the run started with,
        whichever ranks a later generation holds)."""
        placements, loads, domains = state
        if len(placements) != len(self.layers) or len(loads) != len(self.layers):
            raise RuntimeError(f"an expert placement of {len(placements)} layers for {len(self.layers)}")
        self.domains = None if domains is None else tuple(domains)
        for layer, expert_at in zip(self.layers, placements):
            layer.place_(ExpertPlacement(tuple(expert_at), layer.num_local_experts))
            layer.set_domains(self.domains)
            layer.load_since_replace.zero_()
        self.carried, self.pending, self.folded = [list(row) for row in loads], None, None

    def after_step(self, step: int) -> dict | None:
        """After step ``step`` (0-based): re-place if it is a re-placement step; the log record (every
        stage's moves summed), else None."""
        self.commit()
        if (step + 1) % self.every:
            return None
        totals = self._global_load()
        new = [pack_experts(load, layer.placement, self.domains) for load, layer in zip(totals, self.layers)]
        record = self.place(new)
        self.carried = [[0] * len(row) for row in totals]
        stages = self._every_stage(record)
        return {"step": step + 1, **{k: sum(r[k] for r in stages) for k in record}}

    def _every_stage(self, mine) -> list:
        """``mine`` from every pipeline stage (in stage order); just ``[mine]`` without pp."""
        if self.pp_group is None:
            return [mine]
        stages = [None] * dist.get_world_size(self.pp_group)
        comm.all_gather_object(stages, mine, self.pp_group)
        return stages

    def place(self, placements: list[ExpertPlacement]) -> dict:
        """Move every layer's experts to ``placements`` (values and optimizer state) and route by them."""
        if not self.layers:
            return {"experts_moved": 0, "bytes_moved": 0}
        moves, moved = [], 0
        for layer, new in zip(self.layers, placements):
            ex = layer.experts
            params = (ex.w_gate, ex.w_up, ex.w_down)
            for _, src, src_slot, dst, dst_slot in layer.placement.moves_to(new):
                moves.append(RowMove(params, src, src_slot, dst, dst_slot))
                moved += src != dst
        sent = move_rows_(self.dp, moves, self.ep_group)
        for layer, new in zip(self.layers, placements):
            layer.place_(new)
        return {"experts_moved": moved, "bytes_moved": sent}

    def note_for_save(self) -> None:
        """At a save (every rank): fold the counts into the global load; the state file keeps it and the
        maps of every stage's layers, by layer name."""
        mine = {name: {"expert_at": list(layer.placement.expert_at), "load": load}
                for name, layer, load in zip(self.names, self.layers, self._global_load())}
        self.noted = {"ep": self.ep, "layers": {name: saved for stage in self._every_stage(mine)
                                                for name, saved in stage.items()}}

    def load(self, state: dict | None) -> None:
        """After a checkpoint's tensors loaded (into the current placement): continue its re-placement
        state. A checkpoint without one for every layer of this stage (another balance or model, an older
        save) leaves the run's own as it is."""
        saved = (state or {}).get("layers")
        if isinstance(saved, list):  # saved before the maps were keyed by layer name (pp = 1)
            saved = dict(zip(self.names, saved)) if len(saved) == len(self.layers) else None
        if not self.layers or not saved or any(name not in saved for name in self.names):
            return
        mine = [saved[name] for name in self.names]
        for layer in self.layers:
            layer.load_since_replace.zero_()
        self.carried = [list(s["load"]) for s in mine]
        if state["ep"] == self.ep:  # the saved placement, so the next re-placements are the same
            self.place([ExpertPlacement(tuple(s["expert_at"]), layer.num_local_experts)
                        for s, layer in zip(mine, self.layers)])


def set_replica_domains(layers: list, topology, stage_group) -> tuple[int, ...] | None:
    """The EP ranks' NVLink domains (:func:`ep_domains`), given to every balanced one of ``layers`` (a stage's
    MoE layers, ``MoELayer.set_domains``); None where no layer balances. Collective over ``stage_group``."""
    layers = [moe for moe in layers if moe.replicate]
    if not layers:
        return None
    domains = ep_domains(topology, layers[0].ep_group, stage_group)
    for layer in layers:
        layer.set_domains(domains)
    return domains


def ep_domains(topology, ep_group, stage_group) -> tuple[int, ...] | None:
    """Each EP rank's NVLink domain, numbered by first appearance, if every EP group of the stage has the
    same pattern (expert-data-parallel replicas must re-place alike); else None. Collective over the stage."""
    mine = group_domains(topology, dist.get_process_group_ranks(ep_group))
    everyone = [None] * dist.get_world_size(stage_group)
    comm.all_gather_object(everyone, mine, stage_group)
    return mine if all(other == mine for other in everyone) else None


def group_domains(topology, ranks: list[int]) -> tuple[int, ...] | None:
    """The NVLink domain of each of ``ranks`` (global ranks, in group order), numbered by first
    appearance; None without a topology or where a GPU has no domain."""
    if topology is None:
        return None
    found = [topology.gpus[r].domain for r in ranks]
    if None in found:
        return None
    order = list(dict.fromkeys(found))
    return tuple(order.index(d) for d in found)
