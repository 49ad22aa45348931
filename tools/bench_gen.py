"""Benchmark generation: the built-in server over HTTP (CPU, the default) or its engine in process (GPU).

HTTP: generated tokens/s of N concurrent requests vs the same requests one at a time, and the time of a small
call (``/model_info``) on a kept connection vs a new one each time. It starts the built-in server (a
subprocess) on the tiny model, or with ``--url`` and ``--token-file`` measures a running one (built-in or
SGLang). Every request samples exactly ``--max-new-tokens`` tokens (ignore_eos): both runs do the same work.

Engine (``--device cuda``; ``--engine-bench`` on CPU tests it on ``--model-path``): per shape a random-weight
Qwen2.5 model built on the spot (bf16, no download); per row count R (1 prompt, or R/8 prompts of n=8 answers)
a warm-up request (its wall time is ``setup_s``: graph capture, compilation), then one of ``--max-new-tokens``
tokens (ignore_eos, temperature 1): decode ms/step (engine counters), wall ms per token step, tokens/s, and
the roofline: bytes a decode step moves (weights less an untied input embedding, the KV cache at the mean
context) over the measured copy bandwidth. ``--baseline DIR`` (an older copy of the package directory
areal_hpc/gen/backends/builtin) runs the same workload with ``--baseline-tokens`` new tokens (it is
host-bound) for the speed-up. Prints a line per (shape, rows), then the results as JSON (also to ``--out``).

Usage::

    python tools/bench_gen.py [--model-path .cache/tiny/model] [--requests 8] [--max-new-tokens 64]

    mkdir -p .cache/engine-baseline && git archive fe8b547 areal_hpc/gen/backends/builtin \\
        | tar -x -C .cache/engine-baseline
    python tools/bench_gen.py --device cuda [--shapes 1.5b,7b] [--rows 1,64,256] [--max-new-tokens 1024] \\
        [--prompt-len 256] [--baseline .cache/engine-baseline/areal_hpc/gen/backends/builtin] \\
        [--baseline-tokens 128] [--out FILE.json]
    python tools/bench_gen.py --device cpu --engine-bench --rows 1,16 --max-new-tokens 16 --prompt-len 8 \\
        --baseline .cache/engine-baseline/areal_hpc/gen/backends/builtin --baseline-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

if TYPE_CHECKING:
    from areal_hpc.gen.client import GenClient

BUILTIN = "areal_hpc.gen.backends.builtin"
SHAPES = {  # Qwen2.5 configs: hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
}


def gen_client(url: str, token: str | None, timeout: float) -> GenClient:
    """A client; imported here, as areal_hpc.gen imports the rollout stack, which the GPU image lacks."""
    from areal_hpc.gen.client import GenClient

    return GenClient(url, token, timeout=timeout)


@contextmanager
def builtin_server(args: argparse.Namespace) -> Iterator[GenClient]:
    """Start ``python -m areal_hpc.gen.backends.builtin.server`` with a fresh secret; yield a client; SIGTERM it at the end."""
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as run_dir:
        secret, address = Path(run_dir) / "secret", Path(run_dir) / "address.json"
        token = os.urandom(16).hex()
        secret.write_text(token)
        secret.chmod(0o600)
        cmd = [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", args.model_path]
        cmd += ["--token-file", str(secret), "--address-file", str(address), "--seed", "0"]
        cmd += ["--max-batch-size", str(args.max_batch_size), "--num-threads", str(args.num_threads)]
        cmd += ["--device", args.device]
        proc = subprocess.Popen(cmd, cwd=REPO)
        try:
            deadline = time.monotonic() + args.start_timeout
            while not address.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start within {args.start_timeout} s")
                time.sleep(0.1)
            client = gen_client(json.loads(address.read_text())["url"], token, args.timeout)
            client.wait_healthy(timeout=30)
            yield client
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids (not special tokens: ids from 16 up)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def one_at_a_time(client: GenClient, prompts: list[list[int]], params: dict) -> tuple[int, float]:
    """(generated tokens, seconds) of the prompts sent one after the other."""
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += sum(len(o["output_ids"]) for o in client.generate(prompt, params, return_logprob=True))
    return tokens, time.perf_counter() - start


def concurrent(client: GenClient, prompts: list[list[int]], params: dict) -> tuple[int, float]:
    """(generated tokens, seconds) of the prompts sent at once, one thread each."""
    counts = [0] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def send(i: int) -> None:
        barrier.wait()
        counts[i] = sum(
            len(o["output_ids"]) for o in client.generate(prompts[i], params, return_logprob=True)
        )

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(counts), time.perf_counter() - start


def call_ms(calls: int, client_of_call) -> float:
    """Median milliseconds of ``calls`` calls of /model_info, each through ``client_of_call()``."""
    times = []
    for _ in range(calls):
        client = client_of_call()
        start = time.perf_counter()
        client.model_info()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(client: GenClient, args: argparse.Namespace) -> dict:
    """Both measurements on one server, after a warm-up request."""
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = make_prompts(args.requests, args.prompt_len, args.vocab_size, args.seed)
    client.generate(prompts[0], {**params, "max_new_tokens": 4})
    seq_tokens, seq_s = one_at_a_time(client, prompts, params)
    conc_tokens, conc_s = concurrent(client, prompts, params)
    seq_tps, conc_tps = seq_tokens / seq_s, conc_tokens / conc_s
    # A new client has no connection yet: each of its calls connects, as every call did before keep-alive.
    fresh = call_ms(args.calls, lambda: gen_client(client.url, client.token, client.timeout))
    kept = call_ms(args.calls, lambda: client)
    return {
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "sequential_tokens_per_s": round(seq_tps, 1),
        "concurrent_tokens_per_s": round(conc_tps, 1),
        "speedup": round(conc_tps / seq_tps, 2),
        "max_requests_per_forward": client.server_info().get("stats", {}).get("max_requests_per_forward"),
        "call_ms_new_connection": round(fresh, 3),
        "call_ms_kept_connection": round(kept, 3),
    }


# --- engine mode -------------------------------------------------------------------------------------------


def log(*parts: object) -> None:
    print(*parts, flush=True)  # progress as it happens: PYTHONUNBUFFERED may not be set


def free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, reps: int = 10) -> float:
    """Bytes/s of a copy of a large tensor, read + written (the roofline's rate): median of ``reps`` timed
    copies after warm-up. 2 GiB on a GPU (timed with CUDA events); 256 MiB of host memory on CPU."""
    cuda = torch.device(device).type == "cuda"
    n = 2**31 if cuda else 2**28
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = []
    for _ in range(reps + 3):  # the first copies fault the pages in / warm the allocator: dropped
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            secs.append(time.perf_counter() - t0)
    del src, dst
    free_memory(device)
    return 2 * n / statistics.median(secs[3:])


def build_model(shape: str, out: str, device: str) -> None:
    """A random-weight Qwen2.5 model of ``shape`` saved (bf16) in ``out``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():  # built where it runs: seconds for 7B on a GPU
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        # Explicitly, whatever the library's init: std 0.02 keeps the logits spread, so sampling draws from a
        # real softmax; norms at 1 and biases at 0 as in a trained model.
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    model.save_pretrained(out)
    del model
    free_memory(device)


def bare_packages() -> None:
    """Bare parent packages of the engine: areal_hpc.gen's __init__ imports the rollout stack, which the GPU
    image lacks."""
    for name in ("areal_hpc.gen", "areal_hpc.gen.backends", BUILTIN):
        if name not in sys.modules:
            sys.modules[name] = module = types.ModuleType(name)
            module.__path__ = [str(REPO / name.replace(".", "/"))]


def engine_classes(copy: str | None, tmp: str, package: str) -> tuple[type, type]:
    """(Engine, SamplingParams) of the package's engine, or of the copy of the package in ``copy`` (imported
    as ``package``)."""
    if copy is None:
        bare_packages()
        package = BUILTIN
    else:
        # A package of its own beside the current one: its modules import each other under the new name.
        (Path(tmp) / package).mkdir()
        for src in Path(copy).glob("*.py"):
            (Path(tmp) / package / src.name).write_text(src.read_text().replace(BUILTIN, package))
        # An empty __init__: the package's own imports the HTTP server and with it the rollout stack.
        (Path(tmp) / package / "__init__.py").write_text("")
        if tmp not in sys.path:
            sys.path.insert(0, tmp)
    engine, protocol = (importlib.import_module(f"{package}.{m}") for m in ("engine", "protocol"))
    return engine.Engine, protocol.SamplingParams


def start_engine(engine_cls: type, path: str, args: argparse.Namespace):
    """The engine on ``path``; ``--mem-fraction-static`` only where this engine takes it."""
    kwargs = dict(device=args.device, dtype=args.dtype, seed=0, max_batch_size=max(args.rows))
    if args.mem_fraction_static is not None:
        if "mem_fraction_static" in inspect.signature(engine_cls).parameters:
            kwargs["mem_fraction_static"] = args.mem_fraction_static
        else:
            log(f"{engine_cls.__module__}.Engine takes no mem_fraction_static: not passed")
    return engine_cls(path, **kwargs).start()


def generate(engine, params_cls: type, prompts: list[list[int]], n: int, new: int, timeout: float) -> dict:
    """Wall time, generated tokens and the engine's counters' growth over one request."""
    params = params_cls(max_new_tokens=new, temperature=1.0, n=n, ignore_eos=True)
    before = dict(engine.info()["stats"])
    start = time.perf_counter()
    outputs = engine.submit(prompts, params).wait(timeout)
    wall = time.perf_counter() - start
    after = engine.info()["stats"]
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in ("decode_steps", "decode_secs", "prefill_secs")}
    return {"wall_s": wall, "tokens": sum(len(o.output_ids) for o in outputs), **grown}


def measure(engine, params_cls: type, rows: int, new: int, vocab: int, args: argparse.Namespace) -> dict:
    """One row count: a short warm-up request (one-off setup: graph capture, compiling), then a timed one."""
    n = 1 if rows == 1 else 8
    prompts = make_prompts(rows // n, args.prompt_len, vocab, args.seed + rows)
    warm = make_prompts(rows // n, args.prompt_len, vocab, args.seed - rows)  # others: no prefix cache hit
    setup = generate(engine, params_cls, warm, n, min(16, new), args.timeout)["wall_s"]
    run = generate(engine, params_cls, prompts, n, new, args.timeout)
    return {
        "max_new_tokens": new,
        "setup_s": round(setup, 3),
        "wall_s": round(run["wall_s"], 3),
        "prefill_s": round(run["prefill_secs"], 3),
        "decode_steps": run["decode_steps"],
        "decode_ms_per_step": round(1e3 * run["decode_secs"] / max(run["decode_steps"], 1), 3),
        "wall_ms_per_step": round(1e3 * run["wall_s"] / new, 3),
        "tokens": run["tokens"],
        "tokens_per_s": round(run["tokens"] / run["wall_s"], 1),
    }


def run_engine(label: str, classes: tuple[type, type], path: str, new: int, args: argparse.Namespace) -> dict:
    """Every row count through one engine on the model at ``path``; the engine stopped and freed after."""
    engine_cls, params_cls = classes
    vocab = min(32000, json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    engine = start_engine(engine_cls, path, args)
    try:
        out = {}
        for rows in args.rows:
            out[rows] = r = measure(engine, params_cls, rows, new, vocab, args)
            log(f"  {label}: {rows} rows x {new} tokens: {r['decode_ms_per_step']} ms/step, "
                f"{r['tokens_per_s']} tok/s, setup {r['setup_s']} s")  # fmt: skip
        if args.profile and label == "engine":
            profile(engine, params_cls, args.rows[-1], vocab, args)
        return out
    finally:
        engine.stop()
        del engine
        free_memory(args.device)


def profile(engine, params_cls: type, rows: int, vocab: int, args: argparse.Namespace) -> None:
    """A request of ``rows`` rows x 64 tokens under torch.profiler: the kernels by device time, and how much of
    the wall time the device was busy (the rest is the host's: launches, sampling, bookkeeping). The Chrome
    trace goes to ``--profile``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = 1 if rows == 1 else 8
    prompts = make_prompts(rows // n, args.prompt_len, vocab, args.seed + 7)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch_profile(activities=activities) as prof:
        run = generate(engine, params_cls, prompts, n, 64, args.timeout)
    prof.export_chrome_trace(args.profile)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    steps = max(run["decode_steps"], 1)
    log(f"profile, {rows} rows x 64 tokens: wall {run['wall_s']:.3f} s, device busy {busy_us / 1e6:.3f} s "
        f"({100 * busy_us / 1e6 / run['wall_s']:.0f}%), {len(kernels) / steps:.0f} kernels per decode step")  # fmt: skip
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=60)
    log(table)


def decode_bytes(path: str, dtype: str) -> tuple[int, int]:
    """(Weight bytes a decode step reads, KV cache bytes per token) of the model at ``path``. The weights from
    the safetensors headers: all but an untied input embedding (a step reads one row of it per token); a tied
    one is the lm_head's matrix, stored once."""
    elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    shapes = {}
    for file in Path(path).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if "lm_head.weight" in shapes:
        shapes.pop("model.embed_tokens.weight", None)
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * elem
    return elem * sum(math.prod(shape) for shape in shapes.values()), kv_per_token


def summarize(model: str, rows: int, new: dict, base: dict | None, nbytes: float, bandwidth: float) -> dict:
    """One result (printed as a line): the engine, its roofline and the baseline beside it."""
    roofline_ms = 1e3 * nbytes / bandwidth
    row = dict(model=model, rows=rows, **new, step_bytes=int(nbytes), roofline_ms=round(roofline_ms, 3))
    row["roofline_fraction"] = round(roofline_ms / new["decode_ms_per_step"], 3)
    line = (
        f"{model} {rows:>4} rows: engine {new['decode_ms_per_step']:.2f} ms/step "
        f"(wall {new['wall_ms_per_step']:.2f}), {new['tokens_per_s']:.0f} tok/s; "
        f"roofline {roofline_ms:.2f} ms ({100 * row['roofline_fraction']:.0f}%)"
    )
    if base:
        row["baseline"] = base
        row["speedup_per_step"] = round(base["decode_ms_per_step"] / new["decode_ms_per_step"], 2)
        row["speedup_tokens_per_s"] = round(new["tokens_per_s"] / base["tokens_per_s"], 2)
        line += (
            f"; baseline {base['decode_ms_per_step']:.2f} ms/step, {base['tokens_per_s']:.0f} tok/s; "
            f"speed-up {row['speedup_per_step']:.2f}x per step, {row['speedup_tokens_per_s']:.2f}x tok/s"
        )
    log(line)
    return row


def engine_bench(args: argparse.Namespace) -> dict:
    """The engine mode: bandwidth, then per model the engine's and the baseline's runs, then the summary."""
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU"
    bandwidth = copy_bandwidth(args.device)
    log(f"{name}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        new_cls = engine_classes(args.engine_dir, tmp, "engine_new")
        base_cls = engine_classes(args.baseline, tmp, "engine_baseline") if args.baseline else None
        for shape in args.shapes or [None]:
            path = args.model_path if shape is None else os.path.join(tmp, f"model-{shape}")
            if shape is not None:
                start = time.perf_counter()
                build_model(shape, path, args.device)
                log(f"built the random {shape} model in {time.perf_counter() - start:.0f} s")
            new = run_engine("engine", new_cls, path, args.max_new_tokens, args)
            base = run_engine("baseline", base_cls, path, args.baseline_tokens, args) if base_cls else {}
            weights, kv_per_token = decode_bytes(path, args.dtype)
            # The KV cache read at the mean context over the decode, and the new token's KV written (+1).
            kv_tokens = args.prompt_len + args.max_new_tokens / 2 + 1
            for rows in args.rows:
                nbytes = weights + rows * kv_tokens * kv_per_token
                results.append(summarize(shape or path, rows, new[rows], base.get(rows), nbytes, bandwidth))
            if shape is not None:
                shutil.rmtree(path)
    return {
        "device": name,
        "dtype": args.dtype,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "prompt_len": args.prompt_len,
        "results": results,
    }


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=".cache/tiny/model", help="model of the server or the CPU engine")
    p.add_argument("--url", default=None, help="measure this running server instead of starting one")
    p.add_argument("--token-file", default=None, help="bearer token file of --url")
    p.add_argument("--requests", type=int, default=8, help="N: requests, sent concurrently or one by one")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (32; engine 256)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (64; engine 1024)")
    p.add_argument("--vocab-size", type=int, default=1000, help="HTTP prompt token ids are drawn below this")
    p.add_argument("--max-batch-size", type=int, default=64, help="built-in server's --max-batch-size")
    p.add_argument("--num-threads", type=int, default=1, help="built-in server's torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu: the HTTP benchmark; cuda: the engine benchmark")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--calls", type=int, default=300, help="timed /model_info calls of each kind")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP call or engine request")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the server to start")
    e = p.add_argument_group("engine benchmark (--device cuda, or --engine-bench)")
    e.add_argument("--engine-bench", action="store_true", help="the engine benchmark on --device cpu")
    e.add_argument("--shapes", default=None, help=f"of {','.join(SHAPES)}; GPU default 1.5b,7b")
    e.add_argument("--rows", type=int_list, default=[1, 64, 256], help="row counts: 1 or multiples of 8")
    e.add_argument("--baseline", default=None, help="directory of an older copy of the engine package")
    e.add_argument("--baseline-tokens", type=int, default=128, help="new tokens per answer of the baseline")
    e.add_argument("--mem-fraction-static", type=float, default=None, help="passed if the engine takes it")
    e.add_argument("--engine-dir", default=None, help=argparse.SUPPRESS)  # a copy as the engine: tests
    e.add_argument("--out", default=None, help="also write the JSON results here")
    e.add_argument("--profile", default=None, help="FILE: profile a request at the last row count (trace)")
    args = p.parse_args(argv)
    args.engine_bench = args.engine_bench or args.device != "cpu"
    if args.prompt_len is None:
        args.prompt_len = 256 if args.engine_bench else 32
    if args.max_new_tokens is None:
        args.max_new_tokens = 1024 if args.engine_bench else 64
    if args.shapes is None and args.device != "cpu":
        args.shapes = "1.5b,7b"
    args.shapes = args.shapes.split(",") if args.shapes else None
    if any(s not in SHAPES for s in args.shapes or []):
        p.error(f"--shapes: of {', '.join(SHAPES)}")
    if any(r != 1 and (r < 8 or r % 8) for r in args.rows):
        p.error("--rows: 1 or multiples of 8 (groups of 8 answers)")
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"  # the engine's own choice on each
    return args


def http_bench(args: argparse.Namespace) -> dict:
    """The HTTP mode: both measurements, printed."""
    if args.url:
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        result = bench(gen_client(args.url, token, args.timeout), args)
    else:
        with builtin_server(args) as client:
            result = bench(client, args)
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens: "
        f"one at a time {result['sequential_tokens_per_s']} tok/s, "
        f"concurrent {result['concurrent_tokens_per_s']} tok/s, "
        f"ratio {result['speedup']}x (max {result['max_requests_per_forward']} requests per forward pass)"
    )
    print(
        f"/model_info: {result['call_ms_kept_connection']} ms on a kept connection, "
        f"{result['call_ms_new_connection']} ms on a new one "
        f"({result['call_ms_new_connection'] / result['call_ms_kept_connection']:.2f}x)"
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark of the mode the flags choose; print its results as JSON."""
    args = parse_args(argv)
    result = engine_bench(args) if args.engine_bench else http_bench(args)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
