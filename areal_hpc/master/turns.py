"""Colocated generation and training take turns on the same GPUs (a bare 3D spec in allocation_mode).

After a step's rollouts the servers give their memory back (SGLang's release_memory_occupation) and the
trainers run the step's calls. Before the new weights are published the servers take the weights' memory back,
and only after the update the KV cache's, as SGLang's own RL integrations order it, so that the cache is not
held while the weights load. Decoupled servers keep their memory: `Turns(colocated=False)` does nothing.
Servers of a LoRA actor's adapters (`keep_weights`) keep their base weights, which never change: they give back
their KV cache alone, and take an adapter where others take the weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from areal_hpc.control import timeline


class Turns:
    """Who holds the shared GPUs: the servers (after `publish`) or the trainers (after `to_trainers`)."""

    def __init__(self, clients: Sequence, colocated: bool, timeout: float, keep_weights: bool = False):
        self.clients, self.colocated, self.timeout = list(clients), colocated, timeout
        self.released = ["kv_cache", "cuda_graph"] if keep_weights else None  # None: all
        self.trainers_hold = False

    def to_trainers(self) -> dict[str, float]:
        """The servers, idle after the step's rollouts, release all their memory."""
        if not self.colocated or self.trainers_hold:
            return {}
        start = time.monotonic()
        with timeline.span("release_memory"):
            self._each(lambda c: c.release_memory_occupation(self.released, self.timeout))
        self.trainers_hold = True
        return {"timeperf/release_memory": time.monotonic() - start}

    def publish(self, publish: Callable[[], dict]) -> dict[str, float]:
        """`publish()` the new weights into the servers' resumed weight memory, then resume their KV cache."""
        if not self.trainers_hold:
            return publish()
        start = time.monotonic()
        if self.released is None:
            with timeline.span("resume_memory", tags="weights"):
                self._each(lambda c: c.resume_memory_occupation(["weights"], self.timeout))
        with timeline.span("update_weights"):
            stats = publish()
        with timeline.span("resume_memory", tags="kv_cache"):
            self._each(lambda c: c.resume_memory_occupation(["kv_cache", "cuda_graph"], self.timeout))
        self.trainers_hold = False
        resumed = time.monotonic() - start - stats.get("timeperf/weight_sync", 0.0)
        return stats | {"timeperf/resume_memory": resumed}

    def _each(self, call: Callable) -> None:
        with ThreadPoolExecutor(max(1, len(self.clients))) as pool:
            list(pool.map(call, self.clients))
