"""The megatron-core backend: tensor, pipeline and data parallel (`actor.backend: megatron`; the layout's TP and
PP sizes come from allocation_mode).

    model     the GPTModel of an HF config, with our packed attention and a hidden-state last stage
    convert   HF <-> Megatron weights per TP rank and PP stage (pure)
    parallel  Megatron's groups from the TP and PP sizes; what the CPU path substitutes
    engine    MegatronEngine: a TrainEngine on Megatron's DDP, distributed optimizer and schedules
"""

from areal_hpc.train.backends.megatron.engine import MegatronEngine as Engine

__all__ = ["Engine"]
