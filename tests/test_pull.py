"""`dflash-local pull` against a pre-populated Hugging Face cache, offline."""

import os
import shutil
import subprocess
import sys

from zlab import write_checkpoint, zlab_config

from dflash_local import Engine
from dflash_local.gguf_file import read_gguf
from dflash_local.pull import REGISTRY


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
        assert p.name in r.stdout and p.drafter_repo in r.stdout
    assert {"qwen3-8b", "llama-3.1-8b-instruct", "gpt-oss-20b", "gemma-4-31b-it", "qwen3.5-4b"} <= {
        p.name for p in REGISTRY}
    r = subprocess.run([sys.executable, "-m", "dflash_local", "pull", "no-such-model"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and "unknown pair" in r.stderr and "qwen3-8b" in r.stderr
