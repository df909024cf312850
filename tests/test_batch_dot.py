"""The batch-invariant kernels added to ggml's CPU matmul (native/ggml/batch_dot.c, built into llama.cpp by
scripts/setup.sh): every element of a tile of 2..16 rows has the bits ggml's one-row kernel (vec_dot) gives it, for
each weight type they cover, compared element by element against the installed library's own vec_dot. The engine's
lossless tests then check what this buys end to end: drafted output token-identical to plain decoding while verify
batches run through these kernels."""

import re
import subprocess
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest

import llama_cpp
from dflash_local import Engine, _native
from cpu import cpu_flags
from fixtures import write_tiny_drafter, write_tiny_target
from lossless import assert_scripted_lossless

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(llama_cpp.__file__).parent.parent
TYPES = ["q8_0", "q5_0", "q4_K", "q6_K"]
GEMM = ["q5_0", "q4_0", "q4_1", "q4_K"]  # dflash_batch_gemm's, on every CPU with AVX2


# batch_dot.c's kernels (the build is -march=native): every type where vec_dot takes AVX2 with AVX512-VNNI lane sums,
# q4_K and q6_K on other AVX2 CPUs, none elsewhere
AVX2 = {"avx2", "f16c", "fma"}
VNNI = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
if VNNI <= cpu_flags() and "avx_vnni_int8" not in cpu_flags():
    KERNELS = TYPES
else:
    KERNELS = ["q4_K", "q6_K"] if AVX2 <= cpu_flags() else []


def build_check(tmp_path_factory, source: str) -> Path:
    """A checker in native/ggml/ built against the installed llama.cpp's headers and libraries."""
    if not (SITE / "include" / "ggml-cpu.h").is_file():
        pytest.skip(f"no ggml headers in {SITE / 'include'}")
    exe = tmp_path_factory.mktemp("check") / Path(source).stem
    lib = SITE / "llama_cpp" / "lib"
    cc = sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"
    r = subprocess.run([cc, "-O2", "-march=native", "-I", str(SITE / "include"), str(ROOT / "native" / "ggml" / source),
                        "-L", str(lib), "-lggml-cpu", "-lggml-base", "-lggml", "-lm", f"-Wl,-rpath,{lib}", "-o",
                        str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Path:
    """native/ggml/check_batch_dot.c (the installed library's dflash_batch_dot and vec_dot)."""
    return build_check(tmp_path_factory, "check_batch_dot.c")


def test_every_element_of_every_tile_is_vec_dots(check):
    r = subprocess.run([str(check)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "all identical"
    missing = {line.split(":")[0] for line in r.stdout.splitlines() if line.endswith("no kernel")}
    gemm = GEMM if AVX2 <= cpu_flags() else []
    no_gemm = {f"gemm {t}" for t in set(GEMM) - set(gemm)}
    q8_K = set() if AVX2 <= cpu_flags() else {"q8_K"}  # the activations' quantizer (its bytes checked too)
    assert missing == (set(TYPES) - set(KERNELS)) | no_gemm | q8_K, (
        f"this CPU's kernels are {KERNELS} and gemm {gemm}: {r.stdout}")


def test_the_benchmark_mode_runs_and_agrees(check):
    """The timing mode (bench/README's figures) computes the same products and says how long each took."""
    if not KERNELS:
        pytest.skip("this CPU has no AVX2: ggml keeps vec_dot for every row")
    r = subprocess.run([str(check), "bench"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if "rows 16" in line]
    assert [line.split()[0] for line in rows] == KERNELS
    assert all(" 0 of 65536 differ" in line for line in rows), r.stdout
    gemm = [line for line in r.stdout.splitlines() if line.startswith("gemm ")]
    assert [line.split()[1] for line in gemm] == GEMM, r.stdout
    assert all("rows 512, 1 threads: 0 of 1048576 differ" in line for line in gemm), r.stdout


@pytest.fixture(scope="module")
def check_matmul(tmp_path_factory) -> Path:
    """native/ggml/check_matmul.c (ggml's own matmul, whatever kernels it has)."""
    return build_check(tmp_path_factory, "check_matmul.c")


def assert_all_identical(checker: Path, threads: int) -> None:
    r = subprocess.run([str(checker), str(threads)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "all identical", r.stdout + r.stderr


def assert_bench_line(checker: Path, pattern: str) -> None:
    r = subprocess.run([str(checker), "2", "bench"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.fullmatch(pattern, r.stdout.strip()), r.stdout


@pytest.mark.parametrize("threads", [1, 2])
def test_ggmls_matmul_gives_a_row_its_bits_whatever_the_batch(check_matmul, threads):
    """The invariant exactness rests on, end to end through ggml's graph: products of 2..512 rows (prompt chunks,
    verify blocks) give every row the bits of its product alone (a one-token decode), for float, q8_0-family and
    K-quant weights and the attention's shape, whichever kernel ggml picks (setup.sh's sgemm, batch_dot, vec_dot).
    Upstream's sgemm fails it: its f32, f16, bf16 and iq4_nl rows differ from the row alone."""
    assert_all_identical(check_matmul, threads)


def test_the_attention_benchmark_mode_runs(check_matmul):
    """check_matmul THREADS bench: a decode step's two attention products at 4096 cells, timed
    (docs/measurements.md)."""
    assert_bench_line(check_matmul, r"decode step's attention, 4 heads, 4096 cells, 2 threads: K x Q \d+\.\d us, "
                                    r"V x softmax \d+\.\d us")


@pytest.fixture(scope="module")
def check_flash_attn(tmp_path_factory) -> Path:
    """native/ggml/check_flash_attn.c (ggml's own flash attention, whatever kernel it has)."""
    return build_check(tmp_path_factory, "check_flash_attn.c")


@pytest.mark.parametrize("threads", [1, 2])
def test_flash_attention_gives_a_row_its_bits_whatever_the_batch(check_flash_attn, threads):
    """Through ggml's graph: batches of 2..512 query rows over f16 and q8_0 caches (causal and sliding-window masks,
    grouped-query heads, a soft cap) give every row the bits of the row alone over a cache that ends at its cell, and
    agree with a double-precision softmax to 1e-4. Upstream's kernel fails it (its decode steps split the cache across
    threads, its batches of 32 rows or more are tiled, and it accumulates in f16)."""
    assert_all_identical(check_flash_attn, threads)


def test_the_flash_attention_benchmark_mode_runs(check_flash_attn):
    """check_flash_attn THREADS bench: a decode step and a prompt chunk at 4096 cells, for gemma's heads and for
    SmolLM2's, timed (docs/measurements.md)."""
    assert_bench_line(check_flash_attn, r"flash attention, 4 heads of 256, 4096 cells, 2 threads: a decode step "
                                        r"\d+\.\d us, a 512-row chunk \d+\.\d ms\n"
                                        r"flash attention, 9 heads of 64 on 3 K/V heads, 4096 cells, 2 threads: a "
                                        r"decode step \d+\.\d us, a 512-row chunk \d+\.\d ms")


def test_a_q4_1_target_verifies_with_a_one_token_decodes_bits(models_dir):
    """SmolLM2-135M-Instruct's layer type end to end (its Q4_1 file: q4_1 layers, a q8_0 head): a tiny llama whose
    layers are q4_1, random weights (flat logits, near ties everywhere). The first row of a step verifying 1..15
    drafts has a plain step's logits bit for bit (the q4_1 GEMM from 4 rows where this CPU has AVX2), and scripted
    drafts of every acceptance length give plain decoding's tokens."""
    q4_1, q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    path = write_tiny_target(models_dir / "tiny-q4_1.gguf", arch="llama", layer_type=q4_1, head_type=q8_0)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and
            t.name.endswith(("_q.weight", "_up.weight", "_down.weight"))} == {q4_1}
    drafter = write_tiny_drafter(models_dir / "tiny-q4_1-drafter.gguf", path, target_layers=(1, 3))
    e = Engine(path, drafter, n_ctx=512, draft_policy="fixed")
    s, sp = e.session, _native.Sampling()
    prompt = "def total(values):\n    result = 0\n"
    e.cache.clear()  # the session is driven by hand
    rows = []
    for n in (0, 1, 4, 7, 15):
        s.truncate(0)
        last = s.prefill(e.prompt_tokens(prompt), sp, 0)
        s.step(last, [last] * n, sp, 1)
        rows.append(s.logits(0))
    s.truncate(0)
    for row in rows[1:]:
        np.testing.assert_array_equal(row.view(np.uint32), rows[0].view(np.uint32))
    e.cache.clear()
    for p in (prompt, "The history of the printing press", "Q: river code?\nA:"):
        assert_scripted_lossless(e, p, max_tokens=48)
