"""Multi-turn episodes on a real built-in server: token-exact trajectories, incremental chat, per-token versions,
export modes, and groups that run out of time."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from areal_hpc.agent import ChatRenderer, Toolbox, Trajectory, drifts, export, load_tools
from areal_hpc.agent.tools import CALCULATOR
from areal_hpc.config import load_config
from areal_hpc.control.manifest import write_manifest
from areal_hpc.data import PromptSample, read_batch
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer
from areal_hpc.gen.client import GenClient
from areal_hpc.gen.episode import EpisodeContext, Services
from areal_hpc.gen.episodes import (
    AgentFailed,
    Episodes,
    FirstGroups,
    GroupTimeout,
    RepeatedAgentError,
    episode_groups,
    episode_stats,
    episodes_step,
    run_group,
)
from areal_hpc.gen.rollout import StepRollout, pack_episodes
from areal_hpc.master.sources import no_group_error
from tests.helpers import REPO_ROOT as REPO

RECORD = PromptSample("q1", "What is 47 * 38?", (1, 2, 3), "math", ("\\boxed{1786}",))
TOOL = {"role": "tool", "name": "calculator", "content": "1786"}


@pytest.fixture
def client(builtin_client):
    """A built-in server (engine + HTTP on a thread of this process) on the tiny model (conftest)."""
    return builtin_client


def services(tokenizer, *overrides: str) -> Services:
    """The services of the toy's tool runs: the calculator, and a reward for the product in the answer."""
    cfg = load_config([REPO / "configs/toy-cpu.yaml"], ["rollout.workflow=tool_loop", *overrides])
    toolbox = Toolbox(load_tools(["calculator"]))
    return Services(tokenizer, cfg.rollout, lambda text, record, ids: float("1786" in text), toolbox)


PARAMS = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5}


async def two_turns(ctx, record):
    """A user's workflow: ask, give the model a tool answer, ask again."""
    messages = [{"role": "user", "content": record.prompt}]
    reply = await ctx.chat(messages, ctx.tool_schemas)
    reply = await ctx.chat([*messages, reply, TOOL], ctx.tool_schemas)
    return await ctx.score(reply["content"])


def test_each_chat_turn_appends_only_the_new_messages_to_the_sampled_ids(client, tiny_tokenizer):
    result = run_group(services(tiny_tokenizer), two_turns, client, RECORD, PARAMS, group_size=3, timeout=60)
    renderer = ChatRenderer(tiny_tokenizer, [CALCULATOR.schema()])
    first = renderer.first([{"role": "user", "content": RECORD.prompt}])
    for samples in result.samples:
        (sample,) = samples  # concat: one sample per episode
        ids, trained = list(sample.ids), ~np.asarray(sample.prompt_mask)
        assert ids[: len(first)] == first
        # Turn 1's sampled ids, the template's tokens around the tool message, then turn 2's sampled ids.
        n1 = _run_length(trained, len(first))
        between = renderer.after_turn([TOOL], ids[len(first) : len(first) + n1])
        second = len(first) + n1 + len(between)
        assert ids[len(first) + n1 : second] == between and not trained[len(first) + n1 : second].any()
        assert trained[second:].all() and trained.sum() == len(ids) - len(first) - len(between)
    assert result.counts["turns"] == 6 and result.counts["breaks"] == 0


def _run_length(mask: np.ndarray, start: int) -> int:
    """How many True values follow mask[start] (inclusive) before the first False."""
    rest = mask[start:]
    return int(np.argmin(rest)) if not rest.all() else len(rest)


def test_naive_re_rendering_drifts_where_the_trajectory_keeps_the_sampled_ids(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer)
    messages = [{"role": "user", "content": RECORD.prompt}]
    # The model may sample a word byte by byte; its text encodes back to the merged token, not to these ids.
    canonical = tiny_tokenizer.encode("The answer is", add_special_tokens=False)
    sampled = [i for ch in "The answer is" for i in tiny_tokenizer.encode(ch, add_special_tokens=False)]
    sampled.append(renderer.end_of_turn)
    assert drifts(tiny_tokenizer, sampled) and sampled != canonical + [renderer.end_of_turn]
    traj = Trajectory()
    traj.add_context(renderer.first(messages))
    traj.add_turn(sampled, [-0.5] * len(sampled), [3] * len(sampled), "stop")
    traj.add_context(renderer.after_turn([TOOL], sampled))
    naive = renderer.first([*messages, {"role": "assistant", "content": "The answer is"}, TOOL])
    assert naive != traj.ids  # re-rendering from text trains on ids the model never sampled
    start = traj.turns[0].start
    assert traj.ids[start : start + len(sampled)] == sampled
    assert len(naive) < len(traj.ids)  # the merged re-encoding is shorter


def test_export_concat_and_per_turn():
    traj = Trajectory()
    traj.add_context([1, 2])
    traj.add_turn([3, 4], [-0.1, -0.2], [5, 5], "stop")
    traj.add_context([6])
    traj.add_turn([7], [-0.3], [6], "length")
    traj.add_context([8, 9])  # a tool answer after the last turn: no loss, left out
    (concat,) = export(traj, 1.0, "concat")
    assert concat.ids == (1, 2, 3, 4, 6, 7) and concat.prompt_mask == (True, True, False, False, True, False)
    assert concat.truncated and concat.reward == 1.0 and concat.sampled_versions == [5, 5, 6]
    first, second = export(traj, 1.0, "per_turn", turn_discount=0.5)
    assert first.ids == (1, 2, 3, 4) and first.prompt_mask == (True, True, False, False)
    assert second.ids == concat.ids and second.prompt_mask == (True,) * 5 + (False,)
    assert (first.discount, second.discount) == (0.5, 1.0) and not first.truncated
    assert [s.reward for s in export(traj, [0.0, 1.0], "per_turn")] == [0.0, 1.0]
    with pytest.raises(ValueError, match="per_turn"):
        export(traj, [0.0, 1.0], "concat")
    with pytest.raises(ValueError, match="2 rewards for 1 turns|for 2 turns"):
        export(traj, [1.0], "per_turn")


def test_per_turn_export_packs_a_row_per_turn_with_discounted_rewards(client, tiny_tokenizer):
    cfg = load_config(
        [REPO / "configs/toy-cpu.yaml"],
        ["rollout.workflow=tool_loop", "rollout.export=per_turn", "rollout.turn_discount=0.5"],
    )
    every_answer_right = Services(
        tiny_tokenizer, cfg.rollout, lambda *a: 1.0, Toolbox(load_tools(["calculator"]))
    )
    result = run_group(every_answer_right, two_turns, client, RECORD, PARAMS, 2, 60)
    arrays = pack_episodes([[s for samples in result.samples for s in samples]], cfg)
    assert len(arrays["rewards"]) == 4  # two turns of two episodes
    scaled = cfg.ppo.reward_output_scaling  # success 1 -> reward (1 - 0.5) * 2 * scaling
    assert arrays["rewards"].tolist() == [scaled * 0.5, scaled, scaled * 0.5, scaled]
    masked = arrays["token_versions"][arrays["prompt_mask"]]
    assert (masked == -1).all() and (arrays["token_versions"][~arrays["prompt_mask"]] == 0).all()
    stats = episode_stats(result.counts, episodes=2)
    assert stats["rollout/turns_per_episode"] == 2.0 and 0 < stats["rollout/masked_token_share"] < 1


async def long_answer(ctx, record):
    await ctx.generate(record.input_ids, {"max_new_tokens": 1500, "ignore_eos": True})
    return 0.0


@pytest.mark.parametrize("group_size", [1, 2])
def test_a_group_past_its_time_is_given_up_and_its_requests_aborted(client, tiny_tokenizer, group_size):
    """Also when every episode runs out of time at once (one episode always does): none is left running, and
    none generates on to its 1,500 tokens."""
    generated = client.server_info()["stats"].get("generated_tokens", 0)
    with pytest.raises(GroupTimeout, match=f"{group_size} of {group_size} episodes"):
        run_group(
            services(tiny_tokenizer), long_answer, client, RECORD, PARAMS, group_size=group_size, timeout=0.3
        )
    assert client.server_info()["num_running_reqs"] == 0
    assert client.server_info()["stats"]["generated_tokens"] - generated < 1500


def test_an_interrupted_turn_resumes_with_its_tokens_and_tags_each_with_its_version(
    client, tiny_tokenizer, tiny_model_dir, tmp_path
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(tmp_path / "v1")
    write_manifest(tmp_path / "v1")
    ctx = EpisodeContext(services(tiny_tokenizer), client, RECORD, PARAMS, index=0)
    box = []
    worker = threading.Thread(target=lambda: box.append(asyncio.run(long_answer(ctx, RECORD))), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while client.server_info()["stats"].get("generated_tokens", 0) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.update_weights_from_disk(str(tmp_path / "v1"), weight_version=1)
    worker.join(120)
    (traj,) = ctx.trajectories
    (turn,) = traj.turns
    versions = traj.versions[turn.start : turn.end]
    assert len(versions) == 1500 and versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert ctx.counts["interrupted_turns"] == 1 and ctx.counts["turns"] == 1


def test_a_conversation_that_fills_the_servers_context_ends_there(client, tiny_tokenizer):
    first = ChatRenderer(tiny_tokenizer, [CALCULATOR.schema()]).first(
        [{"role": "user", "content": RECORD.prompt}]
    )
    full = services(tiny_tokenizer)
    full.max_context = len(first) + 10  # room for 9 new tokens: turn 1 gets them, turn 2 none
    result = run_group(
        full, two_turns, client, RECORD, {**PARAMS, "max_new_tokens": 50}, group_size=2, timeout=60
    )
    assert result.counts["turns"] == 2 and result.counts["context_full"] == 2
    for (sample,) in result.samples:
        assert len(sample.ids) <= len(first) + 9 and sample.truncated


@pytest.fixture
def short_client(tiny_model_dir):
    """A built-in server of context 512 on the tiny model, whose own is 2048."""
    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=4, context_length=512).start()
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), "test-token")
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", "test-token", timeout=120)
    httpd.shutdown()
    engine.stop()


def test_a_conversation_ends_at_the_context_its_server_reports(short_client, tiny_tokenizer):
    svc = services(tiny_tokenizer)
    svc.max_context = 2048  # as configured: the model's (episodes.max_context)
    params = {**PARAMS, "max_new_tokens": 1000, "ignore_eos": True}
    # Turn 1 fills the server's 512 tokens; turn 2 has no room there (it used to get a 400 and fail the rollout).
    result = run_group(svc, two_turns, short_client, RECORD, params, group_size=2, timeout=60)
    assert result.counts["turns"] == 2 and result.counts["context_full"] == 2
    for (sample,) in result.samples:
        assert len(sample.ids) == 511 and sample.truncated


async def two_turns_but_q2_hangs(ctx, record):
    if record.query_id == "q2":
        await asyncio.sleep(3600)
    return await two_turns(ctx, record)


def test_a_synchronous_step_writes_the_groups_that_ended_and_names_those_dropped(
    client, tiny_tokenizer, tmp_path
):
    cfg = load_config(
        [REPO / "configs/toy-cpu.yaml"],
        ["rollout.workflow=tests.test_episodes:two_turns_but_q2_hangs", "rollout.tools=[calculator]",
         "rollout.episode_timeout_secs=8", "group_size=2"],
    )  # fmt: skip
    episodes = Episodes(cfg, services(tiny_tokenizer))
    prompts = [replace(RECORD, query_id=q) for q in ("q1", "q2", "q3")]
    path, stats, kept, dropped, _ = episodes_step(
        [client], episodes, prompts, cfg, tmp_path / "step.h5", epoch=0
    )
    assert (kept, dropped) == ([("q1", 0), ("q3", 0)], [("q2", 0, "timeout")]) and stats[
        "rollout/dropped_groups"
    ] == 1
    arrays = read_batch(path)
    assert arrays["group_ids"].tolist() == [0, 0, 1, 1]  # concat: one row per episode, two episodes a group
    assert stats["rollout/turns_per_episode"] == 2 and stats["rollout/tool_calls_per_episode"] == 0


@pytest.fixture
def agent_episodes(plugins, tiny_tokenizer):
    """agent_episodes(agent, *overrides): the toy's config with tests/plugins/agent_fns.py's ``agent`` as
    rollout.agent, and its Episodes (their endpoints shut at teardown)."""
    made = []

    def make(agent: str, *overrides: str) -> tuple:
        cfg = load_config([REPO / "configs/toy-cpu.yaml"], [f"rollout.agent=agent_fns:{agent}", *overrides])
        made.append(Episodes(cfg, services(tiny_tokenizer)))
        return cfg, made[-1]

    yield make
    for episodes in made:
        episodes.close()


def test_agent_concurrency_bounds_the_agents_running_at_once_and_an_episode_s_time_runs_from_its_turn(
    agent_episodes, client
):
    import agent_fns

    agent_fns.CROWD.update(now=0, most=0)
    _, episodes = agent_episodes(
        "counts_its_crowd", "group_size=4", "rollout.agent_concurrency=2", "rollout.episode_timeout_secs=1.2"
    )
    start = time.monotonic()
    groups, _ = episode_groups(
        [client], episodes, [replace(RECORD, query_id=q) for q in ("q1", "q2")], epoch=0
    )
    # 8 calls of half a second, two at a time: 2 s in all, past the episodes' 1.2 s, which run from their turns.
    assert time.monotonic() - start > 1.9
    assert agent_fns.CROWD["most"] == 2 and episodes.slots.free == 2
    assert [g.dropped for g in groups] == [None, None] and [g.rewards for g in groups] == [[1.0] * 4] * 2


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        ("returns_text", "rollout.agent returned a str, not a number (the reward): '1.0'"),
        ("returns_true", "rollout.agent returned a bool, not a number (the reward): True"),
        ("returns_nan", "rollout.agent returned nan, not a finite number (the reward)"),
        ("returns_none", "rollout.agent returned None, not a number (the reward)"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_the_agent_s_error(
    agent_episodes, client, tmp_path, agent, message
):
    cfg, episodes = agent_episodes(agent, "group_size=2", "rollout.agent_concurrency=1")
    rolled = episodes_step([client], episodes, [RECORD], cfg, tmp_path / "step.h5", epoch=0)
    assert rolled.path is None and rolled.dropped == [("q1", 0, "agent_error")]  # the ledger's line
    assert rolled.stats["rollout/dropped_groups"] == 1
    ((query_id, epoch, error),) = rolled.given_up
    assert (query_id, epoch, str(error)) == ("q1", 0, message)
    assert episodes.slots.free == 1  # the turn came back, though the second episode was given up for it


NONE = AgentFailed("rollout.agent returned None, not a number (the reward)")
TIMEOUT = GroupTimeout(
    "2 of 2 episodes still ran after 3 s", "an episode ran past rollout.episode_timeout_secs=3"
)


def test_a_step_whose_groups_the_agent_all_failed_alike_ends_the_run_and_says_so_first():
    cfg = load_config([REPO / "configs/toy-cpu.yaml"])
    raised = AgentFailed("rollout.agent raised KeyError: 'q2'", "rollout.agent raised KeyError")
    alike = StepRollout(None, {}, [], [], (("q1", 0, NONE), ("q2", 0, NONE), ("q3", 0, NONE)))
    error = no_group_error(4, cfg, alike)
    assert isinstance(error, RepeatedAgentError) and str(error) == (
        "step 5 has no group to train on: every group was dropped: 3 by rollout.agent returned None, not a number "
        "(the reward) (first at prompt 'q1', epoch 0); a new attempt would draw the same prompts and fail alike"
    )
    # Another cause, or time, among them: a new attempt may fare better (it is restarted); the most first.
    mixed = StepRollout(None, {}, [], [], (("q1", 0, TIMEOUT), ("q2", 0, raised), ("q3", 0, raised)))
    error = no_group_error(4, cfg, mixed)
    assert type(error) is RuntimeError and str(error) == (
        "step 5 has no group to train on: every group was dropped: 2 by rollout.agent raised KeyError (first at "
        "prompt 'q2', epoch 0: rollout.agent raised KeyError: 'q2'); 1 by an episode ran past "
        "rollout.episode_timeout_secs=3 (first at prompt 'q1', epoch 0: 2 of 2 episodes still ran after 3 s)"
    )


def test_an_agent_that_fails_the_first_batch_of_groups_alike_ends_an_asynchronous_run():
    first = FirstGroups(3)
    first.ended("q1", 0, NONE)
    first.ended("q2", 0, NONE)
    with pytest.raises(
        RepeatedAgentError, match=r"^the first 3 groups of this attempt were all dropped: 3 by "
    ):
        first.ended("q3", 0, NONE)
    # A group kept, or dropped otherwise, among the first passes the test for good: the run goes on.
    for other in (
        None,
        TIMEOUT,
        AgentFailed("rollout.agent raised KeyError: 'x'", "rollout.agent raised KeyError"),
    ):
        first = FirstGroups(3)
        first.ended("q1", 0, NONE)
        first.ended("q2", 0, other)
        for i in range(3, 9):
            first.ended(f"q{i}", 0, NONE)
