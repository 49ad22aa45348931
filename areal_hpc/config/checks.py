"""Value checks of a built config: per-field bounds and choices from the schema, then cross-field rules.

All problems are gathered and reported together, each naming its key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_hpc import alloc
from areal_hpc.config import extensions, kv_pool
from areal_hpc.config.algorithm import MAX_STOP_TOKEN_IDS
from areal_hpc.config.backends import GEN_BACKENDS, TRAIN_BACKENDS, megatron_model_problems, moe_experts
from areal_hpc.config.lora import lora_problems
from areal_hpc.config.schema import ConfigError, ExperimentConfig, ModelConfig, TrainedModelConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PROGRAM_GETS = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")  # and OPENAI_*: agent.program_env
_BOUNDS = {
    "ge": (lambda v, b: v >= b, ">="),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="),
    "lt": (lambda v, b: v < b, "<"),
}


def walk(cfg: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every leaf option."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from walk(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, value


def field_problems(key: str, f: dataclasses.Field, value: Any) -> list[str]:
    """Problems of one value against its field's choices and bounds (null is always allowed)."""
    if value is None:
        return []
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        return [f"'{key}' is {value!r}; choose one of {', '.join(map(str, meta['choices']))}"]
    out = []
    for name, (ok, symbol) in _BOUNDS.items():
        if name in meta and not ok(value, meta[name]):
            out.append(f"'{key}' is {value}; it must be {symbol} {meta[name]}")
    return out


def cross_field_problems(cfg: ExperimentConfig) -> list[str]:
    """Rules that involve more than one option."""
    out = []
    for key in ("experiment_name", "trial_name"):
        name = getattr(cfg, key)
        if name is not None and not _NAME.match(name):
            out.append(
                f"'{key}' is {name!r}; use letters, digits, '-' and '.' only ('_' separates names in paths)"
            )
    if cfg.success_rate_lb > cfg.success_rate_ub:
        out.append(
            f"'success_rate_lb' ({cfg.success_rate_lb}) is above 'success_rate_ub' ({cfg.success_rate_ub})"
        )
    gen = cfg.ppo.gen
    if gen.min_new_tokens > gen.max_new_tokens:
        out.append(
            f"'ppo.gen.min_new_tokens' ({gen.min_new_tokens}) is above "
            f"'ppo.gen.max_new_tokens' ({gen.max_new_tokens})"
        )
    if len(gen.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in gen.stop_token_ids):
        out.append(
            f"'ppo.gen.stop_token_ids' must be at most {MAX_STOP_TOKEN_IDS} token ids >= 0 (every request carries "
            f"them), got {len(gen.stop_token_ids)} with min {min(gen.stop_token_ids)}"
        )
    if cfg.ppo.ppo_n_minibatches > cfg.dataset.train_bs_n_seqs * cfg.group_size:
        out.append(
            f"'ppo.ppo_n_minibatches' ({cfg.ppo.ppo_n_minibatches}) exceeds the sequences of a step "
            f"(dataset.train_bs_n_seqs * group_size = {cfg.dataset.train_bs_n_seqs * cfg.group_size})"
        )
    if not cfg.ppo.disable_value and not cfg.critic.path:
        out.append("'critic.path' is required when 'ppo.disable_value' is false")
    out += extension_problems(cfg)
    if cfg.eval.enabled and not cfg.eval.data_dir:
        out.append("'eval.data_dir' is required when 'eval.enabled' is true: the folder of <name>.jsonl sets")
    if cfg.ppo.group_adv_norm and cfg.group_size < 2:
        out.append("'ppo.group_adv_norm' needs 'group_size' >= 2")
    out += algorithm_problems(cfg)
    for name, model in trainer_models(cfg).items():
        backend = TRAIN_BACKENDS.get(model.backend)
        if backend is None:  # the choices check names it
            continue
        if name == "critic" and not backend.value_model:
            able = [b for b, spec in TRAIN_BACKENDS.items() if spec.value_model]
            out.append(
                f"'critic.backend' {model.backend!r} has no value model yet (give one of {', '.join(able)})"
            )
    out += lora_problems(cfg)
    for name in ("actor", "critic"):
        model = getattr(cfg, name)
        if model.optimizer.offload and not TRAIN_BACKENDS[model.backend].optimizer_offload:
            able = [b for b, spec in TRAIN_BACKENDS.items() if spec.optimizer_offload]
            out.append(
                f"'{name}.optimizer.offload' needs a backend that offloads ({', '.join(able)}); "
                f"'{name}.backend' is {model.backend!r}"
            )
        out += _recompute_problems(name, model)
    return out


def _recompute_problems(name: str, model: TrainedModelConfig) -> list[str]:
    """recompute_layers against the model's decoder layers, where its config.json can be read."""
    layers = (_hf_config(model.path) or {}).get("num_hidden_layers")
    if model.recompute_layers is None or layers is None or model.recompute_layers <= layers:
        return []
    return [
        f"'{name}.recompute_layers' is {model.recompute_layers}, but {name}.path has {layers} decoder layers: give "
        f"at most {layers}, or null (all of them)"
    ]


def algorithm_problems(cfg: ExperimentConfig) -> list[str]:
    """Combinations of the algorithm's options (config/algorithm.py) that cannot work together, in RL; the
    options that merely do nothing somewhere are config/inert.py's."""
    if cfg.experiment_type != "ppo":
        return []  # a supervised warm-up takes none of them (inert.py refuses those set)
    ppo, out = cfg.ppo, []
    if ppo.policy_loss == "gspo" and ppo.loss_agg_mode in ("token-mean", "token-sum"):
        out.append(
            f"'ppo.policy_loss' gspo has one loss per answer (its sequence ratio), but 'ppo.loss_agg_mode' "
            f"{ppo.loss_agg_mode} weighs answers by their length: give ppo.loss_agg_mode=seq-mean-token-mean "
            "(or policy_loss gspo_token, GSPO's token variant)"
        )
    if ppo.distill_coef > 0 and not cfg.teacher.path:
        out.append(
            f"'ppo.distill_coef' is {ppo.distill_coef}, but 'teacher.path' is not set: on-policy distillation "
            "needs teacher.path, the teacher model's directory"
        )
    if ppo.policy_loss == "cispo" and ppo.c_clip is not None:
        out.append(
            "'ppo.c_clip' (dual clip) bounds the PPO loss of negative advantages, but 'ppo.policy_loss' cispo "
            "clips its importance weight instead: give c_clip=null"
        )
    if ppo.prox_logp_method == "loglinear" and not ppo.use_decoupled_loss:
        out.append(
            "'ppo.prox_logp_method' loglinear approximates the proximal policy of the decoupled loss, but "
            "'ppo.use_decoupled_loss' is false: give use_decoupled_loss=true, or prox_logp_method=recompute"
        )
    out += _behav_correction_problems(cfg)
    bc, two_policies = ppo.behav_correction, not (ppo.use_decoupled_loss or ppo.recompute_logprob)
    masks = bc.action == "mask" and (bc.lower is not None or bc.upper is not None)
    if ppo.policy_loss == "cispo" and two_policies and masks:
        out.append(
            "'ppo.policy_loss' cispo keeps a gradient on every token, but 'ppo.behav_correction.action' mask "
            "drops the tokens whose ratio pi/mu (cispo's own, with two policies) leaves the bounds: give "
            "ppo.behav_correction.action=clamp (truncated importance sampling)"
        )
    if ppo.group_baseline == "leave_one_out" and cfg.group_size < 2:
        out.append(
            f"'ppo.group_baseline' leave_one_out needs 'group_size' >= 2 (the other answers of the prompt); "
            f"group_size is {cfg.group_size}"
        )
    if ppo.group_baseline != "none" and ppo.adv_norm and ppo.group_adv_norm:
        out.append(
            f"'ppo.group_baseline' {ppo.group_baseline} with 'ppo.group_adv_norm' true: group normalisation "
            "already subtracts the group's mean; give ppo.group_adv_norm=false (or group_baseline=none)"
        )
    if ppo.overlong_buffer is not None and round(ppo.overlong_buffer * ppo.gen.max_new_tokens) < 1:
        out.append(
            f"'ppo.overlong_buffer' {ppo.overlong_buffer} of 'ppo.gen.max_new_tokens' {ppo.gen.max_new_tokens} "
            "is less than one token: give a larger share, or overlong_buffer=null"
        )
    if cfg.dynamic_sampling and cfg.group_size < 2:
        out.append(
            "'dynamic_sampling' drops the groups whose answers all have the same reward, and with 'group_size' "
            "1 every group has: give group_size >= 2, or dynamic_sampling=false"
        )
    return out


def _behav_correction_problems(cfg: ExperimentConfig) -> list[str]:
    """Bounds of ppo.behav_correction that cannot mean anything."""
    bc, key, out = cfg.ppo.behav_correction, "ppo.behav_correction", []
    if bc.action == "clamp" and bc.metric != "ratio":
        out.append(
            f"'{key}.action' clamp clips the importance weight, but '{key}.metric' is {bc.metric}: give "
            f"{key}.metric=ratio, or action=mask to drop the tokens whose {bc.metric} leaves the bounds"
        )
    if bc.action == "clamp" and bc.lower is None and bc.upper is None:
        out.append(
            f"'{key}.action' clamp, but '{key}.lower' and '{key}.upper' are both null: nothing to clamp; "
            "give a bound"
        )
    if bc.lower is not None and bc.upper is not None and bc.lower >= bc.upper:
        out.append(f"'{key}.lower' ({bc.lower}) is not below '{key}.upper' ({bc.upper})")
    if bc.metric == "ratio" and bc.lower is not None and bc.lower < 0:
        out.append(
            f"'{key}.lower' is {bc.lower}, but '{key}.metric' ratio is never negative: give a lower bound "
            ">= 0, or null"
        )
    return out


def extension_problems(cfg: ExperimentConfig) -> list[str]:
    """The forms of the extension specs (importing them is the preflight's), and the options they bring."""
    specs = {
        "reward.fn": cfg.reward.fn,
        "dataset.loader": cfg.dataset.loader,
        "actor.interface": cfg.actor.interface,
        "rollout.workflow": cfg.rollout.workflow,
        "rollout.agent": cfg.rollout.agent,
    }
    out = [p for field, spec in specs.items() if (p := extensions.spec_problem(field, spec))]
    out += agent_problems(cfg)
    out += [p for spec in cfg.rollout.tools if (p := extensions.spec_problem("rollout.tools", spec))]
    if len(set(cfg.rollout.tools)) != len(cfg.rollout.tools):
        out.append(f"'rollout.tools' names a tool twice: {cfg.rollout.tools}")
    if cfg.rollout.workflow == "tool_loop" and not cfg.rollout.tools:
        out.append(
            "'rollout.tools' is empty, but 'rollout.workflow' tool_loop calls tools: name at least one"
        )
    if cfg.reward.fn is None and cfg.reward.fn_batch:
        out.append("'reward.fn_batch' is true, but 'reward.fn' is not set: name the batch reward function")
    mine = {"ppo": "ppo_actor", "sft": "sft"}[cfg.experiment_type]
    if cfg.actor.interface in ("ppo_actor", "sft") and cfg.actor.interface != mine:
        out.append(
            f"'actor.interface' is {cfg.actor.interface!r}, the interface of the other experiment type; "
            f"experiment_type {cfg.experiment_type} takes {mine!r} (or null)"
        )
    return out


def agent_problems(cfg: ExperimentConfig) -> list[str]:
    """An agent trained as it is (rollout.agent or rollout.agent_command) in place of the workflow: one of
    them, a program that is there, a model name the OpenAI endpoint can serve."""
    rollout, out = cfg.rollout, []
    agents = [key for key in ("agent", "agent_command") if getattr(rollout, key) is not None]
    if len(agents) == 2:
        out.append("'rollout.agent' and 'rollout.agent_command' are both set: set one")
    if agents and rollout.workflow != "single_turn":
        named = " and ".join(f"'rollout.{key}'" for key in agents) + (" is" if len(agents) == 1 else " are")
        out.append(
            f"'rollout.workflow' is {rollout.workflow!r}, but {named} set: the agent replaces the workflow; "
            "set rollout.workflow=single_turn (its default)"
        )
    if rollout.agent_command is not None:
        out += _command_problems(rollout.agent_command)
    out += _agent_env_problems(rollout)
    if not rollout.agent_model or any(c.isspace() for c in rollout.agent_model):
        out.append(f"'rollout.agent_model' is {rollout.agent_model!r}; give a model name without whitespace")
    return out


def _agent_env_problems(rollout) -> list[str]:
    """rollout.agent_env and agent_isolation apply to the program of rollout.agent_command; agent_env names
    variables, none of those the program gets anyway."""
    unused = [key for key, default in (("agent_env", []), ("agent_isolation", "required"))
              if getattr(rollout, key) != default and rollout.agent_command is None]  # fmt: skip
    out = [f"'rollout.{key}' is set, but 'rollout.agent_command' is not: it applies to the program of "
           "rollout.agent_command; remove it" for key in unused]  # fmt: skip
    for name in rollout.agent_env:
        if not _ENV_NAME.match(str(name)):
            out.append(
                f"'rollout.agent_env' names {name!r}, which is not a variable name (letters, digits, _)"
            )
        elif name in _PROGRAM_GETS or name.startswith("OPENAI_"):
            out.append(f"'rollout.agent_env' names {name}, which the program gets anyway: remove it")
    return out


def _command_problems(command: str) -> list[str]:
    key = "'rollout.agent_command'"
    try:
        words = shlex.split(command)
    except ValueError as exc:
        return [f"{key} is {command!r}, which does not split into words like a shell line: {exc}"]
    if not words:
        return [f"{key} is empty: give the program to start per episode, and its arguments"]
    if shutil.which(words[0]) is None:
        return [f"{key}: program {words[0]!r} is not found (not on PATH, or not executable)"]
    return []


def allocation_problems(cfg: ExperimentConfig) -> list[str]:
    """allocation_mode against what is implemented (kinds, backends and their parallelism), the cluster size,
    and TP against the actor's attention heads."""
    try:
        mode = alloc.parse_allocation_mode(cfg.allocation_mode)
    except alloc.AllocationError as e:
        return [f"'allocation_mode': {e}"]
    if mode.kind == "manual":
        return [
            f"'allocation_mode' is {cfg.allocation_mode!r}: manual allocations are not implemented yet; give "
            "the generation servers GPUs of their own, e.g. 'builtin.d1p1m1+d1p1m1'"
        ]
    if mode.kind == "decoupled" and cfg.colocated_gen_backend != "builtin":
        return [
            f"'colocated_gen_backend' is set, but allocation_mode {cfg.allocation_mode!r} is decoupled: it names "
            f"its generation backend ({mode.gen_backend!r}) before the '.'"
        ]
    backend = gen_backend(cfg)
    gen = GEN_BACKENDS.get(backend)
    if gen is None:
        return [
            f"'allocation_mode': generation backend {backend!r} is not available "
            f"(available: {', '.join(GEN_BACKENDS)})"
        ]
    out = _colocated_problems(cfg, mode) if mode.kind == "colocated" else []
    if mode.kind != "colocated" and cfg.weight_update_mode == "tensor":
        out.append(
            f"'weight_update_mode': tensor hands GPU memory to servers on the trainers' GPUs, and allocation_mode "
            f"{cfg.allocation_mode!r} gives the servers GPUs of their own; give weight_update_mode=broadcast"
        )
    if out:
        return out
    tensor = (mode.gen or dict(mode.train).get("actor_gen") or dict(mode.train)[alloc.DEFAULT_KEY]).tensor
    if tensor > 1 and not gen.tensor_parallel:
        out.append(
            f"'allocation_mode': generation backend {backend!r} has no tensor parallelism: its servers' "
            f"tensor size must be 1, not {tensor}"
        )
    out += _parallel_problems(cfg, mode)
    if out:
        return out
    try:
        allocation = alloc.resolve_allocation(mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node)
        for mfc in (mfc for name in trainer_models(cfg) for mfc in MFCS_OF[name]):
            allocation.train_spec(mfc)  # every call of a trainer model has a layout
        hf = _hf_config(cfg.actor.path)
        if hf is not None and "num_attention_heads" in hf:
            heads = hf["num_attention_heads"]
            alloc.check_model_heads(allocation, heads, hf.get("num_key_value_heads", heads))
        alloc.check_pipeline_batch(allocation, cfg.dataset.train_bs_n_seqs * cfg.group_size)
    except alloc.AllocationError as e:
        return [f"'allocation_mode': {e}"]
    return _megatron_model_problems(cfg, allocation)


def _megatron_model_problems(cfg: ExperimentConfig, allocation: alloc.Allocation) -> list[str]:
    """What keeps each model on the megatron backend from being built at the TP, PP and EP sizes of its
    calls."""
    out = []
    for name, model in trainer_models(cfg).items():
        hf = _hf_config(model.path) if model.backend == "megatron" else None
        if hf is None:
            continue
        where = f"'{name}.path' ({Path(model.path) / 'config.json'})"
        for spec in dict.fromkeys(allocation.train_spec(mfc) for mfc in MFCS_OF[name]):
            problems = megatron_model_problems(hf, spec.tensor, spec.pipeline, spec.expert)
            out += [f"{where}: {p}" for p in problems]
    return list(dict.fromkeys(out))  # a problem of several layouts once


def _colocated_problems(cfg: ExperimentConfig, mode: alloc.AllocationMode) -> list[str]:
    """Colocated servers and trainers take turns on the same GPUs (master/turns.py)."""
    out = []
    if "actor_gen" not in dict(mode.train) and alloc.DEFAULT_KEY not in dict(mode.train):
        out.append(
            f"'allocation_mode' {cfg.allocation_mode!r} is colocated: its generation servers run on actor_gen's "
            "layout; give actor_gen:<3D spec> or '*:<3D spec>'"
        )
    if cfg.async_rl:
        out.append(
            "'async_rl': colocated generation and training take turns on the same GPUs, so generation cannot "
            "run ahead; give async_rl=false, or the servers GPUs of their own (e.g. 'builtin.d1p1m1+d1p1m1')"
        )
    if cfg.weight_update_mode == "broadcast":
        out.append(
            "'weight_update_mode': colocated servers share the trainers' GPUs, where NCCL cannot join two ranks "
            "of one GPU; give weight_update_mode=tensor (or disk)"
        )
    if cfg.weight_update_mode == "tensor" and cfg.cluster.n_nodes > 1:
        out.append(
            "'weight_update_mode': tensor hands trainer rank 0's GPU memory to the servers of its node only, and "
            f"this run has {cfg.cluster.n_nodes} nodes; give weight_update_mode=disk"
        )
    return out


def gen_backend(cfg: ExperimentConfig) -> str:
    """The generation backend: named by a decoupled allocation_mode, else colocated_gen_backend."""
    return alloc.parse_allocation_mode(cfg.allocation_mode).gen_backend or cfg.colocated_gen_backend


def allocation_of(cfg: ExperimentConfig) -> alloc.Allocation:
    """The allocation of a validated config on its cluster."""
    return alloc.resolve_allocation(cfg.allocation_mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node)


def data_parallel_size(cfg: ExperimentConfig) -> int:
    """The most data-parallel ranks a trainer call splits a batch over: a batch needs that many groups."""
    allocation, sizes = allocation_of(cfg), [1]
    for mfc in (mfc for model in trainer_models(cfg) for mfc in MFCS_OF[model]):
        with contextlib.suppress(alloc.AllocationError):  # a call the graph leaves out, without a layout
            sizes.append(allocation.train_spec(mfc).data)
    return max(sizes)


def mfc_spec(cfg: ExperimentConfig, mfc: str) -> alloc.ParallelSpec:
    """The parallel sizes a trainer call runs at (sft_train: actor_train's)."""
    return allocation_of(cfg).train_spec("actor_train" if mfc == "sft_train" else mfc)


# The trainer calls of each model, its home first: the layout it is loaded on and trains on. A call on another
# layout runs on a copy of the model there, which parameter reallocation keeps up to date.
MFCS_OF = {
    "actor": ("actor_train", "actor_inf"),
    "critic": ("critic_train", "critic_inf"),
    "ref": ("ref_inf",),
    "teacher": ("teacher_inf",),
}


def trainer_models(cfg: ExperimentConfig) -> dict[str, ModelConfig]:
    """The models the trainer ranks host, by name: the actor; the reference policy with a KL penalty (its path
    defaults to the actor's); the teacher of on-policy distillation; the critic unless disable_value."""
    models: dict[str, ModelConfig] = {"actor": cfg.actor}
    if cfg.experiment_type == "ppo" and cfg.ppo.kl_ctl > 0:
        models["ref"] = cfg.ref if cfg.ref.path else dataclasses.replace(cfg.ref, path=cfg.actor.path)
    if cfg.experiment_type == "ppo" and cfg.ppo.distill_coef > 0:
        models["teacher"] = cfg.teacher
    if cfg.experiment_type == "ppo" and not cfg.ppo.disable_value:
        models["critic"] = cfg.critic
    return models


def _parallel_problems(cfg: ExperimentConfig, mode: alloc.AllocationMode) -> list[str]:
    """Each training layout's tensor, pipeline and expert sizes against the backends of the models whose calls
    run on it (`*`: the calls not listed)."""
    out, listed = [], {key for key, _ in mode.train}
    for key, spec in mode.train:
        layout = "the training layout" if key == alloc.DEFAULT_KEY else f"the layout of {key}"
        for model, model_cfg in trainer_models(cfg).items():
            calls = set(MFCS_OF[model])
            if key not in calls and not (key == alloc.DEFAULT_KEY and calls - listed):
                continue
            name = model_cfg.backend
            backend = TRAIN_BACKENDS[name]
            for size, axis, able in (
                (spec.tensor, "tensor", backend.tensor_parallel),
                (spec.pipeline, "pipeline", backend.pipeline_parallel),
            ):
                if size > 1 and not able:
                    out.append(
                        f"'allocation_mode': {layout} {spec.format()} has {axis} size {size}, but {model}.backend "
                        f"{name!r} has no {axis} parallelism (it trains data parallel: give d{spec.world_size}p1m1)"
                    )
            if spec.expert > 1 and not backend.expert_parallel:
                out.append(_expert_problem(layout, spec, model, name))
            if spec.context > 1 and not backend.context_parallel:
                out.append(_context_problem(layout, spec, model, name))
    return out


def _context_problem(layout: str, spec: alloc.ParallelSpec, model: str, name: str) -> str:
    """A layout's c > 1 for a model whose backend has no context parallelism."""
    able = [b for b, backend in TRAIN_BACKENDS.items() if backend.context_parallel]
    why = {"megatron": " (megatron-core's needs Transformer Engine's attention, which is not installed)"}
    return (
        f"'allocation_mode': {layout} {spec.format()} has context size {spec.context}, but {model}.backend "
        f"{name!r} has no context parallelism{why.get(name, '')}: give {model}.backend={able[0]} (Ulysses "
        f"sequence parallelism), or d{spec.data * spec.context} without c"
    )


def _expert_problem(layout: str, spec: alloc.ParallelSpec, model: str, name: str) -> str:
    """A layout's e > 1 for a model whose backend has no expert parallelism."""
    able = [b for b, backend in TRAIN_BACKENDS.items() if backend.expert_parallel]
    dense = dataclasses.replace(spec, expert=1).format()
    return (
        f"'allocation_mode': {layout} {spec.format()} has expert size {spec.expert}, but {model}.backend "
        f"{name!r} has no expert parallelism (backends with it: {', '.join(able)}): give "
        f"{model}.backend={able[0]} for a mixture-of-experts model, or {dense} without e"
    )


def _hf_config(path: str | None) -> dict | None:
    """A local HF config.json, or None when there is none to read."""
    if not path:
        return None
    config_file = Path(path).expanduser() / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def validate(cfg: ExperimentConfig, problems: list[str] | tuple = ()) -> None:
    """Raise ConfigError listing every problem of the config (`problems` found before, too), or return quietly."""
    problems = [*problems, *(p for key, f, value in walk(cfg) for p in field_problems(key, f, value))]
    problems += cross_field_problems(cfg) + router_replay_problems(cfg)
    if not problems:
        problems += allocation_problems(cfg)
    problems += kv_pool.problems(cfg, _hf_config(cfg.actor.path))  # the longest row against the servers
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def router_replay_problems(cfg: ExperimentConfig) -> list[str]:
    """Routing replay (actor.router_replay) and SGLang's expert parallelism (sglang.ep_size) against the actor's
    model and the generation servers' tensor size (issue 33)."""
    hf, out = _hf_config(cfg.actor.path), []
    where = f"'actor.path' ({Path(cfg.actor.path or '') / 'config.json'})"
    experts = None if hf is None else moe_experts(hf.get("text_config", hf))  # None: no local config to read
    if cfg.actor.router_replay == "rollout":
        if cfg.experiment_type != "ppo":
            out.append(
                "'actor.router_replay' is rollout, but experiment_type sft generates no rollouts: give off"
            )
        elif experts == 0:
            out.append(
                f"'actor.router_replay' is rollout, but {where} is a dense model (no num_experts or "
                f"num_local_experts): only a mixture-of-experts model routes; give actor.router_replay=off"
            )
        backend = TRAIN_BACKENDS.get(cfg.actor.backend)  # an unknown one: its own check says so
        if backend is not None and not backend.router_replay:  # the trainer's half is issue 33's next step
            out.append(
                f"'actor.router_replay' is rollout, but actor.backend {cfg.actor.backend} does not replay the "
                "servers' routing yet: give actor.router_replay=off"
            )
    ep = cfg.sglang.ep_size
    if ep < 1:
        return out  # its bounds check says why
    if ep > 1 and experts == 0:
        out.append(f"'sglang.ep_size' is {ep}, but {where} is a dense model: there are no experts to split")
    elif ep > 1 and experts and experts % ep:
        out.append(f"'sglang.ep_size' {ep} does not divide the {experts} experts of {where}")
    try:
        tensor = allocation_of(cfg).gen_tensor
    except alloc.AllocationError:
        return out  # allocation_problems says why
    if tensor % ep:  # SGLang splits a server's tp_size GPUs into groups of ep_size (its parallel_state)
        out.append(
            f"'sglang.ep_size' {ep} must divide the generation servers' tensor size {tensor} "
            f"(allocation_mode {cfg.allocation_mode!r}), as SGLang requires"
        )
    return out
