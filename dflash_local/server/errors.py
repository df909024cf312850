"""OpenAI-style errors: every failure a client sees is {"error": {"message", "type", "param", "code"}}, in JSON,
with `param` the request field at fault."""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _is_field(part) -> bool:
    """A location part that names a field or an index, not one of pydantic's type tags ('str', 'dict[str,float]',
    'function-after[...]', 'literal[...]')."""
    return isinstance(part, int) or not (part in _TAGS or "[" in part)


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def param_of(loc) -> str | None:
    """OpenAI's `param` for a pydantic error location: fields and indexes, as messages.0.content."""
    parts = [str(p) for p in loc if p != "body" and _is_field(p)]
    return ".".join(parts) or None


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    err = e.errors()[0] if e.errors() else {}
    param = param_of(err.get("loc", ()))
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix for our checks
    return APIError(400, f"{param + ': ' if param else ''}{msg}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):  # query parameters (bodies are read by body.py)
        e = validation_error(e)
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                              "invalid_request_error")

    app.add_middleware(CatchAll)


class CatchAll:
    """A bug of ours is a JSON 500 (and a traceback in the log), and the connection stays usable: Starlette's own
    handler answers and then re-raises, and uvicorn closes the connection under the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started or scope["type"] != "http":
                raise
            traceback.print_exception(e, file=sys.stderr)
            await error_response(500, f"internal error: {type(e).__name__}", "server_error")(scope, receive, send)
