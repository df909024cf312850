"""`dflash-local convert` and `inspect`: z-lab DFlash checkpoints -> llama.cpp `dflash` GGUFs.

Checkpoints are written by the tests in z-lab's exact layout (tests/zlab.py): random BF16 weights, real config
fields, GQA, head_dim != hidden / heads, several shards with an index json. Parity is checked three ways:
llama.cpp's dflash graph on the converted file against a float64 NumPy reference of the drafter (raw logits),
the engine's native step against the same reference (drafts and their probabilities), and generation through the
engine (token-identical to plain decoding).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from fixtures import write_tiny_target
from zlab import LlamaProbe, Reference, from_bf16_bits, read_safetensors, target_matrices, write_checkpoint, zlab_config

from dflash_local import Engine, _native
from dflash_local.convert import hf_to_gguf
from dflash_local.convert.errors import ConvertError
from dflash_local.convert.hf_to_gguf import add_convert_args, convert_drafter, run_convert
from dflash_local.convert.inspect_gguf import add_inspect_args, run_inspect
from dflash_local.gguf_file import read_gguf
from dflash_local.validate import check_pair

H = 64  # hidden size of the tiny target
LAYER_IDS = [0, 1, 2]  # z-lab ids (outputs of layers 0..2) -> GGUF layer inputs 1..3 of the 4-layer target
PROB_RTOL = {"f32": 1e-4, "f16": 1e-2, "q8_0": 0.1}  # draft probabilities against the reference (measured 2e-6,
# 1.2e-3, 0.05)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target  # conftest's: the tiny target every test of the package reads and none writes


@pytest.fixture(scope="module")
def target_info(target):
    return read_gguf(target)


def config_for(info, **kw):
    """A z-lab config for the tiny target: 3 layers, GQA 4/2, head_dim 32 (hidden / heads would be 16)."""
    args = dict(hidden=H, n_layer=3, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=LAYER_IDS,
                num_target_layers=info.get("block_count"), vocab_size=info.n_vocab,
                mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8)
    args.update(kw)
    return zlab_config(**args)


@pytest.fixture(scope="module")
def ckpt(work, target_info):
    return write_checkpoint(work / "zlab-tiny-DFlash", config_for(target_info), n_shards=3)


@pytest.fixture(scope="module")
def reference(ckpt, target):
    embd, head = target_matrices(target)
    return Reference(ckpt, embd, head)


@pytest.fixture(scope="module")
def converted(work, ckpt, target):
    cache = {}

    def get(outtype):
        if outtype not in cache:
            cache[outtype] = convert_drafter(ckpt, target, work / f"out/drafter-{outtype}.gguf", outtype).path
        return cache[outtype]

    return get


def random_blocks(n, n_vocab, mask, width, block, seed=0):
    """(features, noise block) pairs: random target features for 3..60 positions, [last, mask x (block-1)]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feats = rng.standard_normal((int(rng.integers(3, 60)), width)).astype(np.float32)
        out.append((feats, [int(rng.integers(0, n_vocab))] + [mask] * (block - 1)))
    return out


def compare(probe, reference, blocks):
    errs, same, n = [], 0, 0
    for feats, toks in blocks:
        got, want = probe.logits(feats, toks), reference.logits(feats, toks)
        keep = np.isfinite(want)  # a reduced draft vocabulary leaves -inf outside its tokens
        assert np.array_equal(keep, np.isfinite(got))
        errs.append(np.linalg.norm(got[keep] - want[keep]) / np.linalg.norm(want[keep]))
        same += int((got.argmax(1) == want.argmax(1)).sum())
        n += len(toks)
    return max(errs), same / n


def clear_top1(probe, reference, blocks):
    """Positions whose reference top two differ by more than 3x the row's RMS error (a closer race is a coin toss
    for any rounding): their share of all positions, and the share of them where the probe has the same top-1."""
    clear = agree = n = 0
    for feats, toks in blocks:
        got, want = probe.logits(feats, toks), reference.logits(feats, toks)
        keep = np.isfinite(want)
        top2 = np.sort(np.where(keep, want, -np.inf), axis=1)[:, -2:]
        rms = np.sqrt(np.mean(np.where(keep, got - want, 0.0) ** 2, axis=1))
        rows = top2[:, 1] - top2[:, 0] > 3 * rms
        clear += int(rows.sum())
        agree += int((got.argmax(1) == want.argmax(1))[rows].sum())
        n += len(toks)
    return clear / n, agree / max(clear, 1)


def no_leftovers(folder: Path, allowed=()):
    left = sorted(p.name for p in folder.iterdir() if p.name not in allowed)
    assert left == [], left


# -- layout -----------------------------------------------------------------------------------------------------------


def test_layout_metadata_and_exact_bf16(converted, ckpt, target_info):
    path = converted("bf16")
    info = read_gguf(path)
    assert info.arch == "dflash"
    spec = check_pair(target_info, info)
    assert spec.layers == [i + 1 for i in LAYER_IDS]  # z-lab target_layer_ids + 1
    assert spec.block_size == 8 and spec.mask_token == target_info.kv["tokenizer.ggml.mask_token_id"]
    assert info.get("attention.causal") is False
    assert info.get("attention.key_length") == 32 and info.get("attention.head_count_kv") == 2
    assert info.get("embedding_length") == H and info.get("block_count") == 3
    assert info.get("rope.freq_base") == 1000000.0 and info.get("context_length") == 40960
    assert info.kv["tokenizer.ggml.tokens"].digest == target_info.kv["tokenizer.ggml.tokens"].digest
    assert info.kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    t = info.tensors
    assert t["fc.weight"].shape == (len(LAYER_IDS) * H, H) and t["fc.weight"].type == "BF16"
    assert t["blk.2.attn_q.weight"].shape == (H, 4 * 32) and t["blk.2.attn_k.weight"].shape == (H, 2 * 32)
    assert t["enc.output_norm.weight"].type == "F32" and t["blk.0.attn_q_norm.weight"].shape == (32,)
    assert "token_embd.weight" not in t and "output.weight" not in t  # borrowed from the target at run time
    # BF16 -> BF16 is a copy of the bits; F32 holds exactly the same values
    src = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        src.update(read_safetensors(f))
    r16 = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}
    r32 = {x.name: x for x in gguf.GGUFReader(str(converted("f32"))).tensors}
    for hf, name in [("fc.weight", "fc.weight"), ("layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
                     ("hidden_norm.weight", "enc.output_norm.weight")]:
        want = src[hf]
        if r16[name].tensor_type == gguf.GGMLQuantizationType.BF16:
            got16 = from_bf16_bits(np.array(r16[name].data).view(np.uint16)).reshape(want.shape)
            assert np.array_equal(got16, want)
        assert np.array_equal(np.array(r32[name].data).reshape(want.shape), want)


def test_mask_token_and_warnings(work, target, target_info):
    # no mask token in dflash_config: the target's own is used; a drafter trained on a deeper target is only a warning
    cfg = config_for(target_info, num_target_layers=36)
    del cfg["dflash_config"]["mask_token_id"]
    d = write_checkpoint(work / "ck-nomask", cfg, n_shards=1)
    r = convert_drafter(d, target, work / "out-nomask/d.gguf", "f16")
    assert read_gguf(r.path).kv["tokenizer.ggml.mask_token_id"] == target_info.kv["tokenizer.ggml.mask_token_id"]
    assert any("36-layer target" in w for w in r.warnings)


def test_unindexed_shards_and_single_file(work, target, target_info):
    cfg = config_for(target_info)
    for name, shards, index in [("noindex", 2, False), ("single", 1, False)]:
        d = write_checkpoint(work / f"ck-{name}", cfg, n_shards=shards, index=index)
        out = convert_drafter(d, target, work / f"out-{name}/d.gguf", "f32").path
        assert len(read_gguf(out).tensors) == 3 + 11 * 3


# -- parity with the NumPy reference ------------------------------------------------------------------------------


def test_f32_logits_match_reference(converted, target, reference, target_info):
    probe = LlamaProbe(target, converted("f32"))
    try:
        blocks = random_blocks(12, target_info.n_vocab, target_info.kv["tokenizer.ggml.mask_token_id"],
                               len(LAYER_IDS) * H, 8)
        err, same = compare(probe, reference, blocks)
    finally:
        probe.close()
    assert err < 1e-4, err
    assert same == 1.0


# bf16 weights convert bit-exactly; what remains is ggml rounding activations to the weight type (bf16 keeps 8 bits)
@pytest.mark.parametrize("outtype,max_err", [("f16", 1e-3), ("bf16", 5e-3), ("q8_0", 2e-2)])
def test_quantized_top1_matches_reference(converted, target, reference, target_info, outtype, max_err):
    probe = LlamaProbe(target, converted(outtype))
    try:
        blocks = random_blocks(80, target_info.n_vocab, target_info.kv["tokenizer.ggml.mask_token_id"],
                               len(LAYER_IDS) * H, 8, seed=1)
        err, same = compare(probe, reference, blocks)
        clear, agree = clear_top1(probe, reference, blocks)
    finally:
        probe.close()
    # 640 positions of a random-weight drafter: near ties are common, and the share of those a type's rounding flips
    # varies with the CPU's kernels (q8_0: 0.989-1.0 here); every position with a clear winner must agree
    assert same >= 0.98, same
    assert clear >= 0.9 and agree == 1.0, (clear, agree)
    assert err < max_err, err


@pytest.fixture(scope="module")
def target256(work):
    # K-quants work on rows of 256: a target (and drafter) of hidden size 256
    return write_tiny_target(work / "target256.gguf", n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64,
                             n_ff=512)


@pytest.mark.parametrize("outtype,min_same,max_err,qtype", [
    ("q4_0", 0.85, 0.15, "Q4_0"), ("q4_k_m", 0.85, 0.15, "Q4_K"), ("q5_k_m", 0.9, 0.08, "Q5_K"),
    ("q6_k", 0.95, 0.05, "Q6_K"),
])
def test_low_bit_types_load_and_draft(work, target256, outtype, min_same, max_err, qtype):
    info = read_gguf(target256)
    mask = info.kv["tokenizer.ggml.mask_token_id"]
    cfg = zlab_config(hidden=256, n_layer=2, n_head=4, n_kv=2, head_dim=128, n_ff=512, target_layer_ids=[0, 2],
                      num_target_layers=4, vocab_size=info.n_vocab, mask_token_id=mask, block_size=16)
    d = work / "ck256"
    if not d.exists():
        write_checkpoint(d, cfg, n_shards=2)
    out = convert_drafter(d, target256, work / f"out256/d-{outtype}.gguf", outtype).path
    got = read_gguf(out)
    types = {t.name: t.type for t in got.tensors.values()}
    assert types["blk.0.ffn_gate.weight"] == qtype
    assert all(types[n] == "F32" for n in types if n.endswith("norm.weight"))  # norms stay f32
    assert got.kv["general.file_type"] == gguf.LlamaFileType[f"MOSTLY_{outtype.upper()}"]
    assert got.kv["tokenizer.ggml.mask_token_id"] == mask and got.get("target_layers").values == [1, 3]
    embd, head = target_matrices(target256)
    probe = LlamaProbe(target256, out)
    try:
        err, same = compare(probe, Reference(d, embd, head), random_blocks(20, info.n_vocab, mask, 512, 16, seed=2))
    finally:
        probe.close()
    assert same >= min_same and err < max_err, (same, err)
    no_leftovers(work / "out256", allowed={p.name for p in (work / "out256").glob("d-*.gguf")})


# -- the engine --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_native_step_drafts_match_reference(converted, target, reference, target_info, outtype):
    """The product path: features captured from the target and injected step after step, drafts from the engine's
    native step, compared with the reference fed the same features."""
    from conftest import make_prompts

    mask = target_info.kv["tokenizer.ggml.mask_token_id"]
    tgt, dft = _native.Model(str(target), 0, False), _native.Model(str(converted(outtype)), 0, False)
    session = _native.Session(tgt, dft, [i + 1 for i in LAYER_IDS], 512, 2, True, False)
    session.keep_draft_logits(True)
    greedy = _native.Sampling()
    same = n = 0
    for prompt in make_prompts(4, seed=7):
        session.truncate(0)
        last = session.prefill(tgt.tokenize(prompt, True, False), greedy, 0)
        feats = session.features()
        for k in range(10):
            d = session.draft(last, 7, True)
            r = session.step(last, d.tokens, greedy, 1 + k)
            got, want = session.draft_logits(), reference.logits(feats, [last] + [mask] * 7)[1:]
            if outtype == "f32":
                assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4
            assert list(d.tokens) == got.argmax(1).tolist()
            # the probability reported for each draft is the drafter's softmax at that token, and the reference's
            # within the logits' error
            probs = [softmax(row)[t] for row, t in zip(got, d.tokens)]
            np.testing.assert_allclose(d.probs, probs, rtol=1e-4)
            ref_probs = [softmax(row)[t] for row, t in zip(want, d.tokens)]
            np.testing.assert_allclose(d.probs, ref_probs, rtol=PROB_RTOL[outtype])
            same += int((got.argmax(1) == want.argmax(1)).sum())
            n += len(want)
            for j in np.nonzero(got.argmax(1) != want.argmax(1))[0]:
                top2 = np.sort(want[j])[-2:]
                assert top2[1] - top2[0] < 0.05 * want[j].std()  # a disagreement is a near-tie, never more
            feats = np.concatenate([feats, session.features()[: r.n_accepted + 1]])  # what the step injected
            last = r.tokens[-1]
    # 280 positions; random weights leave a few near-ties that q8_0 rounding may flip (the probe test above
    # meets 99% on 640 positions of random features)
    assert same / n >= (0.99 if outtype != "q8_0" else 0.98), same / n


def test_engine_output_with_converted_drafter(converted, target):
    from conftest import make_prompts

    engine = Engine(target, converted("q8_0"), n_ctx=512, draft_policy="fixed")  # drafts at every step
    for p in make_prompts(8, seed=3):
        base = engine.complete(p, max_tokens=24, draft=False)
        spec = engine.complete(p, max_tokens=24)
        assert spec.token_ids == base.token_ids and spec.text == base.text
        assert spec.summary.n_drafted > 0


# -- reduced draft vocabulary -------------------------------------------------------------------------------------


def test_checkpoint_d2t(work, target, target_info):
    rng = np.random.default_rng(5)
    n_draft = 100
    ids = np.sort(rng.choice(target_info.n_vocab, n_draft, replace=False))
    head = (rng.standard_normal((n_draft, H)) * 4 / np.sqrt(H)).astype(np.float32)
    cfg = config_for(target_info, block_size=8)
    cfg["draft_vocab_size"] = n_draft
    extra = {"d2t": ("I64", (ids - np.arange(n_draft)).astype(np.int64)), "lm_head.weight": ("BF16", head),
             "t2d": ("I64", np.zeros(target_info.n_vocab, np.int64))}
    d = write_checkpoint(work / "ck-d2t", cfg, n_shards=2, extra=extra)
    out = convert_drafter(d, target, work / "out-d2t/d.gguf", "f32").path
    info = read_gguf(out)
    assert info.tensors["d2t"].type == "I64" and info.tensors["output.weight"].shape == (H, n_draft)
    r = {x.name: x for x in gguf.GGUFReader(str(out)).tensors}
    assert np.array_equal(np.array(r["d2t"].data), ids)  # stored as absolute target ids
    embd, thead = target_matrices(target)
    probe = LlamaProbe(target, out)
    try:
        blocks = random_blocks(8, target_info.n_vocab, target_info.kv["tokenizer.ggml.mask_token_id"],
                               len(LAYER_IDS) * H, 8, seed=4)
        err, same = compare(probe, Reference(d, embd, thead), blocks)
    finally:
        probe.close()
    assert err < 1e-4 and same == 1.0
    engine = Engine(target, out, n_ctx=256)
    spec, base = engine.complete("Hello", max_tokens=16), engine.complete("Hello", max_tokens=16, draft=False)
    assert spec.token_ids == base.token_ids and spec.summary.n_drafted > 0


def test_draft_vocab_from_target_head(work, ckpt, target, target_info, reference):
    ids = list(range(0, target_info.n_vocab, 3))
    vocab = work / "vocab.txt"
    vocab.write_text(" ".join(map(str, ids)))
    out = convert_drafter(ckpt, target, work / "out-dv/d.gguf", "f32", draft_vocab=vocab).path
    r = {x.name: x for x in gguf.GGUFReader(str(out)).tensors}
    _, head = target_matrices(target)
    assert np.array_equal(np.array(r["d2t"].data), ids)
    assert np.array_equal(np.array(r["output.weight"].data).reshape(len(ids), H), head[ids])
    probe = LlamaProbe(target, out)
    try:
        feats, toks = random_blocks(1, target_info.n_vocab, target_info.kv["tokenizer.ggml.mask_token_id"],
                                    len(LAYER_IDS) * H, 8, seed=6)[0]
        got = probe.logits(feats, toks)
    finally:
        probe.close()
    want = reference.logits(feats, toks)
    assert np.all(np.isinf(np.delete(got, ids, axis=1)))
    np.testing.assert_allclose(got[:, ids], want[:, ids], rtol=1e-4, atol=1e-4)  # the kept tokens' logits unchanged
    with pytest.raises(ConvertError, match="outside the target's vocabulary"):
        (work / "bad.txt").write_text(f"1 2 {target_info.n_vocab}")
        convert_drafter(ckpt, target, work / "out-dv/bad.gguf", "f32", draft_vocab=work / "bad.txt")


# -- Hub ids (offline, from a filled cache) ---------------------------------------------------------------------------


def test_hub_id_from_offline_cache(work, ckpt, target, converted):
    cache = work / "hf-cache"
    repo = cache / "models--zlab-test--tiny-DFlash"
    snap = repo / "snapshots" / ("0123456789abcdef" * 2 + "01234567")
    snap.mkdir(parents=True)
    for f in ckpt.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(work / "hf-home"))
    code = (
        "import argparse, sys\n"
        "from dflash_local.convert.hf_to_gguf import add_convert_args, run_convert\n"
        "p = argparse.ArgumentParser(); add_convert_args(p)\n"
        "from dflash_local.convert.errors import ConvertError\n"
        "try:\n    sys.exit(run_convert(p.parse_args(sys.argv[1:])))\n"
        "except ConvertError as e:\n    print('ERROR', e); sys.exit(2)\n"
    )
    out = work / "out-hub" / "d.gguf"
    run = subprocess.run([sys.executable, "-c", code, "zlab-test/tiny-DFlash", "-m", str(target), "-o", str(out),
                          "--outtype", "f32", "-q"], env=env, capture_output=True, text=True, cwd=work, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    info = read_gguf(out)
    assert info.kv["general.name"] == "tiny-DFlash"
    hub = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    local = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(converted("f32"))).tensors}
    assert hub.keys() == local.keys() and all(np.array_equal(hub[n], local[n]) for n in hub)
    run = subprocess.run([sys.executable, "-c", code, "zlab-test/not-cached", "-m", str(target), "-o",
                          str(work / "out-hub" / "x.gguf"), "-q"],
                         env=env, capture_output=True, text=True, cwd=work, check=False)
    assert run.returncode == 2 and "not in the local Hugging Face cache" in run.stdout, run.stdout + run.stderr
    no_leftovers(work / "out-hub", allowed={"d.gguf"})


# -- errors: clear messages, no partial files -------------------------------------------------------------------------


def _variant(work, ckpt, name, edit_config=None, edit_files=None):
    d = work / f"bad-{name}"
    shutil.copytree(ckpt, d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_files:
        edit_files(d)
    return d


def _truncate(d):
    shard = sorted(d.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)


def _drop_shard(d):
    sorted(d.glob("*.safetensors"))[0].unlink()


def _extra_tensor(d):
    from zlab import write_safetensors

    name = "layers.0.attention_conv.base_kernel"  # a DFlash2 tensor
    zeros = np.zeros((2, 2, H), np.float32)
    write_safetensors(d / "model-extra.safetensors", [(name, "BF16", zeros.shape, lambda: zeros)])
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"][name] = "model-extra.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _set(key, value):
    def edit(cfg):
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    return edit


ERROR_CASES = [
    ("arch", _set("architectures", ["Qwen3ForCausalLM"]), None, "unknown architecture"),
    ("dflash2", _set("architectures", ["DFlash2DraftModel"]), None, "needs dflash_config.conv_kernel_size"),
    ("no-dflash-config", _set("dflash_config", None), None, "missing 'dflash_config'"),
    ("hidden", _set("hidden_size", 128), None, "shape"),  # the weights disagree with the config first
    ("deep", lambda c: c["dflash_config"].update(target_layer_ids=[1, 9, 17]), None,
     "target_layer_ids \\[9, 17\\] do not exist"),
    ("vocab", _set("vocab_size", 151936), None, "vocabulary has 151936 tokens"),
    ("mask", lambda c: c["dflash_config"].update(mask_token_id=151669), None, "mask token 151669 is outside"),
    ("truncated", None, _truncate, "truncated"),
    ("missing-shard", None, _drop_shard, "is missing"),
    ("dflash2-tensor", None, _extra_tensor, "unexpected tensor 'layers.0.attention_conv.base_kernel'"),
    ("bias", _set("attention_bias", True), None, "biases are not supported"),
]


@pytest.mark.parametrize("name,edit_config,edit_files,message", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_checkpoints_fail_clearly_without_output(work, ckpt, target, name, edit_config, edit_files, message):
    d = _variant(work, ckpt, name, edit_config, edit_files)
    out_dir = work / f"out-bad-{name}"
    with pytest.raises(ConvertError, match=message):
        convert_drafter(d, target, out_dir / "d.gguf", "q8_0")
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_target_with_another_hidden_size(work, ckpt, target256):
    with pytest.raises(ConvertError, match="hidden size is 64, target256.gguf has 256"):
        convert_drafter(ckpt, target256, work / "out-mismatch/d.gguf", "f16")
    assert not (work / "out-mismatch").exists() or not any((work / "out-mismatch").iterdir())


def test_target_is_not_a_drafter_or_missing(work, ckpt, converted):
    with pytest.raises(ConvertError, match="is a DFlash drafter"):
        convert_drafter(ckpt, converted("f32"), work / "out-x/d.gguf")
    with pytest.raises(ConvertError, match="no such file"):
        convert_drafter(ckpt, work / "nope.gguf", work / "out-x/d.gguf")
    with pytest.raises(ConvertError, match="not a Hugging Face repository id"):
        convert_drafter(work / "no/such/dir", converted("f32"), work / "out-x/d.gguf")


def test_unwritable_output(work, ckpt, target):
    blocker = work / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConvertError, match="cannot write"):
        convert_drafter(ckpt, target, blocker / "d.gguf", "f16")
    with pytest.raises(ConvertError, match="is a directory"):
        convert_drafter(ckpt, target, work, "f16")


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_failure_midway_leaves_old_file_and_no_temporaries(work, ckpt, target, monkeypatch, outtype):
    out_dir = work / f"out-mid-{outtype}"
    out_dir.mkdir()
    old = out_dir / "d.gguf"
    old.write_bytes(b"previous version")
    calls = []
    real = hf_to_gguf.encode

    def failing(t, q):
        calls.append(t.name)
        if len(calls) == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C halfway
        return real(t, q)

    monkeypatch.setattr(hf_to_gguf, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        convert_drafter(ckpt, target, old, outtype)
    assert old.read_bytes() == b"previous version"
    no_leftovers(out_dir, allowed={"d.gguf"})


# -- command line, progress, inspect ----------------------------------------------------------------------------------


def test_cli_functions_progress_and_inspect(work, ckpt, target, capsys):
    p = argparse.ArgumentParser()
    add_convert_args(p)
    out = work / "out-cli" / "d.gguf"
    assert run_convert(p.parse_args([str(ckpt), "-m", str(target), "-o", str(out), "--outtype", "q8_0"])) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(out)
    assert "d.gguf (q8_0)" in cap.err and "wrote" in cap.err  # the progress bar and the summary line

    p = argparse.ArgumentParser()
    add_inspect_args(p)
    assert run_inspect(p.parse_args([str(out)])) == 0
    text = capsys.readouterr().out
    assert "architecture dflash, file type MOSTLY_Q8_0" in text
    assert "target layers (inputs) [1, 2, 3], block size 8, mask token" in text
    assert "blk.0.ffn_gate.weight" in text and "Q8_0" in text and "tokenizer.ggml.tokens = [str x" in text
    assert run_inspect(p.parse_args([str(out), "--json"])) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["tensor_types"] == {"Q8_0": 1 + 7 * 3, "F32": 2 + 4 * 3}
    assert s["dflash"]["target_layers"] == [1, 2, 3]
