"""Entry point of one role process: `python -m areal_hpc.launch.roles --run-dir D ROLE [--index i]`.

The same command runs under `areal-hpc run` (local processes) and in a Slurm step; everything a role needs
comes from the run directory (config, secret, registry) and its index.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback
from pathlib import Path

from areal_hpc.control import fsio
from areal_hpc.control.poll import poll_until
from areal_hpc.control.status import RUNNING, abort, complete, set_status
from areal_hpc.launch.rundir import RunDir

START_TIMEOUT_SECS = 600.0


def wait_gen_address(run: RunDir, index: int) -> dict:
    path = run.gen_address(index)
    return poll_until(
        lambda: fsio.read_json(path), START_TIMEOUT_SECS, f"generation server {index} to write {path}"
    )


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
    from areal_hpc.gen.client import GenClient
    from areal_hpc.master.graph import build_graph
    from areal_hpc.master.loop import Master
    from areal_hpc.master.trainers import TrainerGroup

    cfg = run.load_config()
    set_status(run.root, RUNNING, role="controller")
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
    token = run.token()
    clients = [
        GenClient(wait_gen_address(run, i)["url"], token) for i in range(len(allocation.gen_servers()))
    ]
    trainers = TrainerGroup(run.root, allocation.n_train_gpus)
    trainers.wait_started(START_TIMEOUT_SECS)
    graph = build_graph(cfg, trainer_only=True)
    with MathVerifier(n_workers=1) as verifier:
        try:
            Master(cfg, run, graph, (train, heldout), trainers, clients, verifier, tokenizer).run()
        finally:
            trainers.stop()
    complete(run.root, "controller")


def run_trainer(run: RunDir, rank: int) -> None:
    from areal_hpc.train.worker import serve_trainer

    serve_trainer(run, rank)


def run_gen_server(run: RunDir, index: int) -> None:
    """The built-in server on the actor's weights; it announces its URL in the run directory."""
    from areal_hpc.gen import server

    cfg = run.load_config()
    host = "127.0.0.1" if cfg.mode == "local" else "0.0.0.0"
    args = ["--model-path", cfg.actor.path, "--token-file", str(run.secret), "--host", host]
    args += ["--address-file", str(run.gen_address(index)), "--seed", str(cfg.seed + index)]
    run.gen_address(index).parent.mkdir(exist_ok=True)
    server.serve(server.parse_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal_hpc.launch.roles")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("role", choices=("controller", "gen_server", "trainer"))
    parser.add_argument("--index", type=int, default=0)
    ns = parser.parse_args(argv)
    run = RunDir(ns.run_dir)
    name = ns.role if ns.role == "controller" else f"{ns.role}{ns.index}"
    setup_logging(run.load_config().logging.level, name)
    # SIGTERM from the launcher or Slurm: leave through the normal exit path so that finally-blocks run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if ns.role == "controller":
            run_controller(run)
        elif ns.role == "trainer":
            run_trainer(run, ns.index)
        else:
            run_gen_server(run, ns.index)
    except SystemExit:
        raise
    except BaseException as exc:
        logging.error("%s failed:\n%s", name, traceback.format_exc())
        abort(run.root, f"{type(exc).__name__}: {exc}", name)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
