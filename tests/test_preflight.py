"""Bad inputs (datasets, model directories) are refused by `run` and `submit`, dry runs too, before anything is
written or submitted: every problem at once, each naming its option and file:line."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import pytest

from areal_hpc.cli import main
from areal_hpc.launch.storage import parameter_count, storage_problems, trained_parameter_count
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


@pytest.fixture
def huge_model(tmp_path, toy):
    """The tiny model's directory, its config claiming some 400 trillion parameters (each MLP 10^12 wide)."""
    model = tmp_path / "huge"
    shutil.copytree(toy.model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 10**12}))
    return model


def test_a_file_root_too_small_for_the_runs_checkpoints_is_refused_before_anything_is_written(
    toy, huge_model, capsys
):
    code = main(["run", TOY, *toy.overrides("huge", 2, f"actor.path={huge_model}", "recover_keep=1")])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(rf"'cluster.fileroot': {toy.fileroot} has [\d.]+ GB free, but the run needs about", err)
    assert "(2 recover checkpoints): free some, lower recover_keep" in err
    assert re.search(r"/dev/shm has [\d.]+ GB free, but the trainers' recover checkpoint buffers take", err)
    assert sorted(p.name for p in toy.fileroot.iterdir()) == ["huge"]  # no run directory


def test_only_a_run_on_this_machine_asks_for_its_dev_shm(toy, huge_model):
    cfg = toy.config("huge", 2, f"actor.path={huge_model}")
    assert any("/dev/shm" in p for p in storage_problems(cfg, here=True))
    assert not any("/dev/shm" in p for p in storage_problems(cfg, here=False))  # the nodes' is not this one's
    assert storage_problems(toy.config("tiny", 2), here=True) == []


def test_a_lora_runs_recover_checkpoints_are_sized_by_its_adapters(toy, huge_model):
    """They hold the adapters only (the base is the model's path): a model whose full checkpoints fit nowhere
    trains adapters on the same storage."""
    lora = ("actor.lora.rank=8", "weight_update_mode=adapter")
    assert storage_problems(toy.config("huge", 2, f"actor.path={huge_model}", *lora, "actor.lora.target_modules=[q_proj,v_proj]"), here=True) == []  # fmt: skip
    # all-linear, counted as PEFT counts the adapters it adds to the tiny model
    from transformers import AutoModelForCausalLM

    from areal_hpc.train import lora as train_lora

    model = train_lora.add_adapters(
        AutoModelForCausalLM.from_pretrained(toy.model_dir), 8, 16.0, 0.0, ["all-linear"]
    )
    peft_count = sum(p.numel() for name, p in model.named_parameters() if train_lora.is_adapter(name))
    assert trained_parameter_count(toy.config("tiny", 2, *lora)) == peft_count


def test_a_file_root_that_cannot_rename_over_a_file_is_refused(toy, monkeypatch):
    """Some FUSE and object-store mounts: every shared file of a run is written to a temporary name and renamed."""

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    monkeypatch.setattr(os, "replace", refuse)
    (problem,) = storage_problems(toy.config("no-rename", 2), here=False)
    assert problem.startswith(
        f"'cluster.fileroot': {toy.fileroot} cannot hold the run directory: writing and"
    )
    assert list(toy.fileroot.glob(".areal-probe-*")) == []  # the probe's files are gone


@pytest.mark.parametrize(
    "bad",
    [{"num_attention_heads": 0}, {"hidden_size": "1536"}, {"vocab_size": True}, {"num_key_value_heads": -2}],
)
def test_a_hostile_model_config_sizes_nothing_instead_of_crashing_the_preflight(tmp_path, bad):
    config = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert parameter_count(str(tmp_path)) == 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 256) + 2 * 100 * 64
    (tmp_path / "config.json").write_text(json.dumps(config | bad))
    assert parameter_count(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert parameter_count(str(tmp_path)) is None
