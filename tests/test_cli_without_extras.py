"""The command line with the core dependencies only, as after `pip install "dflash-local[smollm2]"`: torch and
matplotlib are blocked from import in the subprocess (a sitecustomize puts a finder first in sys.meta_path), and
commands that do not run a model do not load llama.cpp."""

import json
import os
import subprocess
import sys

import pytest
from zlab import write_checkpoint, zlab_config

from dflash_local.gguf_file import read_gguf

BLOCKER = '''
import sys


class BlockExtras:
    """Makes the optional extras' modules look uninstalled."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, BlockExtras())
'''
PROMPT = "The history of the printing press"


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("no-extras")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", "import numpy, torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "No module named 'torch' (blocked by the test)" in r.stderr, r.stderr
    return env


def dflash(env, cwd, *args):
    return subprocess.run([sys.executable, "-m", "dflash_local", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True)


def test_every_command_has_help_without_the_extras(bare_env, tmp_path):
    for command in ("generate", "serve", "tui", "bench", "convert", "inspect", "pull", "init-drafter", "train"):
        r = dflash(bare_env, tmp_path, command, "--help")
        assert r.returncode == 0, (command, r.stderr)
        assert r.stdout.startswith(f"usage: dflash-local {command} "), command


def test_generate_without_torch_is_lossless(bare_env, tmp_path, tiny_target, tiny_drafter):
    def generate(*args):
        r = dflash(bare_env, tmp_path, "generate", "-p", PROMPT, "-n", 24, "--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    # the tiny pair, and the default pair of scripts/demo.sh (SmolLM2, answering a chat message): its target and the
    # drafter shipped in the package
    for pair in (["-m", tiny_target, "-d", tiny_drafter], ["--chat"]):
        (draft, log), (plain, _) = generate(*pair), generate(*pair[:2], "--no-draft")
        assert draft["draft_ms"] > 0 and plain["draft_ms"] == 0
        assert len(draft["token_ids"]) == 24 and draft["token_ids"] == plain["token_ids"]
    assert "and smollm2-135m-instruct-dflash2-q8_0.gguf" in log  # the shipped drafter was found and loaded


def test_torch_commands_say_which_extra_to_install(bare_env, tmp_path, tiny_target, tiny_drafter):
    hint = 'needs torch, which is not installed: pip install "dflash-local[torch]"'
    r = dflash(bare_env, tmp_path, "train", "-m", tiny_target, "-o", tmp_path / "run")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"dflash-local: error: train {hint}"]
    assert not (tmp_path / "run").exists()
    # refused before any model loads (no "loading" line)
    r = dflash(bare_env, tmp_path, "generate", "-m", tiny_target, "-d", tiny_drafter, "--draft-backend", "torch",
               "-p", PROMPT)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"dflash-local: error: --draft-backend torch {hint}"]


def test_bench_without_matplotlib_reports_and_skips_only_the_plot(bare_env, tmp_path, tiny_target, tiny_drafter):
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.png").write_bytes(b"an earlier run's picture")
    r = dflash(bare_env, tmp_path, "bench", "-m", tiny_target, "-d", tiny_drafter, "-n", 8, "--no-peer",
               "--out", out)
    assert r.returncode == 0, r.stderr
    hint = 'matplotlib is not installed, so no bench.png (pip install "dflash-local[bench]")'
    assert r.stderr.splitlines()[0].endswith(hint) and r.stderr.splitlines()[-1].endswith(hint)
    assert "Traceback" not in r.stderr
    assert "Lossless: True." in r.stdout
    assert json.loads((out / "bench.json").read_text())["overall"]["lossless"] is True
    assert (out / "bench.md").is_file() and not (out / "bench.png").exists()


def test_convert_and_inspect_do_not_load_llama_cpp(bare_env, tmp_path, tiny_target):
    info = read_gguf(tiny_target)
    ckpt = write_checkpoint(tmp_path / "ckpt", zlab_config(
        hidden=64, n_layer=1, n_head=4, n_kv=2, head_dim=32, n_ff=96, target_layer_ids=[0, 2],
        num_target_layers=info.get("block_count"), vocab_size=info.n_vocab,
        mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8))
    out = tmp_path / "drafter.gguf"
    code = f"""
import json, sys
import dflash_local
from dflash_local.cli import main

def llama_loaded():
    modules = [m for m in ("llama_cpp", "dflash_local._native", "dflash_local.engine.engine") if m in sys.modules]
    return modules + ["libllama"] * ("libllama" in open("/proc/self/maps").read())

assert main(["convert", {str(ckpt)!r}, "-m", {str(tiny_target)!r}, "-o", {str(out)!r}, "--outtype", "q8_0"]) == 0
assert main(["inspect", {str(out)!r}]) == 0
before = llama_loaded()
dflash_local.Engine  # the engine, and llama.cpp with it, load on first use
print(json.dumps([before, llama_loaded()]))
"""
    r = subprocess.run([sys.executable, "-c", code], env=bare_env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "architecture dflash, file type MOSTLY_Q8_0" in r.stdout
    before, after = json.loads(r.stdout.splitlines()[-1])
    assert before == []
    assert after == ["dflash_local._native", "dflash_local.engine.engine", "libllama"]
