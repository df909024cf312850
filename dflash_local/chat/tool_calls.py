"""Tool calls: the model's call syntax, found from its chat template as llama.cpp's common/chat.cpp does, and the
output parsed into OpenAI `tool_calls`.

Formats (the registry's families):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes)
- qwen3-coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
  (Qwen3-Coder, Qwen3.5, Qwen3.6)
- llama3: a JSON object `{"name": ..., "parameters": {...}}` as the whole answer, or after `<|python_tag|>`
- harmony: a gpt-oss message to `functions.NAME` (harmony.py)
- gemma4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` (Gemma 4; Gemma 3's templates have no tools)

tool_choice has no grammar behind it here: `required` and a named function are checked once the output is complete
(an output without the call is an error), and parallel_tool_calls=false keeps the first call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from . import harmony
from .textstream import partial_suffix


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def wire(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolChoiceError(ValueError):
    """The output does not satisfy the request's tool_choice."""


def detect(template: str | None) -> str | None:
    """The tool-call format of the model whose chat template this is; None where it is none of the known ones."""
    src = template or ""
    if "<|channel|>" in src:
        return "harmony"
    if "<|tool_call>call:" in src:
        return "gemma4"
    if "<tool_call>" in src and "<function=" in src and "<parameter=" in src:
        return "qwen3-coder"
    if "<tool_call>" in src:
        return "hermes"
    if "<|start_header_id|>" in src and ("<|python_tag|>" in src or "ipython" in src):
        return "llama3"
    return None


PRESERVED = {  # control tokens the output must show as text for each format's parser (llama.cpp's preserved_tokens)
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3-coder": ("<tool_call>", "</tool_call>"),
    "llama3": ("<|python_tag|>",),
    "harmony": harmony.PRESERVED,
    "gemma4": ("<|tool_call>", "<tool_call|>", "<|\"|>"),
}


# -- the request --------------------------------------------------------------------------------------------------


def check_choice(tool_choice, tools: list[dict] | None) -> str | None:
    """The request's tool_choice as 'auto', 'none', 'required' or a function name; ValueError if it is not one."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("auto", "none", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        choice = tool_choice["function"]["name"]
        if choice not in [fn.get("name") for fn in functions(tools or [])]:
            raise ValueError(f"tool_choice names the function '{choice}', which is not in tools")
    else:
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    if choice != "none" and not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    return choice


def functions(tools: list[dict]) -> list[dict]:
    """The function definitions in OpenAI `tools` (entries that are none are left out)."""
    return [f for t in tools if isinstance(t, dict) and isinstance(f := t.get("function", t), dict)]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them (as llama.cpp hands them over): a tool call's arguments as an object
    rather than OpenAI's JSON string (templates iterate them or apply tojson), a tool result with the name of the
    function it answers, and an answer's reasoning_content also as `thinking` (what gpt-oss's template reads)."""
    names, out = {}, []
    for m in messages:
        if isinstance(m.get("reasoning_content"), str) and "thinking" not in m:
            m = {**m, "thinking": m["reasoning_content"]}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                if not isinstance(c.get("function"), dict):  # the template will say what it makes of it
                    calls.append(c)
                    continue
                fn = dict(c["function"])
                try:
                    args = json.loads(fn["arguments"]) if isinstance(fn.get("arguments"), str) else None
                except json.JSONDecodeError:
                    args = None  # the template gets it as it came
                if isinstance(args, dict):
                    fn["arguments"] = args
                if isinstance(c.get("id"), str):
                    names[c["id"]] = fn.get("name")
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        if m.get("role") == "tool" and "name" not in m and names.get(m.get("tool_call_id")):
            m = {**m, "name": names[m["tool_call_id"]]}
        out.append(m)
    return out


def enforce(choice: str, parallel: bool, calls: list[ToolCall]) -> list[ToolCall]:
    """The calls the response carries under tool_choice and parallel_tool_calls; ToolChoiceError if the output does
    not satisfy them."""
    if choice not in ("auto", "none", "required"):
        wrong = [c.name for c in calls if c.name != choice]
        if wrong or not calls:
            raise ToolChoiceError(f"tool_choice required a call to '{choice}' but the model "
                                  + (f"called '{wrong[0]}'" if wrong else "called no tool"))
    elif choice == "required" and not calls:
        raise ToolChoiceError("tool_choice 'required' but the model called no tool")
    return calls if parallel else calls[:1]


# -- the output ---------------------------------------------------------------------------------------------------


def parse(text: str, fmt: str, tools: list[dict], partial: bool) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer in format `fmt` (reasoning already taken out; harmony's messages are read one
    by one with harmony_call). With partial=True (more text may follow) the content stops where a call may be
    starting and only complete calls are returned. Text that looks like a call but does not parse (a call cut short
    included) stays in the content, as it came."""
    if fmt == "llama3":
        return _parse_llama3(text, partial)
    tags = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3-coder": ("<tool_call>", "</tool_call>"),
            "gemma4": ("<|tool_call>call:", "<tool_call|>")}[fmt]
    body_parser = {"hermes": _hermes_call, "qwen3-coder": lambda b: _xml_call(b, tools), "gemma4": _gemma4_call}[fmt]
    return _parse_tagged(text, tags, body_parser, partial)


def harmony_call(m: harmony.Message) -> ToolCall | None:
    """The call a harmony message makes, if it is one to a function and its arguments are complete JSON."""
    if not (m.recipient or "").startswith("functions."):
        return None
    return _json_call(m.recipient[len("functions."):], m.body)


def _parse_tagged(text: str, tags: tuple[str, str], body_parser, partial: bool) -> tuple[str, list[ToolCall]]:
    open_, close = tags
    content, calls, pos = "", [], 0
    while True:
        i = text.find(open_, pos)
        if i < 0:
            tail = text[pos:]
            content += tail[: len(tail) - partial_suffix(tail, [open_])] if partial else tail
            return content, calls
        content += text[pos:i]
        j = text.find(close, i)
        if j < 0 and partial:  # a call being written
            return content, calls
        end = len(text) if j < 0 else j + len(close)
        call = body_parser(text[i + len(open_): j if j >= 0 else len(text)])
        if call:
            calls.append(call)
        else:
            content += text[i:end]
        pos = end


def _json_call(name: str, args_text: str) -> ToolCall | None:
    try:
        args = json.loads(args_text)
    except json.JSONDecodeError:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False)) if name and isinstance(args, dict) else None


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string already
        return _json_call(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _xml_call(body: str, tools: list[dict]) -> ToolCall | None:
    fn = re.search(r"<function=([^>\s]+)>(.*?)</function>", body, re.S)
    if not fn:
        return None
    name = fn.group(1)
    schema = next((f.get("parameters") for f in functions(tools) if f.get("name") == name), None)
    props = schema.get("properties") if isinstance(schema, dict) else None
    args = {}
    for key, value in re.findall(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", fn.group(2), re.S):
        # values are bare text; a parameter the schema does not declare a string is read as JSON where it is JSON
        if isinstance(props, dict) and isinstance(props.get(key), dict) and props[key].get("type") == "string":
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _parse_llama3(text: str, partial: bool) -> tuple[str, list[ToolCall]]:
    tag = "<|python_tag|>"
    head = text.lstrip()
    if head.startswith(tag):
        head = head[len(tag):].lstrip()
    elif not head.startswith("{"):
        if partial and tag.startswith(head):  # nothing yet, or the tag being written
            return "", []
        return text, []
    if partial:  # a JSON answer is a call or not only once it is complete
        return "", []
    try:
        obj, end = json.JSONDecoder().raw_decode(head)
    except json.JSONDecodeError:
        return text, []
    call = _hermes_call(json.dumps(obj)) if isinstance(obj, dict) else None
    if call is None or head[end:].strip():
        return text, []
    return "", [call]


def _gemma4_call(body: str) -> ToolCall | None:
    """NAME{key:value,...}: Gemma 4's argument syntax is JSON-like, with <|"|> quoting strings and bare keys."""
    m = re.match(r"([\w.-]+)\{", body)
    if not m:
        return None
    try:
        args, end = _gemma4_value(body, m.end() - 1)
    except (ValueError, IndexError):
        return None
    return ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)) if not body[end:].strip() else None


def _gemma4_value(s: str, i: int):
    q = '<|"|>'
    while s[i].isspace():
        i += 1
    if s.startswith(q, i):
        j = s.index(q, i + len(q))
        return s[i + len(q): j], j + len(q)
    if s[i] in "{[":
        close, out = ("}", {}) if s[i] == "{" else ("]", [])
        i += 1
        while True:
            while s[i].isspace() or s[i] == ",":
                i += 1
            if s[i] == close:
                return out, i + 1
            if close == "}":
                colon = s.index(":", i)
                key = s[i:colon].strip()
                out[key], i = _gemma4_value(s, colon + 1)
            else:
                value, i = _gemma4_value(s, i)
                out.append(value)
    m = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null").match(s, i)
    if not m:
        raise ValueError(f"not a Gemma 4 value at {i}")
    return json.loads(m.group(0)), m.end()
