"""The gen_server role: one generation server of the run (or one node's part of a server wider than a node),
started by the run's generation backend, announced in the run directory once it answers `/health`, stopped
when the run is over."""

from __future__ import annotations

import logging
import time

import torch

from areal_hpc.config import gen_backend, server_targets
from areal_hpc.control import START_TIMEOUT_SECS, RunContext, RunEndedError, fsio, poll_until, why_stop
from areal_hpc.gen import discovery
from areal_hpc.gen.backends import ServerSpec, free_port, start_server
from areal_hpc.gen.client import GenClient

logger = logging.getLogger("gen_server")
WATCH_SECS = 1.0


def server_spec(ctx: RunContext, visible: int | None = None, dist_init_addr: str | None = None) -> ServerSpec:
    """Task `ctx.index`'s part of its server: the model, the server's first GPU among the `visible` ones its
    step sees (default: CUDA's count; a server wider than a node takes all of each node's), its seed, and
    for a multi-node server its node rank and where they meet (`dist_init_addr`)."""
    cfg, tp = ctx.cfg, ctx.allocation.gen_tensor
    server, node_rank = ctx.allocation.gen_tasks()[ctx.index]
    visible = torch.cuda.device_count() if visible is None else visible
    device = f"cuda:{server.index * tp % visible if server.n_nodes == 1 else 0}" if visible else "cpu"
    sg, targets = cfg.sglang, server_targets(cfg)  # LoRA: room for the actor's adapters
    return ServerSpec(
        model_path=cfg.actor.path, token_file=ctx.run.secret, host=ctx.bind_host, device=device, tp_size=tp,
        seed=cfg.seed + server.index, max_running_requests=cfg.max_running_requests, public_host=ctx.public_host,
        mem_fraction_static=sg.mem_fraction_static, context_length=sg.context_length, log_level=sg.log_level,
        memory_saver=ctx.allocation.colocated, ep_size=sg.ep_size,
        enable_return_routed_experts=cfg.actor.router_replay == "rollout",
        nnodes=server.n_nodes, node_rank=node_rank, dist_init_addr=dist_init_addr,
        max_lora_rank=cfg.actor.lora.rank if targets else 0, lora_target_modules=targets,
    )  # fmt: skip


def run(ctx: RunContext) -> None:
    """Serve until the run ends: completed (return), or failed or abandoned (RunEndedError). Node rank 0 of a
    server serves HTTP and announces it; the other node ranks of a multi-node server only run their part."""
    server, node_rank = ctx.allocation.gen_tasks()[ctx.index]
    address = ctx.run.gen_address(server.index)
    spec = server_spec(ctx, dist_init_addr=meeting_point(ctx) if server.n_nodes > 1 else None)
    process = start_server(gen_backend(ctx.cfg), spec)
    try:
        if node_rank == 0:
            GenClient(process.url, ctx.run.token()).wait_healthy(START_TIMEOUT_SECS)
            discovery.announce(address, process.url)
        why = serve_until_over(ctx, process)
    finally:
        if node_rank == 0:
            discovery.withdraw(address)
        process.stop()
    if why:
        raise RunEndedError(why)


def meeting_point(ctx: RunContext) -> str:
    """host:port where the node ranks of this task's server meet: node rank 0 picks it for this attempt and
    writes it to the run directory, the others wait for it there."""
    server, node_rank = ctx.allocation.gen_tasks()[ctx.index]
    path = ctx.run.gen_dist_init(server.index)
    if node_rank == 0:
        addr = f"{ctx.public_host}:{free_port(ctx.bind_host)}"
        fsio.write_json(path, {"addr": addr, "attempt": ctx.attempt})
        return addr

    def written() -> str | None:
        point = fsio.read_json(path)
        return point["addr"] if point and point.get("attempt") == ctx.attempt else None

    return poll_until(
        written, START_TIMEOUT_SECS, f"node rank 0 of generation server {server.index} to write {path}"
    )


def serve_until_over(ctx: RunContext, server) -> str:
    """Watch the run; "" once it finished, else why this server gives up (the run failed, or it died)."""
    start = time.monotonic()
    while (why := why_stop(ctx.run, time.monotonic() - start)) is None:
        if not server.alive():
            return "the generation server stopped"
        time.sleep(WATCH_SECS)
    logger.info("run over (%s): stopping", why or "finished")
    return why
