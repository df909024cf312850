"""Server-sent events: one generation streamed as OpenAI chunks, with comment keep-alives while it waits its turn."""

from __future__ import annotations

import asyncio
import json
import time

from .api_logprobs import logprobs_body
from .api_models import chunk_choice, finish_reason, timings_of, usage_of
from .engine import Engine, Finished, TextDelta
from .metrics import Metrics
from .runner import Job

KEEPALIVE_SECONDS = 10.0


def frame(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_events(job: Job, head: dict, chat: bool, include_usage: bool, metrics: Metrics, t0: float,
                     engine: Engine):
    finished = False
    n_text = 0  # characters of tokens streamed so far, for completions' text_offset
    try:
        if chat:
            yield frame({**head, "choices": [chunk_choice(chat, None, None, first=True)]})
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
                logprobs = logprobs_body(engine, ev.logprobs, chat, n_text)
                if logprobs and not chat:
                    n_text = sum(map(len, logprobs["tokens"]), n_text)
                yield frame({**head, "choices": [chunk_choice(chat, ev.text, None, logprobs=logprobs)]})
            elif isinstance(ev, Finished):
                finished = True
                metrics.add(ev.summary, time.perf_counter() - t0)
                yield frame({**head, "choices": [chunk_choice(chat, None, finish_reason(ev))],
                             "timings": timings_of(ev)})
                if include_usage:
                    yield frame({**head, "choices": [], "usage": usage_of(ev)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a client that went away stops its generation at the end of the current step
        if not finished:
            metrics.cancelled += 1
