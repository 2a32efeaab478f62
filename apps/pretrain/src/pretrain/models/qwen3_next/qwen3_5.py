"""Qwen3.5 as released: a vision-language model (``qwen3_5``, ``qwen3_5_moe``) whose language model is read
(``text_config``; ``model.language_model.*``, the vision tower ``model.visual.*`` left out) or its text
model alone (``qwen3_5_text``, ``qwen3_5_moe_text``).

Its linear layers hold their input projections apart: ``in_proj_qkv`` (every key head's query,
then every key head's key, then every value head's value), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``
(one row block per value head each). Qwen3-Next's (ours) group the rows by key head: ``in_proj_qkvz``
holds key head h's query, key, its ``r`` value heads' values and their ``z``; ``in_proj_ba`` its value
heads' ``b`` then ``a``. Value head ``j`` belongs to key head ``j // r`` in both, so regrouping the rows
is the whole difference; the rest of the model is the same.
"""

from __future__ import annotations

import torch

from .gdn import qkvz_layout

PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # vision-language model -> its text model


def text_config(hf: dict) -> dict:
    """The text model's ``config.json`` keys of a Qwen3.5 vision-language model's (else ``hf`` itself)."""
    inner = hf.get("text_config")
    if hf.get("model_type") not in TEXT or not isinstance(inner, dict):
        return hf
    return {"tie_word_embeddings": hf.get("tie_word_embeddings")} | inner | {"model_type": TEXT[hf["model_type"]]}


def language_model(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's language model under the text model's names (the vision tower dropped)."""
    out = {}
    for name, t in state.items():
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = t
        elif not name.startswith("model.visual."):
            out[name] = t
    return out


def from_qwen3_5_names(state: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Qwen3.5's projections -> Qwen3-Next's, in a copy of ``state`` (a layer missing any part or of
    other widths is left as it is, for the caller to report)."""
    nk, r, _ = qkvz_layout(m)
    dk, dv, h = m.linear_key_dim, m.linear_value_dim, m.hidden
    widths = {"in_proj_qkv": 2 * nk * dk + nk * r * dv, "in_proj_z": nk * r * dv, "in_proj_b": nk * r, "in_proj_a": nk * r}
    out = dict(state)
    for i in range(m.layers):
        p = f"model.layers.{i}.linear_attn."
        parts = {k: state.get(f"{p}{k}.weight") for k in PARTS}
        if any(t is None or tuple(t.shape) != (widths[k], h) for k, t in parts.items()):
            continue
        for k in PARTS:
            del out[f"{p}{k}.weight"]
        q, k, v = parts["in_proj_qkv"].split([nk * dk, nk * dk, nk * r * dv])
        rows = [q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h), parts["in_proj_z"].view(nk, r * dv, h)]
        out[p + "in_proj_qkvz.weight"] = torch.cat(rows, 1).reshape(-1, h)
        out[p + "in_proj_ba.weight"] = torch.cat([parts["in_proj_b"].view(nk, r, h), parts["in_proj_a"].view(nk, r, h)],
                                                 1).reshape(-1, h)
    return out
