"""The inputs a config names, checked before anything is written or submitted: the datasets, every line of
them (file:line), and the model and tokenizer directories. A bad input fails alike on every attempt, so it must
be refused here, never found by a role, whose failures are retried.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from areal_hpc.config import ExperimentConfig, InputError, gen_backend, trainer_models
from areal_hpc.data import DatasetFormatError, read_prompt_records
from areal_hpc.eval import EvalDataError, load_eval_set


def check_inputs(cfg: ExperimentConfig, new_run: bool = True) -> None:
    """Raise InputError listing every problem of the inputs of `cfg`, or return quietly. `new_run`: a run that
    starts afresh (not `submit --recover`), which has no checkpoint to resume."""
    problems = [p for key, path in datasets(cfg) for p in dataset_problems(cfg, key, path)]
    problems += [p for key, path in models(cfg) for p in model_problems(key, path, key == "actor.path")]
    problems += eval_set_problems(cfg) + writer_problems(cfg) + sglang_problems(cfg)
    if new_run and cfg.recover_mode == "resume":
        problems.append(
            "'recover_mode' is resume, but a new run has no recover checkpoint to resume: use auto, or "
            "resubmit an existing run with `areal-hpc submit --recover RUN`"
        )
    if problems:
        raise InputError("invalid inputs:\n  " + "\n  ".join(problems))


def datasets(cfg: ExperimentConfig) -> list[tuple[str, str | None]]:
    out = [("dataset.path", cfg.dataset.path)]
    return out + [("dataset.valid_path", cfg.dataset.valid_path)] if cfg.dataset.valid_path else out


def eval_set_problems(cfg: ExperimentConfig) -> list[str]:
    """Every evaluation set of `eval.enabled` loads (each line: problem and answer)."""
    if not cfg.eval.enabled or not cfg.eval.data_dir:  # without a folder the config checks said so
        return []
    out = []
    for name in cfg.eval.data_names:
        try:
            load_eval_set(name, cfg.eval.data_dir)
        except EvalDataError as exc:
            out.append(f"'eval.data_names': {exc}")
    return out


def writer_problems(cfg: ExperimentConfig) -> list[str]:
    """The libraries of the statistics writers asked for are installed (the roles import them mid-run)."""
    wanted = [
        ("logging.tensorboard", "tensorboard", "tensorboard"),
        ("logging.wandb", "wandb", "areal-hpc[wandb]"),
    ]
    return [
        f"'{key}' is true, but {module} is not installed: pip install '{package}', or set {key}=false"
        for key, module, package in wanted
        if getattr(cfg.logging, key.split(".")[1]) and importlib.util.find_spec(module) is None
    ]


def sglang_problems(cfg: ExperimentConfig) -> list[str]:
    """SGLang servers need SGLang where the job runs: this environment, as submitted."""
    if gen_backend(cfg) != "sglang" or importlib.util.find_spec("sglang") is not None:
        return []
    return [
        "The run's generation servers are SGLang's, but sglang is not installed: pip install 'areal-hpc[sglang]' "
        "(docs/sglang.md), or use the builtin backend"
    ]


def models(cfg: ExperimentConfig) -> list[tuple[str, str | None]]:
    """The model directories the run loads: the actor (whose tokenizer every role uses), ref and critic; a
    reference policy on the actor's weights is checked as the actor."""
    out = [(f"{name}.path", m.path) for name, m in trainer_models(cfg).items()]
    return [(key, path) for key, path in out if key == "actor.path" or path != cfg.actor.path]


def dataset_problems(cfg: ExperimentConfig, key: str, path: str | None) -> list[str]:
    if not path:
        return [f"'{key}' is not set: give the JSONL file of prompts"]
    try:
        records = read_prompt_records(path)
    except OSError as exc:
        return [f"'{key}': cannot read {path}: {exc.strerror or exc}"]
    except DatasetFormatError as exc:
        return [f"'{key}': {exc}"]
    batch = cfg.dataset.train_bs_n_seqs
    if key == "dataset.path" and len(records) < batch:
        return [
            f"'{key}': {path} holds {len(records)} prompts, fewer than one step's dataset.train_bs_n_seqs={batch}"
        ]
    return []


def model_problems(key: str, path: str | None, tokenizer: bool) -> list[str]:
    """A Hugging Face directory whose config (and tokenizer) load, without reaching the Hub."""
    if not path:
        return [f"'{key}' is not set: give a Hugging Face model directory"]
    if not Path(path).expanduser().is_dir():
        return [f"'{key}': {path} is not a directory (a Hugging Face model directory with config.json)"]
    from transformers import AutoConfig, AutoTokenizer

    out = []
    loaders = [("config", AutoConfig.from_pretrained)]
    loaders += [("tokenizer", AutoTokenizer.from_pretrained)] if tokenizer else []
    for what, load in loaders:
        try:
            load(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            out.append(f"'{key}': {path} holds no loadable Hugging Face {what}: {str(exc).splitlines()[0]}")
    return out
