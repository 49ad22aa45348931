"""One row of the longest prompt and answer against what a generation server holds, refused before anything is
submitted: the servers' context length (both backends), and the built-in server's KV pool on a GPU of
cluster.gpu_memory_gib (config/kv_pool.py)."""

import pytest
import torch
from transformers import AutoConfig

from areal_hpc.config import ConfigError, kv_pool, load_config
from areal_hpc.gen.backends.builtin import cache
from areal_hpc.gen.backends.builtin.model import Decoder, Shape

ROW = ["dataset.max_prompt_len=64", "ppo.gen.max_new_tokens=1000"]  # a row of 1064 tokens


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    return str(err.value)


def test_a_context_length_shorter_than_the_longest_row_is_refused_naming_both_lengths(tiny_model_dir):
    message = refusal([f"actor.path={tiny_model_dir}", *ROW, "sglang.context_length=512"])
    assert (
        "'ppo.gen.max_new_tokens' 1000 + 'dataset.max_prompt_len' 64 = 1064 exceeds 'sglang.context_length' 512, "
        "the longest prompt + answer a generation server takes: lower ppo.gen.max_new_tokens or "
        "dataset.max_prompt_len, or raise sglang.context_length to 1064"
    ) in message


def test_the_models_own_context_bounds_the_row_too(tiny_model_dir):
    # The tiny model takes 2048 positions (max_position_embeddings), whatever sglang.context_length says.
    where = f"'actor.path' ({tiny_model_dir / 'config.json'})"
    message = refusal(
        [f"actor.path={tiny_model_dir}", "ppo.gen.max_new_tokens=4000", "dataset.max_prompt_len=64"]
    )
    assert (
        f"'ppo.gen.max_new_tokens' 4000 + 'dataset.max_prompt_len' 64 = 4064 exceeds the model's context, "
        f"max_position_embeddings 2048 of {where} ('sglang.context_length' 32768 is more than it takes): lower "
        "ppo.gen.max_new_tokens or dataset.max_prompt_len"
    ) in message
    message = refusal([f"actor.path={tiny_model_dir}", *ROW, "sglang.context_length=1024"])
    assert "raise sglang.context_length to 1064" in message  # within the model's 2048
    message = refusal(
        [f"actor.path={tiny_model_dir}", "ppo.gen.max_new_tokens=3000", "sglang.context_length=2048"]
    )
    assert f"(the model takes at most 2048: max_position_embeddings of {where})" in message  # beyond it


def test_a_model_only_on_the_cluster_is_bounded_by_the_context_length_alone():
    for mode in ("builtin.d4p1m1+d4p1m1", "sglang.d4p1m1+d4p1m1"):  # both backends refuse such requests
        message = refusal(["actor.path=/shared/models/Qwen3-1.7B", f"allocation_mode={mode}", *ROW,
                           "sglang.context_length=1000"])  # fmt: skip
        assert "= 1064 exceeds 'sglang.context_length' 1000" in message
    load_config(overrides=["actor.path=/shared/models/Qwen3-1.7B", *ROW, "sglang.context_length=null"])


def test_a_multi_turn_workflow_cuts_its_turns_to_the_context_itself(tiny_model_dir):
    # Each turn asks for the room the conversation leaves (gen/episode.py): a longer max_new_tokens is served, cut.
    for workflow in ("rollout.workflow=tool_loop", "rollout.agent=areal_hpc.agent.toy_agent:solve"):
        load_config(overrides=[f"actor.path={tiny_model_dir}", workflow, "ppo.gen.max_new_tokens=4000"])


def test_the_context_is_reported_with_the_other_problems_at_once(tiny_model_dir):
    message = refusal([f"actor.path={tiny_model_dir}", *ROW, "sglang.context_length=512", "group_size=0"])
    assert "'group_size' is 0" in message and "exceeds 'sglang.context_length' 512" in message


def test_a_gpu_too_small_for_one_row_is_refused_with_the_numbers(tiny_model_dir):
    # 0.5 of 6.001 GiB, less 3 GiB reserved and the tiny model's 139840 bfloat16 weights, leaves ~0.25 MB: 62
    # pages of 16 positions at 256 bytes a position, the first the scratch page.
    gpu = [f"actor.path={tiny_model_dir}", "cluster.gpu_memory_gib=6.001", "sglang.mem_fraction_static=0.5"]
    assert (
        "'cluster.gpu_memory_gib' 6.001 leaves the built-in server's KV cache 976 positions, fewer than the "
        "longest row: 'ppo.gen.max_new_tokens' 1000 + 'dataset.max_prompt_len' 64 = 1064 "
        "(sglang.mem_fraction_static 0.5 of 6.001 GiB, less 0.00026 GiB of weights and 3 GiB reserved, leaves "
        "0.00024 GiB at 256 bytes a position): raise sglang.mem_fraction_static, lower ppo.gen.max_new_tokens or "
        "dataset.max_prompt_len, or generate on GPUs with more memory"
    ) in refusal([*gpu, *ROW])
    # 0.9 of 3 GiB is less than the 3 GiB reserved
    three = [f"actor.path={tiny_model_dir}", "cluster.gpu_memory_gib=3", *ROW]
    assert "the built-in server's KV cache 0 positions" in refusal(three)


def test_a_multi_turn_row_needs_the_pool_up_to_the_context(tiny_model_dir):
    gpu = [f"actor.path={tiny_model_dir}", "cluster.gpu_memory_gib=6.001", "sglang.mem_fraction_static=0.5"]
    message = refusal(
        [*gpu, "rollout.workflow=tool_loop", "dataset.max_prompt_len=64", "ppo.gen.max_new_tokens=4000"]
    )
    assert (
        "KV cache 976 positions, fewer than the longest row: 'ppo.gen.max_new_tokens' 4000 + "
        "'dataset.max_prompt_len' 64 = 4064 cut to the context, 2048 (" in message
    )


def test_a_gpu_that_holds_the_row_passes(tiny_model_dir):
    gpu = [f"actor.path={tiny_model_dir}", "cluster.gpu_memory_gib=6.001", "sglang.mem_fraction_static=0.5"]
    load_config(overrides=[*gpu, "dataset.max_prompt_len=64", "ppo.gen.max_new_tokens=900"])  # 964 <= 976
    load_config(overrides=[f"actor.path={tiny_model_dir}", "cluster.gpu_memory_gib=80", *ROW])  # an H100


def test_unknown_gpu_memory_skips_the_pool_check(tiny_model_dir):
    cfg = load_config(overrides=[f"actor.path={tiny_model_dir}", "sglang.mem_fraction_static=0.5", *ROW])
    assert cfg.cluster.gpu_memory_gib is None


def test_gpu_memory_is_refused_where_no_built_in_server_generates(tiny_model_dir):
    message = refusal([f"actor.path={tiny_model_dir}", "allocation_mode=sglang.d4p1m1+d4p1m1",
                       "cluster.gpu_memory_gib=3", *ROW])  # fmt: skip
    assert "cluster.gpu_memory_gib" in message and "generation backend builtin" in message


def test_the_pool_arithmetic_is_the_built_in_servers(tiny_model_dir):
    """config/kv_pool.py repeats builtin/cache.py's arithmetic (the config stage may not import it): equal."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    hf = config.to_dict()
    assert (kv_pool.PAGE, kv_pool.RESERVED_BYTES) == (cache.PAGE, cache.RESERVED_BYTES)
    assert kv_pool.kv_bytes_per_token(hf) == Shape.of(config).kv_bytes_per_token * torch.bfloat16.itemsize
    weights = Decoder(config, torch.device("cpu"), torch.bfloat16).nbytes
    assert kv_pool.parameter_count(tiny_model_dir) * kv_pool.ITEMSIZE == weights
    for budget in (5 << 20, 1 << 20, 4096 * 3 + 17):
        plan = cache.plan(Shape.of(config), torch.bfloat16, budget, 2048)
        assert kv_pool.pool_tokens(budget, kv_pool.kv_bytes_per_token(hf)) == plan.tokens
