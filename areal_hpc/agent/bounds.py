"""Bounds on what comes from outside as JSON or text (an agent's request, the policy's tool calls): nesting and
text that the tokenizer and the chat template cannot take are refused here, by name, before they reach them
(deep nesting recurses in json, Jinja and the template's `tojson`; a lone surrogate fails the tokenizer)."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 32  # objects and lists inside each other: tool arguments of real agents stay under ten
# Text that needs more bytes than this per token of the context cannot fit it (English takes about 4 bytes a
# token, Chinese about 4.5, code 3-4): refused by length before anything renders or tokenizes it.
BYTES_PER_TOKEN = 16


class Unusable(ValueError):
    """JSON that parses but is nested too deep or holds text that is not Unicode; ``where`` is its path."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)
        self.where, self.what = where, what


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` whose result is nested at most ``max_depth`` deep and holds only encodable text; else
    json.JSONDecodeError (bad syntax, text that is not UTF-8) or Unusable, which says what is wrong and where."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Unusable("", f"nested deeper than {max_depth} levels") from None
    if (found := problem(value, max_depth)) is not None:
        raise Unusable(*found)
    return value


def problem(value: Any, max_depth: int = MAX_DEPTH) -> tuple[str, str] | None:
    """The first place in ``value`` (a JSON path such as ``messages[2].content``) nested deeper than
    ``max_depth``, or holding text that is not valid Unicode (a lone surrogate), and what is wrong there."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return where, "holds text that is not valid Unicode (a lone surrogate)"
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                return where[:60], f"nested deeper than {max_depth} levels"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str) and not _encodable(key):
                    return where, "has a key that is not valid Unicode (a lone surrogate)"
                if isinstance(child, str | dict | list):  # numbers need no look (nor a path)
                    inner = (
                        f"{where}[{key}]" if isinstance(item, list) else f"{where}.{key}" if where else key
                    )
                    stack.append((child, inner, depth + 1))
    return None


def text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in ``value``, keys included (call after ``problem`` found none)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode())
        elif isinstance(item, dict):
            total += sum(len(k.encode()) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
