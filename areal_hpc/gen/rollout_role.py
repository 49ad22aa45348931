"""The rollout role of asynchronous RL: the generation manager and the rollout workers (threads) fill the
rollout store until the run ends; the weight version the servers hold is read from the run directory."""

from __future__ import annotations

import logging
import threading
import time

from transformers import AutoTokenizer

from areal_hpc.control import (
    START_TIMEOUT_SECS,
    Ledger,
    RunContext,
    RunDir,
    RunEndedError,
    fsio,
    poll_until,
    why_stop,
)
from areal_hpc.data import RolloutStore, run_steps, training_prompts
from areal_hpc.gen import discovery
from areal_hpc.gen.episodes import Episodes, FirstGroups, is_single_turn, make_services
from areal_hpc.gen.journal import Journals
from areal_hpc.gen.manager import GenerationManager, ManagerState
from areal_hpc.gen.rollout_worker import RolloutContext, RolloutWorker, used_prompts
from areal_hpc.monitor import TranscriptLog
from areal_hpc.reward import TaskRewards

logger = logging.getLogger("rollout")
VERSION_POLL_SECS = 0.05
COUNTERS_SECS = 1.0  # how often the manager's counters are written for `areal-hpc status`


def run(ctx: RunContext) -> None:
    cfg, ds = ctx.cfg, ctx.cfg.dataset
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    train = training_prompts(cfg, tokenizer)
    clients = discovery.clients(
        ctx.run, len(ctx.allocation.gen_servers()), capacity=cfg.max_running_requests,
        adapters=cfg.weight_update_mode == "adapter",
    )  # fmt: skip
    _, total_steps = run_steps(cfg.exp_ctrl, len(train), ds.train_bs_n_seqs)
    max_concurrent = cfg.max_concurrent_rollouts or ds.train_bs_n_seqs
    point = wait_start_point(ctx.run, ctx.attempt)
    store = RolloutStore(ctx.run.rollouts)
    done, n_stored = used_prompts(Ledger(ctx.run.ledger), store)
    journals = Journals(ctx.run.episodes)
    if n := journals.prune(done):
        logger.info("removed the journals of %d groups already stored or trained", n)
    # Resumed staleness counters: every group trained on or waiting in the store was accepted.
    state = ManagerState(point["version"], accepted=point["global_step"] * ds.train_bs_n_seqs + n_stored)
    manager = GenerationManager(
        len(clients), ds.train_bs_n_seqs, cfg.max_head_offpolicyness, max_concurrent, cfg.schedule_policy,
        total_rollouts=total_steps * ds.train_bs_n_seqs, state=state,
    )  # fmt: skip
    stop = threading.Event()
    n_workers = cfg.n_rollout_workers or ctx.allocation.n_train_gpus
    with TaskRewards(cfg.reward, math_workers=2, tasks={p.task for p in train.samples}) as rewards:
        shared = RolloutContext(cfg, train, clients, rewards, manager, store, tokenizer, stop, done)
        if not is_single_turn(cfg):
            version_now = None if cfg.interruptible_generation else (lambda: manager.version)
            groups = cfg.rollout.transcript_groups
            services = make_services(cfg, tokenizer, rewards, version_now=version_now, stop=stop, journals=journals,
                                     transcripts=TranscriptLog(ctx.run, groups) if groups else None)  # fmt: skip
            shared.episodes = Episodes(cfg, services, ctx.run)
            shared.first_groups = FirstGroups(ds.train_bs_n_seqs)
        workers = [
            RolloutWorker(i, n_workers, shared, -(-max_concurrent // n_workers)) for i in range(n_workers)
        ]
        threads = [t for w in workers for t in w.threads()]
        for t in threads:
            t.start()
        logger.info("%d rollout workers, %d threads, %d servers", n_workers, len(threads), len(clients))
        start = shown = time.monotonic()
        try:
            while (why := why_stop(ctx.run, time.monotonic() - start)) is None and not stop.is_set():
                published = fsio.read_json(ctx.run.published_version)
                if published:
                    for client in clients:  # a LoRA run's requests name the new adapter (gen/adapters.py),
                        if client.served is not None:  # before the version lets the next ones go
                            client.served.advance(published["version"])
                    manager.set_version(published["version"])
                if time.monotonic() - shown > COUNTERS_SECS:
                    fsio.write_json(ctx.run.generation, counters(manager, clients))
                    shown = time.monotonic()
                time.sleep(VERSION_POLL_SECS)
            fsio.write_json(ctx.run.generation, counters(manager, clients))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
            if shared.episodes:
                shared.episodes.close()
    errors = [e for w in workers for e in w.errors]
    if errors:
        raise errors[0]
    if why:
        raise RunEndedError(why)


def counters(manager: GenerationManager, clients) -> dict[str, int]:
    """What `areal-hpc status` reads: the manager's counters, and the samples waiting for a server's slot."""
    return {**manager.counters(), "waiting_samples": sum(c.admission.waiting for c in clients)}


def wait_start_point(run: RunDir, attempt: int) -> dict:
    """Where the controller starts this attempt, once it has resumed or started afresh."""

    def started() -> dict | None:
        point = fsio.read_json(run.start_point)
        return point if point and point["attempt"] == attempt else None

    return poll_until(
        started, START_TIMEOUT_SECS, f"the controller to start attempt {attempt} ({run.start_point})"
    )
