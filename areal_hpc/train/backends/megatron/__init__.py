"""The megatron-core backend: tensor, pipeline and data parallel (issue 13; not a config choice until the
trainer dispatches data per data-parallel replica).

    model     the GPTModel of an HF config, with our packed attention and a hidden-state last stage
    convert   HF <-> Megatron weights per TP rank and PP stage (pure)
    parallel  Megatron's groups from the TP and PP sizes; what the CPU path substitutes
    engine    MegatronEngine: a TrainEngine on Megatron's DDP, distributed optimizer and schedules
"""

from areal_hpc.train.backends.megatron.engine import MegatronEngine as Engine

__all__ = ["Engine"]
