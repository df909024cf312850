"""Sliding-window layers keep only their window (issue #37), still bit-exact.

llama.cpp's window cache holds n_swa + n_ubatch cells a sequence instead of the whole context, and our patch to it
(native/llama/patch_llama.py) puts position p in cell p mod size, so that attention sums a window's cells in the
same order whatever came before. Here a tiny gemma4 (a window of 8 tokens) with 16-token ubatches has 256 window
cells: generations of several hundred tokens wrap around them many times, across rejected drafts, warm prompt caches
and parallel slots, and every output must equal plain decoding and a fresh engine's."""

import pytest
from rollback import scripted_run
from test_slots import interleave

from dflash_local import Engine
from dflash_local.engine.placement import Placement

CELLS = 256  # llama.cpp's window cache: n_swa + n_ubatch = 8 + 16, in whole 256-cell pages
PROMPT = "def total(values):\n    result = 0\n"


def engine(target, drafter=None, n_ctx=2048, flash_attn="off", **kw):
    return Engine(target, drafter, n_ctx=n_ctx, draft_policy="fixed",
                  placement=Placement(n_threads=2, n_batch=64, n_ubatch=16, flash_attn=flash_attn), **kw)


def kv_bytes(e: Engine) -> int:
    return sum(ctx for _, _, ctx, _ in e.session.memory("target"))


def answer(e: Engine, prompt, **kw):
    """Tokens, logprobs and top 3 of a 40-token answer: every bit a kernel could change."""
    f = e.complete(prompt, max_tokens=40, logprobs=3, **kw)
    return (f.token_ids, [(lp.token, lp.logprob, list(lp.top)) for lp in f.logprobs]), f.summary.n_cached


def test_the_sliding_layers_hold_their_window_not_the_context(gemma4):
    """Four times the context: only the full-attention layers' cache grows (with every position in the sliding
    layers' too it would be four times the size)."""
    small, large = kv_bytes(engine(gemma4, n_ctx=1024)), kv_bytes(engine(gemma4, n_ctx=4096))
    assert small < large < 2.5 * small


@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_drafting_equals_plain_decoding_across_many_wraps(gemma4, gemma4_drafter, flash_attn):
    """With flash attention too: upstream's splits a one-token step's cache across threads past 512 cells and tiles
    batches of 32 rows or more, so verify rows and prompt chunks rounded differently from plain steps."""
    e = engine(gemma4, gemma4_drafter, flash_attn=flash_attn)
    assert e.model_info()["bit_exact_verify"]
    base, done, steps = scripted_run(e, PROMPT, 900, seed=5)  # every acceptance length, 3.5 times round the cells
    assert done.token_ids == base.token_ids
    assert sum(1 for s in steps if s.rollback) > 100
    assert e.session.reuse_floor() > CELLS  # the oldest positions are gone
    spec, plain = e.complete(PROMPT * 12, max_tokens=300), e.complete(PROMPT * 12, max_tokens=300, draft=False)
    assert spec.summary.n_drafted > 0 and spec.summary.n_rollbacks > 0
    assert spec.token_ids == plain.token_ids


def test_a_warm_cache_gives_a_fresh_engines_bits_past_the_window(gemma4, gemma4_drafter):
    e = engine(gemma4, gemma4_drafter)
    ids = e.prompt_tokens(PROMPT * 6)
    follow = ids + e.complete(ids, max_tokens=400).token_ids + e.prompt_tokens("What does it return?")
    warm, n_cached = answer(e, follow)
    assert n_cached > CELLS + 100  # reused past many overwritten cells, decoded positions included
    assert warm == answer(engine(gemma4, gemma4_drafter), follow)[0]
    # a prompt that shares less than the cells still hold: the window before it is gone, so it starts afresh
    short = ids[:100]
    redo, n_cached = answer(e, short)
    assert n_cached == 0 and redo == answer(engine(gemma4, gemma4_drafter), short)[0]


def test_a_prompt_without_the_last_answer_resumes_from_the_checkpoint(gemma4, gemma4_drafter):
    """A chat template that leaves an answer's reasoning out of the history: the next prompt shares the previous
    prompt, not the answer, whose hundreds of tokens overwrote the prompt's window. The prompt's checkpoint (its
    window cells, saved before its last token) takes the cache back there, and the answer is a fresh engine's."""
    e = engine(gemma4, gemma4_drafter)
    ids = e.prompt_tokens(PROMPT * 6)
    e.complete(ids, max_tokens=400)
    assert e.session.reuse_floor() > len(ids)  # the prompt's window is overwritten
    follow = ids + e.prompt_tokens("What does it return?")
    warm, n_cached = answer(e, follow)
    assert n_cached == len(ids) - 1
    assert warm == answer(engine(gemma4, gemma4_drafter), follow)[0]
    # and again from that checkpoint's own successor: the follow-up's checkpoint, past another long answer
    e.complete(follow, max_tokens=400, draft=False)
    again, n_cached = answer(e, follow + e.prompt_tokens("And for an empty list?"))
    assert n_cached == len(follow) - 1
    assert again == answer(engine(gemma4, gemma4_drafter), follow + e.prompt_tokens("And for an empty list?"))[0]


def test_a_checkpoint_with_free_cells_comes_back_to_its_own_cells(gemma4, gemma4_drafter):
    """A checkpoint taken after the cache went back inside its window holds fewer cells than the cache has, and not
    cell 0: restored, the answer after it is still a fresh engine's."""
    e = engine(gemma4, gemma4_drafter)
    ids = e.prompt_tokens(PROMPT * 6)
    out = e.complete(ids, max_tokens=403).token_ids
    floor = e.session.reuse_floor()
    # wrapped, the oldest cell held off a lane boundary, and a cut before position 256, which holds cell 0
    assert 0 < floor - 7 and (floor - 7) % 8 != 0 and floor + 10 < CELLS
    # back inside the window held, a few new tokens: the checkpoint holds the positions from the oldest on, not the
    # ones past the cut, which held cell 0
    second = (ids + out)[: floor + 10] + e.prompt_tokens("Why?")
    assert answer(e, second)[1] == floor + 10
    e.complete(second, max_tokens=400, draft=False)
    third = second + e.prompt_tokens("Say it again.")
    warm, n_cached = answer(e, third)
    assert n_cached == len(second) - 1
    assert warm == answer(engine(gemma4, gemma4_drafter), third)[0]


def test_truncating_below_the_window_held_is_refused(gemma4):
    e = engine(gemma4)
    e.complete(PROMPT, max_tokens=500, draft=False)
    s, floor = e.session, e.session.reuse_floor()
    assert CELLS < floor < s.past(0)
    with pytest.raises(ValueError, match="sliding-window cache holds a full window from position"):
        s.truncate(floor - 1)
    s.truncate(floor)  # the last position it can keep, and none
    s.truncate(0)
    e.cache.clear()


def test_parallel_slots_each_keep_their_own_window(gemma4, gemma4_drafter):
    jobs = {0: dict(prompt=PROMPT, max_tokens=400), 1: dict(prompt="The quick brown fox", max_tokens=350),
            2: dict(prompt=PROMPT * 3, max_tokens=300, temperature=0.9, seed=3)}
    together = interleave(engine(gemma4, gemma4_drafter, n_slots=3), jobs)
    for slot, kw in jobs.items():
        assert together[slot][0].token_ids == engine(gemma4, gemma4_drafter).complete(**kw).token_ids, slot
