"""A scripted drafter: proposes the known greedy continuation with planted errors.

It is a test double for the drafter only: verification, acceptance, rollback and feature injection are the real
native code. Cycling the error offset through 0..n (n meaning no error) forces every acceptance length.
With rated=True it also rates its drafts as a DSpark confidence head would, knowing where it planted the error:
high before it, low from it on. Wrapping is the base of test drafters that watch or pause the engine's own.
"""

import random

from dflash_local.engine.drafter import Drafter
from dflash_local.engine.policy import DraftPolicy

CPU = {k: 7.5 + 6.5 * k for k in range(1, 10)}  # verify cost growing like gemma-3-270m's on 2 cores


class ScriptedDrafter(Drafter):
    def __init__(self, n_prompt: int, continuation: list[int], n_vocab: int, seed: int | None = None,
                 errors: bool = True, rated: bool = False):
        self.n_prompt = n_prompt
        self.continuation = continuation
        self.n_vocab = n_vocab
        self.rng = random.Random(seed) if seed is not None else None
        self.errors = errors  # False: every draft is the continuation itself
        self.rated = rated
        self.calls = 0
        self.error_at = 0  # where the last draft's error is (its length: none)

    def draft(self, tokens: list[int], n: int) -> list[int]:
        # tokens = prompt + everything generated so far; the next generated index is len(tokens) - n_prompt
        j = len(tokens) - self.n_prompt
        draft = list(self.continuation[j : j + n])
        draft += [0] * (n - len(draft))
        error_at = self.rng.randint(0, n) if self.rng else self.calls % (n + 1)
        self.calls += 1
        self.error_at = error_at if self.errors else n
        if self.error_at < n:
            draft[error_at] = (draft[error_at] + 1) % self.n_vocab
        return draft

    def draft_rated(self, tokens: list[int], n: int) -> tuple[list[int], list[float] | None]:
        draft = self.draft(tokens, n)
        return draft, [0.9 if i < self.error_at else 0.1 for i in range(n)] if self.rated else None


class Wrapping(Drafter):
    """Another drafter (the engine's own) with something added by a subclass: drafts, context, cropping and the
    features of decoded positions pass through to it."""

    def __init__(self, inner: Drafter):
        self.inner = inner

    def draft(self, tokens, k):
        return self.inner.draft(tokens, k)

    def context(self):
        return self.inner.context()

    def crop(self, n):
        self.inner.crop(n)

    def extend(self, session, pos0, n):
        self.inner.extend(session, pos0, n)


class SteadyCosts(DraftPolicy):
    """The draft-length policy with gemma-3-270m-like step times in place of this machine's measurements, which
    another process (or a faster kernel) can change at any moment: a test of the engine's wiring then takes the
    same steps on every run; the cost logic itself is tested in test_policy.py."""

    def _record(self, kind, k, value):
        return CPU[k] if kind == "verify" else 0.2 if kind == "sample" else 3.0
