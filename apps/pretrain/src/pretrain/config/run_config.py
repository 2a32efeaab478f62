"""The run configuration: TOML sections read into frozen, validated dataclasses.

A config is eight sections, ``[model] [parallel] [train] [data] [checkpoint] [log] [topology] [profile]``; every key has a
default, so a file names only what differs. ``--set section.key=value`` overrides (repeatable) are
applied on top; the value is read as a TOML literal (``--set parallel.hcp=[2,2]``,
``--set train.lr=3e-4``) and taken as a plain string when it is not one (``--set log.dir=runs/a``).

The schema is the sections (``model_section``, ``parallel_section``, ``train_section``, ``sections``),
each validating itself in ``__post_init__``; :class:`Config` checks each rule that spans sections
once, and :meth:`Config.validate_world` what depends on the number of ranks, returning the resolved
:class:`~pretrain.config.layout.Layout`. This module adds the loading: TOML, overrides, type checks.
Every problem is a :class:`~pretrain.errors.UsageError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import typing
from dataclasses import dataclass, field

try:  # Python >= 3.11 ships the TOML reader; tomli is the same module for older ones
    import tomllib as tomli
except ModuleNotFoundError:  # pragma: no cover
    import tomli

from par_groups import LayoutError
from .checks import CROSS_SECTION_RULES
from .fault_rules import fault_tolerance_experts, fault_tolerance_world
from .model_section import ModelConfig
from .rules import _need
from .fp8_rules import fp8_expert_rule, fp8_tile_rule
from .parallel_section import ParallelConfig
from .sections import CheckpointConfig, DataConfig, LogConfig, ProfileConfig, TopologyConfig
from .train_section import TrainConfig, shorten_warmup
from .config_files import builtin_configs, read_toml  # builtin_configs: part of this module's surface
from .flavors import flavor_model
from ..errors import UsageError, shown
from .layout import MAX_WORLD, Layout, micro_batching

__all__ = ["CheckpointConfig", "Config", "DataConfig", "Layout", "LogConfig", "ModelConfig", "ParallelConfig",
           "TopologyConfig", "TrainConfig", "builtin_configs", "load_config", "parse_override"]



SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "topology": TopologyConfig,
    "profile": ProfileConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    source: str = field(default="", compare=False)  # the file it came from ("" = built in)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every rule that spans sections, once each (``checks``: one named function per concern)."""
        for rule in CROSS_SECTION_RULES:
            rule(self)

    def validate_world(self, world_size: int) -> Layout:
        """Check everything that depends on the number of ranks; return the resolved layout."""
        p, t = self.parallel, self.train
        _need(1 <= world_size <= MAX_WORLD, f"world size {world_size} must be in 1..{MAX_WORLD} (2**17 ranks)")
        dp, rest = divmod(world_size, p.tp * p.cp * p.pp)
        if t.local_batch and not rest:  # torchtitan's per-rank batch: the global one follows the layout's dp
            object.__setattr__(t, "global_batch", t.local_batch * dp)
        if not rest:  # before the grid is built: a dp the batch cannot fill fails at once (else the grid says why)
            micro_batch, microbatches = micro_batching(t.global_batch, t.micro_batch, p.microbatches, dp, p.pp)
        sp = p.tp > 1 if p.sequence_parallel is None else (p.sequence_parallel and p.tp > 1)
        layout = Layout(world_size, p.tp, p.cp, p.pp, p.ep, p.expert_tp, p.vpp, p.chunks_per_rank, sp,
                        micro_batch if not rest else 0, microbatches if not rest else 0, p.order, tuple(p.hcp or ()))
        try:
            layout.grid  # noqa: B018 - builds and checks the grid
        except LayoutError as e:
            raise UsageError(f"[parallel] does not fit {world_size} ranks: {e}") from None
        if sp:
            _need((t.seq_len // p.cp) % p.tp == 0,
                  f"[train].seq_len={t.seq_len} / cp={p.cp} must be divisible by tp={p.tp} for sequence parallelism")
        if p.dynamic_cp:  # a document of a whole window must fit the dp x cp ranks
            ranks = dp * p.cp
            _need(t.seq_len <= p.max_seq_per_rank * ranks,
                  f"[train].seq_len={t.seq_len} can hold a document longer than [parallel].max_seq_per_rank="
                  f"{p.max_seq_per_rank} x dp x cp={ranks} tokens; raise max_seq_per_rank to at least "
                  f"{math.ceil(t.seq_len / ranks)}")
        if not rest:
            fp8_tile_rule(self, layout)
            fp8_expert_rule(self, layout)
            fault_tolerance_world(self, dp)
        if p.hsdp_replicas > 1:
            _need(dp % p.hsdp_replicas == 0,
                  f"[parallel].hsdp_replicas={p.hsdp_replicas} does not divide dp={dp} (world {world_size})")
        if not rest:
            fault_tolerance_experts(self, layout)
        return layout

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["parallel"]["hcp"] = list(self.parallel.hcp)
        out["model"]["mlp_only_layers"] = list(self.model.mlp_only_layers)
        out["model"]["offload"] = list(self.model.offload)
        if not isinstance(self.model.recompute, str):
            out["model"]["recompute"] = list(self.model.recompute)
        out["log"]["wandb_tags"] = list(self.log.wandb_tags)
        for section, key in (("parallel", "sequence_parallel"), ("model", "norm_topk_prob")):
            if out[section][key] is None:
                del out[section][key]  # TOML has no null: absent = default
        return out

    def to_toml(self) -> str:
        """The config as TOML that :func:`load_config` reads back to an equal config."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_literal(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ---- reading -------------------------------------------------------------------------------------


def _coerce(section: str, key: str, value, hint):
    """Check a TOML value against the field's type; ints are accepted where floats are expected."""
    where = f"[{section}].{key}"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is bool or (origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and bool in args):
        _need(isinstance(value, bool), f"{where} must be true or false, got {shown(value)}")
        return value
    if hint is int:
        _need(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, got {shown(value)}")
        _need(abs(value) < 2**63, f"{where}={value} is out of range (TOML integers are 64-bit: |value| < 2**63)")
        return value
    if hint is float:
        _need(isinstance(value, (int, float)) and not isinstance(value, bool),
              f"{where} must be a number, got {shown(value)}")
        _need(math.isfinite(value), f"{where}={value} must be a finite number")
        return float(value)
    if hint is list:
        _need(isinstance(value, list), f"{where} must be a list, got {shown(value)}")
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and str in args and isinstance(value, str):
        return value  # a word, or (below) a list of strings: [model].recompute
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and str in args:
        _need(isinstance(value, list) and all(isinstance(v, str) for v in value),
              f"{where} must be a string or a list of strings, e.g. [\"a\", \"b\"], got {shown(value)}")
        return tuple(value)
    if hint in (str, dict):
        what = "a string" if hint is str else "a table, e.g. {momentum = 0.9}"
        _need(isinstance(value, hint), f"{where} must be {what}, got {shown(value)}")
        return value
    if origin is tuple and args[0] is str:
        _need(isinstance(value, list) and all(isinstance(v, str) for v in value),
              f"{where} must be a list of strings, e.g. [\"a\", \"b\"], got {shown(value)}")
        return tuple(value)
    if origin is tuple:
        _need(isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
              f"{where} must be a list of integers, e.g. [2, 2], got {shown(value)}")
        return tuple(value)
    raise TypeError(f"no reader for {where} of type {hint}")  # a bug here, not bad input


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1) if len(name) <= 100 else []
    return f" (did you mean {close[0]}?)" if close else ""


RENAMED = {("parallel", "placement"): "rank_assignment"}  # (section, old key) -> new key
# (section, another trainer's key) -> par's key, with the note saying so
ALIASES = {("train", "local_batch_size"): ("local_batch", "torchtitan's per-data-parallel-rank batch; par's "
                                                          "global_batch is over all ranks")}
RENAMED_FROM = {(section, new): old for (section, old), new in RENAMED.items()}
# (section, old key) -> the keys it now sets, all to its value ([train].timeout_s meant both timeouts)
SPLIT = {("train", "timeout_s"): ("collective_timeout_s", "join_timeout_s")}


def config_from_dict(data: dict, source: str = "") -> Config:
    """Build and validate a :class:`Config` from nested dicts; unknown sections or keys are errors."""
    sections = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise UsageError(f"unknown section [{shown(section)[1:-1]}]{_suggest(section, list(SECTIONS))}; "
                             f"valid sections: {', '.join(SECTIONS)}")
        _need(isinstance(values, dict), f"[{section}] must be a table of keys")
        cls = SECTIONS[section]
        if section == "model" and values.get("flavor"):  # its keys first, the section's own on top
            values = {**flavor_model(values["flavor"]), **values}
        hints = typing.get_type_hints(cls)
        valid = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in list(values.items()):
            if (section, key) in SPLIT:  # the old key still works, sets each new one, and says so
                new = SPLIT[section, key]
                print(f"note: [{section}].{key} is now {' and '.join(f'[{section}].{n}' for n in new)}; "
                      f"it sets each", file=sys.stderr)
                for name in new:
                    if name not in values:  # a new key given beside it wins
                        kwargs[name] = _coerce(section, name, value, hints[name])
                continue
            if (section, key) in ALIASES:
                alias, (key, why) = key, ALIASES[section, key]
                print(f"note: [{section}].{alias} is [{section}].{key} here ({why})", file=sys.stderr)
            if (section, key) in RENAMED:  # the old name still works, and says the new one
                key = RENAMED[section, key]
                print(f"note: [{section}].{RENAMED_FROM[section, key]} is now [{section}].{key}", file=sys.stderr)
            if key not in valid:
                raise UsageError(f"unknown key [{section}].{shown(key)[1:-1]}{_suggest(key, valid)}; valid keys: "
                                 f"{', '.join(valid)}")
            kwargs[key] = _coerce(section, key, value, hints[key])
        sections[section] = cls(**kwargs)
    return Config(**sections, source=source)


def parse_override(text: str) -> tuple[str, str, object]:
    """'parallel.hcp=[2,2]' -> ('parallel', 'hcp', [2, 2]); a bare word that is no TOML literal is a string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise UsageError(f"--set {shown(text)} must look like section.key=value, e.g. --set parallel.tp=2")
    raw = raw.strip()
    try:
        value = tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise UsageError(f"--set {shown(text)}: the value is nested too deeply to read") from None
    return section, name.strip(), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    merged = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items()}
    if any(parse_override(t)[:2] == ("model", "flavor") for t in overrides):
        merged["model"] = {}  # --set model.flavor replaces the file's model section
    for text in overrides:
        section, name, value = parse_override(text)
        table = merged.setdefault(section, {})
        _need(isinstance(table, dict), f"[{section}] must be a table of keys")
        table[name] = value
    return merged


ENV_OVERRIDES = "PRETRAIN_SET"  # space-separated overrides applied after --set (CI and smoke tests)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config (None = the embedded ``tiny.toml``), apply ``--set`` overrides, then those of
    ``$PRETRAIN_SET`` (e.g. ``PRETRAIN_SET="train.steps=2"`` shortens every run), validate."""
    data, source = read_toml(path)
    overrides = list(overrides or []) + os.environ.get(ENV_OVERRIDES, "").split()
    merged = apply_overrides(data, overrides)
    shorten_warmup(merged, {parse_override(o)[:2] for o in overrides})
    return config_from_dict(merged, source=source)
