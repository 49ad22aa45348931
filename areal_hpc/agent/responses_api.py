"""OpenAI's Responses API (``POST /v1/responses``) as the episode endpoint speaks it: the subset the OpenAI Agents
SDK's default model and AReaL's agents use, served as a chat turn of the same episode (agent.openai_api).

A request's ``instructions`` and ``input`` items become chat messages: a message item (text, or input_text and
output_text parts), the model's ``function_call`` items folded into the assistant message before them, and
``function_call_output`` items as tool messages. An agent that sends back the output items it was given thus
sends back the reply it was given, so the episode goes on without a break, token for token.
``previous_response_id`` names an earlier response of the same episode: its conversation comes first. Tools are
the API's flat function tools; ``tool_choice``, ``parallel_tool_calls`` and ``text.format`` are served as the
chat API's. What it cannot honour (streaming, background runs, reasoning settings, other tool types, includes)
is refused with 400 naming the field, as everywhere in the endpoint.
"""

from __future__ import annotations

from typing import Any

from areal_hpc.agent import openai_api as api
from areal_hpc.agent.openai_api import bad

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
          "max_output_tokens", "stream", "include", "store", "metadata", "user", "previous_response_id", "text",
          "truncation", "reasoning", "background", "top_logprobs"}  # fmt: skip
# Fields accepted at one value only, the one that changes nothing here.
NEUTRAL = {"stream": False, "background": False, "include": [], "truncation": "disabled", "top_logprobs": 0}


def parse_responses(body: Any, model: str, earlier: dict[str, list[dict]]) -> tuple[api.Request, int]:
    """The chat request a Responses request asks for, and how many of its messages are the instructions (not
    carried to a later response); ``earlier``: the conversations of this episode's responses by id."""
    fields = api.check_fields(body, FIELDS, model, NEUTRAL)
    if fields.get("reasoning") not in (None, {}):
        raise bad("reasoning", "not served here (the model reasons as its chat template lets it)")
    before = []
    if (previous := fields.get("previous_response_id")) is not None:
        if previous not in earlier:
            raise bad("previous_response_id", f"{str(previous)[:80]!r} is not a response of this episode")
        before = earlier[previous]
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {
        "model": fields["model"],
        "messages": [*system, *before, *_messages(fields.get("input"))],
        **{k: fields[k] for k in ("temperature", "top_p", "parallel_tool_calls") if k in fields},
    }
    if "max_output_tokens" in fields:
        chat["max_completion_tokens"] = fields["max_output_tokens"]
    if "tools" in fields:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(fields["tools"], "tools"))]
    if "tool_choice" in fields:
        chat["tool_choice"] = _tool_choice(fields["tool_choice"])
    if "text" in fields:
        chat["response_format"] = _format(fields["text"])
    return api.parse_chat(chat, model), len(system)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise bad(where, "must be a list")
    return value


def _messages(value: Any) -> list[dict]:
    """Chat messages of a request's input: a string, or a list of items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(_list(value, "input")):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict):
            out.append({"role": item.get("role"), "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            last = out[-1] if out and out[-1]["role"] == "assistant" else None
            if last is None:  # a call with no text before it
                out.append(last := {"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, where)})
        else:
            raise bad(where, "must be a message, function_call or function_call_output item")
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = ("input_text", "output_text", "text")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad(
        where, "must be text or a list of input_text/output_text parts (images and files are not served)"
    )


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad(
            where, 'only function tools are served: {"type": "function", "name": ..., "parameters": {...}}'
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict:
    fmt = text.get("format", {"type": "text"}) if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt


def response(reply: dict, finish: str, use: dict, model: str, rid: str, created: int, request: dict) -> dict:
    """A response object of one chat reply: its text as a message item, each tool call a function_call item."""
    output = []
    if reply["content"]:
        text = {"type": "output_text", "text": reply["content"], "annotations": []}
        output.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                       "content": [text]})  # fmt: skip
    for call in api.wire_message(reply).get("tool_calls", []):
        output.append({"type": "function_call", "id": f"fc_{rid}_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})  # fmt: skip
    cut = finish == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": output, "instructions": request.get("instructions"), "metadata": request.get("metadata") or {},
        "parallel_tool_calls": request.get("parallel_tool_calls", True), "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools", []), "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "previous_response_id": request.get("previous_response_id"),
        "usage": {"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
                  "total_tokens": use["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }  # fmt: skip
