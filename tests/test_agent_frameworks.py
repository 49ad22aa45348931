"""Popular agent frameworks trained as they are (docs/agents.md's table): each runs a 3-turn episode with a
calculator against the real endpoint and a built-in tiny-model server, its first model turns scripted as tool
calls (the tiny model writes none of its own), the last the model's own. Each episode is one sample with no
break, and what is trained is exactly what the server sampled: its ids and its logprobs."""

from __future__ import annotations

import asyncio

import pytest

from areal_hpc.gen.agents import function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episode import EpisodeContext
from tests.plugins import framework_agents  # the frameworks are in the test extra (pyproject)
from tests.test_episodes import PARAMS, RECORD, services
from tests.test_transcripts import ScriptedModel

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 38"}}\n</tool_call>'
AFTER_OPENING = 'calculator", "arguments": {"expression": "47 * 38"}}\n</tool_call>'  # a forced turn's rest


class ScriptThenModel:
    """The server's client, its first answers scripted (``texts``), the rest the tiny model's own."""

    def __init__(self, client, tokenizer, texts: list[str]):
        self.client, self.script = client, ScriptedModel(tokenizer, texts)
        self.sampled: list[tuple[list[int], list[float]]] = []  # the model's own answers: ids, logprobs

    def generate(self, input_ids, sampling_params=None, rid=None, stop=None):
        if self.script.texts:
            return self.script.generate(input_ids, sampling_params, rid=rid, stop=stop)
        answers = self.client.generate(input_ids, sampling_params, rid=rid, stop=stop)
        for a in answers:
            self.sampled.append(
                (list(a["output_ids"]), [lp[0] for lp in a["meta_info"]["output_token_logprobs"]])
            )
        return answers

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def endpoint():
    endpoint = Endpoint("policy")
    yield endpoint
    endpoint.shutdown()


@pytest.mark.parametrize(
    "agent, script",
    [
        # The SDK raises on an answer cut at max_output_tokens, and the tiny model ends none of its own: the last
        # turn is scripted too (ended by its end-of-turn token).
        (framework_agents.agents_sdk_default, [CALL, CALL, "It is \\boxed{1786}."]),
        (framework_agents.agents_sdk_forced, [AFTER_OPENING, CALL]),
        (framework_agents.langchain_any_tool, [AFTER_OPENING, CALL]),
    ],
    ids=["agents-sdk-responses", "agents-sdk-required-one-call", "langchain-any-one-call"],
)
def test_a_framework_agent_runs_three_turns_trained_as_sampled(
    builtin_client, tiny_tokenizer, endpoint, agent, script
):
    model = ScriptThenModel(builtin_client, tiny_tokenizer, script)
    ctx = EpisodeContext(services(tiny_tokenizer), model, RECORD, {**PARAMS, "max_new_tokens": 256}, 0)
    asyncio.run(function_agent(agent, endpoint)(ctx, RECORD))
    assert ctx.failure is None and ctx.counts["refused_requests"] == 0
    assert (ctx.counts["turns"], ctx.counts["breaks"]) == (3, 0)
    (traj,) = ctx.trajectories
    for turn, text in zip(traj.turns[: len(script)], script, strict=True):  # the scripted turns, as written
        assert tiny_tokenizer.decode(traj.ids[turn.start : turn.end], skip_special_tokens=True) == text
    for turn, (ids, logprobs) in zip(traj.turns[len(script) :], model.sampled, strict=True):
        # the model's own turns: its ids and logprobs, trained as sampled
        assert traj.ids[turn.start : turn.end] == ids
        assert traj.logprobs[turn.start : turn.end] == logprobs
