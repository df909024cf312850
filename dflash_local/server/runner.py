"""Runs engine generations one at a time, in a worker thread, for asyncio callers (the server).

Requests wait in a bounded FIFO queue; the running one is never interrupted by others. A caller that goes away sets
its job's cancel flag, and the worker stops at the end of the current native step and frees the engine.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from ..engine.engine import Engine, Finished, Generation
from ..engine.stats import StepStats


class QueueFullError(RuntimeError):
    pass


_DONE = object()


class Job:
    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    async def next(self, timeout: float | None = None):
        """The next engine event; None at the end; raises what the engine raised; TimeoutError on timeout."""
        ev = await asyncio.wait_for(self.events.get(), timeout)
        if ev is _DONE:
            return None
        if isinstance(ev, BaseException):
            raise ev
        return ev


@dataclass
class Slot:
    """The engine's one generation slot as GET /slots shows it: the running task, or the last one once it is done.
    The worker thread updates the counts; the server reads them."""

    id_task: int
    n_prompt: int
    max_tokens: int
    n_decoded: int = 0
    n_cached: int = 0  # prompt tokens reused from the previous generation's cache (known once it finishes)
    processing: bool = True


class Runner:
    def __init__(self, engine: Engine, max_queue: int = 32):
        self.engine = engine
        self.max_queue = max_queue
        self.waiting = 0
        self.tasks = 0  # generations started, the last one's id
        self.slot: Slot | None = None  # None until the first generation starts
        self._lock = asyncio.Lock()  # asyncio.Lock wakes waiters in FIFO order

    def submit(self, generation: Generation) -> Job:
        # while the engine is free, one of the waiting jobs is about to start (its task has not run yet): it does
        # not count against the queue
        if self.waiting >= self.max_queue + (0 if self._lock.locked() else 1):
            raise QueueFullError(f"{self.waiting} requests are already waiting")
        job = Job()
        self.waiting += 1
        asyncio.get_running_loop().create_task(self._run(job, generation))
        return job

    async def _run(self, job: Job, generation: Generation) -> None:
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        if job.cancel.is_set():  # gave up while waiting
            self._lock.release()
            job.events.put_nowait(_DONE)
            return
        loop = asyncio.get_running_loop()
        self.tasks += 1
        slot = self.slot = Slot(self.tasks, len(generation.ids), generation.max_tokens)

        def put(ev):
            loop.call_soon_threadsafe(job.events.put_nowait, ev)

        def work():
            try:
                gen = self.engine.run(generation)
                try:
                    for ev in gen:
                        if isinstance(ev, StepStats):  # the prefill's token, then what each step added
                            slot.n_decoded = max(slot.n_decoded, 1) + ev.n_tokens
                        elif isinstance(ev, Finished):
                            slot.n_decoded, slot.n_cached = len(ev.token_ids), ev.summary.n_cached
                        put(ev)
                        if job.cancel.is_set():
                            break
                finally:
                    gen.close()
            except Exception as e:  # reported to the caller, who turns it into an HTTP error
                put(e)
            finally:
                slot.processing = False
                put(_DONE)
                # the engine is free only now: the next request starts after this one has really stopped
                loop.call_soon_threadsafe(self._lock.release)

        threading.Thread(target=work, name="dflash-generate", daemon=True).start()
