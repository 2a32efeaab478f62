"""``[model].flavor``: a shipped config's ``[model]`` section by name, as torchtitan's ``model.flavor``.

``flavor = "llama3-8b"`` (or torchtitan's ``"8B"``; ``"debugmodel"`` is par's ``tiny``) starts the model
section from that config's; the section's other keys then override it. Set by ``--set model.flavor=...``
it replaces the config file's model section (later ``--set model.*`` still apply).
"""

from __future__ import annotations

from .config_files import builtin_configs, read_toml
from .rules import _need

# torchtitan's llama3 / deepseek_v3 flavour names -> the shipped config of the same model
TORCHTITAN_FLAVORS = {"debugmodel": "tiny", "debugmodel_moe": "tiny-moe", "1B": "llama3.2-1b", "8B": "llama3-8b",
                      "70B": "llama3-70b", "405B": "llama3-405b", "671B": "deepseek-v3"}


def flavor_names() -> list[str]:
    return [n[:-5] for n in builtin_configs()] + list(TORCHTITAN_FLAVORS)


def flavor_model(name) -> dict:
    """The ``[model]`` keys of flavour ``name``; one error line for an unknown one."""
    _need(isinstance(name, str) and name in flavor_names(),
          f"[model].flavor={name!r} is not one of {', '.join(flavor_names())}")
    data, _source = read_toml(TORCHTITAN_FLAVORS.get(name, name))
    return dict(data.get("model", {}))
