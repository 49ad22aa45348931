"""The figures of a run (`areal-hpc plot`): one 960x540 PNG per figure whose statistics the rows hold."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.image import imread

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control.rundir import create_run_dir
from areal_hpc.monitor import StatsLog
from areal_hpc.monitor.plots import FIGURES, figures, plot_run

TOOLS = ("calculator", "python")


def ppo_step(step: int) -> dict:
    """One step of a PPO run, with every statistic the figures read."""
    row = {"step": step, "time": 1000.0 + step}
    for name, avg in [("reward", 0.1 * step), ("task_reward", 0.1 * step - 0.5)]:
        row |= {
            f"ppo_actor/{name}/avg": avg,
            f"ppo_actor/{name}/min": avg - 0.5,
            f"ppo_actor/{name}/max": avg + 0.5,
        }
    for name in ("importance_weight", "behave_imp_weight"):
        row |= {f"ppo_actor/{name}/avg": 1.0, f"ppo_actor/{name}/min": 0.8, f"ppo_actor/{name}/max": 1.3}
    for end in ("head", "tail"):
        row |= {f"ppo_actor/{end}_offpolicyness/avg": 0.5, f"ppo_actor/{end}_offpolicyness/max": 2.0}
    row |= {
        "rollout/answer_len/avg": 300.0 - 10 * step,
        "ppo_actor/seq_len/avg": 400.0 - 10 * step,
        "ppo_actor/prompt_len/avg": 100.0,
        "rollout/no_eos_ratio": 0.2,
        "ppo_actor/no_eos_ratios/avg": 0.2,
        "ppo_actor/actor_loss/avg": 1.0 / step,
        "timeperf/actor_gen": 10.0,
        "timeperf/rew_inf": 1.0,
        "timeperf/actor_train": 5.0 + step,
        "timeperf/weight_sync": 0.5,
        "timeperf/e2e": 17.0 + step,
        "eval/greedy_acc": 0.2 + 0.05 * step,
    }
    row |= {  # an agent's episodes
        "rollout/turns_per_episode": 3.0 - 0.1 * step,
        "rollout/breaks_per_episode": 0.1,
        "rollout/tool_calls_per_episode": 1.5,
        "rollout/tool_results_per_episode": 1.2,
        "rollout/tool_errors_per_episode": 0.3,
        **{f"rollout/tool_calls_per_episode/{name}": 0.5 for name in TOOLS},
    }
    return row


def ppo_run() -> list[dict]:
    """Six steps, step 4 logged twice (the second wins), a NaN, and checkpoint evaluations arriving late."""
    rows = [ppo_step(step) for step in range(1, 7)]
    rows.insert(4, ppo_step(4) | {"ppo_actor/reward/avg": 0.9})
    rows[0]["ppo_actor/task_reward/avg"] = math.nan
    for step in (3, 6):
        rows.append(
            {
                "step": step,
                "time": 2000.0 + step,
                "eval/math_500/greedy_acc": 0.1 * step,
                "eval/math_500/sample_pass@1": 0.08 * step,
                "eval/aime24/pass@8": 0.02 * step,
                "eval/math_500/maj@32": 0.11 * step,
                "eval/math_500/greedy_length": 512.0,  # not an accuracy: not plotted
                "eval/math_500/num_questions": 500,
            }
        )
    return rows


def assert_figure(path):
    assert path.read_bytes().startswith(b"\x89PNG")
    image = imread(path)
    assert image.shape[:2] == (540, 960) and image.shape[2] in (3, 4)
    assert image.std() > 0
    rgb = (image[..., :3] * 255).round().astype(np.int64)
    colours = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])  # one integer per colour: fast
    assert len(colours) > 2  # more than background and text: something was drawn


def test_a_ppo_run_gives_every_figure(tmp_path):
    paths = plot_run(ppo_run(), tmp_path / "plots")  # the folder is created
    assert paths == [tmp_path / "plots" / f"{name}.png" for name in FIGURES]
    for path in paths:
        assert_figure(path)
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary file left behind


def test_the_reward_figure_names_the_task_reward_and_the_scaled_one_and_episodes_get_turns_and_tools():
    drawn = figures(ppo_run())
    reward, tools = drawn["reward"], drawn["tools"]
    assert [ax.get_ylabel() for ax in reward.axes] == ["task reward", "scaled reward (trained on)"]
    assert legend(reward) == ["task reward", "scaled reward"]
    assert legend(drawn["turns"]) == ["turns", "breaks"]
    assert legend(tools) == ["tool calls", "tool results", "tool errors", *(f"calls of {n}" for n in TOOLS)]


def legend(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[-1].get_legend().get_texts()]


def test_a_run_without_evaluations_gives_no_eval_figure(tmp_path):
    rows = [{k: v for k, v in row.items() if not k.startswith("eval/")} for row in ppo_run()]
    names = [path.stem for path in plot_run(rows, tmp_path)]
    assert names == [name for name in FIGURES if name != "eval"]
    assert not (tmp_path / "eval.png").exists()


def test_a_supervised_run_gives_only_the_loss_figure(tmp_path):
    rows = [{"step": step, "time": 100.0 + step, "sft/loss": 2.0 / step} for step in range(1, 6)]
    assert plot_run(rows, tmp_path) == [tmp_path / "loss.png"]
    assert_figure(tmp_path / "loss.png")


def test_no_statistics_give_no_figures(tmp_path):
    assert plot_run([], tmp_path) == []
    assert plot_run([{"step": 1, "time": 1.0, "eval/math_500/num_questions": 500}], tmp_path) == []


def test_areal_hpc_plot_writes_a_runs_figures_into_its_logs(tmp_path, capsys):
    run = create_run_dir(load_config(overrides=[f"cluster.fileroot={tmp_path}", "trial_name=t1"]))
    assert main(["plot", str(run.root)]) == 1  # nothing logged yet
    stats = StatsLog(run.stats)
    for row in ppo_run():
        stats.write(row.pop("step"), {k: v for k, v in row.items() if k != "time"})
    assert main(["plot", str(run.root)]) == 0
    assert capsys.readouterr().out.split() == [str(run.plots / f"{name}.png") for name in FIGURES]
