"""An SGLang server as a child process: its command (pure, pinned by golden files) and its lifetime."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from areal_hpc.gen.backends import ServerSpec, free_port

log = logging.getLogger(__name__)
STOP_GRACE_SECS = 30.0


class SGLangSetupError(RuntimeError):
    """The server cannot be started as specified; the message says what to change."""


def server_command(spec: ServerSpec, port: int, python: str = sys.executable) -> list[str]:
    """The child's command: SGLang's launch flags (sglang 0.5.10's names) after our launcher's."""
    if not spec.device.startswith("cuda"):
        raise SGLangSetupError(f"SGLang servers run on GPUs, not on {spec.device!r}: use the builtin backend")
    base_gpu = int(spec.device.partition(":")[2] or 0)
    cmd = [python, "-P", "-m", "areal_hpc.gen.backends.sglang.launch", "--token-file", str(spec.token_file)]
    cmd += ["--model-path", spec.model_path, "--host", spec.host, "--port", str(port)]
    cmd += ["--tp-size", str(spec.tp_size), "--base-gpu-id", str(base_gpu), "--random-seed", str(spec.seed)]
    cmd += ["--max-running-requests", str(spec.max_running_requests), "--weight-version", spec.weight_version]
    cmd += ["--mem-fraction-static", str(spec.mem_fraction_static), "--dtype", spec.dtype or "bfloat16"]
    if spec.context_length is not None:
        cmd += ["--context-length", str(spec.context_length)]
    if spec.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(spec.max_total_tokens)]
    # The client decodes the answers (gen.client); the original launched its servers so, and with metrics.
    cmd += ["--skip-tokenizer-init", "--enable-metrics", "--log-level", spec.log_level]
    if spec.memory_saver:  # without it release_memory_occupation frees nothing
        cmd.append("--enable-memory-saver")
    if spec.ep_size != 1:  # SGLang's default is 1: the shipped commands stay as they were
        cmd += ["--ep-size", str(spec.ep_size)]
    if spec.enable_return_routed_experts:  # routing replay: without it SGLang drops return_routed_experts
        cmd.append("--enable-return-routed-experts")
    if spec.max_lora_rank:  # LoRA adapters published each version (weights.publisher.AdapterPublisher)
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank), "--lora-target-modules"]
        cmd += list(spec.lora_target_modules)
    if spec.nnodes > 1:  # node rank 0 serves HTTP, the others run their part of the model
        cmd += ["--dist-init-addr", spec.dist_init_addr, "--nnodes", str(spec.nnodes)]
        cmd += ["--node-rank", str(spec.node_rank)]
    return cmd


class SGLangServer:
    """A started SGLang server: the child process and where clients reach it."""

    def __init__(self, spec: ServerSpec):
        port = spec.port or free_port(spec.host)
        cmd = server_command(spec, port)
        log.info("starting SGLang: %s", " ".join(cmd))
        self.process = subprocess.Popen(cmd, start_new_session=True)  # its own group: stop() ends them all
        self.url = f"http://{spec.public_host}:{port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM (SGLang's launcher then ends its scheduler processes); SIGKILL to the group after a grace."""
        if not self.alive():
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_GRACE_SECS)
        except subprocess.TimeoutExpired:
            log.warning(
                "SGLang server %d did not stop within %.0f s: killed", self.process.pid, STOP_GRACE_SECS
            )
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start(spec: ServerSpec) -> SGLangServer:
    """The backend's entry (areal_hpc.gen.backends)."""
    return SGLangServer(spec)
