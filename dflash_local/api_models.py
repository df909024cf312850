"""The OpenAI wire format: request bodies (unknown fields are ignored, as OpenAI clients send many), turned into
Engine.generate's arguments, and the pieces of the response bodies."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from . import chat_output, reasoning, tool_calls
from .api_errors import APIError
from .engine import ContextOverflowError, Engine, Finished
from .sampling import SamplingParams


class GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None

    def generate_kwargs(self, engine: Engine, prompt: dict, prompt_param: str, n_predict: int = -1) -> dict:
        """Engine.generate's arguments for this request and `prompt` ({"prompt": ...} or {"messages": ...}); a value
        the engine would refuse raises APIError. n_predict caps a request that sets no max_tokens (-1: the context's
        end), as llama-server's -n."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        try:
            ids = engine.prompt_tokens(**prompt)
            SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
        except ValueError as e:
            raise APIError(400, str(e))
        max_tokens = self.max_completion_tokens or self.max_tokens or (n_predict if n_predict > 0 else
                                                                       engine.n_ctx - len(ids))
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return dict(prompt, max_tokens=max_tokens, stop=stop, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, min_p=self.min_p, seed=self.seed)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[dict] | None = None
    # passed to the chat template as they come, so that a conversation with tool calls renders whole
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning, for templates that keep it

    @model_validator(mode="after")
    def _tool_answers_a_call(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the 'tool_call_id' of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = None  # rendered by the chat template, calls parsed from the output (tool_calls.py)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, over the server's defaults
    response_format: dict | None = None

    @field_validator("response_format")
    @classmethod
    def _plain_text_only(cls, v):
        # a JSON mode or schema the output would not follow is refused, never silently dropped
        if v is not None and v.get("type", "text") != "text":
            raise ValueError(f"type {v.get('type')!r} is not supported yet; only 'text'")
        return v
    reasoning_format: str | None = None  # over the server's --reasoning-format
    reasoning_budget_tokens: int | None = Field(
        default=None, validation_alias=AliasChoices("reasoning_budget_tokens", "thinking_budget_tokens"))

    def prompt_kwargs(self) -> dict:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in self.messages]
        try:
            budget = reasoning.budget_kwargs(self.reasoning_budget_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="reasoning_budget_tokens")
        kwargs = budget | (self.chat_template_kwargs or {}) | ({"tools": self.tools} if self.tools else {})
        return {"messages": tool_calls.template_messages(messages), "chat_template_kwargs": kwargs}

    def output_syntax(self, engine: Engine, prompt: dict, reasoning_format: str) -> chat_output.Syntax:
        """How this request's output is read (reasoning, tool calls); a request that cannot be served raises
        APIError."""
        fmt = self.reasoning_format or reasoning_format
        try:
            reasoning.check_format(fmt)
        except ValueError as e:
            raise APIError(400, str(e), param="reasoning_format")
        try:
            tool_calls.check_choice(self.tool_choice, self.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice")
        try:
            text = engine.chat_prompt(prompt["messages"], prompt["chat_template_kwargs"])
        except ValueError as e:  # the template's own errors
            raise APIError(400, str(e))
        try:
            return chat_output.syntax_for(engine.chat_template, text, fmt, self.tools, self.tool_choice,
                                          self.parallel_tool_calls)
        except ValueError as e:  # tools for a model whose call syntax is unknown
            raise APIError(400, str(e), param="tools")


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    def prompt_kwargs(self) -> dict:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        return {"prompt": prompt}


# -- responses ------------------------------------------------------------------------------------------------------


def response_head(chat: bool, model: str) -> dict:
    """The fields every response body and stream chunk of one request starts with."""
    return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}


def completion_body(head: dict, done: Finished, message: chat_output.Message | None) -> dict:
    """A whole response: a chat completion when given the assistant's message, else a text completion."""
    choice = {"index": 0, "finish_reason": finish_reason(done, message), "logprobs": None}
    if message is not None:
        head = {**head, "object": "chat.completion"}
        choice["message"] = message.wire()
    else:
        choice["text"] = done.text
    return {**head, "choices": [choice], "usage": usage_of(done), "timings": timings_of(done)}


def chunk_choice(chat: bool, text: str | None, finish: str | None, first: bool = False,
                 delta: dict | None = None) -> dict:
    """A stream chunk's choice: a chat chunk's delta is the one given, or else the text as content."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else delta or ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


def finish_reason(done: Finished, message: chat_output.Message | None = None) -> str:
    if message is not None and message.calls:
        return "tool_calls"
    return "length" if done.summary.finish_reason in ("length", "context_full") else "stop"


def usage_of(done: Finished) -> dict:
    s = done.summary
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_generated, "total_tokens": s.n_prompt + s.n_generated}


def timings_of(done: Finished) -> dict:
    """llama-server's `timings` fields, plus the mean acceptance length."""
    s = done.summary
    n_eval = s.n_prompt - s.n_cached
    return {
        "prompt_n": n_eval,
        "prompt_ms": s.prompt_ms,
        "prompt_per_second": n_eval / (s.prompt_ms / 1000) if s.prompt_ms > 0 else 0.0,
        "predicted_n": s.n_generated,
        "predicted_ms": s.decode_ms,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.n_drafted,
        "draft_n_accepted": s.n_accepted,
        "mean_acceptance_length": s.mean_acceptance_length,
    }
