"""The SGLang backend's server command for the shipped SGLang config, pinned by a golden file
(UPDATE_GOLDEN=1 rewrites it), and what validation says of SGLang options and layouts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, allocation_of, load_config
from areal_hpc.control import RunContext, RunDir
from areal_hpc.gen.backends.sglang import server_command
from areal_hpc.gen.server_role import server_spec

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
LAYERS = ["qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-8gpu-sglang.yaml"]
# golden name: the config's layers and the GPUs each gen_server step sees (srun --gpus-per-node of its sbatch)
CASES = {
    "qwen3-1.7b-8gpu-sglang": (LAYERS, 4),
    "qwen3-1.7b-1gpu-colocated": (["qwen3-1.7b-8gpu.yaml", "qwen3-1.7b-1gpu-colocated.yaml"], 1),
}


def commands(cfg, visible: int) -> str:
    """Each server's command as its gen_server task runs it, ports pinned."""
    run = RunDir(Path("/shared/runs") / cfg.experiment_name / "golden")
    allocation = allocation_of(cfg)
    lines = []
    for i in range(len(allocation.gen_servers())):
        ctx = RunContext(run, cfg, allocation, "gen_server", i, visible, attempt=0, local=False)
        spec = server_spec(ctx, visible=visible)
        lines.append(" ".join(server_command(spec, 30000 + i, python="/opt/areal/bin/python")))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", CASES)
def test_each_server_command_matches_the_golden_file(name):
    layers, visible = CASES[name]
    cfg = load_config([REPO / "configs" / f for f in layers], ["trial_name=golden"])
    text, golden = commands(cfg, visible), GOLDEN / f"{name}.servers.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; UPDATE_GOLDEN=1 rewrites it after review"
    assert ("--enable-memory-saver" in text) == ("colocated" in name)  # else release frees nothing
    first = text.splitlines()[0].split()
    assert first[first.index("--token-file") + 1] == "/shared/runs/qwen3-1.7b-async/golden/secret"
    assert "--api-key" not in first  # the key is read from the secret file in the child, off the command line


def test_sglang_options_apply_to_sglang_servers_only():
    with pytest.raises(
        ConfigError, match="'sglang.mem_fraction_static' is set, but the generation backend is 'builtin'"
    ):
        load_config([REPO / "configs/toy-cpu.yaml"], ["sglang.mem_fraction_static=0.5"])


def test_a_server_wider_than_a_node_is_refused():
    with pytest.raises(ConfigError, match="an SGLang server of tensor size 16 spans nodes of 8 GPUs"):
        load_config(
            [REPO / "configs/qwen3-1.7b-8gpu.yaml"],
            ["allocation_mode=sglang.d1p1m16+d16p1m1", "cluster.n_nodes=4"],
        )


def test_a_submission_without_sglang_installed_is_refused_before_anything_is_written(
    tiny_build, tmp_path, capsys
):
    from areal_hpc.cli import main

    args = [str(REPO / "configs" / f) for f in LAYERS] + [
        f"actor.path={tiny_build.model_dir}", f"dataset.path={tiny_build.train_path}", f"cluster.fileroot={tmp_path}",
    ]  # fmt: skip
    assert main(["submit", *args, "--dry-run"]) == 2  # this environment has no sglang (its kernels need CUDA)
    assert "servers are SGLang's, but sglang is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
