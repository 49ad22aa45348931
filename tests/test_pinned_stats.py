"""A fixed-seed 3-step toy run gives the very losses and rewards that were pinned (as torchtitan pins its
losses): a refactor of the loop, the roles or the backends must not change a single number.

    AREAL_UPDATE_PINS=1 pytest tests/test_pinned_stats.py   # re-pin, after a change that is meant to
    ATEN_CPU_CAPABILITY=default pytest tests/test_pinned_stats.py   # other kernels: within the tolerance

The roles run pinned kernels (KERNELS). On a CPU with the vector extensions of the pinning machine and its torch
build, the numbers compare bit for bit (an AVX-512 machine other than the pinning one gave a gradient norm apart
in its last bits). Elsewhere (another torch build, another CPU) other kernels round differently, and the numbers
compare within a tolerance instead: whole numbers (token counts, lengths, rewards) exactly, the others within a
relative 1e-3 (1e-5 absolute for the rounding noise near 0). Measured on the pinning machine under other kernels
(ATen's default ones, MKL's own branch, or both): at most 1.1e-4 relative (ppo_actor/approx_kl/min, a difference
of two logprobs), 4.8e-7 absolute on the noise (behave_approx_kl: one float32 ulp of a logprob), and no sampled
token changed. Real changes fail it: ppo.eps_clip 0.2 -> 0.21 moves actor_loss/min by 1.25e-2, reward scaling 5 ->
5.05 every loss and reward by 1e-2, a 1% larger lr sft/lr by 1e-2 and grad_norm by 2.3e-3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats

PINS = Path(__file__).parent / "golden" / "pinned-stats.json"
# Synchronous PPO with two trainer ranks (the gradient all-reduce) and a reference model, and the supervised
# warm-up. Unnormalised advantages: the untrained model's constant reward then moves it. The server decodes
# one group at a time: rows batched with other requests round differently from run to run.
# Each on both training backends: the sharded default and the replicated one.
PPO = (
    "allocation_mode=builtin.d1p1m1+d2p1m1", "cluster.n_nodes=1", "cluster.n_gpus_per_node=3",
    "ppo.adv_norm=false", "ppo.group_adv_norm=false", "ppo.kl_ctl=0.05", "max_running_requests=2",
)  # fmt: skip
SFT = ("experiment_type=sft",)
RUNS = {
    "ppo": PPO,
    "sft": SFT,
    "ppo-torch": (*PPO, "actor.backend=torch", "ref.backend=torch"),
    "sft-torch": (*SFT, "actor.backend=torch"),
}
TIMING = ("time", "timeperf/", "rollout/gen_tokens_per_s", "rollout/gen_secs")  # differ from run to run

# The kernels of every role, whatever the CPU picks: ATen's AVX2 ones (an AVX-512 machine would take its
# AVX-512 ones); MKL's SSE2 branch for sgemm, the one BLAS routine a run calls (MKL_CBWR=AVX2 holds on Intel
# processors only: elsewhere MKL takes the processor's own branch); oneDNN's AVX2 ones (a run calls none
# today); one thread, as a reduction split among threads rounds differently.
KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
}
REL, ABS = 1e-3, 1e-5  # 9 and 20 times the largest deviations measured under other kernels (see above)


def kernels() -> dict[str, str]:
    """KERNELS, without ATen's AVX2 ones where torch would not pick them itself (a CPU without AVX2)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return KERNELS
    return {k: v for k, v in KERNELS.items() if k != "ATEN_CPU_CAPABILITY"}


def vector_extensions() -> list[str]:
    """The CPU's AVX-512 and AMX extensions: two AVX-512 machines were seen to round a gradient norm apart."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "") if cpuinfo.exists() else ""  # fmt: skip
    return sorted(f for f in flags.split() if f.startswith(("avx512", "amx")))


def machine() -> dict:
    return {"torch": torch.__version__, "kernels": kernels(), "cpu": vector_extensions()}


def pinned_numbers(toy, name: str) -> list[dict]:
    cfg = toy.config(f"pin-{name}", 3, *RUNS[name], "recover_mode=disabled")
    assert run_local(cfg) == 0
    rows = read_stats(run_dir_of(cfg).stats)
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def within_tolerance(rows: list[dict]) -> list[dict]:
    """The pinned rows as expected values: a number that is whole in every row (a count, a length, a
    reward) exactly, any other within REL (ABS near 0)."""
    keys = {k for r in rows for k in r}
    whole = {k for k in keys if all(float(r[k]).is_integer() for r in rows if k in r)}
    return [{k: v if k in whole else pytest.approx(v, rel=REL, abs=ABS) for k, v in r.items()} for r in rows]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_three_step_toy_run_gives_the_pinned_numbers(toy, name, monkeypatch):
    for variable, value in kernels().items():
        monkeypatch.setenv(variable, value)  # the roles inherit the test's environment
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {"machine": machine(), "runs": {}}
    got = pinned_numbers(toy, name)
    if os.environ.get("AREAL_UPDATE_PINS") == "1":
        pins["machine"], pins["runs"][name] = machine(), got
        PINS.write_text(json.dumps(pins, indent=1) + "\n")
        return
    # Bit for bit where the roles ran the kernels of the pins; elsewhere within the tolerance.
    exact = pins["machine"] == machine()
    expected = pins["runs"][name] if exact else within_tolerance(pins["runs"][name])
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for row, pinned in zip(got, expected, strict=True):
        assert row == pinned, f"compared {'bit for bit' if exact else 'within the tolerance'}"
