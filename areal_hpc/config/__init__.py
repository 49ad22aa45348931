"""Configuration: the schema, YAML loading with overrides, validation and generated docs."""

from areal_hpc.config.backends import GEN_BACKENDS, TRAIN_BACKENDS, Backend
from areal_hpc.config.loader import dump_yaml, load_config, to_dict
from areal_hpc.config.schema import ConfigError, ExperimentConfig, InputError

__all__ = [
    "GEN_BACKENDS",
    "TRAIN_BACKENDS",
    "Backend",
    "ConfigError",
    "ExperimentConfig",
    "InputError",
    "dump_yaml",
    "load_config",
    "to_dict",
]
