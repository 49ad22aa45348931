"""Benchmark the trainer: one RL-like minibatch through an engine, the sharded FSDP engine against the padded,
replicated torch engine measured in the same run.

The workload (issue 12): 64 sequences of 200 + lognormal(6.5, 0.8) tokens, clipped to [128, 8192], seed 0,
micro-batches of at most 16,384 tokens, a loss from the token logprobs. Random-weight Qwen2.5 shapes are built
on the spot (no download). Reported: tokens/s, MFU (model FLOPs, 6 N per token plus causal attention, over the
dense bf16 peak), padding fraction of the computed tokens, peak GPU memory; for the 7B shape with optimizer
offload the step time; for ``--checkpoint`` the time a recover checkpoint blocks training and its bytes.

    python tools/bench_train.py --device cuda [--shapes 1.5b,3b] [--offload-7b] [--checkpoint 3b] [--write-threads 4,8]
    python tools/bench_train.py --device cuda --shapes 3b,30b-a3b --moe-layers 8 --variants megatron:nockpt

The mixture-of-experts shape is Qwen3-30B-A3B's (128 experts, top 8) with ``--moe-layers`` of its 48 layers, so that
it fits one GPU; its MFU counts the active parameters (the routed experts' top 8 of 128, everything else).
    python tools/bench_train.py            # CPU: a small shape on 1, 2 and 4 gloo ranks, optimizer bytes

Prints one JSON line per measurement, then a summary of ratios against the baseline.
"""

from __future__ import annotations

import argparse
import gc
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
# Qwen3-MoE configs: hidden, attention heads, kv heads, head dim, experts, top k, expert intermediate size
MOE_SHAPES = {
    "30b-a3b": (2048, 32, 4, 128, 128, 8, 768),
    "cpu-moe": (256, 4, 2, 64, 8, 2, 128),  # the CPU's small shape (tools/gpu_check_sharded.py's dry run)
}
MAX_TOKENS_PER_MB = 16384


def model_config(shape: str, vocab: int = VOCAB, moe_layers: int = 8):
    """The transformers config of ``shape``: a Qwen2.5 of SHAPES or a Qwen3-MoE of MOE_SHAPES."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    if shape in MOE_SHAPES:
        hidden, heads, kv, head, experts, top, inner = MOE_SHAPES[shape]
        return Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=moe_layers, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=head, num_experts=experts, num_experts_per_tok=top,
            moe_intermediate_size=inner, intermediate_size=6144, norm_topk_prob=True, tie_word_embeddings=False,
            max_position_embeddings=32768, rope_theta=1e6, torch_dtype="bfloat16",
        )  # fmt: skip
    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
        max_position_embeddings=32768, rope_theta=1e6, torch_dtype="bfloat16",
    )  # fmt: skip


def build_model(shape: str, out: Path, device: str, vocab: int = VOCAB, moe_layers: int = 8) -> int:
    """A random-weight model of ``shape`` saved (bf16) in ``out``; returns the parameters a token goes
    through (all of them for a dense model; for a MoE model the top k of the routed experts)."""
    from transformers import AutoModelForCausalLM

    config = model_config(shape, vocab, moe_layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    if shape in MOE_SHAPES:
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        n -= experts * (1 - config.num_experts_per_tok / config.num_experts)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return int(n)


def toy_tokenizer(model: Path, tiny_model: Path, eos_ids: list[int] | None = None) -> None:
    """Give a random-weight ``model`` the tiny model's tokenizer (the toy's prompts: its ids are in range), and
    ``eos_ids`` as the ids that end an answer (its generation_config): a random model's near-uniform draws then
    end one after ~vocab / len(eos_ids) tokens, a geometric tail."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, model / name)
    if eos_ids:
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def workload(
    n_seqs: int = 64, seed: int = 0, vocab: int = VOCAB, scale: float = 1.0
) -> dict[str, np.ndarray]:
    """The issue's RL-like minibatch (lengths scaled by ``scale`` for small CPU runs)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(200 + rng.lognormal(6.5, 0.8, n_seqs), 128, 8192)
    lengths = np.maximum((lengths * scale).astype(np.int64), 2)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {"cu_seqlens": cu, "packed_input_ids": rng.integers(0, vocab, cu[-1])}


def model_flops(n_params: int, shape: str, lengths: np.ndarray, moe_layers: int = 8) -> float:
    """FLOPs of forward + backward: 6 N per token, plus causal attention's 6 h L s^2 per sequence (h: the
    attention's width)."""
    if shape in MOE_SHAPES:
        _, heads, _, head, *_ = MOE_SHAPES[shape]
        hidden, layers = heads * head, moe_layers
    else:
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
               steps: int = 2, checkpoint_dir: Path | None = None, write_threads: tuple[int, ...] = (4,),
               publish: bool = False, profile: bool = False, moe_layers: int = 8) -> dict:  # fmt: skip
    """Warm up with one step, then time ``steps`` optimizer steps over the workload."""
    cfg = TrainedModelConfig(
        path=str(model_dir), backend=backend, dtype="bfloat16", gradient_checkpointing=ckpt,
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps_proportion=0.0, offload=offload),
    )  # fmt: skip
    row = {"shape": shape, "backend": backend, "gradient_checkpointing": ckpt, "offload": offload}
    if shape in MOE_SHAPES:
        row.update(layers=moe_layers, active_params=n_params)
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
        "mfu": round(model_flops(n_params, shape, lengths, moe_layers) / secs / PEAK_FLOPS, 4),
        "padding": round(padding_fraction(backend, lengths.tolist(), spec), 3), "peak_gib": round(peak, 1),
    })  # fmt: skip
    if checkpoint_dir is not None:
        row.update(checkpoint_once(engine, checkpoint_dir, mbs, write_threads))
    if publish:
        row.update(publish_once(engine, profile=profile))
    if profile:
        profile_step(engine, mbs)
    del engine
    gc.collect()  # an engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    return row


class _NoNetwork:
    """A weight group that sends nothing: what is left of publication is gathering and bucketing."""

    def broadcast(self, flat: torch.Tensor, what: str) -> None:
        pass


def publish_once(engine, bucket_bytes: int = 64 << 20, profile: bool = False) -> dict:
    """The engine's weights gathered into full HF tensors and flattened into the publisher's buckets (its own
    ``send_buckets`` and ``Stager``, without the network), beside a device-to-device copy of the same bytes."""
    from areal_hpc.weights.bucket import Stager, plan_buckets
    from areal_hpc.weights.sender import send_buckets, weight_metas

    buckets = plan_buckets(weight_metas(engine.hf_params(), engine.dtype), bucket_bytes)
    stager = Stager(buckets)  # kept across publications, as the sender keeps it

    def publish() -> tuple[int, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            total = send_buckets(_NoNetwork(), engine.hf_weights(), buckets, stager)
        torch.cuda.synchronize()
        return total, time.perf_counter() - start

    total, _ = publish()  # warm-up: the staging buffer and each bucket's places are made
    secs = min(publish()[1] for _ in range(3))
    if profile:  # where the CPU time of one publication goes
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            publish()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    start = time.perf_counter()
    for _ in engine.hf_weights():  # the gathering alone
        pass
    torch.cuda.synchronize()
    gather = time.perf_counter() - start
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    copy = time.perf_counter() - start
    return {"publish_gb": round(total / 1e9, 2), "gather_bucket_s": round(secs, 4),
            "gather_bucket_gbps": round(total / secs / 1e9, 1), "gather_s": round(gather, 4),
            "device_copy_gbps": round(total / copy / 1e9, 1)}  # fmt: skip


def profile_step(engine, mbs, top: int = 25) -> None:
    """The CUDA time of one training step by operator, the largest ``top`` (to find what a backend spends)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.train_minibatch(mbs, loss_fn)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top), flush=True)


def checkpoint_once(engine, folder: Path, mbs, write_threads: tuple[int, ...]) -> dict:
    """A recover checkpoint's cost to training: making its CPU buffers (once per run, after the first step),
    the time each save blocks training (the copy into them), the training step run while it is written (per
    number of writer threads), and its bytes; the write's speed beside the disk's own (plain writes, fsync)."""
    from areal_hpc.train import sharded

    def begin(folder: Path) -> float:
        folder.mkdir(parents=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        saver.save({"actor": engine.state_dict()}, folder)
        return time.perf_counter() - start

    row = {"disk_write_gbps": disk_write_gbps(folder / "disk")}
    saver = sharded.AsyncSave()
    start = time.perf_counter()
    saver.reserve({"actor": engine.state_dict()})
    row["ckpt_reserve_s"], row["ckpt_blocked_s"] = round(time.perf_counter() - start, 2), []
    for threads in write_threads:
        sharded.WRITE_THREADS = threads
        start = time.perf_counter()
        row["ckpt_blocked_s"].append(round(begin(folder / "ckpt"), 2))
        torch.cuda.reset_peak_memory_stats()
        step_start = time.perf_counter()
        engine.train_minibatch(mbs, loss_fn)  # training goes on while the bytes are written
        torch.cuda.synchronize()
        step = time.perf_counter() - step_start
        files = saver.wait()
        total = time.perf_counter() - start
        gb = sum(f["size"] for f in files.values()) / 1e9
        row[f"ckpt_threads{threads}"] = {
            "total_s": round(total, 1), "write_gbps": round(gb / total, 2), "step_during_write_s": round(step, 2),
            "step_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        }  # fmt: skip
        shutil.rmtree(folder / "ckpt")  # room on the disk for the next
    saver.close()
    return {**row, "ckpt_gb": round(gb, 2), "ckpt_files": len(files)}


def disk_write_gbps(path: Path, gb: int = 4) -> float:
    """GB/s of writing ``gb`` GB to one file in 64 MB writes, then fsync: the disk's speed, for scale."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(gb * 1000 // 64):
            f.write(block)
        os.fsync(f.fileno())
    secs = time.perf_counter() - start
    path.unlink()
    return round(gb / secs, 2)


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


def check_head(tokens: int = 16384, hidden: int = 2048) -> list[dict]:
    """The chunked LM head (logprobs + entropy, forward and backward) eager against compiled, per chunk size:
    milliseconds, memory above the inputs, and the compiled outputs' largest difference from eager's."""
    from areal_hpc.train import head

    gen = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (
        torch.randn(VOCAB, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=gen)

    def run(chunk: int) -> tuple[float, float, list[torch.Tensor]]:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logp, entropy = head.chunked_logprobs(h, w, labels, 1.0, chunk)
        (logp.sum() + 0.01 * entropy.sum()).backward()
        torch.cuda.synchronize()
        secs, peak = time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**30
        return secs * 1e3, peak, [logp.detach(), entropy.detach(), h.grad, w.grad]

    rows, kernel = [], head.kernel
    for compiled in (False, True):
        head.kernel = kernel if compiled else (lambda fn, device: fn)
        for chunk in (2048, 4096):
            run(chunk)  # warm-up (and compilation)
            ms, gib, outs = run(chunk)
            if not compiled and chunk == 2048:
                reference = outs
            diff = max(
                (o.float() - r.float()).abs().max().item() for o, r in zip(outs, reference, strict=True)
            )
            rows.append({"check": "chunked LM head, forward + backward", "compiled": compiled, "chunk": chunk,
                         "ms": round(ms, 1), "gib_above_inputs": round(gib, 2), "max_abs_diff": diff})  # fmt: skip
    head.kernel = kernel
    return rows


def cuda_main(args: argparse.Namespace) -> list[dict]:
    rows = [] if args.skip_checks else [check_packed_attention(), *check_head()]
    for row in rows:
        print(json.dumps(row), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        for shape in [s for s in args.shapes.split(",") if s]:
            model_dir = work / shape
            n = build_model(shape, model_dir, "cuda", moe_layers=args.moe_layers)
            ckpt_dir = work / "ckpt" if shape == args.checkpoint else None
            runs = [v.split(":") for v in args.variants.split(",")]
            for backend, ckpt in runs:
                timed = ckpt_dir if backend == "fsdp" and (backend, ckpt) == tuple(runs[-1]) else None
                rows.append(train_once(model_dir, shape, n, backend, ckpt == "ckpt", checkpoint_dir=timed,
                                       write_threads=tuple(int(t) for t in args.write_threads.split(",")),
                                       publish=args.publish, profile=args.profile,
                                       moe_layers=args.moe_layers))  # fmt: skip
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
    dense = [r for r in rows if r["shape"] in SHAPES and "mfu" in r]
    for r in rows:
        if r["shape"] in MOE_SHAPES and "mfu" in r and dense:
            d = dense[-1]
            print(f"{r['shape']} ({r['layers']} layers) {r['backend']}: {r['tokens_per_s']} tokens/s, MFU "
                  f"{r['mfu']:.1%} on {r['active_params'] / 1e9:.2f}B active parameters, peak {r['peak_gib']} GiB; "
                  f"{r['mfu'] / d['mfu']:.2f}x the MFU of the {d['shape']} shape's {d['backend']} run ({d['mfu']:.1%})")  # fmt: skip
        base = by.get((r["shape"], "torch", True, None))
        fsdp = by.get((r["shape"], "fsdp", r.get("gradient_checkpointing"), None))
        if r["backend"] == "megatron" and fsdp and "tokens_per_s" in r and "tokens_per_s" in fsdp:
            print(f"{r['shape']} megatron (gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}): "
                  f"{r['tokens_per_s'] / fsdp['tokens_per_s']:.2f}x the fsdp engine's tokens/s, "
                  f"MFU {r['mfu']:.1%} vs {fsdp['mfu']:.1%}, peak {r['peak_gib']} vs {fsdp['peak_gib']} GiB")  # fmt: skip
        if r["backend"] == "fsdp" and base and "tokens_per_s" in r and "tokens_per_s" in base:
            print(f"{r['shape']} fsdp (gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}): "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x the padded torch engine's tokens/s, "
                  f"MFU {r['mfu']:.1%} vs {base['mfu']:.1%}")  # fmt: skip
        if "gather_bucket_gbps" in r:
            print(f"{r['shape']} {r['backend']}: weights gathered and bucketed for publication at "
                  f"{r['gather_bucket_gbps'] / r['device_copy_gbps']:.0%} of a device copy's bandwidth "
                  f"({r['publish_gb']} GB in {r['gather_bucket_s']} s)")  # fmt: skip
        for key, ckpt in r.items():
            if key.startswith("ckpt_threads"):
                print(f"{r['shape']} recover checkpoint ({key.removeprefix('ckpt_threads')} writer threads): "
                      f"training blocked {max(r['ckpt_blocked_s']):.2f} s per save, the step during the write "
                      f"{ckpt['step_during_write_s'] / r['step_s']:.2f}x the step alone, written at "
                      f"{ckpt['write_gbps'] / r['disk_write_gbps']:.0%} of the disk's speed")  # fmt: skip
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
    parser.add_argument("--write-threads", default="4", help="checkpoint writer threads, one save per entry")
    parser.add_argument(
        "--publish", action="store_true", help="time gathering and bucketing the weights (cuda)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print one step's CUDA time by operator (cuda)"
    )
    parser.add_argument("--moe-layers", type=int, default=8, help="layers of the mixture-of-experts shapes")
    parser.add_argument("--skip-checks", action="store_true", help="no attention and LM-head checks (cuda)")
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON lines")
    args = parser.parse_args()
    rows = cuda_main(args) if args.device == "cuda" else cpu_main(args)
    summary(rows)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
