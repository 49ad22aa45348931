"""Each answer scored by its prompt's task: math by the math verifier; stem by its letter or number where one
decides it (reward/stem.py), else as math (the original scores stem with its math checker); code by running
the task's tests in the sandbox. A `reward.fn` of the user's scores every answer instead (reward/custom.py).

    with TaskRewards(cfg.reward, math_workers=2, tasks={"math", "code"}) as rewards:
        success = rewards.score_batch([(answer_text, prompt_sample, answer_ids), ...])   # in [0, 1] each

The sandbox is made at once when `tasks` has code (its log line says which protections it has), else with the
first code answer; a run without code tasks starts none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence

from areal_hpc.algo import MathVerifier
from areal_hpc.config import RewardConfig
from areal_hpc.data import PromptSample
from areal_hpc.reward.code import CodeVerifier
from areal_hpc.reward.custom import CustomReward, Item
from areal_hpc.reward.sandbox import Limits, Sandbox
from areal_hpc.reward.stem import stem_verdict

logger = logging.getLogger(__name__)


class TaskRewards:
    def __init__(self, cfg: RewardConfig, math_workers: int = 2, tasks: Collection[str] = ()):
        self.cfg = cfg
        self.custom = CustomReward(cfg) if cfg.fn is not None else None
        self.math = MathVerifier(n_workers=math_workers) if self.custom is None else None
        self._code: CodeVerifier | None = None
        self._lock = threading.Lock()
        if "code" in tasks and self.custom is None:
            self._make_code()  # now, so that the log says its protections before the first step

    def score_batch(self, items: Sequence[Item]) -> list[float]:
        """Success of each (answer text, its prompt, the answer's token ids): 1.0 or 0.0 (a reward.fn's own
        scores as it returns them)."""
        if self.custom is not None:
            return self.custom.score_batch(items)
        scores = [0.0] * len(items)
        by_math, by_code = [], []
        for i, (text, prompt, _) in enumerate(items):
            if prompt.task == "code":
                by_code.append(i)
            elif (decided := _stem_score(text, prompt)) is not None:
                scores[i] = decided
            else:
                by_math.append(i)
        if by_math:
            math = self.math.verify_batch([(items[i][0], list(items[i][1].solutions)) for i in by_math])
            for i, score in zip(by_math, math, strict=True):
                scores[i] = float(score)
        if by_code:
            verdicts = self._make_code().verify_batch([(items[i][0], items[i][1].tests) for i in by_code])
            for i, ok in zip(by_code, verdicts, strict=True):
                scores[i] = float(ok)
        return scores

    def _make_code(self) -> CodeVerifier:
        """The code verifier, made with the first call."""
        with self._lock:
            if self._code is None:
                cfg = self.cfg
                limits = Limits(time_secs=cfg.code_time_secs, memory_mb=cfg.code_memory_mb)
                sandbox = Sandbox(limits, isolation=cfg.code_isolation)
                isolated = sandbox.protections.isolated
                logger.log(
                    logging.INFO if isolated else logging.WARNING,
                    "code rewards: %s",
                    sandbox.protections.describe(),
                )
                self._code = CodeVerifier(sandbox, cfg.code_workers)
            return self._code

    def close(self) -> None:
        for scorer in (self.custom, self.math, self._code):
            if scorer is not None:
                scorer.close()

    def __enter__(self) -> TaskRewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stem_score(text: str, prompt: PromptSample) -> float | None:
    """A stem answer's score where its letter or number decides it (against any of the solutions), else None."""
    if prompt.task != "stem":
        return None
    verdicts = [stem_verdict(text, solution) for solution in prompt.solutions]
    if True in verdicts:
        return 1.0
    return 0.0 if all(v is False for v in verdicts) else None
