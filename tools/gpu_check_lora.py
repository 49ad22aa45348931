"""Check LoRA serving on a GPU (issue 47): a random rank-R adapter on every linear layer of a random-weight Qwen2.5
model of a real shape, published as a PEFT folder and served by the built-in engine. Prints, and checks:

- publication: the bytes of a version's adapter folder against the model's weights, and its seconds (write, then
  the server's load) against the full weights' (the same tensors written again, then the server's disk load);
- the engine's logprobs under the adapter against transformers' with PEFT's (unmerged, the trainer's; bf16: mean
  |diff| within gpu_check_engine.py's bound for full weights, or within 10% of the same engine's on the base
  weights against transformers' with the adapter off, measured too: a deep random model's bf16 differences grow);
- decode time with the adapter's side path against the same engine serving its base model.

Usage (device tool; carry .whl for peft and accelerate, installed by tools/gpu_env.sh)::

    python tools/gpu_check_lora.py [--shape 7b] [--rank 64] [--rows 64] [--tokens 256] [--out FILE.json]
    python tools/gpu_check_lora.py --device cpu --shape tiny --rows 4 --tokens 8   # the CPU self-check

Exits non-zero when a check fails; prints one JSON line of the statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_gen import SHAPES, bare_packages, build_model  # noqa: E402
from tools.gpu_check_engine import MEAN_ABS_TOLERANCE  # noqa: E402

bare_packages()  # the engine alone: the GPU image lacks what the rollout stack imports
from areal_hpc.gen.backends.builtin.engine import Engine  # noqa: E402
from areal_hpc.gen.backends.builtin.lora import ALL as LINEAR  # noqa: E402 (every linear layer)
from areal_hpc.gen.backends.builtin.protocol import SamplingParams  # noqa: E402
from areal_hpc.weights import Adapter, write_adapter  # noqa: E402

TINY = Path(os.environ.get("AREAL_HPC_TINY", REPO / ".cache" / "tiny")) / "model"  # --shape tiny


def random_adapter(model: Path, rank: int, alpha: float) -> Adapter:
    """An adapter on every linear layer that moves each weight by a few percent (as a trained one does)."""
    from safetensors import safe_open

    gen, pairs = torch.Generator().manual_seed(3), {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                module = name.removesuffix(".weight")
                if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR:
                    out, inp = f.get_slice(name).get_shape()
                    a = torch.randn(rank, inp, generator=gen) / inp**0.5
                    b = torch.randn(out, rank, generator=gen) * 0.02 / rank**0.5
                    pairs[module] = (a.to(torch.bfloat16), b.to(torch.bfloat16))
    return Adapter(rank, alpha, str(model), pairs)


def reference_logprobs(model: Path, folder: Path, outputs, base_outputs, prompts, device: str):
    """transformers' logprobs of each output given its prompt: ``outputs`` under the published adapter loaded by
    PEFT (unmerged, as the trainer computes it: x W + s (x A) B), ``base_outputs`` with the adapter off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
    hf = PeftModel.from_pretrained(hf, str(folder)).eval()

    def logprobs(outs) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for prompt, o in zip(prompts, outs, strict=True):
                ids = torch.tensor([prompt + o.output_ids], device=device)
                logp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
                out.append(logp[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu())
        return out

    with hf.disable_adapter():
        base = logprobs(base_outputs)
    return logprobs(outputs), base


def mean_abs_diff(outputs, reference: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat([torch.tensor(o.logprobs) - r for o, r in zip(outputs, reference, strict=True)]).abs()
    return round(diff.mean().item(), 5), round(diff.max().item(), 5)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="7b", choices=[*SHAPES, "tiny"])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    failures, stats = [], {"shape": args.shape, "rank": args.rank}
    with tempfile.TemporaryDirectory() as tmp:
        model = TINY if args.shape == "tiny" else Path(tmp) / "model"
        if args.shape != "tiny":
            build_model(args.shape, str(model), args.device)
        adapter = random_adapter(model, args.rank, 2.0 * args.rank)
        import peft  # noqa: F401 (write_adapter's; imported before the clock starts)

        folder, write_s = timed(lambda: write_adapter(Path(tmp) / "adapter-v1", adapter))
        stats["adapter_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        stats["weights_bytes"] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        stats["bytes_ratio"] = round(stats["weights_bytes"] / stats["adapter_bytes"], 1)
        engine = Engine(str(model), device=args.device, seed=0, max_batch_size=max(args.rows, 8),
                        max_lora_rank=args.rank, lora_targets=LINEAR,
                        # half the GPU: room for transformers' reference copy, whatever the stopped engine keeps
                        mem_fraction_static=0.5).start()  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = [
            torch.randint(16, min(vocab, 3000), (20,), generator=gen).tolist() for _ in range(args.rows)
        ]
        params = SamplingParams(max_new_tokens=args.tokens, sampling_seed=7, ignore_eos=True)
        engine.submit(prompts, SamplingParams(max_new_tokens=4)).wait(600)  # warm-up: the batch's graphs
        base_outs, base_s = timed(lambda: engine.submit(prompts, params).wait(600))
        _, load_s = timed(lambda: engine.adapters.load("policy-v1", str(folder), engine.device))
        outs, lora_s = timed(lambda: engine.submit(prompts, params, adapter="policy-v1").wait(600))
        stats["decode_s_base"], stats["decode_s_adapter"] = round(base_s, 3), round(lora_s, 3)
        stats["side_path_cost"] = round(lora_s / base_s, 3)
        # Full weights the same way: written again (the trainer's save), then the server's load from disk.
        from safetensors.torch import load_file, save_file

        full = Path(tmp) / "full"
        full.mkdir()
        _, save_s = timed(
            lambda: [save_file(load_file(f), full / f.name) for f in sorted(model.glob("*.safetensors"))]
        )
        _, full_load_s = timed(lambda: engine.update_weights(str(model)))
        engine.stop()
        engine = None
        torch.cuda.empty_cache()  # room for transformers' copy of the model
        stats["publish_s_adapter"] = round(write_s + load_s, 3)
        stats["publish_s_weights"] = round(save_s + full_load_s, 3)
        reference, base = reference_logprobs(model, folder, outs, base_outs, prompts, args.device)
        stats["mean_abs_logprob_diff"], stats["max_abs_logprob_diff"] = mean_abs_diff(outs, reference)
        # The same engine on its base weights against transformers' base: the full-weight check at this shape.
        stats["base_mean_abs_logprob_diff"], stats["base_max_abs_logprob_diff"] = mean_abs_diff(
            base_outs, base
        )
    # Within the full-weight bound, or (a deep random model's bf16 differences grow with its depth) within 10%
    # of the engine's own difference on the base weights at this shape.
    bound = max(MEAN_ABS_TOLERANCE, 1.1 * stats["base_mean_abs_logprob_diff"])
    if stats["mean_abs_logprob_diff"] > bound:
        failures.append(f"mean |engine - PEFT| logprob {stats['mean_abs_logprob_diff']} > {bound:.5f}")  # fmt: skip
    print(json.dumps(stats))
    if args.out:
        Path(args.out).write_text(json.dumps(stats, indent=2))
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
