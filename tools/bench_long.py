"""The longest answer each shape trains on one GPU at c = 1 (issue 48): one sequence of L tokens per micro-batch
through the fsdp engine with gradient checkpointing and the chunked LM head, L doubling until the GPU runs
out of memory. Random-weight Qwen2.5 shapes are built on the spot (tools/bench_train.py's); the 7B shape keeps
its Adam state in CPU memory (optimizer.offload), as on one GPU it must.

Each length reports the forward and backward seconds of its micro-batch and their MFU (6 N per token plus
causal attention's 6 h L s^2, over the H200's dense bf16 peak) with each attention kernel the trainer can run
a long sequence on (FlashAttention's varlen kernel, cuDNN's: train.packed.CUDNN_FROM), ``mfu`` for the one it
runs, and the peak GPU memory. The optimizer step does not depend on L; it is timed once per shape, at the first
length.

Then, at the lengths of ``--kept-at`` and with the faster kernel, as many layers keep their activations
(recompute_layers) as fit in 92% of the GPU: ``layer_gib`` (a kept layer's activations), ``kept_layers``,
``mfu_kept``. The peaks are of forward and backward alone, not of the optimizer step.

    python tools/bench_long.py --shapes 1.5b,3b,7b --lengths 16384,32768,65536,131072 [--out rows.jsonl]
    python tools/bench_long.py --device cpu --shapes cpu --lengths 256,512   # a self-check of this script
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_hpc.config.schema import OptimizerConfig, TrainedModelConfig  # noqa: E402
from areal_hpc.train import packed  # noqa: E402
from areal_hpc.train.backends import make_engine  # noqa: E402
from areal_hpc.train.models import decoder_layers, recompute_layers  # noqa: E402
from tools.bench_train import PEAK_FLOPS, VOCAB, build_model, loss_fn, model_flops  # noqa: E402


def one_sequence(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"cu_seqlens": np.array([0, length]), "packed_input_ids": rng.integers(0, VOCAB, length)}


def no_update() -> bool:  # train_minibatch's skip: forward and backward, no optimizer step
    return True


def timed(fn, *args, **kwargs) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn(*args, **kwargs)
    sync()
    return time.perf_counter() - start


KERNELS = {"flash": None, "cudnn": 1}  # train.packed.CUDNN_FROM: no sequence on cuDNN, or every one


def with_cudnn_from(cudnn_from: int | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with sequences of ``cudnn_from`` tokens or more on cuDNN's attention."""
    default, packed.CUDNN_FROM = packed.CUDNN_FROM, cudnn_from
    try:
        return fn(*args, **kwargs)
    finally:
        packed.CUDNN_FROM = default


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def fewer_recomputed(engine, mbs: list[dict], cudnn_from: int | None, device: str) -> dict:
    """Forward and backward of ``mbs`` with as many layers keeping their activations as fit in 92% of the
    GPU beside the peak of all recomputing. A kept layer's memory is what two kept layers add to the memory
    held when the forward leaves the last layer (the step's peak, at the head or in the backward, can hide
    it). No try-and-fail: FSDP's state after running out of memory in a backward is not usable again."""
    layers = decoder_layers(engine.net)
    held: list[float] = []
    hook = layers[-1].register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated() / 2**30))

    def run(kept: int) -> tuple[float, float, float]:
        recompute_layers(engine.net, len(layers) - kept)
        held.clear()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        s = with_cudnn_from(cudnn_from, timed, engine.train_minibatch, mbs, loss_fn, skip=no_update)
        return s, peak_gib(device), held[0] if device == "cuda" else 0.0

    try:
        (_, base, held0), (_, _, held2) = run(0), run(2)
        layer, kept = (held2 - held0) / 2, len(layers)  # on a CPU: this script's self-check of the path
        if device == "cuda" and layer > 0:
            kept = max(0, min(kept, int((0.92 * torch.cuda.mem_get_info()[1] / 2**30 - base) / layer)))
        s, peak, _ = run(kept)
    finally:
        hook.remove()
        recompute_layers(engine.net, None)
    return {
        "layer_gib": round(layer, 2),
        "kept_layers": kept,
        "kept_s": round(s, 2),
        "kept_peak_gib": round(peak, 1),
    }


def longest(shape: str, lengths: list[int], kept_at: set[int], root: Path, device: str) -> list[dict]:
    model = root / shape
    n_params = build_model(shape, model, device)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = max(lengths)  # random weights: the rotary table only needs the room
    (model / "config.json").write_text(json.dumps(config))
    offload = shape == "7b"
    cfg = TrainedModelConfig(
        path=str(model), dtype="bfloat16", gradient_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps_proportion=0.0, offload=offload),
    )  # fmt: skip
    engine = make_engine(cfg, total_train_steps=100)
    rows = []
    for i, length in enumerate(lengths):
        mbs = [one_sequence(length)]
        row = {"shape": shape, "tokens": length, "offload": offload}
        try:
            if i == 0:  # compiles the norms and MLPs, then the optimizer step, alone
                engine.train_minibatch(mbs, loss_fn, skip=no_update)
                row["step_s"] = round(timed(engine.train_minibatch, mbs, loss_fn), 2)
            if device == "cuda":  # the peak of forward and backward, not of the optimizer step
                torch.cuda.reset_peak_memory_stats()
            secs = {name: with_cudnn_from(cudnn_from, timed, engine.train_minibatch, mbs, loss_fn, skip=no_update)
                    for name, cudnn_from in KERNELS.items()}  # fmt: skip
        except torch.OutOfMemoryError:
            rows.append({**row, "result": "out of memory"})
            print(json.dumps(rows[-1]), flush=True)
            break
        flops = model_flops(n_params, shape, np.array([length]))
        for name, s in secs.items():
            row.update({f"{name}_s": round(s, 2), f"mfu_{name}": round(flops / s / PEAK_FLOPS, 4)})
        runs = "cudnn" if packed.CUDNN_FROM is not None and length >= packed.CUDNN_FROM else "flash"
        row.update(mfu=row[f"mfu_{runs}"], cudnn_speedup=round(secs["flash"] / secs["cudnn"], 3),
                   peak_gib=round(peak_gib(device), 1))  # fmt: skip
        if length in kept_at:
            row.update(fewer_recomputed(engine, mbs, KERNELS[min(secs, key=secs.get)], device))
            row["mfu_kept"] = round(flops / row["kept_s"] / PEAK_FLOPS, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1.5b,3b,7b")
    parser.add_argument("--lengths", default="16384,32768,65536,131072")
    parser.add_argument(
        "--kept-at",
        help="lengths at which to find the most layers keeping their activations "
        "(three more runs each); default: the first length",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    shapes = args.shapes.split(",")
    kept_at = args.kept_at or str(lengths[0])
    # A process per shape: what one shape's engine leaves on the GPU never crowds the next (the 7B at 16k ran
    # out of memory after the 3B in one process, and fits alone at 32k).
    if len(shapes) > 1:
        rows = []
        for shape in shapes:
            with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
                subprocess.run([sys.executable, __file__, "--shapes", shape, "--lengths", args.lengths,
                                "--device", args.device, "--kept-at", kept_at, "--out", out.name], check=True)  # fmt: skip
                rows += [json.loads(line) for line in out]
    else:
        with tempfile.TemporaryDirectory(prefix="bench-long-") as root:
            rows = longest(shapes[0], lengths, {int(x) for x in kept_at.split(",")}, Path(root), args.device)
    for shape in shapes:
        fit = [r for r in rows if r["shape"] == shape and "mfu" in r]
        best = fit[-1] if fit else None
        print(f"{shape}: longest trained {best['tokens'] if best else 0} tokens"
              + (f" at {best['mfu']:.1%} MFU (FlashAttention {best['mfu_flash']:.1%}, cuDNN "
                 f"{best['mfu_cudnn']:.1%}), {best['peak_gib']} GiB" if best else ""))  # fmt: skip
        for r in fit:
            if "mfu_kept" in r:
                print(f"{shape} at {r['tokens']} tokens, {r['kept_layers']} layers keeping their activations "
                      f"({r['layer_gib']} GiB each): {r['mfu_kept']:.1%} MFU, {r['kept_peak_gib']} GiB")  # fmt: skip
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
