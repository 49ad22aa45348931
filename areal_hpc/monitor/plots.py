"""A run's per-step statistics (the rows of stats.jsonl) as PNG figures of 960x540 pixels: reward, lengths,
off-policyness, importance weights, time per step, evaluations, loss, and the turns and tool use of multi-turn
episodes, one file each."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

Series = dict[str, dict[int, float]]  # statistic -> step -> value

SIZE, DPI = (9.6, 5.4), 100  # 960x540 pixels, the same for every figure
LENGTHS = ("rollout/answer_len/avg", "ppo_actor/seq_len/avg", "ppo_actor/prompt_len/avg")
NO_EOS = ("rollout/no_eos_ratio", "ppo_actor/no_eos_ratios/avg")
TASK_REWARD, SCALED_REWARD = "ppo_actor/task_reward/avg", "ppo_actor/reward/avg"
TURNS = ("turns", "breaks", "interrupted_turns", "refused_requests")  # rollout/<name>_per_episode
TOOLS = ("tool_calls", "tool_results", "tool_errors")
E2E = "timeperf/e2e"
# Accuracy-like evaluations: the in-run `eval/greedy_acc` and checkpoint ones `eval/<set>/<metric>`;
# lengths and question counts are not accuracies.
ACCURACY = re.compile(r"eval/(?:.+/)?(?:greedy_acc|sample_pass@\d+|pass@\d+|maj@\d+)")


def _series(rows: list[dict]) -> Series:
    """Each statistic's value per step. The last finite value in file order wins: evaluation rows come
    later with the step of their checkpoint, and a step may be logged again."""
    out: Series = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, int | float) and math.isfinite(value):
                out.setdefault(key, {})[step] = float(value)
    return out


def _curve(ax, s: Series, key: str, label: str | None = None, band: tuple[str, str] | None = None, **style):
    """One statistic against step, with an optional (min, max) band in its colour; None when absent."""
    if key not in s:
        return None
    label = label or key
    steps = sorted(s[key])
    (line,) = ax.plot(steps, [s[key][x] for x in steps], label=label, **{"marker": ".", **style})
    lo, hi = band or ("", "")
    if lo in s and hi in s:
        both = sorted(s[lo].keys() & s[hi].keys())
        lows, highs = [s[lo][x] for x in both], [s[hi][x] for x in both]
        ax.fill_between(both, lows, highs, color=line.get_color(), alpha=0.15, lw=0, label=f"{label} min-max")
    return line


def _avg_band(ax, s: Series, name: str):
    key = f"ppo_actor/{name}"
    return _curve(ax, s, f"{key}/avg", name, band=(f"{key}/min", f"{key}/max"))


def _reward(ax, s: Series) -> bool:
    # The task reward (the task's score, or the workflow's or agent's reward: 1 solved, 0 not) and the scaled
    # reward PPO trains on, ((task reward - 0.5) x 2 - ppo.reward_output_bias) x ppo.reward_output_scaling: each
    # on its own axis, so that both read. No min-max bands: with 0/1 task rewards they span the whole range.
    ax.set(title="Reward", ylabel="task reward")
    drawn = [_curve(ax, s, TASK_REWARD, "task reward")]
    if SCALED_REWARD in s:
        right = ax.twinx()
        right.set_ylabel("scaled reward (trained on)")
        drawn.append(_curve(right, s, SCALED_REWARD, "scaled reward", color="C1", linestyle="--"))
    return any(drawn)


def _lengths(ax, s: Series) -> bool:
    ax.set(title="Lengths", ylabel="tokens")
    drawn = [_curve(ax, s, key) for key in LENGTHS]
    if any(key in s for key in NO_EOS):  # a ratio in [0, 1]: on its own scale, dashed to tell it apart
        right = ax.twinx()
        right.set_ylabel("no-EOS ratio")
        colours = [f"C{len(LENGTHS) + i}" for i in range(len(NO_EOS))]
        drawn += [
            _curve(right, s, key, color=c, linestyle="--") for key, c in zip(NO_EOS, colours, strict=True)
        ]
    return any(drawn)


def _offpolicyness(ax, s: Series) -> bool:
    ax.set(title="Off-policyness", ylabel="policy versions behind")
    drawn = []
    for i, end in enumerate(("head", "tail")):
        key = f"ppo_actor/{end}_offpolicyness"
        drawn.append(_curve(ax, s, f"{key}/avg", f"{end} avg", color=f"C{i}"))
        drawn.append(_curve(ax, s, f"{key}/max", f"{end} max", color=f"C{i}", linestyle="--"))
    return any(drawn)


def _importance_weights(ax, s: Series) -> bool:
    ax.set(title="Importance weights", ylabel="weight")
    drawn = any([_avg_band(ax, s, name) for name in ("importance_weight", "behave_imp_weight")])
    if drawn:
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1.0 (on-policy)")
    return drawn


def _time(ax, s: Series) -> bool:
    ax.set(title="Time per step", ylabel="seconds")
    # The parts vary by run; the largest at the bottom, where its height reads best.
    parts = sorted(
        (k for k in s if k.startswith("timeperf/") and k != E2E), key=lambda k: -sum(s[k].values())
    )
    steps = sorted({x for key in parts for x in s[key]})
    width = 0.8 * min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)
    bottom = [0.0] * len(steps)
    for key in parts:
        heights = [s[key].get(x, 0.0) for x in steps]
        ax.bar(steps, heights, width, bottom=bottom, label=key.removeprefix("timeperf/"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    return any([parts, _curve(ax, s, E2E, "e2e", color="black")])


def _eval(ax, s: Series) -> bool:
    ax.set(title="Evaluation", ylabel="accuracy")
    keys = [key for key in sorted(s) if ACCURACY.fullmatch(key)]
    return any([_curve(ax, s, key, key.removeprefix("eval/"), marker="o") for key in keys])


def _loss(ax, s: Series) -> bool:
    ax.set(title="Loss", ylabel="loss")
    return any([_curve(ax, s, key) for key in sorted(s) if key.endswith(("loss", "loss/avg"))])


def _turns(ax, s: Series) -> bool:
    ax.set(title="Turns per episode", ylabel="per episode")
    return any([_curve(ax, s, f"rollout/{name}_per_episode", name.replace("_", " ")) for name in TURNS])


def _tools(ax, s: Series) -> bool:
    # The totals, then each tool's calls (agents' and workflows' tools alike), dashed.
    ax.set(title="Tool use per episode", ylabel="per episode")
    drawn = [_curve(ax, s, f"rollout/{name}_per_episode", name.replace("_", " ")) for name in TOOLS]
    if any(drawn):
        prefix = "rollout/tool_calls_per_episode/"
        for key in sorted(k for k in s if k.startswith(prefix)):
            _curve(ax, s, key, f"calls of {key.removeprefix(prefix)}", linestyle="--")
    return any(drawn)


_DRAW = {
    "reward": _reward,
    "lengths": _lengths,
    "offpolicyness": _offpolicyness,
    "importance_weights": _importance_weights,
    "time": _time,
    "eval": _eval,
    "loss": _loss,
    "turns": _turns,
    "tools": _tools,
}
FIGURES = tuple(_DRAW)  # each written as `<name>.png`


def plot_run(rows: list[dict], out_dir: Path) -> list[Path]:
    """Write one PNG per figure whose statistics the rows hold; return their paths (figures without data are skipped)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out_dir / f"{name}.png") for name, fig in figures(rows).items()]


def figures(rows: list[dict]) -> dict[str, Figure]:
    """The figures whose statistics the rows hold, by name."""
    s = _series(rows)
    out = {}
    for name, draw in _DRAW.items():
        fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")  # no pyplot: no global state, no display
        ax = fig.add_subplot()
        if not draw(ax, s):
            continue
        ax.set_xlabel("global step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        # One legend for both axes of a twin plot, on the top one so no line hides it.
        handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
        fig.axes[-1].legend(handles=handles, fontsize="small")
        out[name] = fig
    return out


def _save(fig: Figure, path: Path) -> Path:
    """Write atomically, so a reader (a browser refreshing the run's folder) never sees half a file.
    print_png renders at the figure's own size and dpi, whatever the user's savefig rcParams say."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    FigureCanvasAgg(fig).print_png(tmp)
    os.replace(tmp, path)
    return path
