"""The live figures of a chat session, fed by the engine's events; plain state, no UI.

Everything here runs on the UI thread: the generation worker only queues events (see app.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dflash_local.engine.stats import StatsTracker, StepStats, Summary

HISTORY = 240  # sparkline samples kept (one per decode step, over the whole session)
WINDOW = 8  # decode steps behind the "now" speed and each sparkline sample: one step alone is noisy


@dataclass
class Totals:
    """Decode tokens and time of every answer made in one mode (DFlash or plain) this session."""

    tokens: int = 0
    ms: float = 0.0
    answers: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / (self.ms / 1000) if self.ms > 0 else 0.0


@dataclass
class Live:
    drafting: bool = True  # the mode of the current (or last) answer
    tracker: StatsTracker = field(default_factory=lambda: StatsTracker(1))
    tokens: int = 0  # tokens of the current answer, the prefill's first token included
    decode_tokens: int = 0  # of those, made by decode steps (what tokens/s counts)
    decode_ms: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, ms) of the last steps
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # tokens/s samples for the sparkline
    summary: Summary | None = None  # of the last finished answer
    prompt_tps: float | None = None
    prompt_new: int = 0  # prompt tokens processed (not reused from the cache) by the last answer
    dflash: Totals = field(default_factory=Totals)
    plain: Totals = field(default_factory=Totals)

    def start(self, drafting: bool, block_size: int) -> None:
        """A new answer begins; the session totals and the sparkline carry on."""
        self.drafting = drafting
        self.tracker = StatsTracker(max(block_size, 2) if drafting else 1)  # as the engine sizes its own
        self.tokens = self.decode_tokens = 0
        self.decode_ms = 0.0
        self.recent.clear()
        self.summary = None
        (self.dflash if drafting else self.plain).answers += 1

    def first_text(self) -> None:
        """Text arrived: the first comes from the prefill's token, before any step, so count that token."""
        self.tokens = max(self.tokens, 1)

    def step(self, s: StepStats) -> None:
        self.tracker.add(s)
        # the prefill's token counts even when it made no text (half a UTF-8 character, say)
        self.tokens = max(self.tokens, 1) + s.n_tokens
        self.decode_tokens += s.n_tokens
        self.decode_ms += s.step_ms
        totals = self.dflash if self.drafting else self.plain
        totals.tokens += s.n_tokens
        totals.ms += s.step_ms
        self.recent.append((s.n_tokens, s.step_ms))
        self.history.append(self.now_tps)

    def finish(self, summary: Summary) -> None:
        self.summary = summary
        self.tokens = summary.n_generated  # the engine's own count is the truth
        self.prompt_tps = summary.prompt_tokens_per_second
        self.prompt_new = summary.n_prompt - summary.n_cached

    # -- figures --------------------------------------------------------------------------------------------------

    @property
    def now_tps(self) -> float:
        ms = sum(m for _, m in self.recent)
        return sum(n for n, _ in self.recent) / (ms / 1000) if ms > 0 else 0.0

    @property
    def avg_tps(self) -> float:
        if self.summary is not None:
            return self.summary.tokens_per_second
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    @property
    def steps(self) -> int:
        return len(self.tracker.steps)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens gained per target verify (accepted drafts + the target's own token)."""
        n = self.steps
        return (sum(s.n_accepted for s in self.tracker.steps) + n) / n if n else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Acceptance rate per draft position (1-based), this answer."""
        t = self.tracker
        return [a / d if d else 0.0 for a, d in zip(t.accepted_at, t.drafted_at)]

    @property
    def draft_ms(self) -> float:
        """Per step, this answer."""
        return sum(s.draft_ms for s in self.tracker.steps) / self.steps if self.steps else 0.0

    @property
    def verify_ms(self) -> float:
        return sum(s.verify_ms for s in self.tracker.steps) / self.steps if self.steps else 0.0

    @property
    def other_ms(self) -> float:
        return sum(s.other_ms for s in self.tracker.steps) / self.steps if self.steps else 0.0

    @property
    def speedup(self) -> float | None:
        """DFlash over plain decoding, decode tokens/s over all answers of each mode this session."""
        if self.dflash.ms > 0 and self.plain.ms > 0 and self.plain.tokens > 0:
            return self.dflash.tokens_per_second / self.plain.tokens_per_second
        return None
