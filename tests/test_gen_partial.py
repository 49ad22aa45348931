"""Interruptible generation: answers continued across weight updates keep tokens and logprobs aligned."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.control.manifest import write_manifest
from areal_hpc.gen.client import GenClient
from areal_hpc.gen.partial import (
    ABORT,
    Part,
    answers_of,
    cache_counts,
    cache_stats,
    continuation_params,
    continuation_seed,
    extend,
    from_response,
    generate_group,
    version_of,
)

PROMPT = [5, 9, 2, 7]
PARAMS = {"n": 3, "max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}


@pytest.fixture
def client(builtin_client):
    """A built-in server (engine + HTTP on a thread of this process) on the tiny model (conftest)."""
    return builtin_client


def perturbed(model_dir, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def wait_generating(client: GenClient, more_than: int) -> int:
    deadline = time.monotonic() + 60
    while (tokens := client.server_info()["stats"].get("generated_tokens", 0)) <= more_than:
        assert time.monotonic() < deadline, "the server generates nothing"
        time.sleep(0.01)
    return tokens


def test_a_group_spanning_three_weight_versions_has_aligned_tokens_and_logprobs(
    client, tiny_model_dir, tmp_path
):
    models = [
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        perturbed(tiny_model_dir, 1),
        perturbed(tiny_model_dir, 2),
    ]
    for version in (1, 2):
        models[version].save_pretrained(tmp_path / f"v{version}")
        write_manifest(tmp_path / f"v{version}")  # a snapshot the server accepts
    box: list = []
    worker = threading.Thread(target=lambda: box.append(generate_group(client, PROMPT, PARAMS)), daemon=True)
    worker.start()
    seen = wait_generating(client, 0)
    for version in (1, 2):  # two updates while the answers are being written
        client.update_weights_from_disk(str(tmp_path / f"v{version}"), weight_version=version)
        seen = wait_generating(client, seen + 3 * 10)
    worker.join(120)
    (answers,) = box
    assert len(answers) == 3
    for answer in answers:
        assert (answer.version_start, answer.version_end) == (0, 2) and answer.n_parts >= 2
        assert all(p.first == p.last for p in answer.parts)  # aborted parts: each of one version
        versions = [p.last for p in answer.parts]
        assert versions == sorted(set(versions))  # one part per version
        assert len(answer.output_ids) == len(answer.logprobs) == PARAMS["max_new_tokens"]
        assert sum(p.tokens for p in answer.parts) == PARAMS["max_new_tokens"] and answer.finish == "length"
        # Each part's logprobs are those of its tokens under the weights that generated it.
        ids = torch.tensor([PROMPT + list(answer.output_ids)])
        start = 0
        for length, version, _ in answer.parts:
            with torch.no_grad():
                logits = models[version](ids).logits[
                    0, len(PROMPT) - 1 + start : len(PROMPT) - 1 + start + length
                ]
            expected = torch.log_softmax(logits.float(), -1).gather(
                1, ids[0, len(PROMPT) + start :][:length, None]
            )
            got = torch.tensor(answer.logprobs[start : start + length])
            torch.testing.assert_close(got, expected[:, 0], atol=2e-3, rtol=0)
            start += length


def test_a_continuation_asks_for_the_rest_of_the_budget_with_a_seed_of_its_own():
    from areal_hpc.gen.partial import PartialAnswer

    half = PartialAnswer((1, 2, 3), (-0.1, -0.2, -0.3), "abort", 0, 0, (Part(3, 0, 0),))
    params = {"n": 4, "max_new_tokens": 10, "min_new_tokens": 5, "sampling_seed": 7}
    assert continuation_params(params, half, index=2) == {
        "n": 1, "max_new_tokens": 7, "min_new_tokens": 2, "sampling_seed": continuation_seed(7, 2, 3),
    }  # fmt: skip


def test_continuation_seeds_never_meet_a_siblings_seed_or_each_other():
    # A request's n answers take seeds seed + j; seed + 1000 * index + done gave answer 0's part after one
    # token the seed of answer 1, so both drew the same random numbers.
    from areal_hpc.gen.partial import PartialAnswer

    params = {"n": 4, "max_new_tokens": 600, "sampling_seed": 7}
    siblings = {7 + j for j in range(params["n"])}
    seeds = [
        continuation_params(params, PartialAnswer((1,) * done, (0.0,) * done, "abort", 0, 0), index)[
            "sampling_seed"
        ]
        for index in range(params["n"])
        for done in range(params["max_new_tokens"])
    ]
    assert len(set(seeds)) == len(seeds) and not siblings & set(seeds)
    assert all(2**62 <= s < 2**63 for s in seeds)  # an int64 on the server


def test_without_interruption_an_update_waits_for_running_answers(client, tiny_model_dir, tmp_path):
    perturbed(tiny_model_dir, 1).save_pretrained(tmp_path / "v1")
    write_manifest(tmp_path / "v1")
    box: list = []
    params = {**PARAMS, "n": 2, "max_new_tokens": 300}
    worker = threading.Thread(target=lambda: box.append(generate_group(client, PROMPT, params)), daemon=True)
    worker.start()
    wait_generating(client, 0)
    client.update_weights_from_disk(str(tmp_path / "v1"), weight_version=1, abort_all_requests=False)
    worker.join(30)
    (answers,) = box  # finished on the old weights, never interrupted
    assert all((a.version_start, a.version_end, a.n_parts, a.finish) == (0, 0, 1, "length") for a in answers)
    assert client.generate(PROMPT, {"max_new_tokens": 2})[0]["meta_info"]["weight_version"] == "1"


def test_an_answer_paused_in_place_across_an_update_starts_at_the_version_it_was_sent_under(
    client, tiny_model_dir, tmp_path
):
    # Not interruptible: the publisher pauses answers in place and they go on under the new weights. The
    # server then reports only version 1, at their end; their first tokens were sampled under version 0.
    perturbed(tiny_model_dir, 1).save_pretrained(tmp_path / "v1")
    write_manifest(tmp_path / "v1")
    box: list = []
    params = {**PARAMS, "n": 2}
    worker = threading.Thread(
        target=lambda: box.append(generate_group(client, PROMPT, params, min_version=0)), daemon=True
    )
    worker.start()
    wait_generating(client, 0)
    client.pause_generation("in_place")
    paused_at = client.server_info()["stats"]["generated_tokens"]
    client.update_weights_from_disk(str(tmp_path / "v1"), weight_version=1, abort_all_requests=False)
    client.continue_generation()
    worker.join(120)
    (answers,) = box
    assert paused_at < 2 * params["max_new_tokens"]  # paused while the answers were being written
    for answer in answers:
        assert (answer.version_start, answer.version_end, answer.finish) == (0, 1, "length")
        # One request, its tokens sampled under versions 0 then 1, the split unknown to the client.
        assert answer.parts == (Part(params["max_new_tokens"], 0, 1),)


def test_weight_versions_are_read_from_sglang_string_labels():
    assert [version_of(label) for label in ("0", "7", "default", None)] == [0, 7, 0, 0]
    with pytest.raises(ValueError, match="'v7' is not a label this run gives its weights"):
        version_of("v7")


def test_a_request_aborted_in_the_waiting_queue_is_an_empty_part_to_continue():
    # SGLang's answer to a request aborted before it ran: no tokens, no logprobs, no prompt_tokens.
    meta = {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "weight_version": "3"}
    part = from_response({"output_ids": [], "meta_info": meta})
    assert part.interrupted and part.output_ids == () and part.version_start == 3


def answer(ids: list[int], finish: str, **meta) -> dict:
    """A /generate response object for ``ids``, with the extra meta_info fields ``meta``."""
    logprobs = [[-0.5, t, None] for t in ids]
    info = {"finish_reason": {"type": finish}, "weight_version": "0", "output_token_logprobs": logprobs}
    return {"output_ids": ids, "meta_info": info | meta}


def test_an_answer_counts_its_prompt_tokens_and_those_the_server_had_cached():
    part = from_response(answer([7], "stop", cached_tokens=3), prompt_tokens=4)
    assert (part.prompt_tokens, part.cached_tokens) == (4, 3)
    # An older server does not report cached_tokens: it cached nothing we know of.
    assert from_response(answer([7], "stop"), prompt_tokens=4).cached_tokens == 0
    # answers_of takes the prompt tokens from the ids it sent.
    answers = answers_of(None, [answer([7], "stop", cached_tokens=c) for c in (0, 3)], PROMPT, {})
    assert [(a.prompt_tokens, a.cached_tokens) for a in answers] == [(4, 0), (4, 3)]


def test_an_answer_of_several_parts_sums_their_counts_and_counts_a_request_a_part():
    first = from_response(answer([7], ABORT, cached_tokens=0), prompt_tokens=4)
    queued = from_response(answer([], ABORT), prompt_tokens=5)  # aborted while queued: sent, nothing cached
    last = from_response(answer([8, 9], "stop", cached_tokens=5), prompt_tokens=5)
    whole = extend(extend(first, queued), last)
    assert (whole.n_parts, whole.prompt_tokens, whole.cached_tokens) == (3, 14, 5)
    single = from_response(answer([7], "stop", cached_tokens=4), prompt_tokens=4)
    counts = cache_counts([whole, single])
    assert counts == {"requests": 4, "prompt_tokens": 18, "cached_tokens": 9}
    assert cache_stats(counts) == {
        "rollout/cached_tokens_per_request": 9 / 4,
        "rollout/cached_token_ratio": 9 / 18,
    }
    # Nothing sent (or a group's file written before the counts): 0, not a division by zero.
    assert set(cache_stats({}).values()) == {0.0}
