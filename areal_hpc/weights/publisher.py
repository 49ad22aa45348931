"""Weight publication as the controller drives it: ``publisher.publish(version) -> stats`` after a train step.

``BroadcastPublisher`` (``weight_update_mode: broadcast``): at the first publish, trainer rank 0 serves the
store of a fresh weight group (request ``weight_group_store``), then every server joins it over HTTP
(``/init_weights_update_group``: its TP ranks from ``rank_offset``) while trainer rank 0 joins as rank 0 (``init_weight_group``,
which answers with the bucket plan). Each publish pauses generation (running requests end with finish reason
abort and return their partial output), then the trainer ranks gather the weights and rank 0 broadcasts the
buckets (``broadcast_weights``)
while each server receives them, one ``/update_weights_from_distributed`` request per bucket with
``load_format: "flattened_bucket"`` (SGLang's API), and finally generation continues on the new weights.

``DiskPublisher`` (``weight_update_mode: disk``): trainer rank 0 saves a safetensors snapshot whose
``manifest.json`` is written last; every server loads it with ``/update_weights_from_disk``; the previous
snapshot is removed.

``TensorPublisher`` (``weight_update_mode: tensor``, colocated): every trainer rank gathers the full weights and
holds them, sharing them by CUDA IPC handles (``shared.py``); each server's TP ranks copy them from the trainer
ranks on their own GPUs with ``/update_weights_from_tensor`` (SGLang's API); then the ranks drop them. No disk,
no copy on the way, and no GPU read by the servers of other GPUs.

``AdapterPublisher`` (``weight_update_mode: adapter``, a LoRA actor): trainer rank 0 writes the adapters of the
version as a PEFT folder (megabytes); every server loads it under the version's name (``/load_lora_adapter``:
generation goes on meanwhile), then reports the version (``/update_weight_version``, which interrupts running
requests when generation is interruptible), and lets the previous adapter go; requests name the adapter of their
server's version (``gen/adapters.py``).

The parts of one step run concurrently and are awaited together within ``timeout`` seconds: a part that fails
or does not finish in time raises ``WeightSyncError`` naming the server or trainer rank and why, so the run
fails instead of hanging. Each reports ``timeperf/weight_sync`` and ``weight_sync/bytes``.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal_hpc.config import allocation_of
from areal_hpc.control import read_manifest, snapshot_bytes
from areal_hpc.weights.adapter import adapter_name
from areal_hpc.weights.group import server_ranks
from areal_hpc.weights.receiver import FLATTENED

log = logging.getLogger(__name__)

TRAINER = "trainer rank 0"
MARGIN_S = (
    5.0  # calls wait this much longer than the group's own waits, so the cause, not a bare timeout, surfaces
)


class WeightSyncError(RuntimeError):
    """A weight publication failed or timed out; the message names each server or trainer rank at fault."""


def run_all(tasks: dict[str, Callable[[], Any]], timeout: float, what: str) -> dict[str, Any]:
    """Run ``tasks`` (name -> callable) concurrently; their results by name once all succeeded.

    The first failure, or ``timeout`` seconds without all done, raises WeightSyncError listing every task
    that failed so far (with its error) and every task still running. Threads are daemons: a stuck call
    cannot keep the process alive.
    """
    results: queue.Queue = queue.Queue()

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            results.put((name, True, fn()))
        except BaseException as exc:  # noqa: BLE001 (reported to the caller, whatever it is)
            results.put((name, False, exc))

    for name, fn in tasks.items():
        threading.Thread(target=run, args=(name, fn), name=f"weights: {name}", daemon=True).start()
    done: dict[str, Any] = {}
    failed: dict[str, BaseException] = {}
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < len(tasks) and not failed:
        try:
            name, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            break
        (done if ok else failed)[name] = value
    if not failed and len(done) == len(tasks):
        return done
    time.sleep(0.2)  # a failure often brings its peers' errors with it: collect those that come at once
    while not results.empty():
        name, ok, value = results.get_nowait()
        (done if ok else failed)[name] = value
    problems = [f"{name}: {type(exc).__name__}: {exc}" for name, exc in failed.items()]
    pending = [name for name in tasks if name not in done and name not in failed]
    if pending and not failed:
        problems += [f"{name}: did not finish within {timeout:g} s" for name in pending]
    elif pending:
        problems.append(f"still running: {', '.join(pending)}")
    raise WeightSyncError(f"{what} failed: " + "; ".join(problems))


def server_name(index: int, client) -> str:
    return f"server {index} ({client.url})"


class BroadcastPublisher:
    """Publishes through a weight group of trainer rank 0 and every server; set up at the first publish.

    ``trainers`` needs ``call_one(rank, type, payload, timeout)`` (``TrainerGroup``); ``clients`` are
    ``GenClient``s, one rank each. ``abort_all_requests=False``: no interruption; generation is paused in
    place while the buckets arrive, and running requests go on with the new weights (their answers report
    only the new version: the rollout side knows the one they started under, gen/partial.py).
    """

    def __init__(
        self,
        trainers,
        clients: Sequence,
        timeout: float = 300.0,
        bucket_bytes: int = 512 * 2**20,
        abort_all_requests: bool = True,
        tp_size: int = 1,
    ):
        self.trainers, self.clients, self.tp_size = trainers, list(clients), tp_size
        self.timeout, self.bucket_bytes, self.abort_all = timeout, bucket_bytes, abort_all_requests
        self.group_name = f"areal-weights-{uuid.uuid4().hex[:8]}"
        self.buckets: list[dict] | None = None  # the plan, per bucket {"names", "dtypes", "shapes"}

    def setup(self) -> float:
        """Make the weight group (servers and trainer rank 0 join concurrently); returns the seconds taken."""
        start, t = time.monotonic(), self.timeout
        call_t, all_t = t + MARGIN_S, t + 2 * MARGIN_S
        try:
            store = self.trainers.call_one(
                0, "weight_group_store", {"group_name": self.group_name, "timeout_s": t}, call_t
            )
        except Exception as exc:
            raise WeightSyncError(
                f"opening weight group {self.group_name!r} failed: {TRAINER}: {exc}"
            ) from exc
        offsets, world_size = server_ranks([self.tp_size] * len(self.clients))  # each TP rank receives
        join = {"world_size": world_size, "backend": store["backend"], "bucket_bytes": self.bucket_bytes}
        tasks: dict[str, Callable[[], Any]] = {
            TRAINER: lambda: self.trainers.call_one(0, "init_weight_group", join, call_t)
        }
        for i, client in enumerate(self.clients):
            tasks[server_name(i, client)] = lambda c=client, rank=offsets[i]: c.init_weights_update_group(
                store["master_address"], store["master_port"], rank, world_size, self.group_name,
                store["backend"], group_timeout=t, timeout=call_t,
            )  # fmt: skip
        where = f"{store['master_address']}:{store['master_port']}"
        joined = run_all(
            tasks, all_t, f"setting up weight group {self.group_name!r} ({store['backend']}, {where})"
        )
        self.buckets = joined[TRAINER]["buckets"]
        log.info("weight group %s: %d ranks, %d buckets", self.group_name, world_size, len(self.buckets))
        return time.monotonic() - start

    def publish(self, version: int) -> dict[str, float]:
        """Broadcast the actor's weights of ``version`` to every server; statistics of the sync."""
        stats: dict[str, float] = {}
        if self.buckets is None:
            stats["timeperf/weight_group_init"] = self.setup()
        start, call_t, all_t = time.monotonic(), self.timeout + MARGIN_S, self.timeout + 2 * MARGIN_S
        servers = {server_name(i, c): c for i, c in enumerate(self.clients)}
        # Interrupt: running requests return what they have (finish reason abort). Else they wait in place and
        # go on with the new weights: no half-updated model serves between two buckets.
        mode = "abort" if self.abort_all else "in_place"
        run_all(
            {n: lambda c=c: c.pause_generation(mode) for n, c in servers.items()},
            call_t,
            "pausing generation",
        )
        tasks: dict[str, Callable[[], Any]] = {  # every rank gathers, rank 0 sends
            TRAINER: lambda: self.trainers.call_each("broadcast_weights", {"version": version}, call_t)[0]
        }
        for name, client in servers.items():
            tasks[name] = lambda c=client: self._update_server(c, version)
        try:
            results = run_all(tasks, all_t, f"weight sync of version {version} over {self.group_name!r}")
        except WeightSyncError:
            self.buckets = None  # the group is unusable now
            raise
        run_all({n: c.continue_generation for n, c in servers.items()}, call_t, "continuing generation")
        stats["timeperf/weight_sync"] = time.monotonic() - start
        stats["weight_sync/bytes"] = float(results[TRAINER]["bytes"])
        return stats

    def _update_server(self, client, version: int) -> None:
        last = len(self.buckets) - 1
        for i, bucket in enumerate(self.buckets):  # the version set once, with the last bucket
            client.update_weights_from_distributed(
                **bucket, group_name=self.group_name, weight_version=str(version) if i == last else None,
                flush_cache=i == last, abort_all_requests=self.abort_all, load_format=FLATTENED,
                timeout=self.timeout + MARGIN_S,
            )  # fmt: skip


class DiskPublisher:
    """Publishes through a safetensors snapshot per version in ``snapshot_dir(version)`` (shared storage)."""

    def __init__(
        self,
        snapshot_dir: Callable[[int], Path],
        trainers,
        clients: Sequence,
        timeout: float = 300.0,
        abort_all_requests: bool = True,
    ):
        self.snapshot_dir, self.trainers = snapshot_dir, trainers
        self.clients, self.timeout, self.abort_all = list(clients), timeout, abort_all_requests

    def publish(self, version: int) -> dict[str, float]:
        """Rank 0 saves the actor's weights; every server loads them; the previous snapshot is removed."""
        start, path = time.monotonic(), self.snapshot_dir(version)
        self.trainers.call_all("save", {"model": "actor", "path": str(path)})
        manifest = read_manifest(path)
        tasks = {
            server_name(i, c): lambda c=c: c.update_weights_from_disk(
                str(path), version, abort_all_requests=self.abort_all, timeout=self.timeout
            )
            for i, c in enumerate(self.clients)
        }
        run_all(tasks, self.timeout + MARGIN_S, f"loading weight snapshot {path}")
        shutil.rmtree(self.snapshot_dir(version - 1), ignore_errors=True)
        return {
            "timeperf/weight_sync": time.monotonic() - start,
            "weight_sync/bytes": float(snapshot_bytes(manifest)),
        }


class TensorPublisher:
    """Publishes to colocated servers by handing them the trainers' tensors (``weights/shared.py``): every rank
    gathers the full weights, the ranks in ``sources`` share them, each TP rank of server i copies from the
    trainer rank ``sources[i][tp_rank]`` (the one on its GPU: no GPU is read by more than its own server), then
    the ranks let them go."""

    def __init__(
        self,
        trainers,
        clients: Sequence,
        sources: Sequence[Sequence[int]],
        timeout=300.0,
        abort_all_requests=True,
    ):
        self.trainers, self.clients, self.sources = trainers, list(clients), [list(s) for s in sources]
        self.timeout, self.abort_all = timeout, abort_all_requests
        if len(self.sources) != len(self.clients):
            raise ValueError(
                f"{len(self.clients)} servers but the trainer ranks of {len(self.sources)} to share to"
            )

    def publish(self, version: int) -> dict[str, float]:
        start, call_t = time.monotonic(), self.timeout + MARGIN_S
        ranks = sorted({r for s in self.sources for r in s})
        try:
            shared = run_all(
                {TRAINER: lambda: self.trainers.call_each("share_weights", {"version": version, "ranks": ranks},
                                                          call_t)},
                call_t + MARGIN_S, f"sharing the weights of version {version}",
            )[TRAINER]  # fmt: skip
            tasks = {
                server_name(i, c): lambda c=c, src=src: c.update_weights_from_tensor(
                    [shared[r]["serialized"] for r in src], version, abort_all_requests=self.abort_all,
                    timeout=call_t,
                )
                for i, (c, src) in enumerate(zip(self.clients, self.sources, strict=True))
            }  # fmt: skip
            run_all(tasks, call_t + MARGIN_S, f"copying the shared weights of version {version}")
        finally:  # the servers are done with them, or failed: the trainers' memory goes back either way
            self.trainers.call_each("unshare_weights", None, call_t)
        secs = time.monotonic() - start
        return {"timeperf/weight_sync": secs, "weight_sync/bytes": float(shared[ranks[0]]["bytes"])}


class AdapterPublisher:
    """Publishes a LoRA actor's adapters through a PEFT folder per version in ``snapshot_dir(version)``."""

    def __init__(self, snapshot_dir: Callable[[int], Path], trainers, clients: Sequence, timeout=300.0,
                 abort_all_requests=True):  # fmt: skip
        self.snapshot_dir, self.trainers = snapshot_dir, trainers
        self.clients, self.timeout, self.abort_all = list(clients), timeout, abort_all_requests
        self.loaded: tuple[int, str] | None = None  # the version and name the servers hold from us

    def publish(self, version: int) -> dict[str, float]:
        start, path, name = time.monotonic(), self.snapshot_dir(version), adapter_name(version)
        self.trainers.call_all("save_adapter", {"path": str(path)})
        nbytes = snapshot_bytes(read_manifest(path))

        def update(c) -> None:
            c.load_lora_adapter(name, str(path), timeout=self.timeout)
            c.update_weight_version(version, self.abort_all, timeout=self.timeout)

        servers = {server_name(i, c): c for i, c in enumerate(self.clients)}
        run_all({n: lambda c=c: update(c) for n, c in servers.items()}, self.timeout + MARGIN_S,
                f"loading adapter {path}")  # fmt: skip
        if self.loaded is not None and self.loaded[0] != version:
            old_version, old = self.loaded
            # The servers hold it in memory: its folder goes now. SGLang unloads it once its last running
            # request ends (not interruptible: maybe minutes), which no publication waits for.
            shutil.rmtree(self.snapshot_dir(old_version), ignore_errors=True)
            for n, c in servers.items():
                threading.Thread(target=_unload, args=(n, c, old, self.timeout), daemon=True).start()
        self.loaded = (version, name)
        for c in self.clients:  # the controller's own requests name it from now on (synchronous RL)
            if getattr(c, "served", None) is not None:
                c.served.advance(version)
        return {"timeperf/weight_sync": time.monotonic() - start, "weight_sync/bytes": float(nbytes)}


def _unload(server: str, client, name: str, timeout: float) -> None:
    try:
        client.unload_lora_adapter(name, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 (a server that kept it holds one adapter more; nothing is wrong)
        log.warning("%s: adapter %s not unloaded: %s", server, name, exc)


def share_sources(servers: Sequence, n_trainers: int) -> list[list[int]]:
    """For each colocated server, the trainer rank each of its TP ranks copies the weights from: the one on the
    same GPU (the trainer step runs rank r on the job's GPU r)."""
    return [[gpu if gpu < n_trainers else 0 for gpu in server.gpus] for server in servers]


def make_publisher(cfg, run, trainers, clients: Sequence):
    """The publisher of ``cfg.weight_update_mode`` for a run (``run.weight_snapshot(version)`` names snapshots)."""
    timeout, interrupt = cfg.weight_update_timeout_secs, cfg.interruptible_generation
    if cfg.weight_update_mode == "disk":
        return DiskPublisher(run.weight_snapshot, trainers, clients, timeout, interrupt)
    if cfg.weight_update_mode == "broadcast":
        tp = allocation_of(cfg).gen_tensor
        bucket = cfg.weight_update_bucket_mb * 2**20
        return BroadcastPublisher(trainers, clients, timeout, bucket, interrupt, tp_size=tp)
    if cfg.weight_update_mode == "adapter":
        return AdapterPublisher(run.adapter_snapshot, trainers, clients, timeout, interrupt)
    if cfg.weight_update_mode == "tensor":
        sources = share_sources(allocation_of(cfg).gen_servers(), trainers.n_ranks)
        return TensorPublisher(trainers, clients, sources, timeout, interrupt)
    raise ValueError(f"unknown weight_update_mode {cfg.weight_update_mode!r}")
