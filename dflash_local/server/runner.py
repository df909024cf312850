"""Runs engine generations in the engine's slots, in a worker thread, for asyncio callers (the server).

A request takes a free slot (the one whose cached tokens share the longest prefix with its prompt, as llama-server
picks one) or waits in a bounded FIFO queue. The worker runs rounds: every running generation goes on to its next step
(or through one slice of its prompt: a whole batch when nothing else runs, else about as long as the others' step, so
a long prompt does not stop their streams); the slots' drafts from the engine's drafter are made together
(Engine.draft_many: one drafter decode for the blocks of one length), then all their steps run in one target decode
(Engine.step_many). A request that arrives while others stream starts at the next round instead of after they end, and
each slot's output is that of the request run alone (engine.py). On a CPU a round's decode can take longer than a
prompt (8 rows of 4 slots, 0.15-0.2 s for gemma-3-270m on 2 cores): a request that a free slot can take, and whose
prompt fits in one slice, interrupts it if it has only begun (Engine.interrupt), its prompt goes first, and the round
runs again. A caller that goes away sets its job's cancel flag, and so does a caller that leaves its events unread for
`timeout` seconds (a client that stopped reading its stream: its socket's buffers are full); the worker stops that
generation before its next step and frees the slot. A request may ask for a slot (llama-server's id_slot): it waits
for that one, letting others by. When the last generation ends and nobody waits, the worker gives the memory of the
burst's batches back (Engine.trim). close() stops the worker after its round in flight (at the server's shutdown, and
at the interpreter's exit): a thread still inside llama.cpp when Python finalizes would take the process down with it.
"""

from __future__ import annotations

import asyncio
import atexit
import statistics
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from ..engine.engine import DraftRequest, Engine, Finished, Generation, Interrupted, Prefilled, StepRequest
from ..engine.stats import StepStats


# prompt tokens a prefilling slot decodes per round at least while others stream: at a long prompt's depth one token
# alone costs more than their step (its decode reads the whole KV cache), and slices of a few tokens halve their gaps
# but make the prompt several times slower (docs/measurements.md, 2026-12-07)
MIN_SLICE = 16


class QueueFullError(RuntimeError):
    pass


class ClosedError(RuntimeError):
    pass


_DONE = object()


class Job:
    def __init__(self, generation: Generation, id_slot: int = -1):
        self.generation = generation
        self.id_slot = id_slot  # the slot asked for (llama-server's id_slot), -1: any
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self.slot: int | None = None  # the slot it runs in, once it starts
        # whether its caller is reading: a stream whose client stopped reading waits on the socket, not on next()
        self.reading = False
        self.last_read = time.monotonic()
        self.unread = 0

    def put(self, ev) -> None:
        """From the worker thread: hand an event to the caller's event loop."""
        self.unread += 1
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is left to read it
            pass

    def stalled(self, timeout: float) -> bool:
        """Events have waited for the caller, who has not come to read them for `timeout` seconds."""
        return self.unread > 0 and not self.reading and time.monotonic() - self.last_read > timeout

    async def next(self, timeout: float | None = None):
        """The next engine event; None at the end; raises what the engine raised; TimeoutError on timeout."""
        self.reading = True
        try:
            ev = await asyncio.wait_for(self.events.get(), timeout)
        finally:
            self.reading, self.last_read = False, time.monotonic()
        self.unread -= 1
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
    def __init__(self, engine: Engine, max_queue: int = 32, timeout: float = 600.0):
        """timeout: seconds a caller may leave its events unread (a client that stopped reading its stream) before
        its generation is cancelled and its slot freed."""
        self.engine = engine
        self.max_queue = max_queue
        self.timeout = timeout
        self.tasks = 0  # generations started, the last one's id
        self.slots: list[Task | None] = [None] * len(engine.slots)  # None until the slot's first generation
        self._waiting: deque[Job] = deque()
        self._running: dict[int, tuple[Job, object]] = {}  # slot -> (job, its engine generator)
        self._results: dict[int, object] = {}  # slot -> its last step's result (or error), for its generator
        self._again: list[StepRequest] = []  # the steps of an interrupted round, to run in the next one
        self.interrupted = 0  # rounds interrupted so far (/metrics)
        self._last_used = [0] * len(engine.slots)
        self._step_ms: deque[float] = deque(maxlen=9)  # the streams' last decodes (drafts and step)
        self._slice = float(MIN_SLICE)  # prompt tokens per round beside streams, resized by each slice's time
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> int:
        """Slots running a generation."""
        return len(self._running)

    def submit(self, generation: Generation, id_slot: int = -1) -> Job:
        """Queue a generation, for the slot id_slot (-1: the best free one)."""
        if not -1 <= id_slot < len(self.slots):
            raise ValueError(f"id_slot {id_slot} is not a slot: this server has {len(self.slots)} (0..."
                             f"{len(self.slots) - 1}), or -1 for any")
        job = Job(generation, id_slot)
        with self._cv:
            if self._closed:
                raise ClosedError("the server is shutting down")
            # jobs a free slot is about to take do not count against the queue
            free = len(self.slots) - len(self._running)
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            if self._short(job):  # a slot can take it now and decode its prompt in one slice: it goes first
                self.engine.interrupt()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="dflash-generate", daemon=True)
                self._worker.start()
                me = weakref.ref(self)  # the exit hook must not keep the runner (and its engine) alive
                atexit.register(lambda: (runner := me()) is not None and runner.close())
            self._cv.notify()
        return job

    def close(self, wait: bool = True) -> None:
        """Stop the worker once its round in flight ends: every running or waiting generation ends there (its caller
        gets the end of its events), and no request is taken after. wait: until the worker has stopped."""
        with self._cv:
            self._closed = True
            for job, _ in self._running.values():
                job.cancel.set()
            for job in self._waiting:
                job.cancel.set()
            self.engine.interrupt()  # a decode that has only begun is given up
            self._cv.notify()
        if wait and self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()

    def _free_for(self, job: Job) -> list[int]:
        """The free slots the job may take."""
        free = [i for i in range(len(self.slots)) if i not in self._running]
        return free if job.id_slot < 0 else [i for i in free if i == job.id_slot]

    def _pick_slot(self, job: Job) -> int:
        """The slot asked for, or else the free slot whose cache shares most with the prompt; among equals, the
        least recently used."""
        free = self._free_for(job)
        ids = job.generation.ids
        return max(free, key=lambda i: (self.engine.slots[i].cache.shared(ids), -self._last_used[i]))

    def _start(self, job: Job) -> None:
        slot = job.slot = self._pick_slot(job)
        self.tasks += 1
        self._last_used[slot] = self.tasks
        g = job.generation
        self.slots[slot] = Task(self.tasks, len(g.ids), g.max_tokens)
        try:
            self._running[slot] = (job, self.engine.generation(g, slot))
        except Exception as e:  # the worker goes on; the caller gets the error
            self.slots[slot].processing = False
            job.put(e)
            job.put(_DONE)

    def _end(self, slot: int) -> None:
        with self._cv:
            job, gen = self._running.pop(slot)
            self._results.pop(slot, None)
        try:
            gen.close()  # a generation stopped early records its slot's cache here
        except Exception as e:
            job.put(e)
        self.slots[slot].processing = False
        job.put(_DONE)

    def _admit(self) -> list[int]:
        """Start waiting requests in free slots; their slots."""
        started = []
        with self._cv:
            self.engine.interrupt(False)  # whoever asked is being let in
            while True:
                # the first waiting job a free slot can take (one waiting for a busy slot lets the others by)
                job = next((j for j in self._waiting if j.cancel.is_set() or self._free_for(j)), None)
                if job is None:
                    break
                self._waiting.remove(job)
                if job.cancel.is_set():  # gave up while waiting
                    job.put(_DONE)
                    continue
                self._start(job)
                if job.slot in self._running:
                    started.append(job.slot)
        return started

    def _work(self) -> None:
        ran = False  # generations ran since the engine was last trimmed
        while True:
            with self._cv:
                idle = not self._waiting and not self._running
            if idle and ran and not self._closed:  # the memory of the last burst's batches goes back before waiting
                self.engine.trim()
                ran = False
            with self._cv:
                while not self._waiting and not self._running and not self._closed:
                    self._cv.wait()
                if self._closed:
                    for job in self._waiting:
                        job.put(_DONE)
                    self._waiting.clear()
            if self._closed and not self._running:
                self.engine.interrupt(False)
                return
            ran = True
            self._round()

    def _round(self) -> None:
        """One round (a call of its own: nothing of it, such as a request's sampler, outlives it while the worker
        waits)."""
        # each running generation goes on to its next step, or through one slice of its prompt (a request that
        # arrives meanwhile starts before the next slot's turn), the drafts they ask the drafter for are made
        # together, then the steps of all of them run in one target decode
        # an interrupted round's steps run again, but not those of a generation cancelled meanwhile: it ends below
        requests, self._again = [q for q in self._again if not self._running[q.slot][0].cancel.is_set()], []
        turned = {q.slot for q in requests}
        drafts = []
        streaming = any(self._decoding(k) for k in self._running)
        self.engine.prefill_chunk = self._prompt_slice() if streaming else None
        while True:
            fresh = self._admit()
            slot = next((k for k in fresh + list(self._running) if k not in turned), None)
            if slot is None:
                break
            turned.add(slot)
            before, t0 = self.slots[slot].n_prompt_done, time.perf_counter()
            prefilling = not self._decoding(slot)
            q = self._advance(slot)
            if streaming and prefilling and self.slots[slot].n_prompt_done > before:
                self._resize_slice(self.slots[slot].n_prompt_done - before, (time.perf_counter() - t0) * 1000)
            (drafts if isinstance(q, DraftRequest) else requests).append(q)
        t0 = time.perf_counter()
        while drafts:
            try:
                results = self.engine.draft_many(drafts)
            except Exception as e:  # every generation that asked gets the error
                results = [e] * len(drafts)
            again = []
            for q, r in zip(drafts, results):
                self._results[q.slot] = r
                step = self._advance(q.slot)
                (again if isinstance(step, DraftRequest) else requests).append(step)
            drafts = again
        requests = [q for q in requests if q is not None]
        if not requests:
            return
        try:
            results = self.engine.step_many(requests)
        except Interrupted:
            self.interrupted += 1
            self._again = [q for q in requests if q.slot in self._running]
            return
        except Exception as e:  # every generation of the batch gets the error
            for q in requests:
                self._results[q.slot] = e
            return
        for q, r in zip(requests, results):
            self._results[q.slot] = r
        self._step_ms.append((time.perf_counter() - t0) * 1000)

    def _decoding(self, slot: int) -> bool:
        """The slot's generation is past its prompt."""
        task = self.slots[slot]
        return slot in self._running and task.n_prompt_done >= task.n_prompt

    def _prompt_slice(self) -> int:
        """Prompt tokens a prefilling slot decodes in a round while others stream: as many as take about as long as
        their usual step (the median of their last ones: a step that verified a long draft must not size it), so that
        their gap between tokens stays about twice the usual (issue #37); MIN_SLICE tokens at least."""
        return round(self._slice)

    def _resize_slice(self, n: int, ms: float) -> None:
        """A slice of n prompt tokens took ms: the next one is as many tokens as the streams' usual step would take
        at that rate. A prompt token costs more as its context grows, and a slice that also fed the drafter a batch
        of features costs more than its tokens: the size at most halves or doubles at a time."""
        if self._step_ms:
            self._slice = max(MIN_SLICE, n * min(2.0, max(0.5, statistics.median(self._step_ms) / ms)))

    def _short(self, job: Job) -> bool:
        """A free slot can take the job and what its cache lacks of the prompt fits in one slice. Only then is the
        round in flight given up for it: a long prompt goes a slice per round anyway, and giving up a round would
        add to the streams' gap."""
        if not self._free_for(job):
            return False
        ids = job.generation.ids
        return len(ids) - self.engine.slots[self._pick_slot(job)].cache.shared(ids) <= self._prompt_slice()

    def _advance(self, slot: int) -> StepRequest | DraftRequest | None:
        """Run the slot's generation up to its next step or draft (handing its events to the caller), or through one
        batch of its prompt; its StepRequest or DraftRequest, or None."""
        job, gen = self._running[slot]
        result = self._results.pop(slot, None)
        while True:
            if job.stalled(self.timeout):  # its client stopped reading: the slot goes to someone who reads
                job.cancel.set()
            if job.cancel.is_set():
                self._end(slot)
                return None
            try:
                ev = gen.throw(result) if isinstance(result, Exception) else gen.send(result)
            except StopIteration:
                self._end(slot)
                return None
            except Exception as e:  # reported to the caller, who turns it into an HTTP error
                job.put(e)
                self._end(slot)
                return None
            result = None
            if isinstance(ev, (StepRequest, DraftRequest)):
                return ev
            task = self.slots[slot]
            if isinstance(ev, Prefilled):
                task.n_prompt_done = ev.n_done
                return None
            task.n_prompt_done = task.n_prompt
            if isinstance(ev, StepStats):  # the prefill's token, then what each step added
                task.n_decoded = max(task.n_decoded, 1) + ev.n_tokens
            elif isinstance(ev, Finished):
                task.n_decoded, task.n_cached = len(ev.token_ids), ev.summary.n_cached
            job.put(ev)
