"""The tokens of an episode and the training samples made of them.

A `Trajectory` is one growing sequence of ids: context tokens (the prompt, tool results, user turns, the
template's tokens between turns: loss mask 0) and the model's sampled tokens (loss mask 1) with their behaviour
logprobs and the weight version each was sampled under. `export` turns it into samples:

    concat    one sample: the whole conversation up to the last model turn, trained on every sampled token
    per_turn  one sample per model turn: its context (earlier turns included, not trained here) and its tokens

A sample's `prompt_mask` (the batch key) is True on every token the policy did not sample.

Under routing replay a turn keeps the routed experts of its request (gen.routing): rows for the trajectory's
ids up to its end, since its request's prompt was the whole trajectory so far. A sample takes those of its last
turn. The arrays are carried, not read: this module needs no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

NOT_SAMPLED = -1  # the version of a context token


@dataclass(frozen=True)
class Turn:
    """One model turn: its sampled ids are ids[start:end]; finish is stop or length."""

    start: int
    end: int
    finish: str
    routing: Any = field(default=None, compare=False, repr=False)  # its request's routed experts, or None


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # NOT_SAMPLED on context tokens
    turns: list[Turn] = field(default_factory=list)
    # Keep every turn's routing (per_turn export trains each turn with its own); false: the last turn's only
    # (concat), since a turn's routing holds a row for every id before its end.
    routing_per_turn: bool = True

    def add_context(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [NOT_SAMPLED] * len(ids)

    def add_turn(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        finish: str,
        routing: Any = None,
    ) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a turn of {len(ids)} ids has {len(logprobs)} logprobs and {len(versions)} versions"
            )
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        if not self.routing_per_turn and self.turns:
            self.turns[-1] = replace(self.turns[-1], routing=None)
        self.turns.append(Turn(start, len(self.ids), finish, routing))

    def extends(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` start with this trajectory's ids (so a generation on them continues it)."""
        return len(ids) >= len(self.ids) and list(ids[: len(self.ids)]) == self.ids

    @property
    def n_sampled(self) -> int:
        return sum(t.end - t.start for t in self.turns)


@dataclass(frozen=True)
class Sample:
    """One training sequence: ids, which of them the policy did not sample, behaviour logprobs, versions."""

    ids: tuple[int, ...]
    prompt_mask: tuple[bool, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    truncated: bool  # its last model turn ended without a stop token
    reward: float  # the task reward (not yet scaled by ppo.reward_output_*)
    discount: float = 1.0  # the factor on its scaled reward (per_turn: turn_discount ** turns after it)
    # Routing replay: its last turn's routed experts (rows for its ids; fewer: no forward, zeros in the batch)
    routing: Any = field(default=None, compare=False, repr=False)

    @property
    def sampled_versions(self) -> list[int]:
        return [v for v, masked in zip(self.versions, self.prompt_mask, strict=True) if not masked]


def export(
    traj: Trajectory, reward: float | Sequence[float], mode: str, turn_discount: float = 1.0
) -> list[Sample]:
    """The samples of one trajectory (none when the model never took a turn). ``reward`` is the episode's, or one
    per turn (per_turn only); per_turn gives the episode reward to every turn, discounted by ``turn_discount``
    for each turn after it."""
    if not traj.turns:
        return []
    per_turn = not isinstance(reward, int | float)
    if per_turn and mode != "per_turn":
        raise ValueError("a workflow returned one reward per turn; that needs rollout.export: per_turn")
    if per_turn and len(reward) != len(traj.turns):
        raise ValueError(f"a workflow returned {len(reward)} rewards for {len(traj.turns)} turns")
    if mode == "concat":
        return [_sample(traj, traj.turns, traj.turns[-1], float(reward), 1.0)]
    if mode != "per_turn":
        raise ValueError(f"unknown export mode {mode!r}: concat or per_turn")
    n = len(traj.turns)
    return [
        _sample(
            traj, [turn], turn, float(reward[k]) if per_turn else float(reward), turn_discount ** (n - 1 - k)
        )
        for k, turn in enumerate(traj.turns)
    ]


def _sample(traj: Trajectory, trained: Sequence[Turn], last: Turn, reward: float, discount: float) -> Sample:
    """ids up to the end of ``last`` (trailing context tokens carry no loss and are left out), trained on the
    tokens of ``trained``."""
    mask = [True] * last.end
    for turn in trained:
        mask[turn.start : turn.end] = [False] * (turn.end - turn.start)
    return Sample(
        tuple(traj.ids[: last.end]),
        tuple(mask),
        tuple(traj.logprobs[: last.end]),
        tuple(traj.versions[: last.end]),
        last.finish != "stop",
        reward,
        discount,
        last.routing,
    )
