"""Evaluation of each saved checkpoint in a job of its own (`eval.enabled`): `eval.evaluate` on the checkpoint,
as a Slurm job on the generation partition (submitit's SlurmExecutor) or, under `areal-hpc run`, a local
process (its LocalExecutor). When a job is done its metrics join the run's statistics under `eval/<set>/` at
the checkpoint's step. A job that fails is logged with the end of its log and never stops training.

At most `eval.max_concurrent_jobs` run at once; later checkpoints wait their turn. A component of recover
checkpoints: the checkpoints not evaluated yet are evaluated again after a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import submitit

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import RunDir
from areal_hpc.eval import EvalOptions, evaluate, outside_this_job
from areal_hpc.monitor import StatsLog

logger = logging.getLogger("master")
POLL_SECS = 2.0


class CheckpointEvals:
    """The evaluation jobs of a run's saved checkpoints, each collected into `stats` when it is done."""

    def __init__(
        self, cfg: ExperimentConfig, run: RunDir, stats: StatsLog, executor, job: Callable = evaluate
    ):
        self.cfg, self.run, self.stats, self.executor, self.job = cfg, run, stats, executor, job
        self.waiting: list[tuple[int, str]] = []  # (step, checkpoint) not started yet
        self.running: dict[int, tuple[str, submitit.Job]] = {}  # step -> (checkpoint, its job)
        self.done: set[int] = set()  # the steps whose evaluation is in the statistics

    def submit(self, step: int, checkpoint: str | Path) -> None:
        """Evaluate `checkpoint`, saved at `step`, when a job slot is free."""
        if self.cfg.eval.enabled:
            self.waiting.append((step, str(checkpoint)))
            self.poll()

    def poll(self) -> None:
        """Collect the jobs that are done; start waiting ones in the free slots (answers at once)."""
        for step, (checkpoint, job) in list(self.running.items()):
            if job.done():
                del self.running[step]
                self._collect(step, checkpoint, job)
        while self.waiting and len(self.running) < self.cfg.eval.max_concurrent_jobs:
            step, checkpoint = self.waiting.pop(0)
            self._start(step, checkpoint)

    def finish(self, timeout: float) -> None:
        """Wait for every evaluation (at the end of the run), at most `timeout` seconds; cancel what is left."""
        deadline = time.monotonic() + timeout
        while (self.waiting or self.running) and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_SECS)
        for step, (checkpoint, job) in self.running.items():
            logger.warning(
                "evaluation of %s (step %d) unfinished after %.0f s: cancelled", checkpoint, step, timeout
            )
            job.cancel(check=False)
        for step, checkpoint in self.waiting:
            logger.warning("evaluation of %s (step %d) never started", checkpoint, step)

    def _start(self, step: int, checkpoint: str) -> None:
        ev = self.cfg.eval
        try:  # a refused evaluation is a failed evaluation, not a failed run
            opts = EvalOptions(
                checkpoint, str(self.run.eval_results(step)), tuple(ev.data_names), ev.data_dir,
                ev.max_gen_tokens, ev.n_sampling, ev.temperature, ev.top_p, ev.top_k, ev.n_gpus, seed=self.cfg.seed,
            )  # fmt: skip
            with outside_this_job():
                job = self.executor.submit(self.job, opts)
        except Exception as exc:
            logger.warning("evaluation of %s (step %d) not submitted: %s", checkpoint, step, exc)
            return
        logger.info("evaluating %s (step %d) in job %s", checkpoint, step, job.job_id)
        self.running[step] = checkpoint, job

    def _collect(self, step: int, checkpoint: str, job: submitit.Job) -> None:
        try:
            results = job.result()
        except Exception as exc:
            why = [line for line in (job.stderr() or str(exc)).splitlines() if line.strip()][-1:]
            logger.warning("evaluation of %s (step %d) failed: %s (its log: %s)", checkpoint, step,
                           why[0] if why else exc, job.paths.stderr)  # fmt: skip
            return
        self.done.add(step)
        self.stats.write(
            step, {f"eval/{name}/{k}": v for name, metrics in results.items() for k, v in metrics.items()}
        )
        logger.info("evaluation of step %d: %s", step,
                    ", ".join(f"{n} greedy_acc {m['greedy_acc']:.1f}" for n, m in results.items()))  # fmt: skip

    def state_dict(self) -> dict:
        pending = sorted([*self.waiting, *((s, c) for s, (c, _) in self.running.items())])
        return {"pending": [list(p) for p in pending], "done": sorted(self.done)}

    def load_state_dict(self, state: dict) -> None:
        """Evaluate again what a checkpointed run had not finished evaluating (its jobs died with it)."""
        self.done = set(state.get("done", []))
        self.waiting = [(int(step), checkpoint) for step, checkpoint in state.get("pending", [])]
