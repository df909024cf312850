"""OpenAI-compatible HTTP server (`dflash-local serve`) over one engine, with DFlash drafting on by default."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import ContextOverflowError, Engine, Finished, TextDelta
from .metrics import Metrics
from .runner import QueueFullError, Runner
from .sampling import SamplingParams

KEEPALIVE_SECONDS = 10.0


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- request bodies: unknown fields are ignored, as OpenAI clients send many --------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None
    # passed to the chat template as they come, so that a conversation with tool calls renders whole
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = None  # rendered by the chat template; tool calls in the output are not parsed
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, over the server's defaults

    def template_kwargs(self) -> dict:
        return (self.chat_template_kwargs or {}) | ({"tools": self.tools} if self.tools else {})


class CompletionRequest(_Body):
    prompt: str | list[str]


# -- the app ------------------------------------------------------------------------------------------------------


class State:
    """What the app holds: the engine once loaded, or the loading error."""

    def __init__(self, alias: str, api_key: str | None, max_queue: int):
        self.alias = alias
        self.api_key = api_key
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self.runner: Runner | None = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.metrics = Metrics()
        self.created = int(time.time())


def create_app(load_engine: Callable[[], Engine], alias: str, api_key: str | None = None,
               max_queue: int = 32) -> FastAPI:
    state = State(alias, api_key, max_queue)

    async def lifespan(app):
        def load():
            try:
                state.engine = load_engine()
            except Exception as e:
                state.error = str(e)
            state.loaded.set()

        threading.Thread(target=load, name="dflash-load", daemon=True).start()
        yield

    app = FastAPI(title="dflash-local", version="0.1.0", lifespan=lifespan)
    app.state.dflash = state
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        msg = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        return error_response(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                              "invalid_request_error")

    def check_key(request: Request) -> None:
        if not state.api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not given or not secrets.compare_digest(given.encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def ready() -> Engine:
        if state.engine is None:
            if state.error:
                raise APIError(503, f"the model failed to load: {state.error}", "server_error")
            raise APIError(503, "the model is still loading", "server_error", code="model_loading",
                           headers={"Retry-After": "2"})
        if state.runner is None:
            state.runner = Runner(state.engine, state.max_queue)
        return state.engine

    def check_model(name: str | None) -> None:
        if name is not None and name not in model_names():
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.alias}'",
                           param="model", code="model_not_found")

    def model_names() -> set[str]:
        names = {state.alias}
        if state.engine is not None:
            names.add(state.engine.target_info.path.name)
        return names

    @app.get("/health")
    async def health():
        if state.engine is not None:
            return {"status": "ok"}
        if state.error:
            return JSONResponse({"status": "error", "error": state.error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        check_key(request)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        info = {"object": "model", "created": state.created, "owned_by": "dflash-local"}
        data = [{"id": state.alias, **info}]
        if state.engine is not None:
            data[0]["meta"] = state.engine.model_info()
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_key(request)
        check_model(body.model)
        engine = ready()
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        prompt_kw = {"messages": messages, "chat_template_kwargs": body.template_kwargs()}
        return await generate(engine, body, request, prompt_kw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_key(request)
        check_model(body.model)
        engine = ready()
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        return await generate(engine, body, request, {"prompt": prompt}, chat=False)

    async def generate(engine: Engine, body: _Body, request: Request, prompt_kw: dict, chat: bool):
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        try:
            ids = engine.prompt_tokens(**prompt_kw)
            SamplingParams(body.temperature, body.top_k, body.top_p, body.min_p, body.seed)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded")
        except ValueError as e:
            raise APIError(400, str(e))
        max_tokens = body.max_completion_tokens or body.max_tokens or engine.n_ctx - len(ids)
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        kwargs = dict(prompt_kw, max_tokens=max_tokens, stop=stop, temperature=body.temperature, top_k=body.top_k,
                      top_p=body.top_p, min_p=body.min_p, seed=body.seed)
        try:
            job = state.runner.submit(**kwargs)
        except QueueFullError as e:
            raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "5"})
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": state.alias}
        t0 = time.perf_counter()
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream(job, head, chat, usage, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(watch_disconnect(request, job))
        done = None
        try:
            while (ev := await job.next()) is not None:
                if isinstance(ev, Finished):
                    done = ev
        except ValueError as e:
            raise APIError(400, str(e))
        except Exception as e:
            raise APIError(500, f"generation failed: {e}", "server_error")
        finally:
            watcher.cancel()
        if done is None:  # the client went away; nobody reads this
            state.metrics.cancelled += 1
            return JSONResponse({}, status_code=499)
        state.metrics.add(done.summary, time.perf_counter() - t0)
        choice = {"index": 0, "finish_reason": finish_reason(done), "logprobs": None}
        if chat:
            head["object"] = "chat.completion"
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        return {**head, "choices": [choice], "usage": usage_of(done), "timings": timings_of(done)}

    async def stream(job, head, chat: bool, include_usage: bool, t0: float):
        def frame(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        finished = False
        try:
            if chat:
                yield frame({**head, "choices": [choice(None, None, first=True)]})
            while True:
                try:
                    ev = await job.next(timeout=KEEPALIVE_SECONDS)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                except Exception as e:  # the engine failed mid-stream: say so in-band, then end the stream
                    yield frame({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
                    break
                if ev is None:
                    break
                if isinstance(ev, TextDelta):
                    yield frame({**head, "choices": [choice(ev.text, None)]})
                elif isinstance(ev, Finished):
                    finished = True
                    state.metrics.add(ev.summary, time.perf_counter() - t0)
                    yield frame({**head, "choices": [choice(None, finish_reason(ev))], "timings": timings_of(ev)})
                    if include_usage:
                        yield frame({**head, "choices": [], "usage": usage_of(ev)})
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a client that went away stops its generation at the end of the current step
            if not finished:
                state.metrics.cancelled += 1

    async def watch_disconnect(request: Request, job) -> None:
        while not job.cancel.is_set():
            if await request.is_disconnected():
                job.cancel.set()
                return
            await asyncio.sleep(0.25)

    return app


def finish_reason(done: Finished) -> str:
    return "length" if done.summary.finish_reason in ("length", "context_full") else "stop"


def usage_of(done: Finished) -> dict:
    s = done.summary
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_generated, "total_tokens": s.n_prompt + s.n_generated}


def timings_of(done: Finished) -> dict:
    """llama-server's `timings` fields, plus the mean acceptance length."""
    s = done.summary
    n_eval = s.n_prompt - s.n_cached
    return {
        "prompt_n": n_eval,
        "prompt_ms": s.prompt_ms,
        "prompt_per_second": n_eval / (s.prompt_ms / 1000) if s.prompt_ms > 0 else 0.0,
        "predicted_n": s.n_generated,
        "predicted_ms": s.decode_ms,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.n_drafted,
        "draft_n_accepted": s.n_accepted,
        "mean_acceptance_length": s.mean_acceptance_length,
    }


def serve(args, load_engine: Callable[[], Engine], alias: str) -> int:
    import uvicorn

    app = create_app(load_engine, alias, args.api_key, args.max_queue)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    server = uvicorn.Server(config)
    state = app.state.dflash

    def stop_if_load_failed():
        state.loaded.wait()
        if state.error:
            print(f"dflash-local: error: {state.error}", file=sys.stderr)
            server.should_exit = True

    threading.Thread(target=stop_if_load_failed, daemon=True).start()
    print(f"dflash-local: serving '{alias}' on http://{args.host}:{args.port}/v1 (loading the model...)",
          file=sys.stderr)
    server.run()
    return 2 if state.error else 0
