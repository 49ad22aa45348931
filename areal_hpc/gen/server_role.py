"""The gen_server role: one generation server of the run, started by the backend that allocation_mode names,
announced in the run directory once it answers `/health`, stopped when the run is over."""

from __future__ import annotations

import logging
import time

import torch

from areal_hpc.config import gen_backend
from areal_hpc.control import START_TIMEOUT_SECS, RunContext, RunEndedError, why_stop
from areal_hpc.gen import discovery
from areal_hpc.gen.backends import ServerSpec, start_server
from areal_hpc.gen.client import GenClient

logger = logging.getLogger("gen_server")
WATCH_SECS = 1.0


def server_spec(ctx: RunContext, visible: int | None = None) -> ServerSpec:
    """Server `ctx.index` of the generation layout: its model, its first GPU among the `visible` ones its step
    sees (default: CUDA's count), its seed."""
    cfg, tp = ctx.cfg, ctx.allocation.gen_tensor
    visible = torch.cuda.device_count() if visible is None else visible
    device = f"cuda:{ctx.index * tp % visible}" if visible else "cpu"
    sg = cfg.sglang
    return ServerSpec(
        model_path=cfg.actor.path, token_file=ctx.run.secret, host=ctx.bind_host, device=device, tp_size=tp,
        seed=cfg.seed + ctx.index, max_running_requests=cfg.max_running_requests, public_host=ctx.public_host,
        mem_fraction_static=sg.mem_fraction_static, context_length=sg.context_length, log_level=sg.log_level,
        memory_saver=ctx.allocation.mode.kind == "colocated",
    )  # fmt: skip


def run(ctx: RunContext) -> None:
    """Serve until the run ends: completed (return), or failed or abandoned (RunEndedError)."""
    spec = server_spec(ctx)
    server = start_server(gen_backend(ctx.cfg), spec)
    try:
        GenClient(server.url, ctx.run.token()).wait_healthy(START_TIMEOUT_SECS)
        discovery.announce(ctx.run.gen_address(ctx.index), server.url)
        why = serve_until_over(ctx, server)
    finally:
        discovery.withdraw(ctx.run.gen_address(ctx.index))
        server.stop()
    if why:
        raise RunEndedError(why)


def serve_until_over(ctx: RunContext, server) -> str:
    """Watch the run; "" once it finished, else why this server gives up (the run failed, or it died)."""
    start = time.monotonic()
    while (why := why_stop(ctx.run, time.monotonic() - start)) is None:
        if not server.alive():
            return "the generation server stopped"
        time.sleep(WATCH_SECS)
    logger.info("run over (%s): stopping", why or "finished")
    return why
