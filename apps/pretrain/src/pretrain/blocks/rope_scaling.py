"""RoPE scaling as transformers defines it (``rope_parameters`` / ``rope_scaling``): one implementation
for grouped-query attention (Llama 3.1+, Qwen3) and latent attention (DeepSeek-V3's YaRN).

``[model].rope_scaling`` is a table with transformers' own keys, ``{}`` for plain RoPE:

* ``linear``: ``factor`` (every frequency divided by it);
* ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``;
* ``yarn``: ``factor``, ``original_max_position_embeddings``, optional ``beta_fast`` (32),
  ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate`` (true).

``dynamic`` (NTK scaling that changes with the current sequence length) is refused: training at a
fixed length would use different frequencies than inference at another.
"""

from __future__ import annotations

import math

import torch

from ..errors import UsageError

REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}
OPTIONAL = {"linear": (), "llama3": (), "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                                 "attention_factor", "truncate")}
ROPE_TYPES = ("default",) + tuple(REQUIRED)


def check_rope_scaling(s, where: str = "[model].rope_scaling") -> None:
    """One UsageError line naming the key if ``s`` is not a RoPE scaling transformers and we both read."""
    if not isinstance(s, dict):
        raise UsageError(f"{where} must be a table, e.g. {{rope_type = \"llama3\", factor = 8.0, ...}}, got {s!r}")
    kind = s.get("rope_type", "default")
    if kind == "dynamic":
        raise UsageError(f"{where}: rope_type='dynamic' is not supported (its frequencies depend on the current "
                         f"length); supported: {', '.join(ROPE_TYPES)}")
    if kind not in ROPE_TYPES:
        raise UsageError(f"{where}: rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        extra = sorted(set(s) - {"rope_type"})
        if extra:
            raise UsageError(f"{where}: {', '.join(extra)} given with rope_type='default' (plain RoPE takes no keys)")
        return
    missing = [k for k in REQUIRED[kind] if s.get(k) is None]
    if missing:
        raise UsageError(f"{where}: rope_type={kind!r} needs {', '.join(missing)}")
    unknown = sorted(set(s) - {"rope_type", *REQUIRED[kind], *OPTIONAL[kind]})
    if unknown:
        raise UsageError(f"{where}: {', '.join(unknown)} not understood with rope_type={kind!r} (keys: "
                         f"{', '.join(REQUIRED[kind] + OPTIONAL[kind])})")
    for key, value in s.items():
        if key == "rope_type" or value is None:
            continue
        if key == "truncate":
            ok = isinstance(value, bool)
        elif key == "original_max_position_embeddings":
            ok = type(value) is int and value >= 1
        else:
            ok = type(value) in (int, float) and value >= 0
        if not ok:
            what = "true or false" if key == "truncate" else "a positive integer" if key.startswith("original") else \
                "a number >= 0"
            raise UsageError(f"{where}.{key}={value!r} must be {what}")
    if s["factor"] < 1:
        raise UsageError(f"{where}.factor={s['factor']!r} must be >= 1")
    if kind == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
        raise UsageError(f"{where}: high_freq_factor={s['high_freq_factor']} must exceed "
                         f"low_freq_factor={s['low_freq_factor']}")


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """Interpolate the slow frequencies by ``factor``, keep the fast ones, ramp in between."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=inv_freq.device).float() / dim)  # as transformers rounds
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim) if mscale and all_dim
                     else yarn_get_mscale(factor))
    return inv_freq, float(attention)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def scaled_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos/sin) of plain ``inv_freq`` under scaling ``s``."""
    kind = s.get("rope_type", "default") if s else "default"
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, s), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, dim, theta, s)
    return inv_freq, 1.0


def softmax_mscale(s: dict) -> float:
    """DeepSeek's extra softmax factor under scaled RoPE (``mscale_all_dim`` squared; transformers'
    ``yarn_apply_mscale``); 1 otherwise."""
    if s and s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        return yarn_get_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return 1.0
