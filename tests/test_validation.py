"""Bad files and mismatched pairs end in clear errors before llama.cpp can abort the process."""

import subprocess
import sys

import pytest
import numpy as np
from fixtures import write_tiny_drafter, write_tiny_target

from dflash_local import Engine
from dflash_local.gguf_file import GGUFError, read_gguf
from dflash_local.validate import PairError


def test_reader_sees_what_the_writer_wrote(tiny_target, tiny_drafter):
    t, d = read_gguf(tiny_target), read_gguf(tiny_drafter)
    assert t.arch == "qwen3" and d.arch == "dflash"
    assert d.get("target_layers").values == [1, 3]
    assert d.get("block_size") == 8
    assert t.n_vocab == d.n_vocab == 488
    assert t.kv["tokenizer.ggml.tokens"].digest == d.kv["tokenizer.ggml.tokens"].digest
    assert d.tensors["fc.weight"].shape == (2 * 64, 64)


def test_drafter_for_a_deeper_target_is_refused(tmp_path, tiny_target):
    deep = write_tiny_target(tmp_path / "deep.gguf", n_layer=6)
    bad = write_tiny_drafter(tmp_path / "bad.gguf", deep, target_layers=(2, 5))
    with pytest.raises(PairError, match="do not exist"):
        Engine(tiny_target, bad)


def test_layer_zero_is_refused(tmp_path, tiny_target, tiny_drafter):
    # layer input 0 is the embedding output, which neither capture path provides
    with pytest.raises(PairError, match="do not exist"):
        Engine(tiny_target, _with_layers(tmp_path, tiny_drafter, (0, 3)))


def test_drafter_for_another_hidden_size_is_refused(tmp_path, tiny_target):
    narrow = write_tiny_target(tmp_path / "narrow.gguf", n_embd=32)
    bad = write_tiny_drafter(tmp_path / "bad.gguf", narrow)
    with pytest.raises(PairError, match="hidden size"):
        Engine(tiny_target, bad)


def test_drafter_for_another_vocabulary_is_refused(tmp_path, tiny_target):
    other = write_tiny_target(tmp_path / "other.gguf", vocab_size=400)
    bad = write_tiny_drafter(tmp_path / "bad.gguf", other)
    with pytest.raises(PairError, match="vocabulary"):
        Engine(tiny_target, bad)


def _with_layers(tmp_path, drafter, layers):
    """Copy a drafter GGUF with its dflash.target_layers replaced (same-length list, so offsets hold)."""
    info = read_gguf(drafter)
    data = bytearray(drafter.read_bytes())
    old = np.array(info.get("target_layers").values, dtype="<i4").tobytes()
    i = data.index(b"dflash.target_layers") + len(b"dflash.target_layers") + 4 + 4 + 8
    assert data[i : i + len(old)] == old
    data[i : i + len(old)] = np.array(layers, dtype="<i4").tobytes()
    out = tmp_path / "edited.gguf"
    out.write_bytes(bytes(data))
    return out


def test_drafter_for_another_tokenizer_is_refused(tmp_path, tiny_drafter, gemma_target):
    with pytest.raises(PairError):
        Engine(gemma_target, tiny_drafter)


def test_wrong_roles_are_refused(tiny_target, tiny_drafter):
    with pytest.raises(PairError, match="expected a 'dflash' drafter"):
        Engine(tiny_target, tiny_target)
    with pytest.raises(PairError, match="not a target"):
        Engine(tiny_drafter)


def test_corrupt_and_truncated_files(tmp_path, tiny_target, tiny_drafter):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 100)
    with pytest.raises(GGUFError, match="not a GGUF"):
        Engine(junk)
    cut = tmp_path / "cut.gguf"
    data = tiny_target.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated"):
        Engine(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(GGUFError, match="truncated"):
        Engine(header_only)
    with pytest.raises(GGUFError, match="no such file"):
        Engine(tmp_path / "missing.gguf")
    cut_draft = tmp_path / "cut-draft.gguf"
    cut_draft.write_bytes(tiny_drafter.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match="truncated"):
        Engine(tiny_target, cut_draft)


def test_bad_drafter_from_the_cli_is_an_error_not_a_crash(tmp_path, tiny_target):
    deep = write_tiny_target(tmp_path / "deep.gguf", n_layer=8)
    bad = write_tiny_drafter(tmp_path / "bad.gguf", deep, target_layers=(2, 7))
    r = subprocess.run(
        [sys.executable, "-m", "dflash_local", "generate", "-m", str(tiny_target), "-d", str(bad), "-p", "hi"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert "do not exist" in r.stderr
    assert "Traceback" not in r.stderr

