"""The sbatch text of the shipped configs, pinned by golden files (UPDATE_GOLDEN=1 pytest ... rewrites them)."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control import RunDir
from areal_hpc.launch.local import plan_roles
from areal_hpc.launch.plan import PlanError, launch_plan
from areal_hpc.launch.sbatch import render
from areal_hpc.launch.submit import dry_run_text, prepare

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
PINNED = ["trial_name=golden", "cluster.slurm.python=/opt/areal/bin/python"]


def config(*files, overrides=()):
    return load_config([REPO / "configs" / f for f in files], [*PINNED, *overrides])


def scripts_of(cfg):
    run = RunDir(Path("/shared/runs") / cfg.experiment_name / "golden")
    plan = launch_plan(cfg, run, workdir=Path("/home/u/rl"))
    return plan, [render(plan, job, cfg, version="0.0-golden") for job in plan.jobs]


CASES = {
    "toy-hetjob": (("toy-cpu.yaml",), ()),
    "toy-two-jobs": (("toy-cpu.yaml",), ("cluster.slurm.hetjob=false",)),
    "qwen3-1.7b-8gpu": (("qwen3-1.7b-8gpu.yaml",), ()),
    "qwen3-1.7b-32gpu": (("qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-32gpu.yaml"), ()),
    "qwen2.5-32b-64gpu-megatron": (("qwen3-1.7b-8gpu.yaml", "qwen2.5-32b-64gpu-megatron.yaml"), ()),
    "qwen3-1.7b-1gpu-colocated": (("qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-1gpu-colocated.yaml"), ()),
    "qwen2.5-7b-1gpu-lora": (("qwen3-1.7b-8gpu.yaml", "qwen2.5-7b-1gpu-lora.yaml"), ()),
    "qwen3-1.7b-8gpu-tools": (("qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-8gpu-tools.yaml"), ()),
    "qwen3-30b-a3b-16gpu-megatron": (("qwen3-1.7b-8gpu.yaml", "qwen3-30b-a3b-16gpu-megatron.yaml"), ()),
    "qwen3-235b-a22b-128gpu-megatron": (("qwen3-1.7b-8gpu.yaml", "qwen3-235b-a22b-128gpu-megatron.yaml"), ()),
    "qwen3-8b-32gpu-long": (("qwen3-1.7b-8gpu.yaml", "qwen3-8b-32gpu-long.yaml"), ()),
}


@pytest.mark.parametrize("name", CASES)
def test_rendered_sbatch_matches_the_golden_file_and_is_valid_bash(name, tmp_path):
    files, overrides = CASES[name]
    _, scripts = scripts_of(config(*files, overrides=overrides))
    for i, text in enumerate(scripts):
        golden = GOLDEN / f"{name}.{i}.sh"
        if os.environ.get("UPDATE_GOLDEN"):
            golden.write_text(text)
        assert text == golden.read_text(), f"{golden} differs; UPDATE_GOLDEN=1 rewrites it after review"
        script = tmp_path / golden.name
        script.write_text(text)
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_the_toy_is_one_heterogeneous_job_with_servers_in_component_0():
    plan, (text,) = scripts_of(config("toy-cpu.yaml"))
    assert plan.kind == "hetjob"
    gen, train = plan.jobs[0].components
    assert [s.role for s in gen.steps] == ["gen_server"]
    assert [s.role for s in train.steps] == ["trainer", "controller"]
    assert (gen.partition, train.partition) == ("gen", "train")
    assert text.count("#SBATCH hetjob") == 1
    assert "srun --het-group=0" in text and "srun --het-group=1" in text
    assert "--kill-on-bad-exit=1" in text and "wait -n" in text


def test_one_node_decoupled_runs_as_one_plain_job_with_gpus_split_between_steps():
    plan, (text,) = scripts_of(config("qwen3-1.7b-8gpu.yaml"))
    assert plan.kind == "single"
    (component,) = plan.jobs[0].components
    assert component.gpus_per_node == 8
    roles = [(s.role, s.gpus_per_node) for s in component.steps]
    assert roles == [("gen_server", 4), ("trainer", 4), ("controller", 0), ("rollout", 0)]  # async_rl
    assert "--het-group" not in text


def test_colocated_servers_share_every_node_and_gpu_of_the_trainers():
    overrides = ["allocation_mode=d16p1m1", "cluster.n_nodes=2", "async_rl=false", "weight_update_mode=disk"]
    plan, (text,) = scripts_of(config("qwen3-1.7b-8gpu.yaml", overrides=overrides))
    assert plan.kind == "single"
    (component,) = plan.jobs[0].components
    assert (component.nodes, component.gpus_per_node) == (2, 8)
    gen, train = component.steps[:2]
    assert (gen.role, gen.ntasks, gen.gpus_per_node, gen.overlap) == ("gen_server", 16, 8, True)
    assert (train.role, train.ntasks, train.gpus_per_node, train.overlap) == ("trainer", 16, 8, False)
    assert "--nodes=2 --ntasks=16 --ntasks-per-node=8 --cpus-per-task=8 --gpus-per-node=8 --overlap" in text


def test_site_options_reach_the_script():
    overrides = [
        "cluster.slurm.account=proj42",
        "cluster.slurm.qos=high",
        "cluster.slurm.time=2-00:00:00",
        "cluster.slurm.exclude=n7",
        "cluster.slurm.extra_sbatch_lines=['--reservation=rl']",
        "cluster.slurm.setup_commands=['module load cuda/12.4']",
        "cluster.slurm.command_prefix=apptainer exec --nv /img/areal.sif",
    ]
    _, (text,) = scripts_of(config("toy-cpu.yaml", overrides=overrides))
    for line in ["#SBATCH --account=proj42", "#SBATCH --qos=high", "#SBATCH --time=2-00:00:00",
                 "#SBATCH --exclude=n7", "#SBATCH --reservation=rl", "\nmodule load cuda/12.4\n",
                 "apptainer exec --nv /img/areal.sif /opt/areal/bin/python -P -m areal_hpc.launch.roles"]:  # fmt: skip
        assert line in text


def test_a_layout_slurm_cannot_place_is_refused_naming_the_field():
    # 4 nodes, generation on 4 GPUs: generation and training would share node 0.
    cfg = config(
        "qwen3-1.7b-8gpu.yaml", overrides=["cluster.n_nodes=4", "allocation_mode=builtin.d4p1m1+d28p1m1"]
    )
    with pytest.raises(PlanError, match="allocation_mode: generation and training share node 0"):
        launch_plan(cfg, RunDir(Path("/x")))
    with pytest.raises(PlanError, match="slurm.nodelist"):
        launch_plan(config("toy-cpu.yaml", overrides=["cluster.slurm.nodelist=n1"]), RunDir(Path("/x")))


def test_dry_run_writes_nothing(tmp_path, toy):
    cfg = config("toy-cpu.yaml", overrides=toy.overrides("golden", 2))
    text = dry_run_text(prepare(cfg))
    assert "layout: hetjob" in text and "#SBATCH hetjob" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.slurm.nodelist=n1", "cluster.slurm.nodelist"),
        ("allocation_mode=builtin.d1p1m1+d9p1m1", "allocation_mode"),
        ("cluster.slurm.cpus_per_gpu=0", "cluster.slurm.cpus_per_gpu"),
    ],
)
def test_submit_refuses_a_bad_config_before_writing_anything(tmp_path, capsys, override, message):
    code = main(["submit", str(REPO / "configs/toy-cpu.yaml"), f"cluster.fileroot={tmp_path}", override])
    assert code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_submit_without_slurm_says_so_and_writes_nothing(tmp_path, toy, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = main(["submit", str(REPO / "configs/toy-cpu.yaml"), *toy.overrides("t", 2)])
    assert code == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_attempt_requeues_the_job_while_the_configs_retries_last():
    overrides = ["recover_mode=auto", "recover_retries=3", "recover_after=7"]
    _, (text,) = scripts_of(config("toy-cpu.yaml", overrides=overrides))
    # Each run of the script begins an attempt, with the roles' python; exit code 3 (FINISHED) starts nothing.
    assert 'attempt=$(/opt/areal/bin/python -m areal_hpc.recover.attempt --run-dir "$AREAL_RUN_DIR")' in text
    assert 'export AREAL_ATTEMPT="$attempt"' in text and 'logs="$AREAL_RUN_DIR/logs/attempt$attempt"' in text
    assert '[ "$failures" -ge 3 ]' in text  # failed attempts, counted in the run directory
    assert '[ "$1" = 75 ]' in text  # stopped on a notice with a checkpoint: requeued, not counted
    assert "sleep 7 & wait $!" in text
    assert 'scontrol requeue "${SLURM_JOB_ID}" && exit 0' in text
    assert text.index("areal_hpc.recover.attempt") < text.index("srun ")  # before any step starts


def test_recover_mode_disabled_renders_no_requeue():
    _, (text,) = scripts_of(config("toy-cpu.yaml", overrides=["recover_mode=disabled"]))
    assert "scontrol requeue" not in text
    assert "recover_mode is disabled: the job is not requeued" in text


def test_the_two_jobs_of_a_run_never_requeue_or_begin_an_attempt_themselves():
    plan, scripts = scripts_of(config("toy-cpu.yaml", overrides=["cluster.slurm.hetjob=false"]))
    assert plan.kind == "two-jobs"
    for text in scripts:
        assert "scontrol requeue" not in text and "#SBATCH --no-requeue" in text  # nor may Slurm requeue one
        assert "areal_hpc.recover.attempt" not in text and "\nattempt=0\n" in text  # begun by `submit`
        assert "areal-hpc submit --recover $AREAL_RUN_DIR" in text


@pytest.mark.parametrize(
    "files, overrides",
    [
        (("toy-cpu.yaml",), ()),
        (("toy-cpu.yaml",), ("async_rl=true",)),
        (("toy-cpu.yaml", "toy-sft.yaml"), ()),
        (("qwen3-1.7b-8gpu.yaml",), ()),
        (("qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-32gpu.yaml"), ()),
    ],
)
def test_areal_hpc_run_starts_the_very_tasks_of_the_slurm_job(files, overrides):
    cfg = config(*files, overrides=overrides)
    run = RunDir(Path("/x"))
    slurm_tasks = Counter(
        s.role for job in launch_plan(cfg, run).jobs for s in job.steps for _ in range(s.ntasks)
    )
    assert Counter(role.argv[-1] for role in plan_roles(cfg, run)) == slurm_tasks
    assert ("rollout" in slurm_tasks) == (cfg.experiment_type == "ppo" and cfg.async_rl)


def test_roles_import_the_launchers_package_from_a_folder_holding_another_checkout(tmp_path):
    """A run started beside another areal_hpc (a clone kept for its configs) runs the installed roles: plain
    `python -m` would import the folder's copy first, and a benchmark's "baseline" once ran today's roles so."""
    (tmp_path / "areal_hpc").mkdir()
    (tmp_path / "areal_hpc" / "__init__.py").write_text(
        "raise SystemExit('the copy in the working folder')\n"
    )
    [role, *_] = plan_roles(config("toy-cpu.yaml"), RunDir(Path("/x")))
    entry = role.argv[: role.argv.index("--run-dir")]
    assert entry[-1] == "areal_hpc.launch.roles"
    ran = subprocess.run([*entry, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "--run-dir" in ran.stdout, ran.stderr
    plain = subprocess.run(
        [sys.executable, "-m", entry[-1], "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "the copy in the working folder" in plain.stderr
    script = (GOLDEN / "toy-two-jobs.0.sh").read_text()
    assert " -P -m areal_hpc.launch.roles " in script  # the job script's roles alike
