"""A request served from a warm prompt cache gets what a fresh server gives it, bit for bit (issue #37). The cached
prefix holds positions that prompt chunks, one-token steps and verify blocks computed, past 512 positions; a fresh
engine computes the same positions as prompt chunks. They agree because every CPU kernel gives a row the same bits
whatever batch it is in (docs/lossless.md); flash attention, which splits a one-token step's cache across threads
from 512 positions on, shows that the comparison catches a kernel that does not."""

import json
from pathlib import Path

from dflash_local import Engine

ROOT = Path(__file__).resolve().parent.parent
# about 800 tokens of a "rewrite this file" request
PROMPT = json.loads((ROOT / "bench" / "long-prompts.jsonl").read_text().splitlines()[0])["prompt"][:3000]


def fresh(engine_kw: dict, prompt: str):
    f = Engine(**engine_kw).complete(prompt, max_tokens=24, logprobs=3)
    return f.token_ids, [(lp.token, lp.logprob, list(lp.top)) for lp in f.logprobs]


def test_a_warm_prompt_cache_gives_a_fresh_engines_bits(gemma_target, gemma_drafter):
    kw = dict(model=gemma_target, draft=gemma_drafter, n_ctx=2048, n_threads=2, draft_policy="fixed")
    engine = Engine(**kw)
    n_prompt = len(engine.prompt_tokens(PROMPT))
    assert n_prompt > 600
    first = engine.complete(PROMPT, max_tokens=40)
    assert first.summary.n_drafted > 0  # verify blocks computed some of the cached positions
    follow = PROMPT + first.text + "\n\nWhich names did you change?"
    warm = engine.complete(follow, max_tokens=24, logprobs=3)
    assert warm.summary.n_cached > n_prompt + 20
    warm_scores = [(lp.token, lp.logprob, list(lp.top)) for lp in warm.logprobs]
    assert (warm.token_ids, warm_scores) == fresh(kw, follow)


def test_the_comparison_catches_a_kernel_that_rounds_by_batch(gemma_target):
    """Flash attention's one-token steps past 512 positions round differently from a prompt chunk's rows."""
    kw = dict(model=gemma_target, n_ctx=2048, n_threads=2, flash_attn=True)
    engine = Engine(**kw)
    first = engine.complete(PROMPT, max_tokens=40, draft=False)
    follow = PROMPT + first.text + "\n\nWhich names did you change?"
    warm = engine.complete(follow, max_tokens=24, logprobs=3)
    assert warm.summary.n_cached > len(engine.prompt_tokens(PROMPT)) + 20
    warm_scores = [(lp.token, lp.logprob, list(lp.top)) for lp in warm.logprobs]
    assert (warm.token_ids, warm_scores) != fresh(kw, follow)
