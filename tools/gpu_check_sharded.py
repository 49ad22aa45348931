"""Sharded training on GPUs: one RL-like minibatch trained on each layout of the fsdp and megatron engines (one
process and one GPU per rank, NCCL), the first optimizer step's loss and grad_norm checked against the same
engine on one rank, then the step timed for scaling. Not part of the test suite (CPU tests with gloo cover the
equality: tests/test_fsdp_engine.py, tests/test_megatron_engine.py, tests/test_context_parallel.py,
tests/test_megatron_moe.py).

A layout is ``engine:sizes``, on dp x tp x pp x cp ranks: ``N`` alone is the data-parallel size, or sizes
named dpN, tpN, ppN, epN, cpN. ``fsdp:`` takes dp and cp (Ulysses sequence parallelism: ``fsdp:cp2`` is d1c2
on 2 ranks, ``fsdp:dp2cp2`` d2c2 on 4); ``megatron:`` takes dp, tp, pp (``tp2``, ``pp2``, ``tp2pp2``,
``dp2tp2``) and ep, the expert-parallel size of an MoE ``--shape``, which adds no ranks but must divide d*t:
without dp the layout has the fewest replicas that allow it (``megatron:ep2`` is d2e2 on 2 ranks, as
``megatron:dp2ep2``). Megatron's context parallelism needs Transformer Engine, not installed: cp is fsdp's.
The model is a random-weight bf16 Qwen2.5 of ``--shape``, or a Qwen3-MoE (``30b-a3b`` with ``--moe-layers`` of
its layers), and the workload issue 12's (tools/bench_train.py: 64 sequences, about 71k tokens, micro-batches
of at most 16,384 tokens), dealt over the data-parallel replicas as the master deals them; or with
``--seq-len L``, ``--seqs`` sequences of exactly L tokens, one per micro-batch. Reported per layout: the
global loss and grad_norm, tokens/s of the whole minibatch, MFU per GPU (an MoE's on its active parameters),
peak GPU memory per rank; then each layout against its engine's one-rank row (relative differences, scaling
efficiency). Exits 1 when a layout fails or is outside the tolerance, 2 on bad arguments or no GPU.

    python tools/gpu_check_sharded.py [--device cuda] [--shape 1.5b] [--layouts fsdp:1,fsdp:2,megatron:tp2]
        [--steps 3] [--gradient-checkpointing] [--out rows.jsonl]
    python tools/gpu_check_sharded.py --shape 30b-a3b --moe-layers 8 --layouts megatron:1,megatron:ep2
    python tools/gpu_check_sharded.py --shape 7b --seq-len 32768 --gradient-checkpointing --offload \\
        --layouts fsdp:1,fsdp:cp2,fsdp:cp4
    python tools/gpu_check_sharded.py --device cpu     # dry run: a small float32 model on gloo ranks (2 min)
    python tools/gpu_check_sharded.py --device cpu --layouts fsdp:1,fsdp:cp2,fsdp:dp2cp2 [--seq-len 512]
    python tools/gpu_check_sharded.py --device cpu --shape cpu-moe --layouts megatron:1,megatron:ep2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from areal_hpc.algo import balanced_partition  # noqa: E402
from areal_hpc.alloc import ParallelSpec  # noqa: E402
from areal_hpc.config.schema import MicroBatchSpec, OptimizerConfig, TrainedModelConfig  # noqa: E402
from areal_hpc.data import CU, select  # noqa: E402
from areal_hpc.train import dist  # noqa: E402
from areal_hpc.train.backends import make_engine  # noqa: E402
from areal_hpc.train.microbatch import micro_batches  # noqa: E402
from tools.bench_train import (  # noqa: E402
    MAX_TOKENS_PER_MB,
    MOE_SHAPES,
    PEAK_FLOPS,
    SHAPES,
    VOCAB,
    build_model,
    loss_fn,
    model_flops,
    workload,
)

# The default layouts (on GPUs: those of them that fit).
CUDA_LAYOUTS = "fsdp:1,fsdp:2,fsdp:4,megatron:1,megatron:2,megatron:tp2,megatron:pp2,megatron:tp2pp2"
CPU_LAYOUTS = "fsdp:1,fsdp:2,megatron:1,megatron:tp2,megatron:pp2"
# The CPU's vocabulary: torch sums a float32 norm on one CPU thread lane by lane, with an error that grows with
# the tensor (about 1e-5 at the 1M elements of a 4096-token tied embedding): a one-rank grad_norm then
# differs from a sharded one's by more than the tolerance. At 1024 tokens it is about 2e-6.
CPU_VOCAB, CPU_MAX_TOKENS_PER_MB = 1024, 512
# Relative tolerances (loss, grad_norm) against one rank. float32: only the order of the sums differs. bf16
# keeps 8 significant bits (2^-8 = 4e-3 per rounding), and a layout regroups the bf16 sums (TP splits each
# matmul's, micro-batches pack other sequences together): logprobs move by a few units of that. The loss
# sums ~71k of them, whose roundings mostly cancel; the gradients compound theirs through every layer. A bug
# of layout (a replica counted twice, a shard missing, gradients averaged, not summed) moves either by tens
# of percent or a factor, far outside.
TOLERANCE = {"cpu": (1e-5, 1e-5), "cuda": (1e-2, 5e-2)}
LAYOUT = re.compile(r"(fsdp|megatron):(\d+|(?:(?:dp|tp|pp|ep|cp)\d+)+)")
# The sizes each engine cannot run, and why (make_engine would ignore them: not the layout named).
REFUSED = {
    "fsdp": (("tp", "pp", "ep"), "the fsdp engine shards over its data ranks and splits sequences over cp "
             "ranks (dpN, cpN); tp, pp and ep are megatron's"),
    "megatron": (("cp",), "megatron-core's context parallelism needs Transformer Engine's attention, which "
                 "this project does not install: use fsdp:cpN"),
}  # fmt: skip


def parse_layout(text: str) -> tuple[str, ParallelSpec]:
    """``fsdp:2`` -> ("fsdp", d2p1m1); ``fsdp:dp2cp2`` -> d2p1m1c2; ``megatron:tp2pp2`` -> d1p2m2;
    ``megatron:ep2`` -> d2p1m1e2 (no dp given: the fewest replicas whose d*t ranks the experts divide)."""
    match = LAYOUT.fullmatch(text)
    if match is None:
        raise ValueError(f"layout {text!r}: expected engine:N or engine: with sizes dpN, tpN, ppN, epN, cpN")
    engine, sizes = match.groups()
    found = re.findall(r"(dp|tp|pp|ep|cp)(\d+)", f"dp{sizes}" if sizes.isdigit() else sizes)
    size = {axis: int(n) for axis, n in found}
    if len(size) < len(found):
        raise ValueError(f"layout {text!r}: a size named twice")
    axes, why = REFUSED[engine]
    if any(size.get(axis, 1) > 1 for axis in axes):
        raise ValueError(f"layout {text!r}: {why}")
    tp, ep = size.get("tp", 1), size.get("ep", 1)
    data = size.get("dp", ep // math.gcd(ep, tp))  # an expert group lies within a stage's d*t ranks
    try:
        return engine, ParallelSpec(data, tp, size.get("pp", 1), expert=ep, context=size.get("cp", 1))
    except ValueError as exc:  # sizes of 0, an expert size that d*t does not divide
        raise ValueError(f"layout {text!r}: {exc}") from None


def vocab_of(device: str) -> int:
    return VOCAB if device == "cuda" else CPU_VOCAB


def equal_sequences(n: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` sequences of exactly ``length`` random tokens: the long-sequence workload (--seq-len)."""
    ids = np.random.default_rng(seed).integers(0, vocab, n * length)
    return {CU: np.arange(n + 1, dtype=np.int64) * length, "packed_input_ids": ids}


def minibatch(args: argparse.Namespace) -> dict[str, np.ndarray]:
    if args.seq_len:
        return equal_sequences(args.seqs, args.seq_len, vocab_of(args.device))
    return workload() if args.device == "cuda" else workload(n_seqs=8, vocab=CPU_VOCAB, scale=0.05)


def max_tokens_per_mb(args: argparse.Namespace) -> int:
    """The micro-batch budget; with --seq-len at least one sequence, so that none is split."""
    return max(MAX_TOKENS_PER_MB if args.device == "cuda" else CPU_MAX_TOKENS_PER_MB, args.seq_len or 0)


def rank_batch(batch: dict[str, np.ndarray], spec: ParallelSpec, rank: int) -> dict[str, np.ndarray]:
    """This rank's part as the master deals it (master/loop.py run_mfc): one part of balanced tokens per
    data-parallel replica; the TP, PP and CP ranks of a replica get the same part."""
    parts = balanced_partition(np.diff(batch[CU]).tolist(), spec.data)
    return select(batch, parts[spec.coords(rank)[0]])


def timed_steps(engine, mbs: list, steps: int, cuda: bool) -> float:
    """Seconds per optimizer step, the slowest rank's."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_minibatch(mbs, loss_fn)
    sync()
    return float(dist.all_reduce(torch.tensor((time.perf_counter() - start) / steps), "max"))


def measure(layout: str, rank: int, args: argparse.Namespace, model_dir: str, n_params: int) -> dict:
    """The first step's global loss and grad_norm, then ``args.steps`` steps timed: the layout's row."""
    engine_name, spec = parse_layout(layout)
    cuda = args.device == "cuda"
    cfg = TrainedModelConfig(
        path=model_dir, backend=engine_name, dtype="bfloat16" if cuda else "float32",
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps_proportion=0.0, offload=args.offload),
    )  # fmt: skip
    engine = make_engine(cfg, total_train_steps=1 + args.steps, spec=spec)
    batch = minibatch(args)
    mb_spec = MicroBatchSpec(max_tokens_per_mb=max_tokens_per_mb(args))
    mbs = micro_batches(rank_batch(batch, spec, rank), mb_spec)
    first = engine.train_minibatch(mbs, loss_fn)
    # Each rank holds its replica's loss sum; the sum over the DP group counts each replica once (fsdp's
    # dp_group None: every rank is a replica; with cp, the ranks of one CP index, one in each replica).
    loss = dist.all_reduce_sum(torch.tensor(first["loss"], dtype=torch.float64), engine.dp_group)
    secs = timed_steps(engine, mbs, args.steps, cuda)
    peaks = dist.all_gather_object(round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
    lengths, n = np.diff(batch[CU]), spec.world_size
    tokens = int(lengths.sum())
    flops = model_flops(n_params, args.shape, lengths, args.moe_layers)  # an MoE's: its active parameters
    return {
        "layout": layout, "engine": engine_name, "ranks": n, "spec": spec.format(), "device": args.device,
        "shape": args.shape, "active_params": n_params, "dtype": cfg.dtype, "tokens": tokens,
        "seq_len": args.seq_len, "offload": args.offload, "loss": float(loss),
        "grad_norm": float(first["grad_norm"]), "step_s": round(secs, 4),
        "tokens_per_s": round(tokens / secs, 1),
        "mfu": round(flops / secs / (n * PEAK_FLOPS), 4) if cuda else None, "peak_gib": peaks,
    }  # fmt: skip


def _rank_main(rank: int, layout: str, args: argparse.Namespace, model_dir: str, n_params: int, out: str):
    cuda = args.device == "cuda"
    os.environ["LOCAL_RANK"] = str(rank)  # init_distributed's GPU: cuda:<rank>, whatever a launcher set
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the CPU's cores
    world = parse_layout(layout)[1].world_size
    dist.init_distributed(rank, world, f"{out}.init", backend="nccl" if cuda else "gloo", timeout_s=900)
    try:
        row = measure(layout, rank, args, model_dir, n_params)
        if rank == 0:
            Path(out).write_text(json.dumps(row))
        dist.barrier()  # no rank leaves while another's last collective is in flight
    finally:
        dist.destroy()


def run_layout(layout: str, args: argparse.Namespace, model_dir: Path, n_params: int, work: Path) -> dict:
    """The layout's row, or its error: a failed rank ends the others (mp.spawn), not the check."""
    out = work / layout.replace(":", "-")
    try:
        world = parse_layout(layout)[1].world_size
        mp.spawn(_rank_main, args=(layout, args, str(model_dir), n_params, str(out)), nprocs=world)
        return json.loads(out.read_text())
    except Exception as exc:
        traceback.print_exc()
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        return {"layout": layout, "error": last[0]}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def against(r: dict, one: dict, tolerance: tuple[float, float]) -> tuple[str, bool]:
    """A row beside its engine's one-rank row: the summary line, and whether it is within the tolerance."""
    diffs = [rel(r[key], one[key]) for key in ("loss", "grad_norm")]
    within = all(d <= tol for d, tol in zip(diffs, tolerance, strict=True))
    scaling = r["tokens_per_s"] / (r["ranks"] * one["tokens_per_s"])
    mfu = f", MFU {r['mfu']:.1%} vs {one['mfu']:.1%}" if r["mfu"] is not None else ""
    return (f"{r['layout']} vs {one['layout']}: loss {r['loss']:.6g} (rel {diffs[0]:.1e}), grad_norm "
            f"{r['grad_norm']:.6g} (rel {diffs[1]:.1e}): {'within' if within else 'OUTSIDE'} rel "
            f"{tolerance[0]:g} / {tolerance[1]:g}; scaling {scaling:.2f} ({r['tokens_per_s']:.0f} vs "
            f"{r['ranks']} x {one['tokens_per_s']:.0f} tokens/s){mfu}", within)  # fmt: skip


def compare(rows: list[dict], tolerance: tuple[float, float]) -> tuple[list[str], list[str]]:
    """Summary lines and problems: each row against its engine's one-rank row."""
    lines, problems = [], [f"{r['layout']}: {r['error']}" for r in rows if "error" in r]
    base = {r["engine"]: r for r in rows if r.get("ranks") == 1}
    for r in rows:
        one = base.get(r.get("engine"))
        if "error" in r or one is None:
            lines.append(f"{r['layout']}: {'failed' if 'error' in r else 'no one-rank row to compare with'}")
        elif r is one:
            mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            lines.append(f"{r['layout']}: the reference: loss {r['loss']:.6g}, grad_norm {r['grad_norm']:.6g}, "
                         f"{r['tokens_per_s']:.0f} tokens/s{mfu}")  # fmt: skip
        else:
            line, within = against(r, one, tolerance)
            lines.append(line)
            problems += [] if within else [f"{r['layout']}: loss or grad_norm outside the tolerance"]
    return lines, problems


def make_room(model_dir: Path, length: int) -> None:
    """A config whose positions reach ``length`` (random weights: the rotary table only needs the room)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], length)
    path.write_text(json.dumps(config))


def layouts_of(args: argparse.Namespace, n_gpus: int) -> list[str]:
    """The asked layouts, or the defaults that fit; ValueError for one that cannot run here."""
    if args.layouts:
        layouts = [t for t in args.layouts.split(",") if t]
        for text in layouts:
            check_layout(text, args, n_gpus)
        return layouts
    if args.device == "cpu":
        return CPU_LAYOUTS.split(",")
    return [t for t in CUDA_LAYOUTS.split(",") if parse_layout(t)[1].world_size <= n_gpus]


def check_layout(text: str, args: argparse.Namespace, n_gpus: int) -> None:
    """ValueError when the layout cannot run here, or would not measure what it names."""
    engine, spec = parse_layout(text)
    if args.device == "cuda" and spec.world_size > n_gpus:
        raise ValueError(f"layout {text!r} needs {spec.world_size} GPUs; this machine has {n_gpus}")
    if spec.expert > 1 and args.shape not in MOE_SHAPES:
        raise ValueError(f"layout {text!r}: expert parallelism needs a mixture-of-experts --shape "
                         f"({', '.join(MOE_SHAPES)})")  # fmt: skip
    if args.offload and engine != "fsdp":
        raise ValueError(f"layout {text!r}: --offload is the fsdp engine's (megatron would ignore it)")
    if args.seq_len and args.seqs < spec.data:  # a replica without a sequence would time nothing
        raise ValueError(f"layout {text!r}: --seqs {args.seqs} is fewer than its {spec.data} data replicas")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument(
        "--shape", choices=[*SHAPES, *MOE_SHAPES], help="default 1.5b (cuda), cpu (cpu; cpu-moe: a small MoE)"
    )
    p.add_argument("--moe-layers", type=int, default=8, help="layers of a mixture-of-experts shape")
    p.add_argument("--layouts", default="", help="comma-separated (default: all that fit)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps after the first")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--seq-len", type=int, help="the minibatch: --seqs sequences of exactly this many tokens")
    p.add_argument("--seqs", type=int, default=2, help="sequences of --seq-len")
    p.add_argument("--offload", action="store_true", help="Adam state in CPU memory (fsdp; a 7B on few GPUs)")
    p.add_argument("--out", type=Path, help="also write the rows here as JSON lines")
    args = p.parse_args()
    if args.steps < 1 or args.moe_layers < 1 or args.seqs < 1 or (args.seq_len or 1) < 1:
        p.error("--steps, --moe-layers, --seqs and --seq-len must be at least 1")
    args.shape = args.shape or ("1.5b" if args.device == "cuda" else "cpu")
    n_gpus = torch.cuda.device_count()
    if args.device == "cuda" and n_gpus == 0:
        print("no GPU: --device cuda needs CUDA GPUs; --device cpu is the dry run on gloo", file=sys.stderr)
        return 2
    try:
        layouts = layouts_of(args, n_gpus)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast: hosts without fabric support fail in it
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the gloo ranks share the CPU's cores
    print(f"torch {torch.__version__}, {n_gpus} GPU(s); {args.device}: {','.join(layouts)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-sharded-") as tmp:
        model_dir = Path(tmp) / "model"
        n_params = build_model(args.shape, model_dir, args.device, vocab_of(args.device), args.moe_layers)
        if args.seq_len:
            make_room(model_dir, args.seq_len)
        for layout in layouts:
            rows.append(run_layout(layout, args, model_dir, n_params, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    lines, problems = compare(rows, TOLERANCE[args.device])
    print("\n".join(lines))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"FAILED ({len(problems)} problem(s))")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
