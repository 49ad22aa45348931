"""The tiny Qwen3-MoE learns the toy code tasks under GRPO on the megatron backend, its experts split over two
trainer ranks and its routing replayed from the generation server, from one supervised warm-up (as the dense
model does in tests/test_algorithm_learning.py)."""

from __future__ import annotations

from areal_hpc.config import load_config
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats
from areal_hpc.monitor.summary import learning_summary
from tests.helpers import REPO_ROOT
from tests.test_algorithm_learning import CONFIGS, MIN_REWARD_GAIN, WARM_UP

MOE = (
    "actor.backend=megatron", "allocation_mode=builtin.d1p1m1+d2p1m1e2", "cluster.n_nodes=1",
    "cluster.n_gpus_per_node=3",
)  # fmt: skip


def test_the_tiny_moe_learns_with_its_experts_split_and_routing_replayed(tmp_path, tiny_build):
    common = [
        f"cluster.fileroot={tmp_path}", f"dataset.path={tiny_build.root / 'data' / 'code' / 'train.jsonl'}",
        "dataset.valid_path=null", "logging.tensorboard=false", "recover_mode=disabled", *MOE,
    ]  # fmt: skip
    warm_up = load_config(
        [*CONFIGS, REPO_ROOT / "configs" / "toy-sft.yaml"],
        [*common, "trial_name=warm-up", f"actor.path={tiny_build.moe_dir}", *WARM_UP],
    )
    assert run_local(warm_up) == 0
    (checkpoint,) = (run_dir_of(warm_up).root / "checkpoints" / "actor").iterdir()
    cfg = load_config(
        CONFIGS, [*common, "trial_name=grpo", f"actor.path={checkpoint}", "actor.router_replay=rollout"]
    )
    assert run_local(cfg) == 0
    rows = read_stats(run_dir_of(cfg).stats)
    summary = learning_summary(rows, window=3)
    assert summary["reward_last"] - summary["reward_first"] >= MIN_REWARD_GAIN, summary
    assert all(
        r["ppo_actor/moe/replay_mismatch"] < 0.05 for r in rows if "ppo_actor/moe/replay_mismatch" in r
    )
