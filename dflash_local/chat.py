"""Turn chat messages into a prompt string.

The GGUF's own `tokenizer.chat_template` (Jinja) is used when present. Files without one (the gemma-3-270m GGUF is
one) fall back to the documented turn format of their architecture family; other architectures need a template.
"""

from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

GEMMA_ARCHS = {"gemma", "gemma2", "gemma3", "gemma3n", "gemma4"}
CHATML_ARCHS = {"qwen2", "qwen3", "qwen3moe"}


class ChatTemplateError(ValueError):
    pass


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


def render(messages: list[dict], template: str | None, arch: str, bos: str = "", eos: str = "") -> str:
    _check(messages)
    if template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ChatTemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(
                messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from e
    if arch in GEMMA_ARCHS:
        return gemma_prompt(messages)
    if arch in CHATML_ARCHS:
        return chatml_prompt(messages)
    raise ChatTemplateError(
        f"this '{arch}' model has no chat template in its GGUF; use a plain prompt instead of chat messages"
    )
