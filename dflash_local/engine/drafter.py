"""Drafters: what proposes the tokens the target verifies at each step.

A drafter answers draft(tokens, k): up to k tokens it expects after `tokens` (the prompt and everything generated so
far, the newest last). A DFlash drafter reads the target's features and keeps them as its context, one entry per
position of the target's KV cache: the engine crops that context when the cache is cut back and extends it with the
positions each prefill chunk and each step decode.

It is implemented by the llama.cpp drafter inside the native session (NativeDrafter), the PyTorch drafter
(torch_drafter.TorchDraftBackend), any function of (tokens, k) (FunctionDrafter), and the tests' scripted drafter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class Drafter:
    """The interface, with the context methods of a drafter that needs nothing from the target."""

    samples = False  # it drafts from a distribution draft_sampled() can draw from (rejection sampling)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def draft_rated(self, tokens: list[int], k: int) -> tuple[list[int], list[float] | None]:
        """draft(), and the drafter's own estimate that each token is accepted where it gives one for free (a
        DSpark confidence head, DFlash2's selector path), else None: the policy cuts the draft with it."""
        return self.draft(tokens, k), None

    def draft_sampled(self, tokens: list[int], k: int, sampler, index: int) -> list[int]:
        """k tokens drawn from the drafter's distribution (sampler's temperature, generated token number index on),
        which a rejection-sampling step then verifies against: only where `samples`."""
        raise NotImplementedError(f"{type(self).__name__} has no distribution to draw drafts from")

    def drafted_with(self, session) -> bool:
        """Whether its greedy drafts come from the drafter of `session`, which the engine's driver runs for several
        slots in one decode (Engine.draft_many)."""
        return False

    def context(self) -> int:
        """How many positions of the target's cache this drafter holds the features of (a prefix reused from the
        previous generation can be no longer)."""
        return sys.maxsize

    def crop(self, n: int) -> None:
        """The target's cache was cut back to its first n positions."""

    def extend(self, session, pos0: int, n: int) -> None:
        """The target just decoded positions pos0 .. pos0 + n - 1: their features are rows 0 .. n - 1 of
        session.features()."""

    def for_slot(self, slot: int) -> Drafter:
        """The drafter for a generation in the session's slot `slot` (engine.py): itself, unless it keeps a context
        per sequence of the target's cache."""
        return self


class FunctionDrafter(Drafter):
    def __init__(self, fn: Callable[[list[int], int], list[int]]):
        self.fn = fn

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.fn(tokens, k))[:k]


class NativeDrafter(Drafter):
    """The llama.cpp drafter of the native session, for one of its slots. The session feeds it the target's
    features itself whenever feature capture is on (kept until the next draft, then injected in one batch), so its
    context is kept with the session's caches (prompt_cache.py), not here."""

    samples = True

    def __init__(self, session, slot: int = 0):
        self.session = session
        self.slot = slot

    def drafted_with(self, session) -> bool:
        return session is self.session

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return self.session.draft(tokens[-1], k, slot=self.slot).tokens

    def draft_rated(self, tokens: list[int], k: int) -> tuple[list[int], list[float] | None]:
        d = self.session.draft(tokens[-1], k, slot=self.slot)
        return d.tokens, d.confidence or None

    def draft_sampled(self, tokens: list[int], k: int, sampler, index: int) -> list[int]:
        return self.session.draft(tokens[-1], k, False, sampler, index, self.slot).tokens

    def for_slot(self, slot: int) -> Drafter:
        return self if slot == self.slot else NativeDrafter(self.session, slot)


def as_drafter(d: Drafter | Callable[[list[int], int], list[int]]) -> Drafter:
    return d if isinstance(d, Drafter) else FunctionDrafter(d)
