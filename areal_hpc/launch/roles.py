"""Entry point of one role process: `python -m areal_hpc.launch.roles --run-dir D ROLE`.

The same command runs under `areal-hpc run` (local processes), submitit's LocalExecutor (`role_main`) and in
a Slurm step. A process learns its index among the tasks of its role from the job environment (submitit's
JobEnvironment: SLURM_PROCID under Slurm, SUBMITIT_LOCAL_* locally), never from the launcher's arguments;
everything else comes from the run directory (config, secret, registry).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from areal_hpc.control import fsio
from areal_hpc.control.heartbeat import Heartbeat, last_beat
from areal_hpc.control.poll import poll_until
from areal_hpc.control.rundir import RunDir
from areal_hpc.control.status import ABORTED, RUNNING, abort, complete, get_status, set_status
from areal_hpc.recover.attempt import current_attempt
from areal_hpc.recover.signals import EXIT_PREEMPTED, Preempted, outlive_term

START_TIMEOUT_SECS = 600.0
CONTROLLER_DEAD_SECS = 60.0
ROLES = ("controller", "gen_server", "trainer", "rollout")
LAUNCHER_ENV = "AREAL_LAUNCHER_PID"  # set by `areal-hpc run` for the roles it starts
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class JobEnvironmentError(RuntimeError):
    """A role started outside any job environment, or with a task count that does not match the plan."""


def task_of_job() -> tuple[int, int]:
    """(index, number of tasks) of this process in its step, from submitit's JobEnvironment."""
    import submitit

    try:
        env = submitit.JobEnvironment()
    except RuntimeError as exc:
        raise JobEnvironmentError(
            "no job environment: start roles with `areal-hpc run`, submitit or Slurm "
            f"(SUBMITIT_EXECUTOR={os.environ.get('SUBMITIT_EXECUTOR', '')!r}): {exc}"
        ) from exc
    return env.global_rank, env.num_tasks


def wait_gen_address(run: RunDir, index: int) -> dict:
    path = run.gen_address(index)
    return poll_until(
        lambda: fsio.read_json(path), START_TIMEOUT_SECS, f"generation server {index} to write {path}"
    )


def gen_clients(run: RunDir, allocation) -> list:
    """A client of each generation server of the allocation, once it has announced its address."""
    from areal_hpc.gen.client import GenClient

    token = run.token()
    return [GenClient(wait_gen_address(run, i)["url"], token) for i in range(len(allocation.gen_servers()))]


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )


def run_controller(run: RunDir) -> None:
    """Load data and tokenizer, find the servers and trainers, run the master loop, mark the run COMPLETE."""
    from transformers import AutoTokenizer

    from areal_hpc import alloc
    from areal_hpc.algo.math_verify import MathVerifier
    from areal_hpc.data.dataset import load_prompt_dataset
    from areal_hpc.master.graph import build_graph
    from areal_hpc.master.loop import Master
    from areal_hpc.master.trainers import TrainerGroup

    cfg = run.load_config()
    attempt = current_attempt()
    set_status(run, RUNNING, role="controller", reset=attempt > 0)
    resume_from = recover_point(cfg, run, attempt)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    ds = cfg.dataset
    train = load_prompt_dataset(ds.path, tokenizer, ds.max_prompt_len, ds.apply_chat_template)
    logging.info("Loaded %d prompts from %s (%d longer than %d tokens dropped)", len(train), ds.path,
                 train.n_dropped, ds.max_prompt_len)  # fmt: skip
    heldout = None
    if ds.valid_path:
        heldout = load_prompt_dataset(ds.valid_path, tokenizer, ds.max_prompt_len, ds.apply_chat_template)
    allocation = alloc.resolve_allocation(
        cfg.allocation_mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    )
    clients = gen_clients(run, allocation)
    trainers = TrainerGroup(run, allocation.n_train_gpus)
    trainers.wait_started(START_TIMEOUT_SECS)
    graph = build_graph(cfg, trainer_only=True)
    with MathVerifier(n_workers=1) as verifier:
        try:
            master = Master(cfg, run, graph, (train, heldout), trainers, clients, verifier, tokenizer)
            # USR2: checkpoint at the end of the step; SIGTERM: checkpoint the last finished step now.
            master.notice.install(on_term=cfg.recover_mode != "disabled")
            master.run(resume_from, attempt)
            # Complete before the trainers stop: under Slurm a step that ends before the run is marked
            # finished ends the job as failed.
            complete(run, "controller")
        finally:
            trainers.stop()


def recover_point(cfg, run: RunDir, attempt: int):
    """The recover checkpoint this attempt resumes from, or None for a fresh start (`recover_mode`)."""
    from areal_hpc.recover.checkpoint import Checkpoints
    from areal_hpc.recover.state import resumes

    ckpts = Checkpoints(run.recover, cfg.recover_keep)
    latest = ckpts.latest() if cfg.recover_mode != "disabled" else None
    if resumes(cfg.recover_mode, attempt, latest is not None, str(ckpts.root)):
        logging.info("attempt %d resumes from recover checkpoint %s", attempt, latest)
        return latest
    logging.info("attempt %d starts afresh (recover_mode %s)", attempt, cfg.recover_mode)
    return None


def wait_start_point(run: RunDir, attempt: int) -> dict:
    """Where the controller starts this attempt, once it has resumed or started afresh."""

    def started() -> dict | None:
        point = fsio.read_json(run.start_point)
        return point if point and point["attempt"] == attempt else None

    return poll_until(
        started,
        START_TIMEOUT_SECS,
        f"the controller to start attempt {attempt} ({run.start_point})",
    )


def run_rollout(run: RunDir) -> None:
    """Asynchronous RL's rollout side: the generation manager and the rollout workers (threads), until the
    run ends; the published weight version is read from the run directory."""
    from transformers import AutoTokenizer

    from areal_hpc import alloc
    from areal_hpc.algo.math_verify import MathVerifier
    from areal_hpc.control.ledger import Ledger
    from areal_hpc.data.dataset import ShardedSampler, load_prompt_dataset
    from areal_hpc.data.store import RolloutStore
    from areal_hpc.gen.manager import GenerationManager, ManagerState
    from areal_hpc.gen.rollout_worker import RolloutContext, RolloutWorker, used_prompts
    from areal_hpc.master.loop import make_counter

    cfg = run.load_config()
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    ds = cfg.dataset
    train = load_prompt_dataset(ds.path, tokenizer, ds.max_prompt_len, ds.apply_chat_template)
    allocation = alloc.resolve_allocation(
        cfg.allocation_mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    )
    clients = gen_clients(run, allocation)
    n_servers = len(clients)
    total_steps = make_counter(
        cfg, ShardedSampler(len(train), 0, 1, cfg.seed, ds.train_bs_n_seqs)
    ).total_steps
    max_concurrent = cfg.max_concurrent_rollouts or ds.train_bs_n_seqs
    point = wait_start_point(run, current_attempt())
    store = RolloutStore(run.rollouts)
    done, n_stored = used_prompts(Ledger(run.ledger), store)
    # Resumed staleness counters: every group trained on or waiting in the store was accepted.
    state = ManagerState(point["version"], accepted=point["global_step"] * ds.train_bs_n_seqs + n_stored)
    manager = GenerationManager(
        n_servers, ds.train_bs_n_seqs, cfg.max_head_offpolicyness, max_concurrent, cfg.schedule_policy,
        total_rollouts=total_steps * ds.train_bs_n_seqs, state=state,
    )  # fmt: skip
    stop = threading.Event()
    n_workers = cfg.n_rollout_workers or allocation.n_train_gpus
    with MathVerifier(n_workers=2) as verifier:
        ctx = RolloutContext(cfg, train, clients, verifier, manager, store, tokenizer, stop, done)
        workers = [
            RolloutWorker(i, n_workers, ctx, -(-max_concurrent // n_workers)) for i in range(n_workers)
        ]
        threads = [t for w in workers for t in w.threads()]
        for t in threads:
            t.start()
        logging.info("%d rollout workers, %d threads, %d servers", n_workers, len(threads), n_servers)
        start = time.monotonic()
        try:
            while (why := why_stop(run, time.monotonic() - start)) is None and not stop.is_set():
                published = fsio.read_json(run.published_version)
                if published:
                    manager.set_version(published["version"])
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    errors = [e for w in workers for e in w.errors]
    if errors:
        raise errors[0]
    if why:
        raise RunEndedError(why)


def run_trainer(run: RunDir, rank: int, n_tasks: int) -> None:
    from areal_hpc import alloc
    from areal_hpc.train.worker import serve_trainer

    cfg = run.load_config()
    allocation = alloc.resolve_allocation(
        cfg.allocation_mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    )
    if n_tasks != allocation.n_train_gpus:
        raise JobEnvironmentError(
            f"the job started {n_tasks} trainer tasks, but allocation_mode {cfg.allocation_mode!r} "
            f"trains on {allocation.n_train_gpus} GPUs"
        )
    if cfg.recover_mode != "disabled":
        outlive_term()  # the controller's recover checkpoint on SIGTERM needs this rank's state
    serve_trainer(run, rank)


def run_gen_server(run: RunDir, index: int) -> None:
    """The built-in server on the actor's weights; it announces its URL in the run directory and serves
    until the run ends (see `why_stop`), so that a job whose servers are a step of their own finishes."""
    import torch

    from areal_hpc.gen import server

    cfg = run.load_config()
    host = "127.0.0.1" if os.environ.get("SUBMITIT_EXECUTOR") == "local" else "0.0.0.0"
    args = ["--model-path", cfg.actor.path, "--token-file", str(run.secret), "--host", host]
    if torch.cuda.is_available():  # the step's GPUs: one per server on a node (TP > 1 needs real SGLang)
        args += ["--device", f"cuda:{index % torch.cuda.device_count()}"]
    args += ["--address-file", str(run.gen_address(index)), "--seed", str(cfg.seed + index)]
    args += ["--max-batch-size", str(cfg.max_running_requests)]
    run.gen_address(index).parent.mkdir(exist_ok=True)
    reason: list[str] = []
    threading.Thread(target=watch_run, args=(run, reason), daemon=True).start()
    server.serve(server.parse_args(args))
    if reason and reason[0]:
        raise RunEndedError(reason[0])


class RunEndedError(RuntimeError):
    """The run ended without completing while this role was serving it."""


def why_stop(run: RunDir, waited: float, dead_secs: float = CONTROLLER_DEAD_SECS) -> str | None:
    """None while the run goes on; "" once it finished; else why a server should give up on it."""
    if run.finished.exists():
        return ""
    status = get_status(run)
    if status is not None and status.state == ABORTED:
        return f"the run was aborted by {status.role or '?'}: {status.reason}"
    beat = last_beat(run.heartbeats, "controller")
    if beat is None:
        return (
            f"no controller started within {START_TIMEOUT_SECS:.0f} s"
            if waited > START_TIMEOUT_SECS
            else None
        )
    if beat.get("state") == "stopped":
        return "the controller stopped before the run finished"
    age = time.time() - beat["time"]
    return f"the controller's last heartbeat is {age:.0f} s old" if age > dead_secs else None


def watch_run(run: RunDir, reason: list[str], interval: float = 1.0) -> None:
    """Poll `why_stop`; when the run is over, record why and SIGTERM this process (the server's clean exit)."""
    start = time.monotonic()
    while (why := why_stop(run, time.monotonic() - start)) is None:
        time.sleep(interval)
    logging.info("run over (%s): stopping", why or "finished")
    reason.append(why)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_launcher() -> None:
    """`areal-hpc run` starts each role in a session of its own, so that Ctrl-C reaches the launcher alone;
    should the launcher be killed outright, its roles get SIGTERM (Linux's parent-death signal) instead of
    running on unsupervised."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def role_main(run_dir: str | os.PathLike, role: str) -> int:
    """Run one role until it ends; 0 on success. The callable that every launcher starts."""
    run = RunDir(Path(run_dir))
    index, n_tasks = task_of_job()
    name = role if role in ("controller", "rollout") else f"{role}{index}"  # one controller, one rollout
    setup_logging(run.load_config().logging.level, name)
    # SIGTERM from the launcher or Slurm: leave through the normal exit path so that finally-blocks run
    # (the controller and the trainers replace this once a recover checkpoint can be written).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    die_with_launcher()
    # USR2: Slurm's notice of preemption or of the time limit. Recover checkpoints are written on it once
    # they exist; until then it must not kill the role (USR2's default action).
    signal.signal(signal.SIGUSR2, lambda *_: logging.warning("USR2: preemption or time limit notice"))
    # The controller beats for servers in a job of their own, the rollout role for the controller; a failure is recorded (abort) before its
    # heartbeat says "stopped", so that servers report the failure's cause, not the stop.
    with Heartbeat(run.heartbeats, name) if role in ("controller", "rollout") else contextlib.nullcontext():
        try:
            if role == "controller":
                run_controller(run)
            elif role == "trainer":
                run_trainer(run, index, n_tasks)
            elif role == "rollout":
                run_rollout(run)
            else:
                run_gen_server(run, index)
        except SystemExit:
            raise
        except Preempted as exc:  # no failure: the next attempt resumes from the checkpoint just written
            logging.warning("Preempted: %s", exc)
            abort(run, f"Preempted: {exc}", name)
            return EXIT_PREEMPTED
        except BaseException as exc:
            logging.error("%s failed:\n%s", name, traceback.format_exc())
            abort(run, f"{type(exc).__name__}: {exc}", name)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal_hpc.launch.roles")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("role", choices=ROLES)
    ns = parser.parse_args(argv)
    return role_main(ns.run_dir, ns.role)


if __name__ == "__main__":
    sys.exit(main())
