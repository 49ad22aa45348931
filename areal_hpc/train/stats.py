"""Statistics of one request on one rank, reduced over the data-parallel ranks into one flat dict.

Three kinds, as in the original's statistics: masked per-token (or per-sequence) values reported as
``name/avg|min|max`` (the average weighted by how many values each rank had), totals (denominators such as
``n_tokens``, summed) and means of scalars (``grad_norm``, ``lr``: averaged over the calls of all ranks).
``reduce`` is a collective: every rank calls it, and every rank gets the same dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from areal_hpc.algo import MaskedStat
from areal_hpc.train import dist


def _value(x: torch.Tensor | float) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


class StatsTracker:
    """Accumulates statistics on this rank; ``reduce`` combines all ranks."""

    def __init__(self) -> None:
        self._masked: dict[str, list[float]] = {}  # name -> [sum, count, min, max]
        self._totals: dict[str, float] = {}
        self._means: dict[str, list[float]] = {}  # name -> [sum, calls]

    def masked(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Record ``values`` where ``mask`` holds (the name is registered even when none do)."""
        selected = values.detach()[mask.bool()].double()
        entry = self._masked.setdefault(name, [0.0, 0.0, float("inf"), float("-inf")])
        if selected.numel():
            entry[0] += selected.sum().item()
            entry[1] += selected.numel()
            entry[2] = min(entry[2], selected.min().item())
            entry[3] = max(entry[3], selected.max().item())

    def total(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to a total summed over calls and ranks."""
        self._totals[name] = self._totals.get(name, 0.0) + _value(value)

    def mean(self, name: str, value: torch.Tensor | float) -> None:
        """Record one value of a scalar averaged over calls and ranks."""
        entry = self._means.setdefault(name, [0.0, 0.0])
        entry[0] += _value(value)
        entry[1] += 1

    def add(self, stats: Mapping[str, MaskedStat | torch.Tensor | float], totals: Iterable[str] = ()) -> None:
        """Record a loss function's stats: ``(values, mask)`` pairs as masked, names in ``totals`` as totals;
        other scalars are ignored."""
        totals = set(totals)
        for name, stat in stats.items():
            if isinstance(stat, tuple):
                self.masked(name, *stat)
            elif name in totals:
                self.total(name, stat)

    def reduce(self, scope: str = "", group=None) -> dict[str, float]:
        """``{scope}/{name}...`` floats combined over the ranks of ``group`` (None: all ranks; a collective,
        identical on every rank)."""
        names = dist.all_gather_object(
            (sorted(self._masked), sorted(self._totals), sorted(self._means)), group
        )
        masked, totals, means = (sorted(set().union(*(n[i] for n in names))) for i in range(3))
        empty = [0.0, 0.0, float("inf"), float("-inf")]
        m = torch.tensor([self._masked.get(k, empty) for k in masked], dtype=torch.float64).reshape(-1, 4)
        sums = torch.cat(
            [
                m[:, :2].reshape(-1),
                torch.tensor([self._totals.get(k, 0.0) for k in totals], dtype=torch.float64),
                torch.tensor([self._means.get(k, [0.0, 0.0]) for k in means], dtype=torch.float64).reshape(
                    -1
                ),
            ]
        )
        sums = dist.all_reduce(sums, "sum", group)
        lows = dist.all_reduce(torch.cat([m[:, 2], -m[:, 3]]), "min", group)  # max as the min of negatives

        prefix = f"{scope}/" if scope else ""
        out: dict[str, float] = {}
        for i, name in enumerate(masked):
            total, count = sums[2 * i].item(), sums[2 * i + 1].item()
            if count:
                out[f"{prefix}{name}/avg"] = total / count
                out[f"{prefix}{name}/min"] = lows[i].item()
                out[f"{prefix}{name}/max"] = -lows[len(masked) + i].item()
        offset = 2 * len(masked)
        for i, name in enumerate(totals):
            out[prefix + name] = sums[offset + i].item()
        offset += len(totals)
        for i, name in enumerate(means):
            total, calls = sums[offset + 2 * i].item(), sums[offset + 2 * i + 1].item()
            out[prefix + name] = total / max(calls, 1.0)
        return out
