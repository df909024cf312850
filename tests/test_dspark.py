"""DSpark drafters: conversion (against upstream llama.cpp's own converter class), the PyTorch drafter against
llama.cpp's DSpark graph (Markov-biased logits and confidences), lossless drafting through the engine on the tiny
target, the tiny qwen35 hybrid and gemma-3-270m, and the adaptive policy's cut by the drafter's confidence.

Checkpoints are written by the tests (tests/zlab.py) in the two published config schemas: DeepSpec's (deepseek-ai's
dspark_* drafters: anchor-first blocks, a confidence head) and the speculators' EAGLE3-style export (a bonus anchor
slot before the drafts), BF16 weights in several shards with an index json, GQA, head_dim != hidden / heads. The
"-d2t" ones have a reduced draft vocabulary as the speculators publish it: draft_vocab_size, an lm_head and a
markov_w2 of that many rows, d2t (int64 offsets: target id = d2t[i] + i) and t2d (a bool mask of the target's
vocabulary, unused at runtime); their draft logits are -inf outside the d2t set and the Markov bias lands on the
target rows the draft rows map to.
"""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import check_same_as_upstream, make_prompts, upstream_convert
from fixtures import write_tiny_qwen35
from lossless import SAMPLED, assert_lossless
from parity import drafts_side_by_side, top1_agreement
from scripted import ScriptedDrafter, Wrapping
from test_policy import SteadyCosts
from zlab import dspark_config, edit_config, write_checkpoint, zlab2_config

from dflash_local import Engine, Finished, StepStats
from dflash_local.convert.errors import ConvertError
from dflash_local.convert.gguf_out import tokenizer_kv
from dflash_local.convert.hf_to_gguf import convert_drafter
from dflash_local.engine.drafter import Drafter
from dflash_local.gguf_file import read_gguf
from dflash_local.validate import check_pair

torch = pytest.importorskip("torch")

LAYER_IDS = [0, 1, 2]  # features 0..2 of the 4-layer tiny targets -> GGUF layer inputs 1..3
BLOCK = 8
SCHEMAS = ["deepspec", "speculators", "no-confidence", "deepspec-d2t", "speculators-d2t"]
N_DRAFT = 200  # the reduced draft vocabulary of the "-d2t" checkpoints (the tiny target has 488 tokens)


def anchor_first(schema: str) -> bool:
    return not schema.startswith("speculators")


def draft_ids(schema: str, n_vocab: int) -> np.ndarray:
    """The target token ids a schema's drafter can draft: a fixed random subset for "-d2t", else all."""
    if not schema.endswith("-d2t"):
        return np.arange(n_vocab)
    return np.sort(np.random.default_rng(11).choice(n_vocab, N_DRAFT, replace=False))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("dspark")


def tiny_config(info, schema="deepspec", **kw):
    args = dict(hidden=64, n_layer=2, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=LAYER_IDS,
                num_target_layers=info.get("block_count"), vocab_size=info.n_vocab,
                mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=BLOCK, markov_rank=32)
    if schema.endswith("-d2t"):
        args["draft_vocab_size"] = N_DRAFT
    args.update(kw)
    if schema == "no-confidence":
        return dspark_config(confidence=False, **args)
    return dspark_config(schema=schema.removesuffix("-d2t"), **args)


def d2t_tensors(schema: str, n_vocab: int) -> dict | None:
    """A "-d2t" checkpoint's d2t and t2d, in the speculators' dtypes (int64 offsets, a bool mask)."""
    if not schema.endswith("-d2t"):
        return None
    ids = draft_ids(schema, n_vocab)
    t2d = np.zeros(n_vocab, bool)
    t2d[ids] = True
    return {"d2t": ("I64", ids - np.arange(len(ids))), "t2d": ("BOOL", t2d)}


@pytest.fixture(scope="module")
def ckpt(work, tiny_target):
    info = read_gguf(tiny_target)
    return {s: write_checkpoint(work / f"zlab-tiny-DSpark-{s}", tiny_config(info, s), n_shards=3,
                                extra=d2t_tensors(s, info.n_vocab)) for s in SCHEMAS}


@pytest.fixture(scope="module")
def converted(work, ckpt, tiny_target):
    cache = {}

    def get(schema, outtype):
        if (schema, outtype) not in cache:
            out = work / f"out/dspark-{schema}-{outtype}.gguf"
            cache[schema, outtype] = convert_drafter(ckpt[schema], tiny_target, out, outtype).path
        return cache[schema, outtype]

    return get


# -- conversion -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS)
def test_f32_output_equals_upstreams_converter(work, ckpt, tiny_target, llama_cpp_src, schema):
    _, up_kv, up_t = check_same_as_upstream(
        convert_drafter(ckpt[schema], tiny_target, work / f"up-out/{schema}-ours.gguf", "f32").path,
        upstream_convert(llama_cpp_src, ckpt[schema], tiny_target, work / f"up-out/{schema}-up.gguf"))
    assert up_kv["dflash.sample_from_anchor"] == anchor_first(schema)
    assert up_kv["dflash.has_confidence_head"] == (schema != "no-confidence")
    assert up_kv["dflash.target_layers"] == [i + 1 for i in LAYER_IDS] and up_kv["dflash.block_size"] == BLOCK
    assert "markov_w1.weight" in up_t and ("conf_proj.bias" in up_t) == (schema != "no-confidence")
    n_vocab = len(up_kv["tokenizer.ggml.tokens"])
    if schema.endswith("-d2t"):  # the target ids themselves, the draft vocabulary's own head and Markov rows
        assert np.array_equal(up_t["d2t"][2], draft_ids(schema, n_vocab))
        assert up_t["output.weight"][1] == (64, N_DRAFT) and up_t["markov_w2.weight"][1] == (32, N_DRAFT)
    else:  # the target's LM head, shared
        assert "d2t" not in up_t and "output.weight" not in up_t and up_t["markov_w2.weight"][1] == (32, n_vocab)
    assert up_t["markov_w1.weight"][1] == (32, n_vocab)


def test_layout_pair_check_and_inspect(converted, tiny_target):
    info = read_gguf(converted("deepspec", "q8_0"))
    spec = check_pair(read_gguf(tiny_target), info)
    assert spec.anchor_first and spec.max_draft == BLOCK and spec.layers == [1, 2, 3]
    assert spec.longest_draft(3) == 3  # anchor-first: every slot of a block drafts
    t = info.tensors
    assert t["markov_w1.weight"].shape == (32, info.n_vocab) and t["markov_w2.weight"].type == "Q8_0"
    assert t["conf_proj.weight"].shape == (64 + 32, 1) and t["conf_proj.bias"].type == "F32"
    bonus = check_pair(read_gguf(tiny_target), read_gguf(converted("speculators", "f32")))
    assert bonus.max_draft == BLOCK - 1 and bonus.longest_draft(3) == 2  # a bonus anchor slot drafts nothing
    path = converted("deepspec", "q8_0")
    run = subprocess.run([sys.executable, "-m", "dflash_local", "inspect", str(path)], capture_output=True, text=True,
                         check=True)
    assert (f"DSpark drafter: 2 layers, hidden 64, target layers (inputs) [1, 2, 3], block size {BLOCK}" in run.stdout)
    assert "Markov head of rank 32, a confidence head, anchor-first blocks" in run.stdout
    run = subprocess.run([sys.executable, "-m", "dflash_local", "inspect", str(converted("speculators-d2t", "f32")),
                          "--json"], capture_output=True, text=True, check=True)
    d = json.loads(run.stdout)["dflash"]
    assert (d["variant"], d["markov_rank"], d["confidence_head"], d["sample_from_anchor"]) == ("DSpark", 32, True,
                                                                                              False)
    assert d["draft_vocab"] == N_DRAFT and d["own_lm_head"]


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(markov_head_type="gated"), "markov_head_type 'gated' is not supported"),
    (lambda c: c.update(markov_rank=64), "markov_w1 has rank 32, config.json says markov_rank 64"),
    (lambda c: c.update(architectures=["DFlashDraftModel"], dflash_config={"target_layer_ids": LAYER_IDS}),
     "a DSpark tensor, but config.json says DFlash"),
    (lambda c: c.pop("target_layer_ids"), "dflash_config.target_layer_ids must be a non-empty list"),
], ids=["gated", "rank", "dflash-arch", "no-layers"])
def test_bad_dspark_checkpoints_fail_clearly(work, ckpt, tiny_target, edit, message, request):
    d = work / f"bad-{request.node.callspec.id}"
    shutil.copytree(ckpt["deepspec"], d)
    with pytest.raises(ConvertError, match=message):
        convert_drafter(edit_config(d, edit), tiny_target, work / "bad-out" / "d.gguf", "f32")
    assert not (work / "bad-out").exists() or not any((work / "bad-out").iterdir())


def test_a_confidence_head_without_the_markov_input_is_refused(work, tiny_target):
    """llama.cpp's graph feeds the head [hidden ; Markov embedding]: a head over the hidden state alone (DeepSpec's
    confidence_head_with_markov false) cannot run there."""
    info = read_gguf(tiny_target)
    cfg = tiny_config(info, "no-confidence")
    d = write_checkpoint(work / "conf-hidden-only", cfg, n_shards=1, extra={
        "confidence_head.proj.weight": ("F32", np.zeros((1, 64), np.float32)),
        "confidence_head.proj.bias": ("F32", np.zeros(1, np.float32))})
    with pytest.raises(ConvertError, match=r"has shape \[1, 64\].*\[1, 96\]"):
        convert_drafter(d, tiny_target, work / "conf-out" / "d.gguf", "f32")


# -- the PyTorch drafter against llama.cpp's graph ---------------------------------------------------------------




@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("source", ["gguf", "checkpoint"])
def test_f32_torch_equals_ggml(converted, ckpt, tiny_target, schema, source):
    """torch, from the f32 GGUF and from the checkpoint folder: the same Markov-biased logits, confidences and
    drafts as llama.cpp's graph, for full and shorter blocks. A reduced draft vocabulary: -inf on the same target
    rows (those outside d2t), the drafts inside d2t."""
    path = converted(schema, "f32")
    n_max = BLOCK if anchor_first(schema) else BLOCK - 1
    count = 0
    for d, s, ref, last in drafts_side_by_side(tiny_target, path, path if source == "gguf" else ckpt[schema],
                                               make_prompts(3, seed=5), layer_ids=LAYER_IDS, n_draft=n_max):
        logits = s.draft_logits()
        want, conf = ref.dspark(last, n_max)
        want = want.numpy()
        n_vocab = ref.head.shape[0]
        assert logits.shape == want.shape == (n_max, n_vocab)
        allowed = np.isin(np.arange(n_vocab), draft_ids(schema, n_vocab))
        assert np.array_equal(np.isfinite(logits), np.broadcast_to(allowed, logits.shape))
        assert np.array_equal(np.isfinite(want), np.isfinite(logits))
        assert np.linalg.norm(logits[:, allowed] - want[:, allowed]) / np.linalg.norm(want[:, allowed]) < 1e-4
        assert list(d.tokens) == want.argmax(1).tolist() == ref.draft([last], n_max)
        assert allowed[list(d.tokens)].all()
        if schema == "no-confidence":
            assert conf is None and len(d.confidence) == 0
        else:
            np.testing.assert_allclose(d.confidence, conf.numpy(), rtol=1e-4, atol=1e-6)
        count += 1
    assert count == 18


def test_the_markov_head_changes_the_drafts(converted, tiny_target):
    """The bias is not a no-op on these weights: without it (the unbiased logits) the drafts differ."""
    differ = n = 0
    for d, _, ref, last in drafts_side_by_side(tiny_target, converted("deepspec", "f32"), converted("deepspec", "f32"),
                                              make_prompts(2, seed=7), layer_ids=LAYER_IDS, n_draft=BLOCK, steps=3):
        _, base = ref.hidden_and_logits(last, BLOCK)
        differ += sum(a != b for a, b in zip(d.tokens, base.argmax(1).tolist()))
        n += BLOCK
    assert differ / n > 0.2


def test_q8_0_drafts_agree_with_torch(converted, tiny_target):
    """A q8_0 GGUF run by torch (dequantized) and by llama.cpp, compared slot by slot after the same previous drafts
    (the Markov chain would otherwise carry one flipped near-tie into every later slot). llama.cpp also rounds a
    q8_0 matmul's activations to 8 bits, which decides near-ties of this random-weight drafter's logits, and how
    depends on the CPU's kernels (measured: 99.7% of the slots the same with AVX-512, 98.6% with AVX2 only): as for
    DFlash2 (test_dflash2.py), the same top-1 on >= 99% of the slots with a clear winner (top-2 gap > 3x the row's
    RMS error), every disagreement a near-tie, and >= 95% of all slots and free-running drafts the same."""
    path = converted("deepspec", "q8_0")
    same = clear = agree = drafted = n = 0
    for d, s, ref, last in drafts_side_by_side(tiny_target, path, path, make_prompts(6, seed=6), layer_ids=LAYER_IDS,
                                               n_draft=BLOCK):
        hit, rows = top1_agreement(s.draft_logits(), ref.dspark(last, BLOCK, given=list(d.tokens))[0].numpy())
        same, clear, agree, n = same + hit.sum(), clear + rows.sum(), agree + hit[rows].sum(), n + len(hit)
        drafted += sum(a == b for a, b in zip(d.tokens, ref.draft([last], BLOCK)))
    assert clear / n >= 0.8 and agree / clear >= 0.99, (clear / n, agree / clear)
    assert same / n >= 0.95 and drafted / n >= 0.95, (same / n, drafted / n)


# -- lossless drafting through the engine ---------------------------------------------------------------------------


class Recorded(Wrapping):
    """The engine's own drafter (llama.cpp's or torch's), keeping every token it drafts."""

    def __init__(self, inner: Drafter):
        super().__init__(inner)
        self.tokens = set()

    def draft(self, tokens, k):
        return self.draft_rated(tokens, k)[0]

    def draft_rated(self, tokens, k):  # what the engine calls
        d, ratings = self.inner.draft_rated(tokens, k)
        self.tokens.update(d)
        return d, ratings


@pytest.mark.parametrize("schema", ["deepspec", "speculators", "deepspec-d2t", "speculators-d2t"])
def test_tiny_engine_is_lossless(converted, ckpt, tiny_target, schema):
    for drafter, backend, policy in [(converted(schema, "q8_0"), "ggml", "fixed"), (converted(schema, "f32"), "ggml",
                                                                                     "auto"), (ckpt[schema], "torch",
                                                                                               "fixed")]:
        e = Engine(tiny_target, drafter, n_ctx=512, n_threads=1, draft_backend=backend, draft_policy=policy)
        assert e.max_draft == (BLOCK if anchor_first(schema) else BLOCK - 1)
        rec = Recorded(e.drafter)
        assert_lossless(e, make_prompts(6, seed=8), max_tokens=24, sampling=SAMPLED, label=backend,
                        external_drafter=rec)
        assert rec.tokens <= set(draft_ids(schema, e.target.n_vocab).tolist()), backend
        if backend == "ggml":
            with pytest.raises(ValueError, match="DSpark drafter chains its Markov head"):
                e.complete("x", max_tokens=4, temperature=0.8, seed=1, spec_sampling="rejection")


@pytest.mark.parametrize("schema", ["deepspec", "speculators"])
def test_block_size_bounds_the_drafts_by_the_drafters_rule(converted, tiny_target, schema):
    """The engine's block size and a generation's own (generate(block_size=)) give the longest draft by the
    drafter's rule: every slot of an anchor-first block drafts, a bonus anchor slot does not."""
    e = Engine(tiny_target, converted(schema, "f32"), n_ctx=512, n_threads=1, block_size=4, draft_policy="fixed")
    extra = 1 if anchor_first(schema) else 0
    assert e.max_draft == 3 + extra
    p = make_prompts(1, seed=8)[0]
    base = e.complete(p, max_tokens=24, draft=False)
    events = list(e.generate(p, max_tokens=24, block_size=2))
    assert events[-1].token_ids == base.token_ids
    assert max(s.n_drafted for s in events if isinstance(s, StepStats)) == 1 + extra


@pytest.fixture(scope="module")
def qwen35(work):
    return write_tiny_qwen35(work / "tiny-qwen35.gguf")


@pytest.fixture(scope="module")
def hybrid(work, qwen35):
    info = read_gguf(qwen35)
    d = write_checkpoint(work / "qwen35-DSpark", tiny_config(info, target_layer_ids=[0, 2]), n_shards=2)
    path = convert_drafter(d, qwen35, work / "out/qwen35-dspark-q8_0.gguf", "q8_0").path
    return Engine(qwen35, path, n_ctx=1024, n_threads=1, draft_policy="fixed")


def test_hybrid_target_is_lossless_with_every_acceptance_length(hybrid):
    """The anchor-first drafter's full block is BLOCK drafts (a verify batch of BLOCK + 1 tokens): the recurrent
    snapshots cover it, and every acceptance length 0..BLOCK rolls back exactly. The DSpark drafter's own drafts,
    then a scripted drafter with planted errors through the same engine, for the lengths a random drafter never
    reaches."""
    assert hybrid.max_draft == BLOCK and hybrid.session.n_rs_seq == BLOCK
    done = assert_lossless(hybrid, make_prompts(12, seed=9), max_tokens=24, sampling=dict(temperature=0.9), seed=40)
    assert all(spec.summary.n_checkpoint_rollbacks == 0 for spec in done)
    lengths = set()
    for p in make_prompts(6, seed=10):
        base = hybrid.complete(p, max_tokens=80, draft=False)
        drafter = ScriptedDrafter(len(hybrid.prompt_tokens(p)), base.token_ids, hybrid.target.n_vocab)
        events = list(hybrid.generate(p, max_tokens=80, external_drafter=drafter))
        assert isinstance(events[-1], Finished) and events[-1].token_ids == base.token_ids, p
        steps = [e for e in events if isinstance(e, StepStats)]
        lengths |= {s.n_accepted for s in steps if s.n_drafted == BLOCK}
        assert all(s.rollback in ("", "snapshot") for s in steps)
    assert lengths == set(range(BLOCK + 1))


def test_gemma_dspark_converts_with_the_cli_and_drafts_losslessly(work, gemma_target):
    """A DeepSpec-layout checkpoint for gemma-3-270m's shapes (hidden 640, 262,144 tokens) converted by
    `dflash-local convert`, named DSpark by `inspect`, drafting token-identically to plain decoding, with the
    adaptive policy cutting its blocks by the confidence head."""
    info = read_gguf(gemma_target)
    mask = dict((kv[0], kv[1]) for kv in tokenizer_kv(gemma_target))["tokenizer.ggml.mask_token_id"]
    cfg = dspark_config(hidden=640, n_layer=1, n_head=4, n_kv=2, head_dim=64, n_ff=512, target_layer_ids=[1, 8, 15],
                        num_target_layers=info.get("block_count"), vocab_size=info.n_vocab, mask_token_id=mask,
                        block_size=4, markov_rank=32)
    ckpt_dir = write_checkpoint(work / "gemma-DSpark", cfg, n_shards=2)
    out = work / "gemma-out" / "gemma-dspark-q8_0.gguf"
    cli = [sys.executable, "-m", "dflash_local"]
    run = subprocess.run(cli + ["convert", str(ckpt_dir), "-m", str(gemma_target), "-o", str(out), "--outtype",
                                "q8_0", "-q"], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    run = subprocess.run(cli + ["inspect", str(out)], capture_output=True, text=True, check=True)
    assert "DSpark drafter: 1 layers, hidden 640, target layers (inputs) [2, 9, 16], block size 4" in run.stdout
    for policy in ("fixed", "auto"):
        e = Engine(gemma_target, out, n_ctx=1024, n_threads=1, draft_policy=policy)
        assert e.max_draft == 4
        for i, p in enumerate(make_prompts(3, seed=12)):
            spec, = assert_lossless(e, p, max_tokens=12, drafted=False)
            # what the policy cuts with: the confidence head's rating of each draft after this output
            tokens, ratings = e.drafter.draft_rated(e.prompt_tokens(p) + spec.token_ids, 4)
            assert len(tokens) == len(ratings) == 4 and all(0 < c < 1 for c in ratings)
            assert_lossless(e, p, max_tokens=12, sampling=dict(temperature=1.0), seed=7 + i, drafted=False)


# -- the adaptive policy's cut by the drafter's confidence ------------------------------------------------------------


class AlwaysDrafting(SteadyCosts):
    """The policy with steady costs that always drafts a full block, not as a probe: every drafted block goes
    through the cut by the drafter's ratings (here: random-weight drafters, whose drafts the target rejects)."""

    def choose(self):
        self.probing = False
        return self.max_draft


@pytest.mark.parametrize("variant", ["DSpark", "DFlash2"])
def test_real_drafters_ratings_cut_their_blocks_losslessly(work, converted, tiny_target, variant):
    info = read_gguf(tiny_target)
    if variant == "DSpark":
        path = converted("deepspec", "f32")
    else:
        cfg = zlab2_config(hidden=64, n_layer=1, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=LAYER_IDS,
                           num_target_layers=4, vocab_size=info.n_vocab,
                           mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=BLOCK, selector_rank=16,
                           selector_top_k=6)
        path = convert_drafter(write_checkpoint(work / "policy-DFlash2", cfg), tiny_target,
                               work / "out/policy-d2.gguf", "f32").path
    e = Engine(tiny_target, path, n_ctx=1024, n_threads=1, draft_policy="auto")
    e._policies["drafter"] = AlwaysDrafting(e.max_draft)
    steps = []
    for p in make_prompts(4, seed=13):
        base = e.complete(p, max_tokens=30, draft=False)
        events = list(e.generate(p, max_tokens=30))
        assert events[-1].token_ids == base.token_ids, p
        steps += [ev for ev in events if isinstance(ev, StepStats)]
    rated = sum(e._policies["drafter"].rated_tried)
    assert rated > 5  # the ratings of the verified drafts reached the calibration
    # once it has seen these ratings rejected, the policy stops verifying drafts rated like them
    late = steps[len(steps) // 2:]
    assert sum(s.n_drafted for s in late) < 0.25 * e.max_draft * len(late), [s.n_drafted for s in late]
