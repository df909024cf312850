"""Server-sent events: one generation streamed as OpenAI chunks, with comment keep-alives while it waits its turn."""

from __future__ import annotations

import asyncio
import json
import time

from .logprobs import logprobs_body
from .schema import chunk_choice, finish_reason, timings_of, usage_of
from ..chat.output import Stream
from ..engine.engine import Engine, Finished, TextDelta
from .metrics import Metrics
from .runner import Job
from ..chat.tool_calls import ToolChoiceError

KEEPALIVE_SECONDS = 10.0


def frame(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_events(job: Job, head: dict, stream: Stream | None, include_usage: bool, metrics: Metrics, t0: float,
                     engine: Engine):
    """The events of a chat completion (read by `stream`: reasoning, content and tool call deltas) or, with stream
    None, of a text completion."""
    chat = stream is not None
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
                if not chat:
                    if logprobs:
                        n_text = sum(map(len, logprobs["tokens"]), n_text)
                    yield frame({**head, "choices": [chunk_choice(chat, ev.text, None, logprobs=logprobs)]})
                    continue
                # nothing while the text may still be the start of a marker; the step's logprobs go with the
                # first delta it gives, or alone
                deltas = stream.feed(ev.text) if ev.text else []
                for i, delta in enumerate(deltas or ([{}] if logprobs else [])):
                    yield frame({**head, "choices": [chunk_choice(chat, None, None, delta=delta,
                                                                  logprobs=logprobs if i == 0 else None)]})
            elif isinstance(ev, Finished):
                finished = True
                metrics.add(ev.summary, time.perf_counter() - t0, job.slot)
                if chat:
                    try:
                        deltas = stream.close()
                    except ToolChoiceError as e:  # the output does not meet the request's tool_choice
                        yield frame({"error": {"message": str(e), "type": "server_error", "param": None,
                                               "code": "tool_choice_not_met"}})
                        break
                    for delta in deltas:
                        yield frame({**head, "choices": [chunk_choice(chat, None, None, delta=delta)]})
                finish = finish_reason(ev, stream.sent if chat else None)
                yield frame({**head, "choices": [chunk_choice(chat, None, finish)], "timings": timings_of(ev)})
                if include_usage:
                    yield frame({**head, "choices": [], "usage": usage_of(ev)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a client that went away stops its generation at the end of the current step
        if not finished:
            metrics.cancelled += 1
