"""Benchmark the built-in engine's decode on a GPU with and without cuDNN's attention (batch.GPU_SDPA_BACKENDS).

A random-weight model of the Qwen2.5-1.5B shape in bf16; 1, 64 and 256 rows (groups of 8 answers of a 128-token
prompt), 256 new tokens each (ignore_eos), through the engine's Python API. The baseline lets torch choose the
attention kernel (cuDNN's included), measured in the same run. Prints ms per decode step, decode tokens/s and the
speed-up; exits non-zero when the change is slower at any row count.

    source tools/gpu_env.sh && python tools/gpu_bench_engine_sdpa.py   # on a lent GPU (device tool)
"""

from __future__ import annotations

import sys
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPE = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
)  # fmt: skip
PROMPT, NEW, ROWS = 128, 256, (1, 64, 256)


def builtin_modules():
    """The engine's modules without areal_hpc.gen's package __init__ (the rollout stack the device image lacks)."""
    for name in ("areal_hpc.gen", "areal_hpc.gen.backends", "areal_hpc.gen.backends.builtin"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(REPO / name.replace(".", "/"))]
            sys.modules[name] = module
    import areal_hpc.gen.backends.builtin.batch as batch
    import areal_hpc.gen.backends.builtin.engine as engine
    from areal_hpc.gen.backends.builtin.protocol import SamplingParams

    return batch, engine, SamplingParams


def prompts(n: int, seed: int) -> list[list[int]]:
    return torch.randint(16, 151000, (n, PROMPT), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_ms(engine_mod, params_cls, path: str) -> dict[int, tuple[float, float]]:
    """(ms per decode step, decode tokens/s) at each row count."""
    engine = engine_mod.Engine(
        path, device="cuda", dtype="bfloat16", max_batch_size=max(ROWS), seed=0
    ).start()
    try:
        engine.submit(prompts(2, 99), params_cls(max_new_tokens=8, ignore_eos=True, n=8)).wait(300)  # warm-up
        out = {}
        for rows in ROWS:
            n = 1 if rows == 1 else 8
            before = dict(engine.info()["stats"])
            engine.submit(
                prompts(rows // n, rows), params_cls(max_new_tokens=NEW, ignore_eos=True, n=n)
            ).wait(900)
            after = engine.info()["stats"]
            steps = after["decode_steps"] - before["decode_steps"]
            secs = after["decode_secs"] - before["decode_secs"]
            out[rows] = (1e3 * secs / steps, rows * steps / secs)
        return out
    finally:
        engine.stop()


def main() -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    batch, engine_mod, params_cls = builtin_modules()
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        with torch.device("cuda"):
            Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(torch.bfloat16).save_pretrained(path)
        chosen = batch.GPU_SDPA_BACKENDS
        batch.GPU_SDPA_BACKENDS = None  # the baseline: torch's choice, cuDNN's attention included
        start = time.monotonic()
        baseline = decode_ms(engine_mod, params_cls, path)
        batch.GPU_SDPA_BACKENDS = chosen
        without_cudnn = decode_ms(engine_mod, params_cls, path)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.monotonic() - start:.0f} s")
    print(f"{'rows':>5} {'baseline ms/step':>17} {'no cuDNN ms/step':>17} {'tokens/s':>10} {'speed-up':>9}")
    slower = False
    for rows in ROWS:
        (base_ms, _), (ms, tps) = baseline[rows], without_cudnn[rows]
        print(f"{rows:>5} {base_ms:>17.2f} {ms:>17.2f} {tps:>10.0f} {base_ms / ms:>8.2f}x")
        slower |= ms > base_ms
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
