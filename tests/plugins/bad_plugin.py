"""Extensions with the faults a user's may have, for tests/test_extensions.py."""

import time


def sleeps_on_long_answers(prompt, completion, prompt_ids, completion_ids, **fields):
    if len(completion) > 5:
        time.sleep(3600)
    return 1.0


def raises(prompt, completion, prompt_ids, completion_ids, **fields):
    return {}["no such key"]


def returns_text(prompt, completion, prompt_ids, completion_ids, **fields):
    return "1.0"


def one_score_short(prompts, completions, prompt_ids, completion_ids, **fields):
    return [1.0] * (len(completions) - 1)


def takes_two(prompt, completion):
    return 1.0


class NoInference:
    """An actor interface that cannot run actor_inf."""

    def __init__(self, cfg):
        self.cfg = cfg

    def train_step(self, engine, batch, mb_spec, global_step=None):
        return {}
