"""The product's promise as one check: drafting changes the speed, never the tokens. Greedy output with drafts equals
plain decoding's (draft=False), and seeded sampling with drafts equals seeded sampling without them."""

from scripted import ScriptedDrafter

SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95)  # the sampling most lossless checks use


def assert_lossless(engine, prompts, *, max_tokens, sampling=None, seed=100, drafted=True, label=None, **kw):
    """For each prompt: the engine's completion with drafts (kw: an external_drafter, stop strings, ...) is
    token-identical to plain decoding, and it drafted (unless drafted=False); with `sampling` (a dict of sampling
    arguments) also seeded sampling, seed + i for the i-th prompt, with and without drafts. Returns the drafted
    greedy completions for the caller's own checks (without `sampling`, the engine's session is left after the last
    one)."""
    done = []
    plain_kw = {k: v for k, v in kw.items() if k != "external_drafter"}
    for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts):
        base = engine.complete(p, max_tokens=max_tokens, draft=False, **plain_kw)
        spec = engine.complete(p, max_tokens=max_tokens, **kw)
        assert spec.token_ids == base.token_ids, (label, p)
        assert spec.summary.n_drafted > 0 or not drafted, (label, p)
        if sampling is not None:
            s = dict(max_tokens=max_tokens, seed=seed + i, **sampling)
            assert engine.complete(p, **s).token_ids == engine.complete(p, draft=False, **s).token_ids, (label, p)
        done.append(spec)
    return done


def assert_scripted_lossless(engine, prompt, *, max_tokens, **kw):
    """Plain decoding's own continuation drafted back by a ScriptedDrafter (right drafts with planted errors, so
    every acceptance length occurs): the output is plain decoding's, and more than half a draft is accepted per step.
    Returns the drafted completion."""
    base = engine.complete(prompt, max_tokens=max_tokens, draft=False, **kw)
    drafter = ScriptedDrafter(len(engine.prompt_tokens(prompt)), base.token_ids, engine.target.n_vocab)
    spec = engine.complete(prompt, max_tokens=max_tokens, external_drafter=drafter, **kw)
    assert spec.token_ids == base.token_ids, prompt
    assert spec.summary.mean_acceptance_length > 1.5, prompt
    return spec
