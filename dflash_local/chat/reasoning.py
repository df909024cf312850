"""A thinking model's reasoning, apart from its answer (llama-server's `--reasoning-format deepseek`).

The reasoning is a block at the start of the output between a start and an end tag: `<think>...</think>` (Qwen3,
DeepSeek-R1 and most others) or `<|channel>thought...<channel|>` (Gemma 4). Templates that open the block in the
generation prompt (Qwen3.5's `<|im_start|>assistant\\n<think>\\n`) make the output start inside it. gpt-oss's harmony
channels are read in harmony.py. Format `none` leaves the output as it came.
"""

from __future__ import annotations

from .textstream import partial_suffix

# auto: deepseek wherever the output has a reasoning block, as llama-server; deepseek-legacy: reasoning_content, and
# the reasoning also left in the content as it came
FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
THINK = ("<think>", "</think>")
GEMMA4_THOUGHT = ("<|channel>thought", "<channel|>")
# the control tokens each block's tags are made of: the output must show them as text to be read
MARKERS = {THINK: THINK, GEMMA4_THOUGHT: ("<|channel>", "<channel|>")}


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(FORMATS)}, not {name!r}")
    return name


def budget_kwargs(budget: int | None) -> dict:
    """Chat template variables for a reasoning budget (--reasoning-budget, a request's reasoning_budget_tokens):
    -1 (or none) leaves thinking to the template and the model; 0 turns it off with enable_thinking=false, which
    the templates of thinking models read. llama-server's N > 0 cuts thinking after N tokens by forcing the end tag
    into the sampled tokens; dflash-local does not force tokens, so it refuses that."""
    if budget is None or budget == -1:
        return {}
    if budget == 0:
        return {"enable_thinking": False}
    raise ValueError(f"reasoning budget {budget} is not supported: use -1 (unrestricted) or 0 (no thinking)")


def tags_for(template: str | None) -> tuple[str, str]:
    """The reasoning block's tags for a chat template's model."""
    return GEMMA4_THOUGHT if template and "<|channel>" in template else THINK


def opened_in_prompt(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether the prompt ends inside an open reasoning block (so the output starts in it)."""
    return prompt.rstrip().endswith(tags[0])


def split(text: str, tags: tuple[str, str], inside: bool, partial: bool) -> tuple[str, str]:
    """(reasoning, answer) of the output `text`; `inside`: the output starts inside the reasoning block.

    With partial=True (the output goes on), both parts are what is safe to show now: nothing that could still turn
    out to be a tag, and no trailing blanks of the reasoning (trimmed in the end). A block never closed (the output
    was cut short) is all reasoning.
    """
    start, end = tags
    if not inside:
        head = text.lstrip()
        if head.startswith(start):
            text = head[len(start):]
        elif partial and start.startswith(head):  # nothing yet, or the start tag being written
            return "", ""
        else:
            return "", text
    j = text.find(end)
    if j < 0:
        return (text[: len(text) - partial_suffix(text, [end])] if partial else text).strip(), ""
    return text[:j].strip(), text[j + len(end):].lstrip()
