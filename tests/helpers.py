"""Helpers of the end-to-end tests: the toy experiment's settings, and the role processes of a run."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


class Toy:
    """The toy experiment (configs/toy-cpu.yaml) on the tiny model and easy data, with tiny batches so that a
    step takes about a second, its runs under `fileroot`."""

    def __init__(self, fileroot: Path, model_dir: Path, data: Path):
        self.fileroot, self.model_dir, self.data = fileroot, model_dir, data

    def overrides(self, trial: str, steps: int, *extra: str) -> list[str]:
        return [
            f"cluster.fileroot={self.fileroot}",
            f"trial_name={trial}",
            f"actor.path={self.model_dir}",
            f"dataset.path={self.data / 'train.jsonl'}",
            f"dataset.valid_path={self.data / 'test.jsonl'}",
            "dataset.train_bs_n_seqs=4",
            "group_size=2",
            "ppo.gen.max_new_tokens=6",
            f"exp_ctrl.benchmark_steps={steps}",
            *extra,
        ]

    def config(self, trial: str, steps: int, *extra: str):
        from areal_hpc.config import load_config

        return load_config([REPO_ROOT / "configs" / "toy-cpu.yaml"], self.overrides(trial, steps, *extra))


def role_pids(run_root: Path) -> dict[str, int]:
    """pid of each role process of a run, from /proc."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv if a]
        if "areal_hpc.launch.roles" in args and str(run_root) in args:
            role = next(a for a in args if a in ("controller", "gen_server", "trainer", "rollout"))
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
            index = "" if role in ("controller", "rollout") else env[b"SUBMITIT_LOCAL_GLOBALID"].decode()
            pids[role + index] = int(proc.name)
    return pids
