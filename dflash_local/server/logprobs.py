"""Log-probabilities in OpenAI's shapes (chat's `logprobs.content`, completions' `logprobs` lists) and llama-server's
(`completion_probabilities`)."""

from __future__ import annotations

from ..engine.engine import Engine


def _token(engine: Engine, tok: int, logprob: float) -> dict:
    b = engine.target.piece(tok)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(engine: Engine, entries: list) -> dict:
    content = [{**_token(engine, e.token, e.logprob),
                "top_logprobs": [_token(engine, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def native_logprobs(engine: Engine, entries: list) -> list[dict]:
    """llama-server's completion_probabilities: each token's id, text, bytes and logprob, and its top tokens'."""
    def one(tok: int, logprob: float) -> dict:
        return {"id": tok, **_token(engine, tok, logprob)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(engine: Engine, entries: list, offset: int = 0) -> dict:
    """`offset`: the length of the text before these tokens (text_offset counts from the start of the output)."""
    def text(tok: int) -> str:
        return engine.target.piece(tok).decode("utf-8", errors="replace")

    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(text(e.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def logprobs_body(engine: Engine, entries: list | None, chat: bool, offset: int = 0) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(engine, entries) if chat else completion_logprobs(engine, entries, offset)
