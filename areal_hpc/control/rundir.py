"""The run directory: every path of one run, named here and nowhere else (layout in docs/architecture.md).

    <fileroot>/<user>/<experiment>/<trial>/   (0700)
      config.yaml  secret  status.json  FINISHED  launcher.json  progress.json  start.json  version.json
      ledger.jsonl
      heartbeat/<role>.json  mailbox/<worker>/  gen_servers/<i>.json (+ <i>.dist_init.json)  dist_init.json
      data/step<N>/  rollouts/ (+ dropped/)  weights/v<N>/  checkpoints/<role>/<name>/  recover/step<N>/
      logs/attempt<N>/<role>.log  logs/stats.jsonl  logs/episodes/step-<N>.jsonl  logs/failed_attempts
      slurm/ (scripts, jobs.json)

Every stage takes a `RunDir`; creating one is `create_run_dir`'s job (the launchers'), roles only use it.
"""

from __future__ import annotations

import getpass
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import ExperimentConfig, dump_yaml, load_config

_GLOBAL_STEP = re.compile(r"^epoch\d+epochstep\d+globalstep(\d+)$")


@dataclass(frozen=True)
class RunDir:
    root: Path

    # --- what the launcher writes once ------------------------------------------------------------------

    @property
    def config(self) -> Path:
        """The resolved config every role loads."""
        return self.root / "config.yaml"

    @property
    def secret(self) -> Path:
        """The generation servers' bearer token (0600)."""
        return self.root / "secret"

    @property
    def slurm(self) -> Path:
        """sbatch scripts, submitit's job files and the job scripts' own output."""
        return self.root / "slurm"

    @property
    def jobs(self) -> Path:
        """The Slurm jobs of every submission of the run."""
        return self.slurm / "jobs.json"

    # --- the run's state ----------------------------------------------------------------------------------

    @property
    def status(self) -> Path:
        """RUNNING | COMPLETE | ABORTED, who set it and why."""
        return self.root / "status.json"

    @property
    def finished(self) -> Path:
        """Present once the run completed: job scripts test it, and a finished run never starts again."""
        return self.root / "FINISHED"

    @property
    def launcher(self) -> Path:
        """The `areal-hpc run` process of a local run while it runs it (launch.processes.identity), which
        `areal-hpc stop` signals."""
        return self.root / "launcher.json"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    @property
    def start_point(self) -> Path:
        """{"attempt", "global_step", "version"}: where the current attempt starts, written by the controller
        once it resumed (or started afresh); the rollout role waits for it."""
        return self.root / "start.json"

    @property
    def published_version(self) -> Path:
        """{"version": N}: the weight version the servers hold, written after each publication."""
        return self.root / "version.json"

    @property
    def generation(self) -> Path:
        """The generation manager's counters (running, accepted, dropped, version, expected_version, bound),
        rewritten every second by the rollout role of asynchronous RL; for `areal-hpc status`."""
        return self.root / "generation.json"

    @property
    def ledger(self) -> Path:
        """Consumed sample ids per step."""
        return self.root / "ledger.jsonl"

    # --- coordination of one attempt (cleared when the next begins) ---------------------------------------

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeat"

    @property
    def mailboxes(self) -> Path:
        return self.root / "mailbox"

    @property
    def gen_servers(self) -> Path:
        return self.root / "gen_servers"

    def gen_address(self, index: int) -> Path:
        """{"url", ...} of generation server `index`, once it serves."""
        return self.gen_servers / f"{index}.json"

    def gen_dist_init(self, index: int) -> Path:
        """{"addr", "attempt"}: where the node ranks of multi-node server `index` meet (its node rank 0)."""
        return self.gen_servers / f"{index}.dist_init.json"

    @property
    def dist_init(self) -> Path:
        """{"host", "port", "attempt"}: where the trainers' process group meets (trainer rank 0's store)."""
        return self.root / "dist_init.json"

    # --- data ---------------------------------------------------------------------------------------------

    @property
    def data(self) -> Path:
        return self.root / "data"

    def step_data(self, step: int) -> Path:
        """Batch files of one synchronous step, removed when the step ends."""
        return self.data / f"step{step}"

    @property
    def rollouts(self) -> Path:
        """The rollout store of asynchronous RL."""
        return self.root / "rollouts"

    @property
    def episodes(self) -> Path:
        """Journals of the multi-turn episodes in flight: a resumed run replays their completed turns."""
        return self.root / "episodes"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weight_snapshot(self, version: int) -> Path:
        """The HF snapshot of weight version `version` (weight_update_mode disk)."""
        return self.weights / f"v{version}"

    def adapter_snapshot(self, version: int) -> Path:
        """The LoRA adapter of weight version `version`, a PEFT folder (weight_update_mode adapter)."""
        return self.weights / f"adapter-v{version}"

    def realloc_snapshot(self, model: str) -> Path:
        """The HF snapshot a model's weights move through to its copy on another layout (param_realloc_mode
        disk), overwritten at each move."""
        return self.weights / f"realloc-{model}"

    @property
    def evals(self) -> Path:
        """The evaluations of the saved checkpoints (eval.enabled) and their jobs' folder (`jobs/`)."""
        return self.root / "eval"

    def eval_results(self, step: int) -> Path:
        """Where the evaluation of the checkpoint saved at global step `step` writes its answers and results."""
        return self.evals / f"globalstep{step}"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, role: str, epoch: int, epoch_step: int, global_step: int) -> Path:
        """A persistent HF checkpoint, named as the original names them."""
        return self.checkpoints / role / f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"

    def saved_checkpoints(self, role: str) -> dict[int, Path]:
        """The persistent checkpoints of `role` by global step, oldest first (only names `checkpoint` gives:
        not a merged export beside them, `<name>-merged`)."""
        found = ((_GLOBAL_STEP.search(p.name), p) for p in (self.checkpoints / role).glob("*globalstep*"))
        return dict(sorted((int(m[1]), p) for m, p in found if m))

    @property
    def recover(self) -> Path:
        """Recover checkpoints."""
        return self.root / "recover"

    # --- logs -----------------------------------------------------------------------------------------------

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def attempt_logs(self, attempt: int | str) -> Path:
        """Role logs of one attempt (a requeued Slurm job or a restarted local run starts a new one); job
        scripts give the shell's "$attempt"."""
        return self.logs / f"attempt{attempt}"

    @property
    def stats(self) -> Path:
        return self.logs / "stats.jsonl"

    @property
    def timeline(self) -> Path:
        """Every role process's phases as events (control/timeline.py), which `areal-hpc trace` reads; the
        trainers' torch.profiler traces of `logging.profile_step`."""
        return self.logs / "timeline"

    def timeline_file(self, task: str, attempt: int) -> Path:
        return self.timeline / f"{task}.attempt{attempt}.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of the statistics (logging.tensorboard)."""
        return self.logs / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B's folder: an offline run per attempt (logging.wandb)."""
        return self.logs / "wandb"

    @property
    def plots(self) -> Path:
        """`areal-hpc plot`'s PNGs."""
        return self.logs / "plots"

    @property
    def agent_logs(self) -> Path:
        """The stdout and stderr of each episode's agent program (rollout.agent_command)."""
        return self.logs / "agents"

    @property
    def transcripts(self) -> Path:
        """The transcripts of a sample of each step's episodes (rollout.transcript_groups)."""
        return self.logs / "episodes"

    def transcript(self, step: int) -> Path:
        """The transcripts of step `step`: a JSON line per episode."""
        return self.transcripts / f"step-{step:06d}.jsonl"

    @property
    def failed_attempts(self) -> Path:
        """How many attempts of a Slurm job failed (the job script counts them against recover_retries)."""
        return self.logs / "failed_attempts"

    # --- reading ------------------------------------------------------------------------------------------

    def load_config(self) -> ExperimentConfig:
        return load_config([self.config])

    def token(self) -> str:
        return self.secret.read_text().strip()


def default_trial_name(now: float | None = None) -> str:
    """`run<timestamp>`, the original's default trial name."""
    return "run" + time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def user_root(fileroot: str | os.PathLike) -> Path:
    """`<fileroot>/<user>`: where a user's runs are (a relative fileroot is relative to the working directory)."""
    return Path(fileroot).expanduser().resolve() / getpass.getuser()


def run_dir_of(cfg: ExperimentConfig) -> RunDir:
    """<fileroot>/<user>/<experiment>/<trial> of a config whose trial name is set."""
    if cfg.trial_name is None:
        raise ValueError("trial_name must be set before the run directory is known")
    return RunDir(user_root(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name)


def create_run_dir(cfg: ExperimentConfig) -> RunDir:
    """Make the run directory (0700) with the resolved config and a fresh secret token (0600).

    An existing run directory is an error: a trial name names one run (resuming is the recover path).
    """
    run = run_dir_of(cfg)
    if run.root.exists():
        raise FileExistsError(f"run directory {run.root} already exists; choose another trial_name")
    run.root.mkdir(parents=True, mode=0o700)
    run.logs.mkdir(mode=0o700)
    fd = os.open(run.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    tmp = run.config.with_suffix(".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(run.config)
    return run
