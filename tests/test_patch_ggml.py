"""native/ggml/patch_ggml.py, which scripts/setup.sh runs on the llama-cpp-python 0.3.36 sdist before building it:
the real ggml-cpu sources of that sdist get batch_dot.c in their matmul, flash_attn.c in their flash attention and
both in their build, and llamafile's sgemm keeps to batch-invariant products, and a tree it was not written for (an
anchor changed) or one patched already is refused with one line, nothing written."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "native" / "ggml" / "patch_ggml.py"
CPU = "vendor/llama.cpp/ggml/src/ggml-cpu"
FILES = ("ggml-cpu.c", "CMakeLists.txt", "llamafile/sgemm.cpp", "ops.cpp", "arch/x86/quants.c")


@pytest.fixture
def sdist(tmp_path, request) -> Path:
    """An sdist-shaped tree holding the five files the patch edits, from llama-cpp-python 0.3.36's llama.cpp: a
    source tree given in $DFLASH_LLAMA_CPP_SRC, or the sdist itself."""
    root = tmp_path / "llama_cpp_python-0.3.36"
    cpu = root / CPU
    (cpu / "llamafile").mkdir(parents=True)
    (cpu / "arch" / "x86").mkdir(parents=True)
    given = Path(os.environ.get("DFLASH_LLAMA_CPP_SRC", "/nonexistent")) / "ggml" / "src" / "ggml-cpu"
    if (given / "ggml-cpu.c").is_file():
        for name in FILES:
            shutil.copyfile(given / name, cpu / name)
    else:
        with tarfile.open(request.getfixturevalue("llama_cpp_sdist")) as tar:
            for name in FILES:
                data = tar.extractfile(f"llama_cpp_python-0.3.36/{CPU}/{name}")
                (cpu / name).write_bytes(data.read())
    return root


def patch(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PATCH), str(root)], capture_output=True, text=True, timeout=60)


def contents(root: Path) -> dict[str, str]:
    cpu = root / CPU
    return {str(p.relative_to(cpu)): p.read_text() for p in sorted(cpu.rglob("*")) if p.is_file()}


def test_the_sdists_matmul_calls_the_kernels_and_builds_them(sdist):
    r = patch(sdist)
    assert r.returncode == 0, r.stderr
    c = (sdist / CPU / "ggml-cpu.c").read_text()
    assert c.count('#include "batch_dot.h"') == 1
    # one call, in the plain matmul's chunk loop (not the MoE one), before its per-element vec_dot loop
    call = c.index("dflash_batch_dot(")
    assert c.count("dflash_batch_dot(") == 1
    assert c.rindex("static void ggml_compute_forward_mul_mat_one_chunk(", 0, call) > c.rfind(
        "static void ggml_compute_forward_mul_mat_id_one_chunk(", 0, call)
    assert call < c.index("vec_dot(ne00, &tmp[ir0 - iir0]", call)
    assert "ggml-cpu/batch_dot.c" in (sdist / CPU / "CMakeLists.txt").read_text()
    # sgemm gets the converted rows of the heads that share a slice of src0 as one product; src1's own rows (the
    # first sgemm loop) go as before, a head at a time
    mm = c[c.index("\nvoid ggml_compute_forward_mul_mat(\n"):]
    first, converted = mm.index("(const char *)src1->data + i12*nb12"), mm.index("(const char *)wdata + (i12*ne11")
    assert mm.count("i12 += heads") == 1 and first < mm.index("i12 += heads") < converted
    assert mm.count("ne01, heads*ne11,") == 1 and "const int64_t heads = nb2 == ne1*nb1 ? r2 : 1;" in mm
    # whole products go to dflash_batch_gemm once src1 is converted (after the threads' barrier), before that sgemm
    gemm = mm.index("dflash_batch_gemm(src0->type")
    assert c.count("dflash_batch_gemm(") == 1
    assert mm.index("ggml_barrier(params->threadpool);") < gemm < converted
    assert "ne02 == 1 && ne03 == 1 && ne12 == 1 && ne13 == 1" in mm[gemm - 200:gemm]
    for name in ("batch_dot.c", "batch_dot.h"):
        assert (sdist / CPU / name).read_bytes() == (ROOT / "native" / "ggml" / name).read_bytes()


def test_sgemm_keeps_to_batch_invariant_products_and_says_so(sdist):
    before = (sdist / CPU / "llamafile" / "sgemm.cpp").read_text()
    assert "if (n < 2)\n        return false;" in before
    assert patch(sdist).returncode == 0
    g = (sdist / CPU / "llamafile" / "sgemm.cpp").read_text()
    body = g[g.index("bool llamafile_sgemm(const struct ggml_compute_params"):]
    # upstream's guard (a row alone to vec_dot, whatever the type) gives way to ours, before any kernel is chosen
    guard = body[: body.index("switch (Atype)")]
    assert "#if !defined(__MMA__)" not in guard
    assert "n < 2 && Atype != GGML_TYPE_F32 && Atype != GGML_TYPE_F16 && Atype != GGML_TYPE_BF16" in guard
    assert "if (Atype == GGML_TYPE_IQ4_NL)" in guard
    # the q8_0-family AVX2 tiles: a prefetch in each of the 4 weight rows, and odd column counts ending in 4x3 tiles
    assert g.count("_mm_prefetch((const char *)(A + lda * (ii + i) + l + 8), _MM_HINT_T0);") == 1
    assert "gemm4xN<3>(m0, m, n - 3, n);" in g and "gemm4xN<3>(m0, m, n - 3, n);" not in before
    assert len(g.splitlines()) == len(before.splitlines()) - 5 + 9 + 3 + 4 + 7
    # the symbol dflash-local's sessions look for (native/common.cpp), defined once, before llamafile_sgemm
    assert g.count('extern "C" bool dflash_sgemm_batch_invariant(void) { return true; }') == 1
    assert g.index("dflash_sgemm_batch_invariant") < g.index("bool llamafile_sgemm(const struct ggml_compute_params")


def test_flash_attention_goes_to_flash_attn_c_or_else_row_by_row(sdist):
    assert patch(sdist).returncode == 0
    o = (sdist / CPU / "ops.cpp").read_text()
    assert o.count('#include "flash_attn.h"') == 1
    # one call, first thing in the flash attention's compute function; where it has no kernel, every batch takes
    # upstream's one-row path (no split cache, no tiles)
    fa = o[o.index("static void ggml_compute_forward_flash_attn_ext_f16(\n"):]
    fa = fa[:fa.index("\n}\n")]
    assert o.count("dflash_flash_attn(params, dst)") == 1
    assert fa.index("dflash_flash_attn(params, dst)") < fa.index("GGML_TENSOR_LOCALS")
    assert "const bool use_ref = true;" in fa and "params->use_ref" not in fa
    assert "ggml-cpu/flash_attn.c" in (sdist / CPU / "CMakeLists.txt").read_text()
    for name in ("flash_attn.c", "flash_attn.h"):
        assert (sdist / CPU / name).read_bytes() == (ROOT / "native" / "ggml" / name).read_bytes()


def test_x86_q8_K_rows_are_quantized_by_batch_dot_c_or_else_by_the_reference(sdist):
    assert patch(sdist).returncode == 0
    q = (sdist / CPU / "arch" / "x86" / "quants.c").read_text()
    assert q.count('#include "../../batch_dot.h"') == 1
    body = q[q.index("void quantize_row_q8_K(const float"):]
    body = body[:body.index("\n}\n")]
    assert "if (!dflash_quantize_row_q8_K(x, y, k)) {\n        quantize_row_q8_K_ref(x, y, k);" in body


def test_a_tree_patched_already_is_refused(sdist):
    assert patch(sdist).returncode == 0
    before = contents(sdist)
    r = patch(sdist)
    assert r.returncode != 0 and "patched already" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert contents(sdist) == before


@pytest.mark.parametrize("name, old, new", [("ggml-cpu.c", "    float tmp[32];\n", "    float tmp[64];\n"),
                                             ("ops.cpp", "const bool use_ref = params->use_ref;", "bool use_ref = 0;"),
                                             ("arch/x86/quants.c", "    quantize_row_q8_K_ref(x, y, k);\n}",
                                              "    quantize_row_q8_K_generic(x, y, k);\n}")])
def test_a_llama_cpp_it_was_not_written_for_is_refused_untouched(sdist, name, old, new):
    c = sdist / CPU / name
    assert old in c.read_text()
    c.write_text(c.read_text().replace(old, new))
    before = contents(sdist)
    r = patch(sdist)
    assert r.returncode != 0, r.stdout
    assert "is not the llama.cpp this patch was written for" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert contents(sdist) == before  # nothing half-way: no file copied, no file edited


# x86 CPUs people build on, by what the kernels' #if branches see (the build is -march=native, so each CPU compiles
# its own branch): none of the extensions, AVX2 desktops (Zen 2/3, Intel client cores), AVX512 servers without VNNI,
# and AVX512-VNNI ones (Ice Lake servers; Zen 4 and later likewise). With AVX512, vec.h's helpers are 16-lane only.
MARCHES = ["x86-64", "haswell", "skylake-avx512", "icelake-server"]


@pytest.mark.parametrize("march", MARCHES)
def test_the_kernels_compile_for_every_x86_instruction_set(tmp_path, llama_cpp_sdist, march):
    """batch_dot.c and flash_attn.c compiled inside the sdist's ggml-cpu, as its build compiles them, for each
    -march: a branch written on one CPU must build on the others (flash_attn.c once called vec.h's 8-lane expf,
    which AVX512 builds do not have)."""
    if subprocess.run(["gcc", "-march=" + march, "-E", "-x", "c", "/dev/null"], capture_output=True).returncode:
        pytest.skip(f"this gcc does not know -march={march}")
    ggml = "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml"
    with tarfile.open(llama_cpp_sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(ggml + "/")
                   and m.name.endswith(".h")]
        tar.extractall(tmp_path, members=members, filter="data")
    root = tmp_path / ggml
    for name in ("batch_dot.c", "batch_dot.h", "flash_attn.c", "flash_attn.h"):
        shutil.copyfile(ROOT / "native" / "ggml" / name, root / "src" / "ggml-cpu" / name)
    for name in ("batch_dot.c", "flash_attn.c"):
        r = subprocess.run(["gcc", "-march=" + march, "-std=gnu11", "-O1", "-fopenmp", "-D_GNU_SOURCE",
                            "-DGGML_USE_LLAMAFILE", "-Werror=implicit-function-declaration",
                            "-Werror=incompatible-pointer-types", "-I", root / "include", "-I", root / "src",
                            "-I", root / "src" / "ggml-cpu", "-c", root / "src" / "ggml-cpu" / name,
                            "-o", tmp_path / (name + ".o")], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}, -march={march}:\n{r.stderr[-3000:]}"
