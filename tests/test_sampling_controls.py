"""llama.cpp's sampling controls (grammar, JSON schema, logit bias, penalties) and logprobs: DFlash output equals
plain decoding under each, greedy and seeded, on the tiny target with scripted drafts and on gemma with the shipped
drafter."""

import json
import os
import shutil
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
from scripted import ScriptedDrafter

from dflash_local import Engine, StepStats, _native
from dflash_local.engine.placement import FLASH_ATTN
from dflash_local import models

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
}
# The tiny target's byte tokens can spell invalid UTF-8, which the grammar counts as one character and Python's
# decoder as several: its outputs are checked without the length limits (gemma's are checked with them)
LOOSE = {**PERSON, "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                  "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
NO_DIGITS = 'root ::= [^0-9]+'  # a grammar that lets the tiny target run long

CONTROLS = {
    "grammar": dict(grammar=NO_DIGITS),
    "json_schema": dict(json_schema=PERSON),
    "logit_bias": dict(logit_bias={5: 6.0, 12: -100.0, 40: False}),
    "repeat_penalty": dict(repeat_penalty=1.4, repeat_last_n=16),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=0.8, repeat_last_n=-1),
    "all": dict(grammar=NO_DIGITS, logit_bias={5: 3.0}, repeat_penalty=1.2, presence_penalty=0.4,
                frequency_penalty=0.3, repeat_last_n=24),
}
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)


def scripted_run(engine, prompt, max_tokens, **kw):
    """Plain decoding, then DFlash with drafts of the plain output with planted errors at every position."""
    base = engine.complete(prompt, max_tokens=max_tokens, draft=False, **kw)
    n_prompt = len(engine.prompt_tokens(prompt))
    drafter = ScriptedDrafter(n_prompt, base.token_ids, engine.target.n_vocab)
    events = list(engine.generate(prompt, max_tokens=max_tokens, external_drafter=drafter, **kw))
    steps = [e for e in events if isinstance(e, StepStats)]
    return base, events[-1], {s.n_accepted for s in steps}


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", CONTROLS)
def test_dflash_equals_plain_decoding_under_each_control(tiny_engine, name, sampling):
    kw = CONTROLS[name] | sampling
    for prompt in ("The quick brown fox", "def total(values):\n"):
        base, spec, accepted = scripted_run(tiny_engine, prompt, 120, **kw)
        assert spec.token_ids == base.token_ids and spec.text == base.text, (name, prompt)
        assert base.token_ids != tiny_engine.complete(prompt, max_tokens=120, draft=False, **sampling).token_ids
        if len(base.token_ids) >= 100:  # long outputs see every acceptance length, 0 .. B-1
            assert accepted == set(range(tiny_engine.block_size)), accepted
        assert max(accepted) > 0


def test_constrained_outputs_follow_their_grammar_and_schema(tiny_engine):
    for sampling in ({}, SAMPLED, dict(SAMPLED, seed=5), dict(temperature=1.5, seed=2)):
        out = tiny_engine.complete("Person:", max_tokens=200, json_schema=PERSON, **sampling)
        assert out.summary.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), LOOSE)
        out = tiny_engine.complete("Count:", max_tokens=40, grammar=NO_DIGITS, **sampling)
        assert out.text and not set(out.text) & set("0123456789")
    # any JSON object, as response_format json_object asks
    assert isinstance(json.loads(tiny_engine.complete("x", max_tokens=300, json_schema={}).text), dict)


def test_the_grammar_cuts_drafts_where_they_leave_it(tiny_engine):
    digits = tiny_engine.tokenize("0123456789")
    prompt = "The quick brown fox"
    base = tiny_engine.complete(prompt, max_tokens=40, draft=False, grammar=NO_DIGITS)
    n_prompt = len(tiny_engine.prompt_tokens(prompt))

    def drafter(tokens, n):  # the right continuation with a digit planted at position 2
        j = len(tokens) - n_prompt
        d = (base.token_ids[j : j + n] + [0] * n)[:n]
        return d[:2] + [digits[-1]] + d[3:] if n > 2 else d

    events = list(tiny_engine.generate(prompt, max_tokens=40, grammar=NO_DIGITS, external_drafter=drafter))
    assert events[-1].token_ids == base.token_ids
    steps = [e for e in events if isinstance(e, StepStats)]
    assert all(s.n_drafted <= 2 for s in steps) and any(s.n_accepted == 2 for s in steps)


def test_logit_bias_and_penalties_act_as_llama_cpp_says(tiny_engine):
    prompt = "The quick brown fox"
    plain = tiny_engine.complete(prompt, max_tokens=30, draft=False)
    top = plain.token_ids[0]
    assert tiny_engine.complete(prompt, max_tokens=30, logit_bias={top: -100}).token_ids[0] != top
    assert top not in tiny_engine.complete(prompt, max_tokens=30, logit_bias={top: False}).token_ids
    assert set(tiny_engine.complete(prompt, max_tokens=5, logit_bias={7: 100}).token_ids) == {7}
    # a strong presence penalty over the whole context never repeats a token while others are left
    out = tiny_engine.complete(prompt, max_tokens=30, presence_penalty=1e4, repeat_last_n=-1)
    prompt_ids = set(tiny_engine.prompt_tokens(prompt))
    assert len(set(out.token_ids)) == len(out.token_ids) and not prompt_ids & set(out.token_ids)
    # repeat_last_n = 0 turns the penalties off
    assert tiny_engine.complete(prompt, max_tokens=30, presence_penalty=1e4, repeat_last_n=0).token_ids == \
        plain.token_ids


def test_logprobs_equal_across_modes_and_a_log_softmax_of_the_logits(tiny_engine):
    prompt = "def total(values):\n"
    for sampling in ({}, SAMPLED):
        base, spec, _ = scripted_run(tiny_engine, prompt, 40, logprobs=3, **sampling)
        assert spec.token_ids == base.token_ids
        assert [(e.token, e.logprob, e.top) for e in spec.logprobs] == \
            [(e.token, e.logprob, e.top) for e in base.logprobs]
        assert [e.token for e in base.logprobs] == base.token_ids
        # independently: decode the prompt and output so far in a fresh session, log-softmax each row in numpy
        ids = tiny_engine.prompt_tokens(prompt)
        s = _native.Session(tiny_engine.target, None, [], 256, 1, False, FLASH_ATTN[tiny_engine.placement.fa])
        for i, e in enumerate(base.logprobs):
            s.truncate(0)
            s.prefill(ids + base.token_ids[:i], _native.Sampling(), 0)
            x = s.logits(-1).astype(np.float64)
            lsm = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert e.logprob == pytest.approx(lsm[e.token], abs=1e-4)
            order = np.argsort(-lsm, kind="stable")[:3]
            assert [t for t, _ in e.top] == list(order)
            assert [lp for _, lp in e.top] == pytest.approx(lsm[order], abs=1e-4)
    # logprobs=0: the token's own only; not asked: none
    out = tiny_engine.complete(prompt, max_tokens=5, logprobs=0)
    assert len(out.logprobs) == 5 and all(e.top == [] for e in out.logprobs)
    assert tiny_engine.complete(prompt, max_tokens=5).logprobs is None


@pytest.mark.parametrize("kw,message", [
    (dict(grammar="root ::= undefined"), "grammar does not parse"),
    (dict(grammar='root ::= "a'), "grammar does not parse"),
    (dict(grammar="root ::= x\nx ::= x \"a\""), "grammar does not parse"),  # left recursion
    (dict(grammar="root ::= [a]", json_schema={}), "not both"),
    (dict(json_schema="{"), "not valid JSON"),
    (dict(logit_bias={"x": 1}), "not a token id"),
    (dict(logit_bias={10**7: 1}), "outside the vocabulary"),
    (dict(logit_bias={1: "big"}), "must be a number"),
    (dict(repeat_penalty=0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_controls_are_clear_errors(tiny_engine, kw, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.complete("x", max_tokens=3, **kw)
    assert tiny_engine.complete("x", max_tokens=3).token_ids  # and the engine goes on


def test_gemma_with_the_shipped_drafter_is_lossless_under_the_controls():
    engine = Engine(models.target("gemma"), models.drafter("gemma"), n_ctx=1024, draft_policy="fixed")
    prompt = "Write a JSON object describing a person called Ada:"
    for kw in (dict(json_schema=PERSON), dict(repeat_penalty=1.3, presence_penalty=0.5, logit_bias={236761: -5}),
               dict(json_schema=PERSON, frequency_penalty=0.5, **SAMPLED), dict(logprobs=2, **SAMPLED)):
        base = engine.complete(prompt, max_tokens=48, draft=False, **kw)
        spec = engine.complete(prompt, max_tokens=48, **kw)
        assert spec.token_ids == base.token_ids, kw
        assert spec.summary.n_drafted > 0
        if "json_schema" in kw and base.summary.finish_reason == "eos":
            jsonschema.validate(json.loads(base.text), PERSON)
        if "logprobs" in kw:
            assert [(e.token, e.logprob, e.top) for e in spec.logprobs] == \
                [(e.token, e.logprob, e.top) for e in base.logprobs]


def test_generate_json_schema_on_gemma_validates_and_equals_no_draft(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    outs = []
    for extra in (["-j", json.dumps(PERSON)], ["-jf", str(schema), "--no-draft"]):
        # the venv's own command, found also when its bin/ is not on PATH
        cli = shutil.which("dflash-local", path=os.path.dirname(sys.executable)) or "dflash-local"
        r = subprocess.run([cli, "generate", "-m", "gemma", "-p", "Describe Ada as JSON:", "-n", "96",
                            "--json", *extra], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    spec, plain = outs
    assert spec["drafting"] and not plain["drafting"]
    assert spec["token_ids"] == plain["token_ids"] and spec["finish_reason"] == "eos"
    jsonschema.validate(json.loads(spec["text"]), PERSON)
