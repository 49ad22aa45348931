"""Evaluation: held-out greedy accuracy during training."""

from areal_hpc.eval.heldout import greedy_accuracy

__all__ = ["greedy_accuracy"]
