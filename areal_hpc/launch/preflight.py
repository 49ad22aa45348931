"""The inputs a config names, checked before anything is written or submitted: the datasets, every line of
them (file:line), the model and tokenizer directories, the user's code it names (reward.fn, dataset.loader,
actor.interface, rollout.workflow, rollout.tools and rollout.agent: each imports and takes the call it will
get), what the run needs of its storage (launch/storage.py) and, under `areal-hpc run`, that this machine
isolates model-written code and agent programs. A bad input fails alike on every attempt, so it must be refused
here, never found by a role, whose failures are retried.
"""

from __future__ import annotations

import importlib.util
import inspect
import shlex
from pathlib import Path

from areal_hpc.agent import AgentIsolationError, ChatRenderer, ChatTemplateError, ProgramJail, load_tools
from areal_hpc.config import (
    ExperimentConfig,
    ExtensionError,
    InputError,
    extensions,
    gen_backend,
    trainer_models,
)
from areal_hpc.data import DatasetFormatError, read_prompt_records
from areal_hpc.eval import EvalDataError, load_eval_set
from areal_hpc.launch.storage import storage_problems
from areal_hpc.reward import IsolationError, Limits, Sandbox


def check_inputs(cfg: ExperimentConfig, new_run: bool = True, here: bool = False) -> None:
    """Raise InputError listing every problem of the inputs of `cfg`, or return quietly. `new_run`: a run that
    starts afresh (not `submit --recover`), which has no checkpoint to resume. `here`: the roles run on this
    machine (`areal-hpc run`), so what they need of it is tried now (a Slurm job's roles try it on their nodes)."""
    problems = extension_problems(cfg)
    tasks: set[str] = set()
    if not any(p.startswith("'dataset.loader'") for p in problems):  # else every dataset fails alike
        problems += [p for key, path in datasets(cfg) for p in dataset_problems(cfg, key, path, tasks)]
    problems += [p for key, path in models(cfg) for p in model_problems(key, path, key == "actor.path")]
    problems += teacher_problems(cfg)
    problems += eval_set_problems(cfg) + writer_problems(cfg) + sglang_problems(cfg)
    problems += isolation_problems(cfg, tasks) + agent_isolation_problems(cfg) if here else []
    problems += storage_problems(cfg, here) if new_run else []  # a resubmitted run's checkpoints are there
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
    """The model directories the run loads: the actor (whose tokenizer every role uses), ref, the teacher of
    on-policy distillation and critic; a reference policy (a teacher) on the actor's weights is checked as the
    actor."""
    out = [(f"{name}.path", m.path) for name, m in trainer_models(cfg).items()]
    return [(key, path) for key, path in out if key == "actor.path" or path != cfg.actor.path]


def teacher_problems(cfg: ExperimentConfig) -> list[str]:
    """On-policy distillation scores the actor's sampled token ids with the teacher, so the teacher must share
    the actor's tokenizer vocabulary: each token of the actor's tokenizer has the same id in the teacher's
    (when its directory holds one), and the teacher's vocab_size covers them all. A vocab_size padded
    otherwise is fine (Qwen2.5-7B's 152064 rows against 1.5B's 151936, one tokenizer). A directory that does
    not load: the model checks say why."""
    teacher = trainer_models(cfg).get("teacher")
    if teacher is None or not teacher.path or teacher.path == cfg.actor.path:
        return []
    from transformers import AutoConfig, AutoTokenizer

    try:
        actor = AutoTokenizer.from_pretrained(cfg.actor.path, local_files_only=True)
        hf = AutoConfig.from_pretrained(teacher.path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return []
    where = f"'teacher.path': {teacher.path}"
    share = f"the teacher must share the actor's tokenizer vocabulary (actor.path {cfg.actor.path})"
    vocab_size = getattr(hf.get_text_config(), "vocab_size", None)
    if isinstance(vocab_size, int) and vocab_size < len(actor):
        tokens = f"the {len(actor)} tokens of the actor's tokenizer"
        return [f"{where} has vocab_size {vocab_size}, fewer than {tokens}: {share}"]
    try:
        theirs = AutoTokenizer.from_pretrained(teacher.path, local_files_only=True).get_vocab()
    except (OSError, ValueError, KeyError, TypeError):
        return []  # no tokenizer of its own: its vocab_size covers the actor's token ids
    differ = sorted((i, token) for token, i in actor.get_vocab().items() if theirs.get(token) != i)
    if not differ:
        return []
    i, token = differ[0]
    first = f"the first: {token!r}, id {i} for the actor, {theirs.get(token)} for the teacher"
    differ_text = f"a tokenizer whose ids differ from the actor's for {len(differ)} tokens ({first})"
    return [f"{where} has {differ_text}: {share}"]


def isolation_problems(cfg: ExperimentConfig, tasks: set[str]) -> list[str]:
    """Code answers, and the python tool's calls, are run in the sandbox: with reward.code_isolation required,
    this machine must isolate them."""
    code_answers = "code" in tasks and cfg.reward.fn is None
    python_tool = "python" in cfg.rollout.tools and cfg.rollout.workflow != "single_turn"
    if not (code_answers or python_tool) or cfg.reward.code_isolation != "required":
        return []
    try:
        Sandbox(Limits(time_secs=cfg.reward.code_time_secs, memory_mb=cfg.reward.code_memory_mb))
    except IsolationError as exc:
        return [f"'reward.code_isolation': {exc}"]
    return []


def agent_isolation_problems(cfg: ExperimentConfig) -> list[str]:
    """The program of rollout.agent_command runs in namespaces of its own: with rollout.agent_isolation
    required, this machine must give them (the rollout role tries again on its node)."""
    r = cfg.rollout
    if cfg.experiment_type != "ppo" or r.agent_command is None or r.agent_isolation != "required":
        return []
    try:
        ProgramJail(shlex.split(r.agent_command), (), r.agent_isolation)
    except AgentIsolationError as exc:
        return [f"'rollout.agent_isolation': {exc}"]
    return []


def dataset_problems(cfg: ExperimentConfig, key: str, path: str | None, tasks: set[str]) -> list[str]:
    """The problems of one dataset; the tasks of its records join `tasks`."""
    if not path:
        return [f"'{key}' is not set: give the JSONL file of prompts"]
    loader = cfg.dataset.loader
    try:
        records = read_prompt_records(path, loader, scored_by_fn=cfg.reward.fn is not None)
    except OSError as exc:
        return [f"'{key}': cannot read {path}: {exc.strerror or exc}"]
    except DatasetFormatError as exc:
        return [f"'{key}': {exc}"]
    except Exception as exc:
        if loader == "jsonl":
            raise
        return [f"'dataset.loader' {loader} failed reading {key}={path}: {type(exc).__name__}: {exc}"]
    tasks.update(r.task for r in records)
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


def extension_problems(cfg: ExperimentConfig) -> list[str]:
    """The user's code the config names imports, and takes the calls the roles will make of it."""
    out = []
    checks = (
        ("dataset.loader", None if cfg.dataset.loader == "jsonl" else cfg.dataset.loader, _loader_problems),
        ("reward.fn", cfg.reward.fn, _reward_fn_problems),
        ("actor.interface", cfg.actor.interface, _interface_problems),
        (
            "rollout.workflow",
            cfg.rollout.workflow if cfg.experiment_type == "ppo" else None,
            _workflow_problems,
        ),
        ("rollout.agent", cfg.rollout.agent if cfg.experiment_type == "ppo" else None, _agent_problems),
    )
    for field, spec, problems in checks:
        if spec is None:
            continue
        try:
            obj = extensions.load(field, spec)
        except ExtensionError as exc:
            out.append(str(exc))
            continue
        out += [p for p in problems(cfg, spec, obj) if p]
    return out


def _loader_problems(cfg: ExperimentConfig, spec: str, fn) -> list[str | None]:
    return [
        extensions.call_problem(
            "dataset.loader", spec, fn, (str(cfg.dataset.path),), {}, "the dataset's path"
        )
    ]


def _reward_fn_problems(cfg: ExperimentConfig, spec: str, fn) -> list[str | None]:
    fields = _first_fields(cfg)
    if cfg.reward.fn_batch:
        args, kwargs = (["p"], ["c"], [[1]], [[2]]), {name: [value] for name, value in fields.items()}
        how = (
            "lists (prompts, completions, prompt_ids, completion_ids) and each field of the dataset as a list"
        )
    else:
        args, kwargs = ("p", "c", [1], [2]), fields
        how = "(prompt, completion, prompt_ids, completion_ids, **the fields of a dataset line)"
    return [extensions.call_problem("reward.fn", spec, fn, args, kwargs, how)]


def _first_fields(cfg: ExperimentConfig) -> dict:
    """The fields reward.fn gets with the first training prompt ({} when the dataset cannot be read: its own
    check says why)."""
    try:
        return read_prompt_records(cfg.dataset.path, cfg.dataset.loader, scored_by_fn=True)[0].fields
    except Exception:
        return {}


def _workflow_problems(cfg: ExperimentConfig, spec: str, fn) -> list[str | None]:
    """A workflow is an async function (ctx, record); a multi-turn one renders chats with the actor's template and
    calls the tools the config names."""
    if not inspect.iscoroutinefunction(fn):
        return [f"'rollout.workflow' is {spec!r}, which is not an async function: write `async def {spec.split(':')[-1]}"
                "(ctx, record)` (docs/agents.md)"]  # fmt: skip
    out = [extensions.call_problem("rollout.workflow", spec, fn, ("ctx", "record"), {}, "(ctx, record)")]
    try:
        tools = load_tools(cfg.rollout.tools)
    except ExtensionError as exc:
        return [*out, str(exc)]
    if cfg.rollout.workflow != "single_turn":
        out.append(_template_problem(cfg, "rollout.workflow", spec, [t.schema() for t in tools]))
    return out


def _template_problem(cfg: ExperimentConfig, field: str, spec: str, tools: list[dict]) -> str | None:
    """Whether the actor's chat template renders turns (and these tools) as multi-turn episodes need."""
    if not cfg.actor.path:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path, local_files_only=True)
        ChatRenderer(tokenizer, tools or None)
    except ChatTemplateError as exc:
        return f"'{field}' is {spec!r}, but the chat template of actor.path {cfg.actor.path}: {exc}"
    except (OSError, ValueError):
        pass  # the model check says why it does not load
    return None


def _agent_problems(cfg: ExperimentConfig, spec: str, fn) -> list[str | None]:
    """An agent is a function (base_url, api_key, record), async or not; it reaches the model by the OpenAI API."""
    if not callable(fn):
        return [f"'rollout.agent' is {spec!r}, which is not a function: write `async def {spec.split(':')[-1]}"
                "(base_url, api_key, record)` (docs/agents.md)"]  # fmt: skip
    how = "(base_url, api_key, record)"
    return [
        extensions.call_problem("rollout.agent", spec, fn, ("base_url", "api_key", "record"), {}, how),
        _template_problem(cfg, "rollout.agent", spec, []),
    ]


def _interface_problems(cfg: ExperimentConfig, spec: str, cls) -> list[str | None]:
    out = [extensions.call_problem("actor.interface", spec, cls, (cfg,), {}, "the run's config")]
    if not inspect.isclass(cls):  # a factory: what it builds is known only when called
        return out
    methods = ["train_step"] + (["inference"] if cfg.experiment_type == "ppo" else [])
    for name in methods:
        method = getattr(cls, name, None)
        if method is None:
            out.append(f"'actor.interface' is {spec!r}, a class without {name} (docs/extending.md)")
            continue
        kwargs = {"global_step": 1} if name == "train_step" else {}
        how = f"{name}(engine, batch, mb_spec{', global_step=...' if kwargs else ''})"
        out.append(
            extensions.call_problem("actor.interface", spec, method, (None, "engine", {}, "mb"), kwargs, how)
        )
    return out
