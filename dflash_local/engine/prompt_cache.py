"""Which prefix of a slot's KV caches a new prompt reuses.

The native session keeps each slot's part of the target's KV cache, and of its llama.cpp drafter's, from one generation
to the next. A prompt that starts like the tokens cached (the next turn of a chat, a continuation) decodes only what
follows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptCache:
    slot: int = 0  # the session's slot whose caches this describes
    tokens: list[int] = field(default_factory=list)  # the tokens in the target's KV cache, in order
    n_captured: int = 0  # of those positions, how many were decoded with feature capture on (the session's drafter
    # holds their features)

    def shared(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the cache holds."""
        n, limit = 0, min(len(self.tokens), len(ids))
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        return n

    def reusable(self, ids: list[int], drafter=None, session=None) -> int:
        """How many leading tokens of the prompt `ids` can stay: the prefix shared with the cache, less at least one
        prompt token, whose logits give the first generated token; when drafting, only positions the drafters hold
        features of. A recurrent target's state exists only at the end of the cache and at its checkpoint; a
        sliding-window cache holds a full window from its reuse floor on, and at its checkpoint."""
        n = min(self.shared(ids), len(ids) - 1)
        if drafter is not None:
            n = min(n, self.n_captured, drafter.context())
        if session is None or n == session.past(self.slot):
            return n
        if session.recurrent or n < session.reuse_floor(self.slot):
            ckpt = session.checkpoint_at(self.slot)
            n = ckpt if 0 < ckpt <= n else 0
        return n

    def truncate(self, session, n: int) -> None:
        session.truncate(n, self.slot)
        del self.tokens[n:]
        self.n_captured = min(self.n_captured, n)

    def record(self, session, tokens: list[int], captured: bool) -> None:
        """The caches now hold `tokens` (prompt and generated) up to the session's position; `captured`: the
        positions past the reused prefix were decoded with feature capture on."""
        self.tokens = tokens[: session.past(self.slot)]
        if captured:
            self.n_captured = session.past(self.slot)

    def clear(self) -> None:
        """Forget the cached tokens (after driving the session by hand): the next generation starts afresh."""
        self.tokens, self.n_captured = [], 0
