"""The built-in engine's KV pool (gen/backends/builtin/cache.py, pages.py, scheduler.py): rows take pages as
they grow, are retracted when the pool runs out and continue as if nothing happened, a request that can never
fit is refused with its numbers, and a prompt that extends a finished sequence prefills only its new tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.pages import PAGE, Pages
from areal_hpc.gen.backends.builtin.protocol import RequestError, SamplingParams
from areal_hpc.gen.client import GenClient

REPO = Path(__file__).resolve().parents[1]


def start(model, **kwargs) -> Engine:
    return Engine(str(model), seed=0, max_batch_size=8, **kwargs).start()


def sampled(max_new_tokens: int, seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, sampling_seed=seed)


def prompts(count: int, first: int = 7) -> list[list[int]]:
    return [[(first + 13 * i + 5 * j) % 200 + 1 for j in range(6 + 3 * i)] for i in range(count)]


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0) <= tol


# --- pages ---------------------------------------------------------------------------------------------------


def test_pages_are_counted_cached_by_their_tokens_and_evicted_least_recently_used_first():
    pool = Pages(7)  # page 0 is the scratch page: 6 to hand out
    a, b = list(range(100, 100 + 2 * PAGE + 3)), list(range(500, 500 + 2 * PAGE + 3))
    held_a, held_b = pool.take(3), pool.take(3)
    assert pool.take(1) is None and pool.available == 0
    pool.insert(a, held_a)  # a's two full pages stay cached; its partial third page does not
    pool.release(held_a)
    assert (pool.free, pool.available, pool.cached) == (1, 3, 2)
    assert pool.match(a + [1, 2], limit=len(a)) == held_a[:2]  # now held again: not idle
    assert pool.available == 1
    pool.release(held_a[:2])
    pool.insert(b, held_b)
    pool.release(held_b)
    pool.match(a, limit=len(a))  # a used after b: b's pages go first
    pool.release(held_a[:2])
    assert sorted(pool.take(4)) == sorted([held_a[2], held_b[2], held_b[1], held_b[0]])
    assert pool.match(b, len(b)) == [] and pool.match(a, len(a)) == held_a[:2]
    assert pool.flush() == 2 and pool.match(a, len(a)) == []  # new weights: nothing cached


# --- admission, growth and retraction ------------------------------------------------------------------------


def test_retracted_rows_continue_with_the_tokens_and_logprobs_of_an_unconstrained_run(tiny_model_dir):
    batch, params = prompts(8), sampled(60)
    roomy = start(tiny_model_dir)
    tight = start(tiny_model_dir, max_total_tokens=12 * PAGE)  # 8 rows of up to 81 positions: 3 fit at once
    try:
        expected = roomy.submit(batch, params).wait(120)
        got = tight.submit(batch, params).wait(120)
        stats = tight.info()["stats"]
    finally:
        roomy.stop()
        tight.stop()
    assert stats["retracted_rows"] > 0 and stats["max_batch_rows"] < 8
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert all(close(g.logprobs, e.logprobs, 1e-4) for g, e in zip(got, expected, strict=True))
    assert [o.finish_reason for o in got] == [{"type": "length", "length": 60}] * 8  # none cut


def test_a_request_that_can_never_fit_is_refused_with_its_numbers(tiny_model_dir):
    engine = start(tiny_model_dir, context_length=256, max_total_tokens=10 * PAGE)
    try:
        info = engine.info()
        assert info["kv_cache"]["pool_tokens"] == info["max_total_num_tokens"] == 160
        assert info["kv_cache"]["rows_at_full_context"] == 0
        with pytest.raises(
            RequestError, match=r"10 tokens \+ max_new_tokens 300 = 310 exceeds the context length 256"
        ):
            engine.submit([list(range(1, 11))], sampled(300))
        with pytest.raises(RequestError, match=r"may grow to 210, more than the KV cache's 160 positions"):
            engine.submit([list(range(1, 11))], sampled(200))
        assert len(engine.submit([list(range(1, 11))], sampled(150)).wait(60)[0].output_ids) == 150
    finally:
        engine.stop()


# --- prefix reuse --------------------------------------------------------------------------------------------


def test_a_prompt_extending_a_finished_answer_prefills_only_its_new_tokens(tiny_model_dir):
    first_turn, tool_answer = prompts(1)[0] + list(range(30, 60)), [9, 8, 7, 6, 5]
    warm, cold = start(tiny_model_dir), start(tiny_model_dir)
    try:
        answer = warm.submit([first_turn], sampled(25, seed=1)).wait(60)[0]
        second_turn = first_turn + answer.output_ids + tool_answer
        before = warm.info()["stats"]
        reused = warm.submit([second_turn], sampled(20, seed=2)).wait(60)[0]
        after = warm.info()["stats"]
        fresh = cold.submit([second_turn], sampled(20, seed=2)).wait(60)[0]
    finally:
        warm.stop()
        cold.stop()
    # Every full page of the first turn's prompt and answer but its last token (whose keys were never computed).
    cached = (len(first_turn) + 25 - 1) // PAGE * PAGE
    assert (reused.cached_tokens, fresh.cached_tokens) == (cached, 0)
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(second_turn) - cached
    assert reused.output_ids == fresh.output_ids and close(reused.logprobs, fresh.logprobs, 1e-5)


def test_a_groups_samples_share_its_prompt_and_new_weights_forget_the_cache(tiny_model_dir):
    prompt = prompts(3)[2]  # 12 tokens: with 40 more, three full pages
    engine = start(tiny_model_dir)
    try:
        first = engine.submit([prompt + list(range(40))], SamplingParams(n=4, max_new_tokens=5)).wait(60)
        again = engine.submit([prompt + list(range(40))], SamplingParams(n=4, max_new_tokens=5)).wait(60)
        engine.update_weights_from_tensors(lambda: [], weight_version="1")
        updated = engine.submit([prompt + list(range(40))], SamplingParams(n=4, max_new_tokens=5)).wait(60)
        # /flush_cache forgets it too, and, as SGLang's, only while no request runs.
        assert engine.info()["kv_cache"]["cached_pages"] >= 3 and engine.flush_cache() >= 3
        assert engine.info()["kv_cache"]["cached_pages"] == 0
        engine.submit([prompt], SamplingParams(max_new_tokens=2000, ignore_eos=True))  # still running
        with pytest.raises(RequestError, match="flush_cache needs an idle server"):
            engine.flush_cache()
        engine.abort(abort_all=True)
    finally:
        engine.stop()
    assert [o.cached_tokens for o in first] == [0] * 4
    assert [o.cached_tokens for o in again] == [3 * PAGE] * 4
    assert [o.cached_tokens for o in updated] == [0] * 4


# --- a real server -------------------------------------------------------------------------------------------


def test_a_server_with_a_tiny_pool_retracts_and_loses_or_cuts_no_answer(tiny_model_dir, tmp_path):
    secret, address = tmp_path / "secret", tmp_path / "gen.json"
    secret.write_text("token")
    secret.chmod(0o600)
    cmd = [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", str(tiny_model_dir),
           "--token-file", str(secret), "--address-file", str(address), "--max-batch-size", "16",
           "--max-total-tokens", str(16 * PAGE)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not address.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        client = GenClient(json.loads(address.read_text())["url"], "token", timeout=120)
        client.wait_healthy(timeout=30)
        out = client.generate(prompts(12), {"temperature": 1.0, "max_new_tokens": 90, "ignore_eos": True})
        info = client.server_info()
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(out) == 12
    assert [len(o["output_ids"]) for o in out] == [90] * 12
    assert {o["meta_info"]["finish_reason"]["type"] for o in out} == {"length"}
    assert info["stats"]["retracted_rows"] > 0
    assert info["kv_cache"] | {"pool_gib": 0} == {
        "pool_tokens": 256, "pool_gib": 0, "page_size": PAGE, "rows_at_full_context": 0,
        "free_pages": info["kv_cache"]["free_pages"], "available_pages": 16, "cached_pages": info["kv_cache"]["cached_pages"],
    }  # fmt: skip
