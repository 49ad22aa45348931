"""How generation servers and their clients find each other: each server's address in the run directory."""

from __future__ import annotations

import os
from pathlib import Path

from areal_hpc.control import START_TIMEOUT_SECS, RunDir, fsio, poll_until, task_name
from areal_hpc.gen.client import GenClient


def announce(path: Path, url: str) -> None:
    """Make this process's server known at address file `path` (`RunDir.gen_address(i)`), once it answers."""
    fsio.write_json(path, {"url": url, "pid": os.getpid()})


def withdraw(path: Path) -> None:
    """Remove address file `path`, unless a restarted server announced itself there meanwhile."""
    address = fsio.read_json(path)
    if address and address.get("pid") == os.getpid():
        fsio.remove(path)


def clients(
    run: RunDir,
    n_servers: int,
    tokenizer=None,
    timeout: float = START_TIMEOUT_SECS,
    capacity: int | None = None,
    adapters: bool = False,
) -> list[GenClient]:
    """A client of each of the run's `n_servers` servers, once each announced itself (`tokenizer`: decodes
    the answers of servers that send no text; `capacity`: the samples a server runs at once,
    max_running_requests, which this process sends it at most; `adapters`: requests name the LoRA adapter
    of their server's version, weight_update_mode adapter)."""
    token = run.token()
    return [
        GenClient(
            wait_address(run, i, timeout)["url"],
            token,
            tokenizer=tokenizer,
            capacity=capacity,
            name=task_name("gen_server", i),
            adapters=adapters,
        )
        for i in range(n_servers)
    ]


def wait_address(run: RunDir, index: int, timeout: float) -> dict:
    path = run.gen_address(index)
    return poll_until(lambda: fsio.read_json(path), timeout, f"generation server {index} to write {path}")
