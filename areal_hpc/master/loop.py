"""The master loop: one global step at a time, over a step source (master/sources.py).

A step takes its samples from the source (rolled out now, waiting in the rollout store, or SFT sequences), runs
each trainer call of the graph on their data-parallel parts, publishes the new weights to the servers (RL),
lets the source record what it consumed, then logs, saves, evaluates and checkpoints as the frequencies say.
The master holds sample metadata only; data moves through batch files.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from areal_hpc.config import ExperimentConfig, allocation_of, mfc_spec
from areal_hpc.control import RunDir, fsio, timeline
from areal_hpc.data import CU, PromptDataset, read_batch, read_keys
from areal_hpc.eval import make_executor
from areal_hpc.gen import Episodes, Journals, is_single_turn, make_services
from areal_hpc.master.buffer import Buffer, SampleMeta
from areal_hpc.master.checkpoint import Checkpointer
from areal_hpc.master.checkpoint_evals import CheckpointEvals
from areal_hpc.master.counter import make_counter
from areal_hpc.master.dispatch import refs_payload, split_by_rank
from areal_hpc.master.evaluate import HeldoutEval
from areal_hpc.master.freq import FrequencyControl
from areal_hpc.master.graph import MFC, awaited
from areal_hpc.master.guard import StepGuard
from areal_hpc.master.sources import SftBatches, StepBatch, StoreRollouts, SyncRollouts
from areal_hpc.master.turns import Turns
from areal_hpc.monitor import StatsLog, TranscriptLog, open_writers, step_line, write_progress
from areal_hpc.recover import Preempted, rewind
from areal_hpc.weights import make_publisher

logger = logging.getLogger("master")
REWARD = "ppo_actor/task_reward/avg"


def sample_metas(path: str, groups: list[str], group_ids, lengths: list[int], keys, birth: float):
    """Buffer entries of one batch file: row r is in group groups[group_ids[r]], and is sample i of that group
    when i rows of the group come before it (a group has a row per answer, or per model turn of each answer)."""
    if len(group_ids) != len(lengths):
        raise ValueError(f"{path}: {len(group_ids)} group_ids for {len(lengths)} rows")
    outside = sorted({int(g) for g in group_ids if not 0 <= g < len(groups)})
    if outside:
        raise ValueError(f"{path}: group_ids {outside[:8]} are none of its {len(groups)} groups")
    seen = [0] * len(groups)
    metas = []
    for row, g in enumerate(map(int, group_ids)):
        sample_id = f"{groups[g]}/{seen[g]}"
        seen[g] += 1
        metas.append(SampleMeta(sample_id, groups[g], lengths[row], birth, {k: (path, row) for k in keys}))
    return metas


def file_rows(path: str) -> tuple[np.ndarray, list[int], list[str]]:
    """(group index of each row, length of each row, keys) of a batch file. A file without `group_ids` (the
    supervised warm-up's) has one row per group."""
    keys = [k for k in read_keys(path) if k != CU]
    arrays = read_batch(path, keys=[k for k in ("group_ids",) if k in keys])
    lengths = np.diff(arrays[CU]).tolist()
    return arrays.get("group_ids", np.arange(len(lengths))), lengths, keys


def frequency(ctrl, what: str) -> FrequencyControl:
    return FrequencyControl(*(getattr(ctrl, f"{what}_freq_{unit}") for unit in ("epochs", "steps", "secs")))


class Master:
    """The step loop over trainer ranks (`trainers`) and generation servers (`clients`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        run: RunDir,
        graph: list[MFC],
        data: tuple[PromptDataset, PromptDataset | None],
        trainers,
        clients: list,
        rewards,
        tokenizer,
        local: bool = True,
    ):
        train, heldout = data
        self.cfg, self.rundir, self.graph, self.trainers = cfg, run, graph, trainers
        self.layouts = {mfc.name: mfc_spec(cfg, mfc.name) for mfc in graph}  # the trainer ranks' per call
        self.rl = cfg.experiment_type == "ppo"
        self.guard = StepGuard()
        if not self.rl:
            self.source = SftBatches(cfg, run, train, tokenizer)
        elif cfg.async_rl:
            self.source = StoreRollouts(cfg, run, self.guard)
        else:
            episodes = None
            if not is_single_turn(cfg):
                groups = cfg.rollout.transcript_groups
                services = make_services(cfg, tokenizer, rewards, journals=Journals(run.episodes),
                                         transcripts=TranscriptLog(run, groups) if groups else None)  # fmt: skip
                episodes = Episodes(cfg, services, run)
            self.source = SyncRollouts(cfg, run, train, clients, rewards, episodes)
        self.buffer = Buffer([awaited(mfc) for mfc in graph])  # no call waits for an optional key
        self.counter = make_counter(cfg, len(train))
        self.stats = StatsLog(run.stats)
        self.evaluate = HeldoutEval(clients, heldout, rewards, cfg.ppo.gen.max_new_tokens, self.stats)
        self.save_ctl, self.eval_ctl, self.ckpt_ctl = (
            frequency(cfg.exp_ctrl, w) for w in ("save", "eval", "ckpt")
        )
        executor = make_executor(cfg, run.evals / "jobs", local) if cfg.eval.enabled else None
        self.checkpoint_evals = CheckpointEvals(cfg, run, self.stats, executor)
        components = {"counter": self.counter, "source": self.source, "eval": self.evaluate}
        components["checkpoint_evals"] = self.checkpoint_evals
        components |= {"save_ctl": self.save_ctl, "eval_ctl": self.eval_ctl, "ckpt_ctl": self.ckpt_ctl}
        self.checkpointer = Checkpointer(cfg, run, trainers, components)
        self.publisher = make_publisher(cfg, run, trainers, clients)
        self.turns = Turns(
            clients, allocation_of(cfg).colocated and self.rl, cfg.weight_update_timeout_secs,
            keep_weights=cfg.weight_update_mode == "adapter",
        )  # fmt: skip

    def run(self, resume_from=None, attempt: int = 0) -> list[tuple[int, float]]:
        """Every step (from recover checkpoint `resume_from` if given), with held-out greedy accuracy before
        and after RL; the evaluation history."""
        c = self.counter
        logger.info("Training %d steps (%d epochs of %d steps), graph %s", c.total_steps, c.total_epochs,
                    c.steps_per_epoch, [m.name for m in self.graph])  # fmt: skip
        self.trainers.call_all("initialize", {
            "total_train_steps": c.total_steps,
            "mfcs": {mfc.name: mfc.model for mfc in self.graph},
            "realloc_snapshots": {mfc.model: str(self.rundir.realloc_snapshot(mfc.model)) for mfc in self.graph},
        })  # fmt: skip
        self.start(resume_from, attempt)
        with self.guard.checkpoint_on_term(self.checkpoint_and_stop), contextlib.closing(self.stats):
            if self.rl and c.global_step == 0:
                self.evaluate(0)
            while not c.done:
                self.step()
            self.checkpointer.finish()
            if self.rl:
                self.evaluate(c.global_step)
            self.checkpoint_evals.finish(timeout=self.cfg.eval.time_limit_mins * 60)
        return self.evaluate.history

    def step(self) -> None:
        """One global step; on the run's timeline a `step` span (all of it) holding a span for each part."""
        start, step = time.monotonic(), self.counter.global_step
        with timeline.span("step", step=step + 1):
            with timeline.span("rollout"):
                batch = self.source.next(step)
            # Colocated: the servers free the shared GPUs.
            stats = dict(batch.stats) | self.turns.to_trainers()
            with timeline.span("buffer"):
                n_samples = self.add(batch, birth=start)
            for mfc in self.graph:
                with timeline.span(mfc.name):
                    stats |= self.run_mfc(mfc, step, n_samples)
            if self.rl:
                stats |= self.publish()
            self.source.consumed(step, batch)
            self.finish_step(stats, start)

    def finish_step(self, stats: dict[str, float], step_start: float) -> None:
        c = self.counter
        secs = time.monotonic() - step_start
        c.step_secs.append(secs)
        c.global_step += 1
        stats["timeperf/e2e"] = secs
        with timeline.span("log"):
            self.stats.write(c.global_step, stats)
            self.guard.step_done()
            self.checkpointer.finish(wait=False)  # seal a checkpoint whose shards were written in the step
            self.checkpoint_evals.poll()
        logger.info(step_line(c, secs))
        metric, value = ("reward", stats.get(REWARD)) if self.rl else ("loss", stats.get("sft/loss"))
        write_progress(self.rundir.progress, c.global_step, c.total_steps, metric, value, c.eta_secs())
        epoch_done, last = int(c.epoch_step == 0), c.done
        if self.save_ctl.check(epochs=epoch_done, steps=1) or last:
            with timeline.span("save"):
                self.save()
        if self.eval_ctl.check(epochs=epoch_done, steps=1) and not self.guard.urgent:
            with timeline.span("evaluate"):
                self.evaluate(c.global_step)
        due = self.ckpt_ctl.check(epochs=epoch_done, steps=1)
        if self.cfg.recover_mode != "disabled" and not last and (due or self.guard.stop_after_step):
            with timeline.span("checkpoint"):
                self.checkpointer.save(c.global_step, wait=bool(self.guard.stop_after_step))
        if self.guard.stop_after_step and not last:
            raise Preempted(f"{self.guard.stop_after_step}: stopped after global step {c.global_step}")

    # --- one step's parts -------------------------------------------------------------------------------------

    def add(self, batch: StepBatch, birth: float) -> int:
        """Buffer entries of the step's batch files; how many samples they hold (a group's rows vary in number
        when the rollout exports a sample per model turn)."""
        n_samples = 0
        for path, groups in batch.files:
            metas = sample_metas(path, groups, *file_rows(path), birth=birth)
            self.buffer.add(metas)
            n_samples += len(metas)
        return n_samples

    def run_mfc(self, mfc: MFC, step: int, n_samples: int) -> dict[str, float]:
        """One call on every rank: its data-parallel part in, outputs amended into the buffer."""
        start, buffer = time.monotonic(), self.buffer
        if mfc.kind == "train_step":
            self.guard.begin_update(f"{mfc.name} of step {step + 1}")
        samples = buffer.ready(mfc.name, n_samples)
        if samples is None:
            raise RuntimeError(f"{mfc.name}: fewer than {n_samples} samples have its inputs {mfc.inputs}")
        # A part per data-parallel replica of the call's layout; its first rank (TP, PP and CP rank 0) writes
        # the outputs.
        layout = self.layouts[mfc.name]
        parts = split_by_rank(samples, layout.data)
        # A key some samples lack is not sent: a dataset key or an optional one (graph.OPTIONAL_KEYS).
        keys = [k for k in mfc.inputs if all(k in s.keys for s in samples)]
        payloads, written = [], []
        for rank in range(self.trainers.n_ranks):
            dp, tp, pp, cp = layout.coords(rank)
            first = tp == pp == cp == 0
            out = str(self.rundir.step_data(step) / f"{mfc.name}.r{rank}.h5") if first else None
            refs = refs_payload(parts[dp], keys)  # global_step: for head/tail off-policyness
            payloads.append({"mfc": mfc.name, "refs": refs, "out": out, "global_step": step})
            if out and mfc.outputs:
                written.append((parts[dp], out))
        results = self.trainers.call(mfc.kind, payloads)
        for part, out in written:
            buffer.amend([s.sample_id for s in part], out, mfc.outputs)
        buffer.consume(mfc.name, [s.sample_id for s in samples])
        # A train step's statistics (the losses are the last pipeline stage's), a reallocation's seconds.
        stats = dict(results[layout.rank_of(0, 0, layout.pipeline - 1)].get("stats", {}))
        stats[f"timeperf/{mfc.name}"] = time.monotonic() - start
        return stats

    def publish(self, new_version: bool = True) -> dict[str, float]:
        """The next weight version (or, resuming, the current one again) to every server (`weights`);
        `timeperf/weight_sync` and the bytes sent. The version the servers hold goes to the run directory."""
        self.counter.version += int(new_version)
        version = self.counter.version
        try:
            if self.guard.urgent:  # the servers are stopping too; a resume republishes the trainers' weights
                raise RuntimeError("not sent after SIGTERM")
            with timeline.span("publish", version=version):
                stats = self.turns.publish(lambda: self.publisher.publish(version))
        except Exception as exc:
            if not self.guard.urgent:  # SIGTERM may come while the servers take the weights
                raise
            logger.warning("SIGTERM: weight version %d not published: %s", version, exc)
            return {}
        fsio.write_json(self.rundir.published_version, {"version": version})
        return stats

    def save(self) -> None:
        """A persistent checkpoint of the actor (REFERENCE section 1 naming): HF weights, or a LoRA actor's
        adapters as a PEFT folder (`areal-hpc export --merge` folds them into their base)."""
        c = self.counter
        last_epoch_step = (c.global_step - 1) % c.steps_per_epoch + 1
        path = self.rundir.checkpoint(
            "actor", (c.global_step - 1) // c.steps_per_epoch, last_epoch_step, c.global_step
        )
        if self.cfg.actor.lora.rank:
            self.trainers.call_all("save_adapter", {"path": str(path)})
        else:
            self.trainers.call_all("save", {"model": "actor", "path": str(path)})
        logger.info("Saved actor %s to %s", "adapters" if self.cfg.actor.lora.rank else "weights", path)
        self.checkpoint_evals.submit(c.global_step, path)

    # --- starting and stopping --------------------------------------------------------------------------------

    def start(self, resume_from, attempt: int) -> None:
        """Resume from a recover checkpoint, or start afresh (clearing what an earlier attempt left); then tell
        the other roles where this attempt starts (`RunDir.start_point`)."""
        c = self.counter
        if resume_from is None:
            rewind(self.rundir, 0, 0)
        else:
            with timeline.span("resume", checkpoint=str(resume_from)):
                self.checkpointer.load(resume_from)
            rewind(self.rundir, c.global_step, c.version, resume_from)
            if c.version:  # the servers started from actor.path: give them the restored weights
                self.publish(new_version=False)
            logger.info("Resumed from %s: global step %d (epoch %d), weight version %d",
                        resume_from, c.global_step, c.epoch + 1, c.version)  # fmt: skip
        first_step = c.global_step + 1 if resume_from else 0  # TensorBoard forgets the lost future from there
        self.stats.followers = open_writers(self.cfg, self.rundir, attempt, first_step)
        point = {"attempt": attempt, "global_step": c.global_step, "version": c.version}
        fsio.write_json(self.rundir.start_point, point, fsync=True)

    def checkpoint_and_stop(self, cause: Exception) -> None:
        """After SIGTERM: a recover checkpoint of the last finished step, if there is none yet; then `Preempted`."""
        step = self.counter.global_step
        logger.warning("step %d given up: %s", step + 1, cause)
        if self.cfg.recover_mode != "disabled" and step > 0 and not self.checkpointer.has(step):
            self.checkpointer.save(step, wait=True)
        self.checkpointer.finish()  # one still being written
        raise Preempted(f"{self.guard.stop_after_step}: stopped after global step {step}") from cause
