"""Recovery on GPUs: the toy on the tiny model, server on one GPU and trainer on the other (NCCL weight
broadcast), the controller killed mid-run; the restarted attempt must resume from its recover checkpoint,
build a new broadcast group, and end with every step trained once. Not part of the test suite (CPU tests
cover the same path with gloo: tests/test_recover_local.py).

    python tools/gpu_check_recover.py [--steps 8] [--kill-at 4] [--async]

Prints the time from the kill to the next completed step; exits 1 when the run fails or the ledger is wrong.
"""

from __future__ import annotations

import argparse
import os
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

TINY = REPO / ".cache" / "tiny"


def step_of(run) -> int:
    return (fsio.read_json(run.progress) or {}).get("step", 0)


def killer(run, at: int, times: dict) -> None:
    """SIGKILL the controller after step `at`; note when, and when the next step completes."""
    while step_of(run) < at:
        time.sleep(0.02)
    os.kill(last_beat(run.heartbeats, "controller")["pid"], signal.SIGKILL)
    times["killed"] = time.monotonic()
    while step_of(run) <= at:  # progress.json is rewritten by the resumed controller's next step
        time.sleep(0.02)
    times["next_step"] = time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--async", dest="async_rl", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-recover-") as root:
        cfg = load_config(
            [REPO / "configs/toy-cpu.yaml"],
            [
                f"cluster.fileroot={root}", f"trial_name={'async' if ns.async_rl else 'sync'}",
                f"actor.path={TINY / 'model'}", f"dataset.path={TINY / 'data/easy/train.jsonl'}",
                "dataset.valid_path=null", "cluster.n_nodes=1", "cluster.n_gpus_per_node=2",
                f"exp_ctrl.benchmark_steps={ns.steps}", "exp_ctrl.ckpt_freq_steps=1", "recover_after=0",
                f"async_rl={str(ns.async_rl).lower()}",
            ],
        )  # fmt: skip
        run = run_dir_of(cfg)
        times: dict[str, float] = {}
        threading.Thread(target=killer, args=(run, ns.kill_at, times), daemon=True).start()
        code = run_local(cfg)
        records = list(Ledger(run.ledger).records())
        used = Counter((r.epoch, i) for r in records if not r.dropped for i in r.ids)  # once per epoch
        steps = sorted({r.step for r in records})
        ok = code == 0 and steps == list(range(1, ns.steps + 1)) and max(used.values()) == 1
        ok &= run.attempt_logs(1).is_dir() and "next_step" in times
        print(f"{'async' if ns.async_rl else 'sync'}: exit {code}, steps recorded {len(steps)}/{ns.steps}, "
              f"prompts used twice {sum(n > 1 for n in used.values())}, attempts {len(list(run.logs.glob('attempt*')))}")  # fmt: skip
        if "next_step" in times:
            print(f"kill -9 of the controller after step {ns.kill_at} -> next completed step: "
                  f"{times['next_step'] - times['killed']:.1f} s")  # fmt: skip
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
