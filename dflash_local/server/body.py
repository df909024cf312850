"""A request body, read as llama-server reads it: JSON whatever its content type (`curl -d` sends
application/x-www-form-urlencoded), bounded in size before it is read, parsed and validated off the event loop (a
megabytes-long body would stall every other client meanwhile), its strings whole Unicode, its fields strictly typed.
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import APIError, validation_error

# a \uD800-\uDFFF escape: a lone one decodes to a string no UTF-8 encoder takes
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def body_limit(n_ctx: int, longest_token: int) -> int:
    """The largest body a request can need: a prompt that fills the context, every character escaped in JSON as
    \\uXXXX (6 bytes), and a megabyte for the rest (tools, schemas)."""
    return 6 * n_ctx * longest_token + (1 << 20)


async def read_body(request: Request, model: type[BaseModel], limit: int, max_messages: int | None = None):
    """The request's body as `model`; APIError (413 past `limit` bytes, 400 otherwise) naming what is wrong."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise _too_large(int(size), limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _too_large(n, limit)
        chunks.append(chunk)
    return await asyncio.to_thread(parse_body, b"".join(chunks), model, max_messages)


def _too_large(n: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {n} bytes or more, over this server's limit of {limit} (the most a "
                         f"prompt filling the context can take)", code="request_too_large")


def parse_body(raw: bytes, model: type[BaseModel], max_messages: int | None = None):
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at character {e.pos}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate(data)
        if where is not None:
            raise APIError(400, f"{where or 'the body'}: invalid Unicode (a lone surrogate)", param=where or None)
    messages = data.get("messages")
    if max_messages is not None and isinstance(messages, list) and len(messages) > max_messages:
        raise APIError(400, f"{len(messages)} messages cannot fit the context of {max_messages} tokens",
                       param="messages", code="context_length_exceeded")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise validation_error(e) from None


def lone_surrogate(value, path: str = "") -> str | None:
    """The path (as `param` names fields: messages.0.content) of a string or key holding a lone surrogate, or
    None."""
    todo = [(value, path)]
    while todo:
        v, p = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, x in v.items():
                k = str(k).encode("utf-8", "backslashreplace").decode()  # a path the error can print
                sub = f"{p}.{k}" if p else k
                todo.append((k, sub))
                todo.append((x, sub))
        elif isinstance(v, list):
            todo.extend((x, f"{p}.{i}" if p else str(i)) for i, x in enumerate(v))
    return None
