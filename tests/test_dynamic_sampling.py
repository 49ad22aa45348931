"""DAPO's dynamic sampling: a group whose answers all have the same reward is dropped (its prompt used, the drop
counted in the ledger) and more prompts are drawn until the step's batch is full, at most
dynamic_sampling_max_rounds batches; synchronously and asynchronously, every drawn prompt is used once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from areal_hpc.config import InputError, load_config
from areal_hpc.control import Ledger, RunDir
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.data import PromptSample, RolloutStore, ShardedSampler, read_batch, training_prompts
from areal_hpc.gen.episode import Services
from areal_hpc.gen.episodes import Episodes, episodes_step
from areal_hpc.gen.partial import PartialAnswer
from areal_hpc.gen.rollout import Group, equal_rewards, fill_batch, pack_groups
from areal_hpc.launch.local import run_local
from areal_hpc.master.guard import StepGuard
from areal_hpc.master.sources import StoreRollouts, group_names
from areal_hpc.monitor.stats import read_stats

REPO = Path(__file__).resolve().parents[1]
# The tiny model never answers a toy question right within 6 tokens: every group's task rewards are equal. This
# reward (reward.fn) varies between its answers, so that some groups are kept and others dropped.
PARITY = "reward.fn=tests.test_dynamic_sampling:first_token_parity"


def first_token_parity(prompt, completion, prompt_ids, completion_ids, **fields) -> float:
    """1.0 when the answer's first token id is odd."""
    return float(bool(completion_ids) and completion_ids[0] % 2)


@pytest.fixture
def repo_importable(monkeypatch):
    """This module importable by the roles of a run (reward.fn names it)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


# --- the rule and the rounds of a synchronous step -------------------------------------------------------------


def group(query_id: str, *rewards: float, epoch: int = 0, dropped: str | None = None) -> Group:
    return Group(PromptSample(query_id, query_id, (1,), "math", ()), epoch, rewards, dropped=dropped)


def rounds(*batches: list[Group]):
    """draw() of fill_batch: the given rounds, one a call."""
    it = iter(batches)
    return lambda: next(it)


def ids(groups: list[Group]) -> list[str]:
    return [g.prompt.query_id for g in groups]


def test_a_group_is_judged_by_the_spread_of_its_rewards():
    assert equal_rewards([1.0, 1.0, 1.0]) and equal_rewards([0.0, 1e-10]) and equal_rewards([0.3])
    assert not equal_rewards([0.0, 1e-6]) and not equal_rewards([0.0, 0.0, 1.0])


def test_without_dynamic_sampling_a_step_is_one_round_of_every_group():
    filled = fill_batch(rounds([group("a", 0, 0), group("b", 0, 1), group("c", 1, 1)]), 3)
    assert ids(filled.kept) == ["a", "b", "c"] and filled.dropped == [] and filled.rounds == 1


def test_dynamic_sampling_draws_rounds_until_the_batch_is_full_and_drops_the_surplus():
    first = [group("a", 0, 1), group("b", 1, 1), group("c", 0, 0), group("d", 1, 0)]
    second = [group("e", 1, 1), group("f", 0, 1), group("g", 1, 0), group("h", 1, 0, epoch=1)]
    third = [group("i", 0, 1)]  # never drawn
    filled = fill_batch(rounds(first, second, third), 3, dynamic=True, max_rounds=4)
    assert filled.rounds == 2 and ids(filled.kept) == ["a", "d", "f"]
    assert [(g.prompt.query_id, g.dropped) for g in filled.dropped] == [
        ("b", "equal_rewards"), ("c", "equal_rewards"), ("e", "equal_rewards"), ("g", "surplus"),
        ("h", "surplus"),
    ]  # fmt: skip
    assert filled.dropped[-1].epoch == 1  # a group keeps the epoch of its prompt


def test_dynamic_sampling_stops_after_max_rounds_with_a_short_batch_or_none():
    filled = fill_batch(rounds([group("a", 1, 1), group("b", 0, 1)], [group("c", 0, 0), group("d", 1, 1)]), 2,
                        dynamic=True, max_rounds=2)  # fmt: skip
    assert filled.rounds == 2 and ids(filled.kept) == ["b"] and ids(filled.dropped) == ["a", "c", "d"]
    filled = fill_batch(rounds([group("a", 1, 1)], [group("b", 0, 0)]), 1, dynamic=True, max_rounds=2)
    assert filled.kept == [] and ids(filled.dropped) == ["a", "b"]


def test_a_short_batch_has_a_group_for_each_data_parallel_rank():
    # Two ranks: one group kept after max_rounds cannot be split over them, so rounds go on until two are.
    draws = rounds(
        [group("a", 0, 1), group("b", 1, 1)], [group("c", 0, 0)], [group("d", 0, 0)], [group("e", 1, 0)]
    )
    filled = fill_batch(draws, 3, dynamic=True, max_rounds=2, min_kept=2)
    assert filled.rounds == 4 and ids(filled.kept) == ["a", "e"]


def test_groups_given_up_are_dropped_for_their_reason_and_count_as_not_kept():
    first = [group("a", dropped="timeout"), group("b", 0, 1)]
    filled = fill_batch(rounds(first, [group("c", 1, 0), group("d", 1, 0)]), 2, dynamic=True, max_rounds=3)
    assert ids(filled.kept) == ["b", "c"]
    assert [(g.prompt.query_id, g.dropped) for g in filled.dropped] == [("a", "timeout"), ("d", "surplus")]


def test_a_prompt_a_step_takes_in_two_epochs_makes_two_groups():
    assert group_names([("a", 0), ("b", 0), ("a", 1)]) == ["a@epoch0", "b", "a@epoch1"]


# --- a multi-turn step ------------------------------------------------------------------------------------------


async def one_turn(ctx, record) -> float:
    """A workflow of one chat turn whose reward ignores the answer: 1 for every episode of a prompt named same-*,
    the parity of the episode's number for the others."""
    await ctx.chat([{"role": "user", "content": record.prompt}])
    return 1.0 if record.query_id.startswith("same") else float(ctx.index % 2)


def test_a_synchronous_multi_turn_step_replaces_its_groups_of_equal_rewards(
    builtin_client, tiny_tokenizer, tmp_path
):
    cfg = load_config(
        [REPO / "configs/toy-cpu.yaml"],
        ["rollout.workflow=tests.test_dynamic_sampling:one_turn", "group_size=2", "dynamic_sampling=true"],
    )
    episodes = Episodes(cfg, Services(tiny_tokenizer, cfg.rollout, lambda text, record, ids: 0.0))
    batches = iter([(prompts("same-c", "d"), 0), (prompts("e", "same-f"), 1)])
    rolled = episodes_step([builtin_client], episodes, prompts("a", "same-b"), cfg, tmp_path / "step.h5", 0,
                           lambda: next(batches))  # fmt: skip
    assert rolled.kept == [("a", 0), ("d", 0)] and rolled.dropped == [
        ("same-b", 0, "equal_rewards"),
        ("same-c", 0, "equal_rewards"),
    ]
    assert read_batch(rolled.path)["group_ids"].tolist() == [0, 0, 1, 1]
    stats = rolled.stats
    assert stats["rollout/dynamic_sampling_dropped"] == 2 and stats["rollout/dynamic_sampling_rounds"] == 2
    assert stats["rollout/short_batch"] == 0 and stats["rollout/dropped_groups"] == 0
    assert next(batches) == (prompts("e", "same-f"), 1)  # not drawn: the batch was full


def prompts(*query_ids: str) -> list[PromptSample]:
    return [PromptSample(q, "What is 2 + 3?", (1, 2, 3), "math", ("\\boxed{5}",)) for q in query_ids]


# --- the bound of the asynchronous wait ------------------------------------------------------------------------


def stored_group(store: RolloutStore, sequence: int, query_id: str) -> None:
    answers = [PartialAnswer((5, 6), (-0.5, -0.5), "stop", 0, 0) for _ in range(2)]
    prompt = PromptSample(query_id, query_id, (1, 2), "math", ())
    arrays = pack_groups([prompt], [answers], np.asarray([0.0, 1.0], np.float32))
    arrays["rewards"] = arrays["success"]
    store.put(0, sequence, time.time(), arrays, {"query_id": query_id, "epoch": 0})


def test_the_asynchronous_step_takes_a_short_batch_once_the_drops_make_max_rounds_batches(toy, tmp_path):
    cfg = toy.config("bound", 1, "async_rl=true", "dynamic_sampling=true", "dynamic_sampling_max_rounds=2")
    run = RunDir(tmp_path / "run")
    store, source = RolloutStore(run.rollouts), StoreRollouts(cfg, run, StepGuard())
    store.put_dropped(0, 0, time.time(), "q0", 0)  # the success-rate filter's: not counted
    stored_group(store, 1, "q1")
    for i in range(2, 8):  # 6 dropped for equal rewards and 1 ready: short of 2 batches of 4, the step waits
        store.put_dropped(0, i, time.time(), f"q{i}", 0, reason="equal_rewards")
    with pytest.raises(RuntimeError, match="the rollout role stopped"):  # (it has no heartbeat here)
        source.wait(4)
    store.put_dropped(0, 8, time.time(), "q8", 0, reason="equal_rewards")
    assert source.wait(4) == store.ready()  # 7 + 1: the step trains on the one group ready
    store.remove(store.ready())
    with pytest.raises(RuntimeError, match="the rollout role stopped"):
        source.wait(4)  # 7 dropped, none ready: short of the bound
    store.put_dropped(0, 9, time.time(), "q9", 0, reason="equal_rewards")
    none_kept = r"kept none: .*dynamic_sampling_max_rounds=2 .*too easy or too hard"
    with pytest.raises(InputError, match=none_kept):
        source.wait(4)  # 8 dropped, none ready: the step fails


# --- whole runs ------------------------------------------------------------------------------------------------


def check_ledger(run: RunDir, rows: list[dict], drawn: set[tuple[int, str]] | None = None) -> None:
    """Each prompt of the ledger is used once in its epoch, trained on or dropped; each step trained on the groups
    its statistics count and dropped those dynamic sampling counts; `drawn`: the (epoch, query id) the run drew."""
    records = list(Ledger(run.ledger).records())
    used = [(r.epoch, i) for r in records for i in r.ids]
    assert len(used) == len(set(used))  # trained or dropped, once
    if drawn is not None:
        assert set(used) == drawn
    for row in rows:
        step = [r for r in records if r.step == row["step"]]
        trained = [i for r in step if not r.dropped for i in r.ids]
        dropped = [i for r in step if r.dropped for i in r.ids]
        # group_size 2: the step's batch held its kept groups and no other
        assert row["ppo_actor/n_seqs"] == 2 * len(trained)
        assert len(trained) == 4 or row["rollout/short_batch"] == 1
        assert len(dropped) == row["rollout/dynamic_sampling_dropped"] + row.get("rollout/surplus_groups", 0)
    assert sum(row["rollout/dynamic_sampling_dropped"] for row in rows) > 0


def test_a_synchronous_run_fills_each_batch_with_groups_whose_rewards_differ(toy, repo_importable):
    steps = 3
    cfg = toy.config("ds-sync", steps, "dynamic_sampling=true", PARITY, "logging.progress=false")
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    rows = [r for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # The prompts drawn are the sampler's first batches, as many as the steps drew rounds.
    dataset = training_prompts(cfg, AutoTokenizer.from_pretrained(cfg.actor.path))
    sampler = ShardedSampler(len(dataset), 0, 1, cfg.seed, cfg.dataset.train_bs_n_seqs)
    drawn = set()
    for _ in range(int(sum(r["rollout/dynamic_sampling_rounds"] for r in rows))):
        epoch = sampler.epoch
        drawn |= {(epoch, dataset[i].query_id) for i in sampler.next_batch()}
    check_ledger(run, rows, drawn)


def test_an_asynchronous_run_drops_groups_whose_rewards_are_equal(toy, repo_importable):
    steps = 3
    cfg = toy.config(
        "ds-async", steps, "async_rl=true", "max_head_offpolicyness=1", "n_rollout_workers=1",
        "dynamic_sampling=true", PARITY, "logging.progress=false",
    )  # fmt: skip
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    rows = [r for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all("rollout/dynamic_sampling_rounds" not in r for r in rows)
    check_ledger(run, rows)


def test_a_run_whose_groups_all_have_equal_rewards_fails_naming_max_rounds(toy, capsys):
    # The tiny model answers no toy question right: every group's rewards are 0. A new attempt would draw the
    # same prompts and sample the same answers: the run is not restarted.
    cfg = toy.config(
        "ds-equal", 2, "dynamic_sampling=true", "dynamic_sampling_max_rounds=2", "recover_mode=auto",
        "recover_retries=2",
    )  # fmt: skip
    assert run_local(cfg) == 1
    err = capsys.readouterr().err
    assert "dynamic_sampling_max_rounds=2" in err and "every group's rewards were equal" in err
    assert "too easy or too hard" in err and "not restarted" in err
    assert not Path(run_dir_of(cfg).ledger).exists()  # nothing trained, nothing recorded
