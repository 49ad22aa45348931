"""Prompt datasets: read the JSONL format, tokenize the prompts, and hand each rank its batches.

A dataset line (REFERENCE.md section 6)::

    {"query_id": "q1", "prompt": "What is 3 + 4?", "task": "math", "solutions": ["\\boxed{7}"]}

``task`` is one of math | code | stem and defaults to math; ``solutions`` (a list of strings, normally each
with a ``\\boxed{}`` answer) is required for math and stem and optional for code, whose ``input_output`` holds
its test cases (data/code_tests.py). Other fields are ignored, unless a ``reward.fn`` scores the answers: it then
gets every field of the line but the prompt, and needs no solutions or test cases.

``dataset.loader`` may name a function of the user's that reads another format: it takes the path and returns
the records as dicts, validated as the lines are (config/extensions.py).
"""

from __future__ import annotations

import json
import logging
import math
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from areal_hpc.config import ExpCtrlConfig, ExperimentConfig, InputError, extensions
from areal_hpc.data.code_tests import CodeTests, CodeTestsError, parse_code_tests

logger = logging.getLogger(__name__)

TASKS = ("math", "code", "stem")
DEFAULT_TASK = "math"
MAX_ID_CHARS = 512  # a prompt id goes into log lines, ledgers and batch files


class DatasetFormatError(InputError):
    """A dataset file breaks the JSONL format; the message names the file and line."""


class SamplerStateError(ValueError):
    """A saved sampler state does not fit the sampler it is loaded into."""


@dataclass(frozen=True)
class PromptSample:
    """One prompt, tokenized (through the chat template when the dataset was loaded with it)."""

    query_id: str
    prompt: str
    input_ids: tuple[int, ...]
    task: str
    solutions: tuple[str, ...]
    tests: CodeTests | None = None  # a code task's
    # The line's fields but the prompt, for a reward.fn (None when the answers are scored by task).
    fields: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # A worked conversation after the prompt (assistant turns, tool results), for a supervised warm-up.
    messages: tuple[dict, ...] | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class PromptDataset:
    """The prompts kept from one file, and how many were dropped for being longer than max_prompt_len."""

    path: Path
    samples: tuple[PromptSample, ...]
    n_dropped: int
    max_prompt_len: int

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]


# ---------------------------------------------------------------------------------------------------------
# Reading the JSONL format


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Record(NamedTuple):
    query_id: str
    prompt: str
    task: str
    solutions: tuple[str, ...]
    tests: CodeTests | None
    fields: dict[str, Any] | None  # the line but its prompt, kept for a reward.fn
    messages: tuple[dict, ...] | None = None


def _query_id(query_id: Any, where: str) -> str:
    """A line's id as text: a string (or an integer) of printable characters, not too long to be a name in a
    log line. Files named after it are hashes of it (control.fsio.name_of), so any such id is safe on disk."""
    if isinstance(query_id, int) and not isinstance(query_id, bool):
        query_id = str(query_id)
    if not isinstance(query_id, str) or not query_id:
        raise DatasetFormatError(f"{where}: 'query_id' must be a non-empty string, got {_show(query_id)}")
    if len(query_id) > MAX_ID_CHARS:
        raise DatasetFormatError(
            f"{where}: 'query_id' has {len(query_id)} characters, at most {MAX_ID_CHARS}"
        )
    if not query_id.isprintable():
        raise DatasetFormatError(
            f"{where}: 'query_id' {_show(query_id)} holds a character that does not print (a control character, a "
            "separator other than the space, or a lone surrogate)"
        )
    return query_id


def _parse_line(obj: Any, where: str, scored_by_fn: bool = False) -> Record:
    """Validate one decoded line. A line scored by a reward.fn needs no solutions nor test cases (the function
    reads what it needs from the fields it is given)."""
    if not isinstance(obj, dict):
        raise DatasetFormatError(f"{where}: expected a JSON object, got {_show(obj)}")

    query_id = _query_id(obj.get("query_id"), where)

    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetFormatError(f"{where}: 'prompt' must be a non-empty string, got {_show(prompt)}")

    task = obj.get("task", DEFAULT_TASK)
    if task not in TASKS:
        raise DatasetFormatError(f"{where}: 'task' must be one of {', '.join(TASKS)}, got {_show(task)}")

    solutions = obj.get("solutions")
    optional = task == "code" or scored_by_fn
    if solutions is None and optional:
        solutions = []
    if (
        not isinstance(solutions, list)
        or not all(isinstance(s, str) for s in solutions)
        or not (solutions or optional)
    ):
        what = "a list of strings" if optional else "a non-empty list of strings"
        raise DatasetFormatError(f"{where}: 'solutions' must be {what}, got {_show(solutions)}")
    messages = _messages(obj.get("messages"), where)
    if scored_by_fn:
        fields = {**{k: v for k, v in obj.items() if k != "prompt"}, "query_id": query_id}
        return Record(query_id, prompt, task, tuple(solutions), None, fields, messages)
    tests = None
    if task == "code":
        if "input_output" not in obj:
            raise DatasetFormatError(f"{where}: a code task needs 'input_output', its test cases")
        try:
            tests = parse_code_tests(obj["input_output"])
        except CodeTestsError as e:
            raise DatasetFormatError(f"{where}: 'input_output': {e}") from None
    return Record(query_id, prompt, task, tuple(solutions), tests, None, messages)


ROLES = ("assistant", "tool", "user")


def _messages(value: Any, where: str) -> tuple[dict, ...] | None:
    """The optional 'messages': the conversation after the prompt, OpenAI-style (docs/agents.md)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise DatasetFormatError(
            f"{where}: 'messages' must be a non-empty list of messages, got {_show(value)}"
        )
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise DatasetFormatError(
                f"{where}: 'messages'[{i}] must be an object with a role ({', '.join(ROLES)}) and a string "
                f"content, got {_show(m)}"
            )
    if value[-1]["role"] != "assistant":
        raise DatasetFormatError(
            f"{where}: 'messages' must end with the assistant's turn, got {value[-1]['role']!r}"
        )
    return tuple(value)


def _jsonl_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, decoded object) of every non-blank line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                yield where, json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DatasetFormatError(f"{where}: not a valid JSON line ({e}): {_show(raw)}") from None


def read_jsonl(path: str | Path) -> Iterator[Any]:
    """The built-in dataset.loader 'jsonl': the decoded lines of a file (a loader of the user's may wrap it)."""
    return (obj for _, obj in _jsonl_lines(Path(path)))


def _loaded(path: Path, loader: str) -> Iterator[tuple[str, Any]]:
    """(where, object) of every record of `path` as `loader` reads it."""
    if loader == "jsonl":  # ours keeps the line numbers
        yield from _jsonl_lines(path)
        return
    records = extensions.load("dataset.loader", loader)(str(path))
    for i, obj in enumerate(records, start=1):
        yield f"{path}: record {i} of dataset.loader {loader}", obj


def read_prompt_records(path: str | Path, loader: str = "jsonl", scored_by_fn: bool = False) -> list[Record]:
    """Read and validate a dataset, through `loader` (dataset.loader); one Record per line, in order.
    `scored_by_fn`: a reward.fn scores the answers (the records keep their fields for it)."""
    path = Path(path)
    records = []
    first: dict[str, tuple[str, Any]] = {}  # each id in Unicode NFC -> where it was first, as it was written
    for where, obj in _loaded(path, loader):
        record = _parse_line(obj, where, scored_by_fn)
        same = unicodedata.normalize("NFC", record.query_id)
        if same in first:
            before, written = first[same]
            raise DatasetFormatError(
                f"{where}: duplicate query_id {_show(obj['query_id'])} (first at {before}, as {_show(written)}; ids "
                'are compared as text in Unicode NFC, so 7 and "7", or é and e + U+0301, are one id)'
            )
        first[same] = where, obj["query_id"]
        records.append(record)
    if not records:
        raise DatasetFormatError(f"{path}: the dataset holds no records")
    return records


def _prompt_texts(prompts: Sequence[str], tokenizer: Any, apply_chat_template: bool) -> list[str]:
    if not apply_chat_template:
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {name!r} has no chat template; load with apply_chat_template=False")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        for prompt in prompts
    ]


def load_prompt_dataset(
    path: str | Path,
    tokenizer: Any,
    max_prompt_len: int,
    apply_chat_template: bool = True,
    loader: str = "jsonl",
    scored_by_fn: bool = False,
) -> PromptDataset:
    """Read a JSONL prompt dataset and tokenize its prompts; drop (and count) those over max_prompt_len tokens.

    With ``apply_chat_template`` each prompt becomes a single user turn followed by the generation prompt;
    without it the raw prompt is tokenized with the tokenizer's own special tokens (e.g. BOS).
    """
    if not isinstance(max_prompt_len, int) or max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be a positive integer, got {max_prompt_len!r}")
    records = read_prompt_records(path, loader, scored_by_fn)
    texts = _prompt_texts([r.prompt for r in records], tokenizer, apply_chat_template)
    # A chat template writes its own special tokens; adding them again would double the BOS of some models.
    all_ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]
    samples = tuple(
        PromptSample(r.query_id, r.prompt, tuple(ids), r.task, r.solutions, r.tests, r.fields, r.messages)
        for r, ids in zip(records, all_ids, strict=True)
        if len(ids) <= max_prompt_len
    )
    n_dropped = len(records) - len(samples)
    if n_dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens",
            path,
            n_dropped,
            len(records),
            max_prompt_len,
        )
    return PromptDataset(Path(path), samples, n_dropped, max_prompt_len)


def prompts_of(cfg: ExperimentConfig, path: str, tokenizer: Any) -> PromptDataset:
    """The prompts of one of the run's datasets (dataset.path or valid_path), read as the config says."""
    ds = cfg.dataset
    scored_by_fn = cfg.reward.fn is not None
    return load_prompt_dataset(
        path, tokenizer, ds.max_prompt_len, ds.apply_chat_template, ds.loader, scored_by_fn
    )


def training_prompts(cfg: ExperimentConfig, tokenizer: Any) -> PromptDataset:
    """The training prompts; InputError when fewer than one step's batch are short enough to keep."""
    ds = cfg.dataset
    dataset = prompts_of(cfg, ds.path, tokenizer)
    if len(dataset) < ds.train_bs_n_seqs:
        raise InputError(
            f"'dataset.path': {len(dataset)} of the {len(dataset) + dataset.n_dropped} prompts of {ds.path} have at "
            f"most dataset.max_prompt_len={ds.max_prompt_len} tokens, fewer than one step's "
            f"dataset.train_bs_n_seqs={ds.train_bs_n_seqs}"
        )
    return dataset


def run_steps(exp_ctrl: ExpCtrlConfig, n_prompts: int, batch_size: int) -> tuple[int, int]:
    """(steps per epoch, steps of the whole run): whole batches of the prompts (the rest waits for the next
    epoch's shuffle), total_train_epochs of them, at most benchmark_steps."""
    per_epoch = n_prompts // batch_size
    total = per_epoch * exp_ctrl.total_train_epochs
    return per_epoch, total if exp_ctrl.benchmark_steps is None else min(total, exp_ctrl.benchmark_steps)


# ---------------------------------------------------------------------------------------------------------
# Sharded, resumable sampling


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class ShardedSampler:
    """Deterministic shuffled batches of dataset indices for one global rank, resumable mid-epoch.

    Each epoch shuffles all indices with a permutation seeded from (seed, epoch). Rank r takes every
    world_size-th index starting at r, cut to n_items // world_size, so shards are disjoint and of equal
    length; the few indices left over change from epoch to epoch. Step k of all ranks together reads one
    contiguous block of the permutation: the batch a single rank with batch_size * world_size would read.

    Iterating yields the remaining batches of the current epoch (lists of indices) and then moves to the next
    epoch; ``next_batch()`` crosses epochs by itself. The state (epoch, batches consumed in it) is the same on
    every rank, so one rank's ``state_dict()`` restores them all.
    """

    def __init__(
        self, n_items: int, rank: int, world_size: int, seed: int, batch_size: int, drop_last: bool = True
    ):
        _check_int("n_items", n_items, 1)
        _check_int("world_size", world_size, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("seed", seed, 0)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.n_items, self.rank, self.world_size = n_items, rank, world_size
        self.seed, self.batch_size, self.drop_last = seed, batch_size, drop_last
        self.shard_len = n_items // world_size
        rounding = math.floor if drop_last else math.ceil
        self.batches_per_epoch = rounding(self.shard_len / batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{n_items} items give no batch of {batch_size} per rank with world_size={world_size}"
            )
        self.epoch, self.position = 0, 0
        self._shard_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.batches_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The shuffled order of all indices in ``epoch``, identical on every rank."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_items)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's indices in ``epoch``, in the order they are served."""
        if self._shard_cache is None or self._shard_cache[0] != epoch:
            shard = self.permutation(epoch)[self.rank :: self.world_size][: self.shard_len]
            self._shard_cache = (epoch, shard)
        return self._shard_cache[1]

    def next_batch(self) -> list[int]:
        """The next batch of indices; the state moves past it (into the next epoch after the last one)."""
        start = self.position * self.batch_size
        batch = self.shard(self.epoch)[start : start + self.batch_size].tolist()
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: where the next batch comes from, and what the sampler was built with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "world_size": self.world_size,
            "n_items": self.n_items,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuse a state saved by a sampler of another shape."""
        if not isinstance(state, dict):
            raise SamplerStateError(f"sampler state must be a dict, got {_show(state)}")
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise SamplerStateError(f"sampler state lacks {', '.join(missing)}: {_show(state, 200)}")
        for key in ("n_items", "world_size", "batch_size", "seed", "drop_last"):
            if state[key] != mine[key]:
                raise SamplerStateError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={mine[key]!r}; a restore needs the same {key}"
                )
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)) or not (
            0 <= position < self.batches_per_epoch
        ):
            raise SamplerStateError(
                f"sampler state has epoch={epoch!r} position={position!r}; "
                f"need epoch >= 0 and 0 <= position < {self.batches_per_epoch}"
            )
        self.epoch, self.position = epoch, position
