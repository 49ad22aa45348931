"""`areal-hpc eval` on the tiny model over a 20-question slice of MATH-500 (tests/data/eval), served by the
built-in generation server on the CPU; with --submit, as a job on the local Slurm cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.eval import results_table
from areal_hpc.launch import slurm

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "eval"


def test_eval_writes_every_answer_and_the_metrics_of_each_set(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", "--model_path", str(tiny_model_dir), "--output_path", str(out), "--data_names", "math_500",
            "--data_dir", str(DATA), "--max_gen_tokens", "8", "--n_sampling", "4"]  # fmt: skip
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    metrics = results["results"]["math_500"]
    assert metrics["num_questions"] == 20 and results["options"]["n_sampling"] == 4
    assert {"greedy_acc", "sample_pass@1", "pass@1", "maj@1", "greedy_length", "sample_length"} <= set(
        metrics
    )
    assert 1 <= metrics["greedy_length"] <= 8
    answers = [json.loads(line) for line in (out / "math_500.jsonl").read_text().splitlines()]
    assert [a["question_id"] for a in answers] == [f"math_500-{i}" for i in range(1, 21)]
    assert all(len(a["samples"]) == 4 and a["greedy"]["tokens"] <= 8 for a in answers)
    printed = capsys.readouterr().out
    assert "num_questions" in printed and "math_500" in printed and str(out / "results.json") in printed


def test_bad_options_and_missing_sets_are_refused_before_anything_is_written(
    tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "eval"
    base = ["eval", "--model_path", str(tiny_model_dir), "--output_path", str(out), "--data_dir", str(DATA)]
    assert main([*base, "--data_names", "math_500,aime99"]) == 2
    assert "no evaluation set 'aime99'" in capsys.readouterr().err
    assert main([*base, "--n_sampling", "-1", "--top_p", "0"]) == 2
    err = capsys.readouterr().err
    assert "--n_sampling is -1" in err and "--top_p is 0.0" in err
    assert main(["eval", "--model_path", str(tmp_path), "--output_path", str(out)]) == 2
    assert "no Hugging Face model there" in capsys.readouterr().err
    assert main([*base, "--data_names", "aime99", "--submit"]) == 2  # refused before it is queued
    assert "no evaluation set 'aime99'" in capsys.readouterr().err
    assert not out.exists()


def test_the_table_lists_each_set_with_the_columns_it_has():
    table = results_table({
        "math_500": {"num_questions": 500, "greedy_acc": 84.4, "sample_pass@1": 92.66, "greedy_length": 3000.0},
        "aime24": {"num_questions": 30, "greedy_acc": 50.0, "greedy_length": 9000.5},
    })  # fmt: skip
    header, first, second = table.splitlines()
    assert header.split() == ["data", "num_questions", "greedy_acc", "sample_pass@1", "greedy_length"]
    assert first.split() == ["math_500", "500", "84.4", "92.7", "3000.0"]
    assert second.split() == ["aime24", "30", "50.0", "-", "9000.5"]


@pytest.mark.slurm
def test_submit_runs_it_as_a_slurm_job_on_the_generation_partition(
    slurm_env, tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "eval"
    args = ["eval", "--model_path", str(tiny_model_dir), "--output_path", str(out), "--data_names", "math_500",
            "--data_dir", str(DATA), "--max_gen_tokens", "4", "--n_sampling", "2",
            "--submit", str(ROOT / "configs/toy-cpu.yaml")]  # fmt: skip
    assert main(args) == 0
    job_id = re.search(r"submitted Slurm job (\d+) \(partition gen\)", capsys.readouterr().out).group(1)
    assert slurm.wait_final([job_id], timeout=240) == {job_id: "COMPLETED"}
    assert json.loads((out / "results.json").read_text())["results"]["math_500"]["num_questions"] == 20
    (script,) = (out / "slurm").glob("*_submission.sh")
    assert (
        "#SBATCH --partition=gen" in script.read_text() and "#SBATCH --gpus-per-node=1" in script.read_text()
    )
