"""Deferred feature injection (native/features.cpp, Session::defer): the features of positions decoded without a
draft wait, and go into the drafter's cache in one batch when it next drafts. The drafter must see exactly the
context it saw when every step injected them: its drafts (tokens and logits) are compared with those of a run that
drafts at every step, which injects each step's features before the next draft as before.
"""

import random

import numpy as np
import pytest
from conftest import make_prompts
from fixtures import write_tiny_drafter, write_tiny_qwen35
from scripted import SteadyCosts

from dflash_local import Engine, _native
from dflash_local.engine.drafter import NativeDrafter
from dflash_local import models
from dflash_local.engine.placement import Placement

GREEDY = _native.Sampling()


def engine(target, drafter, n_batch=512, **kw):
    placement = Placement(n_threads=1, n_batch=n_batch, n_ubatch=n_batch)
    return Engine(target, drafter, n_ctx=1024, placement=placement, draft_policy="fixed", **kw)


@pytest.fixture(scope="module")
def qwen35_pair(models_dir):
    target = write_tiny_qwen35(models_dir / "tiny-qwen35.gguf")
    return target, write_tiny_drafter(models_dir / "tiny-qwen35-drafter.gguf", target, target_layers=(1, 3))


@pytest.fixture(scope="module")
def gemma(gemma_target):
    # the shipped drafter, and drafter batches of 16: a long gap between drafts fills and flushes them
    return engine(gemma_target, models.drafter("gemma"), n_batch=16)


def drive(e, ids, cont, n_steps, draft_at, seed=None):
    """Prefill ids, then take n_steps steps along the greedy continuation cont (cont[0] is what prefill gives),
    drafting k tokens before the steps in draft_at. Without a seed every step is plain; with one, each step verifies
    a draft of the continuation with an error planted at a random position (or none), so rollbacks happen.
    Returns {position: (draft tokens, draft logits)}."""
    s, k, rng = e.session, e.block_size - 1, random.Random(seed)
    s.truncate(0)
    s.set_capture(True)
    s.keep_draft_logits(True)
    last = s.prefill(ids, GREEDY, 0)
    j, drafts = 0, {}
    for i in range(n_steps):
        if i in draft_at:
            drafts[s.n_past] = (s.draft(last, k).tokens, s.draft_logits())
            assert s.n_pending == 0
        proposal = []
        if seed is not None:
            proposal = list(cont[j + 1 : j + 1 + k])
            at = rng.randint(0, len(proposal))
            if at < len(proposal):
                proposal[at] = (proposal[at] + 1) % e.target.n_vocab
        r = s.step(last, proposal, GREEDY, j + 1)
        j += len(r.tokens)
        last = r.tokens[-1]
    return drafts


def assert_same_drafts(sparse, every):
    assert sparse
    for pos, (tokens, logits) in sparse.items():
        want_tokens, want_logits = every[pos]
        assert tokens == want_tokens, pos
        np.testing.assert_array_equal(logits, want_logits)


def check_deferral(e, prompt, n_steps, draft_at, seed=None):
    """Drafts after long runs of steps without drafts equal those of a run drafting at every step."""
    ids = e.prompt_tokens(prompt)
    per_step = 1 if seed is None else e.block_size
    cont = e.complete(prompt, max_tokens=n_steps * per_step + 1, draft=False).token_ids
    e.cache.clear()  # the session is driven by hand here
    every = drive(e, ids, cont, n_steps, range(n_steps), seed)
    sparse = drive(e, ids, cont, n_steps, draft_at, seed)
    assert_same_drafts(sparse, every)
    e.session.truncate(0)


SPARSE = {0, 1, 4, 5, 27, 28, 30, 47}  # gaps of 0 to 22 plain steps; batches of 8 or 16 fill within the long ones


@pytest.mark.parametrize("capture", ["layer_api", "callback"])
def test_drafts_after_plain_steps_equal_drafts_at_every_step(tiny_target, tiny_drafter, capture):
    e = engine(tiny_target, tiny_drafter, n_batch=8, capture=capture)
    check_deferral(e, make_prompts(3)[0] + " and some more words for a longer prompt", 48, SPARSE)


def test_deferral_with_rollbacks(tiny_target, tiny_drafter):
    e = engine(tiny_target, tiny_drafter, n_batch=8)
    check_deferral(e, "def total(values):\n", 48, SPARSE, seed=3)


@pytest.mark.parametrize("n_rs_seq", [None, 2])  # rollbacks by snapshot, or by checkpoint and replay
def test_deferral_on_a_recurrent_target(qwen35_pair, n_rs_seq):
    e = engine(*qwen35_pair, n_batch=16, n_rs_seq=n_rs_seq)  # 16: a ubatch holds the 7 snapshots' tokens
    check_deferral(e, "Speculative decoding is", 48, SPARSE, seed=5)


def test_deferral_with_the_shipped_gemma_drafter(gemma):
    check_deferral(gemma, "def flatten(nested):\n    \"\"\"Yield the items of nested lists.\"\"\"\n", 48, SPARSE)


def test_truncating_drops_the_pending_features(tiny_target, tiny_drafter):
    """Cut back into the pending rows, or behind them into the drafter's cache, then decode other tokens: the drafts
    equal those of a run that drafted at every step over the same tokens."""
    e = engine(tiny_target, tiny_drafter, n_batch=8)
    prompt = "The quick brown fox"
    ids = e.prompt_tokens(prompt)
    cont = e.complete(prompt, max_tokens=12, draft=False).token_ids
    e.cache.clear()
    s = e.session
    s.set_capture(True)
    s.keep_draft_logits(True)
    n = len(ids) + 11
    other = [7, 11, 13]  # tokens the target did not choose

    def decode(tokens, n_prompt, draft_every_step):
        s.truncate(0)
        s.prefill(tokens[:n_prompt], GREEDY, 0)
        for i, t in enumerate(tokens[n_prompt:]):
            if draft_every_step or i == 6:
                s.draft(t, 7)
            s.step(t, [], GREEDY, 1)

    for cut in (n - 2, n - 8):  # into the 5 pending rows; into the drafter's cache
        decode(ids + cont[:11], len(ids), False)  # drafts once, 5 steps before the end
        assert (s.n_past, s.n_pending) == (n, 5)
        s.truncate(cut)
        assert s.n_pending == max(cut - (n - 5), 0)
        for t in other:
            s.step(t, [], GREEDY, 1)
        got = s.draft(19, 7).tokens, s.draft_logits()
        decode(ids + cont[: cut - len(ids)] + other, len(ids), True)
        want = s.draft(19, 7).tokens, s.draft_logits()
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])
    s.truncate(0)


class Recording(NativeDrafter):
    """The llama.cpp drafter, keeping every draft by (tokens so far, draft length); with `also`, drafts of those
    lengths too at every step (a draft decodes a block of its own length from the drafter's cache, which it leaves
    as it was, so the step's own draft, made last, is unchanged)."""

    def __init__(self, session, also=()):
        super().__init__(session)
        self.drafts, self.also = {}, also

    def drafted_with(self, session):  # it drafts itself, so that the engine calls draft_rated, not draft_many
        return False

    def draft_rated(self, tokens, k):  # what the engine calls
        for j in self.also:
            self.drafts[len(tokens), j] = super().draft_rated(tokens, j)[0]
        d, ratings = super().draft_rated(tokens, k)
        self.drafts[len(tokens), k] = d
        return d, ratings


def test_adaptive_drafts_equal_fixed_drafts_and_output_equals_plain(gemma_target):
    """The engine with the adaptive policy (plain steps between probes, the prefix cache kept across generations):
    greedy output identical to plain decoding, and every draft equal to the fixed-block run's draft of that length at
    that position (the policy's probes draft fewer tokens than a block)."""
    adaptive = Engine(gemma_target, models.drafter("gemma"), n_ctx=1024, n_threads=1, draft_policy="auto")
    fixed = Engine(gemma_target, models.drafter("gemma"), n_ctx=1024, n_threads=1, draft_policy="fixed")
    plain = Engine(gemma_target, n_ctx=1024, n_threads=1)  # its own engine: the adaptive one's cache stays
    first = "def rle_encode(text):\n    \"\"\"Run-length encode a string: 'aaab' -> 'a3b1'.\"\"\"\n"
    # drafts after 4-8 plain steps; steady costs, since with this machine's timings the policy may draft at every step
    adaptive._policies["drafter"] = SteadyCosts(adaptive.max_draft, probe_every=4, max_probe_every=8)
    n_same = n_short = 0
    prompt = first
    for _ in range(2):  # the second prompt extends the first's output: the cache is reused, pending rows too
        a, f = Recording(adaptive.session), Recording(fixed.session, also=range(1, fixed.max_draft))
        out = adaptive.complete(prompt, max_tokens=96, external_drafter=a)
        assert out.token_ids == plain.complete(prompt, max_tokens=96).token_ids
        assert fixed.complete(prompt, max_tokens=96, external_drafter=f).token_ids == out.token_ids
        assert out.summary.steps > len(a.drafts) > 0  # plain steps and drafting steps
        for key, d in a.drafts.items():
            if key in f.drafts:
                assert d == f.drafts[key], key
                n_same, n_short = n_same + 1, n_short + (key[1] < fixed.max_draft)
        prompt = first + out.text[:80]
    assert n_same >= 4 and n_short >= 1, (n_same, n_short)
