"""Reference documentation of every option, generated from the schema's help texts (docs/config.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_hpc.config import inert
from areal_hpc.config.loader import field_types, type_name
from areal_hpc.config.schema import ExperimentConfig

_HEADER = """# Configuration reference

Generated from `areal_hpc/config/schema.py` by `areal-hpc config docs`; do not edit by hand.

A run's config is the schema below, with YAML files merged over it in order, then `key.sub=value`
overrides from the command line. `areal-hpc config show CONFIG [overrides]` prints the result.
"""


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _constraints(meta: Any) -> str:
    parts = []
    if "choices" in meta:
        parts.append(" \\| ".join(map(str, meta["choices"])))
    for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if name in meta:
            parts.append(f"{symbol} {meta[name]}")
    return "; ".join(parts)


def _rows(cls: type, prefix: str, sections: list[tuple[str, str, type]]) -> list[str]:
    rows = []
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, types_[f.name]
        if dataclasses.is_dataclass(tp):
            sections.append((key, f.metadata["help"], tp))
            continue
        allowed = _constraints(f.metadata)
        help_text = f.metadata["help"] + (f" ({allowed})" if allowed else "")
        rows.append(f"| `{key}` | {type_name(tp)} | `{_fmt(_default(f))}` | {help_text} |")
    return rows


def _inert_section() -> str:
    """The options that do nothing in some modes, and what happens when they are set there (config/inert.py)."""
    doc = (inert.__doc__ or "").split("\n", 1)[1].strip()
    rows = [
        f"| {', '.join(f'`{o}*`' if o.endswith('.') else f'`{o}`' for o in rule.options)} | {rule.why} |"
        for rule in inert.RULES
    ]
    return "\n".join(["## Options that do nothing in some modes\n", doc, "", "| options | do nothing when |",
                      "|---|---|", *rows, ""])  # fmt: skip


def render_markdown() -> str:
    """The whole reference as Markdown, one table per section, in schema order."""
    out = [_HEADER, _inert_section()]
    sections: list[tuple[str, str, type]] = [("", "Top-level options.", ExperimentConfig)]
    while sections:
        key, help_text, cls = sections.pop(0)
        found: list[tuple[str, str, type]] = []
        rows = _rows(cls, key + "." if key else "", found)
        sections[0:0] = found
        out.append(f"## `{key}`\n" if key else "## Top level\n")
        out.append(help_text + "\n")
        if rows:
            out.append("| key | type | default | meaning |\n|---|---|---|---|")
            out.extend(rows)
            out.append("")
    return "\n".join(out)


def render_options() -> str:
    """One line per option, `key = default  # help`, for the terminal."""
    from areal_hpc.config.checks import walk

    return "\n".join(
        f"{key} = {_fmt(value)}  # {f.metadata['help']}" for key, f, value in walk(ExperimentConfig())
    )
