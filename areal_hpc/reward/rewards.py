"""Each answer scored by its prompt's task: math and stem by the math verifier (as the original scores stem),
code by running the task's tests in the sandbox.

    with TaskRewards(cfg.reward, math_workers=2) as rewards:
        success = rewards.score_batch([(answer_text, prompt_sample), ...])   # in [0, 1] each

The sandbox is made with the first code answer (its log line says which protections it has), so a run
without code tasks starts no sandbox.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from areal_hpc.algo import MathVerifier
from areal_hpc.config import RewardConfig
from areal_hpc.data import PromptSample
from areal_hpc.reward.code import CodeVerifier
from areal_hpc.reward.sandbox import Limits, Sandbox

logger = logging.getLogger(__name__)


class TaskRewards:
    def __init__(self, cfg: RewardConfig, math_workers: int = 2):
        self.cfg = cfg
        self.math = MathVerifier(n_workers=math_workers)
        self._code: CodeVerifier | None = None
        self._lock = threading.Lock()

    def score_batch(self, items: Sequence[tuple[str, PromptSample]]) -> list[float]:
        """Success of each (answer text, its prompt): 1.0 or 0.0."""
        code = [i for i, (_, prompt) in enumerate(items) if prompt.task == "code"]
        other = [i for i, (_, prompt) in enumerate(items) if prompt.task != "code"]
        scores = [0.0] * len(items)
        if other:
            math = self.math.verify_batch([(items[i][0], list(items[i][1].solutions)) for i in other])
            for i, score in zip(other, math, strict=True):
                scores[i] = float(score)
        if code:
            verdicts = self.code.verify_batch([(items[i][0], items[i][1].tests) for i in code])
            for i, ok in zip(code, verdicts, strict=True):
                scores[i] = float(ok)
        return scores

    @property
    def code(self) -> CodeVerifier:
        with self._lock:
            if self._code is None:
                cfg = self.cfg
                sandbox = Sandbox(Limits(time_secs=cfg.code_time_secs, memory_mb=cfg.code_memory_mb))
                logger.info("code rewards: %s", sandbox.protections.describe())
                self._code = CodeVerifier(sandbox, cfg.code_workers)
            return self._code

    def close(self) -> None:
        self.math.close()
        if self._code is not None:
            self._code.close()

    def __enter__(self) -> TaskRewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
