"""Extension points: a reward function, a dataset loader and an actor interface of the user's, named in the config
(tests/plugins holds them, outside the package), checked before submit and used by a real run."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, InputError, RewardConfig, extensions
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.data import DatasetFormatError, PromptSample, read_prompt_records
from areal_hpc.launch.local import run_local
from areal_hpc.launch.preflight import check_inputs
from areal_hpc.monitor.stats import read_stats
from areal_hpc.reward import TaskRewards
from areal_hpc.reward.custom import RewardFnError

PLUGINS = Path(__file__).resolve().parent / "plugins"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def question(query_id: str, answer: str) -> PromptSample:
    fields = {"query_id": query_id, "answer": answer}
    return PromptSample(query_id, f"What is {answer}?", (1, 2), "math", (), fields=fields)


def scores(reward: RewardConfig, items) -> list[float]:
    with TaskRewards(reward) as rewards:
        return rewards.score_batch(items)


def write_csv(path: Path, jsonl: Path) -> Path:
    """The toy questions as the CSV file toy_plugin.read_csv reads: id,question,answer."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["id", "question", "answer"])
        for line in jsonl.read_text().splitlines():
            r = json.loads(line)
            out.writerow(
                [r["query_id"], r["prompt"], re.search(r"boxed\{(.*)\}", r["solutions"][0]).group(1)]
            )
    return path


# --- reward.fn -------------------------------------------------------------------------------------------------


def test_a_reward_function_scores_every_answer_with_the_fields_of_its_line(plugins):
    q = question("q1", "7")
    items = [("so \\boxed{7}", q, [5]), ("\\boxed{8}", q, [5]), ("no box", q, [5])]
    assert scores(RewardConfig(fn="toy_plugin:boxed_number"), items) == [1.0, 0.0, 0.0]
    batch = RewardConfig(fn="toy_plugin:boxed_numbers", fn_batch=True)
    assert scores(batch, items) == [1.0, 0.0, 0.0]


def test_an_async_reward_function_is_awaited(plugins):
    q = question("q1", "7")
    assert scores(RewardConfig(fn="toy_plugin:answer_length"), [("a", q, [1, 2]), ("b", q, [1] * 8)]) == [
        0.25,
        1.0,
    ]


def test_a_call_past_its_timeout_scores_zero_and_the_pool_keeps_serving(plugins):
    q = question("q1", "7")
    cfg = RewardConfig(fn="bad_plugin:sleeps_on_long_answers", fn_timeout_secs=1.0, fn_workers=1)
    with TaskRewards(cfg) as rewards:
        start = time.monotonic()
        assert rewards.score_batch([("short", q, []), ("a long answer", q, []), ("short", q, [])]) == [
            1.0,
            0.0,
            1.0,
        ]
        assert time.monotonic() - start < 1.0 + 5.0  # one timeout and the new worker's start
        assert rewards.score_batch([("short", q, [])]) == [1.0]


@pytest.mark.parametrize(
    "fn, batch, message",
    [
        (
            "bad_plugin:raises",
            False,
            r"reward.fn bad_plugin:raises on query q1 failed:\n.*KeyError: 'no such key'",
        ),
        ("bad_plugin:returns_text", False, r"returned '1.0'; a score is a finite number"),
        (
            "bad_plugin:one_score_short",
            True,
            r"on query q1 and 1 other answers returned \[1.0\]; .* returns 2 scores",
        ),
    ],
)
def test_a_faulty_reward_function_fails_loudly(plugins, fn, batch, message):
    q = question("q1", "7")
    with pytest.raises(RewardFnError, match=re.compile(message, re.DOTALL)):
        scores(RewardConfig(fn=fn, fn_batch=batch), [("a", q, []), ("b", q, [])])


# --- dataset.loader --------------------------------------------------------------------------------------------


def test_a_loader_reads_another_format_into_records_validated_alike(plugins, tmp_path, toy_train_path):
    path = write_csv(tmp_path / "train.csv", toy_train_path)
    records = read_prompt_records(path, "toy_plugin:read_csv", scored_by_fn=True)
    first = json.loads(toy_train_path.read_text().splitlines()[0])  # {"prompt": "What is 8 * 10 - 17?", ...}
    answer = re.search(r"boxed\{(.*)\}", first["solutions"][0]).group(1)
    assert (records[0].query_id, records[0].prompt) == (first["query_id"], first["prompt"])
    assert records[0].fields == {"query_id": first["query_id"], "answer": answer}
    # Without a reward.fn the math verifier needs solutions, which these records lack.
    with pytest.raises(
        DatasetFormatError, match=r"train.csv: record 1 of dataset.loader toy_plugin:read_csv: 'sol"
    ):
        read_prompt_records(path, "toy_plugin:read_csv")


# --- checked before submit -------------------------------------------------------------------------------------


def test_every_extension_that_cannot_work_is_refused_before_submit(plugins, toy):
    cfg = toy.config(
        "bad", 1, "reward.fn=toy_plugin:boxed_number", "actor.interface=bad_plugin:NoInference",
        "dataset.loader=toy_plugin:no_such_loader",
    )  # fmt: skip
    with pytest.raises(InputError) as refused:
        check_inputs(cfg)
    message = str(refused.value)
    # boxed_number needs each line's 'answer'; the toy lines have query_id, task, solutions and tier.
    assert (
        "'reward.fn' is 'toy_plugin:boxed_number'(prompt, completion, prompt_ids, completion_ids, answer"
        in message
    )
    assert "missing a required argument: 'answer'" in message
    assert "'actor.interface' is 'bad_plugin:NoInference', a class without inference" in message
    assert (
        "'dataset.loader' is 'toy_plugin:no_such_loader': toy_plugin has no attribute 'no_such_loader'"
        in message
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "reward.fn=no_such_package.rewards:score",
            "importing no_such_package.rewards failed (ModuleNotFoundError: No module named 'no_such_package'). "
            "Every role imports it too: install its package in the job's environment or put its folder on PYTHONPATH",
        ),
        (
            "reward.fn=bad_plugin:takes_two",
            "which does not take (prompt, completion, prompt_ids, completion_ids",
        ),
        ("actor.interface=toy_plugin:boxed_number", "which does not take the run's config"),
        ("dataset.loader=toy_plugin:boxed_number", "which does not take the dataset's path"),
    ],
)
def test_an_extension_that_does_not_import_or_take_its_call_is_refused(plugins, toy, override, message):
    with pytest.raises(InputError, match=re.escape(message)):
        check_inputs(toy.config("bad", 1, override))


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "reward.fn=score",
            "'reward.fn' is 'score': not a registered name (registered: none); give 'module:attribute'",
        ),
        ("reward.fn=my pkg:score", "write 'module.path:attribute'"),
        ("reward.fn_batch=true", "'reward.fn_batch' is true, but 'reward.fn' is not set"),
        (
            "actor.interface=sft",
            "the interface of the other experiment type; experiment_type ppo takes 'ppo_actor'",
        ),
        (
            "dataset.loader=parquet",
            "'dataset.loader' is 'parquet': not a registered name (registered: jsonl)",
        ),
    ],
)
def test_the_form_of_a_spec_is_checked_with_the_config(toy, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        toy.config("bad", 1, override)


def test_an_installed_package_registers_names_by_entry_point(plugins, tmp_path, monkeypatch):
    dist = tmp_path / "site" / "toy_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[areal_hpc.reward_fns]\nboxed = toy_plugin:boxed_number\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert extensions.spec_problem("reward.fn", "boxed") is None
    assert extensions.load("reward.fn", "boxed").__name__ == "boxed_number"


# --- a run -----------------------------------------------------------------------------------------------------


def test_the_toy_trains_with_a_reward_function_loader_and_interface_from_outside_the_package(
    plugins, toy, tmp_path
):
    train = write_csv(tmp_path / "train.csv", toy.data / "train.jsonl")
    valid = write_csv(tmp_path / "valid.csv", toy.data / "test.jsonl")
    cfg = toy.config(
        "ext", 2, f"dataset.path={train}", f"dataset.valid_path={valid}", "dataset.loader=toy_plugin:read_csv",
        "reward.fn=toy_plugin:answer_length", "actor.interface=toy_plugin:CountingActor", "logging.tensorboard=false",
    )  # fmt: skip
    assert run_local(cfg) == 0
    steps = [r for r in read_stats(run_dir_of(cfg).stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["toy_plugin/rank_seqs"] == 4 * 2  # the interface's own statistic
        # The task reward is the function's score: each answer's share of 8 tokens.
        answer_len = r["ppo_actor/seq_len/avg"] - r["ppo_actor/prompt_len/avg"]
        assert r["ppo_actor/task_reward/avg"] == pytest.approx(answer_len / 8)


def test_the_guide_shows_the_plugin_that_runs():
    code = (PLUGINS / "toy_plugin.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert len(blocks) >= 3
    for block in blocks:
        assert block.strip() in code, (
            f"docs/extending.md shows code that tests/plugins/toy_plugin.py lacks:\n{block}"
        )
