"""Which parameters ``[train].optimizer = "muon"`` steps with Muon, which with AdamW: decided here only.

Muon for the hidden matrices: attention projections (GQA's q/k/v/o, MLA's down and up projections),
the MLP's and the shared experts' matrices, the routed experts (an ``[E, F, H]`` tensor is E matrices,
each orthogonalized alone) and MTP's ``eh_proj``. AdamW for the rest: the input embedding (and its
copies), the output head, norms, biases, the router and a shared expert's one-row gate (``mlp.shared.gate``:
a router of one output; the Muon paper's and Moonlight's split).
The trainer asks :func:`uses_muon` per parameter (Hugging Face name, full shape); ``pretrain plan``
lists :func:`muon_split` of the whole model.
"""

from __future__ import annotations

import re

from .shapes import full_shapes

ADAMW_PARTS = ("embed_tokens", "shared_embedding", "lm_head", "router", "mlp.shared.gate.")


def uses_muon(name: str, full_shape: tuple[int, ...]) -> bool:
    """Muon for a hidden matrix (2-D, or 3-D routed experts), AdamW for everything else."""
    if any(part in name for part in ADAMW_PARTS):
        return False
    return len(full_shape) == 2 or (len(full_shape) == 3 and ".experts." in name)


def muon_split(model_config) -> dict[str, list[str]]:
    """``{"muon": [...], "adamw": [...]}``: the full model's parameter names (layer indices as ``*``,
    each pattern once), and ``muon_params`` / ``adamw_params``: their element counts."""
    out: dict = {"muon": [], "adamw": [], "muon_params": 0, "adamw_params": 0}
    for name, shape in full_shapes(model_config).items():
        if name.endswith("expert_bias") or (model_config.tie_embeddings and name == "lm_head.weight"):
            continue  # a buffer; the head is the embedding
        side = "muon" if uses_muon(name, shape) else "adamw"
        pattern = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
        if pattern not in out[side]:
            out[side].append(pattern)
        n = 1
        for d in shape:
            n *= d
        out[side + "_params"] += n
    return out


def muon_ns_flops(model_config, ns_steps: int) -> int:
    """Newton-Schulz FLOPs of one Muon step on the whole model (par_zero.newton_schulz.ns_flops per matrix,
    each routed expert's matrix one): what the owners of the data-parallel group share."""
    from par_zero.newton_schulz import ns_flops

    shapes = full_shapes(model_config)
    return sum(ns_flops(s, ns_steps) * (s[0] if len(s) == 3 else 1) for n, s in shapes.items() if uses_muon(n, s))


def render_split(split: dict) -> str:
    ns = split.get("ns_flops_per_step")
    return (f"optimizer: Muon on {split['muon_params']:,} params ({', '.join(split['muon'])}); "
            f"AdamW on {split['adamw_params']:,} ({', '.join(split['adamw'])})"
            + (f"; Newton-Schulz {ns:.3g} FLOP per step, each matrix on one data-parallel rank" if ns else ""))
