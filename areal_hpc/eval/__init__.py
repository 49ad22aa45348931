"""Evaluation: held-out greedy accuracy during training (`heldout`); the original's evaluation metrics,
greedy_acc, sample_pass@1, unbiased pass@k, maj@k and answer lengths (`metrics`)."""

from areal_hpc.eval.heldout import greedy_accuracy
from areal_hpc.eval.metrics import Question, dataset_metrics

__all__ = ["Question", "dataset_metrics", "greedy_accuracy"]
