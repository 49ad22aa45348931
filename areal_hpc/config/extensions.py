"""Extension points: code of the user's that the config names, by a registered name or as "module:attribute".

    reward.fn        scores every answer in place of the task's scorer      entry-point group areal_hpc.reward_fns
    dataset.loader   reads dataset.path and valid_path into records          'jsonl'; group areal_hpc.dataset_loaders
    actor.interface  what a trainer rank does on the actor's calls           'ppo_actor', 'sft'; group areal_hpc.interfaces
    rollout.workflow what one episode is                                     'single_turn', 'tool_loop'; group areal_hpc.workflows
    rollout.tools    a tool the model may call in tool_loop                  'calculator', 'python'; group areal_hpc.tools
    rollout.agent    an agent trained as it is, through the OpenAI API       group areal_hpc.agents

A name without ':' is a built-in or an entry point of an installed package, which registers it in its pyproject:
[project.entry-points."areal_hpc.reward_fns"] my-score = "my_pkg.rewards:score". `spec_problem` checks the form
(config checks, no import); `load` imports what a spec names and `call_problem` says whether it takes the call
it will get: both run before submit (launch.preflight), and the roles load the same object (docs/extending.md).
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib.metadata import entry_points
from typing import Any

from areal_hpc.config.schema import InputError

BUILTIN: dict[str, dict[str, str]] = {
    "reward.fn": {},
    "dataset.loader": {"jsonl": "areal_hpc.data.dataset:read_jsonl"},
    "actor.interface": {
        "ppo_actor": "areal_hpc.train.interfaces:PPOActor",
        "sft": "areal_hpc.train.interfaces:SFTActor",
    },
    "rollout.workflow": {
        "single_turn": "areal_hpc.agent.workflows:single_turn",
        "tool_loop": "areal_hpc.agent.workflows:tool_loop",
    },
    "rollout.tools": {
        "calculator": "areal_hpc.agent.tools:CALCULATOR",
        "python": "areal_hpc.agent.tools:PYTHON",
    },
    "rollout.agent": {},
}
GROUPS = {
    "reward.fn": "areal_hpc.reward_fns",
    "dataset.loader": "areal_hpc.dataset_loaders",
    "actor.interface": "areal_hpc.interfaces",
    "rollout.workflow": "areal_hpc.workflows",
    "rollout.tools": "areal_hpc.tools",
    "rollout.agent": "areal_hpc.agents",
}
_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class ExtensionError(InputError):
    """An extension the config names cannot be loaded or does not take its call; the message names the key."""


def _registered(field: str) -> dict[str, str]:
    found = {ep.name: ep.value for ep in entry_points(group=GROUPS[field])}
    return {**found, **BUILTIN[field]}


def target(field: str, spec: str) -> str:
    """The "module:attribute" that `spec` (a name or a path) stands for; ExtensionError for an unknown name."""
    if ":" in spec:
        return spec
    names = _registered(field)
    if spec not in names:
        known = ", ".join(sorted(names)) or "none"
        raise ExtensionError(
            f"'{field}' is {spec!r}: not a registered name (registered: {known}); give 'module:attribute', e.g. "
            f"'my_pkg.rewards:score', or register it under the entry-point group {GROUPS[field]}"
        )
    return names[spec]


def spec_problem(field: str, spec: str | None) -> str | None:
    """What is wrong with the form of a spec, without importing anything; None when it may load."""
    if spec is None:
        return None
    if ":" in spec:
        if not _PATH.match(spec):
            return f"'{field}' is {spec!r}; write 'module.path:attribute', e.g. 'my_pkg.rewards:score'"
        return None
    try:
        target(field, spec)
    except ExtensionError as exc:
        return str(exc)
    return None


def load(field: str, spec: str) -> Any:
    """The object `spec` names, imported; ExtensionError naming `field` when that fails."""
    path = target(field, spec)
    module, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:
        raise ExtensionError(
            f"'{field}' is {spec!r}: importing {module} failed ({type(exc).__name__}: {exc}). Every role imports "
            "it too: install its package in the job's environment or put its folder on PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExtensionError(f"'{field}' is {spec!r}: {obj.__name__} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def call_problem(field: str, spec: str, fn: Any, args: tuple, kwargs: dict, how: str) -> str | None:
    """Why `fn(*args, **kwargs)` would be refused by its signature (`how` says what the call is), or None."""
    if not callable(fn):
        return f"'{field}' is {spec!r}, a {type(fn).__name__}, which cannot be called"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call itself will tell
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"'{field}' is {spec!r}{signature}, which does not take {how}: {exc}"
    return None
