"""What one training step leaves to compare with the reference, recorded on every rank.

- Module outputs: a forward hook on every module of this rank's chunks keeps its output (the first
  tensor of it) per micro-batch, in forward order, named by its path in the chunk (``layers.3.mlp``:
  the same under every layout; the last chunk's own output, the masked logits, is ``logits``). Only
  calls made inside the trainer's forward of a micro-batch count (a recomputation during the backward
  does not); MTP layers run inside the loss, which is called once per micro-batch, in order.
- Parameter gradients: when the trainer asks for the clip norm (after the data-parallel reduction
  and the sum of partial gradients), every bucket's optimizer range is written into its boxes of
  the full tensor (:meth:`ParamPlacement.boxes`), with a count per element; one all-reduce of
  values and counts over the world, then values / counts: every element of every parameter in full,
  copies (TP-replicated norms, DDP replicas) averaged, shards (TP, EP, ZeRO ranges) put in place.
- MoE routing: every router's routed pairs per expert and smallest top-k margin over the step's
  forwards (:mod:`.routing`); a router takes its place in the forward order like a module output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from par_groups import comm
from par_groups.param_placement import placement_of

from .routing import is_router, routed_pairs, smallest_margin

LOGITS = "logits"


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class Recorder:
    """Hooks on ``trainer``'s chunks (or on ``chunks``, a {chunk id: module} standing in for them)."""

    def __init__(self, trainer, chunks: dict | None = None) -> None:
        self.trainer = trainer
        self.outputs: dict[str, dict[int, torch.Tensor]] = {}
        self.order: list[str] = []  # forward order of first appearance
        self.stage: dict[str, int] = {}  # module name -> chunk id that ran it
        self.routed: dict[str, list[int]] = {}  # MoE router name -> routed pairs per expert (this rank's tokens)
        self.margins: dict[str, float] = {}  # MoE router name -> smallest top-k margin of its selection scores
        self.mb: int | None = None
        self.loss_calls = 0
        self.handles = []
        chunks = trainer.model.chunks if chunks is None else chunks
        last = trainer.model.num_chunks - 1
        for c, chunk in chunks.items():
            for name, module in chunk.named_modules():
                if not name:
                    if c != last:
                        continue
                    name = LOGITS
                self.handles.append(module.register_forward_hook(self._hook(name, c)))
                if is_router(module):
                    self.handles.append(module.register_forward_hook(self._routing_hook(name, c)))

    def _hook(self, name: str, chunk: int):
        def hook(module, args, out):
            t = _first_tensor(out)
            if self.mb is None or t is None or not t.is_floating_point():
                return
            per_mb = self.outputs.setdefault(name, {})
            if self.mb in per_mb:
                return
            if name not in self.stage:
                self.order.append(name)
                self.stage[name] = chunk
            per_mb[self.mb] = t.detach().clone()
        return hook

    def _routing_hook(self, name: str, chunk: int):
        """Every call of a trainer's forward counts (all micro-batches); a recomputation does not."""
        def hook(module, args, out):
            if self.mb is None:
                return
            if name not in self.stage:  # a router's output is no tensor: its place in forward order
                self.order.append(name)
                self.stage[name] = chunk
            cfg = module.config
            load = routed_pairs(out.indices, cfg.num_experts)
            self.routed[name] = [a + b for a, b in zip(self.routed.get(name, [0] * len(load)), load)]
            self.margins[name] = min(self.margins.get(name, float("inf")),
                                     smallest_margin(out.scores, module.expert_bias, cfg.top_k))
        return hook

    def reset(self) -> None:
        self.outputs, self.order, self.stage, self.loss_calls = {}, [], {}, 0
        self.routed, self.margins = {}, {}

    def forward_chunk(self, original):
        def forward_chunk(batch, chunk_id, module, x, microbatch):
            self.mb = microbatch
            try:
                return original(batch, chunk_id, module, x, microbatch)
            finally:
                self.mb = None
        return forward_chunk

    def loss(self, original):
        def loss(out, labels, batch=None, **kw):
            self.mb = self.loss_calls
            self.loss_calls += 1
            try:
                return original(out, labels, batch, **kw) if batch is not None else original(out, labels, **kw)
            finally:
                self.mb = None
        return loss

    def install(self) -> None:
        """Route the trainer's forward and loss through this recorder (instance attributes: this rank only)."""
        self.trainer.forward_chunk = self.forward_chunk(type(self.trainer).forward_chunk.__get__(self.trainer))
        self.trainer.loss = self.loss(type(self.trainer).loss.__get__(self.trainer))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.trainer.__dict__.pop("forward_chunk", None)
        self.trainer.__dict__.pop("loss", None)


def full_param_names(trainer) -> dict[int, str]:
    """id(parameter) -> its full-model name (the same under every layout)."""
    return {id(t): name for name, t in trainer.model.full_named_tensors().items()}


def full_shapes(trainer) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's full shape in this layout, agreed over the world (a pipeline
    stage knows its own parameters only)."""
    names = full_param_names(trainer)
    mine = {names[id(p)]: placement_of(p).full_shape for p in trainer.model.parameters()
            if p.requires_grad and id(p) in names}
    everyone = [None] * dist.get_world_size()
    comm.all_gather_object(everyone, mine, None)
    out: dict[str, tuple[int, ...]] = {}
    for shapes in everyone:
        out |= shapes
    return dict(sorted(out.items()))


@torch.no_grad()
def gather_full_grads(trainer, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
    """Every parameter's reduced gradient as its full tensor (see the module doc); None where the
    data-parallel wrapper keeps no buckets (torch_fsdp2)."""
    dp = trainer.model.dp
    if not hasattr(dp, "buckets"):
        return None
    names = full_param_names(trainer)
    offsets, total = {}, 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        offsets[name] = (total, n)
        total += n
    device = trainer.device
    values = torch.zeros(total, dtype=torch.float64, device=device)
    counts = torch.zeros(total, dtype=torch.float64, device=device)
    for b in dp.buckets:
        grad = b.opt_grad
        for p, _, lo, hi, p_lo in b.opt_segments():
            name = names.get(id(p))
            if name not in offsets:
                continue
            start, n = offsets[name]
            full_v = values[start:start + n].view(shapes[name])
            full_c = counts[start:start + n].view(shapes[name])
            at = lo
            for box_offsets, size in placement_of(p).boxes(p_lo, p_lo + hi - lo):
                k = 1
                for d in size:
                    k *= d
                where = tuple(slice(o, o + s) for o, s in zip(box_offsets, size))
                full_v[where] += grad[at:at + k].view(size).double()
                full_c[where] += 1
                at += k
    comm.all_reduce(values, None)
    comm.all_reduce(counts, None)
    full = (values / counts.clamp_min(1)).float()
    return {name: full[start:start + n].view(shapes[name]) for name, (start, n) in offsets.items()}


def capture_grads_at_clip(trainer, shapes, sink: dict):
    """While installed, the trainer's clip call first stores the full gradients in ``sink['grads']``."""
    dp = trainer.model.dp
    clip = type(dp).clip_grad_norm_.__get__(dp)

    def clip_grad_norm_(*args, **kwargs):
        sink["grads"] = gather_full_grads(trainer, shapes)
        return clip(*args, **kwargs)

    dp.clip_grad_norm_ = clip_grad_norm_
    return lambda: dp.__dict__.pop("clip_grad_norm_", None)
