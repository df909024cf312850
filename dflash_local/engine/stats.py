"""Per-step statistics and the end-of-generation summary, as plain dataclasses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepStats:
    step: int
    n_drafted: int  # tokens the drafter proposed
    n_accepted: int  # of those, accepted by the target
    n_tokens: int  # tokens this step added to the output (accepted + the target's own, after stops)
    draft_ms: float  # drafter compute (noise block and feature injection)
    verify_ms: float  # target compute (the verify batch)
    other_ms: float  # everything else: sampling, bookkeeping, Python
    rollback_ms: float = 0.0  # dropping rejected drafts from the target: KV cut, or recurrent checkpoint + replay
    rollback: str = ""  # how: "" (nothing rejected), "kv", "snapshot" or "checkpoint" (docs/hybrid.md)
    ngram: bool = False  # the draft was an n-gram lookup's (ngram.py), not the drafter's

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.rollback_ms + self.other_ms


@dataclass
class Summary:
    finish_reason: str  # "eos", "stop" (a stop string), "length" (max_tokens) or "context_full"
    drafting: bool
    n_prompt: int
    n_cached: int  # prompt tokens reused from the previous generation's cache
    n_generated: int
    prompt_ms: float  # prefill, which also yields the first generated token
    steps: int
    draft_ms: float
    verify_ms: float
    other_ms: float
    rollback_ms: float
    n_rollbacks: int  # steps that dropped rejected drafts
    n_checkpoint_rollbacks: int  # of those, by recurrent checkpoint + replay
    n_drafted: int
    n_accepted: int
    accepted_at: list[int] = field(default_factory=list)  # per block position: drafts accepted there
    drafted_at: list[int] = field(default_factory=list)  # per block position: drafts proposed there
    ngram_steps: int = 0  # steps whose draft was an n-gram lookup's
    ngram_accepted: int = 0  # drafts of those steps the target accepted
    stop_word: str = ""  # the stop string that ended the output (finish_reason "stop")

    @property
    def decode_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.rollback_ms + self.other_ms

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens made by decode steps over their time (the first token comes with the prefill)."""
        n = max(self.n_generated - 1, 0)
        return n / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        n = self.n_prompt - self.n_cached
        return n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens gained per target verify (accepted drafts + the target's own token)."""
        return (self.n_accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> list[float]:
        """Per block position k (1-based draft index): accepted / proposed at k."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def other_fraction(self) -> float:
        return self.other_ms / self.decode_ms if self.decode_ms else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            decode_ms=self.decode_ms,
            tokens_per_second=self.tokens_per_second,
            prompt_tokens_per_second=self.prompt_tokens_per_second,
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            other_fraction=self.other_fraction,
        )
        return d


def pooled(summaries: list[Summary]) -> Summary:
    """Several generations' summaries as one: counts and times summed, per block position too."""
    def total(name):
        return sum(getattr(s, name) for s in summaries)

    return Summary(
        finish_reason="", drafting=any(s.drafting for s in summaries),
        **{f: total(f) for f in ("n_prompt", "n_cached", "n_generated", "prompt_ms", "steps", "draft_ms", "verify_ms",
                                 "other_ms", "rollback_ms", "n_rollbacks", "n_checkpoint_rollbacks", "n_drafted",
                                 "n_accepted", "ngram_steps", "ngram_accepted")},
        accepted_at=[sum(col) for col in zip(*(s.accepted_at for s in summaries))],
        drafted_at=[sum(col) for col in zip(*(s.drafted_at for s in summaries))],
    )


class StatsTracker:
    """Accumulates StepStats into a Summary."""

    def __init__(self, block_size: int):
        self.steps: list[StepStats] = []
        self.accepted_at = [0] * max(block_size - 1, 0)
        self.drafted_at = [0] * max(block_size - 1, 0)

    def add(self, s: StepStats) -> None:
        self.steps.append(s)
        for k in range(min(s.n_drafted, len(self.drafted_at))):
            self.drafted_at[k] += 1
            if k < s.n_accepted:
                self.accepted_at[k] += 1

    def summary(self, **kw) -> Summary:
        st = self.steps
        return Summary(
            steps=len(st),
            draft_ms=sum(s.draft_ms for s in st),
            verify_ms=sum(s.verify_ms for s in st),
            other_ms=sum(s.other_ms for s in st),
            rollback_ms=sum(s.rollback_ms for s in st),
            n_rollbacks=sum(1 for s in st if s.rollback),
            n_checkpoint_rollbacks=sum(1 for s in st if s.rollback == "checkpoint"),
            n_drafted=sum(s.n_drafted for s in st),
            n_accepted=sum(s.n_accepted for s in st),
            accepted_at=list(self.accepted_at),
            drafted_at=list(self.drafted_at),
            ngram_steps=sum(1 for s in st if s.ngram),
            ngram_accepted=sum(s.n_accepted for s in st if s.ngram),
            **kw,
        )
