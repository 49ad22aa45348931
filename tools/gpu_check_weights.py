"""Weight broadcast on GPUs: this process is trainer rank 0 (cuda:0), a built-in server subprocess rank 1
(cuda:1), over NCCL; the controller's BroadcastPublisher drives both, as in a run. Not part of the test suite.

For a tiny random Qwen2 and a larger one (~1 GB of bf16 tensors by default) it: saves the original weights and
starts the server on them (float32, so its weights hold the bf16 values exactly); sends other random weights in
bf16 and times the first publish (group setup + sync) and the next one (sync only); checks the server's
greedy answer against a float32 forward pass of the new weights (the logprobs of its tokens must match, and
differ from the original weights'), and that weight_version changed; optionally times the disk mode, and
checks that a sync whose trainer never sends times out with a message while the server keeps serving.
Exits 1 on any mismatch. Needs no network.

Usage::

    python tools/gpu_check_weights.py [--backend nccl] [--server-device cuda:1] [--large-gb 1.0]
        [--bucket-mb 512] [--disk] [--check-timeout] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from areal_hpc.gen.client import GenClient  # noqa: E402
from areal_hpc.train.backends.hf_dir import write_hf_dir  # noqa: E402
from areal_hpc.weights.publisher import BroadcastPublisher, DiskPublisher, WeightSyncError  # noqa: E402
from areal_hpc.weights.sender import WeightSender, plan_payload  # noqa: E402

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
TOLERANCE = 2e-3  # max |logprob difference| between the server and the reference (both float32)


def qwen2_config(large_gb: float | None) -> Qwen2Config:
    """The tiny model of the tests, or a Qwen2 of about ``large_gb`` GB in bf16 (layers scale the size)."""
    if large_gb is None:
        return Qwen2Config(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        )  # fmt: skip
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


def start_server(
    model_dir: Path, device: str, work: Path, log_path: Path
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
    cmd += ["--address-file", str(address), "--device", device, "--dtype", "float32", "--max-batch-size", "4"]
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


@torch.no_grad()
def logprobs_under(model: torch.nn.Module, out: dict, device: str) -> torch.Tensor:
    """float32 logprobs of the server's answer tokens under ``model``'s weights (run in float32)."""
    with torch.device(device):  # a fresh float32 model: its rotary buffers are not the bf16-rounded ones
        ref = Qwen2ForCausalLM(model.config).eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.tensor([PROMPT + out["output_ids"]], device=device)
    logits = ref(ids).logits[0, len(PROMPT) - 1 : -1].float()
    del ref
    return logits.log_softmax(-1).gather(-1, ids[0, len(PROMPT) :, None]).squeeze(-1).cpu()


def check_server(client: GenClient, new, old, version: str, device: str) -> list[str]:
    out = client.generate(PROMPT, GREEDY)[0]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    err = (got - logprobs_under(new, out, device)).abs().max().item()
    moved = (got - logprobs_under(old, out, device)).abs().max().item()
    print(f"    logprobs vs new weights: max |diff| {err:.2e}; vs the original weights {moved:.2e}")
    problems = []
    if err > TOLERANCE:
        problems.append(f"server logprobs differ from the new weights' by {err:.2e} > {TOLERANCE}")
    if moved < 10 * TOLERANCE:
        problems.append(f"server logprobs are those of the original weights ({moved:.2e})")
    if out["meta_info"]["weight_version"] != version or client.model_info()["weight_version"] != version:
        problems.append(f"weight_version is {client.model_info()['weight_version']}, expected {version}")
    return problems


def run_case(
    name: str, large_gb: float | None, args: argparse.Namespace, work: Path, timeout_only=False
) -> list[str]:
    config = qwen2_config(large_gb)
    old = random_model(config, 0, args.trainer_device)
    n_bytes = sum(t.numel() * t.element_size() for t in old.state_dict().values())
    print(
        f"== {name}: {config.num_hidden_layers} layers, {n_bytes / 1e9:.3f} GB of bf16 tensors (state dict)"
    )
    model_dir = work / f"{name}-v0"
    old.save_pretrained(model_dir)
    new = random_model(config, 1, args.trainer_device)
    proc, client = start_server(model_dir, args.server_device, work, Path(args.out) / f"server-{name}.log")
    problems: list[str] = []
    try:
        if timeout_only:
            return [f"{name}: {p}" for p in check_timeout(client, new, args)]
        trainer = Trainer(new, args.backend)
        publisher = BroadcastPublisher(trainer, [client], args.timeout, args.bucket_mb * 2**20)
        for version in (1, 2, 3):
            stats = publisher.publish(version)
            secs = stats["timeperf/weight_sync"]
            setup = stats.get("timeperf/weight_group_init")
            print(f"  publish {version} ({args.backend}, {len(publisher.buckets)} buckets): sync {secs * 1e3:.1f} ms, "
                  f"{stats['weight_sync/bytes'] / secs / 1e9:.2f} GB/s" + (f"; group setup {setup * 1e3:.1f} ms" if setup else ""))  # fmt: skip
        problems += check_server(client, new, old, "3", args.trainer_device)
        if args.disk:
            disk = DiskPublisher(lambda v: work / f"{name}-disk-v{v}", trainer, [client], args.timeout)
            stats = disk.publish(4)
            print(
                f"  disk publish: {stats['timeperf/weight_sync']:.2f} s for {stats['weight_sync/bytes'] / 1e9:.3f} GB"
            )
            problems += check_server(client, new, old, "4", args.trainer_device)
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
    p.add_argument("--large-gb", type=float, default=1.0, help="bf16 size of the larger model; 0: skip it")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--disk", action="store_true", help="also time the disk mode (save + manifest + load)")
    p.add_argument("--check-timeout", action="store_true", help="also check a sync that never comes")
    p.add_argument("--out", default=".", help="folder for the server logs")
    args = p.parse_args()
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
        if args.large_gb > 0:
            problems += run_case("large", args.large_gb, args, Path(tmp))
        if args.check_timeout:
            problems += run_case("timeout", None, args, Path(tmp), timeout_only=True)
    for problem in problems:
        print("MISMATCH:", problem)
    print("OK" if not problems else f"FAILED ({len(problems)} problem(s))")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
