"""The tiny model builder and the toy data generator (tools/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

import tools.build_tiny_model as builder
from tools.build_tiny_model import MANIFEST, TinyBuildError, build, is_complete
from tools.make_toy_data import main as make_toy_data_main
from tools.make_toy_data import make_toy_splits

# --- tokenizer ---------------------------------------------------------------------------------------------


def test_digits_are_split_one_by_one(tiny_tokenizer):
    assert tiny_tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]
    ids = tiny_tokenizer("\\boxed{95}", add_special_tokens=False)["input_ids"]
    assert [tiny_tokenizer.decode([i]) for i in ids][-3:] == ["9", "5", "}"]


def test_special_tokens(tiny_tokenizer):
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    ids = tiny_tokenizer("<|im_start|>user<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tiny_tokenizer.eos_token_id
    assert 900 <= len(tiny_tokenizer) <= 2048


def test_chat_template(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"


def test_decode_round_trips_text(tiny_tokenizer):
    text = "Let's think: $\\frac{1}{2} + 0.5 = 1$, so the answer is \\boxed{1}.\n\nÜnïcode ok"
    assert tiny_tokenizer.decode(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_auto_tokenizer_matches_tokenizer_json(tiny_tokenizer, tiny_model_dir):
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "What is 37 + 58?\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert tiny_tokenizer(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids


# --- model ---------------------------------------------------------------------------------------------------


def test_model_loads_and_generates(tiny_model_dir, tiny_tokenizer):
    model, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = model.config
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.vocab_size == len(tiny_tokenizer)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert config.num_key_value_heads == 2 and config.max_position_embeddings == 2048
    assert config.eos_token_id == tiny_tokenizer.eos_token_id

    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tiny_tokenizer))
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, : ids.shape[1]], ids[0])


# --- builder -------------------------------------------------------------------------------------------------


def _weights(build_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(build_dir / "model" / "model.safetensors")


def test_same_seed_gives_identical_build_and_other_seed_differs(tmp_path):
    a, b, c = build(tmp_path / "a", seed=7), build(tmp_path / "b", seed=7), build(tmp_path / "c", seed=8)
    assert (a.model_dir / "tokenizer.json").read_bytes() == (b.model_dir / "tokenizer.json").read_bytes()
    assert a.train_path.read_bytes() == b.train_path.read_bytes()
    wa, wb, wc = _weights(a.root), _weights(b.root), _weights(c.root)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert a.train_path.read_bytes() != c.train_path.read_bytes()


def test_build_is_skipped_when_complete(tmp_path, monkeypatch):
    done = build(tmp_path / "tiny", seed=3)
    assert is_complete(done.root, seed=3) and not is_complete(done.root, seed=4)

    def must_not_build(*args):
        raise AssertionError("rebuilt a complete build")

    monkeypatch.setattr(builder, "_build_into", must_not_build)
    assert build(tmp_path / "tiny", seed=3) == done


def test_outdated_or_damaged_build_is_replaced(tmp_path):
    out = tmp_path / "tiny"
    build(out, seed=3)
    build(out, seed=4)
    assert json.loads((out / MANIFEST).read_text())["seed"] == 4

    (out / "data" / "test.jsonl").write_text("damaged\n")
    assert not is_complete(out, seed=4)
    build(out, seed=4)
    assert is_complete(out, seed=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temporary directories left


def test_build_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(TinyBuildError, match="holds no MANIFEST.json"):
        build(tmp_path / "mine", seed=1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_crash_leaves_nothing_half_built(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(builder, "save_tiny_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build(tmp_path / "tiny", seed=1)
    assert list(tmp_path.iterdir()) == []


# --- toy data ------------------------------------------------------------------------------------------------


def test_toy_records_are_in_dataset_format_with_correct_answers():
    train, test = make_toy_splits(n_train=300, n_test=50, seed=5)
    assert (len(train), len(test)) == (300, 50)
    for record in train + test:
        assert set(record) == {"query_id", "prompt", "task", "solutions", "tier"}
        expression = re.fullmatch(r"What is ([-+* 0-9]+)\?", record["prompt"]).group(1)
        assert record["task"] == "math"
        assert record["solutions"] == [f"\\boxed{{{eval(expression)}}}"]  # Python's precedence is the oracle


def test_toy_splits_are_disjoint_and_unique():
    train, test = make_toy_splits(n_train=500, n_test=100, seed=5)
    ids = [r["query_id"] for r in train + test]
    assert len(set(ids)) == len(ids)
    train_prompts, test_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_prompts) == len(train) and not train_prompts & test_prompts


def test_toy_data_has_an_easy_tier_in_both_splits():
    train, test = make_toy_splits(n_train=900, n_test=100, seed=5)
    shares = []
    for split in (train, test):
        easy = [r for r in split if r["tier"] == "easy"]
        assert all(re.fullmatch(r"What is \d [-+*] \d\?", r["prompt"]) for r in easy)
        shares.append(len(easy) / len(split))
    assert min(shares) >= 0.2 and abs(shares[0] - shares[1]) < 0.12


def test_toy_data_is_a_function_of_the_seed():
    assert make_toy_splits(50, 10, seed=1) == make_toy_splits(50, 10, seed=1)
    assert make_toy_splits(50, 10, seed=1) != make_toy_splits(50, 10, seed=2)


def test_toy_data_rejects_impossible_requests():
    with pytest.raises(ValueError, match="distinct toy questions"):
        make_toy_splits(n_train=10**7, n_test=0, seed=1)
    with pytest.raises(ValueError, match="n_train=-1"):
        make_toy_splits(n_train=-1, n_test=0, seed=1)


def test_toy_data_cli_writes_both_splits(tmp_path, capsys):
    make_toy_data_main(["--out", str(tmp_path), "--n-train", "20", "--n-test", "5", "--seed", "3"])
    lines = {name: (tmp_path / f"{name}.jsonl").read_text().splitlines() for name in ("train", "test")}
    assert (len(lines["train"]), len(lines["test"])) == (20, 5)
    assert json.loads(lines["test"][0])["query_id"] == "toy-test-00000"
    assert "train.jsonl" in capsys.readouterr().out


def test_easy_splits_hold_every_single_digit_question_once():
    from tools.make_toy_data import make_easy_splits

    train, test = make_easy_splits(n_test=50, seed=1)
    prompts = [r["prompt"] for r in train + test]
    assert (len(train), len(test), len(set(prompts))) == (250, 50, 300)
    assert make_easy_splits(n_test=50, seed=1) == (train, test)
    for record in train[:20]:
        expression = record["prompt"].removeprefix("What is ").removesuffix("?")
        assert record["solutions"] == [f"\\boxed{{{eval(expression)}}}"]
