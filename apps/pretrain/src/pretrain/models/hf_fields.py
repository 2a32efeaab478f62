"""Reading a Hugging Face ``config.json``: each field type-checked (one error line naming the key),
the RoPE parameters in either spelling, and MoE expert tensors stacked/unstacked by name."""

from __future__ import annotations

import json
import math
import re

import torch

from ..errors import UsageError
from ..blocks.rope_scaling import check_rope_scaling

MISSING = object()


class _NonFinite(str):
    """A number JSON spells but a config cannot hold (NaN, Infinity, 1e400), kept as its text."""


def _number(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _non_finite(value, path: str):
    """The key path of the first non-finite number in ``value``, or None."""
    if isinstance(value, _NonFinite):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def read_config_json(path) -> dict:
    """A ``config.json`` as a dict; invalid JSON, another type or any non-finite number (``"factor":
    Infinity``, NaN, 1e400) is one error line naming it (transformers' own json reader accepts them)."""
    try:
        hf = json.loads(path.read_text(), parse_constant=_NonFinite, parse_float=_number)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise UsageError(f"{path} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path} is not a JSON object")
    found = _non_finite(hf, "")
    if found:
        raise UsageError(f"{path}: {found[0]}={found[1]} is not a finite number; every number in config.json must be")
    return hf


def hf_value(hf: dict, key: str, kind: str, where: str, default=MISSING):
    """``hf[key]`` checked to be ``kind`` (size: int >= 1, count: int >= 0, number: > 0, coeff: >= 0, bool, str);
    ``default`` when absent or null (absent with no default: one error line)."""
    value = hf.get(key)
    if value is None:
        if default is MISSING:
            raise UsageError(f"{where}: missing {key}")
        return default
    ok = {"size": type(value) is int and value >= 1, "count": type(value) is int and value >= 0,
          "number": type(value) in (int, float) and math.isfinite(value) and value > 0,
          "coeff": type(value) in (int, float) and math.isfinite(value) and value >= 0,
          "bool": isinstance(value, bool),
          "str": isinstance(value, str)}[kind]
    if not ok:
        what = {"size": "a positive integer", "count": "an integer >= 0", "number": "a finite positive number",
                "coeff": "a finite number >= 0", "bool": "true or false", "str": "a string"}[kind]
        raise UsageError(f"{where}: {key}={value!r} must be {what}")
    return float(value) if kind in ("number", "coeff") else value


def refuse_unless(hf: dict, where: str, family: str, **wanted) -> None:
    """One error line for a key whose value we do not implement (absent keys take transformers' default)."""
    for key, want in wanted.items():
        if key in hf and hf[key] is not None and hf[key] != want:
            raise UsageError(f"{where}: {key}={hf[key]!r} is not supported ({family} here needs {want!r})")


def rope_from_hf(hf: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, our ``rope_scaling``) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (older files); a type transformers accepts but we lack is one error line."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UsageError(f"{where}: rope_parameters={params!r} must be an object")
    params = dict(params)
    if "type" in params:  # the spelling of older files
        params.setdefault("rope_type", params.pop("type"))
    theta = hf_value(params | {"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta", "number",
                     where, 10000.0)
    params.pop("rope_theta", None)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UsageError(f"{where}: partial_rotary_factor={partial!r} is not supported (RoPE over the whole head only)")
    if params.get("rope_type", "default") == "default":
        params.pop("rope_type", None)
    elif params.get("rope_type") in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")  # as transformers fills it
    check_rope_scaling(params, f"{where}: rope_parameters")
    return theta, {} if not params else {"rope_type": params.pop("rope_type")} | params


def rope_to_hf(theta: float, scaling: dict) -> dict:
    return {"rope_theta": theta, "rope_type": "default"} | dict(scaling)


def stack_experts(state: dict[str, torch.Tensor], prefix: str, experts: int, proj: dict[str, str]) -> None:
    """In place: ``{prefix}experts.{e}.{proj[w]}.weight`` for every expert -> our ``{prefix}experts.w_{w}`` [E, ...]
    (left as they are when any is missing: the caller reports missing tensors)."""
    for ours, theirs in proj.items():
        names = [f"{prefix}experts.{e}.{theirs}.weight" for e in range(experts)]
        if all(n in state for n in names):
            state[f"{prefix}experts.w_{ours}"] = torch.stack([state.pop(n) for n in names])


def unstack_experts(name: str, t: torch.Tensor, block: str, proj: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """Our ``model.layers.i.mlp.experts.w_{w}`` -> the released per-expert tensors under ``block``; None otherwise."""
    hit = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.w_(\w+)", name)
    if not hit:
        return None
    prefix = f"model.layers.{hit[1]}.{block}.experts."
    return {f"{prefix}{e}.{proj[hit[2]]}.weight": t[e] for e in range(t.shape[0])}
