"""Asynchronous RL end to end: a rollout role feeding the trainer through the rollout store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.config import load_config
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.launch.run_status import status_rows
from areal_hpc.monitor.stats import read_stats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def easy_data(tiny_build) -> Path:
    return tiny_build.root / "data" / "easy"


def run_toy(tmp_path, model_dir, data, trial: str, *extra: str):
    overrides = [
        f"cluster.fileroot={tmp_path}", f"trial_name={trial}", f"actor.path={model_dir}",
        f"dataset.path={data / 'train.jsonl'}", f"dataset.valid_path={data / 'test.jsonl'}",
        "cluster.n_nodes=1", "cluster.n_gpus_per_node=2", "dataset.train_bs_n_seqs=8", "group_size=4",
        "ppo.gen.max_new_tokens=8", *extra,
    ]  # fmt: skip
    cfg = load_config([ROOT / "configs/toy-cpu.yaml"], overrides)
    assert run_local(cfg) == 0
    return run_dir_of(cfg)


def final_weights(run) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run.root / "checkpoints" / "actor").iterdir())[-1:]
    return load_file(ckpt / "model.safetensors")


def test_eta_0_first_update_equals_the_synchronous_update(tmp_path, tiny_model_dir, easy_data):
    # One optimizer update; without advantage normalisation the untrained model's constant reward moves it.
    one_update = [
        "exp_ctrl.benchmark_steps=1",
        "ppo.ppo_n_minibatches=1",
        "actor.optimizer.warmup_steps_proportion=0",
    ]
    one_update += ["ppo.adv_norm=false", "ppo.group_adv_norm=false"]
    # One row at a time: rows batched differently round differently (CPU matmuls of other sizes), and Adam's
    # first step turns the rounding of a near-zero gradient into +-lr.
    one_update.append("max_running_requests=1")
    sync = run_toy(tmp_path, tiny_model_dir, easy_data, "sync", *one_update)
    eta0_async = ("async_rl=true", "max_head_offpolicyness=0", "n_rollout_workers=1")
    eta0 = run_toy(tmp_path, tiny_model_dir, easy_data, "eta0", *one_update, *eta0_async)
    before = load_file(tiny_model_dir / "model.safetensors")
    after_sync, after_async = final_weights(sync), final_weights(eta0)
    assert any(not torch.equal(before[k], after_sync[k]) for k in before)  # the update did something
    for name, tensor in after_sync.items():
        torch.testing.assert_close(after_async[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    (sync_step,), (async_step,) = Ledger(sync.ledger).records(), Ledger(eta0.ledger).records()
    assert sorted(sync_step.ids) == sorted(async_step.ids)  # the same prompts


def test_generation_runs_ahead_of_training(tmp_path, tiny_model_dir, easy_data, capsys):
    run = run_toy(
        tmp_path, tiny_model_dir, easy_data, "eta2", "async_rl=true", "max_head_offpolicyness=2",
        "n_rollout_workers=1", "exp_ctrl.benchmark_steps=6", "logging.progress=false",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "completed" in out and " step 6/6 " not in out  # no progress line
    steps = [r for r in read_stats(run.stats) if "ppo_actor/head_offpolicyness/max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert max(r["ppo_actor/head_offpolicyness/max"] for r in steps) >= 1  # trained on older weights' answers
    assert all(r["ppo_actor/tail_offpolicyness/max"] <= r["ppo_actor/head_offpolicyness/max"] for r in steps)
    assert [len(r.ids) for r in Ledger(run.ledger).records()] == [8] * 6
    shown = dict(status_rows(run))  # `areal-hpc status`: the generation manager's last counters
    assert re.fullmatch(r"0 \(at most \d+\); \d+ accepted, \d+ dropped", shown["rollouts in flight"])
    assert re.match(r"servers hold weight version \d; new rollouts aim at version \d \(bound \d\); last step's "
                    r"samples \d\.\d versions behind \(max \d\)", shown["staleness"])  # fmt: skip
    # The staleness bound itself is the manager's (tests/test_gen_manager.py): it bounds when a rollout may
    # start; an answer that outlives several versions is trained later, continued on newer weights.
