"""Check the built-in engine on a GPU: its logprobs against transformers' forward of the same weights (the
train-inference mismatch, bf16) for fresh answers, answers whose prompts came from the prefix cache, and
answers continued after retraction from a pool a third of their size (none cut); CUDA-graph decode against
eager decode.

Usage (device tool; the engine alone is imported, so no wheels are needed)::

    python tools/gpu_check_engine.py [--shape 1.5b] [--rows 64] [--tokens 256] [--out FILE.json]

Exits non-zero when a check fails; prints one JSON line of the statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_gen import SHAPES, bare_packages, build_model  # noqa: E402

bare_packages()  # the engine alone: the GPU image lacks what the rollout stack imports
from areal_hpc.gen.backends.builtin.engine import Engine  # noqa: E402
from areal_hpc.gen.backends.builtin.protocol import SamplingParams  # noqa: E402

# The engine's and transformers' bf16 forwards differ by kernel order only: mean |logprob difference| per token.
MEAN_ABS_TOLERANCE = 0.05


def hf_logprobs(path: Path, prompts, outputs) -> list[torch.Tensor]:
    """transformers' logprobs of each output's tokens given its prompt (what a trainer recomputes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    result = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + out.output_ids], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            result.append(logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu())
    del model
    torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1.5b", choices=SHAPES)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    failures, stats = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_model(args.shape, str(path), "cuda")
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(16, 30000, (int(n),), generator=gen).tolist() for n in torch.randint(20, 200, (args.rows // 4,), generator=gen)]  # fmt: skip
        params = SamplingParams(max_new_tokens=args.tokens, n=4, sampling_seed=7, ignore_eos=True)
        engine = Engine(str(path), device="cuda", seed=0, max_batch_size=max(args.rows, 8)).start()
        first = engine.submit(prompts, params).wait(600)
        again = engine.submit(prompts, params).wait(600)
        greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        graphed = engine.submit(prompts[:8], greedy).wait(600)
        stats["flash"] = engine._sched.runner.flash
        stats["kv_cache"] = engine.info()["kv_cache"]
        stats["cached_tokens"] = engine.info()["stats"].get("cached_tokens", 0)
        engine._sched.runner.use_graphs = False  # eager decode: the same steps without graphs
        eager = engine.submit(prompts[:8], greedy).wait(600)
        engine.stop()
        del engine
        torch.cuda.empty_cache()
        # A pool a third of what the rows need: rows are retracted and continue (on the GPU, with graphs).
        need = sum(len(p) + args.tokens for p in prompts) * 4
        tight = Engine(
            str(path), device="cuda", seed=0, max_batch_size=max(args.rows, 8), max_total_tokens=need // 3
        ).start()
        squeezed = tight.submit(prompts, params).wait(600)
        stats["retracted_rows"] = tight.info()["stats"].get("retracted_rows", 0)
        tight.stop()
        del tight
        torch.cuda.empty_cache()
        # In bf16 a cached prefix's or a re-prefill's keys differ in the last bits from a fresh forward's, so a
        # sampled row may take another token at a near-tie and go its own way: the same tokens are counted, and
        # each answer's logprobs are checked against transformers' forward of its own tokens below.
        for name, outs in (("prefix_cached", again), ("retracted", squeezed)):
            same = sum(a.output_ids == b.output_ids for a, b in zip(first, outs, strict=True))
            stats[f"{name}_vs_first_same_rows"] = f"{same}/{len(first)}"
        if stats["retracted_rows"] == 0 or any(len(o.output_ids) != args.tokens for o in squeezed):
            failures.append(f"a tight pool retracted {stats['retracted_rows']} rows or cut an answer")
        same = sum(a.output_ids == b.output_ids for a, b in zip(graphed, eager, strict=True))
        stats["graph_vs_eager_same_rows"] = f"{same}/{len(eager)}"
        if same < len(eager) - 1:  # bf16 near-ties may flip one greedy choice
            failures.append(
                f"graph and eager greedy decodes differ in {len(eager) - same} of {len(eager)} rows"
            )
        rows_prompts = [p for p in prompts for _ in range(4)]
        for name, outs in (("", first), ("prefix_cached_", again), ("retracted_", squeezed)):
            reference = hf_logprobs(path, rows_prompts, outs)
            diff = torch.cat([torch.tensor(o.logprobs) - r for o, r in zip(outs, reference, strict=True)])
            stats.update({
                f"{name}tokens": diff.numel(),
                f"{name}mean_abs_logprob_diff": round(diff.abs().mean().item(), 5),
                f"{name}max_abs_logprob_diff": round(diff.abs().max().item(), 5),
                f"{name}mean_logprob_diff": round(diff.mean().item(), 5),
            })  # fmt: skip
            if stats[f"{name}mean_abs_logprob_diff"] > MEAN_ABS_TOLERANCE:
                failures.append(
                    f"{name or 'fresh '}answers: mean |engine - transformers| logprob "
                    f"{stats[f'{name}mean_abs_logprob_diff']} > {MEAN_ABS_TOLERANCE}"
                )
    print(json.dumps(stats))
    if args.out:
        Path(args.out).write_text(json.dumps(stats, indent=2))
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
