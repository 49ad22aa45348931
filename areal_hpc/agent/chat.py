"""Incremental chat rendering: the tokens of new messages, appended to the ids the model already sampled.

Re-rendering a conversation from its text does not give back the ids that were sampled (a sampled split such as
"th" + "e" re-encodes as "the"; templates drop `<think>` blocks of earlier turns; whitespace moves), and PPO on
ids the policy never sampled trains the wrong thing (verl's and SkyRL's write-ups). So a conversation's ids are
only ever appended to: its first messages are rendered once, each model turn adds the sampled ids, and messages
after a turn (tool results, a user's reply) add the tokens the template puts between them.

Those tokens come from the template itself: a fixed conversation that ends with an assistant turn is rendered
with and without the new messages, and the text after that turn's end-of-turn marker is what the template writes
between the model's turn and the next generation prompt. The marker is found in each rendering on its own (after
a sentinel content), since some templates (Qwen3's) render the last assistant turn differently from earlier ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SENTINEL = "ArealHpcSentinelTurn"
SENTINEL_NAME, SENTINEL_ARGUMENT = "areal_hpc_sentinel_tool", "areal_hpc_sentinel_argument"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered incrementally (the message says why)."""


class ChatRenderer:
    """Token ids of chat messages under ``tokenizer``'s chat template, tools (OpenAI function schemas) included."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatTemplateError("the tokenizer has no chat template; multi-turn workflows render with it")
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        base = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL}]
        tail = self._after_sentinel(self.text(base, generation_prompt=False))
        first = self.encode(tail)
        if not first:
            raise ChatTemplateError(
                "the chat template writes nothing after an assistant turn; it has no end marker"
            )
        self.end_of_turn = first[0]  # the token that ends a model turn (Qwen: <|im_end|>)
        self._end_text = tokenizer.decode([self.end_of_turn])
        special = {*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {})}
        if self.end_of_turn not in special:
            raise ChatTemplateError(
                f"the chat template ends an assistant turn with {tail!r}, whose first token {self._end_text!r} is "
                "not a special token: the end of a turn must be one token that the model samples"
            )
        self._base = base

    def text(self, messages: Sequence[dict], generation_prompt: bool = True) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens as text; the tokenizer must not add more (a second BOS).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first(self, messages: Sequence[dict]) -> list[int]:
        """The ids of a conversation's first messages and the generation prompt: the only full rendering."""
        return self.encode(self.text(messages))

    def after_turn(self, messages: Sequence[dict], sampled: Sequence[int]) -> list[int]:
        """The ids to append after a model turn whose sampled ids are ``sampled``: its end marker when the model
        did not write it (stopped by another stop token or the budget), then ``messages`` and the generation
        prompt, as the template writes them."""
        rendered = self.text([*self._base, *messages])
        after = self._after_sentinel(rendered)
        if not after.startswith(self._end_text):
            raise ChatTemplateError(
                f"the chat template does not end an assistant turn with {self._end_text!r}"
            )
        ended = bool(sampled) and sampled[-1] == self.end_of_turn
        return ([] if ended else [self.end_of_turn]) + self.encode(after[len(self._end_text) :])

    def assistant_turn(self, message: dict) -> list[int]:
        """The ids the model writes for an assistant ``message`` (tool calls included), up to and including its end
        marker: what a supervised warm-up trains on."""
        user = [{"role": "user", "content": "Hi"}]
        prompt, whole = self.text(user), self.text([*user, message], generation_prompt=False)
        end = whole.rfind(self._end_text)
        if not whole.startswith(prompt) or end < len(prompt):
            raise ChatTemplateError(
                "the chat template does not render an assistant turn after its generation prompt"
            )
        return self.encode(whole[len(prompt) : end + len(self._end_text)])

    def call_opening(self, name: str | None = None) -> str:
        """The text an assistant turn that calls a tool begins with, as the template writes it: up to the
        function's name (``name`` None), or with ``name`` written, up to its arguments. Appended to a prompt,
        it makes the model's turn a tool call (tool_choice required, or a named function)."""
        user = [{"role": "user", "content": "Hi"}]
        function = {"name": SENTINEL_NAME, "arguments": {SENTINEL_ARGUMENT: 0}}
        call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_0",
                                                                     "function": function}]}  # fmt: skip
        prompt, whole = self.text(user), self.text([*user, call], generation_prompt=False)
        body = whole[len(prompt) :] if whole.startswith(prompt) else ""
        at_name, at_arguments = body.find(SENTINEL_NAME), body.find(SENTINEL_ARGUMENT)
        if not 0 <= at_name < at_arguments:
            raise ChatTemplateError(
                "the chat template does not render a tool call's name before its arguments"
            )
        if name is None:
            return body[:at_name]
        return body[: body.rfind("{", 0, at_arguments)].replace(SENTINEL_NAME, name)

    def transcript(self, prompt: Sequence[dict], messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """The ids of a worked conversation, built as an episode builds them (``prompt`` rendered once, each
        assistant turn appended, the messages between turns appended after it), and which ids are the
        assistant's."""
        if not messages or messages[0]["role"] != "assistant":
            raise ChatTemplateError("a worked conversation starts with the assistant's turn after the prompt")
        ids, mine = self.first(prompt), []
        mine = [False] * len(ids)
        turn: list[int] = []
        between: list[dict] = []
        for message in messages:
            if message["role"] != "assistant":
                between.append(message)
                continue
            context = self.after_turn(between, turn) if turn else []
            turn = self.assistant_turn(message)
            ids += context + turn
            mine += [False] * len(context) + [True] * len(turn)
            between = []
        return ids, mine

    def _after_sentinel(self, rendered: str) -> str:
        at = rendered.rfind(SENTINEL)
        if at < 0:
            raise ChatTemplateError("the chat template drops the content of an assistant message")
        return rendered[at + len(SENTINEL) :]


def drifts(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether these sampled ids would come back different if their text were encoded again (re-rendering
    would then train on ids the model never sampled)."""
    return list(tokenizer.encode(tokenizer.decode(list(ids)), add_special_tokens=False)) != list(ids)
