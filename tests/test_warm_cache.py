"""A request served from a warm prompt cache gets what a fresh server gives it, bit for bit (issue #37). The cached
prefix holds positions that prompt chunks, one-token steps and verify blocks computed, past 512 positions; a fresh
engine computes the same positions as prompt chunks. They agree because every CPU kernel gives a row the same bits
whatever batch it is in (docs/lossless.md), flash attention included (upstream's splits a one-token step's cache
across threads from 512 positions on, and fails here); repacked weights, whose GEMM rounds a prompt chunk differently
from a one-token step, show that the comparison catches a kernel that does not."""

import json
from pathlib import Path

import pytest

from dflash_local import Engine
from dflash_local.engine.placement import Placement

ROOT = Path(__file__).resolve().parent.parent
# about 800 tokens of a "rewrite this file" request
PROMPT = json.loads((ROOT / "bench" / "long-prompts.jsonl").read_text().splitlines()[0])["prompt"][:3000]


def answer(engine: Engine, prompt: str):
    """The tokens of a 24-token answer and, for each, its logprob and top 3: every bit a kernel could change."""
    f = engine.complete(prompt, max_tokens=24, logprobs=3)
    return (f.token_ids, [(lp.token, lp.logprob, list(lp.top)) for lp in f.logprobs]), f.summary.n_cached


def warm_and_fresh(kw: dict, draft: bool):
    """Answer PROMPT, then a follow-up (PROMPT, that answer, a question) from the warm cache and on a fresh engine."""
    engine = Engine(**kw)
    n_prompt = len(engine.prompt_tokens(PROMPT))
    assert n_prompt > 600
    first = engine.complete(PROMPT, max_tokens=40, draft=draft)
    assert (first.summary.n_drafted > 0) == draft  # drafts: verify blocks computed some of the cached positions
    follow = PROMPT + first.text + "\n\nWhich names did you change?"
    warm, n_cached = answer(engine, follow)
    assert n_cached > n_prompt + 20  # the cache held decoded positions past 512
    return warm, answer(Engine(**kw), follow)[0]


def test_a_warm_prompt_cache_gives_a_fresh_engines_bits(gemma_target, gemma_drafter):
    warm, fresh = warm_and_fresh(dict(model=gemma_target, draft=gemma_drafter, n_ctx=2048, n_threads=2,
                                      draft_policy="fixed"), draft=True)
    assert warm == fresh


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_flash_attention_and_a_quantized_cache_keep_the_bits(gemma_target, cache_type):
    placement = Placement(n_threads=2, flash_attn="on", cache_type_k=cache_type, cache_type_v=cache_type)
    engine = Engine(gemma_target, n_ctx=2048, placement=placement)
    assert engine.model_info()["bit_exact_verify"]
    warm, fresh = warm_and_fresh(dict(model=gemma_target, n_ctx=2048, placement=placement), draft=False)
    assert warm == fresh


def test_the_comparison_catches_a_kernel_that_rounds_by_batch(gemma_target):
    """Repacked weights: a prompt chunk's rows go through the repacked GEMM, a one-token step through its GEMV."""
    warm, fresh = warm_and_fresh(dict(model=gemma_target, n_ctx=2048, n_threads=2, repack=True), draft=False)
    assert warm != fresh
