"""The prefix cache's rollout statistics (rollout/cached_tokens_per_request, rollout/cached_token_ratio) in every
path that makes rollout statistics: a synchronous step, asynchronous groups through the rollout store, and
multi-turn episodes of both, on a fake server whose cache numbers are known."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from areal_hpc.config import load_config
from areal_hpc.data import PromptSample, RolloutStore, read_attrs
from areal_hpc.gen.episode import Services
from areal_hpc.gen.episodes import Episodes, FirstGroups, episodes_step
from areal_hpc.gen.rollout import rollout_step
from areal_hpc.gen.rollout_worker import RolloutContext, RolloutWorker
from areal_hpc.master.sources import rollout_stats
from tests.helpers import REPO_ROOT as REPO

P, Q = (1, 2, 3), (4, 5, 6)  # two prompts that share no prefix


class CachingServer:
    """A fake generation server whose prefix cache holds every prompt + answer it finished: a request's cached
    tokens are its prompt's longest common prefix with one of them (as a radix cache matches). Call k answers
    with ``script[k]`` (ids, finish), the last one again for later calls."""

    def __init__(self, script: list[tuple[list[int], str]]):
        self.script, self.calls, self.held = script, 0, []
        self.lock = threading.Lock()

    def generate(self, prompts, params, rid=None, stop=None):
        (sent,) = prompts
        with self.lock:
            ids, finish = self.script[min(self.calls, len(self.script) - 1)]
            self.calls += 1
            out = []
            for _ in range(params["n"]):  # one after the other: a sample finds its siblings' prefix
                cached = max((common(sent, seq) for seq in self.held), default=0)
                self.held.append([*sent, *ids])
                meta = {"finish_reason": {"type": finish}, "weight_version": "0", "cached_tokens": cached}
                meta["output_token_logprobs"] = [[-0.5, t, None] for t in ids]
                out.append({"text": "", "output_ids": list(ids), "meta_info": meta})
        return out

    def context_length(self):
        return None


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prompt(query_id: str, ids: tuple[int, ...]) -> PromptSample:
    return PromptSample(query_id, "What is 2 + 3?", ids, "math", ("\\boxed{5}",))


def config(*overrides: str):
    return load_config([REPO / "configs/toy-cpu.yaml"], ["group_size=2", *overrides])


SCORES = SimpleNamespace(score_batch=lambda items: [float(i % 2) for i in range(len(items))])
STOP = [([7, 8], "stop")]  # every request answered [7, 8]
CACHE_KEYS = ("rollout/cached_tokens_per_request", "rollout/cached_token_ratio")


def cache_of(stats: dict) -> tuple[float, float]:
    return tuple(stats[key] for key in CACHE_KEYS)


def test_a_synchronous_step_reports_the_cached_tokens_of_its_requests(tmp_path):
    rolled = rollout_step(
        [CachingServer(STOP)], SCORES, [prompt("a", P), prompt("b", Q)], config(), tmp_path / "s.h5", 0
    )
    # Each group: its first sample prefills its 3 prompt tokens, its second finds them cached.
    assert cache_of(rolled.stats) == (6 / 4, 6 / 12)


class Manager:
    """What a rollout worker asks of the generation manager."""

    version = 0

    def schedule_request(self, group, n_tokens):
        return 0

    def release(self, group, n_tokens):
        pass

    def close_group(self, group):
        pass


def worker(tmp_path, client, cfg, episodes=None) -> tuple[RolloutWorker, RolloutStore]:
    store = RolloutStore(tmp_path / "rollouts")
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "")
    ctx = RolloutContext(cfg, [prompt("a", P)], [client], SCORES, Manager(), store, tokenizer,
                         threading.Event(), episodes=episodes, first_groups=FirstGroups(4))  # fmt: skip
    return RolloutWorker(0, 1, ctx, 1), store


def test_asynchronous_groups_carry_their_cache_counts_to_the_step_s_statistics(tmp_path):
    # Every answer is interrupted after a token and continued: 2 requests each, their counts summed.
    client = CachingServer([([7], "abort"), ([8], "stop")])
    rollouts, store = worker(tmp_path, client, config())
    assert rollouts.rollout(prompt("a", P), 1, 0)
    (path,) = store.ready()
    attrs = read_attrs(path)
    # First request: 0 and 3 cached of 3. Continuations of 4 (prompt + 7): each finds it whole, after the abort.
    assert (attrs["requests"], attrs["prompt_tokens"], attrs["cached_tokens"]) == (4, 14, 11)
    assert cache_of(rollout_stats([path], [attrs])) == (11 / 4, 11 / 14)
    # A group's file written before the counts reads as none of them.
    old = {k: v for k, v in attrs.items() if k not in ("requests", "prompt_tokens", "cached_tokens")}
    assert cache_of(rollout_stats([path, path], [attrs, old])) == (11 / 4, 11 / 14)


async def two_turns_on_ids(ctx, record):
    """Two turns, the second extending the first with a token of the user's."""
    first = await ctx.generate(record.input_ids)
    await ctx.generate([*record.input_ids, *first.ids, 4])
    return float(ctx.index % 2)


@pytest.fixture
def episodes(tiny_tokenizer):
    cfg = config("rollout.workflow=tests.test_rollout_stats:two_turns_on_ids")
    return cfg, Episodes(cfg, Services(tiny_tokenizer, cfg.rollout, lambda text, record, ids: 0.0))


# Two episodes of P: turn 1 (3 tokens) cached 0 then 3; turn 2 (P 7 8 4: 6 tokens) finds P 7 8 (5), then itself.
EPISODES = (14 / 4, 14 / 18)


def test_a_synchronous_step_of_episodes_counts_each_turn_as_a_request(episodes, tmp_path):
    cfg, eps = episodes
    rolled = episodes_step([CachingServer(STOP)], eps, [prompt("a", P)], cfg, tmp_path / "s.h5", 0)
    assert rolled.path is not None and cache_of(rolled.stats) == EPISODES


def test_asynchronous_episodes_carry_their_cache_counts_to_the_step_s_statistics(episodes, tmp_path):
    cfg, eps = episodes
    rollouts, store = worker(tmp_path, CachingServer(STOP), cfg, eps)
    assert rollouts.rollout(prompt("a", P), 1, 0)
    (path,) = store.ready()
    attrs = read_attrs(path)
    assert "episode_cached_tokens" not in attrs  # once, with the single-turn groups' names
    assert cache_of(rollout_stats([path], [attrs])) == EPISODES
