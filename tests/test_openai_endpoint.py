"""The OpenAI-compatible endpoint with the real `openai` SDK as the client: agents written only against the SDK
run as episodes on a real built-in server, their calls recorded token for token; bad requests get the SDK's
errors; streaming, completions and the model list work as the SDK expects."""

from __future__ import annotations

import dataclasses

import openai
import pytest

from areal_hpc.agent import content_of
from areal_hpc.gen.agents import function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episode import cut_text, stop_length
from areal_hpc.gen.episodes import run_group
from areal_hpc.gen.journal import Journals, read_entries
from tests.plugins import sdk_agents
from tests.test_episodes import PARAMS, RECORD, services


@pytest.fixture
def endpoint():
    endpoint = Endpoint("policy")
    yield endpoint
    endpoint.shutdown()


def run_agent(agent, client, services, endpoint, group_size=2, timeout=60):
    return run_group(services, function_agent(agent, endpoint), client, RECORD, PARAMS, group_size, timeout)


def test_an_sdk_agent_s_turns_are_recorded_as_the_ids_the_server_sampled(
    builtin_client, tiny_tokenizer, endpoint, tmp_path
):
    svc = services(tiny_tokenizer)
    svc.journals = Journals(tmp_path)
    sdk_agents.SEEN.clear()
    result = run_agent(sdk_agents.three_turns, builtin_client, svc, endpoint)
    # Three chat calls an episode, each extending the last: one trajectory, no break, the SDK's own message
    # objects sent back as they came.
    assert result.counts["turns"] == 6 and result.counts["breaks"] == 0
    seen = [
        [(r.choices[0].message.content or "", r.usage.completion_tokens) for r in rs]
        for rs in sdk_agents.SEEN.values()
    ]
    for index, samples in enumerate(result.samples):
        (sample,) = samples
        trained = [not masked for masked in sample.prompt_mask]
        entries, _ = read_entries(Journals(tmp_path).group(0, RECORD.query_id) / f"{index}.jsonl")
        # What is trained is what the server returned: its ids and its logprobs.
        assert [i for i, t in zip(sample.ids, trained, strict=True) if t] == [
            t for e in entries for t in e.ids
        ]
        assert [lp for lp, t in zip(sample.logprobs, trained, strict=True) if t] == [
            lp for e in entries for lp in e.logprobs
        ]
        # And the agent got those ids' text, its tool calls parsed out.
        texts = [tiny_tokenizer.decode(e.ids, skip_special_tokens=True) for e in entries]
        assert [(content_of(text), len(e.ids)) for text, e in zip(texts, entries, strict=True)] in seen


def test_a_malformed_request_a_wrong_key_and_an_unknown_model_get_the_sdk_s_errors_and_the_episode_goes_on(
    builtin_client,
    tiny_tokenizer,
    endpoint,
):
    sdk_agents.SEEN.clear()
    result = run_agent(sdk_agents.asks_wrongly_then_right, builtin_client, services(tiny_tokenizer), endpoint)
    assert result.rewards == [1.0, 1.0] and result.counts["turns"] == 2
    for errors in sdk_agents.SEEN.values():
        assert errors == ["BadRequestError", "AuthenticationError", "NotFoundError"]


async def sdk_tour(base_url, api_key, record, out: dict):
    """The model list, a streamed chat, a refused option, and two completions, the second extending the first."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    out["models"] = [m.id for m in (await client.models.list()).data]
    messages = [{"role": "user", "content": record.prompt}]
    stream = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    out["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    out["usage"] = chunks[-1].usage.completion_tokens
    big = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=500, stop=["zzz"]
    )
    out["capped"] = big.usage.completion_tokens
    try:
        await client.chat.completions.create(model="policy", messages=messages, tool_choice="required")
    except openai.BadRequestError as exc:
        out["refused"] = exc.body["param"]
    first = await client.completions.create(model="policy", prompt="12 + 30 =", max_tokens=6, temperature=0)
    second = await client.completions.create(
        model="policy", prompt="12 + 30 =" + first.choices[0].text + " so", max_tokens=6, temperature=0
    )
    out["completions"] = [first.choices[0].text, second.usage.prompt_tokens]


def test_streaming_completions_and_the_model_list_speak_the_sdk_s_protocol(
    builtin_client, tiny_tokenizer, endpoint
):
    seen = {}

    async def tour(base_url, api_key, record):
        await sdk_tour(base_url, api_key, record, seen)
        return 1.0

    result = run_agent(tour, builtin_client, services(tiny_tokenizer), endpoint, group_size=1)
    assert seen["models"] == ["policy"] and seen["refused"] == "tool_choice"
    assert seen["capped"] <= PARAMS["max_new_tokens"]  # max_tokens is bounded by the run's
    assert len(seen["finish"]) == 1 and seen["finish"][0] in ("stop", "length") and seen["usage"] >= 1
    (samples,) = result.samples
    # The stream's trajectory, then the completions': the second prompt extended the first prompt and its
    # completion, so only " so" was appended (one trajectory for the two).
    assert result.counts["turns"] == 4 and result.counts["breaks"] == 2
    streamed, _, completions = samples
    first_ids = tiny_tokenizer.encode("12 + 30 =")
    assert list(completions.ids[: len(first_ids)]) == first_ids
    assert tiny_tokenizer.decode(list(streamed.ids), skip_special_tokens=True).endswith(seen["streamed"])


def test_the_endpoint_refuses_what_it_cannot_honour_naming_the_field():
    from areal_hpc.agent.openai_api import ApiError, parse_chat

    base = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ]:
        with pytest.raises(ApiError) as caught:
            parse_chat({**base, **extra}, "policy")
        assert caught.value.status == 400 and caught.value.param == param
    # null is unset, as in OpenAI's API; the SDK's echoed reply fields are accepted empty.
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
            }
        ],
    }
    request = parse_chat({**base, "messages": [base["messages"][0], echoed], "temperature": None}, "policy")
    assert request.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
            }
        ],
    }
    assert request.sampling == {}


class Counting:
    """A generation client that counts the requests it sends (the real client does the work)."""

    def __init__(self, client):
        self.client, self.requests = client, 0

    def generate(self, *args, **kwargs):
        self.requests += 1
        return self.client.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


async def three_turns_then_other(base_url, api_key, record):
    """three_turns, but its second tool answer differs from the first run's."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": record.prompt}]
    for turn in range(3):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[sdk_agents.CALCULATOR], max_tokens=12
        )
        messages += [
            response.choices[0].message,
            {"role": "tool", "tool_call_id": "c", "content": f"x{turn}"},
        ]
    return 1.0


def test_a_restarted_episode_is_answered_from_its_journal_up_to_its_last_recorded_turn(
    builtin_client,
    tiny_tokenizer,
    endpoint,
    tmp_path,
):
    svc = services(tiny_tokenizer)
    svc.journals = Journals(tmp_path)
    first = run_agent(sdk_agents.three_turns, builtin_client, svc, endpoint)
    journals = sorted(Journals(tmp_path).group(0, RECORD.query_id).glob("*.jsonl"))
    assert len(journals) == 2 and all(len(read_entries(p)[0]) == 3 for p in journals)

    # Restarted with every turn recorded: no request reaches a server, and the samples are the same.
    counting = Counting(builtin_client)
    again = run_agent(sdk_agents.three_turns, counting, svc, endpoint)
    assert counting.requests == 0 and again.counts["replayed_turns"] == 6
    assert _samples(again) == _samples(first)

    # Cut after each episode's first turn, the last line torn by the crash: two turns of each are generated.
    recorded = [read_entries(path)[0][0] for path in journals]
    for path in journals:
        lines = path.read_bytes().split(b"\n")
        path.write_bytes(lines[0] + b"\n" + lines[1][:20])
    counting = Counting(builtin_client)
    resumed = run_agent(sdk_agents.three_turns, counting, svc, endpoint)
    assert counting.requests == 4 and resumed.counts["replayed_turns"] == 2
    for path, entry in zip(journals, recorded, strict=True):
        entries, _ = read_entries(path)
        assert len(entries) == 3 and entries[0] == entry  # the torn line gave way to the new turns

    # An agent that asks something else at its second request: the first is replayed, the rest generated live
    # and the journal cut there (a warning says so).
    counting = Counting(builtin_client)
    other = run_agent(three_turns_then_other, counting, svc, endpoint)
    assert counting.requests == 4 and other.counts["replayed_turns"] == 2
    assert other.counts["replay_mismatches"] == 2  # one an episode
    assert all(len(read_entries(p)[0]) == 3 for p in journals)


def _samples(result) -> list[tuple]:
    return [(list(s.ids), list(s.logprobs), list(s.versions)) for samples in result.samples for s in samples]


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(tiny_tokenizer):
    ids = tiny_tokenizer.encode("12 + 30 = 42 and 7 * 6 = 42")
    k = stop_length(tiny_tokenizer, ids, ["and", "never"])
    assert "and" in tiny_tokenizer.decode(ids[:k]) and "and" not in tiny_tokenizer.decode(ids[: k - 1])
    assert stop_length(tiny_tokenizer, ids, ["never"]) is None
    assert cut_text("12 + 30 = 42 and 7", ["and", " 30"]) == "12 +"  # before the first of them, as OpenAI


async def one_short_call(base_url, api_key, record):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
    return 1.0


def test_hundreds_of_episodes_connect_at_once(builtin_client, tiny_tokenizer, endpoint):
    # A rollout has every episode of every group in flight: they all reach the endpoint together.
    result = run_agent(one_short_call, builtin_client, services(tiny_tokenizer), endpoint, group_size=200)
    assert result.rewards == [1.0] * 200


@pytest.mark.parametrize("agent", [sdk_agents.sync_three_turns, sdk_agents.async_but_blocking])
def test_an_agent_that_blocks_stalls_nothing_but_itself(builtin_client, tiny_tokenizer, endpoint, agent):
    """A plain function with the blocking client, and an async one that blocks its loop: each runs in a thread
    of its own, so the endpoint still serves the episode's calls (before, they hung until their timeout)."""
    result = run_agent(agent, builtin_client, services(tiny_tokenizer), endpoint, timeout=30)
    assert result.counts["turns"] == 6 and result.counts["breaks"] == 0
    assert [r for r in result.rewards] == [1.0, 1.0]


def test_the_responses_api_continues_an_episode_by_its_items_or_by_previous_response_id(
    builtin_client, tiny_tokenizer, endpoint
):
    """Two episodes with the SDK's responses.create: one sends back the output items it got, the other names
    the previous response; both continue their one sample, and fields it cannot honour get 400s by name."""
    errors = []

    async def agent(base_url, api_key, record):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            first = await client.responses.create(model="policy", input=record.prompt, max_output_tokens=8)
            more = [{"role": "user", "content": "And then?"}]
            if record.prompt.endswith("?"):  # episode 0: the items, sent back
                items = [{"role": "user", "content": record.prompt}, *[o.model_dump() for o in first.output]]
                await client.responses.create(model="policy", input=items + more, max_output_tokens=8)
            else:
                await client.responses.create(
                    model="policy", input=more, previous_response_id=first.id, max_output_tokens=8
                )
            for bad in (
                {"stream": True},
                {"reasoning": {"effort": "high"}},
                {"previous_response_id": "resp_x"},
                {"input": [{"type": "web_search_call"}]},
                {"input": ["text"]},
                {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                {"tools": [{"type": "web_search"}]},
                {"instructions": ["a"]},
                {"prompt_cache_key": "k"},
                {"text": {"format": {"type": "xml"}}},
            ):
                try:
                    await client.responses.create(model="policy", **{"input": "Hi", **bad})
                except openai.BadRequestError as exc:
                    errors.append(exc.body["message"].split(":")[0])
        return 1.0

    for prompt in ("What is 47 * 38?", "What is 47 * 38"):
        record = dataclasses.replace(RECORD, prompt=prompt)
        result = run_group(services(tiny_tokenizer), function_agent(agent, endpoint), builtin_client, record,
                           PARAMS, 1, 60)  # fmt: skip
        assert (result.counts["turns"], result.counts["breaks"]) == (2, 0)
    refused = ["stream", "reasoning", "previous_response_id", "input[0]", "input[0]", "input[0].content",
               "tools[0]", "instructions", "Unrecognized request argument supplied", "text.format"]  # fmt: skip
    assert errors == refused * 2  # each names its field; the episode goes on after them
