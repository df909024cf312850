"""Checks shared by the rollback tests of several targets (tests/test_hybrid.py, test_gemma4.py,
test_qwen35_upstream.py): scripted drafts against plain decoding, the logits plain decoding reaches, the state left by
a rollback, and the two feature-capture paths."""

import numpy as np
from conftest import make_prompts
from scripted import ScriptedDrafter

from dflash_local import Engine, Finished, StepStats, _native


def generate_steps(engine, prompt, max_tokens, **kw) -> tuple[Finished, list[StepStats]]:
    """A generation's result and its steps."""
    events = list(engine.generate(prompt, max_tokens=max_tokens, **kw))
    assert isinstance(events[-1], Finished)
    return events[-1], [e for e in events if isinstance(e, StepStats)]


def scripted_run(engine, prompt, max_tokens, seed=None):
    base = engine.complete(prompt, max_tokens=max_tokens, draft=False)
    drafter = ScriptedDrafter(len(engine.prompt_tokens(prompt)), base.token_ids, engine.target.n_vocab, seed=seed)
    done, steps = generate_steps(engine, prompt, max_tokens, external_drafter=drafter)
    return base, done, steps


def plain_logits(target, ids, cont, n):
    """The logits plain decoding reaches after the prompt ids and cont[0..n-1], fed token by token."""
    sp = _native.Sampling()
    plain = Engine(target, n_ctx=1024).session
    plain.set_capture(False)
    plain.prefill(ids, sp, 0)
    for i in range(n):
        plain.step(cont[i], [], sp, i + 1)
    return plain.logits(0)


def check_logits_after_rollbacks(engine, target, kind):
    """The state after dropping rejected drafts is exactly the state plain decoding reaches (llama_memory_seq_rm
    alone would say true and leave a wrong state for a rollback across decodes). Drives the engine's session by hand:
    all 7 drafts rejected, then 2 of 7 accepted, each rolled back the way `kind` names."""
    prompt = "def total(values):"
    cont = engine.complete(prompt, max_tokens=12, draft=False).token_ids
    ids, sp, s = engine.prompt_tokens(prompt), _native.Sampling(), engine.session
    want = plain_logits(target, ids, cont, 5)  # after cont[0..4]

    s.truncate(0)
    engine.cache.clear()
    s.set_capture(True)
    assert s.prefill(ids, sp, 0) == cont[0]
    draft = list(cont[1:8])
    draft[0] = (draft[0] + 1) % engine.target.n_vocab  # rejects all 7 drafts
    r = s.step(cont[0], draft, sp, 1)
    assert (r.n_accepted, r.tokens, r.rollback) == (0, [cont[1]], kind)
    draft = list(cont[2:9])
    draft[2] = (draft[2] + 1) % engine.target.n_vocab  # accepts 2 of 7
    r = s.step(cont[1], draft, sp, 2)
    assert (r.n_accepted, r.tokens, r.rollback) == (2, cont[2:5], kind)
    s.step(cont[4], [], sp, 5)
    np.testing.assert_array_equal(s.logits(0), want)
    s.truncate(0)


def check_capture_paths_agree(target, drafter, n_layers):
    """The layer-input export and the eval callback capture the same features, and draft the same output."""
    a = Engine(target, drafter, n_ctx=256, capture="layer_api")
    b = Engine(target, drafter, n_ctx=256, capture="callback")
    ids, sp = a.prompt_tokens("def add(a, b):\n    return a + b\n"), _native.Sampling()
    assert a.session.prefill(ids, sp, 0) == b.session.prefill(ids, sp, 0)
    fa, fb = a.session.features(), b.session.features()
    assert fa.shape == (len(ids), n_layers * a.target.n_embd) and np.abs(fa).max() > 0
    np.testing.assert_array_equal(fa, fb)
    for p in make_prompts(4):
        assert a.complete(p, max_tokens=16).token_ids == b.complete(p, max_tokens=16).token_ids
