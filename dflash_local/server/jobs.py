"""A prepared generation's way through the server, the same for every endpoint: submitted to the runner (its errors
as HTTP errors), then either waited for whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.engine import Finished, Generation
from .errors import APIError
from .metrics import Metrics
from .runner import ClosedError, Job, QueueFullError, Runner


def submit(runner: Runner, generation: Generation, id_slot: int = -1) -> Job:
    try:
        return runner.submit(generation, id_slot)
    except ValueError as e:
        raise APIError(400, str(e), param="id_slot")
    except QueueFullError as e:
        raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "5"})
    except ClosedError as e:
        raise APIError(503, str(e), "unavailable_error", code="shutting_down")


async def wait(job: Job, request: Request, metrics: Metrics, t0: float) -> Finished | None:
    """The whole generation, counted in the metrics; None if the client went away meanwhile (its generation stopped)."""
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
    if done is None:
        metrics.cancelled += 1
        return None
    metrics.add(done.summary, time.perf_counter() - t0, job.slot)
    return done


async def watch_disconnect(request: Request, job: Job) -> None:
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(0.25)


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
