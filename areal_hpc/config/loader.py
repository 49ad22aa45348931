"""Build an ExperimentConfig from YAML files and `a.b=c` overrides, with typed coercion.

Every raw value remembers where it came from (file:line or the override text), so that an error names
its source. Unknown keys are errors that suggest the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from areal_hpc.alloc import MFC_NAMES
from areal_hpc.config import inert
from areal_hpc.config.checks import validate
from areal_hpc.config.schema import ConfigError, ExperimentConfig

_NULLS = {"null", "none", "~"}
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
# Keys of the original (or of earlier versions) that this version does not take, and why.
NOT_TAKEN = {
    "mode": "the command decides where roles run: `areal-hpc run` (local processes) or `areal-hpc submit` (Slurm)",
    "logging.stats_jsonl": "statistics always go to logs/stats.jsonl",
    "ppo.behav_imp_weight_cap": "replaced by ppo.behav_correction: a cap X is {level: token, action: mask, "
    "metric: ratio, upper: X} (the default, X = 5.0); null is behav_correction.upper: null",
}
MANUAL_KEYS = ("device_mesh", "parallel")  # an MFC's own mesh, for allocation_mode manual


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of each field of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def all_paths(cls: type = ExperimentConfig, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the schema, sections included."""
    out: list[str] = []
    for name, tp in field_types(cls).items():
        path = prefix + name
        out.append(path)
        if dataclasses.is_dataclass(tp):
            out.extend(all_paths(tp, path + "."))
    return tuple(out)


def not_taken(path: str) -> str | None:
    """Why a key of the original that this version does not take is refused, or None."""
    for key, why in NOT_TAKEN.items():
        if path == key or path.startswith(key + "."):
            return why
    parts = path.split(".")
    if len(parts) > 1 and parts[0] in MFC_NAMES and parts[1] in MANUAL_KEYS:
        return (
            "allocation_mode manual is not implemented yet: every MFC takes its layout from allocation_mode"
        )
    return None


def suggest(path: str) -> str:
    """' (did you mean ...?)' for a mistyped dotted key, or ''."""
    leaf = path.rsplit(".", 1)[-1]
    same_leaf = [p for p in all_paths() if p.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(path, all_paths(), n=1, cutoff=0.6)
    if not close:
        siblings = [p for p in all_paths() if p.rsplit(".", 1)[0] == path.rsplit(".", 1)[0]]
        close = difflib.get_close_matches(path, siblings, n=1, cutoff=0.0) if "." in path else []
    return f" (did you mean '{close[0]}'?)" if close else ""


# ---------------------------------------------------------------- raw values with their source


@dataclasses.dataclass
class Raw:
    """A value from a file or an override, with the place it came from."""

    value: Any
    source: str
    from_text: bool = False  # an override's text, still to be parsed by type


def _yaml_tree(node: yaml.Node, loader: yaml.SafeLoader, where: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            line = f"{where}:{key_node.start_mark.line + 1}"
            if not isinstance(key, str):
                raise ConfigError(f"{line}: key {key!r} is not a string")
            if key in out:
                raise ConfigError(f"{line}: key '{key}' appears twice")
            out[key] = _yaml_tree(value_node, loader, where)
            if isinstance(out[key], Raw):
                out[key].source = line
        return out
    return Raw(loader.construct_object(node, deep=True), where)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file as a nested dict of Raw leaves that know their file:line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        tree = {} if node is None else _yaml_tree(node, loader, str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return tree


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of two raw trees; `top` wins."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def override_tree(text: str) -> dict[str, Any]:
    """'a.b=c' as the raw tree {'a': {'b': Raw('c')}}."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' is not of the form key.sub=value")
    tree: dict[str, Any] = {}
    node = tree
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = Raw(value, f"override '{text}'", from_text=True)
    return tree


# ---------------------------------------------------------------- coercion by schema type


def _optional_inner(tp: Any) -> Any | None:
    """T for `T | None`, else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} or null"
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def coerce(raw: Raw, tp: Any, key: str) -> Any:
    """The raw value converted to the schema type `tp`, or a ConfigError naming key and source."""
    try:
        return _coerce(raw.value, tp, raw.from_text)
    except (TypeError, ValueError) as e:
        detail = f": {e}" if str(e) else ""
        raise ConfigError(
            f"{raw.source}: '{key}' expects {type_name(tp)}, got {raw.value!r}{detail}"
        ) from None


def _coerce(value: Any, tp: Any, from_text: bool) -> Any:
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (from_text and value.strip().lower() in _NULLS):
            return None
        return _coerce(value, inner, from_text)
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        if from_text:
            value = _parse_list_text(value)
            return [_coerce(v, item_tp, isinstance(v, str)) for v in value]
        if not isinstance(value, list):
            raise TypeError("")
        return [_coerce(v, item_tp, False) for v in value]
    if tp is bool:
        return _to_bool(value, from_text)
    if tp is int:
        return _to_int(value, from_text)
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError("quote the value in YAML to pass it as a string")
    raise TypeError(f"unsupported schema type {tp}")


def _parse_list_text(text: str) -> list[Any]:
    text = text.strip()
    if text.startswith("["):
        parsed = yaml.safe_load(text)
        return [str(v) if not isinstance(v, str) else v for v in parsed]
    return [part.strip() for part in text.split(",") if part.strip()]


def _to_bool(value: Any, from_text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and (from_text or value.lower() in _TRUE | _FALSE):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise TypeError("")


def _to_int(value: Any, from_text: bool) -> int:
    if isinstance(value, bool):
        raise TypeError("")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return int(value.strip())
    raise TypeError("")


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise TypeError("")


def build(cls: type, tree: dict[str, Any], prefix: str = "") -> Any:
    """An instance of the schema dataclass `cls` from a raw tree; missing keys take defaults."""
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, node in tree.items():
        key = prefix + name
        if name not in types_:
            source = _first_source(node)
            why = not_taken(key)
            if why:
                raise ConfigError(f"{source}: '{key}' is not an option of this version: {why}")
            raise ConfigError(f"{source}: unknown key '{key}'{suggest(key)}")
        tp = types_[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(node, dict):
                raise ConfigError(
                    f"{node.source}: '{key}' is a section; give its keys, e.g. {key}.<key>=value"
                )
            kwargs[name] = build(tp, node, key + ".")
        elif isinstance(node, dict):
            raise ConfigError(f"{_first_source(node)}: '{key}' is a value, not a section")
        else:
            kwargs[name] = coerce(node, tp, key)
    return cls(**kwargs)


def _first_source(node: Any) -> str:
    while isinstance(node, dict):
        node = next(iter(node.values()))
    return node.source


def load_config(paths: list[str | Path] | tuple = (), overrides: list[str] | tuple = ()) -> ExperimentConfig:
    """The config of the YAML files (merged in order) and overrides, type-checked and validated; options that
    do nothing in its mode are refused or dropped (config/inert.py)."""
    layers = [read_yaml(path) for path in paths] + [override_tree(text) for text in overrides]
    tree: dict[str, Any] = {}
    set_at: dict[str, tuple[int, str]] = {}  # key -> (layer, source) of the last layer that set it
    for i, layer in enumerate(layers):
        tree = merge(tree, layer)
        set_at |= {key: (i, raw.source) for key, raw in _leaves(layer)}
    cfg = build(ExperimentConfig, tree)
    cfg, problems = inert.settle(cfg, set_at)
    validate(cfg, problems)
    return cfg


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Raw]]:
    """(dotted key, raw value) of every value of a raw tree."""
    out = []
    for key, node in tree.items():
        out += _leaves(node, f"{prefix}{key}.") if isinstance(node, dict) else [(prefix + key, node)]
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts and lists."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML; loading it back gives an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
