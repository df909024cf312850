"""Two rows at least in every target decode (Session::pad in native/session.h). llamafile's sgemm, as upstream builds
it, computes each row of a batch with the same bits whatever the batch size, but ggml never gives it a row alone: a
one-token decode goes to vec_dot, which rounds differently. So where the build has upstream's sgemm, a one-token
decode carries a scratch row, no batch leaves a ubatch of one row, and the LM head on demand computes its rows by
vec_dot.

Where it has not (the default setup: sgemm kept to batch-invariant products, native/ggml/patch_ggml.py),
DFLASH_PAD_ROWS=1 switches the same mechanism on: every kernel is then exact anyway, so these tests check the mechanism
(the scratch row dropped after each decode, so that the context still fills to its last cell; the caller's features
and logits; ubatch edges). With upstream's llamafile build they check exactness itself, and that without the padding it
fails. Recurrent targets are not padded (see native/session.h)."""

import os

import numpy as np
import pytest
from conftest import make_prompts
from fixtures import write_tiny_qwen35
from lossless import assert_lossless, assert_scripted_lossless
from scripted import ScriptedDrafter

from dflash_local import Engine, _native
from dflash_local.engine.placement import Placement

SGEMM = _native.sgemm_skips_one_row()  # upstream's sgemm: a row alone goes to vec_dot


def padded(*args, pad="1", **kw) -> Engine:
    """An engine whose session pads (pad "1") or not ("0"), whatever the build."""
    old = os.environ.get("DFLASH_PAD_ROWS")
    os.environ["DFLASH_PAD_ROWS"] = pad
    try:
        return Engine(*args, **kw)
    finally:
        if old is None:
            del os.environ["DFLASH_PAD_ROWS"]
        else:
            os.environ["DFLASH_PAD_ROWS"] = old


@pytest.fixture(scope="module")
def gemma_padded(gemma_target, gemma_drafter):
    return padded(gemma_target, gemma_drafter, n_ctx=2048, draft_policy="fixed")


def test_a_session_pads_where_the_build_has_sgemm(tiny_target):
    """Auto: on for a CPU target exactly where llama.cpp has upstream's sgemm; off with one-row ubatches, which are
    exact."""
    assert Engine(tiny_target, n_ctx=256).session.pads_rows == SGEMM
    assert padded(tiny_target, n_ctx=256).session.pads_rows
    assert not padded(tiny_target, n_ctx=256, pad="0").session.pads_rows
    assert not padded(tiny_target, n_ctx=256, placement=Placement(n_ubatch=1)).session.pads_rows


PROMPTS = make_prompts(12, seed=3) + ["The history of the printing press", "def fibonacci(n):"]


def outputs_that_differ(engine, prompts, max_tokens=96) -> int:
    """Prompts whose output with the drafter's drafts or with scripted ones (plain decoding's continuation with
    planted errors) differs from plain decoding (bench/kernels.py's check)."""
    differ = 0
    for p in prompts:
        base = engine.complete(p, max_tokens=max_tokens, draft=False)
        own = engine.complete(p, max_tokens=max_tokens)
        drafter = ScriptedDrafter(len(engine.prompt_tokens(p)), base.token_ids, engine.target.n_vocab)
        scripted = engine.complete(p, max_tokens=max_tokens, external_drafter=drafter)
        differ += own.token_ids != base.token_ids or scripted.token_ids != base.token_ids
    return differ


def test_gemma_drafts_losslessly_with_the_padding(gemma_padded):
    assert gemma_padded.session.pads_rows and gemma_padded.bit_exact and gemma_padded.model_info()["padded_decode"]
    assert outputs_that_differ(gemma_padded, PROMPTS) == 0
    assert_lossless(gemma_padded, PROMPTS[:2], max_tokens=48, sampling=dict(temperature=0.8, top_k=40, top_p=0.95))


def test_the_context_fills_to_its_last_cell(tiny_target, tiny_drafter):
    """The scratch row leaves the cache after every decode (else the unified cache would fill before the context
    does), and the last cell, which has no room for one, is decoded alone with drafts or without."""
    engine = padded(tiny_target, tiny_drafter, n_ctx=256, draft_policy="fixed")
    for p in ("The quick brown fox", "Once upon a time"):
        base = engine.complete(p, max_tokens=None, draft=False)
        assert len(engine.prompt_tokens(p)) + len(base.token_ids) == 256, p
        spec = assert_lossless(engine, p, max_tokens=None)[0]
        assert spec.summary.n_drafted > 0


def test_no_ubatch_of_one_row(tiny_target, tiny_drafter):
    """With -ub 4 a prompt or a verify block of 5 or 9 rows would leave a row alone: prompts are cut before it, and
    a block loses its last draft."""
    engine = padded(tiny_target, tiny_drafter, n_ctx=512, draft_policy="fixed",
                    placement=Placement(n_batch=16, n_ubatch=4))
    for p in ("a b c d", "The quick brown fox jumps", make_prompts(1, seed=5)[0]):  # prompts of several lengths
        spec = assert_scripted_lossless(engine, p, max_tokens=80)
        assert spec.summary.n_drafted > 0


def test_recurrent_targets_are_not_padded(models_dir):
    """Their recurrent layers multiply per sequence, one row each even in a padded decode: with sgemm built in they
    cannot be exact, and the engine says so."""
    qwen35 = write_tiny_qwen35(models_dir / "tiny-qwen35-pad.gguf")
    engine = padded(qwen35, n_ctx=256)
    assert engine.session.recurrent and not engine.session.pads_rows
    assert engine.bit_exact == (not SGEMM)


def first_row_logits(engine, prompt, n_draft):
    """Logits of a step's first row after the prompt, the step verifying n_draft tokens (0: a plain step)."""
    s, sp = engine.session, _native.Sampling()
    engine.cache.clear()  # the session is driven by hand
    s.truncate(0)
    s.set_capture(False)
    last = s.prefill(engine.prompt_tokens(prompt), sp, 0)
    s.step(last, [last] * n_draft, sp, 1)
    row = s.logits(0)
    s.truncate(0)
    s.set_capture(True)
    return row


def test_a_plain_step_and_a_verify_block_give_the_same_bits(gemma_padded):
    plain = first_row_logits(gemma_padded, "The history of the printing press", 0)
    for n in (1, 3, 8):
        np.testing.assert_array_equal(first_row_logits(gemma_padded, "The history of the printing press", n), plain)


@pytest.mark.skipif(not SGEMM, reason="this llama.cpp has no sgemm, or setup.sh's batch-invariant one")
def test_without_the_padding_sgemm_breaks_exactness(gemma_target, gemma_drafter):
    """The test above can fail: unpadded, some verify blocks round differently from one-token decodes."""
    engine = padded(gemma_target, gemma_drafter, n_ctx=2048, draft_policy="fixed", pad="0")
    assert outputs_that_differ(engine, PROMPTS) > 0
