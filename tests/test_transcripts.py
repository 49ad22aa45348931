"""What an agent's trainer sees: each kept episode's transcript (what the agent sent and got back, as the endpoint
saw it), its tool use counted per tool, and `areal-hpc episodes` printing them."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import openai
import pytest

from areal_hpc.agent import tool_stats
from areal_hpc.agent.trajectory import NOT_SAMPLED
from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control import RunDir
from areal_hpc.control.rundir import create_run_dir
from areal_hpc.gen.agents import function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episode import EpisodeContext
from areal_hpc.gen.transcript import TEXT_CHARS, keep_group
from areal_hpc.monitor import TranscriptLog, read_transcripts, transcript_steps
from areal_hpc.monitor.episodes import format_episode
from tests.plugins.sdk_agents import CALCULATOR
from tests.test_episodes import PARAMS, RECORD, services, two_turns

CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


@pytest.fixture
def endpoint():
    endpoint = Endpoint("policy")
    yield endpoint
    endpoint.shutdown()


def run_episodes(svc, workflow, client, group_size: int = 1) -> list:
    """The episodes of RECORD's group, side by side, their transcripts kept as a rollout keeps a finished
    group's (gen.transcript.keep_group); their rewards."""
    contexts = [EpisodeContext(svc, client, RECORD, PARAMS, i) for i in range(group_size)]

    async def episodes() -> list:
        return await asyncio.gather(*(workflow(ctx, RECORD) for ctx in contexts))

    rewards = asyncio.run(episodes())
    keep_group(svc.transcripts, contexts, rewards)
    return rewards


class ScriptedModel:
    """A generation server's client whose model writes ``texts``, one a request, each ended by its end-of-turn
    token, under weight version 3: the tiny model writes no tool calls, this one writes what a test needs."""

    where = "a scripted model"

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, list(texts)

    def generate(self, input_ids, sampling_params=None, rid=None, stop=None) -> list[dict]:
        text = self.texts.pop(0)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "weight_version": "3"}  # fmt: skip
        return [{"output_ids": ids, "meta_info": meta}]

    def context_length(self) -> None:
        return None

    def abort_request(self, rid) -> dict:
        return {}


# --- transcripts ------------------------------------------------------------------------------------------


def test_an_sdk_agent_s_transcript_is_what_it_sent_and_what_it_got_back(
    builtin_client, tiny_tokenizer, endpoint, tmp_path
):
    sent, got = [], []

    async def agent(base_url, api_key, record):
        """Three chats, the third starting over, then a completion: each request and answer noted."""
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": record.prompt},
            ]
            for turn in range(3):
                if turn == 2:
                    messages = [{"role": "user", "content": "Once more: " + record.prompt}]
                response = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=8
                )
                reply = response.choices[0]
                sent.append(list(messages))
                got.append((reply.message.content, reply.finish_reason, response.usage))
                messages.append({"role": "assistant", "content": reply.message.content})
                messages.append({"role": "user", "content": f"And {turn}?"})
            completion = await client.completions.create(model="policy", prompt="12 + 30 =", max_tokens=6)
            got.append((completion.choices[0].text, completion.choices[0].finish_reason, completion.usage))
        return 0.5

    svc = services(tiny_tokenizer)
    svc.transcripts = TranscriptLog(RunDir(tmp_path), groups=2)
    assert run_episodes(svc, function_agent(agent, endpoint), builtin_client) == [0.5]

    (episode,) = read_transcripts(RunDir(tmp_path), step=1)  # the server's weights are version 0
    assert (episode["query_id"], episode["epoch"], episode["episode"], episode["reward"]) == ("q1", 0, 0, 0.5)
    assert episode["stats"]["turns"] == 4 and episode["stats"]["breaks"] == 2
    *chats, completion = episode["turns"]
    conversation: list[dict] = []
    for turn, messages, (content, finish, usage) in zip(chats, sent, got[:3], strict=True):
        conversation = (conversation if turn["continues"] else []) + turn["messages"]
        assert conversation == messages  # only the messages new to the turn are kept, all when it starts over
        assert turn["reply"] == {"role": "assistant", "content": content}
        assert (turn["finish"], turn["prompt_tokens"], turn["completion_tokens"], turn["version"]) == (
            finish, usage.prompt_tokens, usage.completion_tokens, 0,
        )  # fmt: skip
        conversation.append(turn["reply"])
    assert [t["continues"] for t in chats] == [False, True, False]
    text, finish, usage = got[-1]
    assert completion["prompt"] == "12 + 30 =" and completion["text"] == text
    assert (completion["finish"], completion["completion_tokens"]) == (finish, usage.completion_tokens)


def test_the_first_groups_of_each_step_are_kept_and_a_torn_line_is_skipped(tmp_path):
    run = RunDir(tmp_path)
    log = TranscriptLog(run, groups=2)
    # The step of a group is 1 + the weight version of its first token; one that sampled none goes with the newest.
    assert [log.admit(version) for version in (0, 0, 0, 1, None, None)] == [1, 1, None, 2, 2, None]
    log.write(1, [{"query_id": "a", "epoch": 0, "episode": 0}, {"query_id": "a", "epoch": 0, "episode": 1}])
    with open(run.transcript(1), "ab") as f:
        f.write(b'{"query_id": "b", "epo')  # a crash in the middle of a write
    log.write(1, [{"query_id": "c", "epoch": 0, "episode": 0}])
    assert [e["query_id"] for e in read_transcripts(run, 1)] == ["a", "a", "c"]
    assert transcript_steps(run) == [1] and read_transcripts(run, 7) == []
    # A restarted rollout counts the groups its step already holds: step 1 has its two.
    assert TranscriptLog(run, groups=2).admit(0) is None


# --- tool use ---------------------------------------------------------------------------------------------

CALLS = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "47 * 38"}}</tool_call>\n'
    '<tool_call>{"name": "clock", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +</tool_call>\n'
    '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'
)
ANSWER = "The product is \\boxed{1786}."


async def two_tools(base_url, api_key, record):
    """Offers a calculator and a clock, answers each call the model makes, asks again."""
    answers = {"calculator": "1786", "clock": "the " * 1100}  # a long answer
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for _ in range(2):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR, CLOCK]
            )
            message = response.choices[0].message
            messages.append(message)
            for call in message.tool_calls or []:
                answer = answers.get(call.function.name, f"Error: no tool {call.function.name}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return float("1786" in message.content)


def test_an_sdk_agent_s_tool_calls_and_results_are_counted_per_tool(tiny_tokenizer, endpoint, tmp_path):
    svc = services(tiny_tokenizer)
    svc.transcripts = TranscriptLog(RunDir(tmp_path), groups=1)
    model = ScriptedModel(tiny_tokenizer, [CALLS, ANSWER])
    assert run_episodes(svc, function_agent(two_tools, endpoint), model) == [1.0]
    (episode,) = read_transcripts(RunDir(tmp_path), step=4)  # weight version 3
    counts = episode["stats"]
    # Four calls: two it offered, one the endpoint could not read and one to a tool it did not offer (errors);
    # the agent answered the three it got.
    assert (counts["tool_calls"], counts["tool_errors"], counts["tool_results"]) == (4, 2, 3)
    assert {k: v for k, v in counts.items() if "/" in k} == {
        "tool_calls/calculator": 1, "tool_calls/clock": 1, "tool_results/calculator": 1, "tool_results/clock": 1,
    }  # fmt: skip
    assert tool_stats(counts, episodes=2) == {
        "rollout/tool_results_per_episode": 1.5,
        "rollout/tool_calls_per_episode/calculator": 0.5,
        "rollout/tool_calls_per_episode/clock": 0.5,
        "rollout/tool_results_per_episode/calculator": 0.5,
        "rollout/tool_results_per_episode/clock": 0.5,
    }


def test_a_transcript_shows_the_calls_the_model_garbled_and_cuts_long_texts(
    tiny_tokenizer, endpoint, tmp_path
):
    svc = services(tiny_tokenizer)
    svc.transcripts = TranscriptLog(RunDir(tmp_path), groups=1)
    run_episodes(svc, function_agent(two_tools, endpoint), ScriptedModel(tiny_tokenizer, [CALLS, ANSWER]))
    (episode,) = read_transcripts(RunDir(tmp_path), step=4)
    first, second = episode["turns"]
    assert [c["function"]["name"] for c in first["reply"]["tool_calls"]] == ["calculator", "clock", "weather"]
    assert first["reply"]["tool_calls"][0]["function"]["arguments"] == '{"expression": "47 * 38"}'
    (garbled,) = first["malformed_calls"]
    assert garbled.startswith("not JSON") and first["text"] == CALLS  # the model's whole text
    calculator, clock, weather = second["messages"]  # new to the turn: the agent's answers
    assert second["continues"] and (calculator["tool_call_id"], calculator["content"]) == ("call_0", "1786")
    assert clock["content"] == ("the " * 1100)[:TEXT_CHARS] + f"[cut: {4400 - TEXT_CHARS} more characters]"
    assert weather == {"role": "tool", "content": "Error: no tool weather", "tool_call_id": "call_3"}
    assert second["reply"]["content"] == ANSWER and (second["version"], second["finish"]) == (3, "stop")


def test_the_sdk_s_request_lines_stay_out_of_the_log(tiny_tokenizer, endpoint, caplog):
    caplog.set_level(logging.INFO)
    svc = services(tiny_tokenizer)
    contexts = [EpisodeContext(svc, ScriptedModel(tiny_tokenizer, [ANSWER, ANSWER]), RECORD, PARAMS, 0)]
    asyncio.run(function_agent(two_tools, endpoint)(contexts[0], RECORD))
    assert contexts[0].counts["turns"] == 2
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


# --- areal-hpc episodes -----------------------------------------------------------------------------------


def test_areal_hpc_episodes_prints_a_workflow_s_episodes(builtin_client, tiny_tokenizer, tmp_path, capsys):
    run = create_run_dir(load_config(overrides=[f"cluster.fileroot={tmp_path}", "trial_name=t1"]))
    svc = services(tiny_tokenizer)
    svc.transcripts = TranscriptLog(run, groups=1)
    run_episodes(svc, two_turns, builtin_client, group_size=2)

    assert main(["episodes", str(run.root)]) == 0  # the newest step's
    out = capsys.readouterr().out
    assert out.count("=== step 1 | prompt q1 (epoch 0) | episode ") == 2
    assert "[user]\n  What is 47 * 38?" in out and "[tool | calculator]\n  1786" in out
    assert re.search(r"\[assistant \| \d+ \+ \d+ tokens, (stop|length), weights v0\]", out)

    assert main(["episodes", str(run.root), "--step", "1", "--json"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == read_transcripts(run, 1)
    assert main(["episodes", str(run.root), "--prompt", "q2"]) == 1
    assert "no episodes of prompt 'q2' in step 1; steps with transcripts: 1" in capsys.readouterr().err


def test_printed_texts_reach_the_terminal_with_their_control_characters_escaped():
    episode = {"step": 1, "query_id": "q\x1b]0;title\x07", "turns": [
        {"continues": False, "messages": [{"role": "user", "content": "hi\x1b[2J\nthere"}],
         "reply": {"role": "assistant", "content": "\u202eevil"}, "finish": "stop", "version": 0},
    ]}  # fmt: skip
    text = format_episode(episode)
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "q\\x1b]0;title\\x07" in text and "  hi\\x1b[2J\n  there" in text and "\\u202eevil" in text


def test_parallel_tool_calls_false_returns_a_turns_first_call_and_trains_all_it_sampled(
    tiny_tokenizer, endpoint, tmp_path
):
    got = []  # the calls of each reply

    async def one_call_at_a_time(base_url, api_key, record):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": record.prompt}]
            for _ in range(2):
                response = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[CALCULATOR, CLOCK], parallel_tool_calls=False
                )
                message = response.choices[0].message
                messages.append(message)
                got.append([call.function.name for call in message.tool_calls or []])
                for call in message.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "1786"})
        return 1.0

    svc = services(tiny_tokenizer)
    svc.transcripts = TranscriptLog(RunDir(tmp_path), groups=1)
    contexts = [EpisodeContext(svc, ScriptedModel(tiny_tokenizer, [CALLS, ANSWER]), RECORD, PARAMS, 0)]
    assert asyncio.run(function_agent(one_call_at_a_time, endpoint)(contexts[0], RECORD)) == 1.0
    assert got == [["calculator"], []]
    counts = contexts[0].counts
    assert (counts["cut_tool_calls"], counts["tool_results"], counts["breaks"]) == (3, 1, 0)
    (traj,) = contexts[0].trajectories  # one sample: the whole first turn, all four calls, trained as sampled
    first = traj.turns[0]
    assert tiny_tokenizer.decode(traj.ids[first.start : first.end], skip_special_tokens=True) == CALLS


class RecordingModel(ScriptedModel):
    """A ScriptedModel that keeps the ids of each request (of its one prompt)."""

    def __init__(self, tokenizer, texts):
        super().__init__(tokenizer, texts)
        self.inputs, self.params = [], []

    def generate(self, input_ids, *args, **kwargs):
        (ids,) = input_ids
        self.inputs.append(list(ids))
        self.params.append(args[0] if args else kwargs.get("sampling_params"))
        return super().generate(input_ids, *args, **kwargs)


@pytest.mark.parametrize(
    "choice, opening, written",
    [
        ("required", '<tool_call>\n{"name": "', 'clock", "arguments": {}}\n</tool_call>'),
        ({"type": "function", "function": {"name": "calculator"}}, '<tool_call>\n{"name": "calculator", '
         '"arguments": ', '{"expression": "6 * 7"}}\n</tool_call>'),
    ],
    ids=["required", "named"],
)  # fmt: skip
def test_a_forced_tool_choice_opens_the_call_for_the_model_and_trains_only_what_it_wrote(
    tiny_tokenizer, endpoint, choice, opening, written
):
    got = []

    async def forced(base_url, api_key, record):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": record.prompt}]
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR, CLOCK], tool_choice=choice
            )
            got.append(response.choices[0])
        return 1.0

    svc, model = services(tiny_tokenizer), RecordingModel(tiny_tokenizer, [written])
    (ctx,) = [EpisodeContext(svc, model, RECORD, PARAMS, 0)]
    assert asyncio.run(function_agent(forced, endpoint)(ctx, RECORD)) == 1.0
    (choice_out,) = got
    assert choice_out.finish_reason == "tool_calls"
    ((call_name, arguments),) = [
        (c.function.name, c.function.arguments) for c in choice_out.message.tool_calls
    ]
    assert call_name == ("clock" if choice == "required" else "calculator")
    # The model was asked to go on from the call's opening; the opening is context, not trained.
    forced_ids = tiny_tokenizer.encode(opening, add_special_tokens=False)
    assert model.inputs[0][-len(forced_ids) :] == forced_ids
    (traj,) = ctx.trajectories
    (turn,) = traj.turns
    assert traj.ids[turn.start - len(forced_ids) : turn.start] == forced_ids
    assert set(traj.versions[turn.start - len(forced_ids) : turn.start]) == {NOT_SAMPLED}  # loss mask 0
    assert tiny_tokenizer.decode(traj.ids[turn.start : turn.end], skip_special_tokens=True) == written
    assert ctx.counts["forced_turns"] == 1


def test_a_named_tool_choice_must_name_one_of_the_tools(tiny_tokenizer, endpoint):
    errors = []

    async def asks(base_url, api_key, record):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": record.prompt}]
            for choice, tools in ((({"type": "function", "function": {"name": "weather"}}), [CALCULATOR]),
                                  ("required", None), ("any", [CALCULATOR])):  # fmt: skip
                try:
                    await client.chat.completions.create(
                        model="policy", messages=messages, tools=tools, tool_choice=choice
                    )
                except openai.BadRequestError as exc:
                    errors.append(exc.body["message"])
        return 1.0

    ctx = EpisodeContext(services(tiny_tokenizer), ScriptedModel(tiny_tokenizer, []), RECORD, PARAMS, 0)
    asyncio.run(function_agent(asks, endpoint)(ctx, RECORD))
    assert errors[0].startswith("tool_choice: a named choice is") and "['calculator']" in errors[0]
    assert errors[1] == "tool_choice: 'required' needs tools to call"
    assert errors[2] == "tool_choice: must be 'auto', 'none', 'required' or a named function"


def test_response_format_asks_the_server_for_its_grammar_and_the_built_in_engine_refuses_by_name(
    builtin_client, tiny_tokenizer, endpoint
):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    formats = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    ]
    errors = []

    async def structured(base_url, api_key, record):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": record.prompt}]
            for response_format in [*formats, {"type": "xml"}]:
                try:
                    await client.chat.completions.create(
                        model="policy", messages=messages, response_format=response_format, max_tokens=4
                    )
                except openai.BadRequestError as exc:
                    errors.append(exc.body["message"])
        return 1.0

    # A server with grammars (SGLang) gets the schema as its sampling parameter json_schema; the turns count.
    svc, model = services(tiny_tokenizer), RecordingModel(tiny_tokenizer, ['{"answer": 1}', '{"answer": 2}'])
    ctx = EpisodeContext(svc, model, RECORD, PARAMS, 0)
    asyncio.run(function_agent(structured, endpoint)(ctx, RECORD))
    assert [p["json_schema"] for p in model.params] == ['{"type": "object"}', json.dumps(schema)]
    assert ctx.counts["constrained_turns"] == 2
    assert errors == ['response_format: must be {"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "json_schema": {"name": ..., "schema": {...}}}']  # fmt: skip
    # The built-in engine has no constrained decoding: a 400 that says so, and the episode goes on.
    errors.clear()
    ctx = EpisodeContext(services(tiny_tokenizer), builtin_client, RECORD, PARAMS, 0)
    asyncio.run(function_agent(structured, endpoint)(ctx, RECORD))
    assert len(errors) == 3 and all(
        "sampling_params.json_schema: constrained decoding is not served by the built-in engine" in e
        for e in errors[:2]
    )
