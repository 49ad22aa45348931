"""The controller: the master loop over step sources, the dataflow graph of model function calls, the sample
buffer, the trainer ranks as the master calls them, and its recover checkpoints. The role's entry point is
`master.role`."""

from areal_hpc.master.graph import ALL_MFCS, MFC, build_graph, kept_mfcs
from areal_hpc.master.loop import Master
from areal_hpc.master.trainers import TrainerGroup

__all__ = ["ALL_MFCS", "MFC", "Master", "TrainerGroup", "build_graph", "kept_mfcs"]
