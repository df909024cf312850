"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens, as Claude Code and the Anthropic SDK
call them) over the chat completions: a request's system prompt, content blocks and tools become chat messages and
function tools (MessagesRequest.chat), and the answer becomes content blocks (thinking, text, tool_use) or, streamed,
Anthropic's events. Errors are Anthropic's {"type": "error", "error": {...}}."""

from __future__ import annotations

import json
import secrets

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..chat import output as chat_output
from ..chat.tool_calls import ToolChoiceError
from ..engine.engine import Finished, TextDelta
from ..engine.sampling import MAX_TEMPERATURE
from .errors import APIError
from .schema import ChatRequest, chat_request, joined_text
from .stream import KEEPALIVE, job_events


# fields of Anthropic's API that would change the answer and are not honoured here (others, such as metadata,
# service_tier or cache_control, do not: prompts are always cached)
REFUSED = {"output_config": "output_config (structured outputs, effort) is not supported",
           "container": "containers (code execution) are not supported",
           "mcp_servers": "MCP servers are not supported"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ...: nothing that changes the answer

    model: str | None = None
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # Anthropic requires it; absent: the server's -n
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)  # left out: llama-server's defaults
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None

    def chat(self) -> ChatRequest:
        """This request as a chat completion (APIError naming what cannot be carried over)."""
        for name, why in REFUSED.items():
            if (self.model_extra or {}).get(name) is not None:
                raise APIError(400, why, param=name)
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for i, m in enumerate(self.messages):
            messages += _messages(m, f"messages.{i}")
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "stop": self.stop_sequences,
                "stream": self.stream}
        body |= {name: getattr(self, name) for name in ("temperature", "top_p", "top_k") if getattr(self, name) is not None}
        if self.tools:
            body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body |= _tool_choice(self.tool_choice)
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind == "enabled":  # a budget this server could not keep (docs/server.md, thinking models)
                raise APIError(400, "thinking budgets are not supported: leave thinking out (the model thinks as its "
                                    "template says) or set it to disabled", param="thinking")
            if kind != "disabled":
                raise APIError(400, 'thinking.type must be "enabled" or "disabled"', param="thinking")
            body["reasoning_budget_tokens"] = 0
        return chat_request(body)


def _text(content, where: str) -> str:
    return joined_text(content, where, {"text": "text"})


def _messages(m: dict, where: str) -> list[dict]:
    """One Anthropic message as chat messages: its tool results as tool messages (first: they answer the calls
    before), then the text, thinking and tool calls."""
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role: must be user or assistant", param=f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: a string or a list of content blocks", param=f"{where}.content")
    texts, thinking, calls, results = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            text = _text(block.get("content") or "", f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise APIError(400, f"{at}: {kind!r} blocks are not supported in {role} messages", param=at)
    out = results
    if texts or thinking or calls or not results:
        msg = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out = out + [msg]
    return out


def _tool(tool: dict, where: str) -> dict:
    if tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
        raise APIError(400, f"{where}: only custom tools (name, description, input_schema) are supported, not "
                            f"{tool.get('type')!r}", param=where)
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                             "parameters": tool.get("input_schema") or {"type": "object"}}}


def _tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    out = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        out = {"type": "function", "function": {"name": choice.get("name")}}
    if out is None:
        raise APIError(400, 'tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice")
    return {"tool_choice": out, "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}


# -- answers --------------------------------------------------------------------------------------------------------


def error_response(e: APIError) -> JSONResponse:
    kind = {"server_error": "api_error", "unavailable_error": "overloaded_error"}.get(e.type, e.type)
    if e.status == 401:
        kind = "authentication_error"
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message, "param": e.param}},
                        status_code=e.status, headers=e.headers)


def stop_reason(done: Finished, calls: bool) -> str:
    if calls:
        return "tool_use"
    return {"stop": "stop_sequence", "length": "max_tokens", "context_full": "max_tokens"}.get(
        done.summary.finish_reason, "end_turn")


def usage(done: Finished) -> dict:
    s = done.summary
    return {"input_tokens": s.n_prompt - s.n_cached, "cache_read_input_tokens": s.n_cached,
            "cache_creation_input_tokens": 0, "output_tokens": s.n_generated}


def _arguments(call) -> dict:
    try:
        return json.loads(call.arguments) or {}
    except json.JSONDecodeError:
        return {}


def message_body(done: Finished, message: chat_output.Message, model: str) -> dict:
    content = [{"type": "thinking", "thinking": message.reasoning, "signature": ""}] if message.reasoning else []
    if message.content:
        content.append({"type": "text", "text": message.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _arguments(c)} for c in message.calls]
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(done, bool(message.calls)),
            "stop_sequence": done.summary.stop_word or None, "usage": usage(done)}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def events(job, syntax: chat_output.Syntax, model: str, n_prompt: int, metrics, t0: float):
    """The streamed answer: message_start, each content block's start, deltas and stop (thinking, text, one per tool
    call), message_delta with the stop reason and usage, message_stop; ping while waiting."""
    stream = chat_output.Stream(syntax)
    block = {"index": -1, "type": None}

    def switch(kind: str, start: dict) -> list[str]:
        """Close the open block unless it is of this kind; open one of this kind."""
        if block["type"] == kind and kind != "tool_use":
            return []
        out = [event("content_block_stop", {"index": block["index"]})] if block["type"] else []
        block["index"] += 1
        block["type"] = kind
        return out + [event("content_block_start", {"index": block["index"], "content_block": start})]

    def render(deltas: list[dict]) -> list[str]:
        out = []
        for d in deltas:
            if "reasoning_content" in d:
                out += switch("thinking", {"type": "thinking", "thinking": ""})
                out.append(event("content_block_delta", {"index": block["index"], "delta": {
                    "type": "thinking_delta", "thinking": d["reasoning_content"]}}))
            if "content" in d:
                out += switch("text", {"type": "text", "text": ""})
                out.append(event("content_block_delta", {"index": block["index"], "delta": {
                    "type": "text_delta", "text": d["content"]}}))
            for call in d.get("tool_calls", []):
                fn = call["function"]
                out += switch("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}})
                out.append(event("content_block_delta", {"index": block["index"], "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out

    yield event("message_start", {"message": {
        "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    try:
        async for ev in job_events(job, metrics, t0):
            if ev is KEEPALIVE:
                yield event("ping", {})
            elif isinstance(ev, TextDelta) and ev.text:
                for out in render(stream.feed(ev.text)):
                    yield out
            elif isinstance(ev, Finished):
                for out in render(stream.close()):
                    yield out
                if block["type"]:
                    yield event("content_block_stop", {"index": block["index"]})
                yield event("message_delta", {"delta": {
                    "stop_reason": stop_reason(ev, bool(stream.sent.calls)),
                    "stop_sequence": ev.summary.stop_word or None}, "usage": {"output_tokens": ev.summary.n_generated}})
                yield event("message_stop", {})
    except ToolChoiceError as e:
        yield event("error", {"error": {"type": "api_error", "message": str(e)}})
    except Exception as e:  # the engine failed mid-stream
        yield event("error", {"error": {"type": "api_error", "message": str(e)}})
