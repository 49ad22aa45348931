"""The examples of docs/extending.md: a reward function, a dataset loader and an actor interface that live outside
areal_hpc, as a user's would (this folder on PYTHONPATH). tests/test_extensions.py trains the toy with them."""

import csv
import re

from areal_hpc.train.interfaces import PPOActor


def boxed_number(prompt, completion, prompt_ids, completion_ids, answer, **fields):
    """1.0 when the completion's last \\boxed{} holds the dataset line's answer (an integer)."""
    found = re.findall(r"\\boxed\{(-?\d+)\}", completion)
    return float(bool(found) and int(found[-1]) == int(answer))


def boxed_numbers(prompts, completions, prompt_ids, completion_ids, answer, **fields):
    """boxed_number for a batch (reward.fn_batch: true): lists in, one score per completion out."""
    return [boxed_number(None, c, None, None, a) for c, a in zip(completions, answer, strict=True)]


def read_csv(path):
    """Dataset records from a CSV file of id,question,answer rows (dataset.loader)."""
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            yield {"query_id": row["id"], "prompt": row["question"], "answer": row["answer"]}


class CountingActor(PPOActor):
    """The PPO actor, with the sequences this rank trained on as a statistic of its own (actor.interface)."""

    def train_step(self, engine, batch, mb_spec, global_step=None):
        stats = super().train_step(engine, batch, mb_spec, global_step)
        stats["toy_plugin/rank_seqs"] = float(len(batch["cu_seqlens"]) - 1)
        return stats


async def answer_length(prompt, completion, prompt_ids, completion_ids, **fields):
    """An async reward (awaited in its worker process): the answer's share of 8 tokens. The tests use it to see
    the function's scores become the task reward."""
    return len(completion_ids) / 8
