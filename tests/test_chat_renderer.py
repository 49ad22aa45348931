"""ChatRenderer against small chat templates of our own that behave as real ones do: Qwen2.5's tool turns,
Qwen3's dropped <think> blocks, a Llama-3-like template with a BOS, and templates it must refuse."""

from __future__ import annotations

import copy
import re

import pytest

from areal_hpc.agent import ChatRenderer, ChatTemplateError, drifts


def jinja(source: str) -> str:
    """A template written on indented lines, joined without the layout (all its text is in {{ }})."""
    return "".join(line.strip() for line in source.splitlines())


# Tool results and tool calls as Qwen2.5 writes them; the tools are listed in a system turn.
TOOL_TURNS = r"""
{% if tools %}
  {{ '<|im_start|>system\nYou may call these tools:' }}
  {% for tool in tools %}{{ '\n- ' + tool.function.name + ': ' + tool.function.description }}{% endfor %}
  {{ '\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n' }}
{% endif %}
{% for m in messages %}
  {% if m.role == 'tool' %}
    {% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
    {{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {% elif m.role == 'assistant' %}
    {{ '<|im_start|>assistant\n' }}
    ASSISTANT_CONTENT
    {% for call in m.tool_calls or [] %}
      {% if answer or not loop.first %}{{ '\n' }}{% endif %}
      {{ '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
      {{ (call.function.arguments | tojson) + '}\n</tool_call>' }}
    {% endfor %}
    {{ '<|im_end|>\n' }}
  {% else %}
    {{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""

QWEN25_LIKE = jinja(TOOL_TURNS.replace("ASSISTANT_CONTENT", "{% set answer = m.content or '' %}{{ answer }}"))

# As Qwen3: the reasoning is split off the content; only the last assistant turn keeps a <think> block (an
# empty one when it has no reasoning), earlier turns are written without it.
QWEN3_LIKE = jinja(
    TOOL_TURNS.replace(
        "ASSISTANT_CONTENT",
        r"""
        {% set answer = m.content or '' %}
        {% set reasoning = '' %}
        {% if '</think>' in answer %}
          {% set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\n') %}
          {% set answer = answer.split('</think>')[-1].lstrip('\n') %}
        {% endif %}
        {% if loop.last %}{{ '<think>\n' + reasoning + '\n</think>\n\n' }}{% endif %}
        {{ answer }}
        """,
    )
)

# As Llama 3: a BOS, then headers; the end-of-turn marker is not followed by a newline.
LLAMA3_LIKE = jinja(r"""
{{ bos_token }}
{% for m in messages %}
  {{ '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
""")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
]
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
RESULTS = [{"role": "tool", "content": "18 C, sunny"}, {"role": "tool", "content": "24 C, cloudy"}]
ANSWER = "Paris: 18 C and sunny. Rome: 24 C and cloudy."
THINK_1 = "<think>\nTwo cities, so two calls.\n</think>\n\n"
THINK_2 = "<think>\nBoth answers are in.\n</think>\n\n"


def with_template(tokenizer, template: str):
    """A copy of the tiny tokenizer with another chat template (the shared one is left alone)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def spelled(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` sampled one character at a time: a split the tokenizer would never produce."""
    return [i for ch in text for i in encode(tokenizer, ch)]


def after_marker(rendered: str, turn_text: str, marker: str) -> str:
    """The text ``rendered`` holds after ``turn_text`` and the end-of-turn marker that follows it."""
    return rendered[rendered.index(turn_text + marker) + len(turn_text + marker) :]


def test_a_tool_episode_appends_the_template_tokens_between_the_sampled_turns(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, QWEN25_LIKE)
    renderer = ChatRenderer(tokenizer, [WEATHER])
    assert tokenizer.decode([renderer.end_of_turn]) == "<|im_end|>"

    ids = renderer.first([USER])
    assert tokenizer.decode(ids) == renderer.text([USER])  # the tools' system turn, the user, "assistant\n"
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou may call these tools:\n- get_weather")
    # Turn 1: the model sampled "get_weather" letter by letter; its text would encode back to other ids.
    turn_1 = encode(tokenizer, '<tool_call>\n{"name": "') + spelled(tokenizer, "get_weather")
    turn_1 += encode(tokenizer, CALL_TEXT.split("get_weather", 1)[1]) + [renderer.end_of_turn]
    assert tokenizer.decode(turn_1) == CALL_TEXT + "<|im_end|>" and drifts(tokenizer, turn_1)
    between = renderer.after_turn(RESULTS, turn_1)
    turn_2 = encode(tokenizer, ANSWER) + [renderer.end_of_turn]
    episode = ids + turn_1 + between + turn_2

    # (a) The sampled ids sit unchanged where they were sampled; only the template's tokens come between.
    assert episode[len(ids) : len(ids) + len(turn_1)] == turn_1
    assert episode[len(episode) - len(turn_2) :] == turn_2
    assert between[0] != renderer.end_of_turn  # the model wrote the marker; it is not written twice
    # (b) Those tokens are the template's text from turn 1's end marker to the next generation prompt: both
    # tool results in one user turn.
    called = {"role": "assistant", "content": "", "tool_calls": CALLS}
    rendered = renderer.text([USER, called, *RESULTS])
    assert tokenizer.decode(between) == after_marker(rendered, CALL_TEXT, "<|im_end|>")
    assert tokenizer.decode(between) == (
        "\n<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n24 C, cloudy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Re-rendering the same conversation gives the same text but not the ids the model sampled.
    assert tokenizer.decode(episode[: -len(turn_2)]) == rendered
    assert renderer.first([USER, called, *RESULTS]) != episode[: -len(turn_2)]


def test_a_thinking_episode_keeps_the_think_block_a_re_rendering_drops(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, QWEN3_LIKE)
    renderer = ChatRenderer(tokenizer, [WEATHER])
    ids = renderer.first([USER])
    turn_1 = spelled(tokenizer, THINK_1) + encode(tokenizer, CALL_TEXT) + [renderer.end_of_turn]
    between = renderer.after_turn(RESULTS, turn_1)
    turn_2 = encode(tokenizer, THINK_2 + ANSWER) + [renderer.end_of_turn]
    episode = ids + turn_1 + between + turn_2

    # (a) and (b): the sampled turns unchanged, and the template's text after turn 1's end marker between them.
    assert episode[len(ids) : len(ids) + len(turn_1)] == turn_1
    called = {"role": "assistant", "content": THINK_1, "tool_calls": CALLS}
    rendered = renderer.text([USER, called, *RESULTS])
    assert tokenizer.decode(between) == after_marker(rendered, CALL_TEXT, "<|im_end|>")
    # (c) The template writes turn 1 without its reasoning once it is no longer the last turn, so a re-rendering
    # of the conversation is not what the model saw; the episode keeps the sampled think tokens.
    assert "Two cities" not in rendered
    assert renderer.first([USER, called, *RESULTS]) != episode[: -len(turn_2)]
    assert tokenizer.decode(episode).count("<think>") == 2
    assert tokenizer.decode(episode[len(ids) :]).startswith(THINK_1 + CALL_TEXT + "<|im_end|>\n")


def test_the_last_assistant_turn_is_rendered_with_its_think_block(tiny_tokenizer):
    renderer = ChatRenderer(with_template(tiny_tokenizer, QWEN3_LIKE))
    answered = [USER, {"role": "assistant", "content": THINK_1 + "Sunny."}]
    assert renderer.text(answered, generation_prompt=False).endswith(
        "<|im_start|>assistant\n" + THINK_1 + "Sunny.<|im_end|>\n"
    )
    again = [
        *answered,
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    rendered = renderer.text(again, generation_prompt=False)
    assert "Two cities" not in rendered and rendered.endswith(
        "<think>\n\n</think>\n\nYou're welcome.<|im_end|>\n"
    )


def test_a_turn_cut_by_the_token_budget_gets_its_end_marker(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, QWEN25_LIKE)
    renderer = ChatRenderer(tokenizer, [WEATHER])
    ended = encode(tokenizer, CALL_TEXT) + [renderer.end_of_turn]
    cut = encode(tokenizer, CALL_TEXT[:30])  # max_new_tokens ran out inside the first call
    after = renderer.after_turn(RESULTS, cut)
    assert after == [renderer.end_of_turn] + renderer.after_turn(RESULTS, ended)
    assert tokenizer.decode(cut + after).startswith(CALL_TEXT[:30] + "<|im_end|>\n<|im_start|>user\n")
    assert renderer.after_turn(RESULTS, [])[0] == renderer.end_of_turn  # a turn that sampled nothing


def test_a_transcript_is_built_as_an_episode_and_masks_the_assistant_turns(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, QWEN25_LIKE)
    renderer = ChatRenderer(tokenizer, [WEATHER])
    messages = [
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        *RESULTS,
        {"role": "assistant", "content": ANSWER},
    ]
    ids, mine = renderer.transcript([USER], messages)

    # The episode the model would have run, its turns encoded from the text it writes.
    first = renderer.first([USER])
    turn_1 = encode(tokenizer, CALL_TEXT) + [renderer.end_of_turn]
    turn_2 = encode(tokenizer, ANSWER) + [renderer.end_of_turn]
    between = renderer.after_turn(RESULTS, turn_1)
    assert ids == first + turn_1 + between + turn_2
    assert mine == [False] * len(first) + [True] * len(turn_1) + [False] * len(between) + [True] * len(turn_2)
    assert turn_1 == renderer.assistant_turn(messages[0]) and turn_2 == renderer.assistant_turn(messages[-1])
    # Whole, it is the template's rendering up to the last end marker.
    assert tokenizer.decode(ids) + "\n" == renderer.text([USER, *messages], generation_prompt=False)


def test_a_thinking_transcript_keeps_every_turn_s_reasoning(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, QWEN3_LIKE)
    renderer = ChatRenderer(tokenizer, [WEATHER])
    messages = [
        {"role": "assistant", "content": THINK_1, "tool_calls": CALLS},
        *RESULTS,
        {"role": "assistant", "content": THINK_2 + ANSWER},
    ]
    ids, mine = renderer.transcript([USER], messages)
    turn_1 = encode(tokenizer, THINK_1 + CALL_TEXT) + [renderer.end_of_turn]
    turn_2 = encode(tokenizer, THINK_2 + ANSWER) + [renderer.end_of_turn]
    first = renderer.first([USER])
    between = renderer.after_turn(RESULTS, turn_1)
    assert ids == first + turn_1 + between + turn_2
    assert [i for i, m in zip(ids, mine, strict=True) if m] == turn_1 + turn_2
    # A turn written without reasoning gets the empty think block the model writes before its answer.
    plain = renderer.assistant_turn({"role": "assistant", "content": "Sunny."})
    assert tokenizer.decode(plain) == "<think>\n\n</think>\n\nSunny.<|im_end|>"


def llama3_like(tiny_tokenizer):
    """The Llama-3-like template, its markers added to a copy of the tiny tokenizer as special tokens."""
    tokenizer = with_template(tiny_tokenizer, LLAMA3_LIKE)
    markers = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_tokens(markers, special_tokens=True)
    tokenizer.bos_token = "<|begin_of_text|>"
    return tokenizer


def test_a_template_with_a_bos_is_rendered_with_one_bos_and_header_turns(tiny_tokenizer):
    tokenizer = llama3_like(tiny_tokenizer)
    renderer = ChatRenderer(tokenizer)
    assert tokenizer.decode([renderer.end_of_turn]) == "<|eot_id|>"
    ids = renderer.first([USER])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    turn_1 = spelled(tokenizer, "Which") + encode(tokenizer, " city first?") + [renderer.end_of_turn]
    reply = {"role": "user", "content": "Paris."}
    between = renderer.after_turn([reply], turn_1)
    assert between.count(tokenizer.bos_token_id) == 0
    assert tokenizer.decode(between) == (
        "<|start_header_id|>user<|end_header_id|>\n\nParis.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    asked = {"role": "assistant", "content": "Which city first?"}
    assert tokenizer.decode(ids + turn_1 + between) == renderer.text([USER, asked, reply])

    ids, mine = renderer.transcript([USER], [asked, reply, {"role": "assistant", "content": "Sunny."}])
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode([i for i, m in zip(ids, mine, strict=True) if m]) == (
        "Which city first?<|eot_id|>Sunny.<|eot_id|>"
    )


def test_an_end_marker_of_several_tokens_is_refused(tiny_tokenizer):
    # The same template on the tiny vocabulary, where "<|eot_id|>" is plain text of eight tokens.
    tokenizer = with_template(tiny_tokenizer, LLAMA3_LIKE)
    tokenizer.bos_token = "<|endoftext|>"
    assert len(encode(tokenizer, "<|eot_id|>")) > 1
    with pytest.raises(ChatTemplateError, match=re.escape("<|eot_id|>")):
        ChatRenderer(tokenizer)


def test_a_generation_prompt_that_opens_a_think_block_serves_episodes_but_not_transcripts(tiny_tokenizer):
    # As DeepSeek-R1 and QwQ: the generation prompt opens <think>; assistant turns are written without reasoning.
    template = jinja(r"""
    {% for m in messages %}
      {% if m.role == 'assistant' %}
        {{ '<|im_start|>assistant\n' + m.content.split('</think>')[-1].lstrip('\n') + '<|im_end|>\n' }}
      {% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
    {% endfor %}
    {% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}
    """)
    tokenizer = with_template(tiny_tokenizer, template)
    renderer = ChatRenderer(tokenizer)
    turn_1 = encode(tokenizer, "Easy.\n</think>\n\nSunny.") + [renderer.end_of_turn]
    between = renderer.after_turn([{"role": "user", "content": "Thanks"}], turn_1)
    assert tokenizer.decode(between).endswith("<|im_start|>assistant\n<think>\n")
    # The model's turns start inside the think block, which the rendered turn lacks: no ids to train on.
    with pytest.raises(
        ChatTemplateError, match="does not render an assistant turn after its generation prompt"
    ):
        renderer.assistant_turn({"role": "assistant", "content": "Easy.\n</think>\n\nSunny."})


def test_a_template_that_drops_assistant_content_is_refused(tiny_tokenizer):
    template = jinja(r"""
    {% for m in messages %}
      {% if m.role == 'assistant' %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}
      {% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
    {% endfor %}
    {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
    """)
    with pytest.raises(ChatTemplateError, match="drops the content of an assistant message"):
        ChatRenderer(with_template(tiny_tokenizer, template))


def test_a_template_without_an_end_marker_or_none_at_all_is_refused(tiny_tokenizer):
    unended = "{% for m in messages %}{{ m.role + ': ' + m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="writes nothing after an assistant turn"):
        ChatRenderer(with_template(tiny_tokenizer, unended))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatRenderer(with_template(tiny_tokenizer, None))


def test_drifts_tells_a_split_the_tokenizer_would_not_make(tiny_tokenizer):
    canonical = encode(tiny_tokenizer, "The weather in Paris<|im_end|>")
    assert not drifts(tiny_tokenizer, canonical)
    sampled = spelled(tiny_tokenizer, "The weather") + encode(tiny_tokenizer, " in Paris<|im_end|>")
    assert tiny_tokenizer.decode(sampled) == tiny_tokenizer.decode(canonical)
    assert drifts(tiny_tokenizer, sampled)
