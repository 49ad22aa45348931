"""On-policy distillation's teacher call, teacher_inf, as ref_inf is: its place in the dataflow graph, its own
layout in allocation_mode, the teacher's logprobs on a trainer rank, and the preflight's vocabulary check."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from areal_hpc.alloc import ParallelSpec, resolve_allocation
from areal_hpc.config import ConfigError, InputError, load_config, mfc_spec
from areal_hpc.data import read_batch, write_batch
from areal_hpc.launch.preflight import check_inputs
from areal_hpc.master.graph import build_graph, dependencies
from areal_hpc.train import TrainerHandlers
from tests.helpers import REPO_ROOT

TOY = REPO_ROOT / "configs" / "toy-cpu.yaml"
DISTILL = ["ppo.distill_coef=1.0", "teacher.path=.cache/tiny/model"]


def names(mfcs):
    return [m.name for m in mfcs]


def test_distillation_asks_the_teacher_before_the_actor_trains():
    graph = build_graph(load_config([TOY], DISTILL))
    order = names(graph)
    assert order.index("actor_gen") < order.index("teacher_inf") < order.index("actor_train")
    train = next(m for m in graph if m.name == "actor_train")
    assert "packed_teacher_logprobs" in train.inputs
    deps = dependencies(graph)
    assert deps["teacher_inf"] == {"actor_gen"}  # the teacher scores the sampled answers
    assert "teacher_inf" in deps["actor_train"]
    assert names(build_graph(load_config([TOY], DISTILL), trainer_only=True)) == [
        "teacher_inf", "actor_inf", "actor_train"
    ]  # fmt: skip


def test_without_distillation_there_is_no_teacher_call():
    for overrides in (
        [],
        ["ppo.distill_coef=0"],
    ):  # (a teacher.path without distillation is refused as inert)
        graph = build_graph(load_config([TOY], overrides))
        assert "teacher_inf" not in names(graph)
        assert all("packed_teacher_logprobs" not in m.inputs for m in graph)


def test_the_teacher_and_the_reference_are_two_calls_of_their_own():
    graph = build_graph(load_config([TOY], [*DISTILL, "ppo.kl_ctl=0.1"]))
    train = next(m for m in graph if m.name == "actor_train")
    assert {"ref_inf", "teacher_inf"} <= dependencies(graph)["actor_train"]
    assert {"packed_ref_logprobs", "packed_teacher_logprobs"} <= set(train.inputs)


def test_teacher_inf_takes_a_layout_of_its_own_in_allocation_mode():
    alloc = resolve_allocation("actor_train:d2p1m1,teacher_inf:d1p1m2,*:d2p1m1", n_nodes=1, n_gpus_per_node=2)
    assert alloc.train_spec("teacher_inf") == ParallelSpec(1, 2, 1)
    assert alloc.train_spec("ref_inf") == ParallelSpec(2, 1, 1)  # the '*' default
    layouts = "allocation_mode=builtin.d1p1m1+actor_train:d1p1m1,actor_inf:d1p1m1"
    with pytest.raises(ConfigError, match="no layout for MFC 'teacher_inf'; give it one"):
        load_config([TOY], [*DISTILL, layouts])
    cfg = load_config([TOY], [*DISTILL, f"{layouts},teacher_inf:d1p1m1"])
    assert mfc_spec(cfg, "teacher_inf") == ParallelSpec(1, 1, 1)


def refs(path, n_seqs: int, keys=("packed_input_ids", "prompt_mask")) -> dict[str, list[list]]:
    return {key: [[str(path), i] for i in range(n_seqs)] for key in keys}


def test_a_trainer_rank_gives_the_teachers_logprobs_of_the_sampled_answers(toy, tmp_path):
    """A teacher on the actor's own weights gives the actor's logprobs, at the generation temperature."""
    cfg = toy.config(
        "teacher", 2, "ppo.distill_coef=1.0", f"teacher.path={toy.model_dir}", "teacher.dtype=float32",
        "teacher.backend=torch", "ppo.gen.temperature=0.7",
    )  # fmt: skip
    handlers = TrainerHandlers(cfg, rank=0, world_size=1)
    mfcs = {"actor_inf": "actor", "teacher_inf": "teacher", "actor_train": "actor"}
    loaded = handlers.initialize({"total_train_steps": 2, "mfcs": mfcs})
    assert loaded == {"models": ["actor", "teacher"], "copies": []}
    teacher = handlers.engines["teacher"]
    assert not teacher.trainable and handlers.engines["actor"].trainable  # the teacher does not train

    lengths = [9, 5, 13, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.random.default_rng(0).integers(3, 1000, cu[-1])
    prompt_mask = np.concatenate([np.arange(n) < 3 for n in lengths])
    write_batch(
        tmp_path / "rollout.h5", {"cu_seqlens": cu, "packed_input_ids": ids, "prompt_mask": prompt_mask}
    )

    def call(mfc: str) -> dict[str, np.ndarray]:
        out = tmp_path / f"{mfc}.h5"
        reply = handlers.inference(
            {"mfc": mfc, "refs": refs(tmp_path / "rollout.h5", len(lengths)), "out": out}
        )
        assert reply["path"] == out
        return read_batch(out)

    taught = call("teacher_inf")
    assert set(taught) == {"cu_seqlens", "packed_teacher_logprobs"}
    logprobs = taught["packed_teacher_logprobs"]
    np.testing.assert_array_equal(taught["cu_seqlens"], cu)
    assert logprobs.shape == ids.shape and (logprobs[cu[:-1]] == 0).all()
    np.testing.assert_allclose(logprobs, call("actor_inf")["proximal_logprobs"], atol=1e-5)
    batch = {"cu_seqlens": cu, "packed_input_ids": ids, "prompt_mask": prompt_mask}
    at_one = teacher.logprobs(batch, 1.0, cfg.teacher_inf.mb_spec).numpy()
    assert np.abs(logprobs - at_one).max() > 1e-2  # the generation temperature, not 1


def tiny_copy(toy, tmp_path, vocab_size: int | None = None, swap: tuple[str, str] | None = None):
    """The tiny model's directory, its config's vocab_size changed, or two tokens' ids swapped."""
    model = tmp_path / "teacher"
    shutil.copytree(toy.model_dir, model)
    if vocab_size is not None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    if swap is not None:
        tokenizer = json.loads((model / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
        (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


def test_a_teacher_whose_vocabulary_is_smaller_than_the_actors_is_refused(toy, tmp_path):
    teacher = tiny_copy(toy, tmp_path, vocab_size=512)
    cfg = toy.config("small-vocab", 2, "ppo.distill_coef=1.0", f"teacher.path={teacher}")
    with pytest.raises(InputError) as refused:
        check_inputs(cfg)
    message = str(refused.value)
    assert (
        f"'teacher.path': {teacher} has vocab_size 512, fewer than the 1024 tokens of the actor's" in message
    )
    assert f"the teacher must share the actor's tokenizer vocabulary (actor.path {toy.model_dir})" in message


def test_a_teacher_whose_tokenizer_numbers_tokens_otherwise_is_refused(toy, tmp_path):
    teacher = tiny_copy(toy, tmp_path, swap=("a", "b"))
    cfg = toy.config("other-ids", 2, "ppo.distill_coef=1.0", f"teacher.path={teacher}")
    with pytest.raises(InputError, match=r"'teacher.path': .* has a tokenizer whose ids differ from the actor's "
                       r"for 2 tokens \(the first: "):  # fmt: skip
        check_inputs(cfg)


def test_a_teacher_with_the_actors_tokenizer_and_padded_rows_is_accepted(toy, tmp_path):
    """As Qwen2.5-7B (152064 rows) teaches Qwen2.5-1.5B (151936 rows): one tokenizer, more padding."""
    teacher = tiny_copy(toy, tmp_path, vocab_size=2048)
    check_inputs(toy.config("padded", 2, "ppo.distill_coef=1.0", f"teacher.path={teacher}"))


def test_a_teacher_directory_that_is_not_a_model_is_named(toy, tmp_path):
    cfg = toy.config("no-teacher", 2, "ppo.distill_coef=1.0", f"teacher.path={tmp_path}/none")
    with pytest.raises(InputError, match=f"'teacher.path': {tmp_path}/none is not a directory"):
        check_inputs(cfg)
