"""Weight broadcast on GPUs: this process is trainer rank 0 (cuda:0), a built-in server subprocess rank 1
(cuda:1), over NCCL; the controller's BroadcastPublisher drives both, as in a run. Not part of the test suite.

For a tiny random Qwen2 and a larger one (``--large``: about that many GB of bf16 tensors, or a Qwen2.5 shape
such as ``7b``, 15.2 GB) it: saves the original weights and starts the server on them (the tiny one in float32,
so that its weights hold the bf16 values exactly; the larger one in bf16, as a real server); sends other random
weights in bf16 and times the first publish (group setup + sync) and the next ones (sync only); checks the
server's greedy answer against a float32 forward pass of the new weights (the logprobs of its tokens must match,
within the server dtype's rounding, and differ from the original weights'), and that weight_version changed;
optionally times the disk mode, and checks that a sync whose trainer never sends times out with a message
while the server keeps serving. Exits 1 on any mismatch.

For the larger model it first times a raw broadcast of the same bytes between two processes on the same two
devices (a plain torch.distributed group, nothing else: as one buffer, and in pieces of each ``--bucket-mb``),
then publishes in buckets of each of those sizes and prints the publisher's time and bandwidth beside the raw
broadcast's, and what a bucket costs beyond its bytes (the line of time against the number of buckets).
``--target-ms`` and ``--target-fraction`` (of the raw bandwidth in pieces of that size) make it exit 1 when
no bucket size meets them. With several bucket sizes the tiny model is timed the same way (no targets): its
bytes are nothing, so the line shows what a bucket and a publish cost alone. Needs no network. On a CPU: ``--backend gloo --trainer-device cpu``.

Usage::

    python tools/gpu_check_weights.py [--backend nccl] [--server-device cuda:1] [--large 1.0 | --large 7b]
        [--bucket-mb 512,1024,2048] [--publishes 3] [--target-ms 50 --target-fraction 0.85] [--disk] [--check-timeout]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from areal_hpc.gen.client import GenClient  # noqa: E402
from areal_hpc.train.backends.hf_dir import write_hf_dir  # noqa: E402
from areal_hpc.weights.publisher import BroadcastPublisher, DiskPublisher, WeightSyncError  # noqa: E402
from areal_hpc.weights.sender import WeightSender, plan_payload  # noqa: E402
from tools.bench_train import SHAPES, VOCAB  # noqa: E402

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
# max |logprob difference| between the server (by its dtype) and the float32 reference; the original weights'
# logprobs must differ by ten times more. A bf16 server rounds at every one of its layers.
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25}


def qwen2_config(large: str | None) -> Qwen2Config:
    """The tiny model of the tests, a Qwen2.5 shape (``7b``: tools/bench_train.py's) or a Qwen2 of about
    ``large`` GB in bf16 (layers scale the size)."""
    if large is None:
        return Qwen2Config(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        )  # fmt: skip
    if large in SHAPES:
        hidden, inter, layers, heads, kv, tied = SHAPES[large]
        return Qwen2Config(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
            max_position_embeddings=4096, rope_theta=1e6,
        )  # fmt: skip
    large_gb = float(large)
    hidden, inter, vocab = 1536, 4096, 32000
    per_layer = 2 * hidden * hidden + 2 * hidden * 256 + 3 * hidden * inter
    layers = max(1, round((large_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


def random_model(config: Qwen2Config, seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


class Trainer:
    """Trainer rank 0 as the publisher calls it (what TrainerHandlers does, on a model held here)."""

    def __init__(self, model: torch.nn.Module, backend: str, send: bool = True):
        self.model, self.backend, self.send, self.sender = model, backend, send, WeightSender()

    def call_each(self, type: str, payload=None, timeout: float | None = None) -> list:
        return [self.call_one(0, type, payload, timeout)]

    def call_one(self, rank: int, type: str, payload=None, timeout: float | None = None):
        if type == "weight_group_store":
            port = self.sender.open(payload["group_name"], payload["timeout_s"])
            return {"master_address": "127.0.0.1", "master_port": port, "backend": self.backend}
        if type == "init_weight_group":
            plan = self.sender.join(
                payload["world_size"],
                payload["backend"],
                self.model.state_dict(),
                torch.bfloat16,
                payload["bucket_bytes"],
            )
            return {"buckets": plan_payload(plan)}
        if type == "broadcast_weights":
            if not self.send:
                time.sleep(timeout + 5)
                raise TimeoutError("this trainer was told not to send")
            return self.sender.send(self.model.state_dict())
        raise ValueError(type)

    def call_all(self, type: str, payload: dict) -> list:  # the disk mode's save
        out = Path(payload["path"])
        weights = self.model.state_dict().items()
        return [{"path": str(write_hf_dir(out, self.model, weights, out.parent, torch.bfloat16))}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _raw_rank(rank: int, port: int, args: argparse.Namespace, n_bytes: int, out: str) -> None:
    """One end of the raw broadcast: a plain group of two processes, ``n_bytes`` from rank 0, timed by rank 0."""
    device = torch.device((args.trainer_device, args.server_device)[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, device=device)
    ways = {"whole": [buffer], **{mb: buffer.split(bucket_bytes(mb)) for mb in args.bucket_mb}}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(1 + args.raw_repeats):  # the first round warms up (NCCL makes its communicator)
        for way, parts in ways.items():
            dist.barrier()
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            start = time.perf_counter()
            for part in parts:
                dist.broadcast(part, 0)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            times[way].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({way: statistics.median(t[1:]) for way, t in times.items()}))
    dist.destroy_process_group()


def raw_broadcast(n_bytes: int, args: argparse.Namespace, work: Path) -> dict:
    """Median seconds of a raw broadcast of ``n_bytes`` between the trainer's and the server's devices:
    ``{"whole": one buffer, MB: in pieces of each --bucket-mb}``."""
    out = work / "raw.json"
    mp.spawn(_raw_rank, args=(_free_port(), args, n_bytes, str(out)), nprocs=2)
    raw = json.loads(out.read_text())
    ways = ", ".join(
        f"{way if way == 'whole' else f'in {way} MB pieces'} {secs * 1e3:.1f} ms ({n_bytes / secs / 1e9:.1f} GB/s)"
        for way, secs in raw.items()
    )
    print(f"  raw broadcast of {n_bytes / 1e9:.3f} GB ({args.backend}): {ways}")
    return raw


def per_bucket_cost(syncs: dict[int, tuple[int, float]]) -> str | None:
    """The line of sync seconds against the number of buckets (``{MB: (buckets, secs)}``): what a bucket costs
    beyond its bytes, and what is left for the bytes."""
    xs, ys = zip(*syncs.values(), strict=True)
    if len(set(xs)) < 2:
        return None
    slope, intercept = statistics.linear_regression(xs, ys)
    return (
        f"  each bucket costs {slope * 1e3:.2f} ms beyond its bytes; the bytes alone {intercept * 1e3:.1f} ms"
    )


def against_raw(mb: str, secs: float, n_bytes: float, raw: dict, args: argparse.Namespace) -> list[str]:
    """The publisher's sync in ``mb`` MB buckets beside the raw broadcast in pieces of that size; the targets
    it misses."""
    fraction = raw[mb] / secs
    print(f"  {mb} MB buckets: publisher {secs * 1e3:.1f} ms, {n_bytes / secs / 1e9:.1f} GB/s = {fraction:.0%} of "
          f"the raw broadcast's bandwidth in pieces of that size ({raw['whole'] / secs:.0%} of one buffer's)")  # fmt: skip
    problems = []
    if args.target_ms is not None and secs * 1e3 > args.target_ms:
        problems.append(
            f"{mb} MB buckets: a sync took {secs * 1e3:.1f} ms, over the target {args.target_ms:g} ms"
        )
    if args.target_fraction is not None and fraction < args.target_fraction:
        problems.append(
            f"{mb} MB buckets: a sync reached {fraction:.0%} of the raw bandwidth, under {args.target_fraction:.0%}"
        )
    return problems


def start_server(
    model_dir: Path, device: str, work: Path, log_path: Path, dtype: str
) -> tuple[subprocess.Popen, GenClient]:
    secret, address = work / "secret", work / "address.json"
    token = os.urandom(16).hex()
    secret.write_text(token)
    secret.chmod(0o600)
    cmd = [
        sys.executable,
        "-m",
        "areal_hpc.gen.backends.builtin.server",
        "--model-path",
        str(model_dir),
        "--token-file",
        str(secret),
    ]
    cmd += ["--address-file", str(address), "--device", device, "--dtype", dtype, "--max-batch-size", "4"]
    with open(log_path, "w") as log:  # the child keeps its own copy of the file descriptor
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not address.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; see {log_path}")
        time.sleep(0.2)
    client = GenClient(json.loads(address.read_text())["url"], token, timeout=600)
    client.wait_healthy(60)
    return proc, client


_REFERENCE: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


@torch.no_grad()
def logprobs_under(model: torch.nn.Module, out: dict, device: str) -> torch.Tensor:
    """float32 logprobs of the server's answer tokens under ``model``'s weights (run in float32; kept: a large
    model's float32 copy is slow to make)."""
    key = (id(model), tuple(out["output_ids"]))
    if key not in _REFERENCE:
        _REFERENCE[key] = _logprobs_under(model, out, device)
    return _REFERENCE[key]


def _logprobs_under(model: torch.nn.Module, out: dict, device: str) -> torch.Tensor:
    with torch.device(device):  # a fresh float32 model: its rotary buffers are not the bf16-rounded ones
        ref = Qwen2ForCausalLM(model.config).eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.tensor([PROMPT + out["output_ids"]], device=device)
    logits = ref(ids).logits[0, len(PROMPT) - 1 : -1].float()
    del ref
    return logits.log_softmax(-1).gather(-1, ids[0, len(PROMPT) :, None]).squeeze(-1).cpu()


def check_server(client: GenClient, new, old, version: str, device: str, dtype: str) -> list[str]:
    out = client.generate(PROMPT, GREEDY)[0]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    err = (got - logprobs_under(new, out, device)).abs().max().item()
    moved = (got - logprobs_under(old, out, device)).abs().max().item()
    print(f"    logprobs vs new weights: max |diff| {err:.2e}; vs the original weights {moved:.2e}")
    problems, tolerance = [], TOLERANCE[dtype]
    if err > tolerance:
        problems.append(f"server logprobs differ from the new weights' by {err:.2e} > {tolerance}")
    if moved < 10 * tolerance:
        problems.append(f"server logprobs are those of the original weights ({moved:.2e})")
    if out["meta_info"]["weight_version"] != version or client.model_info()["weight_version"] != version:
        problems.append(f"weight_version is {client.model_info()['weight_version']}, expected {version}")
    return problems


def bucket_bytes(mb: str) -> int:
    return int(float(mb) * 2**20)


def publish_timed(trainer: Trainer, client: GenClient, mb: str, first: int, args) -> tuple[float, float, int]:
    """``--publishes`` publishes through a new group in ``mb`` MB buckets, from version ``first``: the median
    seconds of those after the first (which makes the group), the bytes and the buckets."""
    publisher = BroadcastPublisher(trainer, [client], args.timeout, bucket_bytes(mb))
    stats = [publisher.publish(version) for version in range(first, first + args.publishes)]
    syncs, setup = [s["timeperf/weight_sync"] for s in stats], stats[0]["timeperf/weight_group_init"]
    sent, median = stats[-1]["weight_sync/bytes"], statistics.median(syncs[1:] or syncs)
    print(f"  {len(publisher.buckets)} buckets of <= {mb} MB ({args.backend}): the first publish {syncs[0] * 1e3:.1f} ms "
          f"(group setup {setup * 1e3:.1f} ms), the next {len(syncs) - 1}: median {median * 1e3:.2f} ms, "
          f"{sent / median / 1e9:.2f} GB/s")  # fmt: skip
    client.destroy_weights_update_group(publisher.group_name)  # a server keeps every group it joined
    return median, sent, len(publisher.buckets)


def run_case(
    name: str, large: str | None, args: argparse.Namespace, work: Path, timeout_only=False
) -> list[str]:
    config = qwen2_config(large)
    dtype = "float32" if large is None else "bfloat16"  # the server's: float32 holds the bf16 values exactly
    old = random_model(config, 0, args.trainer_device)
    n_bytes = sum(t.numel() * t.element_size() for t in old.state_dict().values())
    print(f"== {name}: {config.num_hidden_layers} layers, {n_bytes / 1e9:.3f} GB of bf16 tensors (state dict), "
          f"server in {dtype}")  # fmt: skip
    sweep = large is not None or len(args.bucket_mb) > 1  # the tiny model too, to time what a bucket costs
    raw = raw_broadcast(n_bytes, args, work) if sweep and not timeout_only else None
    model_dir = work / f"{name}-v0"
    old.save_pretrained(model_dir)
    new = random_model(config, 1, args.trainer_device)
    log = Path(args.out) / f"server-{name}.log"
    proc, client = start_server(model_dir, args.server_device, work, log, dtype)
    problems: list[str] = []
    try:
        if timeout_only:
            return [f"{name}: {p}" for p in check_timeout(client, new, args)]
        trainer, version, syncs = Trainer(new, args.backend), 0, {}
        for mb in args.bucket_mb if raw is not None else args.bucket_mb[:1]:
            secs, sent, n_buckets = publish_timed(trainer, client, mb, version + 1, args)
            version += args.publishes
            syncs[mb] = (n_buckets, secs)
            problems += check_server(client, new, old, str(version), args.trainer_device, dtype)
        if raw is not None:
            misses = {mb: against_raw(mb, secs, sent, raw, args) for mb, (_, secs) in syncs.items()}
            if line := per_bucket_cost(syncs):
                print(line)
            if large is not None and all(misses.values()):  # targets: for the size a run would be given
                problems += min(misses.values(), key=len)
        if args.disk:
            disk = DiskPublisher(lambda v: work / f"{name}-disk-v{v}", trainer, [client], args.timeout)
            version = str(version + 1)
            stats = disk.publish(int(version))
            print(
                f"  disk publish: {stats['timeperf/weight_sync']:.2f} s for {stats['weight_sync/bytes'] / 1e9:.3f} GB"
            )
            problems += check_server(client, new, old, version, args.trainer_device, dtype)
        print("  closing the trainer's end of the group", flush=True)
        trainer.sender.close()
    finally:
        print("  stopping the server", flush=True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        if code != 0:
            problems.append(f"the server exited with {code} (see server-{name}.log)")
    return [f"{name}: {p}" for p in problems]


def check_timeout(client: GenClient, model, args: argparse.Namespace) -> list[str]:
    """A group that worked once, then a sync whose trainer never sends: a clear error, the server serves on."""
    trainer = Trainer(model, args.backend)
    publisher = BroadcastPublisher(trainer, [client], timeout=5)
    publisher.publish(10)  # the communicator exists now: the next op waits on the GPU, not on the store
    print("  timeout check: one good publish on the group", flush=True)
    trainer.send = False
    start = time.monotonic()
    try:
        publisher.publish(11)
        return ["a sync that never came did not fail"]
    except WeightSyncError as exc:
        print(f"  timeout check: failed after {time.monotonic() - start:.1f} s with: {exc}", flush=True)
        message = str(exc)
    quick = GenClient(client.url, client.token, timeout=60)  # a stuck server fails this check, not the budget
    quick.continue_generation()
    problems = [] if "timed out after 5 s" in message else [f"unexpected timeout message: {message}"]
    out = quick.generate(PROMPT, GREEDY)[0]
    if not quick.health() or out["meta_info"]["finish_reason"]["type"] != "length":
        problems.append("the server does not serve after a timed-out sync")
    print(f"  timeout check: the server still serves ({len(out['output_ids'])} tokens)", flush=True)
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--trainer-device", default="cuda:0")
    p.add_argument("--server-device", default=None, help="default: cuda:1 if there are 2 GPUs, else cuda:0")
    p.add_argument(
        "--large", default="1.0", help="the larger model: its bf16 GB, or a Qwen2.5 shape (7b); 0: none"
    )
    p.add_argument(
        "--bucket-mb",
        default="512",
        help="bucket sizes in MB (0.0625: 64 KB), comma-separated: each is tried",
    )
    p.add_argument(
        "--publishes", type=int, default=3, help="publishes of each model (the first makes the group)"
    )
    p.add_argument("--raw-repeats", type=int, default=5, help="timed rounds of the raw broadcast (median)")
    p.add_argument(
        "--target-ms", type=float, default=None, help="fail when a sync of the larger model is slower"
    )
    p.add_argument(
        "--target-fraction", type=float, default=None, help="fail under this share of the raw bandwidth"
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--disk", action="store_true", help="also time the disk mode (save + manifest + load)")
    p.add_argument("--check-timeout", action="store_true", help="also check a sync that never comes")
    p.add_argument("--out", default=".", help="folder for the server logs")
    args = p.parse_args()
    args.bucket_mb = args.bucket_mb.split(",")
    if not all(bucket_bytes(mb) > 0 for mb in args.bucket_mb):
        p.error("--bucket-mb: sizes must be > 0")
    n_gpus = torch.cuda.device_count()
    if args.server_device is None:
        args.server_device = "cuda:1" if n_gpus > 1 else args.trainer_device
    if args.backend == "nccl" and args.server_device == args.trainer_device:
        print("NCCL refuses two ranks on one GPU: give two GPUs, or --backend gloo", file=sys.stderr)
        return 2
    if args.trainer_device.startswith("cuda"):
        torch.cuda.set_device(args.trainer_device)
    gpu = torch.cuda.get_device_name(0) if n_gpus else "none"
    print(f"torch {torch.__version__}, {n_gpus} GPU(s) ({gpu}); trainer {args.trainer_device}, "
          f"server {args.server_device}, backend {args.backend}")  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-weights-") as tmp:
        problems += run_case("tiny", None, args, Path(tmp))
        if args.large != "0":
            problems += run_case("large", args.large, args, Path(tmp))
        if args.check_timeout:
            problems += run_case("timeout", None, args, Path(tmp), timeout_only=True)
    for problem in problems:
        print("MISMATCH:", problem)
    print("OK" if not problems else f"FAILED ({len(problems)} problem(s))")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
