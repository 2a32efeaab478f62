"""What ``[model].offload`` moves to host memory and back (model/offload.py), per pipeline stage: the
offloaded modules' saved sets (the same per-token sizes :mod:`.activations` counts), and the
host-to-device bandwidth that brings them back within the step."""

from __future__ import annotations

from ..model.offload import modules_at
from ..model.recompute_policy import modules_at as recomputed_at
from ..models import family_of
from .activations import _mlp, _pb, layer_per_token
from .params import chunk_layers, chunks_of


def _module_per_token(cfg, layout, i: int, module: str, pb: int) -> float:
    """Per token of the micro-batch: what ``module`` of layer ``i`` saves (0 where it is recomputed:
    its checkpoint keeps its input only, which the module before it saved)."""
    m = cfg.model
    recomputed = recomputed_at(m.recompute, i)
    share = layout.tp if layout.sequence_parallel else 1
    if module == "layer":
        if "full" in recomputed:
            return m.hidden / share * pb
        word = "selective" if "core_attn" in recomputed else "none"
        return layer_per_token(cfg, layout, i, word)
    if "full" in recomputed or module in recomputed or (module == "mlp" and "moe" in recomputed and m.is_moe_layer(i)):
        return 0.0
    if module == "layernorm":
        return 2 * 8 * m.hidden / share
    if module == "attn":
        return family_of(m).saved_bytes(m, layout, "selective" if "core_attn" in recomputed else "none", pb)
    if (module == "moe") != m.is_moe_layer(i):
        return 0.0  # mlp names the dense layers, moe the MoE ones
    return _mlp(m, layout, i, pb, m.top_k * layout.etp)


def offloaded_per_layer(cfg, layout, i: int, position: int | None) -> float:
    """Bytes per token decoder layer ``i`` (the ``position``-th of its chunk; None: MTP) moves out."""
    m = cfg.model
    if not m.offload:
        return 0.0
    modules = modules_at(m.offload, i, position)
    if "layer" in modules:
        modules = {"layer"}
    return sum(_module_per_token(cfg, layout, i, module, _pb(cfg)) for module in modules)


def offloaded_per_microbatch(cfg, layout, chunk: int, layers) -> float:
    """Bytes one micro-batch of ``chunk`` moves out (and back)."""
    m = cfg.model
    tokens = cfg.train.seq_len / layout.cp * layout.micro_batch
    last = chunk == layout.pp * layout.chunks_per_rank - 1
    mtp = list(range(m.layers, m.layers + m.mtp_depth)) if last else []
    per_token = sum(offloaded_per_layer(cfg, layout, i, n) for n, i in enumerate(layers))
    return (per_token + sum(offloaded_per_layer(cfg, layout, i, None) for i in mtp)) * tokens


def offloaded_bytes(cfg, layout, stage: int) -> float:
    """Bytes pipeline ``stage`` moves to host memory per step (and as many back)."""
    if not cfg.model.offload:
        return 0.0
    ranges = chunk_layers(cfg.parallel, cfg.model.layers)
    per_mb = sum(offloaded_per_microbatch(cfg, layout, c, ranges[c]) for c in chunks_of(cfg, layout, stage))
    return per_mb * layout.microbatches
