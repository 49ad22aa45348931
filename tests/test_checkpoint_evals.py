"""Evaluation of each saved checkpoint in a job of its own (eval.enabled): a toy run on local processes
evaluates its checkpoints and logs their metrics at their steps; a failing evaluation stops nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import submitit

from areal_hpc.config import load_config
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch import runs, slurm, submit
from areal_hpc.launch.local import run_local
from areal_hpc.master.checkpoint_evals import CheckpointEvals
from areal_hpc.monitor.stats import StatsLog, read_stats

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "eval"
EVAL = ("eval.enabled=true", f"eval.data_dir={DATA}", "eval.data_names=[math_500]", "eval.n_sampling=2",
        "eval.max_gen_tokens=4")  # fmt: skip


def test_each_saved_checkpoint_is_evaluated_and_its_metrics_join_the_statistics(toy):
    # One save, at the last step (several: the restart test below).
    cfg = toy.config("evals", 2, *EVAL, "exp_ctrl.save_freq_steps=null", "recover_mode=disabled")
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    evals = {r["step"]: r for r in read_stats(run.stats) if "eval/math_500/greedy_acc" in r}
    assert sorted(evals) == [2]
    assert all(
        r["eval/math_500/num_questions"] == 20 and "eval/math_500/sample_pass@1" in r for r in evals.values()
    )
    assert (run.eval_results(2) / "results.json").is_file() and (
        run.eval_results(2) / "math_500.jsonl"
    ).is_file()


def test_a_failed_evaluation_is_logged_and_training_goes_on(toy, tmp_path, caplog):
    cfg = toy.config("evals-fail", 2, *EVAL, f"eval.data_dir={tmp_path}")  # the set is gone when the job runs
    stats = StatsLog(tmp_path / "stats.jsonl")
    evals = CheckpointEvals(cfg, run_dir_of(cfg), stats, submitit.LocalExecutor(folder=tmp_path / "jobs"))
    evals.submit(1, toy.model_dir)
    evals.finish(timeout=120)
    assert (
        "(step 1) failed: areal_hpc.eval.datasets.EvalDataError: no evaluation set 'math_500'" in caplog.text
    )
    assert read_stats(stats.path) == [] and evals.done == set()


@pytest.mark.slurm
@pytest.mark.slow  # the Slurm executor is test_eval_cli's `eval --submit`; the evaluations, the local test's
def test_on_slurm_each_checkpoint_is_evaluated_by_a_job_on_the_generation_partition(slurm_env, toy):
    overrides = [*toy.overrides("evals-slurm", 1, *EVAL), "exp_ctrl.save_freq_steps=1"]
    sub = submit.prepare(load_config([ROOT / "configs/toy-cpu.yaml"], overrides))
    (job_id,) = submit.submit(sub)
    states = slurm.wait_final([job_id], timeout=240)
    assert set(states.values()) == {"COMPLETED"}, runs.log_files(sub.run)
    evals = [r for r in read_stats(sub.run.stats) if "eval/math_500/greedy_acc" in r]
    assert [r["step"] for r in evals] == [1], (sub.run.root / "logs").glob("**/controller.log")
    (script,) = (sub.run.evals / "jobs").glob("*_submission.sh")
    assert "#SBATCH --partition=gen" in script.read_text()


def test_evaluations_unfinished_at_a_recover_checkpoint_run_again_after_a_restart(toy, tmp_path):
    def cheap_evaluation(opts) -> dict:  # which checkpoints get evaluated is tested here, not how
        return {"math_500": {"greedy_acc": 50.0, "num_questions": 20}}  # (a local function: pickled whole)

    cfg = toy.config("evals-restart", 2, *EVAL, "eval.max_concurrent_jobs=1")
    stats = StatsLog(tmp_path / "stats.jsonl")
    before = CheckpointEvals(cfg, run_dir_of(cfg), stats, submitit.LocalExecutor(folder=tmp_path / "a"))
    before.submit(1, toy.model_dir)  # started
    before.submit(2, toy.model_dir)  # waits for a free slot
    state = before.state_dict()  # ... in a recover checkpoint; then the run dies, and its jobs with it
    before.running[1][1].cancel(check=False)
    assert state["pending"] == [[1, str(toy.model_dir)], [2, str(toy.model_dir)]]
    after = CheckpointEvals(
        cfg, run_dir_of(cfg), stats, submitit.LocalExecutor(folder=tmp_path / "b"), job=cheap_evaluation
    )
    after.load_state_dict(state)
    after.finish(timeout=120)
    assert [r["step"] for r in read_stats(stats.path)] == [1, 2] and after.done == {1, 2}
