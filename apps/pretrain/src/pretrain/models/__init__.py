"""Model families: one folder each (``models/<family>/``) and one line in :data:`FAMILIES` below.

A family declares its attention once (``family.py``'s :class:`Family`): config keys and checks,
tensor shapes and placements, modules, sizing, certify narrowing, Hugging Face mapping and the
features it runs. The rest of the app asks :func:`family_of` instead of comparing names.
"""

from __future__ import annotations

from .family import Family
from .deepseek import FAMILY as DEEPSEEK
from .gqa import FAMILY as GQA
from .qwen3_next import FAMILY as QWEN3_NEXT
from .gpt_oss import FAMILY as GPT_OSS

FAMILIES: tuple[Family, ...] = (
    GQA,
    DEEPSEEK,
    QWEN3_NEXT,
    GPT_OSS,
)

ATTENTIONS = tuple(f.attention for f in FAMILIES)
_BY_ATTENTION = {f.attention: f for f in FAMILIES}


def family_of(m) -> Family:
    """The family of a ``[model]`` (its ``attention`` key; ``ModelConfig`` has checked it is one of :data:`ATTENTIONS`)."""
    return _BY_ATTENTION[m.attention]


def family_for_hf(model_type: str) -> Family | None:
    """The family that reads a transformers ``model_type``, or None."""
    return next((f for f in FAMILIES if model_type in f.hf_architectures), None)
