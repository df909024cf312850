"""Add batch_dot.c to the llama.cpp vendored in an unpacked llama-cpp-python sdist (scripts/setup.sh runs this before
building the wheel): the file goes into ggml-cpu's sources, and ggml's matmul hands it each tile of two rows or more
before calling vec_dot per element. Every anchor must match this llama.cpp exactly; anything else is an error, so a
changed llama.cpp is never patched half-way.

    python native/ggml/patch_ggml.py SDIST_DIR
"""

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ggml_compute_forward_mul_mat_one_chunk: for a plain 2-D product of rows converted to vec_dot's type, each tile of
# activation rows goes to dflash_batch_dot over the chunk's weight rows; it returns false where it has no kernel
CHUNK_ANCHOR = """    float tmp[32];

    for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
        for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += blck_0) {
"""
CHUNK_CALL = """    float tmp[32];

    // dflash-local: tiles of two activation rows or more by a kernel with vec_dot's bits (batch_dot.c)
    const bool dflash_tiles = num_rows_per_vec_dot == 1 && ne02 == 1 && ne03 == 1 && ne12 == 1 && ne13 == 1 &&
                              (src1_cont || src1->type != vec_dot_type);
    for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
        if (dflash_tiles && dflash_batch_dot(type, (int) ne00, (const char *) src0->data + ir0_start * nb01, nb01,
                                             (int) (ir0_end - ir0_start), (const char *) wdata + iir1 * row_size,
                                             row_size, (int) (MIN(iir1 + blck_1, ir1_end) - iir1),
                                             (float *) ((char *) dst->data + iir1 * nb1) + ir0_start,
                                             nb1 / sizeof(float))) {
            continue;
        }
        for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += blck_0) {
"""
INCLUDE_ANCHOR = '#include "tiled/tiled.h"\n'
SOURCES_ANCHOR = "        ggml-cpu/quants.c\n"


def replace_once(text: str, anchor: str, new: str, where: Path) -> str:
    if text.count(anchor) != 1:
        sys.exit(f"error: {where} is not the llama.cpp this patch was written for (anchor found "
                 f"{text.count(anchor)} times): {anchor.strip()[:60]!r}")
    return text.replace(anchor, new)


def main(sdist: Path) -> None:
    cpu = sdist / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-cpu"
    if not (cpu / "ggml-cpu.c").is_file():
        sys.exit(f"error: no vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c in {sdist}")
    c = (cpu / "ggml-cpu.c").read_text()
    if "dflash_batch_dot" in c:
        sys.exit(f"error: {cpu / 'ggml-cpu.c'} is patched already")
    c = replace_once(c, INCLUDE_ANCHOR, INCLUDE_ANCHOR + '#include "batch_dot.h"\n', cpu / "ggml-cpu.c")
    c = replace_once(c, CHUNK_ANCHOR, CHUNK_CALL, cpu / "ggml-cpu.c")
    cmake = cpu / "CMakeLists.txt"
    m = replace_once(cmake.read_text(), SOURCES_ANCHOR, SOURCES_ANCHOR + "        ggml-cpu/batch_dot.c\n", cmake)
    for name in ("batch_dot.c", "batch_dot.h"):
        shutil.copyfile(HERE / name, cpu / name)
    (cpu / "ggml-cpu.c").write_text(c)
    cmake.write_text(m)
    print(f"patched {cpu}: batch_dot.c added to ggml's CPU matmul")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
