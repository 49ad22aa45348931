"""The controller role: find the servers and the trainer ranks, run the master loop, mark the run COMPLETE."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer

from areal_hpc.control import RUNNING, START_TIMEOUT_SECS, RunContext, complete, set_status
from areal_hpc.data import prompts_of, training_prompts
from areal_hpc.gen import discovery
from areal_hpc.master.graph import build_graph
from areal_hpc.master.loop import Master
from areal_hpc.master.trainers import TrainerGroup
from areal_hpc.recover import Checkpoints, resumes
from areal_hpc.reward import TaskRewards

logger = logging.getLogger("controller")


def run(ctx: RunContext) -> None:
    cfg, run = ctx.cfg, ctx.run
    set_status(run, RUNNING, role="controller", reset=ctx.attempt > 0)
    resume_from = recover_point(ctx)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    ds = cfg.dataset
    train = training_prompts(cfg, tokenizer)
    logger.info("Loaded %d prompts from %s (%d longer than %d tokens dropped)", len(train), ds.path,
                train.n_dropped, ds.max_prompt_len)  # fmt: skip
    heldout = prompts_of(cfg, ds.valid_path, tokenizer) if ds.valid_path else None
    clients = discovery.clients(
        run, len(ctx.allocation.gen_servers()), tokenizer, capacity=cfg.max_running_requests,
        adapters=cfg.weight_update_mode == "adapter",
    )  # fmt: skip
    trainers = TrainerGroup(run, ctx.allocation.n_train_gpus)
    trainers.wait_started(START_TIMEOUT_SECS)
    graph = build_graph(cfg, trainer_only=True)
    with TaskRewards(cfg.reward, math_workers=1, tasks={p.task for p in train.samples}) as rewards:
        try:
            data = (train, heldout)
            master = Master(cfg, run, graph, data, trainers, clients, rewards, tokenizer, local=ctx.local)
            # USR2: checkpoint at the end of the step; SIGTERM: checkpoint the last finished step now.
            master.guard.notice.install(on_term=cfg.recover_mode != "disabled")
            master.run(resume_from, ctx.attempt)
            # Complete before the trainers stop: under Slurm a step that ends before the run is marked
            # finished ends the job as failed.
            complete(run, "controller")
        finally:
            trainers.stop()


def recover_point(ctx: RunContext):
    """The recover checkpoint this attempt resumes from, or None for a fresh start (`recover_mode`)."""
    cfg = ctx.cfg
    ckpts = Checkpoints(ctx.run.recover, cfg.recover_keep)
    latest = ckpts.latest() if cfg.recover_mode != "disabled" else None
    if resumes(cfg.recover_mode, ctx.attempt, latest is not None, str(ckpts.root)):
        logger.info("attempt %d resumes from recover checkpoint %s", ctx.attempt, latest)
        return latest
    logger.info("attempt %d starts afresh (recover_mode %s)", ctx.attempt, cfg.recover_mode)
    return None
