"""The built-in engine's slots, decode steps, KV cache and weights (areal_hpc/gen/backends/builtin/)."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GPT2Config, MixtralConfig

from areal_hpc.gen.backends.builtin import cache, runner
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.model import Decoder, Shape, arch_of
from areal_hpc.gen.backends.builtin.protocol import RequestError, SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=8).start()
    yield engine
    engine.stop()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)


def sampled(max_new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, sampling_seed=seed)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def generate(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.submit([prompt], params).wait(timeout=60)[0].output_ids


# --- scheduling ----------------------------------------------------------------------------------------------


def test_rows_moved_down_into_freed_slots_answer_as_they_do_alone(engine):
    low = [[11 + i, 200 + 7 * i, 90, 31 + i][: 2 + i % 3] for i in range(5)]
    high = [[40, 41, 42], [50, 51], [60, 61, 62, 63]]
    params = [sampled(80, seed=5), greedy(70), sampled(70, seed=7)]  # these outlive the low rows
    alone = [generate(engine, p, greedy(64)) for p in low]
    alone += [generate(engine, p, q) for p, q in zip(high, params, strict=True)]
    first = engine.submit(low, greedy(64))  # slots 0-4
    wait_for(lambda: min(len(row.output_ids) for row in first.rows) >= 2)
    engine.pause("in_place")
    later = [
        engine.submit([p], q) for p, q in zip(high, params, strict=True)
    ]  # slots 5-7, tokens counted from 0
    engine.resume()
    requests = [first, *later]
    assert [o.output_ids for r in requests for o in r.wait(60)] == alone
    # Where each row ended: 7 -> 0 and 6 -> 1 when slots 0-4 freed; 5 -> 2, then -> 0 when it ran alone.
    assert [row.slot for r in requests for row in r.rows] == [0, 1, 2, 3, 4, 0, 1, 0]


def test_no_decode_step_is_launched_for_a_row_that_has_its_tokens(engine):
    before = engine.info()["stats"]
    assert len(generate(engine, [7, 8, 9], greedy(5))) == 5
    after = engine.info()["stats"]
    assert after["decode_steps"] - before.get("decode_steps", 0) == 4  # the prefill samples the first token
    assert after["generated_tokens"] - before.get("generated_tokens", 0) == 5


def test_bucket_is_the_smallest_graph_size_that_holds_the_rows_capped_by_the_slots():
    assert runner.bucket(1, 256) == 1 and runner.bucket(3, 256) == 4 and runner.bucket(65, 256) == 96
    assert runner.bucket(200, 128) == 128 and runner.bucket(3, 2) == 2
    assert runner.bucket(300, 512) == 320  # beyond the largest: a multiple of 64


# --- the KV cache --------------------------------------------------------------------------------------------


def test_the_kv_cache_is_a_pool_of_pages_the_memory_share_holds(tiny_model_dir):
    shape = Shape.of(AutoConfig.from_pretrained(tiny_model_dir))
    page_bytes = cache.PAGE * shape.kv_bytes_per_token * 4  # float32

    with pytest.raises(MemoryError, match=r"less than one page .* raise sglang\.mem_fraction_static"):
        cache.plan(shape, torch.float32, page_bytes, context_len=2048)
    pool = cache.plan(shape, torch.float32, 100 * page_bytes + 5, context_len=512)
    assert (pool.pages, pool.tokens, pool.rows_at_full_context) == (100, 99 * 16, 3)  # page 0 is scratch
    assert pool.describe() == {
        "pool_tokens": 1584, "pool_gib": round(100 * page_bytes / 2**30, 3), "page_size": 16,
        "rows_at_full_context": 3,
    }  # fmt: skip
    # No more than the running rows can use at full context (a CPU's share of RAM is a ceiling).
    assert cache.plan(shape, torch.float32, 10**6 * page_bytes, 512, max_tokens=8 * 512).tokens == 8 * 512


def test_a_released_kv_cache_refuses_generation_until_resumed(engine):
    kv, prompt = engine._sched.runner.cache, [3, 1, 4, 1, 5, 9]
    size, before = kv.nbytes, generate(engine, prompt, greedy(8))
    engine.release_memory(["kv_cache"])
    try:
        assert kv.nbytes == 0 and engine.memory["released"] == ["kv_cache"]
        with pytest.raises(RequestError, match="its kv_cache memory is released"):
            generate(engine, prompt, greedy(8))
    finally:
        engine.resume_memory(["kv_cache"])
    assert kv.nbytes == size > 0 and not engine.memory["weights_stale"]
    assert generate(engine, prompt, greedy(8)) == before  # the weights stayed: the same answer


def test_a_row_reads_nothing_of_its_slot_beyond_its_own_length(engine):
    short, long = [1, 2], [3, 4, 5, 6, 7, 8, 9]
    alone = [generate(engine, p, greedy(6)) for p in (short, long)]
    kv = engine._sched.runner.cache
    for t in kv.k + kv.v:
        t.fill_(float("nan"))  # what a new cache may hold: torch.empty gives memory back with any bits
    try:
        both = engine.submit([short, long], greedy(6)).wait(60)
    finally:
        for t in kv.k + kv.v:
            t.zero_()
    assert [o.output_ids for o in both] == alone


# --- the decoder ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "error"), [("model.norm.weight", ValueError), ("model.bogus.weight", KeyError)]
)
def test_loading_refuses_a_bad_file_before_copying_any_weight(tiny_model_dir, tmp_path, name, error):
    decoder = Decoder.from_pretrained(str(tiny_model_dir), CPU, torch.float32)
    before = {n: t.clone() for n, t in decoder.named().items()}
    good = {n: torch.zeros_like(t) for n, t in load_file(tiny_model_dir / "model.safetensors").items()}
    good.pop(name, None)
    save_file(good, tmp_path / "a.safetensors")  # read first: every other weight, all zeros
    save_file({name: torch.zeros(3)}, tmp_path / "b.safetensors")  # a shape no weight of the model has
    with pytest.raises(error, match=rf"b\.safetensors: .*{name}"):
        decoder.load(str(tmp_path))
    assert all(torch.equal(t, before[n]) for n, t in decoder.named().items())


@pytest.mark.parametrize("config", [GPT2Config(), MixtralConfig()], ids=lambda c: c.model_type)
def test_a_model_type_the_decoder_does_not_run_is_refused_by_name(config):
    with pytest.raises(ValueError, match=f"runs qwen2, qwen3 and llama models, not '{config.model_type}'"):
        arch_of(config)
