"""Bad files and mismatched pairs end in clear errors before llama.cpp can abort the process."""

import subprocess
import sys

import pytest
from fixtures import write_tiny_drafter

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


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target_layers=(2, 4)), "do not exist"),
        (dict(target_layers=(0, 2)), "do not exist"),
        (dict(n_embd=32), "hidden size"),
        (dict(n_vocab_tokens=400), "vocabulary"),
    ],
)
def test_mismatched_drafter_is_refused(tmp_path, tiny_target, kwargs, message):
    bad = write_tiny_drafter(tmp_path / "bad.gguf", tiny_target, **kwargs)
    with pytest.raises(PairError, match=message):
        Engine(tiny_target, bad)


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
    bad = write_tiny_drafter(tmp_path / "deep.gguf", tiny_target, target_layers=(2, 7))
    r = subprocess.run(
        [sys.executable, "-m", "dflash_local", "generate", "-m", str(tiny_target), "-d", str(bad), "-p", "hi"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert "do not exist" in r.stderr
    assert "Traceback" not in r.stderr
