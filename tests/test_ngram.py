"""N-gram drafts (ngram.py): the lookup, and the engine verifying its drafts beside the DFlash drafter, losslessly."""

import pytest
from conftest import make_prompts
from fixtures import write_tiny_drafter, write_tiny_qwen35
from test_chat import cli

from dflash_local import Engine, StepStats
from dflash_local.engine.ngram import NgramDrafter, NgramSpec
from dflash_local.engine.policy import DraftPolicy

LOOPING = "The lighthouse keeper climbed the narrow stairs every evening"  # gemma-3-270m repeats itself on it


def test_the_lookup_drafts_what_followed_the_latest_earlier_match():
    d = NgramDrafter(NgramSpec(size_n=2, size_m=3))
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert d.draft(tokens, 8) == [5, 6, 1]  # [1, 2] last came before 5, 6, 1, ...; m = 3 tokens at most
    assert d.draft(tokens, 1) == [5]
    tokens += [7]
    assert d.draft(tokens, 8) == []  # [2, 7] is new
    tokens += [1, 2]
    assert d.draft(tokens, 8) == [7, 1, 2]  # the newest earlier match wins: the table grew with the tokens
    assert d.draft(tokens, 0) == []
    assert NgramDrafter(NgramSpec(size_n=4)).draft([1, 2, 3], 8) == []  # shorter than n
    # a match whose continuation reaches the newest token: a loop, drafted on for as long as asked
    assert NgramDrafter(NgramSpec(size_n=1)).draft([5, 5], 8) == [5] * 8
    assert NgramDrafter(NgramSpec(size_n=2, size_m=7)).draft([9, 1, 2, 3, 1, 2, 3, 1, 2], 8) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramDrafter(NgramSpec(size_n=2)).draft([9, 1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    with pytest.raises(ValueError, match="at least 1"):
        NgramSpec(size_n=0)


def test_another_drafters_steps_teach_a_policy_costs_but_not_acceptance():
    p = DraftPolicy(4)
    p.observe(3, 3, 30.0)
    assert p.verify_ms == {4: 30.0} and p.tried == [0.0] * 4 and p.steps_since_draft == 1
    p.update(3, 3, 30.0, 0.1)
    assert p.tried[:3] == [1.0] * 3 and p.steps_since_draft == 0


def steps(events):
    return [e for e in events if isinstance(e, StepStats)]


def test_ngram_drafts_on_gemma_are_lossless_and_accepted(gemma_target, gemma_drafter):
    e = Engine(gemma_target, gemma_drafter, n_ctx=1024, ngram=NgramSpec())
    assert e.spec_types == ["ngram-simple", "dflash"] and e.n_max == 48
    for prompt, kw in [(LOOPING, {}), ("def fibonacci(n):", {}), (LOOPING, {"temperature": 0.8, "seed": 3})]:
        base = e.complete(prompt, max_tokens=160, draft=False, **kw)
        events = list(e.generate(prompt, max_tokens=160, **kw))
        done = events[-1]
        assert done.token_ids == base.token_ids and done.text == base.text, (prompt, kw)
        if prompt == LOOPING and not kw:
            assert done.summary.ngram_steps > 0 and done.summary.ngram_accepted > 20
            # a step verifies an n-gram draft or the drafter's, never both; an n-gram draft may outrun a block
            assert any(s.ngram and s.n_accepted > e.max_draft for s in steps(events))
        assert done.summary.ngram_steps == sum(s.ngram for s in steps(events))
    # ngram=False: the drafter alone, as the bench's DFlash rows measure it
    alone = e.complete(LOOPING, max_tokens=160, ngram=False)
    assert alone.summary.ngram_steps == 0
    assert alone.token_ids == e.complete(LOOPING, max_tokens=160, draft=False).token_ids
    # rejection sampling verifies the drafter's own distribution: no n-gram drafts then
    r = e.complete(LOOPING, max_tokens=64, temperature=0.8, seed=3, spec_sampling="rejection")
    assert r.summary.ngram_steps == 0


def test_logprobs_and_stop_strings_over_long_ngram_steps(gemma_target, gemma_drafter):
    """A step that accepts many n-gram tokens reports a log-probability for each, as plain decoding does, and a
    stop string inside its tokens ends the output there."""
    e = Engine(gemma_target, gemma_drafter, n_ctx=1024, ngram=NgramSpec())
    stop = ["stairs every evening to the top of the tower.\n\nThe lighthouse keeper climbed the narrow stairs every"]
    spec = e.complete(LOOPING, max_tokens=160, logprobs=2, stop=stop)
    base = e.complete(LOOPING, max_tokens=160, logprobs=2, stop=stop, draft=False)
    assert spec.summary.ngram_accepted > 8 and spec.summary.finish_reason == base.summary.finish_reason == "stop"
    assert spec.text == base.text and spec.token_ids == base.token_ids
    assert len(spec.logprobs) == len(spec.token_ids)
    for a, b in zip(spec.logprobs, base.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_ngram_alone_needs_no_drafter(gemma_target):
    e = Engine(gemma_target, None, n_ctx=1024, ngram=NgramSpec(size_n=4, size_m=16))
    assert e.spec_types == ["ngram-simple"] and e.n_max == 16
    base = e.complete(LOOPING, max_tokens=160, draft=False)
    events = list(e.generate(LOOPING, max_tokens=160))
    spec = events[-1]
    assert spec.token_ids == base.token_ids
    assert spec.summary.ngram_steps > 0 and base.summary.ngram_steps == 0
    assert all(s.ngram for s in steps(events) if s.n_drafted)  # the lookup is all that drafts
    assert spec.summary.steps < base.summary.steps


def test_ngram_drafts_past_the_snapshots_roll_back_a_hybrid_target(models_dir):
    """Long n-gram drafts on a recurrent target with 2 state snapshots: a rejected draft of more than 2 tokens is
    rolled back by checkpoint and replay, and the output stays plain decoding's. (The tiny random target does not
    repeat itself, so one-token matches make the drafts, and the fixed policy verifies each whole.)"""
    target = write_tiny_qwen35(models_dir / "tiny-qwen35-ngram.gguf")
    drafter = write_tiny_drafter(models_dir / "tiny-qwen35-ngram-drafter.gguf", target, target_layers=(1, 3),
                                 block_size=8)
    e = Engine(target, drafter, n_ctx=1024, n_rs_seq=2, draft_policy="fixed", ngram=NgramSpec(size_n=1))
    kinds, longest = set(), 0
    for p in make_prompts(6):
        base = e.complete(p, max_tokens=64, draft=False)
        events = list(e.generate(p, max_tokens=64))
        assert events[-1].token_ids == base.token_ids, p
        for s in steps(events):
            if s.ngram:
                kinds.add(s.rollback)
                longest = max(longest, s.n_drafted)
    assert "checkpoint" in kinds and longest > e.max_draft


def test_spec_type_flags(gemma_target, gemma_drafter):
    r = cli("generate", "-m", gemma_target, "--spec-type", "ngram-simple", "-p", LOOPING, "-n", "96",
            "--spec-ngram-simple-size-n", "4")
    assert r.returncode == 0, r.stderr
    assert "n-gram drafts:" in r.stderr and "acceptance by block position" in r.stderr  # of the lookup's drafts
    assert "loading gemma-3-270m-q4_k_m.gguf\n" in r.stderr  # and no drafter
    plain = cli("generate", "-m", gemma_target, "--no-draft", "-p", LOOPING, "-n", "96")
    assert r.stdout == plain.stdout and "n-gram drafts:" not in plain.stderr
    r = cli("generate", "-m", gemma_target, "--spec-type", "eagle3", "-p", "x")
    assert r.returncode == 2 and "eagle3: the types are ngram-simple, dflash" in r.stderr
    r = cli("generate", "-m", gemma_target, "-d", gemma_drafter, "--spec-type", "ngram-simple", "-p", "x")
    assert r.returncode != 0 and "the drafter would not be used" in r.stderr
    r = cli("bench", "-m", gemma_target, "--spec-type", "ngram-simple")
    assert r.returncode != 0 and "keep dflash in --spec-type" in r.stderr
