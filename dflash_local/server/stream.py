"""Streamed generations: job_events reads one job's events for every dialect's stream (OpenAI's chunks here, llama-
server's native chunks in native.py, Anthropic's and the Responses API's events in their modules), with keep-alives
while it waits its turn and the running timings llama-server's timings_per_token asks for."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

from .logprobs import logprobs_body
from .schema import chunk_choice, finish_reason, timings_of, usage_of
from ..chat.output import Stream
from ..engine.engine import Engine, Finished, TextDelta
from ..engine.stats import StepStats
from .metrics import Metrics
from .runner import Job
from ..chat.tool_calls import ToolChoiceError

KEEPALIVE_SECONDS = 10.0
KEEPALIVE = object()  # what job_events yields while nothing happens


class Running:
    """The timings so far of a streamed generation (llama-server's timings_per_token), from its step events."""

    def __init__(self):
        self.t_first: float | None = None
        self.n, self.steps, self.drafted, self.accepted = 0, 0, 0, 0

    def add(self, ev) -> None:
        if isinstance(ev, TextDelta) and self.t_first is None:  # the prefill's token
            self.t_first, self.n = time.perf_counter(), 1
        elif isinstance(ev, StepStats):
            self.n += ev.n_tokens
            self.steps += 1
            self.drafted += ev.n_drafted
            self.accepted += ev.n_accepted

    def timings(self) -> dict:
        ms = (time.perf_counter() - self.t_first) * 1000 if self.t_first is not None else 0.0
        return {"predicted_n": self.n, "predicted_ms": ms,
                "predicted_per_second": (self.n - 1) / (ms / 1000) if ms > 0 and self.n > 1 else 0.0,
                "draft_n": self.drafted, "draft_n_accepted": self.accepted,
                "mean_acceptance_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0}


async def job_events(job: Job, metrics: Metrics, t0: float):
    """A job's TextDelta and StepStats events and, last, its Finished (counted in the metrics); KEEPALIVE while it
    waits; an engine error raised as it comes. The generation stops when the consumer does (a client gone)."""
    finished = False
    try:
        while True:
            try:
                ev = await job.next(timeout=KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
            if ev is None:
                return
            if isinstance(ev, Finished):
                finished = True
                metrics.add(ev.summary, time.perf_counter() - t0, job.slot)
            yield ev
    finally:
        job.cancel.set()  # a client that went away stops its generation at the end of the current step
        if not finished:
            metrics.cancelled += 1


def frame(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def error_frame(message: str, code: str | None = None) -> str:
    return frame({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


async def sse_events(job: Job, head: dict, stream: Stream | None, include_usage: bool, metrics: Metrics, t0: float,
                     engine: Engine, per_token: bool = False):
    """The events of a chat completion (read by `stream`: reasoning, content and tool call deltas) or, with stream
    None, of a text completion. per_token: each chunk carries the timings so far."""
    chat = stream is not None
    n_text = 0  # characters of tokens streamed so far, for completions' text_offset
    running = Running()

    def chunk(choice: dict) -> str:
        return frame({**head, "choices": [choice]} | ({"timings": running.timings()} if per_token else {}))

    if chat:
        yield frame({**head, "choices": [chunk_choice(chat, None, None, first=True)]})
    try:
        async with aclosing(job_events(job, metrics, t0)) as events:
            async for ev in events:
                running.add(ev)
                if ev is KEEPALIVE:
                    yield ": keep-alive\n\n"
                elif isinstance(ev, TextDelta):
                    logprobs = logprobs_body(engine, ev.logprobs, chat, n_text)
                    if not chat:
                        if logprobs:
                            n_text = sum(map(len, logprobs["tokens"]), n_text)
                        yield chunk(chunk_choice(chat, ev.text, None, logprobs=logprobs))
                        continue
                    # nothing while the text may still be the start of a marker; the step's logprobs go with the
                    # first delta it gives, or alone
                    deltas = stream.feed(ev.text) if ev.text else []
                    for i, delta in enumerate(deltas or ([{}] if logprobs else [])):
                        yield chunk(chunk_choice(chat, None, None, delta=delta,
                                                 logprobs=logprobs if i == 0 else None))
                elif isinstance(ev, Finished):
                    if chat:
                        try:
                            deltas = stream.close()
                        except ToolChoiceError as e:  # the output does not meet the request's tool_choice
                            yield error_frame(str(e), "tool_choice_not_met")
                            break
                        for delta in deltas:
                            yield chunk(chunk_choice(chat, None, None, delta=delta))
                    finish = finish_reason(ev, stream.sent if chat else None)
                    yield frame({**head, "choices": [chunk_choice(chat, None, finish)], "timings": timings_of(ev)})
                    if include_usage:
                        yield frame({**head, "choices": [], "usage": usage_of(ev)})
    except Exception as e:  # the engine failed mid-stream: say so in-band, then end the stream
        yield error_frame(str(e))
    yield "data: [DONE]\n\n"
