"""The greedy LM head (native/greedy_head.cpp): a row's logits computed exactly only for the tokens an int8 bound
cannot rule out of what its sampler reads, the argmax of a greedy row, the top K of a top-k row (and the tokens whose
logits the sampler's controls change). The row's argmax, or top K, ties included, must be the full row's, so greedy
and sampled decoding stay token-identical to decoding with the full head."""

import gguf
import numpy as np
import pytest
from cpu import cpu_flags
from fixtures import write_tiny_target
from scripted import ScriptedDrafter

from dflash_local import Engine, _native
from dflash_local.bench import own_continuation
from dflash_local import models

GREEDY = _native.Sampling()


# the int8 copy's dot products run on AVX512-VNNI and on AVX2, where the head is built by default for a large head (on
# AVX2 alone it leaves a plain step's one row to llama.cpp's head, a little faster there: docs/measurements.md);
# elsewhere the full head serves every row, which the generation tests below still check
VNNI = _native.greedy_head_fast()  # the int8 pass on AVX512-VNNI, which takes a plain step's row too
needs_kernel = pytest.mark.skipif(not VNNI and "avx2" not in cpu_flags(),
                                  reason="the greedy head needs AVX512-VNNI or AVX2, which this CPU lacks")


@pytest.fixture(scope="module")
def gemma(gemma_target):
    # the shipped drafter sets the block (16): scripted drafts go up to 15 tokens, every block whole
    return Engine(gemma_target, models.drafter("gemma"), n_ctx=512, draft_policy="fixed")


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


@needs_kernel
def test_greedy_rows_keep_the_full_rows_argmax_and_their_exact_logits(gemma):
    s, n_vocab = gemma.session, gemma.target.n_vocab
    last = s.prefill(gemma.prompt_tokens('def merge_sorted(a, b):\n    """Merge two sorted lists."""\n'), GREEDY, 0)
    assert s.greedy_head  # gemma's 262k x 640 head is two thirds of its weights: it pays
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


@needs_kernel
def test_the_greedy_head_is_built_where_it_pays_and_can_be_turned_off(gemma, tiny_target):
    s = gemma.session
    s.set_greedy_head(False)
    assert not s.greedy_head and s.greedy_head_bytes == 0
    s.set_greedy_head(None)  # the default: gemma's head pays wherever the int8 pass has a kernel
    assert s.greedy_head
    s.set_greedy_head(True)
    n_vocab, n_embd = gemma.target.n_vocab, gemma.target.n_embd
    assert s.greedy_head_bytes == n_vocab * n_embd + 3 * 4 * n_vocab  # one byte a weight, three floats a row
    assert gemma.model_info()["greedy_head_bytes"] == s.greedy_head_bytes
    s.set_greedy_head(None)
    # the tiny target's head is not a q8_0-row type: the full head, as before
    tiny = Engine(tiny_target, n_ctx=128)
    tiny.session.prefill(tiny.prompt_tokens("def total(values):"), GREEDY, 0)
    assert tiny.session.head_on_demand and not tiny.session.greedy_head
    with pytest.raises(ValueError, match="no greedy head"):
        tiny.session.greedy_logits(0)


@needs_kernel
def test_which_head_calls_the_greedy_head_takes(gemma):
    """A verify block's rows go the greedy head's way, in one call or on demand; a plain step's one row too with
    AVX512-VNNI, and llama.cpp's graph computes it on AVX2 alone (there the int8 pass costs a little more than the full
    head for one row, less from two). The tokens are the same every way."""
    s = gemma.session
    s.set_greedy_head(None)
    last = s.prefill(gemma.prompt_tokens("The history of the printing press"), GREEDY, 0)
    own = own_continuation(s, last, 9, GREEDY)
    p0 = s.n_past
    before = s.pruned_rows[0]
    r = s.step(last, [], GREEDY, 1)
    assert r.tokens == own[1:2] and r.head_rows == (1 if VNNI else 0)
    assert s.pruned_rows[0] - before == (1 if VNNI else 0)
    s.truncate(p0)
    before = s.pruned_rows[0]
    r = s.step(last, own[1:9], GREEDY, 1, 9)  # every row in one call
    assert r.tokens == own[1:10] and r.head_rows == 9 and s.pruned_rows[0] - before == 9
    s.truncate(p0)
    wrong = (own[1] + 1) % gemma.target.n_vocab
    before = s.pruned_rows[0]
    r = s.step(last, [wrong] + own[2:9], GREEDY, 1, 1)  # rejected at once: one row read, on demand
    assert r.tokens == own[1:2] and r.head_rows == 1 and s.pruned_rows[0] - before == 1
    s.truncate(p0)


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
        assert events[-1].summary.n_drafted > 40  # verify blocks, not plain steps
        outputs[on] = (base.token_ids, events[-1].token_ids)
    gemma.session.set_greedy_head(None)
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == outputs[True][1]


@needs_kernel
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


def _check_top_rows(s, n_rows, n_vocab, k, forced, few):
    for i in range(n_rows):
        g, f = s.greedy_logits(i, k, forced), s.logits(i)
        kept = np.isfinite(g)
        assert np.array_equal(g[kept].view(np.uint32), f[kept].view(np.uint32))  # exact logits, bit for bit
        assert np.all(np.isneginf(g[~kept]))
        kth = np.sort(f)[-k]
        assert kept[f >= kth].all()  # every token of the top k, and every one tied with the k-th
        assert kept[forced].all()
        if few:  # the point: a few thousand exact logits where the text is likely, not 262,144
            assert kept.sum() < n_vocab // 10


@needs_kernel
def test_top_k_rows_keep_the_full_rows_top_and_their_exact_logits(gemma):
    """greedy_logits(row, k, forced): the exact logits of every token that could be among the row's k largest and of
    the tokens forced (a sampler's penalised or biased tokens, whose logits may move past the others), -inf elsewhere,
    on likely rows and on the flatter rows after unlikely tokens."""
    s, n_vocab = gemma.session, gemma.target.n_vocab
    s.set_greedy_head(True)
    last = s.prefill(gemma.prompt_tokens("The history of the printing press"), GREEDY, 0)
    own = own_continuation(s, last, 13, GREEDY)
    p0 = s.n_past
    rng = np.random.default_rng(1)
    noise = [int(t) for t in rng.integers(0, n_vocab, 12)]
    forced = sorted({int(t) for t in rng.integers(0, n_vocab, 20)} | {0, n_vocab - 1})
    for draft in (own[1:13], noise):
        s.step(last, draft, GREEDY, 1, 13)
        for k in (2, 40, 300):
            _check_top_rows(s, 13, n_vocab, k, forced, few=draft != noise)
        s.truncate(p0)
    s.set_greedy_head(None)


# the chains of the generation test: llama.cpp's defaults, wide and narrow top-k, and controls that move tokens
# (penalties that lower and negative ones that raise a token of the window, a bias that lifts an unlikely token over
# the others and one that bans a likely one)
CHAINS = {
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-k 300, temperature 1.5": dict(temperature=1.5, top_k=300),
    "top-k 5, penalties": dict(temperature=1.0, top_k=5, repeat_penalty=1.5, frequency_penalty=-1.0,
                               presence_penalty=-0.5, repeat_last_n=32),
    "top-k 20, biases": dict(temperature=0.9, top_k=20, top_p=0.9, logit_bias={77777: 25.0, 506: float("-inf"),
                                                                              1175: 3.0}),
}


@needs_kernel
@pytest.mark.parametrize("chain", CHAINS)
def test_sampled_generation_with_the_top_k_head_is_the_full_heads(gemma, chain):
    """Plain steps and verify blocks (scripted drafts of the sampled output: every acceptance length) with the head
    computing each row's top only give the tokens of the full head, for several seeds; the rows did go the top way."""
    prompt = "Once upon a time, in a village by the sea,"
    for seed in (1, 2, 3):
        outputs = {}
        for on in (True, False):
            gemma.session.set_greedy_head(on)
            gemma.cache.clear()
            before = gemma.session.pruned_rows[1]
            kw = CHAINS[chain] | dict(seed=seed, max_tokens=32)
            base = gemma.complete(prompt, draft=False, **kw)
            drafter = ScriptedDrafter(len(gemma.prompt_tokens(prompt)), base.token_ids, gemma.target.n_vocab,
                                      seed=seed)
            spec = gemma.complete(prompt, external_drafter=drafter, ngram=False, **kw)
            assert spec.summary.n_drafted > 32  # verify blocks, not plain steps
            outputs[on] = (base.token_ids, spec.token_ids)
            # with AVX512-VNNI the plain steps' 32 rows too; on AVX2 alone the verify blocks' rows
            assert (gemma.session.pruned_rows[1] > before + (32 if VNNI else 0)) == on
        assert outputs[True] == outputs[False], seed
        assert outputs[True][0] == outputs[True][1]
    gemma.session.set_greedy_head(None)


def test_which_rows_a_sampler_reads_whole(tiny_target):
    """Sampler.keep: 1 (the argmax) for greedy rows, K for a top-k chain, 0 (every logit) where a grammar's redraw or
    logprobs read the whole row, or top-k does not cut."""
    t = _native.Model(str(tiny_target))

    def keep(temperature=0.8, top_k=40, repeat=1.0, grammar="", n_logprobs=-1):
        return _native.Sampler(t, _native.Sampling(temperature, top_k, 0.95, 0.05, 1), [], 64, repeat, 0.0, 0.0, [],
                               grammar, n_logprobs).keep

    assert keep(temperature=0.0, top_k=0) == 1
    assert keep() == 40 and keep(top_k=1) == 2 and keep(repeat=1.3) == 40
    assert keep(top_k=0) == 0 and keep(top_k=1025) == 0 and keep(top_k=t.n_vocab) == 0
    assert keep(grammar='root ::= "a"') == 0 and keep(n_logprobs=2) == 0
    assert keep(temperature=0.0, top_k=0, n_logprobs=2) == 0  # greedy, but logprobs read the row
