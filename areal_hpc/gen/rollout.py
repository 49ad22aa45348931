"""Synchronous rollout of one step: prompts -> generation servers -> rewards -> a packed batch file.

Each prompt's group_size answers go to one server (prefix-cache reuse, as the original's manager does),
prompts are spread round-robin over the servers, and all requests of a step are submitted at once: each
server's client sends it at most its capacity (max_running_requests) and holds the rest back
(`gen.client.Admission`), so a request's timeout does not run while it queues behind the others.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from areal_hpc.agent import Sample
from areal_hpc.config import GEN_BACKENDS, ExperimentConfig, gen_backend
from areal_hpc.data import PromptSample, write_batch
from areal_hpc.gen.partial import PartialAnswer, from_response


def sampling_params(cfg: ExperimentConfig) -> dict:
    """SGLang sampling_params of the training answers."""
    gen = cfg.ppo.gen
    return {
        "max_new_tokens": gen.max_new_tokens,
        "min_new_tokens": gen.min_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "stop_token_ids": list(gen.stop_token_ids),
        "n": cfg.group_size,
    }


def prompt_seed(seed: int, query_id: str, epoch: int) -> int:
    """The sampling seed of a prompt's group in an epoch, the same in the synchronous and asynchronous paths
    (so that with max_head_offpolicyness 0 both sample the same answers)."""
    return (seed * 1_000_003 + epoch * 7_919 + zlib.crc32(query_id.encode())) % 2**31


def group_params(cfg: ExperimentConfig, query_id: str, epoch: int) -> dict:
    """Sampling params of one prompt's group: seeded only where the generation backend seeds each answer
    (config/backends.py); nothing else relies on the seed."""
    params = sampling_params(cfg)
    if GEN_BACKENDS[gen_backend(cfg)].seeded_sampling:
        params["sampling_seed"] = prompt_seed(cfg.seed, query_id, epoch)
    return params


def generate_groups(
    clients: Sequence, prompts: Sequence[PromptSample], params: Sequence[dict]
) -> list[list[tuple[PartialAnswer, str]]]:
    """group_size (answer, text) per prompt (sampled with params[i]), all prompts submitted at once, prompt i
    on server i % len(servers)."""

    def one(i: int) -> list[tuple[PartialAnswer, str]]:
        responses = clients[i % len(clients)].generate([list(prompts[i].input_ids)], params[i])
        return [(from_response(r), r["text"]) for r in responses]

    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        return list(pool.map(one, range(len(prompts))))


def scores(success: np.ndarray, cfg: ExperimentConfig) -> np.ndarray:
    """The original's reward: ((success - 0.5) * 2 - bias) * scaling."""
    ppo = cfg.ppo
    return (((success - 0.5) * 2 - ppo.reward_output_bias) * ppo.reward_output_scaling).astype(np.float32)


def pack_groups(
    prompts: Sequence[PromptSample], groups: list[list[PartialAnswer]], success: np.ndarray
) -> dict:
    """Packed arrays of prompt + answer sequences (batch keys of docs/architecture.md), without rewards."""
    ids, prompt_mask, logprobs, lengths = [], [], [], []
    no_eos, group_ids, starts, ends = [], [], [], []
    for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True)):
        for answer in answers:
            p = list(prompt.input_ids)
            ids += p + list(answer.output_ids)
            prompt_mask += [True] * len(p) + [False] * len(answer.output_ids)
            logprobs += [0.0] * len(p) + list(answer.logprobs)
            lengths.append(len(p) + len(answer.output_ids))
            no_eos.append(answer.truncated)
            group_ids.append(g)
            starts.append(answer.version_start)
            ends.append(answer.version_end)
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "packed_input_ids": np.asarray(ids, dtype=np.int64),
        "prompt_mask": np.asarray(prompt_mask, dtype=bool),
        "packed_logprobs": np.asarray(logprobs, dtype=np.float32),
        "seq_no_eos_mask": np.asarray(no_eos, dtype=bool),
        "group_ids": np.asarray(group_ids, dtype=np.int64),
        "version_start": np.asarray(starts, dtype=np.int64),
        "version_end": np.asarray(ends, dtype=np.int64),
        "success": success.astype(np.float32),
    }


def pack_episodes(groups: Sequence[Sequence[Sample]], cfg: ExperimentConfig) -> dict:
    """Packed arrays of the samples of each group's episodes (batch keys of docs/architecture.md), rewards
    included; ``token_versions`` holds each trained token's weight version (-1 on the others)."""
    rows = [(g, s) for g, samples in enumerate(groups) for s in samples]
    if not rows:
        raise ValueError("no episode of these groups took a model turn; there is nothing to train on")
    masked = [np.asarray(s.prompt_mask, dtype=bool) for _, s in rows]
    trained = [s.sampled_versions or [0] for _, s in rows]
    success = np.asarray([s.reward for _, s in rows], dtype=np.float32)
    discount = np.asarray([s.discount for _, s in rows], dtype=np.float32)
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum([len(s.ids) for _, s in rows])]).astype(np.int64),
        "packed_input_ids": np.concatenate([np.asarray(s.ids, dtype=np.int64) for _, s in rows]),
        "prompt_mask": np.concatenate(masked),
        "packed_logprobs": np.concatenate(
            [np.where(m, 0.0, np.asarray(s.logprobs)) for m, (_, s) in zip(masked, rows, strict=True)]
        ).astype(np.float32),
        "token_versions": np.concatenate(
            [np.where(m, -1, np.asarray(s.versions)) for m, (_, s) in zip(masked, rows, strict=True)]
        ).astype(np.int64),
        "seq_no_eos_mask": np.asarray([s.truncated for _, s in rows], dtype=bool),
        "group_ids": np.asarray([g for g, _ in rows], dtype=np.int64),
        "version_start": np.asarray([min(v) for v in trained], dtype=np.int64),
        "version_end": np.asarray([max(v) for v in trained], dtype=np.int64),
        "success": success,
        "rewards": scores(success, cfg) * discount,
    }


def rollout_step(
    clients: Sequence,
    rewards,
    prompts: Sequence[PromptSample],
    cfg: ExperimentConfig,
    path: Path,
    epoch: int,
) -> tuple[Path, dict]:
    """Generate, score and write the step's batch file; returns its path and rollout statistics."""
    start = time.monotonic()
    params = [group_params(cfg, p.query_id, epoch) for p in prompts]
    generated = generate_groups(clients, prompts, params)
    gen_secs = time.monotonic() - start
    items = [
        (text, p, a.output_ids) for p, group in zip(prompts, generated, strict=True) for a, text in group
    ]
    success = np.asarray(rewards.score_batch(items), dtype=np.float32)
    groups = [[answer for answer, _ in group] for group in generated]
    arrays = pack_groups(prompts, groups, success)
    arrays["rewards"] = scores(success, cfg)
    write_batch(path, arrays, {"n_prompts": len(prompts), "group_size": cfg.group_size})
    answer_lens = [len(a.output_ids) for answers in groups for a in answers]
    stats = {
        "rollout/answer_len/avg": float(np.mean(answer_lens)),
        "rollout/no_eos_ratio": float(arrays["seq_no_eos_mask"].mean()),
        "rollout/gen_tokens_per_s": sum(answer_lens) / max(gen_secs, 1e-9),
        "timeperf/actor_gen": gen_secs,
        "timeperf/rew_inf": time.monotonic() - start - gen_secs,
    }
    return path, stats
