"""Targets with recurrent memory: a tiny qwen35 hybrid (Gated DeltaNet + attention layers) and a tiny mamba.

Rejected drafts are rolled back with llama.cpp's recurrent-state snapshots where they cover the rollback, otherwise
with a checkpoint taken before the verify batch and a replay of the accepted tokens. Engines built with a small
n_rs_seq force the second path.
"""

import numpy as np
import pytest
from conftest import make_prompts
from fixtures import write_tiny_drafter, write_tiny_mamba, write_tiny_qwen35
from rollback import check_capture_paths_agree, check_logits_after_rollbacks, scripted_run
from scripted import ScriptedDrafter

from dflash_local import Engine, _native
from dflash_local.bench import run_bench
from dflash_local.engine.placement import Placement


@pytest.fixture(scope="module")
def qwen35(models_dir):
    return write_tiny_qwen35(models_dir / "tiny-qwen35.gguf")


@pytest.fixture(scope="module")
def qwen35_drafter(models_dir, qwen35):
    return write_tiny_drafter(models_dir / "tiny-qwen35-drafter.gguf", qwen35, target_layers=(1, 3), block_size=8)


@pytest.fixture(scope="module")
def hybrid(qwen35, qwen35_drafter):
    """Snapshots for the longest draft (7): every rollback uses them."""
    return Engine(qwen35, qwen35_drafter, n_ctx=1024, draft_policy="fixed")


@pytest.fixture(scope="module")
def hybrid_ckpt(qwen35, qwen35_drafter):
    """Two snapshots: rolling back more than two tokens restores the checkpoint and replays."""
    return Engine(qwen35, qwen35_drafter, n_ctx=1024, draft_policy="fixed", n_rs_seq=2)


@pytest.fixture(scope="module")
def mamba(models_dir):
    target = write_tiny_mamba(models_dir / "tiny-mamba.gguf")
    drafter = write_tiny_drafter(models_dir / "tiny-mamba-drafter.gguf", target, target_layers=(1,), block_size=8)
    return Engine(target, drafter, n_ctx=1024, draft_policy="fixed")


def test_a_ubatch_too_small_for_the_snapshots_is_refused(qwen35, qwen35_drafter):
    """llama.cpp keeps a verify block's last n_rs_seq + 1 tokens in one ubatch and aborts the process when it
    cannot: refused up front (8 tokens cannot hold 7 snapshots' 8 plus the one before them)."""
    with pytest.raises(ValueError, match="ubatch must hold at least 9 tokens, not 8"):
        Engine(qwen35, qwen35_drafter, n_ctx=256, placement=Placement(n_threads=1, n_batch=8, n_ubatch=8))
    e = Engine(qwen35, qwen35_drafter, n_ctx=256, placement=Placement(n_threads=1, n_batch=8, n_ubatch=8), n_rs_seq=6)
    assert e.complete("Hello", max_tokens=16).token_ids == e.complete("Hello", max_tokens=16, draft=False).token_ids


def test_sessions_know_their_memory(hybrid, hybrid_ckpt, mamba):
    assert hybrid.target_info.arch == "qwen35" and hybrid.session.recurrent
    assert hybrid.session.n_rs_seq == hybrid.block_size - 1 == 7
    assert hybrid_ckpt.session.n_rs_seq == 2
    assert hybrid.session.uses_layer_api  # qwen35's graph records layer inputs
    # llama.cpp keeps no snapshots for mamba: every rollback goes through a checkpoint
    assert mamba.session.recurrent and mamba.session.n_rs_seq == 0 and not mamba.session.uses_layer_api


def test_greedy_dflash_is_token_identical_on_the_hybrid_target(hybrid):
    rolled = 0
    for p in make_prompts(55):
        base = hybrid.complete(p, max_tokens=24, draft=False)
        spec = hybrid.complete(p, max_tokens=24, draft=True)
        assert spec.token_ids == base.token_ids, p
        assert spec.text == base.text
        assert spec.summary.n_drafted > 0
        rolled += spec.summary.n_rollbacks
        assert spec.summary.n_checkpoint_rollbacks == 0  # the snapshots cover every draft
    assert rolled > 0


@pytest.mark.parametrize("which,kinds", [("hybrid", {"snapshot"}), ("hybrid_ckpt", {"snapshot", "checkpoint"}),
                                         ("mamba", {"checkpoint"})])
def test_every_acceptance_length_with_each_rollback(request, which, kinds):
    engine = request.getfixturevalue(which)
    base, done, steps = scripted_run(engine, "The quick brown fox", 200)
    assert done.token_ids == base.token_ids and done.text == base.text
    full = [s for s in steps if s.n_drafted == engine.block_size - 1]
    assert {s.n_accepted for s in full} == set(range(engine.block_size))  # 0..B-1, B-1 being the full block
    assert {s.rollback for s in steps if s.rollback} == kinds
    n_rs = engine.session.n_rs_seq
    for s in full:  # the path follows from how many tokens are dropped
        dropped = s.n_drafted - s.n_accepted
        assert s.rollback == ("" if dropped == 0 else "snapshot" if dropped <= n_rs else "checkpoint")
        # a draft longer than the snapshots pays for its checkpoint even when it is all accepted
        assert (s.rollback_ms > 0) == (bool(s.rollback) or s.n_drafted > n_rs)
    assert done.summary.rollback_ms == pytest.approx(sum(s.rollback_ms for s in steps))
    assert done.summary.n_rollbacks == sum(1 for s in steps if s.rollback)


@pytest.mark.parametrize("which", ["hybrid", "hybrid_ckpt", "mamba"])
def test_rollback_over_hundreds_of_steps(request, which):
    engine = request.getfixturevalue(which)
    base, done, steps = scripted_run(engine, "def total(values):\n", 700, seed=7)
    assert done.token_ids == base.token_ids
    assert len(steps) > 150 and sum(1 for s in steps if s.rollback) > 100


@pytest.mark.parametrize("which,kind", [("hybrid", "snapshot"), ("hybrid_ckpt", "checkpoint")])
def test_logits_after_a_rollback_equal_plain_decoding(request, qwen35, which, kind):
    check_logits_after_rollbacks(request.getfixturevalue(which), qwen35, kind)


def test_prefix_cache_across_generations(hybrid, qwen35, qwen35_drafter):
    prompt = "Speculative decoding is"
    n_prompt = len(hybrid.prompt_tokens(prompt))
    first = hybrid.complete(prompt, max_tokens=40)
    # the same prompt again: from the checkpoint before the prompt's last token
    again = hybrid.complete(prompt, max_tokens=40)
    assert again.summary.n_cached == n_prompt - 1 == hybrid.session.checkpoint_pos
    assert again.token_ids == first.token_ids
    # a longer prompt sharing the first: from the checkpoint, and equal to a fresh engine's output
    follow = prompt + first.text + "\nmore"
    cont = hybrid.complete(follow, max_tokens=40)
    assert cont.summary.n_cached == n_prompt - 1
    fresh = Engine(qwen35, qwen35_drafter, n_ctx=1024, draft_policy="fixed")
    assert fresh.complete(follow, max_tokens=40).token_ids == cont.token_ids
    assert hybrid.complete(follow, max_tokens=40, draft=False).token_ids == cont.token_ids
    # a prompt that leaves the cached text before the checkpoint starts afresh
    other = hybrid.complete("Hello world", max_tokens=20)
    assert other.summary.n_cached == 0
    assert other.token_ids == fresh.complete("Hello world", max_tokens=20).token_ids
    # a recurrent state cannot be cut at an arbitrary position
    with pytest.raises(ValueError, match="recurrent target can go back to position 0"):
        hybrid.session.truncate(1)


def test_seeded_sampling_equals_plain_sampling(hybrid_ckpt):
    kw = dict(max_tokens=64, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)
    plain = hybrid_ckpt.complete("Hello", seed=123, draft=False, **kw)
    assert hybrid_ckpt.complete("Hello", seed=123, **kw).token_ids == plain.token_ids
    drafter = ScriptedDrafter(len(hybrid_ckpt.prompt_tokens("Hello")), plain.token_ids, hybrid_ckpt.target.n_vocab,
                              seed=1)
    spec = hybrid_ckpt.complete("Hello", seed=123, external_drafter=drafter, **kw)
    assert spec.token_ids == plain.token_ids
    assert spec.summary.n_accepted > 0 and spec.summary.n_checkpoint_rollbacks > 0


def test_layer_api_and_eval_callback_agree_on_the_hybrid_graph(qwen35, qwen35_drafter):
    check_capture_paths_agree(qwen35, qwen35_drafter, 2)


def test_bench_reports_the_rollback_cost(hybrid_ckpt):
    result = run_bench(hybrid_ckpt, [{"prompt": "The quick brown fox"}], 24, peer=False, log=lambda *_: None)
    o = result["overall"]
    assert o["lossless"] and o["rollbacks"] > 0 and o["checkpoint_rollbacks"] > 0
    assert o["rollback_ms_per_rollback"] > 0 and o["rollback_ms_per_step"] > 0
    assert sorted(o["verify_ms"]) == list(range(1, 9))  # measured from the checkpoint each time
    assert "rollback_ms_per_step" in result["rows"][0]


def test_a_failed_call_empties_a_recurrent_session(qwen35, qwen35_drafter):
    """A drafter given three feature layers where it was made for two rejects them after the target decoded the
    prompt: the recurrent state has moved on and cannot be cut back, so both caches are emptied, and the session
    then decodes as a fresh one. (The features go to the drafter once a drafter batch of them is pending: batches of
    9 here, the smallest that holds the 7 snapshots' tokens, and a longer prompt.)"""
    tgt, dft = _native.Model(str(qwen35)), _native.Model(str(qwen35_drafter), 0, True)
    ids = tgt.tokenize("The quick brown fox jumps over the lazy dog", True, False)
    assert len(ids) > 9
    sp = _native.Sampling()
    s = _native.Session(tgt, dft, [1, 2, 3], 128, 2, True, False, n_batch=9, n_ubatch=9)
    with pytest.raises(_native.NativeError, match="rejected the target features"):
        s.prefill(ids, sp, 0)
    assert s.n_past == 0 and s.checkpoint_pos == -1
    s.set_capture(False)
    fresh = _native.Session(tgt, None, [], 128, 2, True, False)
    assert s.prefill(ids, sp, 0) == fresh.prefill(ids, sp, 0)
    np.testing.assert_array_equal(s.logits(-1), fresh.logits(-1))
