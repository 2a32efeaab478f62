"""What a per-module activation policy costs per pipeline stage (``plan``'s ``activation_policy``): the
activations left (sizing.activations), the FLOPs the recomputed modules run again
(``estimate.module_forward_flops``), the bytes ``[model].offload`` moves out and back (sizing.offload)
and the host-to-device bandwidth that brings them back within the stage's backward."""

from __future__ import annotations

from ..sizing.activations import stage_peak_of
from ..sizing.offload import offloaded_bytes
from ..sizing.params import stage_layers
from .estimate import module_forward_flops

# the compute the bandwidth is sized against: an H100's bf16 dense peak at the planner's default efficiency
ASSUMED_TFLOPS = 989.0 * 0.6


def policy_figures(cfg, layout) -> dict:
    m, t = cfg.model, cfg.train
    recompute = ("full",) if m.recompute == "full" else ("core_attn",) if m.recompute == "selective" else \
        () if m.recompute == "none" else m.recompute
    tokens = t.global_batch // layout.dp * t.seq_len  # one model replica's tokens per step
    work = (layout.tp * layout.cp)  # ranks splitting each token's matmuls
    stages = []
    for s, layers in enumerate(stage_layers(cfg.parallel, m.layers)):
        from ..sizing.flops import training_flops_per_token

        flops = sum(training_flops_per_token(m, t.seq_len) / m.layers for _ in layers) * tokens / work
        again = sum(module_forward_flops(m, t.seq_len, i, recompute) for i in layers) * tokens / work
        moved = offloaded_bytes(cfg, layout, s)
        backward_s = (flops + again) * 2 / 3 / (ASSUMED_TFLOPS * 1e12)  # the moved bytes come back within it
        stages.append({"stage": s, "activations": stage_peak_of(cfg, layout, s).with_grads(0.0),
                       "recompute_flops_per_step": again, "model_flops_per_step": flops,
                       "offloaded_bytes_per_step": moved, "h2d_gb_s_needed": moved / backward_s / 1e9 if moved else 0.0})
    return {"recompute": list(recompute), "offload": list(m.offload), "assumed_tflops": ASSUMED_TFLOPS, "stages": stages}
