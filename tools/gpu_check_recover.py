"""Recovery on GPUs: a run whose controller or one of whose trainers is killed with SIGKILL mid-run; the restarted
attempt must resume from its recover checkpoint, build a new broadcast group, and end with every step trained
once and no prompt used twice. Not part of the test suite (CPU tests cover the same paths with gloo:
tests/test_recover_local.py, tests/test_faults.py on the local Slurm).

    python tools/gpu_check_recover.py [--steps 8] [--kill-at 4] [--async]          # the toy, 2 GPUs
    python tools/gpu_check_recover.py --kill trainer --shape 0.5b --gpus 4 --steps 10 \
        --allocation builtin.d2p1m1+d1p1m2 --backend megatron                      # issue 16's 4-GPU run

Without ``--kill-at`` the kill comes after a random step (``--seed``). ``--shape 0.5b`` trains a random-weight
model of Qwen2.5-0.5B's shape (built on the spot) with the toy's tokenizer and prompts. Prints the time from the
kill to the next completed step; exits 1 when the run fails or the ledger is wrong. On a CPU the GPUs are
worker slots (gloo): a dry run of the same layouts with the tiny model.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.control import fsio  # noqa: E402
from areal_hpc.control.heartbeat import last_beat  # noqa: E402
from areal_hpc.control.ledger import Ledger  # noqa: E402
from areal_hpc.control.rundir import run_dir_of  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from tools.bench_train import SHAPES, build_model, toy_tokenizer  # noqa: E402

TINY = REPO / ".cache" / "tiny"


def step_of(run) -> int:
    return (fsio.read_json(run.progress) or {}).get("step", 0)


def victim(run, kill: str, rng: random.Random) -> str:
    """The role to kill: the controller, or one of the trainers that beat now, at random."""
    if kill == "controller":
        return "controller"
    return rng.choice(sorted(f.stem for f in run.heartbeats.glob("trainer*.json")))


def killer(run, kill: str, at: int, rng: random.Random, times: dict) -> None:
    """SIGKILL ``kill`` after step ``at``; note whom and when, and when the next step completes."""
    while step_of(run) < at:
        time.sleep(0.02)
    times["victim"] = name = victim(run, kill, rng)
    os.kill(last_beat(run.heartbeats, name)["pid"], signal.SIGKILL)
    times["killed"] = time.monotonic()
    while step_of(run) <= at:  # progress.json is rewritten by the resumed controller's next step
        time.sleep(0.02)
    times["next_step"] = time.monotonic()


def model_overrides(shape: str, root: Path) -> list[str]:
    """The tiny model, or a random-weight model of a Qwen2.5 shape with the toy's tokenizer (its ids in range)."""
    if shape == "tiny":
        return [f"actor.path={TINY / 'model'}"]
    import torch

    model = root / "model"
    build_model(shape, model, "cuda" if torch.cuda.is_available() else "cpu")
    toy_tokenizer(model, TINY / "model")
    return [f"actor.path={model}", "actor.dtype=bfloat16", "dataset.train_bs_n_seqs=16", "group_size=4",
            "ppo.gen.max_new_tokens=256"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill", choices=("controller", "trainer"), default="controller")
    parser.add_argument("--kill-at", type=int, help="the step after which to kill (default: a random one)")
    parser.add_argument("--seed", type=int, default=None, help="for the random step and trainer")
    parser.add_argument("--async", dest="async_rl", action="store_true")
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the one node")
    parser.add_argument("--allocation", default="builtin.d1p1m1+d1p1m1", help="allocation_mode")
    parser.add_argument("--backend", default="fsdp", choices=("fsdp", "megatron"), help="actor.backend")
    parser.add_argument("--set", action="append", default=[], help="a further config override, key=value")
    ns = parser.parse_args()
    rng = random.Random(ns.seed)
    at = ns.kill_at if ns.kill_at is not None else rng.randint(2, ns.steps - 2)
    mode = "async" if ns.async_rl else "sync"
    with tempfile.TemporaryDirectory(prefix="gpu-recover-") as root:
        cfg = load_config(
            [REPO / "configs/toy-cpu.yaml"],
            [
                f"cluster.fileroot={root}", f"trial_name={mode}", f"dataset.path={TINY / 'data/easy/train.jsonl'}",
                "dataset.valid_path=null", "cluster.n_nodes=1", f"cluster.n_gpus_per_node={ns.gpus}",
                f"allocation_mode={ns.allocation}", f"actor.backend={ns.backend}",
                f"exp_ctrl.benchmark_steps={ns.steps}", "exp_ctrl.ckpt_freq_steps=1", "recover_after=0",
                f"async_rl={str(ns.async_rl).lower()}", "logging.progress=false",
                *model_overrides(ns.shape, Path(root)), *ns.set,
            ],
        )  # fmt: skip
        run = run_dir_of(cfg)
        times: dict = {}
        threading.Thread(target=killer, args=(run, ns.kill, at, rng, times), daemon=True).start()
        code = run_local(cfg)
        records = list(Ledger(run.ledger).records())
        used = Counter((r.epoch, i) for r in records if not r.dropped for i in r.ids)  # once per epoch
        steps = sorted(r.step for r in records)
        ok = code == 0 and steps == list(range(1, ns.steps + 1)) and max(used.values()) == 1
        ok &= run.attempt_logs(1).is_dir() and "next_step" in times
        print(f"{mode}, {ns.shape}, {ns.allocation} ({ns.backend}): exit {code}, steps recorded {steps} of "
              f"{ns.steps}, prompts used twice {sum(n > 1 for n in used.values())}, "
              f"attempts {len(list(run.logs.glob('attempt*')))}")  # fmt: skip
        if "next_step" in times:
            print(f"kill -9 of {times['victim']} after step {at} -> next completed step: "
                  f"{times['next_step'] - times['killed']:.1f} s")  # fmt: skip
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
