"""The master loop of synchronous PPO/GRPO and of supervised warm-up: one global step at a time.

Per step: pick the step's prompts, roll them out (generation + reward), run each trainer call of the graph
on its data-parallel parts, publish the new weights to the servers, then log, save and evaluate as the
frequencies say. The master holds sample metadata only; data moves through batch files.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.config.schema import ExperimentConfig
from areal_hpc.control import fsio
from areal_hpc.control.heartbeat import dead_workers
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.rundir import RunDir
from areal_hpc.data.batch import read_attrs, read_batch, read_keys, write_batch
from areal_hpc.data.dataset import PromptDataset, ShardedSampler
from areal_hpc.data.sft import sft_arrays
from areal_hpc.data.store import RolloutStore
from areal_hpc.eval.heldout import greedy_accuracy
from areal_hpc.gen.rollout import rollout_step
from areal_hpc.master.buffer import Buffer, SampleMeta
from areal_hpc.master.dispatch import refs_payload, split_by_rank
from areal_hpc.master.freq import FrequencyControl
from areal_hpc.master.graph import MFC
from areal_hpc.monitor.progress import write_progress
from areal_hpc.monitor.stats import StatsLog, step_line
from areal_hpc.recover.checkpoint import Checkpoints
from areal_hpc.recover.rewind import rewind, save_into
from areal_hpc.recover.signals import Interrupted, Preempted, PreemptNotice
from areal_hpc.recover.state import check_compatible, identity
from areal_hpc.weights.publisher import make_publisher

logger = logging.getLogger("master")
STORE_POLL_SECS = 0.05
ROLLOUT_DEAD_SECS = 60.0


@dataclass
class StepCounter:
    """Where the run is: epoch and step within it, global step, and the weight version the servers hold."""

    steps_per_epoch: int
    total_epochs: int
    total_steps: int
    global_step: int = 0
    version: int = 0
    step_secs: list[float] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    @property
    def epoch_step(self) -> int:
        return self.global_step % self.steps_per_epoch

    def eta_secs(self) -> float:
        recent = self.step_secs[-10:]
        return sum(recent) / max(len(recent), 1) * (self.total_steps - self.global_step)


def make_counter(cfg: ExperimentConfig, sampler: ShardedSampler) -> StepCounter:
    steps_per_epoch = len(sampler)
    total = steps_per_epoch * cfg.exp_ctrl.total_train_epochs
    if cfg.exp_ctrl.benchmark_steps is not None:
        total = min(total, cfg.exp_ctrl.benchmark_steps)
    return StepCounter(steps_per_epoch, cfg.exp_ctrl.total_train_epochs, total)


def sample_metas(gen_path: str, groups: list[str], group_size: int, lengths: list[int], keys, birth: float):
    """Buffer entries of one rollout file: sample i of group g is row g * group_size + i."""
    return [
        SampleMeta(
            sample_id=f"{groups[row // group_size]}/{row % group_size}",
            group=groups[row // group_size],
            seqlen=lengths[row],
            birth_time=birth,
            keys={k: (gen_path, row) for k in keys},
        )
        for row in range(len(lengths))
    ]


def rollout_stats(paths: list, attrs: list[dict]) -> dict[str, float]:
    """Statistics of the groups a step trains on, as the synchronous rollout reports them."""
    answer_lens, no_eos = [], []
    for path in paths:
        arrays = read_batch(path, keys=["prompt_mask", "seq_no_eos_mask"])
        cu = arrays["cu_seqlens"]
        answer_lens += [
            int((~arrays["prompt_mask"][a:b]).sum()) for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
        no_eos += arrays["seq_no_eos_mask"].tolist()
    return {
        "rollout/answer_len/avg": float(np.mean(answer_lens)),
        "rollout/no_eos_ratio": float(np.mean(no_eos)),
        "rollout/interrupted_answers": float(sum(a["n_interrupted"] for a in attrs)),
        "rollout/gen_secs/avg": float(np.mean([a["gen_secs"] for a in attrs])),
    }


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
        verifier,
        tokenizer,
    ):
        self.cfg, self.rundir, self.graph = cfg, run, graph
        self.dataset, self.heldout = data
        self.trainers, self.clients, self.verifier, self.tokenizer = trainers, clients, verifier, tokenizer
        self.buffer = Buffer(graph)
        self.store = RolloutStore(run.rollouts)
        self.ledger = Ledger(run.ledger)
        self.eval_history: list[tuple[int, float]] = []
        self.sampler = ShardedSampler(len(self.dataset), 0, 1, cfg.seed, cfg.dataset.train_bs_n_seqs)
        self.counter = make_counter(cfg, self.sampler)
        ctrl = cfg.exp_ctrl
        self.save_ctl = FrequencyControl(ctrl.save_freq_epochs, ctrl.save_freq_steps, ctrl.save_freq_secs)
        self.eval_ctl = FrequencyControl(ctrl.eval_freq_epochs, ctrl.eval_freq_steps, ctrl.eval_freq_secs)
        self.ckpt_ctl = FrequencyControl(ctrl.ckpt_freq_epochs, ctrl.ckpt_freq_steps, ctrl.ckpt_freq_secs)
        self.ckpts = Checkpoints(run.recover, cfg.recover_keep)
        self.notice = PreemptNotice()  # the role installs it as the signal handler
        self.updating = False  # a trainer update of the running step has begun
        self.sampler_mark = self.sampler.state_dict()  # as the last finished step left it
        self.stats = StatsLog(run.stats)
        self.publisher = None  # made at the first publish

    def run_mfc(self, mfc: MFC, step: int, n_samples: int) -> dict[str, float]:
        """One call on every rank: its data-parallel part in, outputs amended into the buffer."""
        start, buffer = time.monotonic(), self.buffer
        if mfc.kind == "train_step" and not self.updating:
            if self.notice.urgent:
                raise Interrupted(f"SIGTERM before {mfc.name} of step {step + 1}")
            self.updating = True
        samples = buffer.ready(mfc.name, n_samples)
        if samples is None:
            raise RuntimeError(f"{mfc.name}: fewer than {n_samples} samples have its inputs {mfc.inputs}")
        parts = split_by_rank(samples, self.trainers.n_ranks)
        keys = [k for k in mfc.inputs if k in samples[0].keys]
        out_dir = self.rundir.step_data(step)
        payloads = [
            {
                "mfc": mfc.name,
                "refs": refs_payload(part, keys),
                "out": str(out_dir / f"{mfc.name}.r{rank}.h5"),
                "global_step": self.counter.global_step,  # for head/tail off-policyness
            }
            for rank, part in enumerate(parts)
        ]
        results = self.trainers.call(mfc.kind, payloads)
        for part, payload in zip(parts, payloads, strict=True):
            if mfc.outputs:
                buffer.amend([s.sample_id for s in part], payload["out"], mfc.outputs)
        buffer.consume(mfc.name, [s.sample_id for s in samples])
        stats = dict(results[0].get("stats", {})) if mfc.kind == "train_step" else {}
        stats[f"timeperf/{mfc.name}"] = time.monotonic() - start
        return stats

    def publish(self, new_version: bool = True) -> dict[str, float]:
        """The next weight version (or, resuming, the current one again) to every server, as
        `weight_update_mode` says (`areal_hpc.weights`): broadcast from trainer rank 0, or a snapshot on
        disk; `timeperf/weight_sync` and the bytes sent."""
        self.counter.version += int(new_version)
        try:
            if self.notice.urgent:  # the servers are stopping too; a resume republishes the trainers' weights
                raise RuntimeError("not sent after SIGTERM")
            if self.publisher is None:  # made once: the broadcast group is set up at the first publish
                self.publisher = make_publisher(self.cfg, self.rundir, self.trainers, self.clients)
            return self.publisher.publish(self.counter.version)
        except Exception as exc:
            if not self.notice.urgent:  # SIGTERM may come while the servers take the weights
                raise
            logger.warning("SIGTERM: weight version %d not published: %s", self.counter.version, exc)
            return {}

    def finish_step(self, stats: dict[str, float], step_start: float) -> None:
        c = self.counter
        secs = time.monotonic() - step_start
        c.step_secs.append(secs)
        c.global_step += 1
        stats["timeperf/e2e"] = secs
        self.stats.write(c.global_step, stats)
        self.updating, self.sampler_mark = False, self.sampler.state_dict()  # the step is recorded
        logger.info(step_line(c, secs))
        reward = stats.get("ppo_actor/task_reward/avg", stats.get("sft/loss"))
        write_progress(self.rundir.progress, c.global_step, c.total_steps, reward, c.eta_secs())
        epoch_done = c.epoch_step == 0
        last = c.global_step == c.total_steps
        if self.save_ctl.check(epochs=int(epoch_done), steps=1) or last:
            self.save()
        if self.eval_ctl.check(epochs=int(epoch_done), steps=1) and not self.notice.urgent:
            self.evaluate()
        due = self.ckpt_ctl.check(epochs=int(epoch_done), steps=1)
        if self.cfg.recover_mode != "disabled" and not last and (due or self.notice.reason):
            self.write_recover()
        if self.notice.reason and not last:
            raise Preempted(f"{self.notice.reason}: stopped after global step {c.global_step}")

    # --- recover checkpoints ------------------------------------------------------------------------------

    def write_recover(self) -> None:
        """A recover checkpoint of the step that just ended: every trainer rank's models, optimizers and
        generators, the ledger and the rollout store as they are now, and the controller's counters
        (`recover_state`)."""
        step = self.counter.global_step
        tmp = self.ckpts.begin(step)
        self.trainers.call_all("recover_save", {"dir": str(tmp)})
        save_into(self.rundir, tmp)
        fsio.write_json(tmp / "controller.json", self.recover_state())
        path = self.ckpts.commit(tmp, step)
        logger.info("Dumped recover info to file. (global step %d: %s)", step, path)

    def recover_state(self) -> dict:
        c = self.counter
        return {
            "identity": identity(self.cfg),
            "global_step": c.global_step,
            "version": c.version,
            "sampler": self.sampler_mark,
            "save_ctl": self.save_ctl.state_dict(),
            "eval_ctl": self.eval_ctl.state_dict(),
            "ckpt_ctl": self.ckpt_ctl.state_dict(),
            "eval_history": self.eval_history,
        }

    def resume(self, path) -> None:
        """Continue from recover checkpoint `path`: trainers, counters and run directory as they were then."""
        state = fsio.read_json(path / "controller.json")
        check_compatible(state["identity"], self.cfg, str(path))
        self.trainers.call_all("recover_load", {"dir": str(path)})
        c = self.counter
        c.global_step, c.version = state["global_step"], state["version"]
        self.sampler.load_state_dict(state["sampler"])
        for name in ("save_ctl", "eval_ctl", "ckpt_ctl"):
            getattr(self, name).load_state_dict(state[name])
        self.eval_history = [tuple(e) for e in state["eval_history"]]
        rewind(self.rundir, c.global_step, c.version, path)
        if c.version:  # the servers started from actor.path: give them the restored weights
            self.publish(new_version=False)
        logger.info("Resumed from %s: global step %d (epoch %d), weight version %d",
                    path, c.global_step, c.epoch + 1, c.version)  # fmt: skip

    def save(self) -> None:
        """A persistent HF checkpoint of the actor (REFERENCE section 1 naming)."""
        c = self.counter
        last_epoch_step = (c.global_step - 1) % c.steps_per_epoch + 1
        path = self.rundir.checkpoint(
            "actor", (c.global_step - 1) // c.steps_per_epoch, last_epoch_step, c.global_step
        )
        self.trainers.call_all("save", {"model": "actor", "path": str(path)})
        logger.info("Saved actor weights to %s", path)

    def evaluate(self) -> float | None:
        """Greedy accuracy on the held-out prompts, logged as eval/greedy_acc."""
        if self.heldout is None:
            return None
        acc = greedy_accuracy(self.clients, self.heldout, self.verifier, self.cfg.ppo.gen.max_new_tokens)
        self.stats.write(self.counter.global_step, {"eval/greedy_acc": acc})
        logger.info("Held-out greedy accuracy after %d steps: %.3f", self.counter.global_step, acc)
        self.eval_history.append((self.counter.global_step, acc))
        return acc

    def next_prompts(self) -> list:
        return [self.dataset[i] for i in self.sampler.next_batch()]

    def ppo_step(self) -> None:
        """Rollout, then every trainer call of the graph, then weight publication."""
        start, step = time.monotonic(), self.counter.global_step
        epoch = self.sampler.epoch
        prompts = self.next_prompts()
        gen_path, stats = rollout_step(
            self.clients, self.verifier, prompts, self.cfg, self.rundir.step_data(step) / "rollout.h5", epoch
        )
        self.add_samples(str(gen_path), [p.query_id for p in prompts], self.cfg.group_size, birth=start)
        for mfc in self.graph:
            stats |= self.run_mfc(mfc, step, len(prompts) * self.cfg.group_size)
        stats |= self.publish()
        self.end_of_step_data(step, prompts)
        self.finish_step(stats, start)

    def async_step(self) -> None:
        """Train on the oldest train_bs groups of the rollout store, then publish the new weights."""
        start, step = time.monotonic(), self.counter.global_step
        paths = self.wait_rollouts(self.cfg.dataset.train_bs_n_seqs)
        waited = time.monotonic() - start
        attrs = [read_attrs(path) for path in paths]
        for path in paths:  # a prompt may come back in a later epoch: the file names the group
            self.add_samples(str(path), [path.stem], self.cfg.group_size, birth=start)
        stats = rollout_stats(paths, attrs) | {"timeperf/wait_rollouts": waited}
        for mfc in self.graph:
            stats |= self.run_mfc(mfc, step, len(paths) * self.cfg.group_size)
        stats |= self.publish()
        fsio.write_json(self.rundir.published_version, {"version": self.counter.version})
        self.record_used(step + 1, attrs)
        self.store.remove(paths)
        shutil.rmtree(self.rundir.step_data(step), ignore_errors=True)
        self.finish_step(stats, start)

    def record_used(self, step: int, attrs: list[dict]) -> None:
        """Ledger records of the prompts a step trained on and of those dropped meanwhile, by prompt epoch
        (the rollout side may run ahead into the next epoch)."""
        dropped = self.store.dropped()
        for ids_epochs, was_dropped in (
            ([(a["query_id"], a["epoch"]) for a in attrs], False),
            ([(d["query_id"], d["epoch"]) for _, d in dropped], True),
        ):
            for epoch in sorted({e for _, e in ids_epochs}):
                ids = [i for i, e in ids_epochs if e == epoch]
                self.ledger.record(epoch, step, ids, dropped=was_dropped)
        self.store.remove([path for path, _ in dropped])

    def wait_rollouts(self, n: int) -> list:
        """The n oldest groups of the store, once there; fails when the rollout role stopped beating."""
        while (paths := self.store.oldest(n)) is None:
            if self.notice.urgent:
                raise Interrupted("SIGTERM while waiting for rollouts")
            if dead_workers(self.rundir.heartbeats, ["rollout"], ROLLOUT_DEAD_SECS):
                raise RuntimeError(f"the rollout role stopped (no heartbeat for {ROLLOUT_DEAD_SECS:.0f} s)")
            time.sleep(STORE_POLL_SECS)
        return paths

    def sft_step(self) -> None:
        """Supervised warm-up: next-token loss on the reference solutions of the step's prompts."""
        start, step = time.monotonic(), self.counter.global_step
        prompts = self.next_prompts()
        path = write_batch(self.rundir.step_data(step) / "sft.h5", sft_arrays(prompts, self.tokenizer))
        self.add_samples(str(path), [p.query_id for p in prompts], 1, birth=start)
        stats = {}
        for mfc in self.graph:
            stats |= self.run_mfc(mfc, step, len(prompts))
        self.end_of_step_data(step, prompts)
        self.finish_step(stats, start)

    def add_samples(self, path: str, groups: list[str], group_size: int, birth: float) -> None:
        """Buffer entries of a batch file whose rows are `group_size` answers of each of `groups`."""
        arrays = read_batch(path, keys=[])
        lengths = np.diff(arrays["cu_seqlens"]).tolist()
        keys = [k for k in read_keys(path) if k != "cu_seqlens"]
        self.buffer.add(sample_metas(path, groups, group_size, lengths, keys, birth))

    def end_of_step_data(self, step: int, prompts: list) -> None:
        """Record the consumed prompts, then drop the step's data (the original's clear_data_cache)."""
        c = self.counter
        self.ledger.record(c.epoch, c.global_step + 1, [p.query_id for p in prompts])  # the step that ends
        shutil.rmtree(self.rundir.step_data(step), ignore_errors=True)

    def start(self, resume_from, attempt: int) -> None:
        """Resume from a recover checkpoint, or start afresh (clearing what an earlier attempt left); then
        tell the other roles where this attempt starts (`RunDir.start_point`)."""
        if resume_from is not None:
            self.resume(resume_from)
        else:
            rewind(self.rundir, 0, 0)
        c = self.counter
        self.sampler_mark = self.sampler.state_dict()
        fsio.write_json(
            self.rundir.start_point,
            {"attempt": attempt, "global_step": c.global_step, "version": c.version},
            fsync=True,
        )

    def run(self, resume_from=None, attempt: int = 0) -> list[tuple[int, float]]:
        """All steps (from a recover checkpoint if given); held-out greedy accuracy before and after.
        Returns the evaluation history."""
        step_fn = {"sft": self.sft_step, "ppo": self.async_step if self.cfg.async_rl else self.ppo_step}[
            self.cfg.experiment_type
        ]
        logger.info(
            "Training %d steps (%d epochs of %d steps), graph %s",
            self.counter.total_steps,
            self.counter.total_epochs,
            self.counter.steps_per_epoch,
            [m.name for m in self.graph],
        )
        self.trainers.call_all("initialize", {"total_train_steps": self.counter.total_steps})
        self.start(resume_from, attempt)
        try:
            if self.cfg.experiment_type == "ppo" and self.counter.global_step == 0:
                self.evaluate()
            while self.counter.global_step < self.counter.total_steps:
                step_fn()
            if self.cfg.experiment_type == "ppo":
                self.evaluate()
        except Preempted:
            raise
        except Exception as exc:
            # After SIGTERM the servers and the rollout role stop at once, so waiting on them fails; the
            # trainers serve on, and unless an update was under way they hold the last finished step.
            if not self.notice.urgent or self.updating:
                raise
            self.checkpoint_and_stop(exc)
        return self.eval_history

    def checkpoint_and_stop(self, cause: Exception) -> None:
        """A recover checkpoint of the last finished step, if there is none yet; then `Preempted`."""
        step = self.counter.global_step
        logger.warning("step %d given up: %s", step + 1, cause)
        if self.cfg.recover_mode != "disabled" and step > 0 and step not in self.ckpts.steps():
            self.write_recover()
        raise Preempted(f"{self.notice.reason}: stopped after global step {step}") from cause
