"""Prompt datasets (JSONL -> tokenized samples) and the sharded, resumable sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_hpc.data import CodeTests
from areal_hpc.data.dataset import (
    DatasetFormatError,
    SamplerStateError,
    ShardedSampler,
    load_prompt_dataset,
    read_prompt_records,
)


def write_lines(path: Path, lines: list) -> Path:
    """Write dicts as JSON lines and strings verbatim."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def math_line(query_id: str = "q", prompt: str = "What is 1 + 1?") -> dict:
    return {"query_id": query_id, "prompt": prompt, "task": "math", "solutions": ["\\boxed{2}"]}


# --- loading -------------------------------------------------------------------------------------------------


def test_load_toy_data_through_the_chat_template(toy_train_path, tiny_tokenizer):
    dataset = load_prompt_dataset(toy_train_path, tiny_tokenizer, max_prompt_len=64)
    lines = [json.loads(line) for line in toy_train_path.read_text().splitlines()]
    assert len(dataset) == len(lines) and dataset.n_dropped == 0 and dataset.path == toy_train_path

    first = dataset[0]
    assert (first.query_id, first.prompt, first.task) == (lines[0]["query_id"], lines[0]["prompt"], "math")
    assert first.solutions == tuple(lines[0]["solutions"])
    expected = f"<|im_start|>user\n{first.prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(first.input_ids) == expected


def test_load_without_the_chat_template(tmp_path, tiny_tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [math_line(prompt="What is 12 + 30?")])
    dataset = load_prompt_dataset(path, tiny_tokenizer, max_prompt_len=64, apply_chat_template=False)
    assert list(dataset[0].input_ids) == tiny_tokenizer("What is 12 + 30?")["input_ids"]


def test_long_prompts_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    lines = [math_line(f"q{n}", "What is " + " + ".join(["1"] * n) + "?") for n in (1, 30, 2, 40, 3)]
    dataset = load_prompt_dataset(
        write_lines(tmp_path / "d.jsonl", lines), tiny_tokenizer, max_prompt_len=40, apply_chat_template=False
    )
    assert [s.query_id for s in dataset.samples] == ["q1", "q2", "q3"]
    assert dataset.n_dropped == 2 and all(len(s.input_ids) <= 40 for s in dataset.samples)


def test_defaults_and_lenient_fields(tmp_path):
    lines = [
        {"query_id": 7, "prompt": "p", "solutions": ["\\boxed{1}"], "extra": "ignored"},
        "",
        {
            "query_id": "c",
            "prompt": "add",
            "task": "code",
            "input_output": {"inputs": ["1 2"], "outputs": ["3"]},
        },
    ]
    records = read_prompt_records(write_lines(tmp_path / "d.jsonl", lines))
    tests = CodeTests(("1 2",), ("3",))
    assert records == [
        ("7", "p", "math", ("\\boxed{1}",), None, None, None),
        ("c", "add", "code", (), tests, None, None),
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not a valid JSON line"),
        ("[1, 2]", "expected a JSON object"),
        ({"prompt": "p", "solutions": ["1"]}, "'query_id' must be a non-empty string, got None"),
        ({"query_id": True, "prompt": "p", "solutions": ["1"]}, "'query_id'"),
        ({"query_id": "x", "prompt": 3, "solutions": ["1"]}, "'prompt' must be a non-empty string, got 3"),
        ({"query_id": "x", "prompt": "p", "task": "physics", "solutions": ["1"]}, "got 'physics'"),
        ({"query_id": "x", "prompt": "p", "solutions": "\\boxed{1}"}, "'solutions' must be a non-empty list"),
        ({"query_id": "x", "prompt": "p", "solutions": []}, "'solutions' must be a non-empty list"),
        ({"query_id": "x", "prompt": "p", "task": "code", "solutions": [1]}, "'solutions' must be a list"),
        ({"query_id": "x", "prompt": "p", "task": "stem"}, "'solutions' must be a non-empty list"),
        ({"query_id": "x", "prompt": "p", "task": "code"}, "a code task needs 'input_output'"),
        (
            {
                "query_id": "x",
                "prompt": "p",
                "task": "code",
                "input_output": '{"inputs": ["1"], "outputs": []}',
            },
            "'input_output': needs one output per input and at least one case, got 1 and 0",
        ),
        (
            {
                "query_id": "x",
                "prompt": "p",
                "task": "code",
                "input_output": {"inputs": ["x"], "outputs": ["1"], "fn_name": "f"},
            },
            "'input_output': case 0: a function call's arguments and result must be JSON",
        ),
        ({"query_id": "q", "prompt": "p", "solutions": ["1"]}, "duplicate query_id 'q' (first at "),
        # Ids no log line should carry: too long, with a newline, a lone surrogate.
        (
            {"query_id": "x" * 513, "prompt": "p", "solutions": ["1"]},
            "'query_id' has 513 characters, at most 512",
        ),
        ({"query_id": "a\nb", "prompt": "p", "solutions": ["1"]}, "holds a character that does not print"),
        ({"query_id": "a\ud800", "prompt": "p", "solutions": ["1"]}, "holds a character that does not print"),
    ],
)
def test_malformed_line_is_reported_with_file_and_line(tmp_path, tiny_tokenizer, bad_line, message):
    path = write_lines(tmp_path / "bad.jsonl", [math_line("q"), bad_line, math_line("z")])
    with pytest.raises(DatasetFormatError) as caught:
        load_prompt_dataset(path, tiny_tokenizer, max_prompt_len=64)
    assert str(caught.value).startswith(f"{path}:2: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(("first", "second"), [("7", 7), ("\u00e9", "e\u0301")])
def test_ids_that_are_one_id_once_normalised_are_reported_with_both_lines(
    tmp_path, tiny_tokenizer, first, second
):
    path = write_lines(tmp_path / "ids.jsonl", [math_line(first), {**math_line(), "query_id": second}])
    with pytest.raises(DatasetFormatError) as caught:
        load_prompt_dataset(path, tiny_tokenizer, max_prompt_len=64)
    assert str(caught.value).startswith(
        f"{path}:2: duplicate query_id {second!r} (first at {path}:1, as {first!r}"
    )
    assert "compared as text in Unicode NFC" in str(caught.value)


def test_empty_file_and_bad_max_prompt_len_are_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(DatasetFormatError, match="no records"):
        load_prompt_dataset(write_lines(tmp_path / "e.jsonl", [""]), tiny_tokenizer, max_prompt_len=64)
    with pytest.raises(ValueError, match="max_prompt_len must be a positive integer, got 0"):
        load_prompt_dataset(
            write_lines(tmp_path / "d.jsonl", [math_line()]), tiny_tokenizer, max_prompt_len=0
        )


# --- sampler -------------------------------------------------------------------------------------------------


def take(sampler: ShardedSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    a, b = ShardedSampler(20, 0, 1, seed=3, batch_size=5), ShardedSampler(20, 0, 1, seed=3, batch_size=5)
    assert take(a, 8) == take(b, 8)
    epoch0, epoch1 = list(ShardedSampler(20, 0, 1, seed=3, batch_size=20).permutation(e) for e in (0, 1))
    assert sorted(epoch0) == list(range(20)) and list(epoch0) != list(epoch1)
    assert take(ShardedSampler(20, 0, 1, seed=4, batch_size=5), 4) != take(ShardedSampler(20, 0, 1, 3, 5), 4)


def test_shards_are_disjoint_equal_and_cover_the_data():
    world = [ShardedSampler(10, rank, 3, seed=0, batch_size=1) for rank in range(3)]
    for _ in range(3):  # epochs
        shards = [sum(list(sampler), []) for sampler in world]
        assert [len(s) for s in shards] == [3, 3, 3]
        assert len(set().union(*shards)) == 9  # disjoint; the one index left out changes per epoch


def test_ranks_together_read_what_one_rank_with_the_global_batch_reads():
    ranks = [ShardedSampler(50, rank, 4, seed=9, batch_size=3) for rank in range(4)]
    single = ShardedSampler(50, 0, 1, seed=9, batch_size=12)
    assert len(single) == len(ranks[0]) == 4
    for _ in range(10):
        assert sorted(sum((r.next_batch() for r in ranks), [])) == sorted(single.next_batch())


def test_iteration_yields_one_epoch_of_full_batches():
    sampler = ShardedSampler(11, 0, 1, seed=1, batch_size=4)
    assert [len(batch) for batch in sampler] == [4, 4]
    assert (sampler.epoch, sampler.position) == (1, 0)
    assert [len(b) for b in ShardedSampler(11, 0, 1, seed=1, batch_size=4, drop_last=False)] == [4, 4, 3]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 5, 8])  # mid-epoch, last batch of an epoch, both epochs
def test_restore_continues_exactly_where_it_stopped(stop_after):
    reference = ShardedSampler(17, 1, 2, seed=5, batch_size=2)  # 4 batches per epoch
    expected = take(reference, stop_after + 6)

    before = ShardedSampler(17, 1, 2, seed=5, batch_size=2)
    assert take(before, stop_after) == expected[:stop_after]
    state = json.loads(json.dumps(before.state_dict()))  # survives a JSON file

    after = ShardedSampler(17, 1, 2, seed=5, batch_size=2)
    after.load_state_dict(state)
    assert take(after, 6) == expected[stop_after:]


def test_restore_at_epoch_boundary_does_not_skip_an_epoch():
    sampler = ShardedSampler(8, 0, 1, seed=2, batch_size=4)
    first_epoch = list(sampler)
    restored = ShardedSampler(8, 0, 1, seed=2, batch_size=4)
    restored.load_state_dict(sampler.state_dict())
    assert restored.epoch == 1 and list(restored) == list(sampler) != first_epoch


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"world_size": 4}, "saved with world_size=4 but this sampler has world_size=2"),
        ({"n_items": 99}, "saved with n_items=99 but this sampler has n_items=17"),
        ({"batch_size": 3}, "batch_size"),
        ({"seed": 6}, "seed"),
        ({"position": 4}, "need epoch >= 0 and 0 <= position < 4"),
        ({"epoch": -1}, "epoch=-1"),
    ],
)
def test_restore_refuses_a_state_of_another_sampler(other, message):
    sampler = ShardedSampler(17, 0, 2, seed=5, batch_size=2)
    with pytest.raises(SamplerStateError, match=message):
        sampler.load_state_dict({**sampler.state_dict(), **other})
    with pytest.raises(SamplerStateError, match="lacks position"):
        sampler.load_state_dict({k: v for k, v in sampler.state_dict().items() if k != "position"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2}, r"rank must be in \[0, 2\), got 2"),
        ({"n_items": 0}, "n_items must be an integer >= 1, got 0"),
        ({"batch_size": 9}, "17 items give no batch of 9 per rank with world_size=2"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedSampler(**{"n_items": 17, "rank": 0, "world_size": 2, "seed": 0, "batch_size": 2, **kwargs})
