"""Statistics of one request on one rank, reduced over the data-parallel ranks into one flat dict.

Three kinds, as in the original's statistics: masked per-token (or per-sequence) values reported as
``name/avg|min|max`` (the average weighted by how many values each rank had), totals (denominators such as
``n_tokens``, summed) and means of scalars (``grad_norm``, ``lr``: averaged over the calls of all ranks).
``reduce`` is a collective: every rank calls it, and every rank gets the same dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from areal_hpc.algo import MaskedStat
from areal_hpc.train import dist


def _scalar(x: torch.Tensor | float) -> torch.Tensor:
    return x.detach().double() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The values of ``tensors`` as lists of floats: one copy to the host per device they are on."""
    out: dict[str, list[float]] = {}
    for device in {t.device for t in tensors.values()}:
        names = [name for name, t in tensors.items() if t.device == device]
        flat = torch.cat([tensors[name].reshape(-1) for name in names]).cpu().tolist()
        for name in names:
            size = tensors[name].numel()
            out[name], flat = flat[:size], flat[size:]
    return out


class StatsTracker:
    """Accumulates statistics on this rank; ``reduce`` combines all ranks. Values stay where they were made
    (a GPU's loss statistics on the GPU) until ``reduce``: no host sync per micro-batch."""

    def __init__(self) -> None:
        self._masked: dict[str, torch.Tensor] = {}  # name -> [sum, count, min, max]
        self._totals: dict[str, torch.Tensor] = {}
        self._means: dict[str, torch.Tensor] = {}  # name -> [sum, calls]

    def masked(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Record ``values`` where ``mask`` holds (the name is registered even when none do)."""
        v, m = values.detach().double(), mask.bool()
        if v.numel():
            new = torch.stack([
                torch.where(m, v, 0.0).sum(), m.sum().double(),
                torch.where(m, v, math.inf).min(), torch.where(m, v, -math.inf).max(),
            ])  # fmt: skip
        else:
            new = torch.tensor([0.0, 0.0, math.inf, -math.inf], dtype=torch.float64, device=v.device)
        old = self._masked.get(name)
        if old is not None:
            low, high = torch.minimum(old[2], new[2]), torch.maximum(old[3], new[3])
            new = torch.stack([old[0] + new[0], old[1] + new[1], low, high])
        self._masked[name] = new

    def total(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to a total summed over calls and ranks."""
        value = _scalar(value)
        old = self._totals.get(name)
        self._totals[name] = value if old is None else old + value

    def mean(self, name: str, value: torch.Tensor | float) -> None:
        """Record one value of a scalar averaged over calls and ranks."""
        new = torch.stack([_scalar(value).cpu(), torch.tensor(1.0, dtype=torch.float64)])
        old = self._means.get(name)
        self._means[name] = new if old is None else old + new

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
        mine_masked, mine_means = _on_host(self._masked), _on_host(self._means)
        mine_totals = {name: value for name, (value,) in _on_host(self._totals).items()}
        names = dist.all_gather_object((sorted(mine_masked), sorted(mine_totals), sorted(mine_means)), group)
        masked, totals, means = (sorted(set().union(*(n[i] for n in names))) for i in range(3))
        empty = [0.0, 0.0, float("inf"), float("-inf")]
        m = torch.tensor([mine_masked.get(k, empty) for k in masked], dtype=torch.float64).reshape(-1, 4)
        sums = torch.cat([
            m[:, :2].reshape(-1),
            torch.tensor([mine_totals.get(k, 0.0) for k in totals], dtype=torch.float64),
            torch.tensor([mine_means.get(k, [0.0, 0.0]) for k in means], dtype=torch.float64).reshape(-1),
        ])  # fmt: skip
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
