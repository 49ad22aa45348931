"""The SGLang backend's server command for the shipped SGLang config, pinned by a golden file
(UPDATE_GOLDEN=1 rewrites it), and what validation says of SGLang options and layouts."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, allocation_of, load_config
from areal_hpc.control import RunContext, RunDir, fsio
from areal_hpc.gen.backends.sglang import server_command
from areal_hpc.gen.server_role import meeting_point, server_spec
from areal_hpc.launch.plan import launch_plan

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
# golden name: the config's layers and overrides, and the GPUs each gen_server step sees (srun --gpus-per-node)
CASES = {
    "qwen3-1.7b-8gpu": (["qwen3-1.7b-8gpu.yaml"], [], 4),
    "qwen3-1.7b-32gpu": (["qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-32gpu.yaml"], [], 8),
    "qwen2.5-32b-64gpu-megatron": (["qwen3-1.7b-8gpu.yaml", "qwen2.5-32b-64gpu-megatron.yaml"], [], 8),
    "qwen3-1.7b-1gpu-colocated": (["qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-1gpu-colocated.yaml"], [], 1),
    "qwen2.5-7b-1gpu-lora": (["qwen3-1.7b-8gpu.yaml", "qwen2.5-7b-1gpu-lora.yaml"], [], 1),
    "qwen3-30b-a3b-16gpu-megatron": (["qwen3-1.7b-8gpu.yaml", "qwen3-30b-a3b-16gpu-megatron.yaml"], [], 8),
    "qwen3-8b-32gpu-long": (["qwen3-1.7b-8gpu.yaml", "qwen3-8b-32gpu-long.yaml"], [], 8),
    "qwen3-235b-a22b-128gpu-megatron": (
        ["qwen3-1.7b-8gpu.yaml", "qwen3-235b-a22b-128gpu-megatron.yaml"],
        [],
        8,
    ),
    # servers of tensor size 16 on two nodes each, a task per node (not a shipped config)
    "sglang-tp16-two-nodes": (
        ["qwen3-1.7b-8gpu.yaml", "qwen2.5-32b-64gpu-megatron.yaml"],
        ["allocation_mode=sglang.d2p1m16+d4p2m4", "actor.path=/shared/models/Qwen2.5-72B"],
        8,
    ),
}


def commands(cfg, visible: int) -> str:
    """Each gen_server task's command, ports and multi-node meeting points pinned."""
    run = RunDir(Path("/shared/runs") / cfg.experiment_name / "golden")
    allocation = allocation_of(cfg)
    lines = []
    for i, (server, _) in enumerate(allocation.gen_tasks()):
        ctx = RunContext(run, cfg, allocation, "gen_server", i, visible, attempt=0, local=False)
        meet = f"node{server.node:02d}:45000" if server.n_nodes > 1 else None
        spec = server_spec(ctx, visible=visible, dist_init_addr=meet)
        lines.append(" ".join(server_command(spec, 30000 + server.index, python="/opt/areal/bin/python")))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", CASES)
def test_each_server_command_matches_the_golden_file(name):
    layers, overrides, visible = CASES[name]
    cfg = load_config([REPO / "configs" / f for f in layers], ["trial_name=golden", *overrides])
    text, golden = commands(cfg, visible), GOLDEN / f"{name}.servers.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; UPDATE_GOLDEN=1 rewrites it after review"
    assert ("--enable-memory-saver" in text) == allocation_of(cfg).colocated  # else release frees nothing
    first = text.splitlines()[0].split()
    assert first[first.index("--token-file") + 1] == f"/shared/runs/{cfg.experiment_name}/golden/secret"
    assert "--api-key" not in first  # the key is read from the secret file in the child, off the command line


def test_sglang_options_apply_to_sglang_servers_only():
    with pytest.raises(ConfigError, match="'sglang.log_level' does nothing here: it applies to SGLang"):
        load_config([REPO / "configs/toy-cpu.yaml"], ["sglang.log_level=info"])
    load_config([REPO / "configs/toy-cpu.yaml"], ["sglang.mem_fraction_static=0.5"])  # the built-in's too


def test_a_server_wider_than_a_node_runs_a_task_on_each_of_its_nodes():
    layers, overrides, _ = CASES["sglang-tp16-two-nodes"]
    cfg = load_config([REPO / "configs" / f for f in layers], overrides)
    lines = commands(cfg, 8).splitlines()
    assert len(lines) == 4  # two servers, two nodes each
    for line, (server, rank) in zip(lines, [(0, 0), (0, 1), (1, 0), (1, 1)], strict=True):
        assert f"--nnodes 2 --node-rank {rank}" in line and "--tp-size 16 --base-gpu-id 0" in line
        assert f"--dist-init-addr node{2 * server:02d}:45000" in line
    plan = launch_plan(cfg, RunDir(Path("/x")))
    (gen,) = (s for s in plan.jobs[0].steps if s.role == "gen_server")
    assert (gen.nodes, gen.ntasks, gen.ntasks_per_node, gen.gpus_per_node) == (4, 4, 1, 8)


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    thread.start()
    return thread, box


def test_node_ranks_meet_where_node_rank_0_wrote_this_attempt(tmp_path):
    layers, overrides, _ = CASES["sglang-tp16-two-nodes"]
    cfg = load_config([REPO / "configs" / f for f in layers], overrides)
    run, allocation = RunDir(tmp_path), allocation_of(cfg)
    run.gen_servers.mkdir()
    fsio.write_json(run.gen_dist_init(1), {"addr": "stale:1", "attempt": 0})  # the last attempt's

    def ctx(index: int) -> RunContext:
        return RunContext(run, cfg, allocation, "gen_server", index, 4, attempt=1, local=True)

    waiter, found = in_thread(meeting_point, ctx(3))  # server 1, node rank 1
    time.sleep(0.3)
    assert not found  # not the stale one
    addr = meeting_point(ctx(2))
    waiter.join(10)
    assert found == [addr] and addr.startswith("127.0.0.1:")


def test_a_submission_without_sglang_installed_is_refused_before_anything_is_written(
    tiny_build, tmp_path, capsys
):
    from areal_hpc.cli import main

    args = [str(REPO / "configs" / "qwen3-1.7b-8gpu.yaml")] + [
        f"actor.path={tiny_build.model_dir}", f"dataset.path={tiny_build.train_path}", f"cluster.fileroot={tmp_path}",
        "ppo.gen.max_new_tokens=1000",  # the tiny model's context is 2048
    ]  # fmt: skip
    assert main(["submit", *args, "--dry-run"]) == 2  # this environment has no sglang (its kernels need CUDA)
    assert "servers are SGLang's, but sglang is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
