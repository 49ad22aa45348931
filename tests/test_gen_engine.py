"""The generation engine in-process: sampling, continuous batching, stop rules, seeds (areal_hpc/gen/)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.control import timeline
from areal_hpc.gen.backends.builtin import engine as engine_module
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.protocol import RequestError, SamplingParams
from areal_hpc.gen.backends.builtin.sampling import (
    BLOCK,
    Scaled,
    SlotSampling,
    block_stats,
    draw,
    filter_top_k_top_p,
    uniforms,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), seed=3, max_batch_size=8).start()
    yield engine
    engine.stop()


def run(engine: Engine, prompts, rid=None, **params) -> list:
    return engine.submit(prompts, SamplingParams(**params), rid).wait(timeout=60)


def tokens(outputs) -> list[list[int]]:
    return [o.output_ids for o in outputs]


def wait_for(condition, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# --- sampling ------------------------------------------------------------------------------------------------


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    kept = filter_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.6, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False], [True] * 5]


def slot_sampling(params: list[SamplingParams], vocab: int, seeds=None, stops=None) -> SlotSampling:
    sampling = SlotSampling(len(params), vocab, torch.device("cpu"))
    seeds = seeds if seeds is not None else list(range(len(params)))
    sampling.set(list(range(len(params))), params, seeds, stops or [frozenset()] * len(params))
    return sampling


def test_sample_greedy_sampled_and_banned_before_min_new_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    banned = int(logits[2].argmax())
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.0, min_new_tokens=1)]  # fmt: skip
    sampling = slot_sampling(params, 50, stops=[frozenset(), frozenset(), frozenset({banned})])
    toks, lps = sampling.sample(logits, slice(0, 3))
    assert (
        toks[0] == logits[0].argmax()
        and toks[2] == logits[2].masked_fill(torch.arange(50) == banned, -1e9).argmax()
    )
    expected = [logits[0].log_softmax(-1)[toks[0]], (logits[1] / 0.7).log_softmax(-1)[toks[1]]]
    expected.append(logits[2].log_softmax(-1)[toks[2]])  # the ban restricts the draw, not the logprob
    assert torch.allclose(lps, torch.stack(expected))
    assert sampling.sample(logits, slice(0, 3))[0][2] == banned  # one token made: the stop token is allowed


def test_a_banned_rows_logprob_is_over_the_whole_vocabulary_each_stop_token_once():
    """Row 0's one stop token is banned, its table padded to the neighbour's three ids by repeating it."""
    torch.manual_seed(1)
    logits = torch.randn(2, 40) * 4
    logits[0, 3] = 9.0  # the banned token holds most of the mass
    sampling = slot_sampling([SamplingParams(min_new_tokens=5), SamplingParams()], 40,
                             stops=[frozenset({3}), frozenset({1, 2, 8})])  # fmt: skip
    for _ in range(3):
        tokens, logprobs = sampling.sample(logits, slice(0, 2))
        assert tokens[0] != 3
        assert torch.allclose(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(-1))


def test_a_row_banning_several_stop_ids_draws_none_of_them_when_a_neighbour_widens_the_table():
    """The stop ids hold almost all the mass; the table's rows are sorted and padded with their last id, and
    the draw finds a banned token in it by search."""
    logits = torch.zeros(2, 40)
    logits[:, [2, 17, 30]] = 10.0
    sampling = slot_sampling([SamplingParams(min_new_tokens=100), SamplingParams()], 40, seeds=[3, 4],
                             stops=[frozenset({30, 2, 17}), frozenset({1, 2, 3, 4, 5})])  # fmt: skip
    assert sampling.stop_ids[0].tolist() == [2, 17, 30, 30, 30]
    for _ in range(50):
        tokens, logprobs = sampling.sample(logits, slice(0, 2))
        assert int(tokens[0]) not in (2, 17, 30)
        assert torch.allclose(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(-1))


def test_the_block_statistics_give_the_max_its_first_token_and_the_mass_of_each_block():
    logits = torch.randn(3, 2 * BLOCK + 5)
    logits[1, BLOCK : 2 * BLOCK] = float("-inf")  # an empty block
    logits[2, 7] = logits[2, 9] = 50.0  # a tie: the first wins
    blocks = block_stats(Scaled.of(logits))
    x = torch.nn.functional.pad(logits, (0, BLOCK - 5), value=float("-inf")).view(3, 3, BLOCK)
    assert torch.equal(blocks.max, x.amax(-1)) and blocks.arg[2, 0] == 7 and blocks.sum[1, 1] == 0
    mass = (blocks.sum * blocks.max.exp()).sum(-1).log()
    assert torch.allclose(mass, logits.logsumexp(-1))


def test_sampling_follows_the_distribution_and_its_seed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3)
    draw = lambda seed: slot_sampling(  # noqa: E731
        [SamplingParams()] * 4000, 3, seeds=[seed + i for i in range(4000)]
    ).sample(logits, slice(0, 4000))[0]
    freq = torch.bincount(draw(0), minlength=3) / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    assert torch.equal(draw(0), draw(0)) and not torch.equal(draw(0), draw(1))


def test_a_samples_draw_depends_on_its_seed_and_token_index_only():
    logits = torch.randn(6, 100)
    alone = slot_sampling([SamplingParams()], 100, seeds=[42]).sample(logits[3:4], slice(0, 1))[0]
    crowd = slot_sampling([SamplingParams()] * 6, 100, seeds=[1, 2, 3, 42, 5, 6]).sample(logits, slice(0, 6))[
        0
    ]
    assert crowd[3] == alone[0]


def test_a_wider_neighbour_does_not_change_a_rows_draws():
    """A row inside min_new_tokens bans its own stop ids only, whichever row joins the batch after it."""

    def draws(neighbour_stops: frozenset | None = None) -> list[int]:
        sampling = SlotSampling(2, 8, torch.device("cpu"))
        sampling.set([0], [SamplingParams(min_new_tokens=20)], [42], [frozenset({5})])
        if neighbour_stops:  # admitted later, with more stop ids than the table was wide
            sampling.set([1], [SamplingParams()], [7], [neighbour_stops])
        flat = torch.zeros(2, 8)  # every token as likely: token 0 too
        return [int(sampling.sample(flat, slice(0, 2))[0][0]) for _ in range(12)]

    alone = draws()
    assert 0 in alone and 5 not in alone
    assert draws(frozenset({5, 6, 7})) == alone


def test_the_two_level_draw_is_the_inverse_cdf_over_the_whole_vocabulary():
    """Block, then token within it: the token a float64 cumulative sum over every token gives, for a vocabulary
    with a partial last block, and never a token of probability 0."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * BLOCK + 37
    allowed = torch.randn(2000, vocab, generator=gen) * 3
    allowed[:, ::3] = float("-inf")  # banned or filtered out
    allowed[:5, : 3 * BLOCK] = float("-inf")  # all the mass in the partial block
    u = torch.rand(2000, generator=gen, dtype=torch.float64)
    cdf = allowed.double().softmax(-1).cumsum(-1)
    expected = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    got = draw(Scaled.of(allowed), u)
    assert torch.equal(got, expected)
    assert allowed.gather(1, got[:, None]).isfinite().all()
    edges = draw(Scaled.of(allowed[:3].repeat(2, 1)), torch.tensor([0.0, 0.0, 0.0] + [1 - 2**-53] * 3))
    assert allowed[:3].repeat(2, 1).gather(1, edges[:, None]).isfinite().all()  # u at 0 and just below 1


def test_neighbouring_seeds_give_unrelated_streams():
    """A request's n samples take seeds s, s + 1, ...: their draws must not be one stream shifted by a token."""
    steps = torch.arange(1, 4096)
    first, second = uniforms(torch.full_like(steps, 7), steps), uniforms(torch.full_like(steps, 8), steps - 1)
    assert not torch.isclose(first, second).any()
    both = torch.stack(
        [uniforms(torch.full_like(steps, 7), steps), uniforms(torch.full_like(steps, 8), steps)]
    )
    assert abs(torch.corrcoef(both)[0, 1]) < 0.05 and abs(both.mean() - 0.5) < 0.02


# --- engine --------------------------------------------------------------------------------------------------


def test_rows_joining_a_running_batch_decode_as_alone(engine):
    a, b = [5, 6, 7, 8, 9, 10, 11], [40, 41]
    alone = [tokens(run(engine, [p], **GREEDY))[0] for p in (a, b)]
    before = dict(engine.info()["stats"])
    first = engine.submit([a], SamplingParams(**{**GREEDY, "max_new_tokens": 20}))
    wait_for(lambda: len(first.rows[0].output_ids) >= 3)
    engine.pause("in_place")  # hold the batch so the second request surely joins it mid-generation
    second = engine.submit([b], SamplingParams(**GREEDY))
    engine.resume()
    out_a, out_b = first.wait(60)[0].output_ids, second.wait(60)[0].output_ids
    assert out_a[:12] == alone[0] and out_b == alone[1]
    stats = engine.info()["stats"]
    assert stats["max_requests_per_forward"] >= 2 and stats["prefill_passes"] - before["prefill_passes"] == 2


def test_retract_recomputes_the_kv_cache_under_new_weights_where_in_place_keeps_the_old(tiny_model_dir):
    """SGLang's pause modes across a weight update: retract drops the running rows' KV cache and their prefill
    on continue recomputes it with the new weights, so they go on as a fresh request for prompt + output so
    far would; in_place goes on with the KV cache the old weights computed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    old = [(n, p.detach()) for n, p in model.named_parameters()]
    new = [(n, p + 0.3 * torch.randn(p.shape, generator=gen)) for n, p in old]
    prompt, budget, after = [5, 6, 7, 8, 9], 300, 16
    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=4).start()
    as_fresh = {}
    try:
        for mode in ("in_place", "retract"):
            engine.update_weights_from_tensors(lambda: old)
            request = engine.submit([prompt], SamplingParams(**{**GREEDY, "max_new_tokens": budget}))
            wait_for(lambda: len(request.rows[0].output_ids) >= 4)  # noqa: B023 (called at once)
            engine.pause(mode)
            k = len(request.rows[0].output_ids)  # the tokens sampled under the old weights
            engine.update_weights_from_tensors(lambda: new, abort_all=False)
            engine.resume()
            out = request.wait(60)[0]
            # A fresh request prefills it all: the prefix cache would give it keys the answer's decode computed
            # (equal, but not bit for bit), or in_place's of the old weights.
            engine.flush_cache()
            fresh = run(engine, [prompt + out.output_ids[:k]], **{**GREEDY, "max_new_tokens": after})[0]
            went_on = slice(k, k + after)  # the first tokens after the update
            answer = (out.output_ids[went_on], out.logprobs[went_on])
            as_fresh[mode] = answer == (fresh.output_ids, fresh.logprobs)
    finally:
        engine.stop()
    assert as_fresh == {"in_place": False, "retract": True}


def test_n_samples_share_one_prefill_and_a_seed_fixes_them(engine):
    params = {"max_new_tokens": 6, "n": 3, "sampling_seed": 11, "temperature": 1.0, "ignore_eos": True}
    before = engine.info()["stats"]["prefill_passes"]
    alone = tokens(run(engine, [[3, 4, 5]], **params))
    assert engine.info()["stats"]["prefill_passes"] == before + 1
    assert len({tuple(t) for t in alone}) > 1  # the samples differ
    crowd = engine.submit([[9, 9, 9, 9]], SamplingParams(max_new_tokens=20, n=4))
    again = tokens(run(engine, [[3, 4, 5]], **params))
    crowd.wait(60)
    assert again == alone  # same seed, other batch mates: same samples


def test_stop_token_min_new_tokens_and_zero_budget(engine):
    prompt = [20, 21, 22]
    greedy = tokens(run(engine, [prompt], **GREEDY))[0]
    stop = greedy[1]
    out = run(engine, [prompt], **{**GREEDY, "stop_token_ids": [stop]})[0]
    assert out.output_ids == greedy[: greedy.index(stop) + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    late = run(engine, [prompt], **{**GREEDY, "stop_token_ids": [stop], "min_new_tokens": 5})[0]
    assert stop not in late.output_ids[:5] and len(late.output_ids) >= 5
    empty = run(engine, [prompt], max_new_tokens=0)[0]
    assert empty.output_ids == [] and empty.finish_reason == {"type": "length", "length": 0}


def test_eos_ends_a_row_unless_ignored(engine):
    eos = min(engine.eos_ids)
    prompt = [30, 31]
    first = tokens(run(engine, [prompt], **{**GREEDY, "max_new_tokens": 1}))[0][0]
    engine.eos_ids = frozenset({first})  # pretend the greedy first token is EOS
    try:
        out = run(engine, [prompt], temperature=0.0, max_new_tokens=5)[0]
        ignored = run(engine, [prompt], **{**GREEDY, "max_new_tokens": 5})[0]
    finally:
        engine.eos_ids = frozenset({eos})
    assert out.output_ids == [first] and out.finish_reason == {"type": "stop", "matched": first}
    assert len(ignored.output_ids) == 5 and ignored.finish_reason["type"] == "length"


def test_submit_rejects_bad_input(engine):
    with pytest.raises(RequestError, match="input_ids: token id 5000"):
        engine.submit([[5000]], SamplingParams())
    with pytest.raises(RequestError, match="missing input"):
        engine.submit([[]], SamplingParams())
    held = engine.submit([[1, 2]], SamplingParams(max_new_tokens=200, ignore_eos=True), rid="dup")
    with pytest.raises(RequestError, match="rid: 'dup' is already in use"):
        engine.submit([[1, 2]], SamplingParams(), rid="dup")
    assert engine.abort("dup") == 1 and held.wait(30)[0].finish_reason["type"] == "abort"


def test_sampling_params_validation_names_the_field():
    with pytest.raises(RequestError, match=r"sampling_params.temperature: must be a number >= 0.0"):
        SamplingParams.from_dict({"temperature": -1})
    with pytest.raises(RequestError, match=r"sampling_params.top_k: must be -1"):
        SamplingParams.from_dict({"top_k": 0})
    with pytest.raises(RequestError, match=r"sampling_params.bogus: unsupported"):
        SamplingParams.from_dict({"bogus": 1})
    assert SamplingParams.from_dict({"max_new_tokens": None, "stop_token_ids": [2]}).stop_token_ids == (2,)
    with pytest.raises(RequestError, match=r"sampling_params.stop_token_ids: at most 1024 ids, got 1025"):
        SamplingParams.from_dict({"stop_token_ids": list(range(1025))})  # each step would read them all


def test_a_burst_of_requests_to_an_idle_engine_shares_one_prefill(tiny_model_dir, monkeypatch):
    """A rollout sends its groups together: an idle engine waits until they stop arriving, so they are
    prefilled together and end together (the rollout lasts as long as its last group)."""
    monkeypatch.setattr(engine_module, "SETTLE_QUIET_S", 0.5)  # wide, so a slow CI machine keeps it a burst
    monkeypatch.setattr(engine_module, "SETTLE_MAX_S", 5.0)
    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=4).start()
    try:
        first = engine.submit([[5, 6, 7]], SamplingParams(**GREEDY))
        time.sleep(0.05)  # long enough for an engine that did not wait to prefill the first alone
        second = engine.submit([[8, 9]], SamplingParams(**GREEDY))
        first.wait(60), second.wait(60)
        assert engine.info()["stats"]["prefill_passes"] == 1
    finally:
        engine.stop()


def test_the_engine_records_its_prefills_and_a_decode_span_per_batch(engine, tmp_path):
    """The timeline shows each prefill and one span for each stretch of decode steps at the same rows."""
    timeline.record(tmp_path / "gen_server0.jsonl")
    try:
        run(engine, [[5, 6, 7]], **{**GREEDY, "n": 2})
    finally:
        timeline.stop()
    events = [json.loads(line) for line in (tmp_path / "gen_server0.jsonl").read_text().splitlines()]
    prefills = [e for e in events if e["name"] == "prefill"]
    decodes = [e for e in events if e["name"] == "decode"]
    assert [(e["rows"], e["tokens"]) for e in prefills] == [(2, 3)]
    # The prefill samples each row's first token; 11 decode steps at 2 rows sample the rest.
    assert [(e["rows"], e["steps"]) for e in decodes] == [(2, 11)]
    assert decodes[0]["ts"] >= prefills[0]["ts"] + prefills[0]["dur"] and decodes[0]["dur"] > 0
