"""Model families: one folder each (``models/<family>/``) and one line in :data:`FOLDERS` below.

A family declares its attention once (``family.py``'s :class:`Family`): config keys and checks,
tensor shapes and placements, modules, sizing, certify narrowing, Hugging Face mapping and the
features it runs; its shipped configs are its folder's ``configs/*.toml``. The rest of the app asks
:func:`family_of` instead of comparing names.
"""

from __future__ import annotations

from importlib import import_module

from .family import Family

# the registry: each family's folder, one a line, in the order the app lists them
FOLDERS: tuple[str, ...] = (
    "gqa",
    "deepseek",
    "qwen3_next",
    "gpt_oss",
)

FAMILIES: tuple[Family, ...] = tuple(import_module(f"{__name__}.{folder}").FAMILY for folder in FOLDERS)

ATTENTIONS = tuple(f.attention for f in FAMILIES)
_BY_ATTENTION = {f.attention: f for f in FAMILIES}


def family_of(m) -> Family:
    """The family of a ``[model]`` (its ``attention`` key; ``ModelConfig`` has checked it is one of :data:`ATTENTIONS`)."""
    return _BY_ATTENTION[m.attention]


def family_for_hf(model_type: str) -> Family | None:
    """The family that reads a transformers ``model_type``, or None."""
    return next((f for f in FAMILIES if model_type in f.hf_architectures), None)
