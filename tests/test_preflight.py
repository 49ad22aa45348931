"""Bad inputs (datasets, model directories) are refused by `run` and `submit`, dry runs too, before anything is
written or submitted: every problem at once, each naming its option and file:line."""

from __future__ import annotations

import pytest

from areal_hpc.cli import main
from tests.helpers import REPO_ROOT

TOY = str(REPO_ROOT / "configs" / "toy-cpu.yaml")


@pytest.fixture
def bad_data(tmp_path, toy):
    lines = (toy.data / "train.jsonl").read_text().splitlines(keepends=True)
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text("".join(lines[:3]) + "{not json\n" + "".join(lines[4:]))
    return path


@pytest.mark.parametrize("verb", [["run"], ["submit", "--dry-run"], ["submit"]])
def test_a_malformed_dataset_line_is_named_and_nothing_is_written(toy, bad_data, capsys, verb):
    code = main([*verb, TOY, *toy.overrides("bad", 2, f"dataset.path={bad_data}")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"'dataset.path': {bad_data}:4: not a valid JSON line" in err
    assert sorted(p.name for p in toy.fileroot.iterdir()) == ["data"]  # no run directory


def test_every_bad_input_is_named_at_once(toy, tmp_path, capsys):
    few = tmp_path / "few.jsonl"
    few.write_text("".join((toy.data / "train.jsonl").read_text().splitlines(keepends=True)[:3]))
    overrides = [
        f"dataset.path={few}",
        "actor.path=/nonexistent/model",
        f"dataset.valid_path={tmp_path}/none",
        "eval.enabled=true",
        f"eval.data_dir={tmp_path}",
        "eval.data_names=[aime24]",
    ]
    assert main(["submit", "--dry-run", TOY, *toy.overrides("bad", 2, *overrides)]) == 2
    err = capsys.readouterr().err
    assert f"'eval.data_names': no evaluation set 'aime24': {tmp_path}/aime24.jsonl does not exist" in err
    assert f"'dataset.path': {few} holds 3 prompts, fewer than one step's dataset.train_bs_n_seqs=4" in err
    assert f"'dataset.valid_path': cannot read {tmp_path}/none: No such file or directory" in err
    assert "'actor.path': /nonexistent/model is not a directory" in err


def test_a_directory_without_a_model_is_refused(toy, tmp_path, capsys):
    (tmp_path / "empty-model").mkdir()
    assert main(["run", TOY, *toy.overrides("bad", 2, f"actor.path={tmp_path}/empty-model")]) == 2
    err = capsys.readouterr().err
    assert f"'actor.path': {tmp_path}/empty-model holds no loadable Hugging Face config" in err
    assert "holds no loadable Hugging Face tokenizer" in err


def test_a_new_run_cannot_resume(toy, capsys):
    assert main(["run", TOY, *toy.overrides("bad", 2, "recover_mode=resume")]) == 2
    assert "'recover_mode' is resume, but a new run has no recover checkpoint" in capsys.readouterr().err
