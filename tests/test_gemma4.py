"""Gemma-4: a tiny gemma4 target under DFlash, and z-lab's Gemma-4 drafter layout converted and drafting.

The target (tests/fixtures.py) has what llama.cpp's gemma4 graph reads: sliding-window layers with a window of 8
tokens (shorter than every generation here) beside full-attention layers with other head sizes, proportional RoPE
and V = K, the last two layers reading earlier layers' KV cache, per-layer embeddings, embeddings scaled by
sqrt(hidden) and final logit soft-capping. Its graph records layer inputs, so features come from llama.cpp's layer
API; the eval callback must give the same numbers.

The drafter checkpoints are written in z-lab's Gemma-4 layout (tests/zlab.py: Qwen3 layers, sliding-window layers
and a full one, the target's logit soft-cap); conversion is compared with upstream llama.cpp's own converter class,
the PyTorch drafter with llama.cpp's dflash graph.
"""

import math

import numpy as np
import pytest
from conftest import check_same_as_upstream, make_prompts, upstream_convert
from fixtures import write_tiny_gemma4
from lossless import SAMPLED, assert_lossless
from rollback import check_capture_paths_agree, plain_logits, scripted_run
from scripted import ScriptedDrafter
from zlab import write_checkpoint, zlab_gemma4_config

from dflash_local import Engine, _native
from dflash_local.convert.hf_to_gguf import convert_drafter
from dflash_local.gguf_file import read_gguf
from dflash_local.engine.placement import Placement, PlacementError

DRAFT_WINDOW = 16  # the converted drafters' sliding window: contexts outgrow it within a generation


@pytest.fixture(scope="module")
def engine(gemma4, gemma4_drafter):
    return Engine(gemma4, gemma4_drafter, n_ctx=1024, draft_policy="fixed")


def test_the_target_is_a_gemma4_with_its_parts(engine, gemma4):
    info = read_gguf(gemma4)
    assert info.arch == "gemma4" and engine.session.uses_layer_api and not engine.session.recurrent
    assert info.get("attention.sliding_window") == 8 and info.get("attention.shared_kv_layers") == 2
    # a full layer's V is its K; the shared layers have no K/V of their own
    assert "blk.3.attn_v.weight" not in info.tensors and "blk.4.attn_k.weight" not in info.tensors
    # the drafter takes the target's embeddings times sqrt(hidden), as the gemma4 graph does
    assert engine.draft_info.get("embedding_scale") == pytest.approx(math.sqrt(64))
    # a random model that says something: many different tokens, not one repeated
    out = engine.complete("The quick brown fox", max_tokens=64, draft=False).token_ids
    assert len(set(out)) > 20
    # the window is in force: the same weights with a window longer than the text continue otherwise
    wide = Engine(write_tiny_gemma4(gemma4.parent / "tiny-gemma4-wide.gguf", sliding_window=4096), n_ctx=256)
    assert wide.complete("The quick brown fox", max_tokens=64, draft=False).token_ids != out


def test_a_quantized_cache_needs_whole_blocks_in_the_sliding_layers_too(gemma4, gemma4_drafter):
    # the full layers' heads hold 32 values, the sliding layers' 16: llama.cpp would refuse the context
    with pytest.raises(PlacementError, match="-ctk q8_0: the gemma4 model's attention heads hold 16 values"):
        Engine(gemma4, gemma4_drafter, n_ctx=256, placement=Placement(cache_type_k="q8_0", flash_attn="on"))


def test_layer_api_and_eval_callback_agree(gemma4, gemma4_drafter):
    check_capture_paths_agree(gemma4, gemma4_drafter, 3)


def test_greedy_dflash_is_token_identical(engine):
    partial = 0
    for p in make_prompts(55, seed=3):
        base = engine.complete(p, max_tokens=24, draft=False)
        spec = engine.complete(p, max_tokens=24)
        assert spec.token_ids == base.token_ids, p
        assert spec.text == base.text
        assert spec.summary.n_drafted > 0
        partial += spec.summary.n_rollbacks
    assert partial > 0


def test_every_acceptance_length_and_hundreds_of_rollbacks(engine):
    base, done, steps = scripted_run(engine, "The quick brown fox", 200)
    assert done.token_ids == base.token_ids and done.text == base.text
    full = [s for s in steps if s.n_drafted == engine.block_size - 1]
    assert {s.n_accepted for s in full} == set(range(engine.block_size))  # 0..B-1, B-1 being the full block
    assert {s.rollback for s in steps} == {"", "kv"}
    assert all((s.rollback == "kv") == (s.n_accepted < s.n_drafted) for s in steps)
    base, done, steps = scripted_run(engine, "def total(values):\n", 700, seed=7)
    assert done.token_ids == base.token_ids
    assert len(steps) > 150 and sum(1 for s in steps if s.rollback) > 100


def test_logits_after_a_rollback_equal_plain_decoding(engine, gemma4):
    """Rejected drafts cut from the sliding-window and the shared caches leave exactly the state plain decoding
    reaches, past the window."""
    prompt = "def total(values):\n    result = 0\n"
    cont = engine.complete(prompt, max_tokens=24, draft=False).token_ids
    ids, sp, s = engine.prompt_tokens(prompt), _native.Sampling(), engine.session
    want = plain_logits(gemma4, ids, cont, 20)  # after cont[0..19]

    s.truncate(0)
    engine.cache.clear()  # this test drives the session by hand
    s.set_capture(True)
    assert s.prefill(ids, sp, 0) == cont[0]
    n = 1
    for k in range(4):  # rejects everything, then accepts 2, 5 and 1 of 7 drafts
        draft = list(cont[n:n + 7])
        keep = (0, 2, 5, 1)[k]
        draft[keep] = (draft[keep] + 1) % engine.target.n_vocab
        r = s.step(cont[n - 1], draft, sp, n)
        assert (r.n_accepted, r.tokens, r.rollback) == (keep, cont[n:n + keep + 1], "kv")
        n += keep + 1
    while n < 20:
        s.step(cont[n - 1], [], sp, n)
        n += 1
    s.step(cont[19], [], sp, 20)
    np.testing.assert_array_equal(s.logits(0), want)
    s.truncate(0)


def test_prefix_cache_across_generations(engine, gemma4, gemma4_drafter):
    prompt = "Speculative decoding is"
    first = engine.complete(prompt, max_tokens=40)
    again = engine.complete(prompt, max_tokens=40)
    assert again.summary.n_cached > 0 and again.token_ids == first.token_ids
    # a longer prompt sharing the first one and everything it generated, far past the sliding window
    follow = prompt + first.text + "\nmore"
    cont = engine.complete(follow, max_tokens=40)
    assert cont.summary.n_cached > len(engine.prompt_tokens(prompt)) + 8
    fresh = Engine(gemma4, gemma4_drafter, n_ctx=1024, draft_policy="fixed")
    assert fresh.complete(follow, max_tokens=40).token_ids == cont.token_ids
    assert engine.complete(follow, max_tokens=40, draft=False).token_ids == cont.token_ids
    # going back to a shorter prompt that leaves the cached text: the same as a fresh engine
    other = engine.complete("Speculative sampling", max_tokens=20)
    assert other.token_ids == fresh.complete("Speculative sampling", max_tokens=20).token_ids


def test_seeded_sampling_equals_plain_sampling(engine):
    kw = dict(max_tokens=64, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)
    for i, p in enumerate(make_prompts(4, seed=11)):
        plain = engine.complete(p, seed=100 + i, draft=False, **kw)
        assert engine.complete(p, seed=100 + i, **kw).token_ids == plain.token_ids, p
    plain = engine.complete("Hello", seed=123, draft=False, **kw)
    drafter = ScriptedDrafter(len(engine.prompt_tokens("Hello")), plain.token_ids, engine.target.n_vocab, seed=1)
    spec = engine.complete("Hello", seed=123, external_drafter=drafter, **kw)
    assert spec.token_ids == plain.token_ids
    assert spec.summary.n_accepted > 0 and spec.summary.n_rollbacks > 0


# -- z-lab's Gemma-4 drafters ---------------------------------------------------------------------------------------


def gemma4_config(target_info, **kw):
    """A tiny z-lab Gemma-4 drafter for the tiny gemma4 target: three sliding layers and a full one, GQA, heads of
    32 where the hidden size gives 16."""
    return zlab_gemma4_config(hidden=64, n_layer=4, n_head=4, n_kv=2, head_dim=32, n_ff=96,
                              target_layer_ids=[0, 3, 4], num_target_layers=target_info.get("block_count"),
                              vocab_size=target_info.n_vocab,
                              mask_token_id=target_info.kv["tokenizer.ggml.mask_token_id"], block_size=8,
                              sliding_window=DRAFT_WINDOW, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, gemma4):
    return write_checkpoint(tmp_path_factory.mktemp("g4") / "tiny-gemma-4-it-DFlash", gemma4_config(read_gguf(gemma4)),
                            n_shards=3)


@pytest.fixture(scope="module")
def converted(ckpt, gemma4):
    cache = {}

    def get(outtype):
        if outtype not in cache:
            cache[outtype] = convert_drafter(ckpt, gemma4, ckpt.parent / f"g4-drafter-{outtype}.gguf", outtype).path
        return cache[outtype]

    return get


@pytest.mark.parametrize("scale", [None, 8.0], ids=["scale-from-target", "scale-in-config"])
def test_f32_output_equals_upstreams_converter(tmp_path, gemma4, llama_cpp_src, scale):
    """Keys and tensors as upstream writes them. Upstream takes the noise embedding scale only from the config;
    without one, ours adds the sqrt(hidden) that a gemma target's embeddings need (the gemma4 graph applies it
    to its own embeddings, not to the table the drafter borrows)."""
    d = write_checkpoint(tmp_path / "ckpt", gemma4_config(read_gguf(gemma4), input_embedding_scale=scale),
                         n_shards=3)
    extra = {"dflash.attention.causal"} | ({"dflash.embedding_scale"} if scale is None else set())
    ours_kv, up_kv, up_t = check_same_as_upstream(
        convert_drafter(d, gemma4, tmp_path / "ours.gguf", "f32").path,
        upstream_convert(llama_cpp_src, d, gemma4, tmp_path / "upstream.gguf"), extra)
    assert set(ours_kv) - set(up_kv) == extra
    assert up_kv["dflash.attention.sliding_window"] == DRAFT_WINDOW
    assert list(up_kv["dflash.attention.sliding_window_pattern"]) == [True, True, True, False]
    assert up_kv["dflash.final_logit_softcapping"] == pytest.approx(30.0)
    assert ours_kv["dflash.embedding_scale"] == pytest.approx(8.0)


@pytest.mark.parametrize("source", ["gguf", "checkpoint"])
def test_f32_torch_drafts_equal_ggml(converted, ckpt, gemma4, source):
    """The PyTorch drafter (from the f32 GGUF, and from the checkpoint folder itself) against llama.cpp's dflash
    graph on the gemma4 target, step after step while the drafter's context outgrows its sliding window."""
    pytest.importorskip("torch")
    from dflash_local.engine.torch_drafter import TorchDraftBackend

    drafter = converted("f32")
    e = Engine(gemma4, drafter, n_ctx=512)
    session = e.session
    session.keep_draft_logits(True)
    ref = TorchDraftBackend.load(drafter if source == "gguf" else ckpt, gemma4)
    greedy, worst, steps = _native.Sampling(), 0.0, 0
    for prompt in make_prompts(3, seed=5):
        session.truncate(0)
        ref.crop(0)
        last = session.prefill(e.prompt_tokens(prompt), greedy, 0)
        ref.add(session.features(), 0)
        for k in range(8):
            d = session.draft(last, 7, True)
            want = ref.logits(last, 7).numpy()
            worst = max(worst, float(np.linalg.norm(session.draft_logits() - want) / np.linalg.norm(want)))
            assert list(d.tokens) == want.argmax(1).tolist()
            r = session.step(last, d.tokens, greedy, 1 + k)
            ref.add(session.features()[: r.n_accepted + 1], ref.n)
            last = r.tokens[-1]
            steps += 1
    assert worst < 1e-4 and steps == 24 and ref.n > DRAFT_WINDOW


def test_converted_drafter_is_lossless_through_the_engine(converted, ckpt, gemma4):
    for drafter, backend in [(converted("q8_0"), "ggml"), (ckpt, "torch")]:
        if backend == "torch":
            pytest.importorskip("torch")
        e = Engine(gemma4, drafter, n_ctx=512, draft_backend=backend, draft_policy="fixed")
        assert_lossless(e, make_prompts(4, seed=8), max_tokens=32, sampling=SAMPLED, label=backend)
