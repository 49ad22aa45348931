"""Tool use on the tiny model: its chat template's tool rendering, and the toy calculator data (tools/)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from tools.build_tiny_model import (
    CHAT_TEMPLATE,
    DEFAULT_PARAMS,
    MANIFEST,
    build,
    read_manifest,
    tokenizer_corpus,
)
from tools.make_toy_data import make_toy_splits
from tools.make_toy_tool_data import CALCULATOR_TOOL, OPS, main, make_tool_splits, tool_transcript

# The template before tool use; conversations without tools or tool calls must still render as it did.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# tokenizer.json and model.safetensors of seed 1 before tool use: the pinned stats depend on both.
PINNED_SHA256 = {
    "model/tokenizer.json": "acab4a2be4fec3e0a01b68736f562d31020dee6771c8dfbf6d427f4c3d7ab775",
    "model/model.safetensors": "ceb6d85506aca8bd77abb495de17e110e0b0ed5a0b1a383dd6eb23e934f588aa",
}
PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
PROMPT = re.compile(r"What is (\d+) \* (\d+)\? Use the calculator\.")
QUESTION = {"role": "user", "content": "What is 47 * 38? Use the calculator."}

PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "\\boxed{7}"},
        {"role": "user", "content": "And 5 * 6?\nThink."},
        {"role": "assistant", "content": ""},
        {"role": "system", "content": "A late system turn."},
    ],
    [{"role": "assistant", "content": "no tool calls", "tool_calls": []}, {"role": "user", "content": ""}],
]


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- chat template -------------------------------------------------------------------------------------------


def test_the_build_carries_the_tool_template(tiny_tokenizer):
    assert tiny_tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
def test_plain_conversations_render_as_before(tiny_tokenizer, messages, add_generation_prompt):
    new = _render(tiny_tokenizer, messages, add_generation_prompt=add_generation_prompt)
    old = _render(
        tiny_tokenizer, messages, add_generation_prompt=add_generation_prompt, chat_template=PLAIN_TEMPLATE
    )
    assert new == old


def test_toy_tool_transcript_renders_the_golden_string(tiny_tokenizer):
    text = _render(tiny_tokenizer, [QUESTION, *tool_transcript("47 * 38", 1786)], tools=[CALCULATOR_TOOL])
    assert text == (
        '<|im_start|>system\nTools: calculator. Call one as <tool_call>{"name": ..., "arguments": ...}'
        "</tool_call>.<|im_end|>\n"
        "<|im_start|>user\nWhat is 47 * 38? Use the calculator.<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "47 * 38"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1786\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{1786}<|im_end|>\n"
    )


def test_system_content_calls_with_text_string_arguments_and_consecutive_results(tiny_tokenizer):
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "2*3"}},
        },
        {"id": "b", "type": "function", "function": {"name": "python", "arguments": '{"code":"print(6)"}'}},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Both.", "tool_calls": calls},
        {"role": "tool", "name": "calculator", "content": "6"},
        {"role": "tool", "name": "python", "content": "6\n"},
    ]
    text = _render(tiny_tokenizer, messages, tools=[CALCULATOR_TOOL, PYTHON_TOOL], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\nTools: calculator, python. "
        'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nBoth.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {"code":"print(6)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n6\n\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_calls_of_an_empty_turn_are_separated_and_need_no_tools_header(tiny_tokenizer):
    call = tool_transcript("1 * 2", 2)[0]["tool_calls"][0]
    text = _render(tiny_tokenizer, [{"role": "assistant", "content": None, "tool_calls": [call, call]}])
    block = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 * 2"}}\n</tool_call>'
    assert text == f"<|im_start|>assistant\n{block}\n{block}<|im_end|>\n"


def test_token_counts_of_a_tool_call_and_a_toy_transcript(tiny_tokenizer):
    # The 1,024-token BPE never saw the call syntax: it spells most of it letter by letter.
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 38"}}\n</tool_call>'
    messages = [QUESTION, *tool_transcript("47 * 38", 1786)]
    prompt = _render(tiny_tokenizer, messages[:1], tools=[CALCULATOR_TOOL], add_generation_prompt=True)
    whole = _render(tiny_tokenizer, messages, tools=[CALCULATOR_TOOL])
    counts = {
        "call": _n_tokens(tiny_tokenizer, call),
        "prompt": _n_tokens(tiny_tokenizer, prompt),
        "whole": _n_tokens(tiny_tokenizer, whole),
        "whole_without_tools_header": _n_tokens(tiny_tokenizer, _render(tiny_tokenizer, messages)),
    }
    print(counts)
    assert counts == {"call": 63, "prompt": 94, "whole": 207, "whole_without_tools_header": 141}


# --- toy tool data -------------------------------------------------------------------------------------------


def test_tool_records_answer_the_product_and_carry_a_transcript_of_a_random_operation():
    train, test = make_tool_splits(n_train=500, n_test=64, seed=5)
    assert (len(train), len(test)) == (500, 64)
    ops = []
    for record in train + test:
        assert set(record) == {"query_id", "prompt", "task", "solutions", "messages"}
        a, b = map(int, PROMPT.fullmatch(record["prompt"]).groups())
        assert (a > 9 and b > 9) or (a > 99 and 2 <= b <= 9)
        assert record["task"] == "math" and record["solutions"] == [f"\\boxed{{{a * b}}}"]
        expression = record["messages"][0]["tool_calls"][0]["function"]["arguments"]["expression"]
        op = expression.split()[1]
        assert record["messages"] == tool_transcript(f"{a} {op} {b}", OPS[op](a, b))
        ops.append(op)
    # The warm-up learns the call and the copy, not the operation: a third of its conversations use *.
    assert {op: round(ops.count(op) / len(ops), 1) for op in OPS} == {"+": 0.3, "-": 0.3, "*": 0.3}


def test_tool_splits_are_disjoint_in_either_order_and_a_function_of_the_seed():
    train, test = make_tool_splits(n_train=1000, n_test=64, seed=1)
    assert make_tool_splits(n_train=1000, n_test=64, seed=1) == (train, test)
    assert make_tool_splits(n_train=1000, n_test=64, seed=2) != (train, test)

    def pairs(split):
        return {tuple(sorted(map(int, re.findall(r"\d+", r["prompt"])))) for r in split}

    assert len(pairs(train)) == len(train) and len(pairs(test)) == len(test)
    assert not pairs(train) & pairs(test)
    ids = [r["query_id"] for r in train + test]
    assert len(set(ids)) == len(ids)


def test_tool_data_rejects_impossible_requests():
    with pytest.raises(ValueError, match="distinct tool questions"):
        make_tool_splits(n_train=10**6, n_test=0, seed=1)
    with pytest.raises(ValueError, match="n_test=-1"):
        make_tool_splits(n_train=1, n_test=-1, seed=1)


def test_tool_data_cli_writes_both_splits(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n-train", "20", "--n-test", "5", "--seed", "3"])
    lines = {name: (tmp_path / f"{name}.jsonl").read_text().splitlines() for name in ("train", "test")}
    assert (len(lines["train"]), len(lines["test"])) == (20, 5)
    assert json.loads(lines["test"][0])["query_id"] == "tool-test-00000"
    assert "train.jsonl" in capsys.readouterr().out


def test_tool_data_stays_out_of_the_tokenizer_corpus():
    train, test = make_toy_splits(DEFAULT_PARAMS["n_train"], DEFAULT_PARAMS["n_test"], seed=1)  # as the build
    assert not any("calculator" in text for text in tokenizer_corpus(1, train + test))


# --- build ---------------------------------------------------------------------------------------------------


def test_build_lists_the_tool_data(tiny_build):
    files = read_manifest(tiny_build.root)["files"]
    for split, n in (("train", 1000), ("test", 64)):
        path = tiny_build.root / "data" / "tools" / f"{split}.jsonl"
        assert f"data/tools/{split}.jsonl" in files and len(path.read_text().splitlines()) == n


def test_rebuild_keeps_tokenizer_and_weights_byte_identical(tiny_build, tmp_path):
    again = build(tmp_path / "again", seed=1)
    assert read_manifest(again.root)["builder"] == read_manifest(tiny_build.root)["builder"]
    for name, sha256 in PINNED_SHA256.items():
        assert (again.root / name).read_bytes() == (tiny_build.root / name).read_bytes()
        assert hashlib.sha256((again.root / name).read_bytes()).hexdigest() == sha256
        assert json.loads((again.root / MANIFEST).read_text())["files"][name]["sha256"] == sha256
