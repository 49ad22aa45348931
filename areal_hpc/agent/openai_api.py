"""OpenAI's chat and completions API as the episode endpoint speaks it: requests checked field by field (an error
names the field and comes back in OpenAI's shape, with the status code the SDK maps to its exceptions), messages
brought to one form (so that a reply the agent sends back equals the reply it was given), and responses or
stream chunks built from a model turn.

Like OpenAI's API, a field it does not know or a value it cannot honour is refused, never ignored: a request
that asks for logprobs or n > 1 gets 400 and says so. A forced tool call (tool_choice required or a named
function) is served by opening the call for the model (gen.episode's chat).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from areal_hpc.agent import bounds

ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields a response carries and a client may echo back in an assistant message: dropped when empty.
ECHOED = ("refusal", "annotations", "audio", "function_call", "reasoning_content")
COMMON = {
    "model",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "n",
    "seed",
    "user",
}
CHAT_FIELDS = COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                        "metadata", "store", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
                        "response_format"}  # fmt: skip
COMPLETION_FIELDS = COMMON | {
    "prompt",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "echo",
    "best_of",
}
# Fields accepted at one value only, the one that changes nothing here.
NEUTRAL = {"n": 1, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False,
           "top_logprobs": 0, "echo": False}  # fmt: skip


class ApiError(Exception):
    """An error as OpenAI's API returns it: ``status`` 400 (BadRequestError), 401, 404, 409, 503, ..."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        kind = "authentication_error" if self.status == 401 else kind
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, "invalid_value")


@dataclass
class Request:
    """What a chat or completions request asks of a model turn."""

    sampling: dict  # overrides of the run's sampling: temperature, top_p, max_new_tokens, sampling_seed
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] = field(default_factory=list)  # chat
    tools: list[dict] | None = None  # chat
    parse_tools: bool = True  # chat: tool_choice none leaves the model's text as it is
    parallel_tool_calls: bool = True  # chat: false returns a turn's first tool call only
    force_call: bool = False  # chat: tool_choice required, or a named function (call_name)
    call_name: str | None = None
    json_schema: str | None = None  # chat: response_format's schema, for the server's constrained decoding
    prompt: str | list[int] | None = None  # completions


def parse_chat(body: Any, model: str) -> Request:
    fields = check_fields(body, CHAT_FIELDS, model)
    request = _common(fields)
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    request.messages = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    if (tools := fields.get("tools")) is not None:
        if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
            raise bad("tools", 'must be a list of {"type": "function", "function": {"name": ..., ...}}')
        request.tools = tools or None
    _tool_choice(request, fields.get("tool_choice"))
    request.json_schema = _response_format(fields.get("response_format"))
    request.parallel_tool_calls = fields.get("parallel_tool_calls", True)
    if not isinstance(request.parallel_tool_calls, bool):
        raise bad("parallel_tool_calls", "must be true or false")
    if (limit := fields.get("max_completion_tokens")) is not None:
        request.sampling["max_new_tokens"] = _count("max_completion_tokens", limit)
    return request


def _tool_choice(request: Request, choice: Any) -> None:
    """auto (the default), none, required, or {"type": "function", "function": {"name": one of the tools}}."""
    names = [t["function"]["name"] for t in request.tools or []]
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or name not in names:
            raise bad("tool_choice", f'a named choice is {{"type": "function", "function": {{"name": one of the '
                      f"request's tools {names}}}}}, got {json.dumps(choice)[:200]}")  # fmt: skip
        request.force_call, request.call_name = True, name
    elif choice == "required":
        if not names:
            raise bad("tool_choice", "'required' needs tools to call")
        request.force_call = True
    elif choice not in (None, "auto", "none"):
        raise bad("tool_choice", "must be 'auto', 'none', 'required' or a named function")
    request.parse_tools = choice != "none"


def _response_format(value: Any) -> str | None:
    """The JSON schema a response_format asks the answer to follow, as text (SGLang's sampling parameter
    json_schema; json_object is SGLang's '{"type": "object"}'); None for text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    schema = (
        value.get("json_schema", {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
    )
    if kind != "json_schema" or not isinstance(schema, dict):
        raise bad("response_format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": '
                  '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')  # fmt: skip
    return json.dumps(schema)


def parse_completion(body: Any, model: str) -> Request:
    fields = check_fields(body, COMPLETION_FIELDS, model)
    request = _common(fields)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    is_ids = isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise bad("prompt", "must be one non-empty string or one list of token ids")
    request.prompt = prompt
    return request


def check_fields(body: Any, known: set[str], model: str, neutral: dict = NEUTRAL) -> dict:
    """The body's set fields (null is unset), once each is ``known``, the model is the one served and each
    field of ``neutral`` has the one value accepted."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    fields = {k: v for k, v in body.items() if v is not None}  # null means unset, as in OpenAI's API
    if unknown := sorted(set(fields) - known):
        raise ApiError(
            400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter"
        )
    if "model" not in fields:
        raise bad("model", "is required")
    if fields["model"] != model:
        raise ApiError(404, f"The model '{fields['model']}' does not exist; this endpoint serves '{model}'",
                       "model", "model_not_found")  # fmt: skip
    for name, value in neutral.items():
        if name in fields and fields[name] != value:
            raise bad(name, f"not served here; only {json.dumps(value)} is accepted")
    return fields


def _common(fields: dict) -> Request:
    sampling = {}
    if "temperature" in fields:
        sampling["temperature"] = _number("temperature", fields["temperature"], 0.0, 2.0)
    if "top_p" in fields:
        sampling["top_p"] = _number("top_p", fields["top_p"], 1e-9, 1.0)
    if "max_tokens" in fields:
        sampling["max_new_tokens"] = _count("max_tokens", fields["max_tokens"])
    if "seed" in fields:
        if type(fields["seed"]) is not int:
            raise bad("seed", "must be an integer")
        sampling["sampling_seed"] = fields["seed"] % 2**31
    stop = fields.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a string or a list of up to 4 non-empty strings")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = fields.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", 'only {"include_usage": bool} is served')
    return Request(sampling, stop, stream, bool(options.get("include_usage")))


def _number(name: str, value: Any, low: float, high: float) -> float:
    if type(value) not in (int, float) or not low <= value <= high:
        raise bad(name, f"must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise bad(name, f"must be an integer >= 1, got {value!r}")
    return value


def _is_function(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


# --- messages -----------------------------------------------------------------------------------------------


def normalize_message(message: Any, where: str) -> dict:
    """A message in the one form the chat template renders and conversations are compared in: role, content (a
    string), and, where present, name, tool_calls (arguments parsed from JSON) and tool_call_id."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad(where, f"must be an object with a role in {', '.join(ROLES)}")
    known = {"role", "content", "name", "tool_calls", "tool_call_id", *ECHOED}
    if unknown := sorted(k for k in set(message) - known if message[k] is not None):
        raise bad(f"{where}.{unknown[0]}", "unknown message field")
    if echoed := [k for k in ECHOED if message.get(k)]:
        raise bad(f"{where}.{echoed[0]}", "not served here (send it empty or leave it out)")
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise bad(f"{where}.name", "must be a string")
        out["name"] = message["name"]
    if calls := message.get("tool_calls"):
        if role != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", "only an assistant message has tool_calls, a list")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise bad(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad(where, "must be a string or a list of text parts (images and audio are not served)")


def _call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(
            where, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the text it is: the template renders it so
            arguments = bounds.loads(arguments) if arguments.strip() else {}
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


# --- responses ----------------------------------------------------------------------------------------------


def finish_reason(reply: dict | None, finish: str) -> str:
    if finish == "length":
        return "length"
    return "tool_calls" if reply and reply.get("tool_calls") else "stop"


def wire_message(reply: dict) -> dict:
    """An assistant reply as OpenAI sends it: arguments as JSON text, content null when there are only calls."""
    message = {"role": "assistant", "content": reply["content"]}
    if calls := reply.get("tool_calls"):
        message["content"] = reply["content"] or None
        message["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in calls
        ]
    return message


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_response(reply: dict, finish: str, use: dict, model: str, rid: str, created: int) -> dict:
    choice = {"index": 0, "message": wire_message(reply), "finish_reason": finish_reason(reply, finish),
              "logprobs": None}  # fmt: skip
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": use}  # fmt: skip


def chat_chunks(reply: dict, finish: str, use: dict | None, model: str, rid: str, created: int) -> list[dict]:
    """The stream of one reply: the role, the content, the calls, the finish reason, then the usage if asked."""
    message = wire_message(reply)
    deltas: list[dict] = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    if calls := message.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
    chunks = [_chunk(rid, created, model, delta, None) for delta in deltas]
    chunks.append(_chunk(rid, created, model, {}, finish_reason(reply, finish)))
    if use is not None:
        chunks.append({**_chunk(rid, created, model, {}, None), "choices": [], "usage": use})
    return chunks


def _chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}  # fmt: skip


def completion_response(text: str, finish: str, use: dict, model: str, rid: str, created: int) -> dict:
    return {**_completion(text, finish, model, rid, created), "usage": use}


def completion_chunks(
    text: str, finish: str, use: dict | None, model: str, rid: str, created: int
) -> list[dict]:
    """The stream of one completion: its text, the finish reason, then the usage if asked."""
    chunks = [_completion(text, None, model, rid, created), _completion("", finish, model, rid, created)]
    if use is not None:
        chunks.append({**_completion("", None, model, rid, created), "choices": [], "usage": use})
    return chunks


def _completion(text: str, finish: str | None, model: str, rid: str, created: int) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def models(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "areal-hpc"}
