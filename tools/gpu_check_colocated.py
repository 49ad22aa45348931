"""Colocated generation on one GPU: a random-weight model of Qwen2.5-0.5B's shape trains a few GRPO steps while
its built-in server shares the GPU, releasing its memory during each step's training and taking it back for
the new weights (shared by the trainer's GPU memory, or a disk snapshot); prints each step's time, its parts and
its generated tokens per second of the whole step. tests/test_gpu.py runs it small; tests/test_colocated.py
covers the same turns on the CPU.

    python tools/gpu_check_colocated.py [--steps 3] [--shape 0.5b] [--prompts 16] [--group-size 4]
        [--max-new-tokens 256] [--mem-fraction 0.5] [--weight-update-mode tensor] [--gpus 1]
        [--set KEY=VALUE ...] [--json FILE] [--device cuda]

``--gpus N`` runs the colocated layout dN (a server and a trainer rank on each GPU), where tensor mode shares each
server the weights of the rank on its own GPU; ``--device cpu --shape cpu`` is a dry run of this script.

Issue 32's workload (a GRPO step of 16 prompts x 8 answers of 1,024 tokens, the 1.5B shape)::

    python tools/gpu_check_colocated.py --steps 3 --shape 1.5b --group-size 8 --max-new-tokens 1024 --mem-fraction 0.5

Issue 45's (answers up to 8,192 tokens with a long tail: ``--eos-ids 50`` makes 50 ids spread over the vocabulary
end an answer, so a random model's near-uniform draws end one after ~vocab/50 tokens, a geometric tail cut by
the budget)::

    python tools/gpu_check_colocated.py --steps 3 --shape 1.5b --group-size 8 --max-new-tokens 8192 \
        --mem-fraction 0.5 --eos-ids 50

Samples every process's GPU memory (nvidia-smi) during the run and prints the server's: held while it
generates, and left while the trainer trains. Exits 1 when the run fails, a step did not release and resume
the server's memory, or the server kept more than a fifth of its weights' memory while released.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.control.heartbeat import last_beat  # noqa: E402
from areal_hpc.control.rundir import run_dir_of  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402
from tools.bench_train import SHAPES, build_model, toy_tokenizer  # noqa: E402

try:
    from areal_hpc.monitor import write_trace
except ImportError:  # run against a baseline copy of the package from before the timeline (issue 46)
    write_trace = None

TINY = Path(os.environ.get("AREAL_HPC_TINY", REPO / ".cache" / "tiny"))  # the toy's tokenizer and prompts


def gpu_memory_mib() -> dict[int, int]:
    """MiB of GPU memory each process holds now."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {int(pid): int(mib) for pid, mib in (line.split(", ") for line in out.strip().splitlines())}


def sample(samples: dict[int, list[int]], stop: threading.Event, every: float = 0.2) -> None:
    while not stop.is_set():
        for pid, mib in gpu_memory_mib().items():
            samples[pid].append(mib)
        time.sleep(every)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="answers per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--gpus", type=int, default=1, help="allocation dN: a server and a trainer rank per GPU"
    )
    parser.add_argument("--weight-update-mode", default="tensor", choices=("tensor", "disk", "adapter"))
    parser.add_argument(
        "--mem-fraction", type=float, default=None, help="sglang.mem_fraction_static: the server's share"
    )
    parser.add_argument(
        "--eos-ids",
        type=int,
        default=0,
        help="ids spread over the vocabulary that end an answer (long tails)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override more (e.g. actor_train.mb_spec.max_tokens_per_mb=30720); repeatable",
    )  # fmt: skip
    parser.add_argument("--json", help="write the steps' times to this file")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a dry run of this script (--shape cpu), no memory check"
    )
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-colocated-") as root:
        model = Path(root) / "model"
        n_params = build_model(ns.shape, model, ns.device)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        every = vocab // max(ns.eos_ids, 1)
        toy_tokenizer(model, TINY / "model", list(range(every // 2, vocab, every))[: ns.eos_ids])
        cfg = load_config(
            [REPO / "configs/toy-cpu.yaml"],
            [
                f"cluster.fileroot={root}", "trial_name=colocated", f"actor.path={model}",
                f"dataset.path={TINY / 'data/easy/train.jsonl'}", f"dataset.valid_path={TINY / 'data/easy/test.jsonl'}",
                f"allocation_mode=d{ns.gpus}p1m1", f"weight_update_mode={ns.weight_update_mode}", "cluster.n_nodes=1",
                f"cluster.n_gpus_per_node={ns.gpus}",
                f"actor.dtype={'bfloat16' if ns.device == 'cuda' else 'float32'}", f"dataset.train_bs_n_seqs={ns.prompts}", f"group_size={ns.group_size}",
                f"ppo.gen.max_new_tokens={ns.max_new_tokens}", f"max_running_requests={max(ns.prompts * ns.group_size, 64)}",
                f"exp_ctrl.benchmark_steps={ns.steps}", "logging.tensorboard=false", "logging.progress=false",
            ]
            + ([f"sglang.mem_fraction_static={ns.mem_fraction}"] if ns.mem_fraction is not None else [])
            + ns.set,
        )  # fmt: skip
        samples: dict[int, list[int]] = defaultdict(list)
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(samples, stop), daemon=True)
        if ns.device == "cuda":
            sampler.start()
        start = time.monotonic()
        code = run_local(cfg)
        stop.set()
        if sampler.is_alive():
            sampler.join()
        run = run_dir_of(cfg)
        print(
            f"{ns.shape} ({n_params / 1e9:.2f} B parameters): run exit code {code} in {time.monotonic() - start:.0f} s"
        )
        if ns.json:  # the roles' logs beside the results (recompilations, warnings): the run directory goes
            shutil.copytree(run.logs / "attempt0", Path(ns.json).with_suffix(".logs"), dirs_exist_ok=True)
        if code != 0:
            print(run.logs)
            return 1
        roles = {json.loads(f.read_text())["pid"]: f.stem for f in run.heartbeats.glob("*.json")}
        trainer = last_beat(run.heartbeats, "trainer0")["pid"]
        weights_mib = n_params * 2 / 2**20
        roles[os.getpid()] = "this script, which built the model on the GPU"
        for pid, mib in samples.items():  # the built-in server runs in the gen_server role (no heartbeat)
            print(f"pid {pid} ({roles.get(pid, 'gen_server0: the server')}): peak {max(mib)} MiB")
        others = {pid: mib for pid, mib in samples.items() if pid not in (trainer, os.getpid())}
        server = max(others, key=lambda pid: max(others[pid]), default=None)
        ok = server is not None or ns.device != "cuda"
        if server is not None:
            mib = others[server]
            held = max(mib)
            first = next(i for i, m in enumerate(mib) if m >= 0.9 * held)  # once it took its cache
            left = min(mib[first:])
            print(f"server: holds {held} MiB generating, {left} MiB while released (weights {weights_mib:.0f} MiB, "
                  f"trainer peak {max(samples[trainer])} MiB)")  # fmt: skip
            ok = held - left > 0.8 * weights_mib
        steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
        for r in steps:
            tokens = ns.prompts * ns.group_size * r["rollout/answer_len/avg"]
            print(f"step {r['step']}: e2e {r['timeperf/e2e']:.1f} s, release {r['timeperf/release_memory']:.2f} s, "
                  f"resume {r['timeperf/resume_memory']:.2f} s, weight update {r['timeperf/weight_sync']:.2f} s, "
                  f"{tokens:.0f} tokens generated (answers at the budget: {r['rollout/no_eos_ratio']:.2f}): "
                  f"{tokens / r['timeperf/e2e']:.0f} tokens/s of the step; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k.startswith("timeperf/")))  # fmt: skip
        ok &= len(steps) == ns.steps
        if ns.json:
            Path(ns.json).write_text(
                json.dumps({"args": vars(ns), "n_params": n_params, "steps": steps}) + "\n"
            )
        if write_trace is not None and run.timeline.is_dir():  # the code under test may predate the timeline
            trace, table = write_trace(run, Path(ns.json or root).with_suffix(".trace.json"))
            print(f"where the time went (areal-hpc trace, {trace}):\n{table}")
            for summary in run.timeline.glob("profile.*.txt") if ns.json else ():  # logging.profile_step's
                shutil.copy(summary, Path(ns.json).with_suffix(f".{summary.name}"))
        print("colocated check:", "OK" if ok else "FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
