"""Evaluation: held-out greedy accuracy during training (`heldout`); the evaluation sets and the R1-style
instruction (`datasets`); the original's metrics, greedy_acc, sample_pass@1, unbiased pass@k, maj@k and
answer lengths (`metrics`); `areal-hpc eval`, a checkpoint's answers to the sets and their metrics
(`evaluator`, loaded when first named: it brings the generation stage, which the launcher does not load);
an evaluation as a job of its own (`jobs`)."""

from areal_hpc.eval.datasets import EVAL_SETS, EvalDataError, EvalQuestion, load_eval_set
from areal_hpc.eval.heldout import greedy_accuracy
from areal_hpc.eval.jobs import make_executor, outside_this_job
from areal_hpc.eval.metrics import Question, dataset_metrics

__all__ = [
    "EVAL_SETS",
    "EvalDataError",
    "EvalOptions",
    "EvalQuestion",
    "Question",
    "dataset_metrics",
    "evaluate",
    "greedy_accuracy",
    "load_eval_set",
    "make_executor",
    "outside_this_job",
    "results_table",
]


def __getattr__(name: str):
    if name in ("EvalOptions", "evaluate", "results_table"):
        from areal_hpc.eval import evaluator

        return getattr(evaluator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
