"""On a GPU (`make test-gpu`, marked gpu: `make test` leaves them out): the built-in engine's CUDA path, the
colocated weight update through CUDA IPC, a colocated GRPO run and the offloaded optimizer. The CPU suite
covers the same logic."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.config import MicroBatchSpec
from areal_hpc.data import CU, write_batch
from areal_hpc.gen.client import GenClient
from areal_hpc.train import TrainerHandlers
from areal_hpc.train.backends.fsdp.engine import FSDPEngine
from areal_hpc.train.backends.fsdp.offload import MOMENTS, make_home, offloaded_step
from areal_hpc.train.microbatch import micro_batches
from areal_hpc.weights.shared import SharedWeights
from tests.test_fsdp_engine import model_config, moments, nll, packed, weights
from tests.test_param_realloc import ppo_batch, refs

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=900)


def test_engine_logprobs_graphs_and_seeds_hold_on_a_gpu():
    """Logprobs within the bf16 tolerance of transformers' (fresh, from the prefix cache, and continued after a
    retraction from a tight pool), graph decode as eager."""
    done = tool("tools/gpu_check_engine.py", "--shape", "0.5b", "--rows", "32", "--tokens", "128")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_paged_decode_kernel_agrees_with_its_reference():
    """The Triton kernel against the torch reference: bf16, fp16, fp32, GQA groups 1-16, 1 to 66 splits."""
    done = tool("tools/gpu_check_paged.py")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


def test_the_rotary_cache_write_kernel_equals_the_models_rope_in_bf16():
    """A decode step's q and k rotated, k and v written to their pool rows: the 1.5B's and 7B's heads, within
    one bf16 rounding of the float32 rope (the compiled rope's arithmetic; a fused multiply-add may differ)."""
    from tools.check_kernels import rotate_case

    for heads, kv_heads in [(12, 2), (28, 4)]:
        rotate_case(128, heads, kv_heads, device="cuda", dtype=torch.bfloat16, rel=2**-7)


def test_the_sampling_kernel_agrees_with_torch_at_a_real_vocabulary():
    """The Triton block statistics against torch's on the CPU (Qwen's 151,936 tokens, bf16, bans, padding), and
    the draws they give."""
    from areal_hpc.gen.backends.builtin.sampling import Scaled, block_stats, draw

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 128, 151936
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).bfloat16()
    scale = 1 / (0.5 + torch.rand(rows, device="cuda", generator=gen))
    stops = torch.randint(0, vocab, (rows, 3), device="cuda", generator=gen).sort(dim=1).values
    stops[:, 2] = stops[:, 1]  # padding
    logits.scatter_(1, stops[:, :1], 20.0)  # a stop token holds most of its row's mass
    banned = torch.rand(rows, device="cuda", generator=gen) < 0.5
    gpu = Scaled(logits, scale, stops, banned)
    cpu = Scaled(*(t.cpu() for t in gpu))
    fast, slow = block_stats(gpu), block_stats(cpu)
    assert torch.equal(fast.max.cpu(), slow.max) and torch.equal(fast.arg.cpu(), slow.arg)
    # Triton's interpreter gives torch's masses within 3e-7 (the test after this one);
    # compiled for an H100 they came out up to ~4e-5 lower on some rows (float32 exp lowering, not pinned
    # down): 4e-5 nats in a logprob, where bf16 logits carry 4e-3.
    error = ((fast.sum.cpu() - slow.sum) / slow.sum.clamp(min=1e-30)).abs().max()
    assert error < 1e-4, f"block masses off by {error:.2e} (relative)"
    u = torch.rand(rows, dtype=torch.float64)
    assert (draw(gpu, u.cuda(), fast).cpu() == draw(cpu, u, slow)).sum() >= rows - 1


def test_long_sequences_through_cudnn_attention_equal_flash_attention_over_the_row(monkeypatch):
    """A packed bf16 row of the 7B's heads with two sequences past CUDNN_FROM among short ones: the output and
    gradients within bf16 rounding of FlashAttention's varlen kernel over the whole row."""
    from areal_hpc.train import packed

    monkeypatch.setattr(packed, "CUDNN_FROM", 8192)
    assert packed._cudnn_ok(torch.device("cuda", 0), torch.bfloat16, 28, 4, 128), (
        "no cuDNN attention: nothing checked"
    )
    lengths = [300, packed.CUDNN_FROM + 808, 700, 450, packed.CUDNN_FROM + 37]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(int(cu[-1]), h, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (28, 4, 4))  # fmt: skip
    grad = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(fn):
        out = fn(q, k, v, cu, max(lengths), 0.088)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    for got, want in zip(run(packed.causal_varlen), run(packed._varlen), strict=True):
        error = ((got - want).float().abs().max() / want.float().abs().max()).item()
        assert error < 2**-7, f"{error:.2e} of the largest value apart"


def test_the_engines_kernels_in_tritons_interpreter_equal_torchs():
    """The kernels' logic on the CPU (TRITON_INTERPRET=1; it needs only triton): the sampler's bans through the
    stop table's runtime width, tiles past the vocabulary's end, ties; the rotary cache write; the engine's
    decode path with both against its gathered path."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):  # the GPU image's 3.6 among them
        pytest.skip("Triton < 3.7's interpreter cannot take a runtime loop bound under a recent NumPy (its scalar "
                    "arguments are 1-element arrays): run tools/check_kernels.py with triton >= 3.7")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "tools/check_kernels.py"], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


def test_long_answers_are_never_cut_and_episodes_prefill_only_what_they_add(tmp_path):
    """Issue 45's workloads, small: long-tailed answers all reach their drawn length; an 8-turn episode
    prefills at most 1.3x the tokens it adds (the rest comes from the prefix cache)."""
    long, episodes = tmp_path / "long.json", tmp_path / "episodes.json"
    done = tool("tools/bench_gen_long.py", "--device", "cuda", "--mode", "long", "--shape", "0.5b",
                "--prompts", "8", "--median", "600", "--tail", "4000", "--out", str(long))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    done = tool("tools/bench_gen_long.py", "--device", "cuda", "--mode", "episodes", "--shape", "0.5b",
                "--episodes", "16", "--max-batch", "16", "--out", str(episodes))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(long.read_text())["engine"]["cut"] == 0
    assert json.loads(episodes.read_text())["engine"]["prefill_ratio"] <= 1.3


def test_each_batch_size_is_captured_once_until_the_memory_is_released(tiny_model_dir):
    """The counters /server_info shows: a decode graph per bucket, captured again after a release (the graphs
    point at the memory), which a colocated server pays every step."""
    from areal_hpc.gen.backends.builtin.engine import Engine
    from areal_hpc.gen.backends.builtin.protocol import SamplingParams

    engine = Engine(str(tiny_model_dir), device="cuda", seed=0, max_batch_size=8).start()
    try:
        params = SamplingParams(max_new_tokens=8, n=8, ignore_eos=True)
        captures = lambda: engine.info()["stats"]["graph_captures"]  # noqa: E731
        engine.submit([[5, 6, 7]], params).wait(120)
        first = captures()
        engine.submit([[5, 6, 8]], params).wait(120)
        assert first >= 1 and captures() == first
        engine.release_memory(["kv_cache"])
        engine.resume_memory(["kv_cache"])
        engine.submit([[5, 6, 9]], params).wait(120)
        assert captures() > first and engine.info()["stats"]["graph_capture_secs"] > 0
    finally:
        engine.stop()


def test_a_row_admitted_with_more_stop_ids_is_banned_them_by_the_graphs_that_sample(tiny_model_dir):
    """Decode graphs sample too, reading the slots' stop table: a row whose stop ids widen that table (half the
    vocabulary, banned before min_new_tokens) joins running rows, and every one of its first 20 tokens is
    allowed, where graphs reading the old table would have let one end it at once."""
    from areal_hpc.gen.backends.builtin.engine import Engine
    from areal_hpc.gen.backends.builtin.protocol import SamplingParams

    engine = Engine(str(tiny_model_dir), device="cuda", seed=0, max_batch_size=8).start()
    try:
        running = engine.submit([[5, 6, 7]], SamplingParams(max_new_tokens=200, n=4, ignore_eos=True))
        while len(running.rows[0].output_ids) < 8:
            time.sleep(0.01)
        stops = tuple(range(1, 512))
        params = SamplingParams(max_new_tokens=40, min_new_tokens=20, stop_token_ids=stops, temperature=1.0)
        out = engine.submit([[9, 10, 11]], params).wait(120)[0]
        assert len(out.output_ids) >= 20 and not set(out.output_ids[:20]) & set(stops)
        running.wait(120)
    finally:
        engine.stop()


def test_a_server_copies_weights_a_process_shares_from_its_gpu(tiny_model_dir, tmp_path):
    """weight_update_mode tensor: the server opens this process's CUDA memory (IPC) and copies from it."""
    secret, address = tmp_path / "secret", tmp_path / "address.json"
    secret.write_text("key")
    secret.chmod(0o600)
    server = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", str(tiny_model_dir),
         "--token-file", str(secret), "--address-file", str(address), "--device", "cuda", "--dtype", "float32"],
        cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not address.exists():
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = GenClient(json.loads(address.read_text())["url"], "key", timeout=120)
        before = client.generate([3, 1, 4, 1, 5], GREEDY)[0]["output_ids"]
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda()
        gen = torch.Generator("cuda").manual_seed(1)
        noise = lambda p: torch.randn(p.shape, device="cuda", generator=gen)  # noqa: E731
        shared = SharedWeights()
        moved = [(n, p.detach() + noise(p)) for n, p in model.named_parameters()]
        client.update_weights_from_tensor([shared.share(moved)["serialized"]], weight_version=2)
        after = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
        assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "2"
        original = [(n, p.detach()) for n, p in model.named_parameters()]
        client.update_weights_from_tensor([shared.share(original)["serialized"]], weight_version=3)
        shared.release()
        assert client.generate([3, 1, 4, 1, 5], GREEDY)[0]["output_ids"] == before
    finally:
        server.terminate()
        server.wait(30)


def test_a_colocated_run_shares_the_gpu_and_its_weights():
    done = tool("tools/gpu_check_colocated.py", "--steps", "2", "--shape", "0.5b")
    assert done.returncode == 0 and "colocated check: OK" in done.stdout, done.stdout + done.stderr


def free_segments_after_a_step(toy, tmp_path, *allocation: str) -> int:
    """How many of the allocator's segments a trainer rank leaves cached and unused after a step of 2,200
    tokens (the logits' 9 MB blocks are the allocator's large ones, as every block of a real model's step)."""
    cfg = toy.config("memory", 2, *allocation, "actor.dtype=float32")
    handlers = TrainerHandlers(cfg, rank=0, world_size=1)
    handlers.initialize({"total_train_steps": 2, "mfcs": {"actor_train": "actor"}})
    lengths = [600, 500, 700, 400]
    batch = ppo_batch(torch.zeros(sum(lengths)), lengths)
    write_batch(tmp_path / "rollout.h5", batch)
    rows = refs(str(tmp_path / "rollout.h5"), range(len(lengths)), batch.keys() - {CU})
    handlers.train_step({"mfc": "actor_train", "refs": rows})
    free = sum(
        all(b["state"] != "active_allocated" for b in s["blocks"]) for s in torch.cuda.memory_snapshot()
    )
    del handlers
    gc.collect()
    torch.cuda.empty_cache()
    return free


def test_a_colocated_trainer_leaves_nothing_cached_for_the_servers_after_a_step(toy, tmp_path):
    """The servers resume on the memory the step used: a 7B on one H100 could not, its trainer's allocator
    keeping 47 GiB of activations cached."""
    colocated = ["allocation_mode=d1p1m1", "weight_update_mode=tensor", "cluster.n_nodes=1"]
    assert free_segments_after_a_step(toy, tmp_path, *colocated, "cluster.n_gpus_per_node=1") == 0
    assert free_segments_after_a_step(toy, tmp_path) > 0  # decoupled: kept for the next step


def test_offloaded_step_copies_beside_the_update_and_updates_as_adamw_on_the_gpu():
    """The moments stream in and out on copy streams of their own while the updates run: 0.9 GB of weights, with room on the device for only two parameters' moments at a time, end where AdamW ends with
    its state on the GPU (a copy back that raced its update, or a fetch that reused memory still being read,
    would differ)."""
    gen = torch.Generator("cuda").manual_seed(0)
    start = [torch.randn(4096, 4096 + 64 * i, generator=gen, device="cuda") for i in range(12)]
    grads = [[torch.randn_like(w) * 1e-3 for w in start] for _ in range(3)]
    results = []
    for offloaded in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        if offloaded:
            make_home(optimizer, pinned=True)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            if offloaded:
                offloaded_step(optimizer, params, params[0].device, in_flight=2 * 8 * start[-1].numel())
            else:
                optimizer.step()
        results.append(
            [p.detach() for p in params] + [optimizer.state[p][k] for p in params for k in MOMENTS]
        )
    assert all(t.device.type == "cpu" and t.is_pinned() for t in results[1][len(start) :])
    for on_gpu, offloaded in zip(*results, strict=True):
        torch.testing.assert_close(offloaded.cuda(), on_gpu, atol=1e-6, rtol=0)


def test_offloaded_adam_state_steps_as_on_the_gpu_and_stays_in_page_locked_memory(tiny_model_dir):
    """optimizer.offload on CUDA: three steps give the losses and weights of the state kept on the GPU; the
    moments stay in page-locked CPU memory, through the steps and a recover load into a fresh engine, and the
    device holds none of them (a DTensor made with from_local had moved each back to the GPU)."""
    mbs = micro_batches(packed(), MicroBatchSpec(max_tokens_per_mb=16))
    results = []
    for offload in (False, True):
        gc.collect()
        start = torch.cuda.memory_allocated()
        engine = FSDPEngine(model_config(tiny_model_dir, offload=offload), total_train_steps=10)
        assert engine.device.type == "cuda"
        losses = [engine.train_minibatch(mbs, nll)["loss"] for _ in range(3)]
        results.append((losses, weights(engine), torch.cuda.memory_allocated() - start))
        del engine
    (losses, on_gpu, held), (offloaded_losses, offloaded, held_offloaded) = results
    assert offloaded_losses == pytest.approx(losses, abs=1e-6)
    for name, tensor in on_gpu.items():
        torch.testing.assert_close(offloaded[name], tensor, atol=1e-6, rtol=0)
    state_bytes = 2 * sum(t.numel() * 4 for t in on_gpu.values())
    assert held - held_offloaded >= 0.9 * state_bytes
    trained = FSDPEngine(model_config(tiny_model_dir, offload=True), total_train_steps=10)
    trained.train_minibatch(mbs, nll)
    fresh = FSDPEngine(model_config(tiny_model_dir, offload=True), total_train_steps=10)
    fresh.load_state_dict(trained.state_dict())
    for engine in (trained, fresh):
        local = [m.to_local() for m in moments(engine)]
        assert all(t.device.type == "cpu" and t.is_pinned() for t in local)
