"""How many tokens to draft at each step.

A DFlash block costs a drafter pass plus a target verify of n + 1 tokens, and on CPUs the verify grows almost
linearly with n (docs/measurements.md), so drafting a full block when drafts are rarely accepted is slower than plain
decoding. The adaptive policy picks the n that maximises expected tokens per millisecond:

    E(n) = 1 + sum_{j=1..n} a_1 a_2 ... a_j          (a_k: chance draft k is accepted once 1..k-1 were)
    cost(n) = T(n + 1) + D(n) + S E(n) + H (E(n) - 1)   (measured verify and draft times; D(0) = 0)

a_k are running estimates (a Beta(1, 1) prior, decayed so they follow the text), T and D medians of recent
measured times, filled in for unmeasured sizes by a line through the measured ones, S the median time to sample one
row of logits: a step samples one row per token it yields, drafting or not, so a dear sampler shrinks what drafting
can save. On CPUs a verify batch computes the target's LM head only for the rows the step reads (native/head.cpp,
"LM head on demand"): T(n + 1) then holds the batch with one row's head, as a plain step pays, and H, the median
head time per row, is paid for each further row read, one per further token made (0 where llama.cpp computes every
row's head, which T then holds). A drafting step that paid off (more tokens per millisecond than plain decoding)
with every draft accepted is followed by one that drafts twice as far (up to the full block, or the n-gram lookup's
longest draft, ngram.py), since the estimates of positions seldom reached lag behind; when drafting does not pay, it
decodes plainly and probes every `probe_every` steps to keep learning, waiting twice as long after each probe that
did not pay (up to `max_probe_every`). On CPUs a verified token costs nearly a plain step, so probes are kept
cheap: one drafts only as far as drafts are likely to reach (while the chance that every draft before is accepted
stays above PROBE_REACH), a probe whose drafts were all accepted is followed by one twice as long, and a new
generation halves the wait rather than starting the back-off again (a server's prompts tend to be alike, and on
held-out prompts the restarted back-off's probes cost 5% of plain speed: docs/measurements.md, "The draft-length
policy").

Some drafters rate their own drafts: a DSpark confidence head estimates, for each drafted token, the chance it is
accepted; DFlash2's selector gives the probability of its path at each position. With such a rating the drafted
block is cut before verifying: each rating c goes through a calibration (the acceptance seen at drafts rated like
it, per tenth of c, starting from c itself), and the prefix of m tokens that promises the most tokens per
millisecond of this step, E(m) / (T(m + 1) + D + S E(m)) with the drafting time D already spent, is verified. A cut
only shortens what is verified, so the output stays what the target decodes. Probes verify whole blocks, so the
calibration keeps learning at low ratings too.

With several slots (`serve -np N`) a slot's step is one part of a target decode that carries the other slots' rows
(Engine.step_many). There T(n + 1) above is the whole batch's: what R rows cost, measured over every batched decode
(BatchCosts, shared by the slots), at R = the other slots' rows in this slot's last step plus its own n + 1, and the
tokens the others made in that step count with E(n). A draft row is so priced at what it adds to the batch: little
where a batch of R rows costs little more than one (GPUs), a full row where each row costs the same (a CPU past a few
rows), not at its share of the batch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.9  # per observation: the estimates follow roughly the last 10 tests of each position
MARGIN = 1.1  # drafting must promise 10% more tokens per millisecond than plain decoding: timings are noisy
BINS = 10  # a drafter's ratings are calibrated per tenth
PRIOR = 2.0  # an unseen tenth trusts the drafter's rating as much as two observations
PROBE_REACH = 0.1  # a probe drafts as far as the chance of reaching the draft stays above this


def _median_of_recent(samples: dict, key, value: float) -> float:
    """Median of the last 15 timings per key: one slow step (another process, a page fault) moves nothing."""
    recent = samples.setdefault(key, deque(maxlen=15))
    recent.append(value)
    return statistics.median(recent)


@dataclass
class BatchCosts:
    """What a target decode of several slots' steps costs by its rows, whoever's they are: one per engine, recorded
    by Engine.step_many, read by every slot's policy."""

    verify_ms: dict[int, float] = field(default_factory=dict)  # rows -> median of recent batched decodes
    samples: dict[int, deque] = field(default_factory=dict)

    def record(self, rows: int, ms: float) -> None:
        self.verify_ms[rows] = _median_of_recent(self.samples, rows, ms)


@dataclass
class DraftPolicy:
    max_draft: int  # block size - 1
    adaptive: bool = True
    probe_every: int = 16
    max_probe_every: int = 256
    accepted: list[float] = field(default_factory=list)  # decayed counts per draft position
    tried: list[float] = field(default_factory=list)
    verify_ms: dict[int, float] = field(default_factory=dict)  # tokens verified -> median of recent steps
    draft_ms: dict[int, float] = field(default_factory=dict)  # tokens drafted -> median of recent steps
    sample_ms: float = 0.0  # sampling one row of logits: median of recent steps
    head_ms: float = 0.0  # the target's LM head for one row, where computed on demand: median of recent steps
    samples: dict[tuple[str, int], deque] = field(default_factory=dict)
    steps_since_draft: int = 0
    paid_off: bool = False  # the last drafting step gave more tokens per millisecond than plain decoding would
    last_drafted: int = 0  # tokens the last drafting step verified
    all_accepted: bool = False  # and whether the target accepted them all
    interval: int = 0  # plain steps before the next probe
    probing: bool = False  # the last choice was a probe: verify the whole block, whatever the drafter's ratings
    rated_accepted: list[float] = field(default_factory=lambda: [0.0] * BINS)  # decayed counts per tenth of rating
    rated_tried: list[float] = field(default_factory=lambda: [0.0] * BINS)
    batch: BatchCosts | None = None  # the engine's, where slots share target decodes
    beside: tuple[int, float] = (0, 0.0)  # the other slots' rows and tokens in the decode of this slot's last step

    def __post_init__(self):
        self.interval = self.probe_every
        self.accepted = [0.0] * self.max_draft
        self.tried = [0.0] * self.max_draft

    def new_text(self) -> None:
        """A new generation: the drafter may fare better on it, so probe sooner, but keep most of the back-off."""
        self.interval = max(self.probe_every, self.interval // 2)

    def acceptance(self) -> list[float]:
        return [(a + 1) / (t + 2) for a, t in zip(self.accepted, self.tried)]

    @staticmethod
    def _fit(table: dict[int, float]):
        """A function of k: the measured mean, or a least-squares line through the measured sizes, or None if
        nothing is known (fitted once, for a policy that asks about every size of a long n-gram draft)."""
        if not table:
            return lambda k: None
        if len(table) == 1:
            (k0, t0), = table.items()
            return lambda k: table.get(k, t0 * k / k0 if k0 else t0)  # proportional: the pessimistic guess on CPUs
        xs, ys = list(table), list(table.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
        return lambda k: table[k] if k in table else max(my + slope * (k - mx), 0.0)  # more tokens never cost less

    @staticmethod
    def _expected(acceptance):
        """E(0), E(1), ...: the tokens a step is expected to make with 0, 1, ... drafts, draft k being accepted
        with chance acceptance[k - 1] once the drafts before it were (the target's own token always comes)."""
        e, p = 1.0, 1.0
        yield e
        for a in acceptance:
            p *= a
            e += p
            yield e

    def expected_tokens(self, n: int) -> float:
        return list(self._expected(self.acceptance()[:n]))[-1]

    def likely_rows(self, n: int) -> int:
        """The verify rows a step with n drafts will probably read: the target's own token's, and one per draft
        that is accepted more likely than not (the first batch of a CPU target's LM head, computed on demand)."""
        rows, reach = 1, 1.0
        for a in self.acceptance()[:n]:
            reach *= a
            if reach < 0.5:
                break
            rows += 1
        return rows

    def choose(self) -> int:
        self.probing = False
        if not self.adaptive or self.max_draft == 0:
            return self.max_draft
        verify, beside = self._verify()
        plain = verify(1)
        if plain is None:
            self.probing = True
            return self.max_draft
        if self.steps_since_draft >= self.interval:
            self.probing = True
            return self._probe_length()
        if self.paid_off and self.all_accepted:
            return min(2 * self.last_drafted, self.max_draft)  # reach further while it pays (the estimates catch up)
        draft = self._fit(self.draft_ms)
        best, best_rate = 0, (beside + 1.0) / max(plain + self.sample_ms, 1e-6)
        expected = self._expected(self.acceptance())
        next(expected)  # no draft: plain decoding's rate, above
        for n, e in enumerate(expected, 1):
            t, d = verify(n + 1), draft(n)
            if d is None:
                self.probing = True
                return self.max_draft  # never drafted: try the full block once
            rate = (beside + e) / max(t + d + self._per_token(e), 1e-6)
            if rate > best_rate * (MARGIN if best == 0 else 1.0):
                best, best_rate = n, rate
        return best

    def _verify(self):
        """verify(k), what a step verifying k rows of this slot costs (None if unknown), and the tokens that other
        slots' rows make in it: the slot's own T(k) when its last step ran alone, else the batch's T(R + k), R
        being the other slots' rows in its last step (the module docstring)."""
        rows, tokens = self.beside
        if rows and self.batch is not None and self.batch.verify_ms:
            batch = self._fit(self.batch.verify_ms)
            return (lambda k: batch(rows + k)), tokens
        return self._fit(self.verify_ms), 0.0

    def _per_token(self, e: float) -> float:
        """What making e tokens costs beyond T and D: sampling a row each, and the LM head of every row after the
        first (on demand)."""
        return self.sample_ms * e + self.head_ms * (e - 1)

    def _probe_length(self) -> int:
        """Draft as far as the drafts are likely to reach: beyond, a probe would pay to verify what it cannot learn."""
        reach = 1.0
        for n, a in enumerate(self.acceptance(), 1):
            reach *= a
            if reach < PROBE_REACH:
                return n
        return self.max_draft

    @staticmethod
    def _rating(rating: float) -> float:
        """A NaN or infinite rating (a drafter whose activations overflowed) is no confidence at all."""
        return rating if math.isfinite(rating) else 0.0

    @classmethod
    def _bin(cls, rating: float) -> int:
        return min(max(int(cls._rating(rating) * BINS), 0), BINS - 1)

    def calibrated(self, rating: float) -> float:
        """The chance that a draft the drafter rated `rating` is accepted once the drafts before it were."""
        rating = self._rating(rating)
        b = self._bin(rating)
        return (self.rated_accepted[b] + PRIOR * rating) / (self.rated_tried[b] + PRIOR)

    def cut(self, ratings: list[float], draft_ms: float) -> int:
        """How many tokens of a drafted block to verify, given the drafter's rating of each (see the module
        docstring); all of them when the policy is fixed, probing, or has no verify timings yet."""
        n = len(ratings)
        verify, beside = self._verify()
        if not self.adaptive or self.probing or verify(1) is None:
            return n
        best, best_rate = 0, -1.0
        for m, e in enumerate(self._expected(self.calibrated(r) for r in ratings)):
            rate = (beside + e) / max(verify(m + 1) + draft_ms + self._per_token(e), 1e-6)
            if rate > best_rate:
                best, best_rate = m, rate
        return best

    def observe(
        self, n_drafted: int, n_accepted: int, verify_ms: float, sample_ms: float = 0.0, head_ms: float = 0.0,
        head_rows: int = 0, beside: tuple[int, float] = (0, 0.0),
    ) -> None:
        """Another proposer's step (the n-gram lookup's, ngram.py): its timings count, since a verify costs the same
        whoever drafted, its acceptance does not. verify_ms: its target time, head_ms of it for the head_rows rows
        whose LM head was computed on demand; sample_ms: its time sampling the n_accepted + 1 rows it took tokens
        from; beside: the other slots' rows and tokens in its decode (its verify_ms then a share of that decode,
        which the engine's BatchCosts hold whole)."""
        self.steps_since_draft += 1
        self.beside = beside
        if head_rows:
            per_row = head_ms / head_rows
            self.head_ms = self._record("head", 1, per_row)
            verify_ms -= head_ms - per_row  # T holds one row's head, as a plain step's
        if not beside[0]:
            self.verify_ms[n_drafted + 1] = self._record("verify", n_drafted + 1, verify_ms)
        self.sample_ms = self._record("sample", 1, sample_ms / (n_accepted + 1))

    def update(
        self, n_drafted: int, n_accepted: int, verify_ms: float, draft_ms: float, sample_ms: float = 0.0,
        ratings: list[float] | None = None, head_ms: float = 0.0, head_rows: int = 0,
        beside: tuple[int, float] = (0, 0.0),
    ) -> None:
        """This proposer's step (or a plain one): its timings as observe() takes them, draft_ms, and its acceptance;
        ratings: the drafter's rating of each verified draft, if it gives them."""
        self.observe(n_drafted, n_accepted, verify_ms, sample_ms, head_ms, head_rows, beside)
        if n_drafted:
            self.steps_since_draft = 0
            self.draft_ms[n_drafted] = self._record("draft", n_drafted, draft_ms)
            # judged on the running medians, not on this one step's timing
            verify, others = self._verify()
            plain, verified = verify(1), verify(n_drafted + 1)
            made = n_accepted + 1
            self.paid_off = plain is not None and verified is not None and (
                (others + made) / max(verified + self.draft_ms[n_drafted] + self._per_token(made), 1e-6)
                > MARGIN * (others + 1) / max(plain + self.sample_ms, 1e-6))
            self.last_drafted, self.all_accepted = n_drafted, n_accepted == n_drafted
            # a short probe whose drafts were all accepted cannot show what a longer draft would make: try one
            self.paid_off |= self.probing and self.all_accepted
            self.interval = self.probe_every if self.paid_off else min(2 * self.interval, self.max_probe_every)
        # position k was tested only if every draft before it was accepted
        for k in range(min(n_drafted, n_accepted + 1)):
            self.tried[k] = self.tried[k] * DECAY + 1
            self.accepted[k] = self.accepted[k] * DECAY + (k < n_accepted)
            if ratings:
                b = self._bin(ratings[k])
                self.rated_tried[b] = self.rated_tried[b] * DECAY + 1
                self.rated_accepted[b] = self.rated_accepted[b] * DECAY + (k < n_accepted)

    def _record(self, kind: str, k: int, value: float) -> float:
        return _median_of_recent(self.samples, (kind, k), value)
