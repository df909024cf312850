"""The PyTorch drafter backend against the llama.cpp (ggml) drafter, and lossless generation with it."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_prompts

torch = pytest.importorskip("torch")

from dflash_local import Engine, _native  # noqa: E402
from dflash_local.engine.torch_drafter import pick_device  # noqa: E402


def draft_logits_both(target, drafter, prompt, n):
    """Draft logits of the same noise block from the ggml drafter and the torch drafter."""
    g = Engine(target, drafter, n_ctx=512)
    t = Engine(target, drafter, n_ctx=512, draft_backend="torch")
    sp = _native.Sampling()
    g.session.keep_draft_logits(True)
    ids = g.prompt_tokens(prompt)
    first = g.session.prefill(ids, sp, 0)
    g.session.draft(first, n)
    t.session.prefill(ids, sp, 0)
    t.drafter.add(t.session.features(), 0)
    return g.session.draft_logits(), t.drafter.logits(first, n).numpy()


@pytest.mark.parametrize("n", [1, 3, 7])
def test_f32_drafter_logits_match_the_ggml_drafter(tiny_target, tiny_drafter, n):
    for prompt in ("def add(a, b):", "The quick brown fox jumps over"):
        ggml, ref = draft_logits_both(tiny_target, tiny_drafter, prompt, n)
        assert ggml.shape == ref.shape == (n, 488)
        rel = np.abs(ggml - ref).max(axis=1) / np.abs(ref).max(axis=1)
        assert rel.max() < 1e-4
        assert (ggml.argmax(1) == ref.argmax(1)).all()


def test_gemma_drafter_top1_matches_the_ggml_drafter(gemma_target, gemma_drafter):
    # the ggml side multiplies by gemma's Q8_0 LM head, torch by its dequantized copy: compare the top-1 token
    agree = total = 0
    for prompt in make_prompts(6, seed=2):
        ggml, ref = draft_logits_both(gemma_target, gemma_drafter, prompt, 3)
        agree += int((ggml.argmax(1) == ref.argmax(1)).sum())
        total += len(ref)
    assert agree / total >= 0.99


def test_torch_backend_is_lossless_on_the_tiny_pair(tiny_target, tiny_drafter):
    e = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_backend="torch", draft_policy="fixed")
    assert e.model_info()["draft_backend"] == "torch (cpu)"
    for p in make_prompts(20, seed=4):
        spec = e.complete(p, max_tokens=24)
        assert spec.token_ids == e.complete(p, max_tokens=24, draft=False).token_ids
        assert spec.summary.n_drafted > 0 and spec.summary.draft_ms > 0
    # prefix reuse keeps the torch drafter's context in step with the target's cache
    first = e.complete("Hello world", max_tokens=30)
    again = e.complete("Hello world" + first.text, max_tokens=30)
    assert again.summary.n_cached > 0
    assert again.token_ids == e.complete("Hello world" + first.text, max_tokens=30, draft=False).token_ids
    # an external drafter in between leaves the torch drafter's context behind; the next run must catch up
    e.complete("Hello world" + first.text + again.text, max_tokens=10, external_drafter=lambda t, n: [0] * n)
    follow = "Hello world" + first.text + again.text + " more"
    assert e.complete(follow, max_tokens=20).token_ids == e.complete(follow, max_tokens=20, draft=False).token_ids


def test_torch_and_ggml_backends_draft_the_same_tokens(tiny_target, tiny_drafter):
    g = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    t = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_backend="torch", draft_policy="fixed")
    for p in make_prompts(5, seed=9):
        a, b = g.complete(p, max_tokens=40), t.complete(p, max_tokens=40)
        assert a.token_ids == b.token_ids
        assert (a.summary.n_drafted, a.summary.n_accepted) == (b.summary.n_drafted, b.summary.n_accepted)


def test_torch_backend_is_lossless_on_gemma(gemma_target, gemma_drafter):
    e = Engine(gemma_target, gemma_drafter, n_ctx=1024, draft_backend="torch")
    for p in make_prompts(5, seed=13):
        assert e.complete(p, max_tokens=16).token_ids == e.complete(p, max_tokens=16, draft=False).token_ids


def test_cli_torch_backend(tiny_target, tiny_drafter, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dflash_local", "generate", "-m", str(tiny_target), "-d", str(tiny_drafter),
         "--draft-backend", "torch", "--draft-device", "cpu", "-p", "Hello", "-n", "12", "--json"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12 and out["draft_ms"] > 0


def test_missing_devices_are_clear_errors():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            pick_device("cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="no Metal device"):
            pick_device("mps")
    assert pick_device("cpu") == "cpu"


def test_torch_from_safetensors_matches_ggml_from_the_converted_gguf(tmp_path, tiny_target):
    from zlab import write_checkpoint, zlab_config

    from dflash_local.convert.hf_to_gguf import convert_drafter
    from dflash_local.gguf_file import read_gguf

    info = read_gguf(tiny_target)
    cfg = zlab_config(hidden=64, n_layer=2, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=[0, 2],
                      num_target_layers=4, vocab_size=info.n_vocab,
                      mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8)
    ckpt = write_checkpoint(tmp_path / "zlab-DFlash", cfg, n_shards=2, dtype="F32")
    gguf_path = convert_drafter(ckpt, tiny_target, tmp_path / "drafter-f32.gguf", "f32").path
    for prompt in ("def add(a, b):", "Speculative decoding is"):
        ggml, _ = draft_logits_both(tiny_target, gguf_path, prompt, 7)
        t = Engine(tiny_target, ckpt, n_ctx=512, draft_backend="torch")  # the checkpoint folder itself
        sp = _native.Sampling()
        ids = t.prompt_tokens(prompt)
        first = t.session.prefill(ids, sp, 0)
        t.drafter.add(t.session.features(), 0)
        ref = t.drafter.logits(first, 7).numpy()
        rel = np.abs(ggml - ref).max(axis=1) / np.abs(ref).max(axis=1)
        assert rel.max() < 1e-4
    e = Engine(tiny_target, ckpt, n_ctx=512, draft_backend="torch")
    assert e.model_info()["drafter"]["quant"] == "safetensors"
    for p in make_prompts(5, seed=21):
        assert e.complete(p, max_tokens=20).token_ids == e.complete(p, max_tokens=20, draft=False).token_ids
    with pytest.raises(ValueError, match="checkpoint folder"):
        Engine(tiny_target, ckpt)


CHECK_WITHOUT_THE_CONVERTER = """
import sys
from dflash_local import Engine
from dflash_local.validate import PairError
target, ok, wide = sys.argv[1:]
Engine(target, ok, n_ctx=256, draft_backend="torch")
try:
    Engine(target, wide, n_ctx=256, draft_backend="torch")
except PairError as e:
    print("refused:", e)
print("converter imported:", "dflash_local.convert.hf_to_gguf" in sys.modules)
"""


def test_a_checkpoint_folder_is_checked_against_its_target_without_the_converter(tmp_path, tiny_target):
    """The torch drafter checks a z-lab checkpoint folder against its target with the check the converter uses too
    (validate.py): running one imports no converter."""
    from zlab import write_checkpoint, zlab_config

    from dflash_local.gguf_file import read_gguf

    info = read_gguf(tiny_target)
    folders = []
    for name, hidden in (("ok", 64), ("wide", 96)):
        cfg = zlab_config(hidden=hidden, n_layer=1, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=[0, 2],
                          num_target_layers=4, vocab_size=info.n_vocab,
                          mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8)
        folders.append(str(write_checkpoint(tmp_path / name, cfg, n_shards=1, dtype="F32")))
    r = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_THE_CONVERTER, str(tiny_target), *folders],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: drafter/target mismatch: the drafter's hidden size is 96" in r.stdout
    assert "converter imported: False" in r.stdout
