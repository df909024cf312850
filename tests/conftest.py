import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from fixtures import write_tiny_drafter, write_tiny_gemma4, write_tiny_target

from dflash_local import Engine
from dflash_local.convert.init_drafter import init_drafter
from dflash_local import models

_WORDS = (
    "the a river code function model token fast slow cat dog write read list sum value "
    "number city language speed draft verify block return class import print loop data "
    "paper music light night water green blue small large tree house def if else while"
).split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Deterministic, varied prompts: prose and code fragments."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12)))
        if i % 3 == 0:
            prompts.append(f"def {rng.choice(_WORDS)}(x):\n    # {words}\n")
        elif i % 3 == 1:
            prompts.append(words.capitalize() + ".")
        else:
            prompts.append(f"Q: {words}?\nA:")
    return prompts


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_target(models_dir):
    return write_tiny_target(models_dir / "tiny-target.gguf")


@pytest.fixture(scope="session")
def tiny_drafter(models_dir, tiny_target):
    return write_tiny_drafter(models_dir / "tiny-drafter.gguf", tiny_target, target_layers=(1, 3), block_size=8)


@pytest.fixture(scope="session")
def tiny_engine(tiny_target, tiny_drafter):
    # full blocks every step: the tests below count on every acceptance length being tried
    return Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")


@pytest.fixture(scope="session")
def gemma_target():
    return models.target("gemma")


@pytest.fixture(scope="session")
def gemma_drafter(models_dir, gemma_target):
    # an untrained drafter shaped like a small DFlash drafter for gemma-3-270m (hidden 640, 18 layers)
    return init_drafter(
        models_dir / "gemma-drafter.gguf", gemma_target, n_target_layers=3, block_size=4, head_dim=64, n_ff=512
    )


@pytest.fixture(scope="session")
def gemma4(models_dir):
    # a tiny gemma4 with sliding-window layers (a window of 8 tokens) beside full ones (tests/fixtures.py)
    return write_tiny_gemma4(models_dir / "tiny-gemma4.gguf")


@pytest.fixture(scope="session")
def gemma4_drafter(models_dir, gemma4):
    # features after layer 0 (sliding), layer 3 (the last full layer with its own KV) and layer 4 (shared KV)
    return write_tiny_drafter(models_dir / "tiny-gemma4-drafter.gguf", gemma4, target_layers=(1, 4, 5), block_size=8)


@pytest.fixture(scope="session")
def gemma_engine(gemma_target, gemma_drafter):
    return Engine(gemma_target, gemma_drafter, n_ctx=2048, draft_policy="fixed")


# -- upstream llama.cpp's converter, the reference for ours ------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = "llama-cpp-python==0.3.36"  # the llama.cpp this project builds on, whose converter is the reference


def _sdist() -> Path | None:
    """The llama-cpp-python sdist scripts/setup.sh keeps (scripts/fetch-sdist.sh downloads it if missing)."""
    run = subprocess.run(["bash", str(ROOT / "scripts" / "fetch-sdist.sh")], capture_output=True, text=True,
                         check=False, env={**os.environ, "PYTHON": sys.executable})
    return Path(run.stdout.strip()) if run.returncode == 0 else None


def _llama_cpp_source(cache: Path) -> Path | None:
    """llama.cpp's source as vendored in llama-cpp-python's sdist: $DFLASH_LLAMA_CPP_SRC, or the sdist's converter
    and gguf-py, unpacked once into a cache."""
    given = os.environ.get("DFLASH_LLAMA_CPP_SRC")
    if given:
        return Path(given)
    src = cache / "llama.cpp"
    if (src / "conversion" / "qwen.py").is_file():
        return src
    sdist = _sdist()
    if sdist is None:
        return None
    with tarfile.open(sdist) as tar:
        prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith((prefix + "conversion/", prefix + "gguf-py/")) and m.isfile()]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(src, members=members, filter="data")
    return src


@pytest.fixture(scope="session")
def llama_cpp_sdist():
    sdist = _sdist()
    if sdist is None:
        pytest.skip(f"the {LLAMA_CPP} sdist is not available (scripts/fetch-sdist.sh failed: no package index?)")
    return sdist


@pytest.fixture(scope="session")
def llama_cpp_src():
    src = _llama_cpp_source(Path.home() / ".cache" / "dflash-local-tests")
    if src is None:
        pytest.skip(f"the source of {LLAMA_CPP} is not available (set DFLASH_LLAMA_CPP_SRC or allow pip download)")
    return src


def upstream_convert(src, ckpt_dir, target, out) -> Path:
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "upstream_convert.py"), str(src),
                          str(ckpt_dir), str(target), str(out)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def gguf_contents(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape), np.array(t.data)) for t in r.tensors}
    return kv, tensors


# general.* is provenance (name, size label, ...), not something llama.cpp reads; ours always states causal
UPSTREAM_ONLY = {"general.quantization_version", "general.size_label", "general.type"}


def check_same_as_upstream(ours, upstream, ours_only=frozenset({"dflash.attention.causal"})):
    """Our converter's GGUF against upstream's for the same checkpoint: every key upstream writes but its provenance
    (the same values; general.name aside), at most `ours_only` more, and the same tensors bit for bit. Returns
    ours_kv, up_kv, up_t for the checks of each variant."""
    ours_kv, ours_t = gguf_contents(ours)
    up_kv, up_t = gguf_contents(upstream)
    assert set(up_kv) - set(ours_kv) == UPSTREAM_ONLY
    assert set(ours_kv) - set(up_kv) <= ours_only
    for key in set(up_kv) & set(ours_kv) - {"general.name"}:
        assert ours_kv[key] == up_kv[key], key
    assert ours_t.keys() == up_t.keys()
    for name, (qtype, shape, data) in up_t.items():
        assert ours_t[name][:2] == (qtype, shape), name
        assert np.array_equal(ours_t[name][2], data), name
    return ours_kv, up_kv, up_t
