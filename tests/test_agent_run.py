"""Multi-turn episodes through a whole run: the rollout role runs a user's workflow or agent (tests/plugins),
the trainer trains its per-turn samples, and every prompt is trained once (the ledger); an agent that never
works ends the run at once, saying why first."""

from __future__ import annotations

import pytest

from areal_hpc.control import Ledger, get_status
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.launch.run_status import status_lines
from areal_hpc.monitor import read_transcripts, transcript_steps
from areal_hpc.monitor.stats import read_stats


@pytest.mark.slow  # make test runs the agent's below: the same path, through the endpoint
def test_an_asynchronous_run_trains_two_turn_episodes_and_drops_the_groups_that_hang(plugins, toy):
    steps = 4
    cfg = toy.config(
        "agent", steps, "async_rl=true", "max_head_offpolicyness=1", "n_rollout_workers=1",
        "rollout.workflow=agent_plugin:sometimes_hangs", "rollout.tools=[calculator]",
        "rollout.export=per_turn", "rollout.turn_discount=0.5", "rollout.episode_timeout_secs=3",
        "logging.progress=false",
    )  # fmt: skip
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    rows = [r for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # 4 prompts x 2 episodes x 2 turns: a sample per model turn.
        assert r["ppo_actor/n_seqs"] == 16
        assert r["rollout/turns_per_episode"] == 2 and r["rollout/tool_calls_per_episode"] == 1
        assert r["rollout/tool_error_ratio"] == 0 and 0 < r["rollout/masked_token_share"] < 1
        assert r["ppo_actor/token_offpolicyness/max"] <= 1 + 1  # eta 1, plus an update while a group ran
    # The prompts whose episodes hang (one in three) were dropped after 3 s each; the run went on with the others.
    check_hanging_prompts_dropped(run, rows, steps)


def test_an_agent_written_against_the_openai_sdk_is_trained_as_it_is(plugins, toy):
    steps = 3
    cfg = toy.config(
        "sdk-agent", steps, "async_rl=true", "max_head_offpolicyness=1", "n_rollout_workers=1",
        "rollout.agent=sdk_agents:three_turns_or_hangs", "rollout.export=per_turn", "rollout.turn_discount=0.5",
        "rollout.episode_timeout_secs=3", "logging.progress=false",
    )  # fmt: skip
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    rows = [r for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # 4 prompts x 2 episodes, each one conversation of three chat calls through the endpoint, a sample a turn.
        assert r["ppo_actor/n_seqs"] == 24 and r["rollout/turns_per_episode"] == 3
        assert r["rollout/breaks_per_episode"] == 0 and r["rollout/replayed_turns_per_episode"] == 0
        assert 0 < r["rollout/masked_token_share"] < 1
    # The agents of one prompt in three never answer: their groups were dropped after 3 s each.
    check_hanging_prompts_dropped(run, rows, steps)
    assert not list(run.episodes.glob("epoch*/*/*.jsonl"))  # each group's journals went with it
    # Transcripts of the first 2 groups of each step (rollout.transcript_groups), kept or dropped alike.
    steps_kept = transcript_steps(run)
    assert steps_kept and all(len(read_transcripts(run, s)) <= 2 * 2 for s in steps_kept)
    episode = read_transcripts(run, steps_kept[0])[0]
    assert len(episode["turns"]) >= 1 and episode["turns"][0]["messages"]  # what the agent sent
    assert any(e["reward"] is not None for s in steps_kept for e in read_transcripts(run, s))


def check_hanging_prompts_dropped(run, rows: list[dict], steps: int) -> None:
    """Every prompt whose number is a multiple of 3 (they hang) was dropped, recorded and counted; every other
    trained once, 4 a step."""
    records = list(Ledger(run.ledger).records())
    trained = [i for r in records if not r.dropped for i in r.ids]
    dropped = [i for r in records if r.dropped for i in r.ids]
    assert len(trained) == 4 * steps and len(set(trained)) == len(trained)  # every prompt once
    assert dropped and all(int(i.rsplit("-", 1)[-1]) % 3 == 0 for i in dropped)
    assert not any(int(i.rsplit("-", 1)[-1]) % 3 == 0 for i in trained)
    assert sum(r["rollout/dropped_groups"] for r in rows) == len(dropped)


@pytest.mark.parametrize(
    ("mode", "role", "why"),
    [
        ((), "controller", "step 1 has no group to train on: every group was dropped"),
        (("async_rl=true", "max_head_offpolicyness=1", "n_rollout_workers=1"), "rollout",
         "the first 4 groups of this attempt were all dropped"),
    ],
    ids=["synchronous", "asynchronous"],
)  # fmt: skip
def test_an_agent_that_never_returns_a_number_ends_the_run_at_once_with_that_cause_first(
    plugins, toy, capsys, mode, role, why
):
    cfg = toy.config(
        "no-reward", 1, *mode, "rollout.agent=agent_fns:returns_none", "recover_mode=auto", "recover_retries=2",
        "logging.progress=false",
    )  # fmt: skip
    assert run_local(cfg) == 1
    cause = (
        f"RepeatedAgentError: {why}: 4 by rollout.agent returned None, not a number (the reward) (first at "
    )
    err = capsys.readouterr().err
    assert err.startswith(f"areal-hpc run: {role} aborted the run: {cause}")
    assert "a new attempt would" in err.splitlines()[0] and "not restarted" in err
    run = run_dir_of(cfg)
    status = get_status(run)
    assert status.permanent and status.reason.startswith(cause)
    assert not run.attempt_logs(1).exists()  # not restarted, whatever recover_retries says
    assert f"run: ABORTED ({role}: {cause}" in "\n".join(status_lines(run))
