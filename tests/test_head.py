"""A CPU target's LM head on demand (native/head.cpp): a verify batch stops after the final norm and the head runs
only for the rows the accept loop reads, with the target's own output matrix and ggml kernel. Every row's logits
must be llama.cpp's own, bit for bit, so verification stays lossless."""

import numpy as np
import pytest

from fixtures import write_tiny_gemma4, write_tiny_qwen35

from dflash_local import Engine, _native
from dflash_local.bench import own_continuation

GREEDY = _native.Sampling()


def _verify(s, last, draft, on, head_rows=1):
    """One verify step with the head on demand or from llama.cpp, the logits of all its rows, the session put back."""
    s.set_head_on_demand(on)
    p0 = s.n_past
    r = s.step(last, draft, GREEDY, 1, head_rows)
    rows = np.stack([s.logits(i) for i in range(len(draft) + 1)])  # rows past a rejection: computed here
    assert np.array_equal(s.logits(-1), rows[-1])
    s.truncate(p0)
    return r, rows


@pytest.fixture(scope="module")
def qwen35(models_dir):
    return write_tiny_qwen35(models_dir / "tiny-qwen35-head.gguf")


@pytest.mark.parametrize("which", ["gemma", "tiny", "qwen35"])
def test_rows_read_on_demand_are_llama_cpps_logits_bit_for_bit(which, gemma_target, tiny_target, qwen35):
    path = {"gemma": gemma_target, "tiny": tiny_target, "qwen35": qwen35}[which]
    e = Engine(path, n_ctx=256, n_rs_seq=8)  # qwen35: rollback by snapshot keeps the rows (a replay has none)
    s = e.session
    assert not s.head_on_demand  # found in the graph of the first decode with logits
    last = s.prefill(e.prompt_tokens("def total(values):\n    s = 0\n"), GREEDY, 0)
    assert s.head_on_demand
    s.checkpoint()  # the recurrent target comes back here after each step
    own = own_continuation(s, last, 8, GREEDY)
    wrong = (own[3] + 1) % e.target.n_vocab
    cases = [
        (own[1:2], 1, 2),  # (draft, head_rows asked for, rows the head computes)
        (own[1:5], 1, 5),  # all accepted: 1, 1, 2 and 1 rows
        (own[1:9], 9, 9),  # all accepted, one call
        (own[1:3] + [wrong] + own[4:9], 1, 4),  # rejected at the third draft: rows 4..8 never computed
        (own[1:3] + [wrong] + own[4:9], 9, 9),
    ]
    for draft, head_rows, computed in cases:
        r_on, rows_on = _verify(s, last, draft, True, head_rows)
        r_off, rows_off = _verify(s, last, draft, False)
        assert r_on.tokens == r_off.tokens
        assert r_on.n_accepted == (len(draft) if wrong not in draft else 2)
        assert np.array_equal(rows_on.view(np.uint32), rows_off.view(np.uint32))
        assert (r_on.head_rows, r_off.head_rows) == (computed, 0)
        assert 0 < r_on.head_ms <= r_on.verify_ms and r_off.head_ms == 0
    # a plain step reads its one row: llama.cpp computes it, unless the greedy head does, with AVX512-VNNI (gemma:
    # test_greedy_head.py)
    s.set_head_on_demand(True)
    r = s.step(last, [], GREEDY, 1)
    assert r.head_rows == (1 if s.greedy_head and _native.greedy_head_fast() else 0) and r.tokens == own[1:2]


def test_a_head_with_soft_capping_stays_in_llama_cpp(models_dir):
    # gemma4 soft-caps its logits after the matmul: the graph's last node is no plain matmul of the final norm
    e = Engine(write_tiny_gemma4(models_dir / "tiny-gemma4-head.gguf"), n_ctx=128)
    e.session.prefill(e.prompt_tokens("def total(values):"), GREEDY, 0)
    assert not e.session.head_on_demand
    r = e.session.step(1, [2, 3], GREEDY, 1)
    assert r.head_rows == 0 and r.head_ms == 0


def test_engine_drafts_with_the_head_on_demand_token_identical_to_plain(gemma_engine):
    prompt = "The history of the printing press"
    plain = gemma_engine.complete(prompt, max_tokens=48, draft=False)
    spec = gemma_engine.complete(prompt, max_tokens=48)
    assert gemma_engine.session.head_on_demand
    assert spec.token_ids == plain.token_ids
    assert spec.summary.n_accepted < spec.summary.n_drafted  # rejections: rows left without a head
