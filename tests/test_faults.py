"""Fault injection on the real local Slurm: the toy run as one heterogeneous job (a generation node, a training
node) with a recover checkpoint after every step is hit by one fault per test, and must still end COMPLETED
with every step trained exactly once.

Each test prints one line, and appends it as JSON to the file named by AREAL_FAULT_REPORT when that is set
(`tools/fault_table.py` makes a table of them):

    fault trainer-kill: survived, samples lost 0, 41.2 s from fault to next step

"samples lost" counts the prompts of the epoch never trained or trained twice (the ledger, against the order
an uninterrupted run trains them in); the seconds run from the fault to the first step that a later attempt
completed (stats.jsonl). The fault's step is drawn at random from a printed seed: AREAL_FAULT_SEED=<seed>
draws the same steps again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.control import fsio
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.status import COMPLETE, get_status
from areal_hpc.launch import runs, slurm
from areal_hpc.monitor.stats import read_stats
from areal_hpc.recover.attempt import next_attempt
from areal_hpc.recover.checkpoint import Checkpoints
from tests.slurm import job_log, submit, wait_for_job, wait_role
from tests.test_slurm_submit import submit_toy

pytestmark = [pytest.mark.slurm, pytest.mark.faults]
STEPS = 6  # 4 prompts a step, 62 steps an epoch: one epoch
# SLURM_RESTART_COUNT counts every requeue, Slurm's own (scontrol, preemption, node failure) too.
RECOVER = ("recover_mode=auto", "recover_retries=4", "recover_after=1", "exp_ctrl.ckpt_freq_steps=1")
JOB_SECS = 600.0  # a run with one requeue takes 1-3 minutes on two busy cores
# A job ended for good. NODE_FAIL and PREEMPTED are left out: a --requeue job goes PENDING again after them.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
SEED = int(os.environ.get("AREAL_FAULT_SEED") or random.SystemRandom().randrange(10**6))
ATTEMPT_STARTED = re.compile(r"AREAL_ATTEMPT=(\d+) \(Slurm restart \d+\) started on \S+ at (\S+)")


@dataclass
class Fault:
    """One fault: its name, the step after which it comes (drawn from SEED), and, once it came, when
    (time.time()), in which attempt, and after which step the run really was."""

    name: str
    step: int
    submitted: float = field(default_factory=time.monotonic)
    at: float = 0.0
    attempt: int = 0


@pytest.fixture
def say(capsys) -> Callable[[str], None]:
    """Print a line past pytest's capture: the seed and the result of each fault show in every run."""

    def say(line: str) -> None:
        with capsys.disabled():
            print(f"\n{line}", flush=True)

    return say


@pytest.fixture
def draw(say) -> Callable[..., Fault]:
    """draw(name, low=1): the fault `name` after a random step in [low, STEPS - 2]."""

    def draw(name: str, low: int = 1) -> Fault:
        rng = random.Random(f"{SEED}:{name}")  # one stream per fault: AREAL_FAULT_SEED repeats each
        fault = Fault(name, rng.randint(low, STEPS - 2))
        say(f"fault {name}: AREAL_FAULT_SEED={SEED}, after step {fault.step} of {STEPS}")
        return fault

    return draw


@pytest.fixture
def toy_job(slurm_env, tmp_path, tiny_model_dir, tiny_build):
    """toy_job(fault): submit the toy run for `fault`; (run, job id). The job is cancelled at teardown
    (a failed test must not leave it to hold nodes that the next test needs)."""
    jobs = []

    def toy_job(fault: Fault, *extra: str):
        data = tiny_build.root / "data" / "easy"
        run, (job_id,) = submit_toy(tmp_path, tiny_model_dir, data, fault.name, STEPS, *RECOVER, *extra)
        jobs.append(job_id)
        return run, job_id

    yield toy_job
    for job_id in jobs:
        slurm_env.run("scancel", job_id, check=False)


# --- the faults ---------------------------------------------------------------------------------------------


EPISODES = ("rollout.workflow=tool_loop", "rollout.tools=[calculator]", "rollout.max_turns=2")


@pytest.mark.parametrize(
    "role, name, extra",
    [  # all slow: test_slurm_requeue.py kills a trainer in `make test`
        pytest.param("trainer", "trainer-kill", (), marks=pytest.mark.slow),
        pytest.param("controller", "controller-kill", (), marks=pytest.mark.slow),
        pytest.param("gen_server", "gen-server-kill", (), marks=pytest.mark.slow),
        # The controller rolls out multi-turn episodes (synchronous RL): those in flight resume from their journals.
        pytest.param("controller", "controller-kill-episodes", EPISODES, marks=pytest.mark.slow),
    ],
)
def test_a_role_killed_at_a_random_step(slurm_env, draw, toy_job, say, role, name, extra):
    fault = draw(name)
    run, job_id = toy_job(fault, *extra)
    victim = wait_role(run, role, 0)
    strike(run, fault, lambda: os.kill(victim, signal.SIGKILL))
    check_survived(slurm_env, run, job_id, fault, say)


# An agent reaching the policy through the OpenAI endpoint, three paced turns an episode (tests/plugins).
AGENT = (
    "async_rl=true",
    "max_head_offpolicyness=1",
    "n_rollout_workers=1",
    "rollout.agent=sdk_agents:paced_turns",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rollout-kill-agents", "requeue-agents"])
def test_agent_episodes_cut_by_a_fault_resume_at_their_last_recorded_turn(
    slurm_env, draw, toy_job, say, plugins, name
):
    fault = draw(name, low=2)  # after step 1 the rollout may wait for the first update, no group in flight
    run, job_id = toy_job(fault, *AGENT)
    rollout = wait_role(run, "rollout", 0)
    if name == "rollout-kill-agents":
        strike(run, fault, lambda: os.kill(rollout, signal.SIGKILL))
    else:
        strike(run, fault, lambda: slurm_env.run("scontrol", "requeue", job_id))
    deadline = time.monotonic() + 60  # the role ends (a requeue's SIGTERM: ABORTED, for a while)
    while Path(f"/proc/{rollout}").exists():
        assert time.monotonic() < deadline, f"the rollout role {rollout} still runs 60 s after the fault"
        time.sleep(0.05)
    recorded = recorded_turns(run)  # before the next attempt's rollout role starts (10 s at least)
    check_survived(slurm_env, run, job_id, fault, say)
    rows = [r for r in read_stats(run.stats) if "rollout/replayed_turns" in r]
    # Every turn recorded before the fault was answered from its journal, none generated again; nothing else
    # was replayed, and no agent asked differently.
    say(
        f"fault {name}: {recorded} turns recorded before it, {sum(r['rollout/replayed_turns'] for r in rows):g} replayed"
    )
    assert recorded > 0, "the fault found no episode with a recorded turn"
    assert sum(r["rollout/replayed_turns"] for r in rows) == recorded
    assert all(r["rollout/replay_mismatches_per_episode"] == 0 for r in rows)
    assert not list(run.episodes.glob("epoch*/*/*.jsonl"))


def recorded_turns(run) -> int:
    """The turns recorded in the journals of groups not yet stored or trained."""
    from areal_hpc.data import RolloutStore
    from areal_hpc.gen.journal import read_entries
    from areal_hpc.gen.rollout_worker import used_prompts

    used, _ = used_prompts(Ledger(run.ledger), RolloutStore(run.rollouts))
    return sum(
        len(read_entries(path)[0])
        for path in run.episodes.glob("epoch*/*/*.jsonl")
        if fsio.read_json(path.parent / "id.json")["query_id"]
        not in used.get(int(path.parent.parent.name.removeprefix("epoch")), ())
    )


def test_an_agent_that_sends_malformed_requests_every_episode_only_drops_its_prompts(
    slurm_env, toy_job, say, plugins
):
    # The fault is the agent: one prompt in four sends requests that once stopped the rollout role every time.
    fault = Fault("malformed-agent", 0)
    run, job_id = toy_job(fault, *AGENT[:-1], "rollout.agent=sdk_agents:malformed_for_one_prompt_in_four")
    ended = wait_ended(slurm_env, job_id, run)
    records = list(Ledger(run.ledger).records())
    trained = [i for r in records if not r.dropped for i in r.ids]
    dropped = [(i, r.reason) for r in records if r.dropped for i in r.ids]
    say(f"fault {fault.name}: {len(trained)} prompts trained, {len(dropped)} dropped, Slurm says {ended}")
    assert set(ended.values()) == {"COMPLETED"}, job_log(run, "err")
    assert next_attempt(run) == 1  # no restart: the role never failed
    assert sorted(r.step for r in records if not r.dropped) == list(range(1, STEPS + 1))
    assert len(trained) == len(set(trained)) == 4 * STEPS  # every other prompt trained once
    malformed = lambda i: int(i.rsplit("-", 1)[-1]) % 4 == 1  # noqa: E731
    assert dropped and all(malformed(i) and reason == "agent_error" for i, reason in dropped)
    assert not any(malformed(i) for i in trained)
    rows = [r for r in read_stats(run.stats) if "rollout/refused_requests_per_episode" in r]
    assert sum(r["rollout/dropped_groups"] for r in rows) == len(dropped)


@pytest.mark.slow  # a damaged checkpoint skipped: test_recover's unit test in make test
def test_a_truncated_checkpoint_is_skipped_for_the_one_before(slurm_env, draw, toy_job, say):
    fault = draw("truncated-checkpoint", low=2)
    run, job_id = toy_job(fault)
    controller = wait_role(run, "controller", 0)
    ckpts = Checkpoints(run.recover)
    wait_until(lambda: len(ckpts.steps()) >= 2, run)  # a recover checkpoint and a newer one
    damaged: list[Path] = []

    def truncate_then_kill() -> None:
        os.kill(controller, signal.SIGSTOP)  # no checkpoint is written or dropped meanwhile
        *_, previous, newest = ckpts.steps()
        path = max((ckpts.path(newest) / "shards").iterdir(), key=lambda p: p.stat().st_size)
        os.truncate(path, path.stat().st_size // 2)
        damaged.extend([path, ckpts.path(previous)])
        os.kill(controller, signal.SIGKILL)

    strike(run, fault, truncate_then_kill)
    check_survived(slurm_env, run, job_id, fault, say)
    path, previous = damaged
    log = controller_log(run, fault.attempt + 1)
    assert f"recover checkpoint {path.parent.parent} is damaged" in log and str(path) in log, log
    assert f"resumes from recover checkpoint {previous}" in log, log


@pytest.mark.slow
def test_scontrol_requeue_from_outside(slurm_env, draw, toy_job, say):
    fault = draw("scontrol-requeue")
    run, job_id = toy_job(fault)
    strike(run, fault, lambda: slurm_env.run("scontrol", "requeue", job_id))
    check_survived(slurm_env, run, job_id, fault, say)
    assert "|REQUEUED" in job_history(slurm_env, job_id)  # the first run; Slurm started it again itself


@pytest.mark.slow
def test_preemption_by_an_urgent_job_that_needs_every_node(slurm_env, draw, toy_job, say):
    fault = draw("preemption")
    run, job_id = toy_job(fault)
    urgent: list[str] = []
    # PriorityTier 10 and whole nodes: Slurm preempts the run. Its notice (USR2, GraceTime 10 s) makes the
    # controller checkpoint at the end of the step and stop; the job requeues and waits for the urgent one.
    sleeper = ("-p", "urgent", "-N", "4", "--exclusive", "-t", "5", "-o", "/dev/null", "--wrap", "sleep 15")
    strike(run, fault, lambda: urgent.append(submit(slurm_env, *sleeper)))
    check_survived(slurm_env, run, job_id, fault, say)
    assert wait_for_job(slurm_env, urgent[0]) == {urgent[0]: "COMPLETED"}
    assert "areal-hpc: USR2 at" in job_log(run, "out")  # the notice (--signal=B:USR2) came first
    assert not (run.logs / "failed_attempts").exists()  # a preemption is no failure: retries are kept
    urgent_end = sacct_time(slurm_env, urgent[0], "End")
    assert attempt_starts(run)[fault.attempt + 1] >= urgent_end - 1  # `date -Is`: whole seconds


@pytest.mark.slow
def test_the_training_node_marked_down(slurm_env, draw, toy_job, say):
    # The training component's node (controller and trainer): Slurm requeues the whole job (NODE_FAIL). The
    # generation node is test_the_generation_node_marked_down's.
    fault = draw("node-down")
    run, job_id = toy_job(fault)
    _, node = job_nodes(slurm_env, job_id)
    try:
        take_down(slurm_env, run, fault, node)
        check_survived(slurm_env, run, job_id, fault, say)
        assert "NODE_FAIL" in job_history(slurm_env, job_id)
        assert node not in job_nodes(slurm_env, job_id), f"the resumed run used {node} again"
    finally:
        set_node(slurm_env, node, "state=resume")  # whatever happened: the next test needs every node


@pytest.mark.slow
def test_the_generation_node_marked_down(slurm_env, draw, toy_job, say, capsys):
    # The job script runs on component 0's node (generation): Slurm 22.05 then requeues component 0 alone and
    # keeps component 1 failed, so the job would pend for good. `submit --recover` sees that and requeues it.
    fault = draw("gen-node-down")
    run, job_id = toy_job(fault)
    node, _ = job_nodes(slurm_env, job_id)
    try:
        take_down(slurm_env, run, fault, node)
        deadline = time.monotonic() + 120
        while not slurm.stuck(slurm.component_states(job_id)):
            assert time.monotonic() < deadline, slurm.component_states(job_id)
            time.sleep(0.5)
        assert main(["status", str(run.root)]) == 0
        assert (
            f"stuck: it never starts again; requeue it: areal-hpc submit --recover {run.root}"
            in capsys.readouterr().out
        )
        assert main(["submit", "--recover", str(run.root)]) == 0
        assert f"requeued Slurm job(s) {job_id}" in capsys.readouterr().out
        check_survived(slurm_env, run, job_id, fault, say)
        assert node not in job_nodes(slurm_env, job_id), f"the resumed run used {node} again"
    finally:
        set_node(slurm_env, node, "state=resume")


@pytest.mark.slow
def test_a_time_limit_checkpoints_on_its_notice_and_the_job_requeues_itself(
    slurm_env, tmp_path, tiny_build, say
):
    # A 2-minute limit with USR2 70 s before it (slurmctld checks both about every 30 s): each attempt trains
    # for some 25-40 s after its start, at 0.15 s a step on an idle machine (0.3-0.5 s on a busy one), so 300
    # steps take two attempts or more (120 once finished in one). Without the notice the job would end
    # TIMEOUT, which Slurm never requeues.
    fault, n_steps = Fault("time-limit", 0), 300
    limit = ("cluster.slurm.time=2", "cluster.slurm.signal_grace_secs=70", "exp_ctrl.ckpt_freq_steps=null")
    data = tiny_build.root / "data" / "easy"
    run, (job_id,) = submit_toy(
        tmp_path, tiny_build.model_dir, data, fault.name, n_steps, *RECOVER[:3], *limit
    )
    try:
        ended = wait_ended(slurm_env, job_id, run)
    finally:
        slurm_env.run("scancel", job_id, check=False)
    assert set(ended.values()) == {"COMPLETED"}, (ended, job_log(run, "err"))
    assert "stopped on a preemption or time-limit notice" in job_log(run, "err")
    assert not (run.logs / "failed_attempts").exists()  # notices are no failures
    records = list(Ledger(run.ledger).records())
    assert sorted(r.step for r in records) == list(range(1, n_steps + 1))
    assert max(Counter((r.epoch, i) for r in records for i in r.ids).values()) == 1
    say(f"fault time-limit: survived in {next_attempt(run)} attempts")


# --- helpers ------------------------------------------------------------------------------------------------


def wait_until(ready: Callable[[], bool], run, timeout: float = 300.0) -> None:
    """Poll `ready` until it holds; fails at once when the run aborted (a start takes 1-2 minutes on two
    busy cores: importing torch and transformers in three processes)."""
    deadline = time.monotonic() + timeout
    while not ready():
        status = get_status(run)
        assert status is None or status.state != "ABORTED", status
        assert time.monotonic() < deadline, f"not ready within {timeout} s; logs: {runs.log_files(run)}"
        time.sleep(0.05)


def finished_step(run) -> int:
    return (fsio.read_json(run.progress) or {}).get("step", 0)


def strike(run, fault: Fault, action: Callable[[], object]) -> None:
    """Once the run has finished fault.step: note when, in which attempt and after which step, then act."""
    wait_until(lambda: finished_step(run) >= fault.step, run)
    fault.at, fault.attempt, fault.step = time.time(), next_attempt(run) - 1, finished_step(run)
    action()


def check_survived(cluster, run, job_id: str, fault: Fault, say) -> None:
    """Wait until the job ended for good, report the fault's line, then check that the run survived:
    COMPLETED, FINISHED and COMPLETE; every step once in ledger and statistics; no prompt lost or twice."""
    ended = wait_ended(cluster, job_id, run)
    states = slurm.wait_final([job_id], timeout=60)  # sacct agrees, component by component
    records = list(Ledger(run.ledger).records())
    used = Counter((r.epoch, i) for r in records for i in r.ids)
    planned = planned_ids(run, STEPS)
    lost = len(set(planned) - set(used)) + sum(n - 1 for n in used.values())
    every = list(range(1, STEPS + 1))
    ledger_steps = sorted(r.step for r in records)
    stats = read_stats(run.stats)
    step_rows = [r["step"] for r in stats if "timeperf/e2e" in r]
    reward_rows = [r["step"] for r in stats if "ppo_actor/task_reward/avg" in r]
    status = get_status(run)
    checks = {
        "Slurm says COMPLETED": set(ended.values()) == set(states.values()) == {"COMPLETED"},
        "FINISHED and COMPLETE": run.finished.exists() and status.state == COMPLETE,
        "the ledger holds every step once": ledger_steps == every,
        "the statistics hold every step once": step_rows == reward_rows == every,
        "the planned prompts, each once": lost == 0 and sorted(used) == sorted(planned),
    }
    say(report(fault, run, all(checks.values()), lost))
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, (failed, states, ended, status, ledger_steps, step_rows, runs.log_files(run))


def report(fault: Fault, run, survived: bool, lost: int) -> str:
    """The fault's line; appended as JSON to AREAL_FAULT_REPORT when set."""
    secs = recovery_secs(run, fault)
    entry = {
        "fault": fault.name, "survived": survived, "samples_lost": lost, "recovery_secs": secs,
        "steps": STEPS, "seed": SEED, "after_step": fault.step, "resumed_from": resumed_from(run, fault),
        "attempts": next_attempt(run), "test_secs": round(time.monotonic() - fault.submitted, 1),
    }  # fmt: skip
    if path := os.environ.get("AREAL_FAULT_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    shown = "?" if secs is None else f"{secs:.1f}"
    outcome = "survived" if survived else "NOT survived"
    return f"fault {fault.name}: {outcome}, samples lost {lost}, {shown} s from fault to next step"


def wait_ended(cluster, job_id: str, run, timeout: float = JOB_SECS) -> dict[str, str]:
    """Component -> state from scontrol once every component ended for good."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.run("scontrol", "show", "job", job_id, check=False).stdout
        states = dict(re.findall(r"JobId=(\d+) .*?JobState=(\S+)", info, re.S))
        if states and set(states.values()) <= ENDED:
            return states
        assert time.monotonic() < deadline, (
            f"job {job_id} not ended in {timeout} s:\n{info}\n{job_log(run, 'err')}"
        )
        time.sleep(0.5)


def planned_ids(run, steps: int) -> list[tuple[int, str]]:
    """(epoch, prompt id) of what an uninterrupted run trains on in `steps` steps: the master's own sampler."""
    from transformers import AutoTokenizer

    from areal_hpc.data.dataset import ShardedSampler, load_prompt_dataset

    cfg = run.load_config()
    ds = cfg.dataset
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    data = load_prompt_dataset(ds.path, tokenizer, ds.max_prompt_len, ds.apply_chat_template)
    sampler = ShardedSampler(len(data), 0, 1, cfg.seed, ds.train_bs_n_seqs)
    planned = []
    for _ in range(steps):
        epoch = sampler.epoch
        planned += [(epoch, data[i].query_id) for i in sampler.next_batch()]
    return planned


def attempt_starts(run) -> dict[int, float]:
    """time.time() at which each attempt's job script started (whole seconds)."""
    found = ATTEMPT_STARTED.findall(job_log(run, "out"))
    return {int(a): dt.datetime.fromisoformat(t).timestamp() for a, t in found}


def recovery_secs(run, fault: Fault) -> float | None:
    """Seconds from the fault to the end of the first step of a later attempt (None: there was none)."""
    start = attempt_starts(run).get(fault.attempt + 1)
    if start is None:
        return None
    ends = [r["time"] for r in read_stats(run.stats) if "timeperf/e2e" in r and r["time"] >= start]
    return round(min(ends) - fault.at, 1) if ends else None


def controller_log(run, attempt: int) -> str:
    path = run.attempt_logs(attempt) / "controller.log"
    return path.read_text() if path.exists() else ""


def resumed_from(run, fault: Fault) -> int | None:
    """The step whose recover checkpoint the attempt after the fault resumed from (0: afresh)."""
    log = controller_log(run, fault.attempt + 1)
    if found := re.search(r"resumes from recover checkpoint \S*step(\d+)", log):
        return int(found.group(1))
    return 0 if "starts afresh" in log else None


def job_history(cluster, job_id: str) -> str:
    """Every run of the job (sacct -D: a requeued run keeps its own row)."""
    return cluster.run("sacct", "-j", job_id, "-D", "-X", "-n", "-P", "-o", "JobID,State").stdout


def sacct_time(cluster, job_id: str, column: str) -> float:
    out = cluster.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", column).stdout.split()[0]
    return dt.datetime.fromisoformat(out).timestamp()


def job_nodes(cluster, job_id: str, timeout: float = 60.0) -> list[str]:
    """The node of each component of the job, in component order, once each has one (its last run's, once
    it ended)."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.run("scontrol", "show", "job", job_id).stdout
        components = re.findall(r"^JobId=", info, re.M)
        nodes = [n for n in re.findall(r"^\s+NodeList=(\S+)$", info, re.M) if n != "(null)"]
        if components and len(nodes) == len(components):
            return nodes
        assert time.monotonic() < deadline, f"job {job_id} has no node per component:\n{info}"
        time.sleep(0.5)


def take_down(cluster, run, fault: Fault, node: str) -> None:
    """Once the run finished fault.step, mark `node` down, and drained: with ReturnToService=2 a DOWN node whose
    slurmd still answers (here, all of them) is back in service within a second, and the requeued run could
    start on it again."""
    down = ("state=down", "reason=fault-test"), ("state=drain", "reason=fault-test")
    strike(run, fault, lambda: [set_node(cluster, node, *settings) for settings in down])


def set_node(cluster, node: str, *settings: str) -> None:
    cluster.run("scontrol", "update", f"nodename={node}", *settings, check=False)
