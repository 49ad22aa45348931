"""The launch plan of a Slurm run: which jobs, which components, which steps, on how many nodes and GPUs.

Pure: a config and a run directory in, a `LaunchPlan` out; `sbatch.render` turns it into script text.

- Generation and training on different nodes: ONE heterogeneous job, component 0 on the generation partition
  runs the generation servers, component 1 on the training partition runs the trainer ranks and the controller.
- Both on one node (a one-node decoupled run such as 4 GPUs generating + 4 training): Slurm cannot put two
  components of a job on one node, so one plain job runs both steps, each with its own GPUs.
- `slurm.hetjob: false`: two jobs (generation, training) that meet through the run directory.
- Colocated (a bare 3D spec): one plain job on the training partition; the generation step shares the
  trainers' nodes and GPUs (`srun --overlap`), and the two take turns (master/turns.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from areal_hpc import alloc
from areal_hpc.config import ExperimentConfig, allocation_of
from areal_hpc.control import SINGLE_ROLES, RunDir


class PlanError(ValueError):
    """A config that cannot be laid out as Slurm jobs; the message names the field to change."""


@dataclass(frozen=True)
class Step:
    """One `srun`: `ntasks` copies of a role; each learns its index from SLURM_PROCID."""

    role: str  # gen_server | trainer | controller | rollout
    nodes: int
    ntasks: int
    gpus_per_node: int
    cpus_per_task: int
    het_group: int | None = None  # None: a plain job
    overlap: bool = False  # shares the CPUs of the steps beside it (the controller)

    @property
    def ntasks_per_node(self) -> int:
        return self.ntasks // self.nodes

    @property
    def log_name(self) -> str:
        """Per-task log file name; srun replaces %t by the task's rank."""
        return f"{self.role}.log" if self.role in SINGLE_ROLES else f"{self.role}%t.log"


@dataclass(frozen=True)
class Component:
    """One resource request: a component of a heterogeneous job, or a whole plain job."""

    name: str  # gen | train | all
    partition: str | None
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    mem_gb_per_node: int
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Job:
    """One sbatch script: its name and components (more than one: a heterogeneous job)."""

    name: str
    components: tuple[Component, ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(step for c in self.components for step in c.steps)


@dataclass(frozen=True)
class LaunchPlan:
    run: RunDir
    workdir: Path  # where relative paths of the config resolve, as for `areal-hpc run`: the submitting cwd
    jobs: tuple[Job, ...]
    python: str
    setup_commands: tuple[str, ...]
    command_prefix: str

    @property
    def kind(self) -> str:
        """hetjob | single | two-jobs."""
        if len(self.jobs) == 2:
            return "two-jobs"
        return "hetjob" if len(self.jobs[0].components) > 1 else "single"


def role_tasks(cfg: ExperimentConfig, allocation: alloc.Allocation) -> dict[str, int]:
    """The roles of a run and the tasks of each: the one plan of both launchers (Slurm steps here, local
    processes in `launch.local`), which a role checks its task count against."""
    tasks = {"gen_server": len(allocation.gen_tasks()), "trainer": allocation.n_train_gpus, "controller": 1}
    if cfg.experiment_type == "ppo" and cfg.async_rl:
        tasks["rollout"] = 1  # generation manager, rollout workers and verifier, beside the controller
    return tasks


def launch_plan(cfg: ExperimentConfig, run: RunDir, workdir: Path | None = None) -> LaunchPlan:
    """The jobs that run `cfg` in `run`; raises PlanError when the allocation cannot be laid out."""
    allocation = allocation_of(cfg)
    tasks = role_tasks(cfg, allocation)
    slurm = cfg.cluster.slurm
    gen_nodes = sorted({g // allocation.n_gpus_per_node for g in allocation.server_layout.gpus})
    train_nodes = sorted({g // allocation.n_gpus_per_node for g in allocation.layout("actor_train").gpus})
    shared = set(gen_nodes) & set(train_nodes)
    if shared and cfg.cluster.n_nodes > 1 and not allocation.colocated:
        raise PlanError(
            f"allocation_mode: generation and training share node {min(shared)} of a {cfg.cluster.n_nodes}-node "
            f"run; on Slurm each side needs whole nodes: give generation a multiple of n_gpus_per_node "
            f"({allocation.n_gpus_per_node}) GPUs"
        )
    if slurm.nodelist and not shared:
        raise PlanError(
            "cluster.slurm.nodelist: generation and training get nodes of their own, and Slurm would give "
            "each side all of these; use cluster.slurm.exclude or constraint instead"
        )
    gen_step, train_step = (
        _gen_step(cfg, allocation, len(gen_nodes)),
        _train_step(cfg, allocation, len(train_nodes)),
    )
    side = tuple(Step(role, 1, 1, 0, 1, overlap=True) for role in tasks if role in SINGLE_ROLES)
    name = f"{cfg.experiment_name}_{cfg.trial_name}"
    if allocation.colocated:
        steps = (gen_step, train_step, *side)
        all_ = _component(
            cfg, "all", slurm.train_partition, len(train_nodes), train_step.gpus_per_node, steps
        )
        jobs = (Job(name, (all_,)),)
    elif shared:  # one node
        steps = (gen_step, train_step, *side)
        jobs = (
            Job(name, (_component(cfg, "all", slurm.train_partition, 1, allocation.n_gpus_per_node, steps),)),
        )
    else:
        gen = _component(cfg, "gen", slurm.gen_partition, len(gen_nodes), gen_step.gpus_per_node, (gen_step,))
        train_steps = (train_step, *side)
        train = _component(
            cfg, "train", slurm.train_partition, len(train_nodes), train_step.gpus_per_node, train_steps
        )
        if slurm.hetjob:
            jobs = (Job(name, (_in_group(gen, 0), _in_group(train, 1))),)
        else:
            jobs = (Job(f"{name}_gen", (gen,)), Job(f"{name}_train", (train,)))
    return LaunchPlan(
        run=run,
        workdir=workdir or Path.cwd(),
        jobs=jobs,
        python=slurm.python or sys.executable,
        setup_commands=tuple(slurm.setup_commands),
        command_prefix=slurm.command_prefix or "",
    )


def _gen_step(cfg: ExperimentConfig, allocation: alloc.Allocation, n_nodes: int) -> Step:
    """The generation servers (a task per node of each); colocated, on the trainers' GPUs, which they share."""
    tasks = allocation.gen_tasks()
    gpus_per_node = len(allocation.server_layout.gpus) // n_nodes
    cpus = cfg.cluster.slurm.cpus_per_gpu * len(tasks[0][0].local_gpus)
    return Step("gen_server", n_nodes, len(tasks), gpus_per_node, cpus, overlap=allocation.colocated)


def _train_step(cfg: ExperimentConfig, allocation: alloc.Allocation, n_nodes: int) -> Step:
    n = allocation.n_train_gpus
    return Step("trainer", n_nodes, n, n // n_nodes, cfg.cluster.slurm.cpus_per_gpu)


def _component(
    cfg: ExperimentConfig, name: str, partition: str | None, nodes: int, gpus: int, steps: tuple[Step, ...]
) -> Component:
    slurm = cfg.cluster.slurm
    return Component(
        name, partition, nodes, gpus, slurm.cpus_per_gpu * gpus, slurm.mem_per_gpu_gb * gpus, steps
    )


def _in_group(component: Component, group: int) -> Component:
    steps = tuple(Step(**{**s.__dict__, "het_group": group}) for s in component.steps)
    return Component(**{**component.__dict__, "steps": steps})
