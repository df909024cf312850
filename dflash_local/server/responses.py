"""OpenAI's Responses API (POST /v1/responses, as Codex CLI and agents on the current OpenAI SDK call it) over the chat
completions: `instructions` and `input` (text, or items: messages, function calls and their outputs, reasoning) become
chat messages, function tools OpenAI's chat tools (ResponsesRequest.chat); the answer becomes output items
(reasoning, message, function_call) or, streamed, the `response.*` events. Nothing is stored: each request carries
its whole conversation (previous_response_id is refused)."""

from __future__ import annotations

import json
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field

from ..chat import output as chat_output
from ..chat.tool_calls import ToolChoiceError
from ..engine.engine import Finished, TextDelta
from ..engine.sampling import MAX_TEMPERATURE
from .errors import APIError
from .schema import ChatRequest, chat_request, joined_text
from .stream import KEEPALIVE, job_events

# fields that would change the answer and are not honoured here, with the values that are fine (others, such as
# store, metadata, user, include or prompt_cache_key, do not change it)
REFUSED = {
    "previous_response_id": ((), "this server keeps no responses: send the whole conversation as input"),
    "conversation": ((), "this server keeps no conversations: send the whole conversation as input"),
    "background": ((False,), "background responses are not supported"),
    "prompt": ((), "stored prompts are not supported"),
    "truncation": (("disabled",), "truncation is not supported: a conversation longer than the context is a 400"),
    "top_logprobs": ((0,), "top_logprobs is not supported here: use /v1/chat/completions"),
    "max_tool_calls": ((), "max_tool_calls is not supported"),
    "context_management": ((), "context management is not supported"),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)  # left out: llama-server's defaults
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    reasoning: dict | None = None
    text: dict | None = None

    def chat(self) -> ChatRequest:
        """This request as a chat completion (APIError naming what cannot be carried over)."""
        for name, (fine, why) in REFUSED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in fine:
                raise APIError(400, why, param=name)
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [{"role": "user", "content": self.input}] if isinstance(self.input, str) else _items(self.input)
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls}
        body |= {name: getattr(self, name) for name in ("temperature", "top_p") if getattr(self, name) is not None}
        if self.tools:
            body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        effort = (self.reasoning or {}).get("effort")
        if effort == "none":
            body["reasoning_budget_tokens"] = 0
        elif effort is not None:  # templates that read it (gpt-oss's) take it, as llama-server hands it over
            body["chat_template_kwargs"] = {"reasoning_effort": effort}
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                              "schema": fmt.get("schema")}}
        elif fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.get("type") != "text":
            raise APIError(400, 'text.format.type must be "text", "json_object" or "json_schema"', param="text")
        return chat_request(body)


def _parts(content, where: str) -> str:
    return joined_text(content, where, {"input_text": "text", "output_text": "text", "text": "text",
                                        "refusal": "refusal"})


def _items(items: list[dict]) -> list[dict]:
    """Input items as chat messages: a function call joins the assistant message before it (or starts one), a
    reasoning item goes with the assistant message after it."""
    messages, reasoning = [], None

    def assistant() -> dict:
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant" or reasoning is not None:
            messages.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            messages[-1]["reasoning_content"], reasoning = reasoning, None
        return messages[-1]

    for i, item in enumerate(items):
        at = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer"):
            messages.append({"role": item["role"], "content": _parts(item.get("content"), f"{at}.content")})
        elif kind == "message" and item.get("role") == "assistant":
            msg = assistant()
            msg["content"] += _parts(item.get("content"), f"{at}.content")
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _parts(item.get("output"), f"{at}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(400, f"{at}: {kind!r} items are not supported", param=at)
    return messages


def _tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise APIError(400, f"{where}: only function tools are supported, not {tool.get('type')!r}", param=where)
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": tool.get("parameters") or {"type": "object"}}}


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                   param="tool_choice")


# -- answers --------------------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return prefix + "_" + secrets.token_hex(16)


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def call_item(call, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


class Head:
    """What every response object of one request shares, and the object itself at a given status."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id, self.created, self.body, self.model = _id("resp"), int(time.time()), body, model

    def response(self, status: str, output: list, done: Finished | None = None) -> dict:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": output, "error": None, "incomplete_details": None, "instructions": b.instructions,
               "max_output_tokens": b.max_output_tokens, "parallel_tool_calls": b.parallel_tool_calls,
               "temperature": b.temperature, "top_p": b.top_p, "tool_choice": b.tool_choice or "auto",
               "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "reasoning": b.reasoning,
               "previous_response_id": None, "store": False, "metadata": {}, "usage": None}
        if done is not None:
            s = done.summary
            out["usage"] = {"input_tokens": s.n_prompt, "input_tokens_details": {"cached_tokens": s.n_cached},
                            "output_tokens": s.n_generated, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": s.n_prompt + s.n_generated}
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def status_of(done: Finished) -> str:
    return "incomplete" if done.summary.finish_reason in ("length", "context_full") else "completed"


def response_body(head: Head, done: Finished, message: chat_output.Message) -> dict:
    output = [reasoning_item(message.reasoning)] if message.reasoning else []
    if message.content:
        output.append(message_item(message.content))
    output += [call_item(c) for c in message.calls]
    return head.response(status_of(done), output, done)


async def events(job, syntax: chat_output.Syntax, head: Head, metrics, t0: float):
    """The streamed answer as the Responses API's events (each with its type and sequence_number): created and
    in_progress, each output item added, its deltas and done (reasoning text, output text, function call
    arguments), then completed (or incomplete) with the whole response."""
    stream = chat_output.Stream(syntax)
    seq = 0
    output: list[dict] = []  # the items so far; the last one may be open
    is_open = False

    def event(name: str, **data) -> str:
        nonlocal seq
        seq += 1
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': seq - 1, **data})}\n\n"

    def close() -> list[str]:
        """The events that end the open item."""
        nonlocal is_open
        if not is_open:
            return []
        is_open = False
        item, at = output[-1], {"item_id": output[-1]["id"], "output_index": len(output) - 1}
        out = []
        if item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(event("response.reasoning_text.done", **at, content_index=0, text=text))
        elif item["type"] == "message":
            part = text_part(item.pop("_text"))
            item["content"] = [part]
            out += [event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
                    event("response.content_part.done", **at, content_index=0, part=part)]
        item["status"] = "completed"
        return out + [event("response.output_item.done", output_index=len(output) - 1, item=item)]

    def open_item(item: dict) -> list[str]:
        nonlocal is_open
        out = close()
        output.append(item)
        is_open = True
        out.append(event("response.output_item.added", output_index=len(output) - 1,
                         item={k: v for k, v in item.items() if k != "_text"}))
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                             content_index=0, part=text_part("")))
        return out

    def render(deltas: list[dict]) -> list[str]:
        out = []
        for d in deltas:
            for key, kind, make in (("reasoning_content", "reasoning", reasoning_item),
                                    ("content", "message", message_item)):
                if key not in d:
                    continue
                if not (is_open and output[-1]["type"] == kind):
                    out += open_item({**make("", "in_progress"), "_text": ""})
                output[-1]["_text"] += d[key]
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                out.append(event(name, item_id=output[-1]["id"], output_index=len(output) - 1, content_index=0,
                                 delta=d[key], **extra))
            for call in d.get("tool_calls", []):
                tc = chat_output.ToolCall(call["function"]["name"], call["function"]["arguments"], call["id"])
                out += open_item(call_item(tc, "in_progress"))
                at = {"item_id": output[-1]["id"], "output_index": len(output) - 1}
                out += [event("response.function_call_arguments.delta", **at, delta=tc.arguments),
                        event("response.function_call_arguments.done", **at, arguments=tc.arguments)]
                output[-1]["arguments"] = tc.arguments
        return out

    yield event("response.created", response=head.response("in_progress", []))
    yield event("response.in_progress", response=head.response("in_progress", []))
    try:
        async for ev in job_events(job, metrics, t0):
            if ev is KEEPALIVE:
                yield ": keep-alive\n\n"
            elif isinstance(ev, TextDelta) and ev.text:
                for out in render(stream.feed(ev.text)):
                    yield out
            elif isinstance(ev, Finished):
                for out in render(stream.close()) + close():
                    yield out
                status = status_of(ev)
                yield event(f"response.{status}", response=head.response(status, output, ev))
    except (ToolChoiceError, Exception) as e:  # the engine failed, or the answer missed the tool_choice
        yield event("error", code="server_error", message=str(e), param=None)
