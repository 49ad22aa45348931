"""Configuration: the schema, YAML loading with overrides, validation and generated docs."""

from areal_hpc.config.loader import ConfigError, dump_yaml, load_config, to_dict
from areal_hpc.config.schema import ExperimentConfig

__all__ = ["ConfigError", "ExperimentConfig", "dump_yaml", "load_config", "to_dict"]
