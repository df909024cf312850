"""gpt-oss's harmony output: messages on channels. The generation prompt ends with `<|start|>assistant`, so the output
reads like

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

and a tool call is a message to a recipient, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{ARGS}` (the recipient may also come before the channel). `<|return|>` and `<|call|>` end the generation (they are
end-of-generation tokens), so the last message usually has no terminator in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .textstream import partial_suffix

MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
# the control tokens the output must show as text for this parser
PRESERVED = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


@dataclass
class Message:
    channel: str  # analysis, commentary, final ('' when the header names none)
    recipient: str | None  # e.g. functions.get_weather
    body: str
    raw: str  # the message as it came, header and terminator included


def messages(text: str, partial: bool) -> list[Message]:
    """The messages in `text`. With partial=True (more text may follow), a last message's body stops short of what
    could be the start of a terminator, and a header still being written is left out."""
    out, pos = [], 0
    while pos < len(text):
        i = text.find(MESSAGE, pos)
        if i < 0:  # a header still being written, or text outside harmony's format
            if not partial and text[pos:].strip():
                out.append(Message("", None, text[pos:], text[pos:]))
            break
        header = text[pos:i]
        start = i + len(MESSAGE)
        ends = [(j, t) for t in TERMINATORS if (j := text.find(t, start)) >= 0]
        if ends:
            j, term = min(ends)
            body, nxt = text[start:j], j + (0 if term == "<|start|>" else len(term))
        else:
            body = text[start:]
            if partial:
                body = body[: len(body) - partial_suffix(body, TERMINATORS)]
            nxt = len(text)
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        out.append(Message(channel.group(1) if channel else "", recipient.group(1) if recipient else None, body,
                           text[pos:start] + body if not ends else text[pos:nxt]))
        pos = nxt
    return out
