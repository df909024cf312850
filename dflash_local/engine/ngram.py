"""N-gram drafts: the tokens that followed the last time the context's newest n tokens appeared in it.

llama.cpp's `ngram-simple` speculative type, with its flag names (`--spec-ngram-simple-size-n/-m`). It needs no
model: text that repeats (code being edited, quoted documents, the loops small models fall into under greedy
decoding) is drafted for the cost of a dictionary lookup, and the target verifies it like any draft, so the output
is the same. The engine tries it before the DFlash drafter at each step; its own DraftPolicy decides how much of a
found draft is worth verifying (policy.py), so text that does not repeat costs nothing but the lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from .drafter import Drafter


@dataclass(frozen=True)
class NgramSpec:
    # tokens matched: the context's newest n tokens. 8, not upstream's 12: more repeats found, each verified as
    # far as its policy allows (docs/measurements.md, "The n-gram lookup's size")
    size_n: int = 8
    size_m: int = 48  # tokens drafted at most: those that followed the match

    def __post_init__(self):
        if self.size_n < 1 or self.size_m < 1:
            raise ValueError(f"n-gram sizes must be at least 1, got n={self.size_n}, m={self.size_m}")


class NgramDrafter(Drafter):
    """A proposer like the DFlash drafters, needing no context of features. One generation's lookup table: for every
    n-gram of the tokens so far, where it last ended. The tokens only grow during a generation, so each call indexes
    just the new positions."""

    def __init__(self, spec: NgramSpec):
        self.n, self.m = spec.size_n, spec.size_m
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to min(k, m) tokens that followed the most recent earlier occurrence of tokens' last n tokens, the
        loop they make continued where they reach the newest token."""
        n, end = self.n, len(tokens) - 1
        # index the n-grams that end before the newest token: each has a next token to draft
        for e in range(max(self.indexed, n - 1), end):
            self.last_end[tuple(tokens[e - n + 1 : e + 1])] = e
        self.indexed = max(self.indexed, end)
        if end < n - 1 or k < 1:
            return []
        e = self.last_end.get(tuple(tokens[end - n + 1 :]))
        if e is None:
            return []
        want = min(k, self.m)
        out = tokens[e + 1 : e + 1 + want]
        # a continuation that runs into the context's end is a loop of end - e tokens: it goes on (upstream's
        # ngram-simple stops there, so a model repeating one token would be drafted one token a step)
        while len(out) < want:
            out.append(out[len(out) - (end - e)])
        return out
