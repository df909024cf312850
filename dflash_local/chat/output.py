"""The assistant message in a chat model's output: reasoning, content and tool calls (reasoning.py, harmony.py,
tool_calls.py), read whole or as it streams.

A stream is read by parsing all the text so far at each piece and sending what grew since the last parse (as
llama-server does): markers cut across pieces need no special case, since a parse of partial text holds back
whatever could still become one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import harmony, reasoning, tool_calls
from .tool_calls import ToolCall


@dataclass
class Syntax:
    """How one chat request's output is read."""

    reasoning: str  # "think" (a tagged block at the start) or "harmony" (gpt-oss channels)
    separate: bool = True  # the reasoning is given apart, in reasoning_content (not with reasoning_format none)
    inline: bool = False  # the reasoning also stays in the content as it came (none, deepseek-legacy)
    tags: tuple[str, str] = reasoning.THINK
    inside: bool = False  # the prompt opened the reasoning block
    tools: str | None = None  # the tool-call format; None: calls are not parsed (no tools, or tool_choice none)
    functions: list[dict] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True

    @property
    def preserved(self) -> tuple[str, ...]:
        """Control tokens the output must show as text to be read."""
        marks = harmony.PRESERVED if self.reasoning == "harmony" else reasoning.MARKERS[self.tags]
        return tuple(marks) + (tool_calls.PRESERVED[self.tools] if self.tools else ())


def syntax_for(template: str | None, prompt: str, reasoning_format: str, tools: list[dict] | None, tool_choice,
               parallel: bool = True) -> Syntax:
    """The syntax of a request's output, from the chat template and the rendered prompt; ValueError for a request
    that cannot be served (a bad reasoning_format or tool_choice, or tools for a model whose call syntax is unknown)."""
    reasoning.check_format(reasoning_format)
    choice = tool_calls.check_choice(tool_choice, tools)
    fmt = tool_calls.detect(template) if choice != "none" else None
    if choice != "none" and fmt is None:
        raise ValueError("this model's chat template has no tool-call format dflash-local can read (Hermes/Qwen "
                         "<tool_call>, Qwen3-Coder XML, Llama 3.1 JSON, gpt-oss harmony, Gemma 4): its tool calls "
                         "could not be returned; send the request without tools, or with tool_choice \"none\"")
    kind = "harmony" if template and "<|channel|>" in template else "think"
    tags = reasoning.tags_for(template)
    inside = kind == "think" and reasoning.opened_in_prompt(prompt, tags)
    return Syntax(kind, reasoning_format != "none", reasoning_format in ("none", "deepseek-legacy"), tags, inside, fmt,
                  tool_calls.functions(tools or []), choice, parallel)


@dataclass
class Message:
    reasoning: str
    content: str
    calls: list[ToolCall]

    def wire(self) -> dict:
        """The response's `message`."""
        msg = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [c.wire() for c in self.calls]
        return msg


def parse(syntax: Syntax, text: str, partial: bool) -> Message:
    """The message in `text`; partial=True: the output goes on, and the message holds only what is certain."""
    if syntax.reasoning == "harmony":
        return _parse_harmony(syntax, text, partial)
    thinking, rest = reasoning.split(text, syntax.tags, syntax.inside, partial)
    thinking, rest = thinking if syntax.separate else "", text if syntax.inline else rest
    if not syntax.tools:
        return Message(thinking, rest, [])
    content, calls = tool_calls.parse(rest, syntax.tools, syntax.functions, partial)
    if partial or calls:  # blanks before a call are not part of the answer; while streaming, one may follow
        content = content.rstrip()
    return Message(thinking, content, calls)


def _parse_harmony(syntax: Syntax, text: str, partial: bool) -> Message:
    thinking, content, calls = [], "", []
    for m in harmony.messages(text, partial):
        call = tool_calls.harmony_call(m) if syntax.tools else None
        if call:
            calls.append(call)
            continue
        if m.channel == "analysis" and syntax.separate:
            thinking.append(m.body)
        if syntax.inline:
            content += m.raw
        elif m.channel != "analysis" and m.recipient is None:  # the final answer, and commentary to the user
            content += m.body
    return Message("\n".join(thinking).strip(), content, calls)


def finish(syntax: Syntax, text: str) -> Message:
    """The message of a complete output, under the request's tool_choice (ToolChoiceError if it is not met)."""
    msg = parse(syntax, text, partial=False)
    msg.calls = tool_calls.enforce(syntax.choice, syntax.parallel, msg.calls) if syntax.tools else []
    return msg


class Stream:
    """A streamed output as OpenAI chunk deltas: what each new piece of text adds to the message."""

    def __init__(self, syntax: Syntax):
        self.syntax = syntax
        self.text = ""
        self.sent = Message("", "", [])

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        return self._deltas(parse(self.syntax, self.text, partial=True))

    def close(self) -> list[dict]:
        """The last deltas; ToolChoiceError if the output does not meet the request's tool_choice."""
        return self._deltas(finish(self.syntax, self.text))

    def _deltas(self, msg: Message) -> list[dict]:
        out = []
        if len(msg.reasoning) > len(self.sent.reasoning):
            out.append({"reasoning_content": msg.reasoning[len(self.sent.reasoning):]})
            self.sent.reasoning = msg.reasoning
        if len(msg.content) > len(self.sent.content):
            out.append({"content": msg.content[len(self.sent.content):]})
            self.sent.content = msg.content
        limit = len(msg.calls) if self.syntax.parallel else min(len(msg.calls), 1)
        for i in range(len(self.sent.calls), limit):
            self.sent.calls.append(msg.calls[i])
            out.append({"tool_calls": [msg.calls[i].wire(i)]})
        return out
