"""OpenAI-style errors: every failure a client sees is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # its loc is a character position, not a parameter
            where = err.get("loc", ())[-1]
            reason = (err.get("ctx") or {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {reason} at character {where}")
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix for our checks
        return error_response(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                              "invalid_request_error")
