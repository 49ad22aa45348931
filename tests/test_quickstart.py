"""Every command of docs/quickstart.md works as written: each parses; submissions pass `--dry-run` with the
site's paths (/shared/...) standing in a temporary folder; the commands that read a run run on one; the
dataset line and the install extras it shows are real."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest

from areal_hpc.cli import build_parser, main
from areal_hpc.config import load_config
from areal_hpc.control import COMPLETE, set_status
from areal_hpc.control.rundir import create_run_dir
from areal_hpc.data import read_prompt_records
from areal_hpc.monitor import StatsLog

ROOT = Path(__file__).resolve().parents[1]
SGLANG_SRC = ROOT / ".cache" / "sglang-src"
DOC = (ROOT / "docs" / "quickstart.md").read_text()
READS_A_RUN = ("status", "logs", "plot", "list")
# Run on the local Slurm cluster by their own tests: eval --submit (test_eval_cli.py), submit --recover
# and stop (test_slurm_requeue.py, test_runs.py).
ON_SLURM = ("eval", "stop")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, flags=re.S)


def commands(verb: str | None = None) -> list[list[str]]:
    """The `areal-hpc` command lines of the shell blocks (without the program name and comments)."""
    lines = [line for block in blocks("sh") for line in block.replace("\\\n", " ").splitlines()]
    argvs = [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("areal-hpc ")]
    return [argv for argv in argvs if verb is None or argv[0] == verb]


def at_site(argv: list[str], site: Path) -> list[str]:
    return [arg.replace("/shared", str(site)) for arg in argv]


@pytest.fixture
def site(tmp_path, tiny_build) -> Path:
    """/shared of the page: the model (the tiny one in its place) and a dataset of 1,000 prompts."""
    model = shutil.copytree(tiny_build.model_dir, tmp_path / "models" / "Qwen3-1.7B")
    config = json.loads(
        (model / "config.json").read_text()
    )  # its context as well: the recipe's answers fit it
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40960}))
    (tmp_path / "data").mkdir()
    shutil.copy(tiny_build.train_path, tmp_path / "data" / "math.jsonl")
    return tmp_path


def test_the_page_shows_every_step_as_a_command():
    verbs = {argv[0] for argv in commands()}
    assert verbs == {"submit", "status", "logs", "plot", "list", "eval", "stop"}
    assert len(commands()) >= 9


def test_every_command_parses():
    parser = build_parser()
    for argv in commands():
        parser.parse_args(argv)  # SystemExit on a misspelt flag or verb


def test_each_submission_passes_its_dry_run(site, capsys, monkeypatch):
    # The recipes generate with SGLang, which must be installed where the job runs: its source stands in
    # (`make test` unpacks it; its CUDA kernels cannot be installed here, and a dry run imports nothing of it).
    monkeypatch.syspath_prepend(str(SGLANG_SRC))
    submissions = [argv for argv in commands("submit") if "--recover" not in argv]
    assert len(submissions) == 2
    for argv in submissions:
        dry = [a for a in at_site(argv, site) if a != "--dry-run"] + ["--dry-run"]
        assert main(dry) == 0, capsys.readouterr().err
        assert "#SBATCH" in capsys.readouterr().out
    assert not (site / "areal_hpc").exists()  # a dry run writes nothing


def test_the_commands_that_read_a_run_run_on_one(site, capsys):
    (argv, *_) = commands("submit")
    cfg = load_config(
        [a for a in argv[1:] if a.endswith(".yaml")], [a for a in at_site(argv, site) if "=" in a]
    )
    run = create_run_dir(cfg)
    StatsLog(run.stats).write(1, {"ppo_actor/task_reward/avg": 0.25, "timeperf/e2e": 30.0})
    run.attempt_logs(0).mkdir()
    (run.attempt_logs(0) / "controller.log").write_text("Training 10 steps\n")
    set_status(run, COMPLETE, role="controller", reason="finished")  # --watch returns at once
    for argv in (a for verb in READS_A_RUN for a in commands(verb)):
        assert main(at_site(argv, site)) == 0, argv
    out = capsys.readouterr().out
    assert "COMPLETE" in out and "Training 10 steps" in out and str(run.plots / "reward.png") in out


def test_the_commands_run_on_slurm_by_other_tests_are_the_ones_named():
    others = {argv[0] for argv in commands()} - {"submit", *READS_A_RUN}
    assert others == set(ON_SLURM)
    assert [argv for argv in commands("submit") if "--recover" in argv]


def test_the_dataset_line_is_a_valid_dataset(tmp_path):
    (line,) = blocks("json")
    (tmp_path / "d.jsonl").write_text(line)
    assert read_prompt_records(tmp_path / "d.jsonl") == [
        ("q1", "What is 3 + 4?", "math", ("\\boxed{7}",), None, None, None)
    ]


def test_the_extras_it_installs_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (install,) = [line for block in blocks("sh") for line in block.splitlines() if "pip install -e" in line]
    named = re.search(r"\.\[([a-z,]+)\]", install).group(1).split(",")
    assert set(named) <= set(extras)
