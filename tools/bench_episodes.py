"""Benchmark asynchronous RL on multi-turn episodes whose tool waits have a long tail: eta 4 against eta 0.

The workload is this module's own workflow, `tools.bench_episodes:lookup_agent`: each episode takes
`rollout.max_turns` model turns (`ctx.chat`), and between two turns it waits for a simulated `lookup` tool
(`asyncio.sleep`: the tool is waiting on an API, a sandbox, a search; it computes nothing). The wait of each
call is lognormal, median MEDIAN_SECS and sigma SIGMA, so that a few percent of the calls take 10x the median,
cut at `rollout.tool_time_secs` (a call past it is answered with an error, as a registered tool's would be).
Waits and rewards are seeded from the record's query_id, the episode's index and the turn: every variant sees
the same ones. The reward is a seeded coin (0 or 1): the untrained tiny model learns nothing here, and the
coin gives GRPO's groups the usual variance without scoring on the shared CPU. Throughput, not learning.

Each variant is an `areal-hpc run` (local processes) of the same steps: eta = 0 (asynchronous RL bounded to
synchronous PPO: one step's groups in flight) and eta = 4 (max_concurrent_rollouts groups in flight). A
synchronous step waits for its slowest episode; asynchronous RL keeps generating and training meanwhile.

    python tools/bench_episodes.py [--steps 12] [--turns 3] [--variants eta0,eta4] [--set KEY=VALUE ...]
                                   [--keep DIR]

Prints wall time, loop time (the sum of step times), trained episodes per second of the loop, the loop's
speed-up against eta = 0 in the same run (also without step 1, where eta = 4 starts all its groups at once),
where a step's time went, and the waits the seeded distribution gives the trained prompts.
Exits non-zero when eta = 4 is less than TARGET_SPEEDUP times faster than eta = 0 (loop time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import ExperimentConfig, load_config  # noqa: E402
from areal_hpc.control import fsio  # noqa: E402
from areal_hpc.control.rundir import run_dir_of  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402

TARGET_SPEEDUP = 1.6  # verl reports 1.55-1.6x for asynchronous multi-turn RL on ReTool
TINY = REPO / ".cache" / "tiny"
WORKFLOW = "tools.bench_episodes:lookup_agent"
MEDIAN_SECS = 0.3
# P(wait > 10x median) = P(Z > ln 10 / SIGMA) = 2.8%: the tail of real agent tools (a slow search, a cold
# sandbox). The slowest of a step's 128 calls (16 x 4 episodes x 2) would wait ~5.5 s; the tool's time limit,
# rollout.tool_time_secs (5 s by default), cuts it as a registered tool's is cut.
SIGMA = 1.2
VARIANTS = [  # (label, trial name, overrides)
    ("eta=0 (sync)", "eta0", ["max_head_offpolicyness=0"]),
    ("eta=1", "eta1", ["max_head_offpolicyness=1"]),
    ("eta=2", "eta2", ["max_head_offpolicyness=2"]),
    ("eta=4", "eta4", ["max_head_offpolicyness=4"]),
]


# --- the workload: the workflow the rollout roles run -------------------------------------------------------


def tool_wait(query_id: str, index: int, turn: int, cap: float) -> float:
    """Seconds the lookup after model turn ``turn`` of episode ``index`` waits: the same in every variant."""
    rng = random.Random(f"{query_id}/{index}/{turn}")
    return min(rng.lognormvariate(math.log(MEDIAN_SECS), SIGMA), cap)


def coin(query_id: str, index: int) -> float:
    return float(random.Random(f"{query_id}/{index}/reward").random() < 0.5)


async def lookup_agent(ctx, record) -> float:
    """Ask; then, max_turns - 1 times, wait for the lookup, give its answer and ask again. A seeded coin."""
    opts = ctx.options
    messages = [{"role": "user", "content": record.prompt}]
    for turn in range(opts.max_turns):
        messages.append(await ctx.chat(messages))
        if turn == opts.max_turns - 1:
            break
        wait = tool_wait(record.query_id, ctx.index, turn, opts.tool_time_secs)
        await asyncio.sleep(wait)  # waiting, not computing: the episode's thread is free meanwhile
        answer = "Error: timed out" if wait >= opts.tool_time_secs else f"{record.query_id} -> {wait:.3f}"
        messages.append({"role": "tool", "name": "lookup", "content": answer})
    return coin(record.query_id, ctx.index)


# --- the waits the trained prompts get ---------------------------------------------------------------------


def step_prompts(cfg: ExperimentConfig) -> list[list[str]]:
    """The query ids of each step's prompts, as eta = 0 trains them (the rollout worker's sampler order;
    eta = 4 starts the same prompts in the same order, but trains each step's first finished groups)."""
    from transformers import AutoTokenizer

    from areal_hpc.data import ShardedSampler, run_steps, training_prompts

    ds = cfg.dataset
    train = training_prompts(cfg, AutoTokenizer.from_pretrained(cfg.actor.path))
    _, steps = run_steps(cfg.exp_ctrl, len(train), ds.train_bs_n_seqs)
    sampler = ShardedSampler(len(train), 0, 1, cfg.seed, batch_size=ds.train_bs_n_seqs)
    return [[train[i].query_id for i in sampler.next_batch()] for _ in range(steps)]


def expected_waits(cfg: ExperimentConfig) -> dict[str, float]:
    """Tool seconds of the distribution over the trained prompts: per call, per episode, and the slowest
    episode's of each step (what a synchronous step waits for at least)."""
    r, calls, slowest = cfg.rollout, [], []
    for ids in step_prompts(cfg):
        episodes = []
        for qid in ids:
            for i in range(cfg.group_size):
                waits = [tool_wait(qid, i, t, r.tool_time_secs) for t in range(r.max_turns - 1)]
                calls += waits
                episodes.append(sum(waits))
        slowest.append(max(episodes))
    return {
        "per_call": statistics.mean(calls),
        "p50": statistics.median(calls),
        "slow_share": sum(w >= 10 * MEDIAN_SECS for w in calls) / len(calls),
        "timeouts": sum(w >= r.tool_time_secs for w in calls) / len(calls),
        "per_episode": statistics.mean(calls) * (r.max_turns - 1),
        "slowest_step": statistics.mean(slowest),
        "slowest_sum": sum(slowest),
    }


# --- running and reading the variants ----------------------------------------------------------------------


def workload(root: Path, steps: int, turns: int) -> list[str]:
    return [
        f"cluster.fileroot={root}", f"actor.path={TINY / 'model'}", "dataset.valid_path=null",
        f"rollout.workflow={WORKFLOW}", "rollout.tools=[]", f"rollout.max_turns={turns}",
        "ppo.gen.max_new_tokens=16", "dataset.train_bs_n_seqs=16", "group_size=4", "ppo.ppo_n_minibatches=1",
        f"dataset.path={TINY / 'data' / 'easy' / 'train.jsonl'}", "logging.tensorboard=false",
        "recover_mode=disabled", "async_rl=true", f"exp_ctrl.benchmark_steps={steps}",
        # Room for several steps' groups in flight (eta = 0 is bounded by staleness to one step's), and a
        # server slot for each of their episodes' turns.
        "max_concurrent_rollouts=64", "max_running_requests=256",
    ]  # fmt: skip


def run(cfg: ExperimentConfig) -> tuple[float, Path]:
    start = time.monotonic()
    with open(os.devnull, "w") as quiet:
        code = run_local(cfg, out=quiet)
    if code != 0:
        raise SystemExit(f"bench_episodes: {cfg.trial_name} failed ({code}); logs in {run_dir_of(cfg).logs}")
    return time.monotonic() - start, run_dir_of(cfg).root


@dataclass
class Result:
    """One variant's run."""

    label: str
    wall: float
    loop: float  # the sum of step times: start-up is the same in every variant
    trained: int  # episodes trained on
    generated: int  # episodes of every group finished, those still unused at the end too
    steps: list[dict]  # the steps' rows of stats.jsonl
    server: str  # the generation server's counters

    def mean(self, key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in self.steps)

    def max(self, key: str) -> float:
        return max(r.get(key, 0.0) for r in self.steps)

    @property
    def first(self) -> float:
        """Seconds of step 1: asynchronous RL starts max_concurrent_rollouts groups at once."""
        return self.steps[0]["timeperf/e2e"]

    @property
    def later(self) -> float:
        """Mean seconds of the later steps: the steady state a long run is made of."""
        return statistics.mean(r["timeperf/e2e"] for r in self.steps[1:])


def measure(label: str, wall: float, root: Path, cfg: ExperimentConfig) -> Result:
    steps = [r for r in read_stats(root / "logs" / "stats.jsonl") if "timeperf/e2e" in r]
    # Each step trains train_bs_n_seqs kept groups; the manager's counters count every group finished (it
    # stops at the run's total, so the two agree unless a group was dropped).
    counters = fsio.read_json(root / "generation.json") or {}
    trained = len(steps) * cfg.dataset.train_bs_n_seqs * cfg.group_size
    generated = counters.get("accepted", 0) * cfg.group_size
    loop = sum(r["timeperf/e2e"] for r in steps)
    return Result(label, wall, loop, trained, generated, steps, server_counters(root))


def server_counters(root: Path) -> str:
    """What the generation server did (its last counters line): decode steps, rows a step, prefills."""
    log = root / "logs" / "attempt0" / "gen_server0.log"
    lines = [x for x in log.read_text().splitlines() if "engine counters: " in x] if log.is_file() else []
    if not lines:
        return "no server counters"
    c = json.loads(lines[-1].split("engine counters: ", 1)[1])
    rows = c.get("decode_rows", 0) / max(c["decode_steps"], 1)
    decode = f"{c['decode_steps']} decode steps ({c.get('decode_secs', 0):.1f} s, ~{rows:.0f} rows each)"
    return f"server: {decode}, {c['prefill_passes']} prefills ({c.get('prefill_secs', 0):.1f} s)"


def breakdown(r: Result) -> str:
    """Where a step's time went (means over the steps)."""
    keys = ("e2e", "wait_rollouts", "actor_inf", "actor_train", "weight_sync")
    return f"{r.label}: per step " + ", ".join(f"{k} {r.mean(f'timeperf/{k}'):.2f}" for k in keys)


HEADER = ("variant", "wall", "loop", "episodes/s", "speed-up", "step 1", "later steps", "speed-up", "wait",
          "group secs", "head off-pol max")  # fmt: skip
WIDTHS = (14, 7, 7, 10, 8, 6, 11, 8, 5, 10, 16)


def row(r: Result, base: Result) -> list[str]:
    return [
        r.label, f"{r.wall:.1f}s", f"{r.loop:.1f}s", f"{r.trained / r.loop:.2f}",
        f"{base.loop / r.loop:.2f}x", f"{r.first:.2f}s", f"{r.later:.2f}s", f"{base.later / r.later:.2f}x",
        f"{r.mean('timeperf/wait_rollouts'):.2f}s", f"{r.mean('rollout/gen_secs/avg'):.2f}s",
        f"{r.max('ppo_actor/head_offpolicyness/max'):.0f}",
    ]  # fmt: skip


def line(cells: list[str]) -> str:
    return f"{cells[0]:{WIDTHS[0]}}" + "".join(
        f" {c:>{w}}" for c, w in zip(cells[1:], WIDTHS[1:], strict=True)
    )


def report(results: list[Result], waits: dict[str, float]) -> float:
    """Prints the table; returns the loop speed-up of the last variant over the first (eta = 0)."""
    base = results[0]
    print("\n" + line(list(HEADER)))
    for r in results:
        print(line(row(r, base)))
    for r in results:
        print(f"  {breakdown(r)}; {r.generated} episodes finished\n    {r.server}")
    print(f"tool waits (seeded, the trained prompts of eta=0): {waits['per_call']:.2f} s a call on average "
          f"(median {waits['p50']:.2f} s; {waits['slow_share']:.1%} of calls >= 10x the median, "
          f"{waits['timeouts']:.1%} cut at rollout.tool_time_secs), {waits['per_episode']:.2f} s an episode; "
          f"a step's slowest episode waits {waits['slowest_step']:.2f} s ({waits['slowest_sum']:.1f} s over "
          f"the steps)")  # fmt: skip
    return base.loop / results[-1].loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps of each variant")
    parser.add_argument(
        "--turns", type=int, default=3, help="model turns of an episode (a lookup between two)"
    )
    parser.add_argument(
        "--variants", default="eta0,eta4", help="trial names of the variants: eta0,eta1,eta2,eta4"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run"
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="run under a new DIR and keep the runs (default: a temporary one)"
    )
    ns = parser.parse_args()
    if ns.steps < 2:
        parser.error("--steps must be 2 or more: step 1 is reported apart from the later steps")
    names = ns.variants.split(",")
    variants = [v for v in VARIANTS if v[1] in names]
    if len(variants) < 2 or variants[0][1] != "eta0" or variants[-1][1] != "eta4":
        parser.error("--variants must include eta0 and eta4: the target compares them")
    # The roles import the workflow as tools.bench_episodes: the repo root must be on their path wherever the
    # benchmark is started from (they inherit this environment).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    results = []
    with contextlib.ExitStack() as stack:
        root = ns.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-episodes-"))
        base = [*workload(Path(root).resolve(), ns.steps, ns.turns), *ns.set]
        for label, trial, extra in variants:
            cfg = load_config([REPO / "configs" / "toy-cpu.yaml"], [*base, f"trial_name={trial}", *extra])
            wall, run_root = run(cfg)
            results.append(measure(label, wall, run_root, cfg))
            # Other jobs on the machine slow a variant down (eta = 4 most: it computes all the time), and the
            # load says how busy it was; this run's own roles make ~2-3 of it.
            load = os.getloadavg()[0]
            print(
                f"  {label}: {wall:.1f} s (loop {results[-1].loop:.1f} s), 1-min load {load:.1f}", flush=True
            )
        waits = expected_waits(cfg)
    speedup = report(results, waits)
    ok = speedup >= TARGET_SPEEDUP
    print(f"loop speed-up of eta=4 over eta=0: {speedup:.2f}x (target >= {TARGET_SPEEDUP}x): "
          f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
