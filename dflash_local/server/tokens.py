"""llama-server's POST /tokenize and POST /detokenize, on the target's vocabulary."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .errors import APIError
from ..engine.engine import Engine


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: str | list[str | int]  # text, or text pieces and token ids mixed
    add_special: bool = False  # BOS where the model wants one
    parse_special: bool = True  # control tokens written as text become those tokens
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]


def check_ids(engine: Engine, ids: list[int], param: str) -> None:
    # llama.cpp does not check token ids: one out of range must not reach it
    bad = [t for t in ids if not 0 <= t < engine.target.n_vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is not in the vocabulary (0..{engine.target.n_vocab - 1})",
                       param=param)


def piece(engine: Engine, token: int) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (part of a character), as llama-server gives it."""
    raw = engine.target.piece(token, True)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize(engine: Engine, body: TokenizeRequest) -> dict:
    parts = [body.content] if isinstance(body.content, str) else body.content
    check_ids(engine, [p for p in parts if isinstance(p, int)], "content")
    ids: list[int] = []
    for i, part in enumerate(parts):
        # as llama-server: only the first part may get the BOS
        ids += [part] if isinstance(part, int) else engine.target.tokenize(part, body.add_special and i == 0,
                                                                           body.parse_special)
    if body.with_pieces:
        return {"tokens": [{"id": t, "piece": piece(engine, t)} for t in ids]}
    return {"tokens": ids}


def detokenize(engine: Engine, body: DetokenizeRequest) -> dict:
    check_ids(engine, body.tokens, "tokens")
    text = b"".join(engine.target.piece(t, True) for t in body.tokens).decode("utf-8", errors="replace")
    return {"content": text}
