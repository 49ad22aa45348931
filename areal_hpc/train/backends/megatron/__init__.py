"""The megatron-core backend: tensor, pipeline, data and expert parallel (`actor.backend: megatron`; the layout's
TP, PP and EP sizes come from allocation_mode).

    model     the GPTModel of an HF config, with our packed attention and a hidden-state last stage
    experts   a mixture-of-experts layer's routed experts as grouped matrix products
    convert   HF <-> Megatron weights per TP rank, PP stage and EP rank (pure)
    parallel  Megatron's groups from the TP, PP and EP sizes; what the CPU path substitutes
    moe       the auxiliary losses' scale, routing statistics, micro-batch shapes for EP and sequence parallel
    engine    MegatronEngine: a TrainEngine on Megatron's DDP, distributed optimizer and schedules
"""

from areal_hpc.train.backends.megatron.engine import MegatronEngine as Engine

__all__ = ["Engine"]
