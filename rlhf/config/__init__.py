"""Typed run configuration: schema, YAML + dotted overrides, validation."""

from rlhf.config.loader import ConfigError, dump_yaml, load_config
from rlhf.config.schema import RLHFConfig
from rlhf.config.validate import validate_config

__all__ = ["ConfigError", "RLHFConfig", "dump_yaml", "load_config", "validate_config"]
