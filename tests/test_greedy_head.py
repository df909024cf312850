"""The greedy LM head (native/greedy_head.cpp): a greedy row's logits computed exactly only for the tokens an int8
bound cannot rule out. The row's argmax, ties included, must be the full row's, so greedy decoding stays token-identical
to plain decoding with the full head."""

import gguf
import numpy as np
import pytest
from fixtures import write_tiny_target
from scripted import ScriptedDrafter

from dflash_local import Engine, _native
from dflash_local.bench import own_continuation

GREEDY = _native.Sampling()


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)


# the int8 copy's dot products are AVX512-VNNI (greedy_head.cpp); elsewhere the full head serves every row, which the
# generation tests below still check
needs_vnni = pytest.mark.skipif(not _cpu_has_vnni(), reason="the greedy head needs AVX512-VNNI, which this CPU lacks")


@pytest.fixture(scope="module")
def gemma(gemma_target):
    return Engine(gemma_target, n_ctx=512, draft_policy="fixed")  # scripted drafts: every block whole


def _check_rows(s, n_rows, n_vocab, few):
    for i in range(n_rows):
        g, f = s.greedy_logits(i), s.logits(i)
        kept = np.isfinite(g)
        assert np.array_equal(g[kept].view(np.uint32), f[kept].view(np.uint32))  # exact logits, bit for bit
        assert np.all(np.isneginf(g[~kept]))
        assert kept[f == f.max()].all()  # every token with the largest logit: the argmax and its ties
        assert np.argmax(g) == np.argmax(f)
        if few:  # the point: few exact logits where the text is likely (after unlikely tokens the rows are flatter)
            assert kept.sum() < n_vocab // 100


@needs_vnni
def test_greedy_rows_keep_the_full_rows_argmax_and_their_exact_logits(gemma):
    s, n_vocab = gemma.session, gemma.target.n_vocab
    last = s.prefill(gemma.prompt_tokens('def merge_sorted(a, b):\n    """Merge two sorted lists."""\n'), GREEDY, 0)
    assert s.greedy_head  # gemma's 262k x 640 head is two thirds of its weights
    own = own_continuation(s, last, 17, GREEDY)
    p0 = s.n_past
    rng = np.random.default_rng(0)
    noise = [int(t) for t in rng.integers(0, n_vocab, 16)]  # rows after unlikely tokens: flatter distributions
    for draft in (own[1:17], noise):
        runs = []
        for on in (True, False):
            s.set_greedy_head(on)
            runs.append(s.step(last, draft, GREEDY, 1, 17))
            if on:
                _check_rows(s, 17, n_vocab, few=draft != noise)
            s.truncate(p0)
        assert runs[0].tokens == runs[1].tokens
        assert runs[0].tokens == (own[1:18] if draft == own[1:17] else own[1:2])
    s.set_greedy_head(None)


@needs_vnni
def test_the_greedy_head_is_built_where_it_pays_and_can_be_turned_off(gemma, tiny_target):
    s = gemma.session
    s.set_greedy_head(False)
    assert not s.greedy_head and s.greedy_head_bytes == 0
    s.set_greedy_head(None)  # the default: gemma's head pays
    assert s.greedy_head
    n_vocab, n_embd = gemma.target.n_vocab, gemma.target.n_embd
    assert s.greedy_head_bytes == n_vocab * n_embd + 3 * 4 * n_vocab  # one byte a weight, three floats a row
    assert gemma.model_info()["greedy_head_bytes"] == s.greedy_head_bytes
    # the tiny target's head is not a q8_0-row type: the full head, as before
    tiny = Engine(tiny_target, n_ctx=128)
    tiny.session.prefill(tiny.prompt_tokens("def total(values):"), GREEDY, 0)
    assert tiny.session.head_on_demand and not tiny.session.greedy_head
    with pytest.raises(ValueError, match="no greedy head"):
        tiny.session.greedy_logits(0)


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_generation_with_the_greedy_head_is_plain_decodings(gemma, seed):
    """Every acceptance length (scripted drafts), plain steps and verify blocks, the greedy head on and off."""
    prompt = "The history of the printing press"
    outputs = {}
    for on in (True, False):
        gemma.session.set_greedy_head(on)
        gemma.cache.clear()
        base = gemma.complete(prompt, max_tokens=40, draft=False)
        drafter = ScriptedDrafter(len(gemma.prompt_tokens(prompt)), base.token_ids, gemma.target.n_vocab, seed=seed)
        events = list(gemma.generate(prompt, max_tokens=40, external_drafter=drafter, ngram=False))
        outputs[on] = (base.token_ids, events[-1].token_ids)
    gemma.session.set_greedy_head(None)
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == outputs[True][1]


@needs_vnni
@pytest.mark.parametrize("head_type", ["Q8_0", "Q5_0", "Q4_0"])
def test_tiny_q8_row_heads_with_a_vocabulary_in_no_whole_tiles(models_dir, head_type):
    """The other head types whose rows meet q8_0 activations, and 333 tokens: the copy's last tile of 4 rows has
    one; random weights, so flat rows with many near ties."""
    path = write_tiny_target(models_dir / f"tiny-{head_type}-head.gguf", vocab_size=333,
                             head_type=gguf.GGMLQuantizationType[head_type])
    e = Engine(path, n_ctx=256)
    s, n_vocab = e.session, e.target.n_vocab
    assert n_vocab % 4 == 1
    last = s.prefill(e.prompt_tokens("def total(values):"), GREEDY, 0)
    assert not s.greedy_head  # by default: the head is a small part of this model
    s.set_greedy_head(True)  # asked for: wherever it can
    assert s.greedy_head
    own = own_continuation(s, last, 13, GREEDY)
    p0 = s.n_past
    runs = []
    for on in (True, False):
        s.set_greedy_head(on)
        runs.append(s.step(last, own[1:13], GREEDY, 1, 13))
        if on:
            _check_rows(s, 13, n_vocab, few=False)
        s.truncate(p0)
    assert runs[0].tokens == runs[1].tokens == own[1:14]
    s.set_greedy_head(None)
    assert not s.greedy_head
