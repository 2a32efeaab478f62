"""What ``[model].offload`` moves to host memory and back (model/offload.py), per pipeline stage: the
offloaded modules' saved sets (the same per-token sizes :mod:`.activations` counts), and the
host-to-device bandwidth that brings them back within the step."""

from __future__ import annotations

from .activations import offloaded_per_layer
from .params import chunk_layers, chunks_of


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
