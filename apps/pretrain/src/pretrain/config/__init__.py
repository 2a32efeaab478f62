"""The run configuration: its TOML sections, the rules across them, and the layout a config resolves to."""

# `from pretrain.config import load_config` is how the app, tools and tests read a config
from .run_config import (CheckpointConfig, Config, DataConfig, LogConfig, ModelConfig, TopologyConfig,
                         apply_overrides, builtin_configs, config_from_dict, load_config, parse_override)

__all__ = ["CheckpointConfig", "Config", "DataConfig", "LogConfig", "ModelConfig", "TopologyConfig",
           "apply_overrides", "builtin_configs", "config_from_dict", "load_config", "parse_override"]
