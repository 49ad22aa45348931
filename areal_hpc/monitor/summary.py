"""The end-of-run summary: did the policy learn? First and last steps' reward, held-out accuracy."""

from __future__ import annotations

from statistics import mean

REWARD = "ppo_actor/task_reward/avg"
GREEDY = "eval/greedy_acc"


def learning_summary(rows: list[dict], window: int = 5) -> dict[str, float]:
    """Mean task reward of the first and last `window` steps, and greedy accuracy before and after."""
    rewards = [r[REWARD] for r in rows if REWARD in r]
    evals = [r[GREEDY] for r in rows if GREEDY in r]
    if not rewards:
        raise ValueError(f"no '{REWARD}' in the statistics: is this a PPO run?")
    return {
        "steps": len(rewards),
        "reward_first": mean(rewards[:window]),
        "reward_last": mean(rewards[-window:]),
        "greedy_before": evals[0] if evals else float("nan"),
        "greedy_after": evals[-1] if len(evals) > 1 else float("nan"),
        "secs": sum(r.get("timeperf/e2e", 0.0) for r in rows),
    }


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns with a rule under the header."""
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
