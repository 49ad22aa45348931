"""Routing replay, the rollout side (issue 33): each token's routed experts, from the server's answer to the batch
file. A real built-in server on the tiny MoE (it records routing as SGLang does) answers the rollouts and the
episodes here, and transformers' router on the final sequence is the reference; SGLang's side of the contract
is tests/test_sglang_contract.py's."""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.config import ConfigError, MicroBatchSpec, allocation_of, load_config
from areal_hpc.control import RunContext, RunDir
from areal_hpc.data import PromptSample, RolloutStore, gather, read_batch, select, write_batch
from areal_hpc.data.batch import TOKEN_ROWS, BatchError
from areal_hpc.gen.backends import ServerSpec, start_server
from areal_hpc.gen.client import ROUTED_EXPERTS, GenClient, GenServerError
from areal_hpc.gen.episode import Services
from areal_hpc.gen.episodes import run_group
from areal_hpc.gen.journal import Journals
from areal_hpc.gen.partial import extend, from_response, generate_group
from areal_hpc.gen.rollout import generate_groups, group_params, pack_episodes, pack_groups
from areal_hpc.gen.routing import BATCH_KEY, Shape, decode, fit, model_shape, packed
from areal_hpc.gen.server_role import server_spec
from areal_hpc.train.microbatch import empty_micro_batch, micro_batches, minibatches
from tests.helpers import REPO_ROOT as REPO

PROMPT = [4, 8, 15, 16, 23, 42]
TOKEN = "routing-test-token"


# --- the answer's routing --------------------------------------------------------------------------------------


def sglang_answer(prompt_len: int, output_ids: list[int], routing: np.ndarray | None) -> dict:
    """A /generate answer as SGLang builds it: routed_experts is base64 of the int32 array's bytes."""
    meta = {"finish_reason": {"type": "length", "length": len(output_ids)}, "weight_version": "0"}
    meta["output_token_logprobs"] = [[-0.5, t, None] for t in output_ids]
    if routing is not None:
        meta["routed_experts"] = base64.b64encode(routing.astype(np.int32).tobytes()).decode()
    return {"output_ids": output_ids, "meta_info": meta}


def test_an_answer_s_routing_decodes_to_a_row_per_forwarded_token_of_the_model_s_layers_and_top_k():
    shape = Shape(layers=3, top_k=2, experts=64)
    routing = np.arange(5 * 3 * 2).reshape(5, 3, 2) % 64  # prompt of 4 + 2 outputs - 1 = 5 tokens forwarded
    got = decode(sglang_answer(4, [7, 8], routing), 4, shape, "gen_server0")
    assert got.dtype == np.uint8 and got.shape == (5, 3, 2) and np.array_equal(got, routing)
    many = Shape(layers=3, top_k=2, experts=300)  # more than a byte holds: int16
    wide = decode(sglang_answer(4, [7, 8], routing + 260), 4, many, "gen_server0")
    assert wide.dtype == np.int16 and np.array_equal(wide, routing + 260)


def test_an_answer_without_routing_fails_naming_the_server_and_the_flag_unless_it_has_no_tokens():
    shape = Shape(layers=3, top_k=2, experts=64)
    with pytest.raises(GenServerError, match=r"gen_server3.*--enable-return-routed-experts"):
        decode(sglang_answer(4, [7, 8], None), 4, shape, "gen_server3")
    assert decode(sglang_answer(4, [], None), 4, shape, "gen_server3") is None  # aborted while queued
    with pytest.raises(GenServerError, match="not 5 tokens x 3 layers x top 2"):
        decode(sglang_answer(4, [7, 8], np.zeros((4, 3, 2))), 4, shape, "gen_server3")
    with pytest.raises(GenServerError, match="outside the model's 64 experts"):
        decode(sglang_answer(4, [7, 8], np.full((5, 3, 2), 64)), 4, shape, "gen_server3")


def test_the_routing_s_shape_is_the_model_s_and_a_dense_model_has_none(tiny_moe_dir, tiny_model_dir):
    assert model_shape(str(tiny_moe_dir)) == Shape(layers=2, top_k=2, experts=8)
    with pytest.raises(ValueError, match="dense model"):
        model_shape(str(tiny_model_dir))


def test_a_sequence_gets_a_row_per_token_with_zeros_where_nothing_was_forwarded():
    routing = np.ones((5, 2, 2), dtype=np.uint8)
    padded = fit(routing, 7)  # its last output token, and context added after it, went through no forward
    assert padded.shape == (7, 2, 2) and padded[:5].all() and not padded[5:].any()
    assert fit(routing, 3).shape == (3, 2, 2)  # a turn cut at a stop string keeps the rows of its ids
    assert packed([None, None], [3, 4]) is None
    assert packed([routing, routing], [6, 6]).shape == (12, 2, 2)
    with pytest.raises(ValueError, match="1 of 2 sequences have no routing"):
        packed([routing, None], [6, 6])


def test_a_continued_answer_keeps_the_routing_of_its_last_request():
    first = replace(
        from_response(sglang_answer(4, [7], None), routing=np.full((4, 1, 1), 1, np.uint8)), finish="abort"
    )
    # The continuation's prompt is the prompt and the token so far: its routing covers both.
    second = from_response(sglang_answer(5, [8, 9], None), routing=np.full((6, 1, 1), 2, np.uint8))
    answer = extend(first, second)
    assert answer.output_ids == (7, 8, 9) and (answer.routing == 2).all() and len(answer.routing) == 6
    queued = from_response(sglang_answer(8, [], None))  # aborted while queued: no tokens, no forward
    assert extend(answer, queued).routing is answer.routing


# --- the batch file ---------------------------------------------------------------------------------------------


def routed_batch(dtype, lengths=(5, 3, 7, 4)) -> dict:
    """A packed batch whose routing rows are a function of their token's id, so that a row found beside
    another token gives itself away."""
    ids = np.arange(sum(lengths), dtype=np.int64) * 7 % 251
    experts = 300 if dtype == np.int16 else 256
    routing = (ids[:, None, None] + np.arange(3)[:, None] * 10 + np.arange(2)) % experts
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "packed_input_ids": ids,
        "prompt_mask": ids % 2 == 0,
        "rewards": np.arange(len(lengths), dtype=np.float32),
        BATCH_KEY: routing.astype(dtype),
    }


def assert_rows_with_their_tokens(batch: dict, dtype) -> None:
    expected = routed_batch(dtype)
    rows = {int(t): r for t, r in zip(expected["packed_input_ids"], expected[BATCH_KEY], strict=True)}
    assert batch[BATCH_KEY].dtype == dtype and batch[BATCH_KEY].shape[1:] == (3, 2)
    assert len(batch[BATCH_KEY]) == len(batch["packed_input_ids"]) == batch["cu_seqlens"][-1]
    for token, row in zip(batch["packed_input_ids"], batch[BATCH_KEY], strict=True):
        assert np.array_equal(row, rows[int(token)])


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_routing_rows_travel_with_their_tokens_through_files_splits_and_micro_batches(tmp_path, dtype):
    assert BATCH_KEY in TOKEN_ROWS  # the data layer's name of the key is the rollout's
    batch = routed_batch(dtype)
    write_batch(tmp_path / "a.h5", batch)
    back = read_batch(tmp_path / "a.h5")
    assert_rows_with_their_tokens(back, dtype)
    assert_rows_with_their_tokens(select(back, [2, 0]), dtype)
    for mb in micro_batches(back, MicroBatchSpec(n_mbs=3, max_tokens_per_mb=8)):
        assert_rows_with_their_tokens(mb, dtype)
    for part in minibatches(back, 2):
        assert_rows_with_their_tokens(part, dtype)
    # Two files gathered by reference as the master splits a step over data-parallel ranks.
    write_batch(tmp_path / "b.h5", select(batch, [3, 1]))
    for refs in ([("a.h5", 1), ("b.h5", 0)], [("b.h5", 1), ("a.h5", 2), ("a.h5", 0)]):
        rank = gather({k: [(str(tmp_path / f), i) for f, i in refs] for k in ("packed_input_ids", BATCH_KEY)})
        assert_rows_with_their_tokens(rank, dtype)
    empty = empty_micro_batch(back)  # a rank without samples runs one token, routed experts included
    assert empty[BATCH_KEY].shape == (1, 3, 2) and empty[BATCH_KEY].dtype == dtype


def test_a_batch_refuses_routing_that_is_not_a_row_of_integers_per_token(tmp_path):
    batch = routed_batch(np.uint8)
    for bad in (batch[BATCH_KEY][:4], batch[BATCH_KEY][:, 0], batch[BATCH_KEY].astype(np.float32)):
        with pytest.raises(BatchError, match=BATCH_KEY):
            write_batch(tmp_path / "bad.h5", {**batch, BATCH_KEY: bad})


# --- rollouts on a real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()


def hf_routing(model, ids) -> np.ndarray:
    """transformers' routed experts of every token of ``ids``, [tokens, layers, top_k], zeros on dense layers."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)]), output_router_logits=True).router_logits
    config = model.config
    out = np.zeros((len(ids), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int64)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    for layer, router in zip(sparse, logits, strict=True):
        out[:, layer] = router.softmax(-1).topk(config.num_experts_per_tok, -1).indices.numpy()
    return out


def expected_rows(model, ids) -> np.ndarray:
    """What the batch holds for a sequence: the router's choice for each token but the last, which no forward
    took."""
    return fit(hf_routing(model, ids)[:-1], len(ids))


def serve(model_dir: Path, tmp_path: Path, routing: bool) -> tuple:
    token_file = tmp_path / "secret"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    spec = ServerSpec(
        str(model_dir), token_file, max_running_requests=8, enable_return_routed_experts=routing
    )
    server = start_server("builtin", spec)  # as the gen_server role starts it
    return server, GenClient(server.url, TOKEN, timeout=120, capacity=8, name="gen_server0")


@pytest.fixture(scope="module")
def moe_client(tiny_moe_dir, tmp_path_factory):
    server, client = serve(tiny_moe_dir, tmp_path_factory.mktemp("moe"), routing=True)
    yield client
    server.stop()


@pytest.fixture(scope="module")
def cfg(tiny_moe_dir, toy_train_path):
    overrides = [f"actor.path={tiny_moe_dir}", f"dataset.path={toy_train_path}"]
    cfg = load_config(
        [REPO / "configs/toy-cpu.yaml"], ["group_size=2", "ppo.gen.max_new_tokens=6", *overrides]
    )
    # No trainer backend replays the routing yet, so validation refuses rollout; the rollout side runs without it.
    return replace(cfg, actor=replace(cfg.actor, router_replay="rollout"))


def test_a_group_s_batch_holds_the_routing_the_server_computed_for_every_token(
    cfg, moe_client, hf_moe, tmp_path
):
    params = group_params(cfg, "q1", 0)
    assert params[ROUTED_EXPERTS] == {"layers": 2, "top_k": 2, "experts": 8}
    answers = generate_group(moe_client, PROMPT, params)
    arrays = pack_groups([PromptSample("q1", "p", tuple(PROMPT), "math", ())], [answers], np.zeros(2))
    path = RolloutStore(tmp_path).put(0, 1, time.time(), arrays, {"query_id": "q1", "epoch": 0})
    batch = read_batch(path)
    assert batch[BATCH_KEY].dtype == np.uint8 and batch[BATCH_KEY].shape == (
        len(batch["packed_input_ids"]),
        2,
        2,
    )
    cu = batch["cu_seqlens"]
    for i in range(len(cu) - 1):
        ids = batch["packed_input_ids"][cu[i] : cu[i + 1]]
        assert np.array_equal(batch[BATCH_KEY][cu[i] : cu[i + 1]], expected_rows(hf_moe, ids))


def test_a_synchronous_step_s_answers_carry_their_routing(cfg, moe_client, hf_moe):
    prompts = [PromptSample(f"q{i}", "p", tuple(PROMPT[i:]), "math", ()) for i in range(2)]
    groups = generate_groups([moe_client], prompts, [group_params(cfg, p.query_id, 0) for p in prompts])
    for prompt, group in zip(prompts, groups, strict=True):
        for answer, _ in group:
            ids = [*prompt.input_ids, *answer.output_ids]
            assert np.array_equal(fit(answer.routing, len(ids)), expected_rows(hf_moe, ids))


def test_an_answer_interrupted_and_continued_has_the_routing_of_its_whole_sequence(cfg, moe_client, hf_moe):
    params = {**group_params(cfg, "q1", 0), "max_new_tokens": 300, "ignore_eos": True}
    box: list = []
    before = moe_client.server_info()["stats"].get("generated_tokens", 0)  # the module's server counts on
    worker = threading.Thread(
        target=lambda: box.append(generate_group(moe_client, PROMPT, params)), daemon=True
    )
    worker.start()
    deadline = time.monotonic() + 60
    while moe_client.server_info()["stats"].get("generated_tokens", 0) < before + 20:
        assert time.monotonic() < deadline, "the server generates nothing"
        time.sleep(0.005)
    moe_client.pause_generation("abort")  # as a weight update does: the answers end with what they have
    moe_client.continue_generation()
    worker.join(120)
    (answers,) = box
    assert any(a.n_parts > 1 for a in answers), "no answer was interrupted"
    for answer in answers:
        ids = [*PROMPT, *answer.output_ids]
        assert len(ids) == len(PROMPT) + 300
        assert np.array_equal(fit(answer.routing, len(ids)), expected_rows(hf_moe, ids))


def test_a_server_that_ignores_the_field_fails_the_rollout_naming_itself_and_the_flag(
    cfg, tiny_moe_dir, tmp_path
):
    server, client = serve(tiny_moe_dir, tmp_path, routing=False)  # launched without the flag
    try:
        with pytest.raises(GenServerError, match=r"gen_server0 \(http.*--enable-return-routed-experts"):
            generate_group(client, PROMPT, group_params(cfg, "q1", 0))
    finally:
        server.stop()


# --- episodes ----------------------------------------------------------------------------------------------------

TOOL_ANSWER = [17, 18, 19]  # context appended after the first turn


async def two_turns(ctx, record):
    """Ask, append a tool's answer, ask again: the second request's prompt is the whole conversation."""
    first = await ctx.generate(record.input_ids)
    await ctx.generate([*record.input_ids, *first.ids, *TOOL_ANSWER])
    return 1.0


@pytest.mark.parametrize("export", ["concat", "per_turn"])
def test_an_episode_s_samples_hold_their_last_request_s_routing_and_a_replay_packs_the_same(
    cfg, moe_client, hf_moe, tiny_tokenizer, tmp_path, export
):
    journals = Journals(tmp_path / "episodes")
    overrides = ["rollout.workflow=tool_loop", f"rollout.export={export}"]
    rollout = load_config([REPO / "configs/toy-cpu.yaml"], overrides).rollout
    services = Services(tiny_tokenizer, rollout, lambda *a: 1.0, journals=journals)
    record = PromptSample("q1", "p", tuple(PROMPT), "math", ())
    params = group_params(cfg, record.query_id, 0)
    result = run_group(services, two_turns, moe_client, record, params, 2, 120)
    arrays = pack_episodes([[s for samples in result.samples for s in samples]], cfg)
    cu = arrays["cu_seqlens"]
    assert len(cu) - 1 == (2 if export == "concat" else 4)
    for i in range(len(cu) - 1):  # each sample ends with a model turn: its request forwarded all but its last
        ids = arrays["packed_input_ids"][cu[i] : cu[i + 1]]
        assert np.array_equal(arrays[BATCH_KEY][cu[i] : cu[i + 1]], expected_rows(hf_moe, ids))
    again = run_group(services, two_turns, moe_client, record, params, 2, 120)  # after a restart: journals
    assert again.counts["replayed_turns"] == 4
    replayed = pack_episodes([[s for samples in again.samples for s in samples]], cfg)
    assert replayed.keys() == arrays.keys()
    assert all(np.array_equal(replayed[k], arrays[k]) for k in arrays)
    assert replayed[BATCH_KEY].dtype == np.uint8


# --- configuration ------------------------------------------------------------------------------------------------


def test_routing_replay_is_refused_for_a_dense_model_and_for_values_it_does_not_know(tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"'actor.router_replay' is rollout, but 'actor.path' .* dense model"
    ):
        load_config(
            [REPO / "configs/toy-cpu.yaml"], [f"actor.path={tiny_model_dir}", "actor.router_replay=rollout"]
        )
    with pytest.raises(ConfigError, match="'actor.router_replay' is 'on'; choose one of off, rollout"):
        load_config([REPO / "configs/toy-cpu.yaml"], ["actor.router_replay=on"])
    with pytest.raises(ConfigError, match="actor.backend fsdp does not replay the servers' routing yet"):
        load_config([REPO / "configs/toy-cpu.yaml"], ["actor.router_replay=rollout"])
    sft = ["experiment_type=sft", f"actor.path={tiny_model_dir}", "actor.router_replay=rollout"]
    with pytest.raises(ConfigError, match="experiment_type sft generates no rollouts"):
        load_config([REPO / "configs/toy-cpu.yaml"], sft)


def test_off_asks_the_servers_for_nothing(cfg):
    off = load_config([REPO / "configs/toy-cpu.yaml"], [f"actor.path={cfg.actor.path}"])
    assert off.actor.router_replay == "off" and ROUTED_EXPERTS not in group_params(off, "q1", 0)


def test_the_gen_server_role_starts_its_server_recording_routing_under_routing_replay(cfg, tmp_path):
    ctx = RunContext(RunDir(tmp_path), cfg, allocation_of(cfg), "gen_server", 0, 1, attempt=0, local=True)
    assert server_spec(ctx, visible=0).enable_return_routed_experts  # the built-in server's option
    off = replace(cfg, actor=replace(cfg.actor, router_replay="off"))
    assert not server_spec(replace(ctx, cfg=off), visible=0).enable_return_routed_experts
