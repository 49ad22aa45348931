"""Benchmark the trainer: one RL-like minibatch through an engine, the sharded FSDP engine against the padded,
replicated torch engine measured in the same run.

The workload (issue 12): 64 sequences of 200 + lognormal(6.5, 0.8) tokens, clipped to [128, 8192], seed 0,
micro-batches of at most 16,384 tokens, a loss from the token logprobs. Random-weight Qwen2.5 shapes are built
on the spot (no download). Reported: tokens/s, MFU (model FLOPs, 6 N per token plus causal attention, over the
dense bf16 peak), padding fraction of the computed tokens, peak GPU memory; for the 7B shape with optimizer
offload the step time; for ``--checkpoint`` the time a recover checkpoint blocks training and its bytes.

    python tools/bench_train.py --device cuda [--shapes 1.5b,3b] [--offload-7b] [--checkpoint 3b]
    python tools/bench_train.py            # CPU: a small shape on 1, 2 and 4 gloo ranks, optimizer bytes

Prints one JSON line per measurement, then a summary of ratios against the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from areal_hpc.config.schema import MicroBatchSpec, OptimizerConfig, TrainedModelConfig  # noqa: E402
from areal_hpc.train import dist  # noqa: E402
from areal_hpc.train.backends import make_engine  # noqa: E402
from areal_hpc.train.microbatch import micro_batch_groups, micro_batches  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16, the datasheet's (the MFU denominator)
VOCAB = 151936
SHAPES = {  # Qwen2.5 configs: hidden, intermediate, layers, heads, kv heads, tied embeddings
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, True),
    "3b": (2048, 11008, 36, 16, 2, True),
    "7b": (3584, 18944, 28, 28, 4, False),
    "cpu": (256, 704, 4, 4, 2, True),  # the CPU's small shape
}
MAX_TOKENS_PER_MB = 16384


def build_model(shape: str, out: Path, device: str, vocab: int = VOCAB) -> int:
    """A random-weight Qwen2 of ``shape`` saved (bf16) in ``out``; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
        max_position_embeddings=32768, rope_theta=1e6, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return n


def workload(
    n_seqs: int = 64, seed: int = 0, vocab: int = VOCAB, scale: float = 1.0
) -> dict[str, np.ndarray]:
    """The issue's RL-like minibatch (lengths scaled by ``scale`` for small CPU runs)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(200 + rng.lognormal(6.5, 0.8, n_seqs), 128, 8192)
    lengths = np.maximum((lengths * scale).astype(np.int64), 2)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {"cu_seqlens": cu, "packed_input_ids": rng.integers(0, vocab, cu[-1])}


def model_flops(n_params: int, shape: str, lengths: np.ndarray) -> float:
    """FLOPs of forward + backward: 6 N per token, plus causal attention's 6 h L s^2 per sequence."""
    hidden, _, layers, *_ = SHAPES[shape]
    return 6.0 * n_params * lengths.sum() + 6.0 * hidden * layers * float(
        (lengths.astype(np.float64) ** 2).sum()
    )


def padding_fraction(backend: str, lengths: list[int], spec: MicroBatchSpec) -> float:
    """The share of computed tokens that are padding: the torch engine pads each micro-batch to its longest."""
    if backend != "torch":
        return 0.0
    groups = micro_batch_groups(lengths, spec)
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1.0 - sum(lengths) / computed


def loss_fn(out: dict, mb: dict) -> torch.Tensor:
    return -out["logprobs"].sum() / 65536.0


def train_once(model_dir: Path, shape: str, n_params: int, backend: str, ckpt: bool, offload: bool = False,
               steps: int = 2, checkpoint_dir: Path | None = None) -> dict:  # fmt: skip
    """Warm up with one step, then time ``steps`` optimizer steps over the workload."""
    cfg = TrainedModelConfig(
        path=str(model_dir), backend=backend, dtype="bfloat16", gradient_checkpointing=ckpt,
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps_proportion=0.0, offload=offload),
    )  # fmt: skip
    row = {"shape": shape, "backend": backend, "gradient_checkpointing": ckpt, "offload": offload}
    torch.cuda.reset_peak_memory_stats()
    engine = make_engine(cfg, total_train_steps=100)
    batch = workload()
    spec = MicroBatchSpec(max_tokens_per_mb=MAX_TOKENS_PER_MB)
    mbs = micro_batches(batch, spec)
    lengths = np.diff(batch["cu_seqlens"])
    try:
        engine.train_minibatch(mbs, loss_fn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.train_minibatch(mbs, loss_fn)
        torch.cuda.synchronize()
        secs = (time.perf_counter() - start) / steps
    except torch.OutOfMemoryError:
        row["result"] = "out of memory"
        return row
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30
    tokens = int(lengths.sum())
    row.update({
        "tokens": tokens, "step_s": round(secs, 3), "tokens_per_s": round(tokens / secs),
        "mfu": round(model_flops(n_params, shape, lengths) / secs / PEAK_FLOPS, 4),
        "padding": round(padding_fraction(backend, lengths.tolist(), spec), 3), "peak_gib": round(peak, 1),
    })  # fmt: skip
    if checkpoint_dir is not None:
        row.update(checkpoint_once(engine, checkpoint_dir, mbs))
    del engine
    torch.cuda.empty_cache()
    return row


def checkpoint_once(engine, folder: Path, mbs) -> dict:
    """A recover checkpoint's blocking time (staging) at the first save, which allocates the CPU buffers, and
    at the second, which reuses them; the training step run while the first is written; its bytes."""
    from areal_hpc.train.sharded import AsyncSave

    def begin(folder: Path) -> float:
        folder.mkdir(parents=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        saver.save({"actor": engine.state_dict()}, folder)
        return time.perf_counter() - start

    saver = AsyncSave()
    start = time.perf_counter()
    first = begin(folder / "first")
    step_start = time.perf_counter()
    engine.train_minibatch(mbs, loss_fn)  # training goes on while the bytes are written
    torch.cuda.synchronize()
    overlapped_step = time.perf_counter() - step_start
    files = saver.wait()
    total = time.perf_counter() - start
    shutil.rmtree(folder / "first")  # room on the disk for the second
    second = begin(folder / "second")  # its write is left to the daemon thread: the process ends next
    return {
        "ckpt_blocked_s": [round(first, 2), round(second, 2)], "ckpt_total_s": round(total, 1),
        "ckpt_step_during_write_s": round(overlapped_step, 2),
        "ckpt_gb": round(sum(f["size"] for f in files.values()) / 1e9, 2), "ckpt_files": len(files),
    }  # fmt: skip


def check_packed_attention() -> dict:
    """The varlen kernel against causal SDPA over each sequence alone, on random bf16 q, k, v (GQA)."""
    from areal_hpc.train.packed import _per_sequence, _varlen

    gen = torch.Generator("cuda").manual_seed(0)
    cu = torch.tensor([0, 300, 1324, 1400, 3448], device="cuda")
    q = torch.randn(3448, 12, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(3448, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    packed = _varlen(q, k, v, cu.to(torch.int32), 2048, 128**-0.5)
    alone = _per_sequence(q, k, v, cu, 128**-0.5)
    return {"check": "varlen attention vs each sequence alone (bf16)",
            "max_abs_diff": (packed.float() - alone.float()).abs().max().item()}  # fmt: skip


def cuda_main(args: argparse.Namespace) -> list[dict]:
    rows = [check_packed_attention()]
    print(json.dumps(rows[0]), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        for shape in [s for s in args.shapes.split(",") if s]:
            model_dir = work / shape
            n = build_model(shape, model_dir, "cuda")
            ckpt_dir = work / "ckpt" if shape == args.checkpoint else None
            runs = [v.split(":") for v in args.variants.split(",")]
            for backend, ckpt in runs:
                timed = ckpt_dir if backend == "fsdp" and (backend, ckpt) == tuple(runs[-1]) else None
                rows.append(train_once(model_dir, shape, n, backend, ckpt == "ckpt", checkpoint_dir=timed))
                print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(model_dir)
        if args.offload_7b:
            n = build_model("7b", work / "7b", "cuda")
            rows.append(train_once(work / "7b", "7b", n, "fsdp", True, offload=True, steps=1))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _cpu_rank(rank: int, world: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, Path(out) / f"init{world}", backend="gloo", timeout_s=300)
    try:
        cfg = TrainedModelConfig(path=model_dir, dtype="float32", gradient_checkpointing=False)
        engine = make_engine(cfg, total_train_steps=10)
        batch = workload(n_seqs=8, vocab=4096, scale=0.05)
        parts = np.array_split(np.arange(8), world)[rank]
        from areal_hpc.data import select

        mine = select(batch, parts.tolist())
        start = time.perf_counter()
        engine.train_minibatch(micro_batches(mine, MicroBatchSpec(max_tokens_per_mb=512)), loss_fn)
        secs = time.perf_counter() - start
        local = [getattr(t, "_local_tensor", t) for s in engine.optimizer.state.values()
                 for k, t in s.items() if k != "step"]  # fmt: skip
        state_bytes = sum(t.numel() * t.element_size() for t in local)
        (Path(out) / f"w{world}r{rank}.json").write_text(json.dumps({"bytes": state_bytes, "secs": secs}))
    finally:
        dist.destroy()


def cpu_main(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model_dir = Path(tmp) / "cpu"
        n = build_model("cpu", model_dir, "cpu", vocab=4096)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for world in (1, 2, 4):
            mp.spawn(_cpu_rank, args=(world, str(model_dir), tmp), nprocs=world)
            per_rank = [json.loads((Path(tmp) / f"w{world}r{r}.json").read_text()) for r in range(world)]
            rows.append({"shape": "cpu", "params": n, "backend": "fsdp", "ranks": world,
                         "optimizer_bytes_per_rank": max(r["bytes"] for r in per_rank),
                         "step_s": round(max(r["secs"] for r in per_rank), 2)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict]) -> None:
    rows = [r for r in rows if "shape" in r]
    by = {(r["shape"], r["backend"], r.get("gradient_checkpointing"), r.get("ranks")): r for r in rows}
    for r in rows:
        base = by.get((r["shape"], "torch", True, None))
        if r["backend"] == "fsdp" and base and "tokens_per_s" in r and "tokens_per_s" in base:
            print(f"{r['shape']} fsdp (gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}): "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x the padded torch engine's tokens/s, "
                  f"MFU {r['mfu']:.1%} vs {base['mfu']:.1%}")  # fmt: skip
        if "ranks" in r:
            one = by[(r["shape"], "fsdp", None, 1)]
            print(f"{r['ranks']} ranks: optimizer state per rank {r['optimizer_bytes_per_rank'] / 2**20:.2f} MiB "
                  f"= 1/{one['optimizer_bytes_per_rank'] / r['optimizer_bytes_per_rank']:.2f} of one rank's")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="1.5b,3b", help="comma-separated shapes to train (cuda)")
    parser.add_argument("--offload-7b", action="store_true", help="also a step of the 7B shape with offload")
    parser.add_argument("--checkpoint", default="3b", help="the shape whose recover checkpoint is timed")
    parser.add_argument(
        "--variants", default="torch:ckpt,fsdp:ckpt,fsdp:nockpt",
        help="backend:ckpt|nockpt runs per shape (the first is the baseline; the last fsdp one times the checkpoint)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON lines")
    args = parser.parse_args()
    rows = cuda_main(args) if args.device == "cuda" else cpu_main(args)
    summary(rows)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
