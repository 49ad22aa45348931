"""The trainer role: one rank of the trainers' process group, serving the controller's requests."""

from __future__ import annotations

from areal_hpc.control import RunContext
from areal_hpc.recover import outlive_term
from areal_hpc.train.worker import serve_trainer


def run(ctx: RunContext) -> None:
    if ctx.cfg.recover_mode != "disabled":
        outlive_term()  # the controller's recover checkpoint on SIGTERM needs this rank's state
    serve_trainer(ctx)
