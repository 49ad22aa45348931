"""Configuration: the schema, YAML loading with overrides, validation, the backends' table, generated docs.

schema    the dataclasses of every option (help text, choices, bounds); ConfigError, InputError
algorithm the algorithm's sections of the schema (ppo, ppo.gen, ppo.behav_correction), re-exported by schema
fields    `opt`, the field maker of schema and algorithm
loader    YAML files and `key=value` overrides into the schema, each value remembering its file:line
checks    per-field bounds and choices, cross-field rules, allocation_mode against backends and cluster
inert     options that do nothing in the mode a config runs in: refused where set, else dropped
lora      a LoRA actor against the rest of a config, and the modules its servers adapt
backends  the training and generation backends a config can name, and what each can do
extensions the user's code a config names (reward.fn, dataset.loader, actor.interface): forms, import, signature
docs      docs/config.md and `areal-hpc config options`, rendered from the schema
"""

from areal_hpc.config import extensions
from areal_hpc.config.algorithm import MAX_STOP_TOKEN_IDS
from areal_hpc.config.backends import (
    GEN_BACKENDS,
    TRAIN_BACKENDS,
    Backend,
    megatron_model_problems,
    moe_experts,
)
from areal_hpc.config.checks import (
    MFCS_OF,
    allocation_of,
    data_parallel_size,
    gen_backend,
    mfc_spec,
    trainer_models,
)
from areal_hpc.config.docs import render_markdown, render_options
from areal_hpc.config.extensions import ExtensionError
from areal_hpc.config.loader import dump_yaml, load_config, to_dict
from areal_hpc.config.lora import server_targets
from areal_hpc.config.schema import (
    ActorConfig,
    BehavCorrectionConfig,
    ConfigError,
    DatasetConfig,
    EvalConfig,
    ExpCtrlConfig,
    ExperimentConfig,
    InputError,
    MicroBatchSpec,
    ModelConfig,
    OptimizerConfig,
    PPOConfig,
    RewardConfig,
    SGLangConfig,
    TrainedModelConfig,
)

__all__ = [
    "GEN_BACKENDS",
    "MAX_STOP_TOKEN_IDS",
    "MFCS_OF",
    "TRAIN_BACKENDS",
    "megatron_model_problems",
    "moe_experts",
    "ActorConfig",
    "Backend",
    "BehavCorrectionConfig",
    "ExtensionError",
    "ConfigError",
    "DatasetConfig",
    "EvalConfig",
    "RewardConfig",
    "SGLangConfig",
    "ExpCtrlConfig",
    "ExperimentConfig",
    "InputError",
    "MicroBatchSpec",
    "ModelConfig",
    "OptimizerConfig",
    "PPOConfig",
    "TrainedModelConfig",
    "allocation_of",
    "data_parallel_size",
    "gen_backend",
    "dump_yaml",
    "extensions",
    "load_config",
    "mfc_spec",
    "server_targets",
    "render_markdown",
    "render_options",
    "to_dict",
    "trainer_models",
]
