"""Turn chat messages into a prompt string.

The chat template is the GGUF's `tokenizer.chat_template` (Jinja), or one given with --chat-template-file. It runs in
the environment HF transformers and llama.cpp give chat templates: `raise_exception`, `strftime_now`, loop controls
(`{% break %}`, `{% continue %}`), `tojson` with json.dumps' arguments, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, plus `tools` and any extra ones (`enable_thinking`, ...) the caller
passes. Files without a template (the gemma-3-270m GGUF is one) fall back to the documented turn format of their
architecture family; other architectures need a template.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

GEMMA_ARCHS = {"gemma", "gemma2", "gemma3", "gemma3n", "gemma4"}
CHATML_ARCHS = {"qwen2", "qwen3", "qwen3moe"}


class ChatTemplateError(ValueError):
    pass


def raise_exception(message) -> None:
    # templates use it to refuse conversations they cannot render (roles out of order, a bad content type, ...)
    raise ChatTemplateError("the chat template refused the messages: " + " ".join(str(message).split()))


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # as HF's: jinja's own tojson escapes <, >, & and ' for HTML and takes only `indent`
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = tojson
_ENV.globals["raise_exception"] = raise_exception
_ENV.globals["strftime_now"] = strftime_now


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The compiled template and the names of the variables it reads."""
    try:
        ast = _ENV.parse(source)
        return _ENV.from_string(ast), frozenset(jinja2.meta.find_undeclared_variables(ast))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template has a syntax error on line {e.lineno}: {e.message}") from None


def read_template(path: str | Path) -> str:
    """A chat template file's text, checked to compile."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        compile_template(source)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{path}: {e}") from None
    return source


def _check(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError("each message needs a string 'role' and a string 'content'")


def gemma_prompt(messages: list[dict]) -> str:
    """Gemma's turn format: user/model turns; a system message is prepended to the first user turn."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    out = []
    for m in messages:
        if m["role"] == "system":
            continue
        role = "model" if m["role"] == "assistant" else "user"
        content = m["content"]
        if system and role == "user":
            content, system = f"{system}\n\n{content}", ""
        out.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    return "<bos>" + "".join(out) + "<start_of_turn>model\n"


def chatml_prompt(messages: list[dict]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def render(messages: list[dict], template: str | None, arch: str, bos: str = "", eos: str = "",
           variables: dict | None = None) -> str:
    """The prompt for `messages`. `variables` are extra template variables: `tools` and chat_template_kwargs."""
    _check(messages)
    variables = variables or {}
    if "messages" in variables:
        raise ChatTemplateError("chat template variables cannot replace 'messages'")
    if template:
        compiled, reads = compile_template(template)
        if variables.get("tools") and "tools" not in reads:
            raise ChatTemplateError("the chat template does not render tools; give one that does "
                                    "(--chat-template-file) or send the request without tools")
        context = {"add_generation_prompt": True, "bos_token": bos, "eos_token": eos, **variables}
        try:
            return compiled.render(messages=messages, **context)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is a program: any error in it is the template's, not the server's
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    if variables.get("tools"):
        raise ChatTemplateError(f"this '{arch}' model has no chat template to render tools; give one with "
                                f"--chat-template-file")
    if arch in GEMMA_ARCHS:
        return gemma_prompt(messages)
    if arch in CHATML_ARCHS:
        return chatml_prompt(messages)
    raise ChatTemplateError(
        f"this '{arch}' model has no chat template in its GGUF; give one with --chat-template-file, or use a plain "
        f"prompt instead of chat messages"
    )
