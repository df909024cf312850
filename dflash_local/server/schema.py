"""The OpenAI wire format: request bodies (unknown fields are ignored, as OpenAI clients send many; known fields the
server cannot honour are refused, REFUSED), turned into Engine.generate's arguments, and the pieces of the response
bodies."""

from __future__ import annotations

import secrets
import time
from typing import Any, ClassVar, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      model_validator)

from ..chat import output as chat_output, reasoning, tool_calls
from .errors import APIError, validation_error
from ..engine.engine import ContextOverflowError, Engine, Finished, Generation
from ..engine.grammar import grammar_of
from ..engine.sampling import MAX_TEMPERATURE, ParamError

# Request fields this server cannot honour, with the values it can (a field absent or null is always fine). A request
# setting one otherwise is a 400 naming the field: a client asking for them would otherwise get something it did not
# ask for, silently. (Fields no OpenAI or llama-server client means anything by are ignored.)
REFUSED: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "only n=1 is supported"),
    "best_of": ((1,), "only best_of=1 is supported"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    # llama-server's samplers beyond the ones implemented here
    "mirostat": ((0,), "mirostat sampling is not supported"),
    "typical_p": ((1, 1.0), "typical sampling is not supported"),
    "dynatemp_range": ((0, 0.0), "dynamic temperature is not supported"),
    "xtc_probability": ((0, 0.0), "XTC sampling is not supported"),
    "dry_multiplier": ((0, 0.0), "DRY sampling is not supported"),
    "top_n_sigma": ((-1, -1.0), "top-n-sigma sampling is not supported"),
    "ignore_eos": ((False,), "ignore_eos is not supported"),
    "n_probs": ((0,), "n_probs is not supported: use logprobs"),
    "post_sampling_probs": ((False,), "post-sampling probabilities are not supported"),
    "min_tokens": ((0,), "min_tokens is not supported (llama.cpp has no minimum length; a logit_bias on the end "
                         "token does it)"),
    "n_cmpl": ((1,), "only n_cmpl=1 is supported"),
    "n_indent": ((0,), "n_indent is not supported"),
    "t_max_predict_ms": ((0, -1), "t_max_predict_ms is not supported"),
    "n_cache_reuse": ((0,), "n_cache_reuse (KV shifting) is not supported"),
    "min_keep": ((0,), "min_keep is not supported"),
    "lora": (([],), "LoRA adapters are not supported"),
    "return_tokens": ((False,), "return_tokens is not supported"),
    "return_progress": ((False,), "return_progress is not supported"),
    "response_fields": ((), "response_fields is not supported"),
    "grammar_lazy": ((False,), "lazy grammars are not supported"),
    "grammar_triggers": (([],), "grammar triggers are not supported"),
    "preserved_tokens": (([],), "preserved_tokens is not supported"),
}

# llama-server's `samplers`: its names of the samplers (and their aliases) and its one-letter codes. This server's
# chain is llama.cpp's default order; of the others only those whose parameters are refused unless neutral (above)
# may be listed, since listed at a neutral value they do nothing.
SAMPLERS = {"penalties": "e", "dry": "d", "top_n_sigma": "s", "top_k": "k", "typ_p": "y", "top_p": "p", "min_p": "m",
            "xtc": "x", "temperature": "t", "infill": "i", "adaptive_p": "a"}
SAMPLER_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"} | {
    alias: name for name in SAMPLERS for alias in (name.replace("_", "-"), name.replace("_", ""))}
CHAIN = "ekpmt"  # penalties, top_k, top_p, min_p, temperature: what sample_row applies, in this order
NEUTRAL = {"e": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}, "k": {"top_k": 0},
           "p": {"top_p": 1.0}, "m": {"min_p": 0.0}, "t": {"temperature": 1.0}}  # without a temperature sampler,
# llama.cpp draws from the logits as they are: temperature 1


class GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="allow")  # kept only to check them against REFUSED
    refused: ClassVar[dict] = REFUSED

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # llama-server's fields: n_predict over max_tokens (-1: no limit); n_keep and n_discard only matter to context
    # shifting, which llama-server leaves off by default and this server does not do (a generation ends at the
    # context's end); cache_prompt false decodes the whole prompt; id_slot picks the slot (-1: any)
    n_predict: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    n_keep: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    n_discard: int | None = Field(default=None, ge=0, le=2**31 - 1)
    cache_prompt: bool = True
    id_slot: int = Field(default=-1, ge=-1, le=2**31 - 1)
    samplers: list[str] | str | None = None
    timings_per_token: bool = False  # every stream chunk carries the timings so far
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # a field left out takes llama-server's default (common_params_sampling): its chain of top-k 40, top-p 0.95,
    # min-p 0.05 and temperature 0.8, which frontends that send only a temperature get there too
    temperature: float = Field(default=0.8, ge=0, le=MAX_TEMPERATURE)  # above OpenAI's 2, as llama-server (sampling.py)
    top_p: float = Field(default=0.95, gt=0, le=1)
    top_k: int = Field(default=40, ge=0, le=2**31 - 1)
    min_p: float = Field(default=0.05, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    # llama.cpp's controls (sampling.py)
    logit_bias: dict[str, float | StrictBool] | list[list] | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = Field(default=64, ge=-1, le=2**31 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: dict[str, Any] | None = None
    grammar: str | None = None  # llama-server: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server: a JSON schema

    def refuse_unsupported(self) -> None:
        fields = {**dict(self), **(self.model_extra or {})}
        for name, (fine, why) in self.refused.items():
            if fields.get(name) is not None and fields[name] not in fine:
                raise APIError(400, why, param=name)

    def grammar_text(self) -> tuple[str | None, str]:
        """The GBNF grammar asked for (response_format, json_schema or grammar), and the field that asked."""
        schema, param = self.json_schema, "json_schema"
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                schema, param = rf.get("schema") or schema or {}, "response_format"
            elif kind == "json_schema":
                wrapper = rf.get("json_schema")
                schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
                if schema is None:
                    raise APIError(400, 'a response_format of type "json_schema" needs its schema: '
                                        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                                   param="response_format")
                param = "response_format"
            elif kind != "text":
                raise APIError(400, 'response_format type must be "text", "json_object" or "json_schema"',
                               param="response_format")
        if schema is not None and not isinstance(schema, dict):
            raise APIError(400, "a JSON schema must be a JSON object", param=param)
        try:
            return grammar_of(self.grammar, schema), "grammar" if self.grammar is not None else param
        except ValueError as e:
            raise APIError(400, str(e), param=param if schema is not None else "grammar")

    def n_logprobs(self) -> int | None:
        """How many top logprobs per token the response carries (None: no logprobs)."""
        return None

    def max_new(self, n_predict: int) -> int | None:
        """The most tokens to generate: n_predict, or max_tokens, or else the server's -n (None: to the end of the
        context)."""
        if self.n_predict == 0:
            raise APIError(400, "n_predict 0 (evaluating the prompt only) is not supported", param="n_predict")
        limit = self.n_predict if self.n_predict is not None else self.max_completion_tokens or self.max_tokens
        limit = n_predict if limit is None else limit
        return limit if limit > 0 else None

    def sampling(self) -> dict:
        """The sampling parameters, with those of samplers the request's `samplers` leaves out neutral (as llama.cpp
        leaves them out of its chain)."""
        values = {name: getattr(self, name) for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                                          "presence_penalty", "frequency_penalty")}
        if self.samplers is None:
            return values
        if isinstance(self.samplers, str):
            codes = list(self.samplers)
            unknown = [c for c in codes if c not in SAMPLERS.values()]
        else:
            names = [SAMPLER_ALIASES.get(n, n) for n in self.samplers]
            unknown = [n for n in names if n not in SAMPLERS]
            codes = [SAMPLERS.get(n) for n in names]
        if unknown:
            raise APIError(400, f"samplers: unknown sampler {unknown[0]!r}", param="samplers")
        if "i" in codes or "a" in codes:
            raise APIError(400, "samplers: the infill and adaptive_p samplers are not supported", param="samplers")
        ours = [c for c in codes if c in CHAIN]
        if ours != sorted(set(ours), key=CHAIN.index):
            raise APIError(400, "samplers: this server applies penalties, top_k, top_p, min_p and temperature in "
                                "that order (llama.cpp's default), each at most once", param="samplers")
        for code in CHAIN:
            if code not in ours:
                values |= NEUTRAL[code]
        return values

    def prepare(self, engine: Engine, prompt: dict, prompt_param: str, n_predict: int = -1) -> Generation:
        """The engine's prepared generation for this request and `prompt` ({"prompt": ...} or {"messages": ...}); a
        value the engine refuses raises APIError naming the field. n_predict caps a request that sets no max_tokens
        (-1: the context's end), as llama-server's -n."""
        self.refuse_unsupported()
        grammar, grammar_param = self.grammar_text()
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return engine.prepare(
                **prompt, max_tokens=self.max_new(n_predict), stop=stop, seed=self.seed, grammar=grammar,
                logprobs=self.n_logprobs(), logit_bias=self.logit_bias, repeat_last_n=self.repeat_last_n,
                cache_prompt=self.cache_prompt, **self.sampling())
        except ContextOverflowError as e:
            raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
        except ParamError as e:
            raise APIError(400, str(e), param=grammar_param if e.param == "grammar" else e.param)
        except ValueError as e:  # the chat template's own errors, an empty prompt
            raise APIError(400, str(e), param=prompt_param)


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
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None  # rendered by the chat template, calls parsed from the output (tool_calls.py)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, over the server's defaults
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

    def output_syntax(self, engine: Engine, prompt_text: str, reasoning_format: str) -> chat_output.Syntax:
        """How this request's output is read (reasoning, tool calls), given its rendered prompt; a request that
        cannot be served raises APIError."""
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
            return chat_output.syntax_for(engine.chat_template, prompt_text, fmt, self.tools, self.tool_choice,
                                          self.parallel_tool_calls)
        except ValueError as e:  # tools for a model whose call syntax is unknown
            raise APIError(400, str(e), param="tools")

    def n_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_request(body: dict) -> ChatRequest:
    """Another API's request (Anthropic's, the Responses API's) carried over: its chat request, without the fields
    left None, validated as a chat body is."""
    try:
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=True)
    except ValidationError as e:
        raise validation_error(e) from None


def joined_text(content, where: str, kinds: dict[str, str]) -> str:
    """A message's content in another API: a string, or parts of the types in `kinds` (type -> the key of its text),
    joined; APIError naming the first part of another type."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content if isinstance(content, list) else [content]):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get(kinds[kind]), str):
            raise APIError(400, f"{where}.{j}: only text is supported here, not {kind!r}", param=f"{where}.{j}")
        out.append(part[kinds[kind]])
    return "".join(out)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    def n_logprobs(self) -> int | None:
        if (self.model_extra or {}).get("top_logprobs") is not None:
            raise APIError(400, "completions take logprobs: N (top_logprobs is a chat field)", param="top_logprobs")
        return self.logprobs

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


def completion_body(head: dict, done: Finished, message: chat_output.Message | None,
                    logprobs: dict | None = None) -> dict:
    """A whole response: a chat completion when given the assistant's message, else a text completion."""
    choice = {"index": 0, "finish_reason": finish_reason(done, message), "logprobs": logprobs}
    if message is not None:
        head = {**head, "object": "chat.completion"}
        choice["message"] = message.wire()
    else:
        choice["text"] = done.text
    return {**head, "choices": [choice], "usage": usage_of(done), "timings": timings_of(done)}


def chunk_choice(chat: bool, text: str | None, finish: str | None, first: bool = False,
                 delta: dict | None = None, logprobs: dict | None = None) -> dict:
    """A stream chunk's choice: a chat chunk's delta is the one given, or else the text as content."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else delta or ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


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
