"""The engine on the tiny qwen3 target and its tiny DFlash drafter (both built by the tests)."""

import numpy as np
import pytest
from conftest import make_prompts
from fixtures import write_tiny_target
from scripted import ScriptedDrafter

from dflash_local import ContextOverflowError, Engine, Finished, StepStats, TextDelta, _native


def test_greedy_dflash_is_token_identical_to_baseline(tiny_engine):
    prompts = make_prompts(60)
    for p in prompts:
        base = tiny_engine.complete(p, max_tokens=24, draft=False)
        spec = tiny_engine.complete(p, max_tokens=24, draft=True)
        assert spec.token_ids == base.token_ids, p
        assert spec.text == base.text
        assert spec.summary.drafting and not base.summary.drafting
        assert spec.summary.n_drafted > 0


def test_every_acceptance_length_and_full_blocks(tiny_engine):
    prompt = "The quick brown fox"
    base = tiny_engine.complete(prompt, max_tokens=200, draft=False)
    n_prompt = len(tiny_engine.prompt_tokens(prompt))
    drafter = ScriptedDrafter(n_prompt, base.token_ids, tiny_engine.target.n_vocab)
    accepted = set()
    events = list(tiny_engine.generate(prompt, max_tokens=200, external_drafter=drafter))
    steps = [e for e in events if isinstance(e, StepStats)]
    done = events[-1]
    assert isinstance(done, Finished)
    assert done.token_ids == base.token_ids
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.text == base.text
    for s in steps:
        if s.n_drafted == tiny_engine.block_size - 1:
            accepted.add(s.n_accepted)
    assert accepted == set(range(tiny_engine.block_size))  # 0..B-1, B-1 being the full block
    # tau counts the target's own token on top of the accepted drafts
    assert done.summary.mean_acceptance_length == pytest.approx(
        (done.summary.n_accepted + done.summary.steps) / done.summary.steps
    )
    rates = done.summary.acceptance_rate
    assert len(rates) == tiny_engine.block_size - 1
    assert all(0 < r < 1 for r in rates)
    assert rates[0] > rates[-1]  # an error at position k rejects everything after it


def test_a_generation_block_size_bounds_its_drafts(tiny_engine):
    """generate(block_size=B) drafts at most B - 1 tokens a step for that generation only (the TUI's block size
    setting); above the drafter's trained size it is the trained size, and the engine's own block stays."""
    prompt = "def total(values):\n"
    base = tiny_engine.complete(prompt, max_tokens=40, draft=False)
    for block, longest in ((3, 2), (1, 0), (100, tiny_engine.max_draft)):
        events = list(tiny_engine.generate(prompt, max_tokens=40, block_size=block))
        done = events[-1]
        assert done.token_ids == base.token_ids
        # the fixed policy drafts full blocks where max_tokens leaves room
        assert max(e.n_drafted for e in events if isinstance(e, StepStats)) == longest, block
        assert len(done.summary.drafted_at) == max(longest, 1)
    assert tiny_engine.block_size == 8 and tiny_engine.max_draft == 7
    assert max(s.n_drafted for s in tiny_engine.generate(prompt, max_tokens=40) if isinstance(s, StepStats)) == 7
    for bad in (0, -2, 2.5, "4", True):
        with pytest.raises(ValueError, match="block size"):
            tiny_engine.complete(prompt, max_tokens=4, block_size=bad)


def test_rollback_stays_correct_over_many_steps(tiny_engine):
    prompt = "def total(values):\n"
    base = tiny_engine.complete(prompt, max_tokens=400, draft=False)
    n_prompt = len(tiny_engine.prompt_tokens(prompt))
    drafter = ScriptedDrafter(n_prompt, base.token_ids, tiny_engine.target.n_vocab, seed=7)
    spec = tiny_engine.complete(prompt, max_tokens=400, external_drafter=drafter)
    assert spec.token_ids == base.token_ids
    assert spec.summary.steps < len(base.token_ids) / 2
    # the caches now hold exactly prompt + accepted tokens: a continuation reuses them and matches a fresh run
    follow = prompt + spec.text + "\nmore"
    again = tiny_engine.complete(follow, max_tokens=32, draft=True)
    assert again.summary.n_cached > n_prompt
    fresh = Engine(tiny_engine.target_info.path, tiny_engine.draft_info.path, n_ctx=1024)
    assert fresh.complete(follow, max_tokens=32, draft=True).token_ids == again.token_ids


def test_native_drafter_path_with_prefix_reuse(tiny_engine):
    first = tiny_engine.complete("Hello world", max_tokens=40)
    cont = tiny_engine.complete("Hello world" + first.text, max_tokens=40)
    assert cont.summary.n_cached > 0
    base = tiny_engine.complete("Hello world" + first.text, max_tokens=40, draft=False)
    assert cont.token_ids == base.token_ids


def test_stop_string_split_across_tokens(tiny_engine):
    prompt = "Speculative decoding"
    base = tiny_engine.complete(prompt, max_tokens=40, draft=False)
    pieces = [tiny_engine.target.piece(t) for t in base.token_ids]
    plain = [p.decode() if p.isascii() and len(p) >= 2 else None for p in pieces]
    k = next(i for i in range(3, len(plain) - 1) if plain[i] and plain[i + 1])
    pieces = plain
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = base.text.find(stop)
    for draft in (False, True):
        events = list(tiny_engine.generate(prompt, max_tokens=40, stop=[stop], draft=draft))
        done = events[-1]
        assert done.summary.finish_reason == "stop"
        assert done.text == base.text[:cut]
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.text


def test_finish_reasons_length_and_eos(tiny_engine, tiny_drafter, tmp_path):
    r = tiny_engine.complete("Hello", max_tokens=5)
    assert r.summary.finish_reason == "length" and len(r.token_ids) == 5
    # the tiny target's weights with the token it generates at index k made its end-of-generation token: greedy
    # decoding then ends there, and in the middle of a block (8 tokens per step: the first token comes with the
    # prefill, step j makes tokens 8j+1 .. 8j+8)
    prompt = "The quick brown fox"
    base = tiny_engine.complete(prompt, max_tokens=40, draft=False)
    assert base.summary.finish_reason == "length"
    k = next(i for i in range(10, 40) if base.token_ids[i] not in base.token_ids[:i] and i % 8 not in (0, 1))
    target = write_tiny_target(tmp_path / "eos-target.gguf", eos=base.token_ids[k])
    e = Engine(target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    plain = e.complete(prompt, max_tokens=40, draft=False)
    assert plain.summary.finish_reason == "eos" and plain.token_ids == base.token_ids[:k]
    assert not any(e.target.is_eog(t) for t in plain.token_ids)
    # a drafter that always drafts the continuation: the end-of-generation token is accepted among the drafts and
    # the accepted tokens after it are dropped
    drafter = ScriptedDrafter(len(e.prompt_tokens(prompt)), base.token_ids, e.target.n_vocab, errors=False)
    events = list(e.generate(prompt, max_tokens=40, external_drafter=drafter))
    done, last = events[-1], [ev for ev in events if isinstance(ev, StepStats)][-1]
    assert done.summary.finish_reason == "eos" and done.token_ids == plain.token_ids and done.text == plain.text
    assert last.n_accepted == e.block_size - 1 and last.n_tokens == (k - 1) % 8
    assert "".join(ev.text for ev in events if isinstance(ev, TextDelta)) == done.text
    # and the llama.cpp drafter
    assert e.complete(prompt, max_tokens=40).token_ids == plain.token_ids


def test_context_overflow(tiny_target, tiny_drafter):
    e = Engine(tiny_target, tiny_drafter, n_ctx=64)
    with pytest.raises(ContextOverflowError, match="context"):
        e.complete("word " * 100)
    prompt = "The quick brown fox jumps"
    n_prompt = len(e.prompt_tokens(prompt))
    for draft in (False, True):
        r = e.complete(prompt, max_tokens=500, draft=draft)
        assert r.summary.finish_reason == "context_full"
        assert n_prompt + len(r.token_ids) == 64 + 1  # the last token needs no cache slot of its own
    assert e.complete(prompt, max_tokens=500, draft=True).token_ids == e.complete(prompt, max_tokens=500, draft=False).token_ids


def test_sampling_is_reproducible_and_lossless(tiny_engine):
    kw = dict(max_tokens=64, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)
    a = tiny_engine.complete("Hello", seed=123, **kw)
    b = tiny_engine.complete("Hello", seed=123, **kw)
    c = tiny_engine.complete("Hello", seed=123, draft=False, **kw)
    d = tiny_engine.complete("Hello", seed=124, **kw)
    assert a.token_ids == b.token_ids == c.token_ids
    assert a.token_ids != d.token_ids
    # with a scripted drafter that is often right, sampled verification still gives the baseline's tokens
    n_prompt = len(tiny_engine.prompt_tokens("Hello"))
    drafter = ScriptedDrafter(n_prompt, c.token_ids, tiny_engine.target.n_vocab, seed=1)
    e = tiny_engine.complete("Hello", seed=123, external_drafter=drafter, **kw)
    assert e.token_ids == c.token_ids
    assert e.summary.n_accepted > 0


def _reference_distribution(logits, temperature, top_k, top_p, min_p):
    """The filter chain the native sampler documents: top-k, top-p, min-p on softmax(logits), then temperature."""
    order = np.argsort(-logits, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(logits[order] - logits[order[0]])
    p /= p.sum()
    if top_p < 1:
        keep = np.searchsorted(np.cumsum(p), top_p) + 1
        order, p = order[:keep], p[:keep]
    if min_p:
        order = order[p >= min_p * p[0]]
    q = np.exp((logits[order] - logits[order[0]]) / temperature)
    out = np.zeros_like(logits, dtype=np.float64)
    out[order] = q / q.sum()
    return out


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1)]
)
def test_native_sampler_matches_the_target_distribution(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(300) * 2).astype(np.float32)
    want = _reference_distribution(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    n = 40000
    s = _native.Sampling(temperature, top_k, top_p, min_p, 42)
    counts = np.bincount([_native.sample(logits, s, i) for i in range(n)], minlength=len(logits)) / n
    assert counts[want == 0].sum() == 0  # filtered tokens are never drawn
    assert np.abs(counts - want).max() < 0.01
    assert _native.sample(logits, _native.Sampling(0.0), 0) == int(np.argmax(logits))


def test_layer_api_and_eval_callback_capture_the_same_features(tiny_target, tiny_drafter):
    assert _native.arch_records_layer_inputs("qwen3") and not _native.arch_records_layer_inputs("gemma3")
    a = Engine(tiny_target, tiny_drafter, n_ctx=256, capture="layer_api")
    b = Engine(tiny_target, tiny_drafter, n_ctx=256, capture="callback")
    assert a.session.uses_layer_api and not b.session.uses_layer_api
    ids = a.prompt_tokens("def add(a, b):\n    return a + b\n")
    sp = _native.Sampling()
    ta, tb = a.session.prefill(ids, sp, 0), b.session.prefill(ids, sp, 0)
    fa, fb = a.session.features(), b.session.features()
    assert fa.shape == (len(ids), 2 * a.target.n_embd)
    assert np.abs(fa).max() > 0
    np.testing.assert_array_equal(fa, fb)
    da, db = a.session.draft(ta, 7), b.session.draft(tb, 7)
    ra, rb = a.session.step(ta, da.tokens, sp, 1), b.session.step(tb, db.tokens, sp, 1)
    assert ra.draft == rb.draft and ra.tokens == rb.tokens
    np.testing.assert_array_equal(a.session.features(), b.session.features())
    for p in make_prompts(5):
        assert a.complete(p, max_tokens=16).token_ids == b.complete(p, max_tokens=16).token_ids


def test_draft_probabilities_are_reported(tiny_engine):
    s = tiny_engine.session
    s.truncate(0)
    sp = _native.Sampling()
    t = s.prefill(tiny_engine.prompt_tokens("Hello"), sp, 0)
    d = s.draft(t, 7, True)
    r = s.step(t, d.tokens, sp, 1)
    assert len(r.draft) == len(d.tokens) == len(d.probs) == 7
    assert all(0 < p <= 1 for p in d.probs)
    assert r.draft_ms > 0 and r.verify_ms > 0 and r.step_ms >= r.draft_ms + r.verify_ms
    tiny_engine.cache.clear()  # this test drove the session by hand


def test_chat_uses_the_gguf_template(tiny_engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny_engine.chat_prompt(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tiny_engine.prompt_tokens(messages=msgs)
    assert ids[0] == tiny_engine.target.tokenize("<|im_start|>", False, True)[0]
    r = tiny_engine.complete(messages=msgs, max_tokens=8)
    assert r.summary.n_prompt == len(ids)
    with pytest.raises(ValueError, match="role"):
        tiny_engine.complete(messages=[{"content": "no role"}])


def test_bad_arguments_are_clear_errors(tiny_engine):
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_engine.complete("x", max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        tiny_engine.complete("x", top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        tiny_engine.complete("x", temperature=-1)
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.complete("")
    with pytest.raises(ValueError, match="either"):
        tiny_engine.complete()
