"""Generation backends behind one seam: what starts a generation server.

Every backend's server speaks SGLang's HTTP API, so everything around the start is shared: the client
(`gen.client`), readiness (`/health`), discovery through the run directory (`gen.discovery`) and the
weight-update handshake (`areal_hpc.weights`: SGLang's weight group and routes). A backend is a package
(config/backends.py names it) with one function, `start(spec: ServerSpec) -> Server`:

    builtin   the built-in server in this process (a transformers model; CPU or one GPU)
    sglang    a real SGLang server, a child process on `tp_size` GPUs
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from areal_hpc.config import GEN_BACKENDS, SGLangConfig

_SGLANG = SGLangConfig()


@dataclass(frozen=True)
class ServerSpec:
    """Everything one generation server starts with."""

    model_path: str
    token_file: Path  # the run's secret: clients send it as the bearer token
    host: str = "127.0.0.1"  # the address to bind (0.0.0.0: every interface)
    port: int = 0  # 0: any free port
    device: str = "cpu"  # the server's first GPU, "cuda:<i>", or cpu
    tp_size: int = 1  # GPUs from `device` on
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    seed: int = 0  # of the samples' random streams
    max_running_requests: int = 256  # samples decoded together (SGLang's option)
    weight_version: str = "0"  # before any update
    cpu_threads: int = 1  # torch's CPU threads (roles on one machine share its cores)
    public_host: str = "127.0.0.1"  # the address clients reach it at (a child server's URL)
    memory_saver: bool = False  # colocated: its memory is released while the trainers train (SGLang's flag)
    # A server wider than a node: one process per node, meeting at node rank 0's dist_init_addr (host:port).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # SGLang's own, their defaults config.SGLangConfig's:
    mem_fraction_static: float = _SGLANG.mem_fraction_static
    context_length: int | None = _SGLANG.context_length
    log_level: str = _SGLANG.log_level
    ep_size: int = _SGLANG.ep_size  # a mixture-of-experts model's experts split over this many of its GPUs
    max_total_tokens: int | None = None  # a cap on the KV pool's positions (SGLang's flag; tests use it)
    # Routing replay (actor.router_replay rollout): answers carry each token's routed experts when asked.
    enable_return_routed_experts: bool = False
    # LoRA (weight_update_mode adapter): SGLang's --enable-lora with --max-lora-rank and --lora-target-modules.
    max_lora_rank: int = 0  # 0: LoRA off
    lora_target_modules: tuple[str, ...] = ()


class Server(Protocol):
    """A started generation server."""

    url: str  # where clients reach it

    def alive(self) -> bool:
        """False once it stopped or failed."""

    def stop(self) -> None:
        """Stop serving (running requests end with finish reason abort) and free its resources."""


def free_port(host: str) -> int:
    """A port free on `host` now (SGLang takes no port 0); the server binds it a moment later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(backend: str, spec: ServerSpec) -> Server:
    """Start a server of the generation backend named `backend` (allocation_mode's generation part)."""
    return importlib.import_module(GEN_BACKENDS[backend].module).start(spec)
