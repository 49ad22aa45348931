"""A reward function of the user's (`reward.fn`), called in worker processes under our timeout.

One answer a call (AReaL-lite's signature), plain or async:

    def score(prompt, completion, prompt_ids, completion_ids, **fields) -> float

or, with `reward.fn_batch`, a batch a call (lists, TRL's convention), returning one score per answer:

    def score(prompts, completions, prompt_ids, completion_ids, **fields) -> list[float]

`prompt` is the dataset's prompt text, `prompt_ids` its tokens as generated from (chat template included),
`completion` the decoded answer; `fields` are the dataset line's other fields (query_id, solutions, ... , in a
batch each a list). A score stands for the task success (1 right, 0 wrong, between allowed): the reward is
((score - 0.5) * 2 - bias) * scaling as for built-in tasks. A call that overruns `reward.fn_timeout_secs` is
killed and its answers score 0; a call that raises, or returns something else than numbers, fails the run with
the function's traceback: a bug in the scorer must not train the policy on zeros.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from areal_hpc.algo import Outcome, TimedPool
from areal_hpc.config import RewardConfig, extensions
from areal_hpc.data import PromptSample

Item = tuple[str, PromptSample, Sequence[int]]  # (answer text, its prompt, the answer's token ids)


class RewardFnError(RuntimeError):
    """reward.fn raised or returned something that is not a score; the message holds its traceback."""


def sample_call(prompt: PromptSample, text: str, completion_ids: Sequence[int]) -> tuple[tuple, dict]:
    """(args, kwargs) of a per-answer call."""
    return (prompt.prompt, text, list(prompt.input_ids), list(completion_ids)), dict(prompt.fields or {})


def batch_call(items: Sequence[Item]) -> tuple[tuple, dict]:
    """(args, kwargs) of a batch call: lists, the fields as columns (a field a line lacks is None there)."""
    names = sorted({name for _, prompt, _ in items for name in prompt.fields or {}})
    columns = {name: [(prompt.fields or {}).get(name) for _, prompt, _ in items] for name in names}
    args = (
        [prompt.prompt for _, prompt, _ in items],
        [text for text, _, _ in items],
        [list(prompt.input_ids) for _, prompt, _ in items],
        [list(ids) for _, _, ids in items],
    )
    return args, columns


class CustomReward:
    """`reward.fn` in a TimedPool of `reward.fn_workers` processes."""

    def __init__(self, cfg: RewardConfig):
        self.spec, self.batch, self.timeout = cfg.fn, cfg.fn_batch, cfg.fn_timeout_secs
        self.pool = TimedPool(
            extensions.target("reward.fn", cfg.fn),
            cfg.fn_workers,
            cfg.fn_timeout_secs,
            name=f"reward.fn {cfg.fn}",
        )

    def score_batch(self, items: Sequence[Item]) -> list[float]:
        if not items:
            return []
        if self.batch:
            args, kwargs = batch_call(items)
            (outcome,) = self.pool.run([args], [kwargs])
            return self._scores(outcome, items)
        calls = [sample_call(prompt, text, ids) for text, prompt, ids in items]
        outcomes = self.pool.run([args for args, _ in calls], [kwargs for _, kwargs in calls])
        return [self._scores(outcome, [item])[0] for outcome, item in zip(outcomes, items, strict=True)]

    def _scores(self, outcome: Outcome, items: Sequence[Item]) -> list[float]:
        where = f"reward.fn {self.spec} on query {items[0][1].query_id}" + (
            f" and {len(items) - 1} other answers" if len(items) > 1 else ""
        )
        if outcome.status == "timeout":
            return [0.0] * len(items)
        if outcome.status == "error":
            raise RewardFnError(f"{where} failed:\n{outcome.value}")
        values = outcome.value if self.batch else [outcome.value]
        if self.batch and (not isinstance(values, list | tuple) or len(values) != len(items)):
            raise RewardFnError(
                f"{where} returned {values!r:.200}; a batch reward.fn returns {len(items)} scores"
            )
        bad = [v for v in values if not _is_score(v)]
        if bad:
            raise RewardFnError(f"{where} returned {bad[0]!r:.200}; a score is a finite number")
        return [float(v) for v in values]

    def close(self) -> None:
        self.pool.close()


def _is_score(value: object) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)  # numpy's scalars too
