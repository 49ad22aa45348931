"""The model worker's request kinds and the order in which a flush runs the queued requests (pure).

As in the original (REFERENCE.md section 3): non-blocking requests are handled as soon as they arrive;
blocking ones wait in a queue until ``flush``. A flush runs every pre-hook of the queued requests first
(posting order), then the requests themselves, smallest parallel group (``group_size``) first with ties in
posting order, then every post-hook (posting order). Pre-hooks first lets all workers finish their data
transfers before any of them enters a compute call that needs its peers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from areal_hpc.control.mailbox import Request

NON_BLOCKING = frozenset({"model_config", "fetch", "spec", "clear_data_cache"})
BLOCKING = frozenset({"initialize", "generate", "inference", "train_step", "empty", "reset"})
FLUSH = "flush"  # run the queued blocking requests
STOP = "stop"  # end the worker's loop
PRE_HOOKS = ("data_transfer", "param_realloc")
POST_HOOKS = ("param_realloc", "offload", "save", "evaluate")

Phase = Literal["pre", "compute", "post"]


@dataclass(frozen=True)
class FlushStep:
    """One thing a flush does: a hook (``hook`` set) or the compute call of ``request``."""

    phase: Phase
    request: Request
    hook: dict | None = None


def flush_plan(queued: Sequence[Request]) -> list[FlushStep]:
    """The steps of a flush over ``queued`` (in posting order): pre-hooks, computes by group size, post-hooks."""
    pre = [FlushStep("pre", r, h) for r in queued for h in r.pre_hooks]
    compute = [FlushStep("compute", r) for r in sorted(queued, key=lambda r: r.group_size)]  # sort is stable
    post = [FlushStep("post", r, h) for r in queued for h in r.post_hooks]
    return pre + compute + post
