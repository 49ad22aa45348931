"""A trainer rank as a process: the mailbox handlers that run model function calls on batch files.

Requests (from the master, through `control.worker.WorkerServer`): `model_config` (non-blocking: who am I),
then the blocking `initialize`, `inference`, `train_step`, `save`, run at each `flush`. A payload names the
batch files holding this rank's samples (`refs`, read with `data.batch.gather`) and, for inference, the file
to write the outputs to.

Each model lives on the layout of its home call (`config.MFCS_OF`: the actor on actor_train's). A call of the
graph on another per-MFC layout runs on a copy of the model there, inference only; after the model trains, the
copy's weights are brought up to date before its next call (parameter reallocation, `param_realloc_mode`).

Weight publication over a broadcast group (`areal_hpc.weights`), answered on arrival: `weight_group_store`
(serve the group's store; reply its address), `init_weight_group` (join as rank 0 once every server joins;
reply the bucket plan) and `destroy_weight_group`, asked of rank 0 alone; `broadcast_weights`, asked of every
rank: the actor's full weights are gathered tensor by tensor on all ranks, and rank 0 sends them. Colocated
(`weight_update_mode: tensor`): `share_weights` (every rank gathers; the ranks named hold the full weights and
reply their handles for the server on their GPU) and `unshare_weights` once the servers copied them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from areal_hpc.config import (
    MFCS_OF,
    ExperimentConfig,
    MicroBatchSpec,
    allocation_of,
    mfc_spec,
    trainer_models,
)
from areal_hpc.control import RunContext, WorkerServer, fsio, task_name, timeline
from areal_hpc.data import CU, gather, write_batch
from areal_hpc.train import dist, interfaces
from areal_hpc.train.backends import TrainEngine, make_engine
from areal_hpc.train.rng import rng_state, set_rng_state
from areal_hpc.train.sharded import AsyncSave
from areal_hpc.train.sharded import load as load_shards
from areal_hpc.weights import SharedWeights, WeightSender, plan_payload

logger = logging.getLogger("trainer")
# A recover checkpoint's trainer part: every rank's shards, the LR schedules, each rank's generators.
SHARDS, TRAINERS, RNG = "shards", "trainers.json", "rng"
# The models that only answer inference calls: the reference policy (KL penalty), the teacher (distillation).
INFERENCE_ONLY = ("ref", "teacher")
PROFILE_PREFIX = "profile."  # logs/timeline/profile.<mfc>.step<N>.trainer<rank>.json


class TrainerHandlers:
    """The request types a trainer rank answers; engines are built by `initialize`."""

    def __init__(
        self, cfg: ExperimentConfig, rank: int, world_size: int, host: str = "127.0.0.1", profile_dir=None
    ):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.colocated = allocation_of(cfg).colocated  # the servers take the GPUs back after each step
        self.profile_dir = profile_dir  # where `profiled` writes (the run's timeline folder)
        self.host = host  # where the servers reach this rank's weight-group store
        self.engines: dict[str, TrainEngine] = {}
        self.actor = interfaces.actor_interface(cfg)  # actor_inf, actor_train, sft_train
        self.copies: dict[str, tuple[str, TrainEngine]] = {}  # MFC -> (model, its copy on the MFC's layout)
        self._stale: set[str] = set()  # the MFCs whose copy is behind its model
        self._snapshots: dict[str, str] = {}  # model -> its HF snapshot folder (param_realloc_mode disk)
        self.weight_sender = WeightSender()
        self.shared_weights = SharedWeights()
        self.saver: AsyncSave | None = None  # made by the first recover_save or _reserve
        self._reserved: set[str] = set()  # models whose checkpoint buffers are made

    def model_config(self, payload: Any) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "initialized": bool(self.engines)}

    def initialize(self, payload: dict) -> dict:
        """Load the models the graph needs, each on its home layout; the actor trains for `total_train_steps`
        optimizer steps. The graph's calls (`mfcs`: MFC -> model) on another layout get a copy of their model
        there; `realloc_snapshots` (model -> folder) say where a model's weights move to its copies through the
        disk (`param_realloc_mode` disk)."""
        cfg = self.cfg
        n_minibatches = 1 if cfg.experiment_type == "sft" else cfg.ppo.ppo_n_minibatches
        total = payload["total_train_steps"] * n_minibatches
        models = trainer_models(cfg)
        for name, model_cfg in models.items():  # the reference policy and the teacher do not train
            if name == "ref" and self._ref_is_actor_base(model_cfg):
                continue  # the LoRA actor with its adapters off: no second copy of the weights
            steps = None if name in INFERENCE_ONLY else total
            spec = mfc_spec(cfg, MFCS_OF[name][0])
            self.engines[name] = make_engine(model_cfg, steps, cfg.seed, critic=name == "critic", spec=spec)
        for mfc, name in payload.get("mfcs", {}).items():
            spec = mfc_spec(cfg, mfc)
            if name in models and spec != mfc_spec(cfg, MFCS_OF[name][0]):
                self.copies[mfc] = name, make_engine(models[name], None, cfg.seed, spec=spec)
        self._snapshots = payload.get("realloc_snapshots", {})
        logger.info("rank %d/%d loaded %s, copies for %s", self.rank, self.world_size, sorted(self.engines),
                    sorted(self.copies))  # fmt: skip
        return {"models": sorted(self.engines), "copies": sorted(self.copies)}

    def _ref_is_actor_base(self, ref) -> bool:
        """The reference policy is the LoRA actor's base model, on the actor's layout."""
        cfg = self.cfg
        same_layout = mfc_spec(cfg, "ref_inf") == mfc_spec(cfg, MFCS_OF["actor"][0])
        return bool(cfg.actor.lora.rank) and ref.path == cfg.actor.path and same_layout

    def _engine(self, mfc: str, model: str) -> tuple[TrainEngine, dict[str, float]]:
        """The engine that runs `mfc`: the model's own, or its copy on the call's layout, first brought up to
        date (a collective: every rank runs the same call); with the reallocation's seconds."""
        if model == "ref" and "ref" not in self.engines:
            return self.engines["actor"], {}  # with its adapters off (inference)
        if mfc not in self.copies:
            return self.engines[model], {}
        _, copy = self.copies[mfc]
        if mfc not in self._stale:
            return copy, {}
        start, source = time.monotonic(), self.engines[model]
        if self.cfg.param_realloc_mode == "disk":
            snapshot = self._snapshots[model]
            source.save_hf(snapshot)
            dist.barrier()  # rank 0 wrote it
            copy.load_hf(snapshot)
        else:
            copy.load_weights(source.hf_weights())
        self._stale.discard(mfc)
        return copy, {"timeperf/param_realloc": time.monotonic() - start}

    def _trained(self, model: str) -> None:
        """`model`'s weights changed: its copies are behind."""
        self._stale |= {mfc for mfc, (name, _) in self.copies.items() if name == model}

    def inference(self, payload: dict) -> dict:
        with self.profiled(payload):
            return self._inference(payload)

    def _inference(self, payload: dict) -> dict:
        mfc, batch = payload["mfc"], _load(payload)
        ppo, temperature = self.cfg.ppo, self.cfg.ppo.gen.temperature
        if mfc not in ("actor_inf", "ref_inf", "teacher_inf", "critic_inf"):
            raise ValueError(f"trainer cannot run inference call {mfc!r} (ppo options {ppo.disable_value=})")
        engine, stats = self._engine(mfc, mfc.removesuffix("_inf"))
        mb_spec = self._mb_spec(mfc)
        if mfc == "actor_inf":
            out = self.actor.inference(engine, batch, mb_spec)
            if not isinstance(out, dict) or "proximal_logprobs" not in out:
                raise ValueError(f"actor.interface {type(self.actor).__name__}.inference returned {_keys(out)}; "
                                 "actor_inf needs a dict with proximal_logprobs")  # fmt: skip
        elif mfc == "ref_inf":
            base = engine.adapters_off() if "ref" not in self.engines else contextlib.nullcontext()
            with base:
                out = interfaces.ref_inference(engine, batch, mb_spec, temperature)
        elif mfc == "teacher_inf":
            out = interfaces.teacher_inference(engine, batch, mb_spec, temperature)
        else:
            out = interfaces.critic_inference(engine, batch, mb_spec)
        if payload["out"]:  # one rank of each data-parallel replica writes its outputs
            with timeline.span("write_outputs"):
                write_batch(payload["out"], {CU: batch[CU], **out})
        return {"path": payload["out"], "stats": stats}

    def _mb_spec(self, mfc: str) -> MicroBatchSpec:
        """The call's micro-batching; its token budget is per rank, so a context group of c ranks packs c times
        as many tokens into a micro-batch (each rank runs 1/c of them)."""
        spec = getattr(self.cfg, "actor_train" if mfc == "sft_train" else mfc).mb_spec
        context = mfc_spec(self.cfg, mfc).context
        return dataclasses.replace(spec, max_tokens_per_mb=spec.max_tokens_per_mb * context)

    def train_step(self, payload: dict) -> dict:
        with self.profiled(payload):
            return self._train_step(payload)

    def _train_step(self, payload: dict) -> dict:
        mfc, batch, cfg = payload["mfc"], _load(payload), self.cfg
        if mfc in ("actor_train", "sft_train"):
            stats = self.actor.train_step(
                self.engines["actor"], batch, self._mb_spec(mfc), global_step=payload.get("global_step")
            )
            if not isinstance(stats, dict):
                raise ValueError(f"actor.interface {type(self.actor).__name__}.train_step returned {_keys(stats)}, "
                                 "not a dict of statistics")  # fmt: skip
        elif mfc == "critic_train":
            stats = interfaces.critic_train_step(self.engines["critic"], batch, cfg.ppo, self._mb_spec(mfc))
        else:
            raise ValueError(f"trainer cannot run train call {mfc!r}")
        model = "critic" if mfc == "critic_train" else "actor"
        self._trained(model)
        self._reserve(model)
        if self.colocated:  # the servers resume on this memory (a 7B on one H100: 47 GiB cached by the step)
            with timeline.span("free_memory"):
                self.engines[model].release_memory()
                torch.cuda.empty_cache()  # the process's: every engine's activations (a no-op without CUDA)
        return {"stats": stats}

    @contextlib.contextmanager
    def profiled(self, payload: dict) -> Iterator[None]:
        """The call under torch.profiler (CUDA kernels on a GPU) if its step is `logging.profile_step`: a
        Chrome trace per call and rank in logs/timeline/, which `areal-hpc trace --cuda` merges."""
        step = payload.get("global_step", -1) + 1
        if self.profile_dir is None or step != self.cfg.logging.profile_step:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            yield
        path = self.profile_dir / f"{PROFILE_PREFIX}{payload['mfc']}.step{step}.trainer{self.rank}.json"
        prof.export_chrome_trace(str(path))
        # The ops that took the time, as a table beside it: what a look at the trace would add up.
        key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        path.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
        logger.info("rank %d: profile of %s at step %d in %s", self.rank, payload["mfc"], step, path)

    def _reserve(self, name: str) -> None:
        """After a model's first step, when its optimizer state exists: make the CPU buffers its recover
        checkpoints are copied into, so that no checkpoint pays for them (seconds for tens of GB)."""
        if self.cfg.recover_mode == "disabled" or name in self._reserved:
            return
        start = time.monotonic()
        with timeline.span("checkpoint_buffers", model=name):  # once a run: seconds of page-locking
            self._saver().reserve({name: self.engines[name].state_dict()})
        self._reserved.add(name)
        logger.info(
            "rank %d: checkpoint buffers of %s made in %.1f s", self.rank, name, time.monotonic() - start
        )

    def save(self, payload: dict) -> dict:
        """HF weights of a model (rank 0 writes; every rank joins, as a later sharded save will need)."""
        path = self.engines[payload["model"]].save_hf(payload["path"])
        return {"path": None if path is None else str(path)}

    def save_adapter(self, payload: dict) -> dict:
        """The actor's LoRA adapter as a PEFT folder (rank 0 writes; every rank joins the gather)."""
        engine = self.engines["actor"]
        if not getattr(engine, "lora_scale", None):
            raise RuntimeError("save_adapter needs an actor with actor.lora.rank > 0")
        path = engine.save_adapter(payload["path"])
        return {"path": None if path is None else str(path)}

    # --- recover checkpoints ----------------------------------------------------------------------------------

    def recover_save(self, payload: dict) -> dict:
        """Start this rank's part of a recover checkpoint in folder `dir`: the shards of every trained model's
        weights and optimizer state are copied to CPU memory, then written in the background (`recover_wait`
        says when they are); the LR schedules (rank 0) and this rank's random generators as JSON, at once."""
        folder = Path(payload["dir"])
        trained = {name: e for name, e in self.engines.items() if e.trainable}
        (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        self._saver().save({name: e.state_dict() for name, e in trained.items()}, folder / SHARDS)
        fsio.write_json(folder / RNG / f"{task_name('trainer', self.rank)}.json", rng_state())
        if self.rank == 0:
            schedules = {name: e.schedule_state() for name, e in trained.items()}
            fsio.write_json(folder / TRAINERS, {"world_size": self.world_size, "schedules": schedules})
        return {"models": sorted(trained)}

    def _saver(self) -> AsyncSave:
        if self.saver is None:
            self.saver = AsyncSave()  # starts this rank's checkpoint writer process
        return self.saver

    def recover_poll(self, payload: Any) -> dict:
        """Whether this rank's shards of the last `recover_save` are written (answers at once)."""
        return {"done": self.saver is None or not self.saver.pending() or self.saver.done()}

    def recover_wait(self, payload: Any) -> dict:
        """Until this rank's shards are written: their sizes and sha256, for the checkpoint's manifest, and
        how many seconds the writing took."""
        files = self.saver.wait() if self.saver is not None else {}
        seconds = self.saver.write_seconds if self.saver is not None else 0.0
        return {"files": {f"{SHARDS}/{name}": entry for name, entry in files.items()}, "write_s": seconds}

    def recover_load(self, payload: dict) -> dict:
        """Restore what `recover_save` wrote into folder `dir`, whatever number of ranks wrote it."""
        folder = Path(payload["dir"])
        meta = fsio.read_json(folder / TRAINERS)
        state = {name: self.engines[name].state_dict() for name in meta["schedules"]}
        load_shards(state, folder / SHARDS)
        for name, engine_state in state.items():
            self.engines[name].load_state_dict(engine_state)
            self.engines[name].load_schedule_state(meta["schedules"][name])
        rng = fsio.read_json(folder / RNG / f"{task_name('trainer', self.rank)}.json")
        if rng is not None:
            set_rng_state(rng)
        else:  # more ranks than wrote the checkpoint: this one keeps its own (only sampling would differ)
            logger.warning("rank %d: %s holds no random generators of this rank", self.rank, folder)
        self._stale = set(self.copies)
        if meta["world_size"] != self.world_size:
            logger.info("resharded a checkpoint of %d ranks onto %d", meta["world_size"], self.world_size)
        return {"models": sorted(state)}

    # --- weight publication (rank 0 of the training group only) ---------------------------------------------

    def weight_group_store(self, payload: dict) -> dict:
        """Serve the store of weight group `group_name`; `{"master_address", "master_port", "backend"}`."""
        self._only_rank0("weight_group_store")
        name, timeout_s, port = payload["group_name"], payload["timeout_s"], payload.get("port", 0)
        port = self.weight_sender.open(name, timeout_s, port, self.host)  # listens at the address it replies
        backend = "nccl" if self.engines["actor"].device.type == "cuda" else "gloo"
        return {"master_address": self.host, "master_port": port, "backend": backend}

    def init_weight_group(self, payload: dict) -> dict:
        """Join the weight group as rank 0 (returns when every server joined); the bucket plan of the actor."""
        self._only_rank0("init_weight_group")
        actor = self.engines["actor"]
        buckets = self.weight_sender.join(
            payload["world_size"],
            payload["backend"],
            actor.hf_params(),
            actor.dtype,
            payload["bucket_bytes"],
        )
        return {"buckets": plan_payload(buckets)}

    def _actor_weights_on(self, ranks) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The actor's full weights, gathered on every rank (a collective): the `ranks` get the stream, the
        others drain it and get None."""
        weights = self.engines["actor"].hf_weights()
        if self.rank in ranks:
            return weights
        for _ in weights:
            pass
        return None

    def broadcast_weights(self, payload: dict) -> dict:
        """Rank 0: broadcast the actor's current weights as planned, `{"bytes", "buckets", "secs"}`; other
        ranks: take part in gathering them, `{}`."""
        weights = self._actor_weights_on([0])
        return {} if weights is None else self.weight_sender.send(weights)

    def share_weights(self, payload: dict) -> dict:
        """Every rank gathers the actor's full weights (a collective); the `ranks` named in the payload hold
        them and reply them serialized, `{"serialized", "bytes"}` (a CUDA IPC handle each: the server on this
        rank's GPU copies from them); the others reply `{}`."""
        weights = self._actor_weights_on(payload.get("ranks", [0]))
        if weights is None:
            return {}
        shared = self.shared_weights.share(weights)
        timeline.instant("weights_shared", bytes=shared["bytes"], version=payload.get("version"))
        return shared

    def unshare_weights(self, payload: Any) -> dict:
        self.shared_weights.release()
        return {}

    def destroy_weight_group(self, payload: Any) -> dict:
        self.weight_sender.close()
        return {"destroyed": True}

    def _only_rank0(self, request: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{request} is for trainer rank 0 (the publishing rank), not rank {self.rank}")


def serve_trainer(ctx: RunContext) -> None:
    """Join the trainer process group, then serve this rank's mailbox until the master says stop."""
    rank, world_size = ctx.index, ctx.n_tasks
    dist.init_distributed(rank, world_size, ctx.run.dist_init, host=ctx.public_host, attempt=ctx.attempt)
    handlers = TrainerHandlers(ctx.cfg, rank, world_size, ctx.public_host, ctx.run.timeline)
    try:
        WorkerServer(ctx.run, ctx.name, handlers).serve()
    finally:
        handlers.weight_sender.close()
        if handlers.saver is not None:
            handlers.saver.close()
        dist.destroy()


def _load(payload: dict):
    with timeline.span("load_batch"):
        return gather(payload["refs"])


def _keys(out: Any) -> str:
    return f"a dict of {sorted(out)}" if isinstance(out, dict) else f"a {type(out).__name__}"
