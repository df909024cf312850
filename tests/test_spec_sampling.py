"""Rejection sampling (--spec-sampling rejection): drafts drawn from the drafter's distribution q and accepted with
probability min(1, p/q), a residual draw otherwise, must give tokens distributed as the target's own distribution p.
The tiny target's distributions are exact (its logits), so the test counts thousands of steps against them."""

import math
from collections import Counter

import numpy as np
import pytest
from fixtures import with_inf_in_fc

from dflash_local import Engine
from dflash_local.engine.sampling import SamplingParams

PROMPT = "Q: river code?\nA:"
T = 3.0  # the random drafter's distribution overlaps the target's enough at this temperature: both paths run
N = 3000


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_drafter):
    # its own engine: the test drives the session directly, outside the engine's prompt-cache record; one thread,
    # since thousands of tiny decodes would spend their time in thread handoffs on a busy machine
    return Engine(tiny_target, tiny_drafter, n_ctx=256, draft_policy="fixed", n_threads=1)


def softmax(logits: np.ndarray, temperature: float, top_k: int = 0) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    if top_k:
        order = sorted(range(len(x)), key=lambda i: (-logits[i], i))
        x[order[top_k:]] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def chi2_fails(counts: Counter, p: np.ndarray, n: int) -> bool:
    """Pearson's test of the counts against p, bins of expected count < 5 merged; True where p is rejected at
    the 1e-4 level (Wilson-Hilferty's approximation of the chi-square quantile)."""
    expected = p * n
    big = expected >= 5
    obs = np.array([counts.get(i, 0) for i in range(len(p))], dtype=np.float64)
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    z = 3.719  # the normal quantile at 1 - 1e-4
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > limit


def draws(engine, top_k: int = 0):
    """N speculative steps from the same position, each with its own seed: the first two generated tokens of each
    (a second step follows where the first kept no draft token), the drafter's distribution at the first draft
    position, and how many first draft tokens were accepted."""
    s = engine.session
    ids = engine.prompt_tokens(PROMPT)
    engine.cache.truncate(s, 0)
    s.set_capture(True)
    first = s.prefill(ids, SamplingParams(seed=0).sampler(engine.target, ids, engine.n_ctx), 0)
    n0 = s.n_past
    pairs, accepted = [], 0
    for seed in range(N):
        s.truncate(n0)
        smp = SamplingParams(temperature=T, top_k=top_k, seed=seed).sampler(engine.target, ids, engine.n_ctx)
        d = s.draft(first, 4, False, smp, 1)
        r = s.step(first, d.tokens, smp, 1, True)
        accepted += r.n_accepted > 0
        toks = list(r.tokens)
        if len(toks) == 1:
            d = s.draft(toks[0], 4, False, smp, 2)
            toks += list(s.step(toks[0], d.tokens, smp, 2, True).tokens)
        pairs.append(tuple(toks[:2]))
    # the exact distributions: the target's row after `first`, and the drafter's first draft row
    s.truncate(n0)
    s.keep_draft_logits(True)
    s.draft(first, 4, False)
    q0 = softmax(s.draft_logits()[0], T)
    s.keep_draft_logits(False)
    plain = SamplingParams(seed=0).sampler(engine.target, ids, engine.n_ctx)
    s.step(first, [], plain, 1)
    p0 = softmax(s.logits(0), T, top_k)
    engine.cache.truncate(s, 0)
    return first, n0, pairs, p0, q0, accepted


def test_rejection_sampling_draws_the_target_distribution(engine):
    first, n0, pairs, p0, q0, accepted = draws(engine)
    # both paths ran: draft tokens kept, and residual draws
    assert 0.05 * N < accepted < 0.95 * N, accepted
    t0 = Counter(a for a, _ in pairs)
    assert not chi2_fails(t0, p0, N)
    assert chi2_fails(t0, q0, N)  # the test tells the drafter's distribution apart from the target's

    # the second token, given the most frequent first token v: the target's row after [first, v]
    v = t0.most_common(1)[0][0]
    t1 = Counter(b for a, b in pairs if a == v)
    s = engine.session
    ids = engine.prompt_tokens(PROMPT)
    s.prefill(ids, SamplingParams(seed=0).sampler(engine.target, ids, engine.n_ctx), 0)
    s.step(first, [v], SamplingParams(seed=0).sampler(engine.target, ids, engine.n_ctx), 1)
    p1 = softmax(s.logits(1), T)
    engine.cache.truncate(s, 0)
    assert t0[v] > 150
    assert not chi2_fails(t1, p1, t0[v])


def test_rejection_sampling_follows_top_k(engine):
    _, _, pairs, p0, _, _ = draws(engine, top_k=5)
    t0 = Counter(a for a, _ in pairs)
    assert set(t0) <= set(np.flatnonzero(p0))  # nothing outside the top 5
    assert not chi2_fails(t0, p0, N)


def test_rejection_mode_through_the_engine(engine):
    kw = dict(max_tokens=40, temperature=0.8, seed=11, spec_sampling="rejection")
    a = engine.complete(PROMPT, **kw)
    b = engine.complete(PROMPT, **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 10  # reproducible with its seed
    assert a.summary.n_drafted > 0
    # greedy decoding is the same in both modes, and equal to plain decoding
    greedy = engine.complete(PROMPT, max_tokens=40, spec_sampling="rejection")
    assert greedy.token_ids == engine.complete(PROMPT, max_tokens=40, draft=False).token_ids


def test_rejection_mode_with_a_nan_drafter_samples_as_plain_decoding(tmp_path, tiny_target, tiny_drafter):
    """A drafter whose logits are NaN has no distribution to draw drafts from: its draft ends there, no error, and
    every step is the target's own draw, as in plain decoding with the same seed."""
    e = Engine(tiny_target, with_inf_in_fc(tiny_drafter, tmp_path / "nan.gguf"), n_ctx=256, draft_policy="fixed",
               n_threads=1)
    kw = dict(max_tokens=20, temperature=0.8, seed=11)
    spec = e.complete(PROMPT, spec_sampling="rejection", **kw)
    assert spec.summary.n_drafted == 0 and spec.summary.steps > 10
    assert spec.token_ids == e.complete(PROMPT, draft=False, **kw).token_ids


def test_rejection_mode_refuses_what_it_cannot_verify(engine):
    with pytest.raises(ValueError, match="llama.cpp drafter"):
        engine.complete(PROMPT, max_tokens=4, temperature=1.0, spec_sampling="rejection",
                        external_drafter=lambda toks, k: [0] * k)
    with pytest.raises(ValueError, match="grammar"):
        engine.complete(PROMPT, max_tokens=4, temperature=1.0, spec_sampling="rejection", grammar='root ::= "a"')
    with pytest.raises(ValueError, match="match or rejection"):
        engine.complete(PROMPT, max_tokens=4, spec_sampling="exact")
    s = engine.session
    ids = engine.prompt_tokens(PROMPT)
    smp = SamplingParams(temperature=1.0, seed=1).sampler(engine.target, ids, engine.n_ctx)
    engine.cache.truncate(s, 0)
    s.set_capture(True)
    first = s.prefill(ids, smp, 0)
    d = s.draft(first, 3, False, smp, 1)
    with pytest.raises(ValueError, match="last sampled"):
        s.step(first, [(t + 1) % engine.target.n_vocab for t in d.tokens], smp, 1, True)
    engine.cache.truncate(s, 0)
