"""The proposer chain: at each step the first proposer with a draft proposes it, as llama.cpp's
common/speculative.cpp tries its implementations in order (a repeat in the context first, it is free, then the drafter).

A proposer is a drafter (drafter.py: the n-gram lookup, the llama.cpp drafter, the PyTorch drafter, any function)
with its own draft-length policy (policy.py), which holds its statistics: the acceptance of its drafts by position
and the measured costs, from which it chooses how many tokens to draft. The policy belongs to the slot and carries
over from one generation to the next; the proposer binds it to this generation's drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

from .drafter import Drafter
from .policy import DraftPolicy


@dataclass
class Proposer:
    name: str  # "ngram" or "drafter": its policy's key in the slot
    drafter: Drafter
    policy: DraftPolicy

    def length(self, room: int) -> int:
        """How many tokens to ask the drafter for at this step (0: let the next proposer try)."""
        return min(self.policy.choose(), room)

    def cut(self, proposal: list[int], ratings: list[float] | None, draft_ms: float) -> list[int]:
        """The part of a rated proposal worth verifying (the whole of an unrated one)."""
        return proposal[: self.policy.cut(ratings, draft_ms)] if ratings else proposal

    def learn(self, proposed: bool, n_drafted: int, n_accepted: int, verify_ms: float, draft_ms: float,
              sample_ms: float, ratings: list[float] | None, head_ms: float, head_rows: int,
              beside: tuple[int, float]) -> None:
        """A step ended: its acceptance counts for the proposer that proposed, its timings for every one (a verify
        costs the same whoever drafted)."""
        if proposed:
            self.policy.update(n_drafted, n_accepted, verify_ms, draft_ms, sample_ms, ratings, head_ms=head_ms,
                               head_rows=head_rows, beside=beside)
        else:
            self.policy.observe(n_drafted, n_accepted, verify_ms, sample_ms, head_ms, head_rows, beside)
