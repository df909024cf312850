"""Runs engine generations in the engine's slots, in a worker thread, for asyncio callers (the server).

A request takes a free slot (the one whose cached tokens share the longest prefix with its prompt, as llama-server
picks one) or waits in a bounded FIFO queue. The worker advances every running generation by one engine step (or one
batch of its prompt) in turn, so a request that arrives while others stream starts at the next step instead of after
they end, and each
slot's output is that of the request run alone (engine.py). A caller that goes away sets its job's cancel flag; the
worker stops that generation before its next step and frees the slot.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

from ..engine.engine import Engine, Finished, Generation, Prefilled
from ..engine.stats import StepStats


class QueueFullError(RuntimeError):
    pass


_DONE = object()


class Job:
    def __init__(self, generation: Generation):
        self.generation = generation
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self.slot: int | None = None  # the slot it runs in, once it starts

    def put(self, ev) -> None:
        """From the worker thread: hand an event to the caller's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)

    async def next(self, timeout: float | None = None):
        """The next engine event; None at the end; raises what the engine raised; TimeoutError on timeout."""
        ev = await asyncio.wait_for(self.events.get(), timeout)
        if ev is _DONE:
            return None
        if isinstance(ev, BaseException):
            raise ev
        return ev


@dataclass
class Task:
    """A slot's running task, or its last one once done, as GET /slots shows it. The worker thread updates the
    counts; the server reads them."""

    id_task: int
    n_prompt: int
    max_tokens: int
    n_decoded: int = 0
    n_prompt_done: int = 0  # prompt tokens in the cache so far (a long prompt is decoded a batch per turn)
    n_cached: int = 0  # prompt tokens reused from the slot's previous generation (known once it finishes)
    processing: bool = True


class Runner:
    def __init__(self, engine: Engine, max_queue: int = 32):
        self.engine = engine
        self.max_queue = max_queue
        self.tasks = 0  # generations started, the last one's id
        self.slots: list[Task | None] = [None] * len(engine.slots)  # None until the slot's first generation
        self._waiting: deque[Job] = deque()
        self._running: dict[int, tuple[Job, object]] = {}  # slot -> (job, its engine generator)
        self._last_used = [0] * len(engine.slots)
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> int:
        """Slots running a generation."""
        return len(self._running)

    def submit(self, generation: Generation) -> Job:
        job = Job(generation)
        with self._cv:
            # jobs a free slot is about to take do not count against the queue
            free = len(self.slots) - len(self._running)
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="dflash-generate", daemon=True)
                self._worker.start()
            self._cv.notify()
        return job

    def _pick_slot(self, job: Job) -> int:
        """The free slot whose cache shares most with the prompt; among equals, the least recently used."""
        free = [i for i in range(len(self.slots)) if i not in self._running]
        ids = job.generation.ids
        return max(free, key=lambda i: (self.engine.slots[i].cache.shared(ids), -self._last_used[i]))

    def _start(self, job: Job) -> None:
        slot = job.slot = self._pick_slot(job)
        self.tasks += 1
        self._last_used[slot] = self.tasks
        g = job.generation
        self.slots[slot] = Task(self.tasks, len(g.ids), g.max_tokens)
        try:
            self._running[slot] = (job, self.engine.run(g, slot))
        except Exception as e:  # the worker goes on; the caller gets the error
            self.slots[slot].processing = False
            job.put(e)
            job.put(_DONE)

    def _end(self, slot: int) -> None:
        with self._cv:
            job, gen = self._running.pop(slot)
        try:
            gen.close()  # a generation stopped early records its slot's cache here
        except Exception as e:
            job.put(e)
        self.slots[slot].processing = False
        job.put(_DONE)

    def _work(self) -> None:
        turns: deque[int] = deque()  # running slots, the next to take a turn first
        while True:
            with self._cv:
                while not self._waiting and not self._running:
                    self._cv.wait()
                while self._waiting and len(self._running) < len(self.slots):
                    job = self._waiting.popleft()
                    if job.cancel.is_set():  # gave up while waiting
                        job.put(_DONE)
                        continue
                    self._start(job)
                    if job.slot in self._running:
                        # its prompt goes first: its first token waits for the step running now at most
                        turns.appendleft(job.slot)
            if not turns:
                continue
            slot = turns.popleft()
            if self._turn(slot):
                turns.append(slot)

    def _turn(self, slot: int) -> bool:
        """One event of the slot's generation (an engine step, or a batch of its prompt, at most); whether it runs
        on."""
        job, gen = self._running[slot]
        if job.cancel.is_set():
            self._end(slot)
            return False
        try:
            ev = next(gen)
        except StopIteration:
            self._end(slot)
            return False
        except Exception as e:  # reported to the caller, who turns it into an HTTP error
            job.put(e)
            self._end(slot)
            return False
        task = self.slots[slot]
        if isinstance(ev, Prefilled):
            task.n_prompt_done = ev.n_done
            return True
        task.n_prompt_done = task.n_prompt
        if isinstance(ev, StepStats):  # the prefill's token, then what each step added
            task.n_decoded = max(task.n_decoded, 1) + ev.n_tokens
        elif isinstance(ev, Finished):
            task.n_decoded, task.n_cached = len(ev.token_ids), ev.summary.n_cached
        job.put(ev)
        return True
