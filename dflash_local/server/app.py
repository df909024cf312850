"""OpenAI-compatible HTTP server (`dflash-local serve`) over one engine, with DFlash drafting on by default.

The routes are thin: bodies are read by body.py, the wire format is schema.py, errors errors.py, streaming stream.py,
and runner.py runs the requests in the engine's slots (`-np`), the others waiting in its queue.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePath

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from ..chat import output as chat_output
from .body import body_limit, read_body
from .errors import APIError, error_response, install_error_handlers
from . import anthropic, native, responses
from .anthropic import MessagesRequest
from .responses import ResponsesRequest
from .logprobs import logprobs_body
from .native import InfillRequest, NativeRequest
from .schema import ChatRequest, CompletionRequest, GenerationRequest, completion_body, response_head
from .props import model_card, props, slots
from .stream import sse_events
from .tokens import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from ..engine.engine import Engine, Generation
from .metrics import Metrics
from .jobs import event_stream, submit, wait
from .runner import Runner
from ..chat.tool_calls import ToolChoiceError

# the cap on tokens for a request that sets no max_tokens (`serve -n`): long answers fit, and a model that never stops
# does not run on to the end of the context (docs/server.md)
N_PREDICT = 2048
PAGE = Path(__file__).with_name("page.html")
# llama-server's --timeout: seconds a client may leave its stream unread before its generation is cancelled
TIMEOUT = 600.0
# an absolute path in a message (a load error names the file): clients are shown its file name only
_PATH = re.compile(r"(?<![\w.~-])(?:/[^\s'\"/]+)+")


def file_names(text: str | None) -> str | None:
    return _PATH.sub(lambda m: PurePath(m.group()).name, text) if text else text


class State:
    """What the app holds (the engine once loaded, or the loading error), and the checks every request goes through."""

    def __init__(self, alias: str, api_key: str | None, max_queue: int, n_predict: int,
                 reasoning_format: str = "auto", timeout: float = TIMEOUT):
        self.alias = alias
        self.timeout = timeout
        self.reasoning_format = reasoning_format
        self.api_key = api_key
        self.max_queue = max_queue
        self.n_predict = n_predict
        self.engine: Engine | None = None
        self.runner: Runner | None = None
        self.error: str | None = None
        self.drafter_error: str | None = None  # the drafter failed to load: serving the target without it
        self.shown_error: str | None = None  # the error, as clients see it
        self.loaded = threading.Event()
        self.metrics = Metrics()
        self.created = int(time.time())

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not given or not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def ready(self) -> Engine:
        if self.engine is None:
            if self.error:
                raise APIError(503, f"the model failed to load: {self.shown_error}", "server_error")
            raise APIError(503, "the model is still loading", "server_error", code="model_loading",
                           headers={"Retry-After": "2"})
        if self.runner is None:
            self.runner = Runner(self.engine, self.max_queue, self.timeout)
        return self.engine

    async def read(self, request: Request, model):
        """A request's checks and its body: the key first, then the engine loaded, then the body (bounded by what a
        prompt filling the context can take) as `model`, then its model name."""
        self.check_key(request)
        engine = self.ready()
        body = await read_body(request, model, body_limit(engine.n_ctx, engine.longest_token), engine.n_ctx)
        self.check_model(getattr(body, "model", None))
        return engine, body

    def check_model(self, name: str | None) -> None:
        """A model name must be the alias or the target's file name."""
        names = {self.alias} | ({self.engine.target_info.path.name} if self.engine is not None else set())
        if name is not None and name not in names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.alias}'",
                           param="model", code="model_not_found")



class OriginCheck:
    """A request from a web page (its Origin header) is served only if that page is the server's own or one allowed
    with --cors-origin: otherwise any page the user visits could drive the server (a POST of text/plain needs no
    CORS preflight)."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, set(allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            own = origin.partition("://")[2] == headers.get(b"host", b"").decode("latin-1")
            if origin and not own and origin not in self.allowed and "*" not in self.allowed:
                await error_response(403, f"requests from the web page at {origin} are not allowed (start the server "
                                          f"with --cors-origin {origin} to allow them)", "permission_error",
                                     code="origin_not_allowed")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def openapi_body(model) -> dict:
    """A route's request body in the OpenAPI document (routes read their bodies themselves: body.py)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(load_engine: Callable[[], Engine], alias: str, api_key: str | None = None,
               max_queue: int = 32, n_predict: int = N_PREDICT, reasoning_format: str = "auto",
               load_without_drafter: Callable[[], Engine] | None = None, timeout: float = TIMEOUT,
               cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """load_without_drafter: when load_engine fails and this loads, the fault was the drafter's: the server stays up
    and serves the target with plain decoding (and n-gram drafts if asked), saying so in its log, /health and /props.
    timeout: seconds a client may leave its stream unread; cors_origins: web pages (origins) allowed besides the
    server's own ("*": any)."""
    state = State(alias, api_key, max_queue, n_predict, reasoning_format, timeout)

    async def lifespan(app):
        def load():
            try:
                state.engine = load_engine()
            except Exception as e:
                state.error = str(e)
            if state.engine is None and load_without_drafter is not None:
                try:
                    state.engine = load_without_drafter()
                except Exception:
                    pass  # the target itself fails: its first error says why
                else:
                    state.drafter_error, state.error = state.error, None
                    print(f"dflash-local: warning: the drafter failed to load: {state.drafter_error}; serving "
                          f"'{alias}' without it", file=sys.stderr)
            # clients see file names, the log above the whole paths
            state.drafter_error, state.shown_error = file_names(state.drafter_error), file_names(state.error)
            state.loaded.set()

        threading.Thread(target=load, name="dflash-load", daemon=True).start()
        yield
        if state.runner is not None:  # the streams still open end after the round in flight
            state.runner.close()

    # no /docs or /redoc (pages that fetch scripts from elsewhere); /openapi.json below, behind the key
    app = FastAPI(title="dflash-local", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.dflash = state
    install_error_handlers(app)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(OriginCheck, allowed=tuple(cors_origins))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        state.check_key(request)
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, NativeRequest,
                      InfillRequest, MessagesRequest, ResponsesRequest):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        return doc

    @app.get("/", include_in_schema=False)
    async def page():  # the chat page; it asks for the key itself when one is set
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if state.engine is not None:
            return {"status": "ok"} | ({"drafter_error": state.drafter_error} if state.drafter_error else {})
        if state.error:
            return JSONResponse({"status": "error", "error": state.shown_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        state.check_key(request)
        runner = state.runner
        gauges = {"slots_processing": runner.busy, "requests_waiting": runner.waiting} if runner else {}
        counters = {"interrupted_rounds_total": runner.interrupted} if runner else {}
        return PlainTextResponse(state.metrics.render(gauges, counters), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        state.check_key(request)
        return {"object": "list", "data": [model_card(state.alias, state.created, state.engine)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        state.check_key(request)
        state.check_model(name)
        return model_card(state.alias, state.created, state.engine)

    @app.get("/props")
    async def get_props(request: Request):
        state.check_key(request)
        body = props(state.ready(), state.alias, state.n_predict)
        body["speculative"]["drafter_error"] = state.drafter_error
        return body

    @app.get("/slots")
    async def get_slots(request: Request, fail_on_no_slot: bool = False):
        state.check_key(request)
        engine = state.ready()
        tasks = state.runner.slots
        if fail_on_no_slot and all(t is not None and t.processing for t in tasks):
            raise APIError(503, "no slot available", "unavailable_error")
        return slots(engine, tasks)

    # each route's work on the prompt (templates, tokenizing, a grammar's loading) runs off the event loop, so that
    # other clients and /health are answered meanwhile
    @app.post("/apply-template", openapi_extra=openapi_body(ChatRequest))
    async def apply_template(request: Request):
        engine, body = await state.read(request, ChatRequest)
        try:
            return {"prompt": await asyncio.to_thread(engine.chat_prompt, **body.prompt_kwargs())}
        except ValueError as e:  # the template refused the messages or the variables
            raise APIError(400, str(e), param="messages")

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def post_tokenize(request: Request):
        engine, body = await state.read(request, TokenizeRequest)
        return await asyncio.to_thread(tokenize, engine, body)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def post_detokenize(request: Request):
        engine, body = await state.read(request, DetokenizeRequest)
        return await asyncio.to_thread(detokenize, engine, body)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    @app.post("/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat(request: Request):
        engine, body = await state.read(request, ChatRequest)
        generation, syntax = await asyncio.to_thread(prepare_chat, state, engine, body)
        return await respond(state, engine, body, request, generation, syntax)

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    @app.post("/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def create_response(request: Request):
        engine, body = await state.read(request, ResponsesRequest)
        chat = body.chat()
        generation, syntax = await asyncio.to_thread(prepare_chat, state, engine, chat)
        job = submit(state.runner, generation)
        head, t0 = responses.Head(body, state.alias), time.perf_counter()
        if chat.stream:
            return event_stream(responses.events(job, syntax, head, state.metrics, t0))
        done, message = await whole(state, request, job, syntax, t0)
        return responses.response_body(head, done, message) if done else JSONResponse({}, status_code=499)

    @app.post("/v1/messages", openapi_extra=openapi_body(MessagesRequest))
    async def messages(request: Request):
        try:
            engine, body = await state.read(request, MessagesRequest)
            chat = body.chat()
            generation, syntax = await asyncio.to_thread(prepare_chat, state, engine, chat)
            job = submit(state.runner, generation)
            t0 = time.perf_counter()
            if chat.stream:
                return event_stream(anthropic.events(job, syntax, state.alias, len(generation.ids), state.metrics,
                                                     t0))
            done, message = await whole(state, request, job, syntax, t0)
            return anthropic.message_body(done, message, state.alias) if done else JSONResponse({}, status_code=499)
        except APIError as e:
            return anthropic.error_response(e)

    @app.post("/v1/messages/count_tokens", openapi_extra=openapi_body(MessagesRequest))
    async def count_tokens(request: Request):
        try:
            engine, body = await state.read(request, MessagesRequest)
            chat = body.chat()
            try:
                ids = await asyncio.to_thread(engine.prompt_tokens, **chat.prompt_kwargs())
            except ValueError as e:
                raise APIError(400, str(e), param="messages")
            return {"input_tokens": len(ids)}
        except APIError as e:
            return anthropic.error_response(e)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        engine, body = await state.read(request, CompletionRequest)
        generation = await asyncio.to_thread(body.prepare, engine, body.prompt_kwargs(), "prompt", state.n_predict)
        return await respond(state, engine, body, request, generation, None)

    @app.post("/completion", openapi_extra=openapi_body(NativeRequest))
    @app.post("/completions", openapi_extra=openapi_body(NativeRequest))
    async def completion(request: Request):
        engine, body = await state.read(request, NativeRequest)
        return await respond_native(state, engine, body, request, body.prompt_kwargs()["prompt"], "prompt")

    @app.post("/infill", openapi_extra=openapi_body(InfillRequest))
    async def infill(request: Request):
        engine, body = await state.read(request, InfillRequest)
        ids = await asyncio.to_thread(body.infill_ids, engine, engine.placement.n_batch)
        return await respond_native(state, engine, body, request, ids, "input_prefix")

    return app


def prepare_chat(state: State, engine: Engine, body: ChatRequest):
    """A chat request's generation, and how its output is read (reasoning, tool calls)."""
    generation = body.prepare(engine, body.prompt_kwargs(), "messages", state.n_predict)
    syntax = body.output_syntax(engine, generation.prompt_text, state.reasoning_format)
    generation.shown = engine.token_set(syntax.preserved)  # the format's control tokens, shown to its parser
    return generation, syntax


async def respond_native(state: State, engine: Engine, body: NativeRequest, request: Request, prompt: list,
                         prompt_param: str):
    """llama-server's /completion and /infill: the prompt (token ids and text mixed) generated on, answered in its
    native shapes."""
    generation = await asyncio.to_thread(body.prepare, engine, {"prompt": prompt}, prompt_param, state.n_predict)
    job = submit(state.runner, generation, body.id_slot)
    t0 = time.perf_counter()
    if body.stream:
        return event_stream(native.chunks(job, engine, body, state.metrics, t0, state.alias, generation.ids,
                                          state.n_predict))
    done, _ = await whole(state, request, job, None, t0)
    if done is None:
        return JSONResponse({}, status_code=499)
    return native.completion_body(engine, body, done, job.slot, state.alias, generation.ids, state.n_predict)


async def respond(state: State, engine: Engine, body: GenerationRequest, request: Request,
                  generation: Generation, syntax: chat_output.Syntax | None):
    """Queue the prepared generation; stream its chunks, or wait for it and answer with the whole completion.
    `syntax` reads a chat completion's output (None for a text completion)."""
    chat = syntax is not None
    job = submit(state.runner, generation, body.id_slot)
    head = response_head(chat, state.alias)
    t0 = time.perf_counter()
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        stream = chat_output.Stream(syntax) if chat else None
        return event_stream(sse_events(job, head, stream, usage, state.metrics, t0, engine, body.timings_per_token))
    done, message = await whole(state, request, job, syntax, t0)
    if done is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    return completion_body(head, done, message, logprobs_body(engine, done.logprobs, chat))


async def whole(state: State, request: Request, job, syntax: chat_output.Syntax | None, t0: float):
    """A generation waited for whole, and its chat message read by `syntax` (None: a text completion); (None, None) if
    the client went away."""
    done = await wait(job, request, state.metrics, t0)
    if done is None or syntax is None:
        return done, None
    try:
        return done, chat_output.finish(syntax, done.text)
    except ToolChoiceError as e:
        raise APIError(500, str(e), "server_error", code="tool_choice_not_met")


def idle_timeout_protocol():
    """uvicorn's HTTP protocol, with its keep-alive timeout (5 s) from the moment a connection opens: uvicorn starts it
    only after a response, so a connection that never sent a request stayed open for good."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Protocol(AutoHTTPProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    return Protocol


def serve(args, load_engine: Callable[[], Engine], alias: str,
          load_without_drafter: Callable[[], Engine] | None = None) -> int:
    import uvicorn

    n_predict = N_PREDICT if args.n_predict is None else args.n_predict
    app = create_app(load_engine, alias, args.api_key, args.max_queue, n_predict, args.reasoning_format,
                     load_without_drafter, args.timeout, tuple(args.cors_origin))
    state = app.state.dflash

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C or SIGTERM: the generations in flight end at their next step, and their streams with them (as
            # llama-server stops at once), rather than uvicorn waiting for each to its end
            if state.runner is not None:
                state.runner.close(wait=False)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            timeout_graceful_shutdown=10,  # past a step's time: a backstop
                            http=idle_timeout_protocol())
    server = Server(config)

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
