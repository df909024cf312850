"""Add batch_dot.c and flash_attn.c to the llama.cpp vendored in an unpacked llama-cpp-python sdist (scripts/setup.sh
runs this before building the wheel): the files go into ggml-cpu's sources, ggml's matmul hands batch_dot.c each tile
of two rows or more before calling vec_dot per element, and its flash attention goes to flash_attn.c; llamafile's
sgemm (where the build has it) takes only products whose bits do not depend on the number of rows. Every anchor must
match this llama.cpp exactly; anything else is an error, so a changed llama.cpp is never patched half-way.

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

# ggml_compute_forward_mul_mat, once src1 is converted to vec_dot's type: a plain 2-D product of q5_0 or q4_0 weights
# and 4 rows or more goes whole to dflash_batch_gemm (each thread its share of the weight rows), before sgemm
GEMM_ANCHOR = """    ggml_barrier(params->threadpool);

#if GGML_USE_LLAMAFILE
    if (src1->type != vec_dot_type) {
"""
GEMM_CALL = """    ggml_barrier(params->threadpool);

    // dflash-local: whole products by batch_dot.c's GEMM where it has one (see patch_ggml.py)
    if (src1->type != vec_dot_type && ne02 == 1 && ne03 == 1 && ne12 == 1 && ne13 == 1 &&
        dflash_batch_gemm(src0->type, (int) ne00, src0->data, nb01, (int) ne01, params->wdata,
                          ggml_row_size(vec_dot_type, ne10), (int) ne11, (float *) dst->data, nb1 / sizeof(float),
                          ith, nth)) {
        return;
    }

#if GGML_USE_LLAMAFILE
    if (src1->type != vec_dot_type) {
"""

# ggml_compute_forward_mul_mat hands sgemm one head at a time; with grouped-query attention the r2 heads that share a
# slice of the cache then read it r2 times (a decode step at depth is bound by those reads: 4 times gemma's K and V).
# Their rows lie side by side in the converted src1, and their outputs in dst, so they go as one product of r2 * ne11
# columns: the slice is read once. sgemm gives each element the same bits whatever the number of columns, so nothing
# else changes
GQA_ANCHOR = """        for (int64_t i13 = 0; i13 < ne13; i13++)
            for (int64_t i12 = 0; i12 < ne12; i12++)
                if (!llamafile_sgemm(params,
                                     ne01, ne11, ne00/ggml_blck_size(src0->type),
                                     (const char *)src0->data + i12/r2*nb02 + i13/r3*nb03,
                                     nb01/ggml_type_size(src0->type),
                                     (const char *)wdata + (i12*ne11 + i13*ne12*ne11)*row_size,
"""
GQA_NEW = """        // dflash-local: the heads sharing a slice of src0 as one product (see patch_ggml.py)
        const int64_t heads = nb2 == ne1*nb1 ? r2 : 1;
        for (int64_t i13 = 0; i13 < ne13; i13++)
            for (int64_t i12 = 0; i12 < ne12; i12 += heads)
                if (!llamafile_sgemm(params,
                                     ne01, heads*ne11, ne00/ggml_blck_size(src0->type),
                                     (const char *)src0->data + i12/r2*nb02 + i13/r3*nb03,
                                     nb01/ggml_type_size(src0->type),
                                     (const char *)wdata + (i12*ne11 + i13*ne12*ne11)*row_size,
"""

# llamafile_sgemm (a GGML_LLAMAFILE build) serves only products it gives the same bits whatever the number of rows
# (native/ggml/README.md, checked by check_matmul.c): on x86, float weights (the attention's f16 cache among them) for
# every row count, one included, and q8_0, q5_0 and q4_0 from two rows (their one-row vec_dot has sgemm's bits and is
# faster for a row alone); iq4_nl never (its vec_dot sums two blocks at a time), nor anything elsewhere. The marker
# tells dflash-local's sessions that no decode needs a second row (Session::pad)
SGEMM_ANCHOR = """    // only enable sgemm for prompt processing
#if !defined(__MMA__)
    if (n < 2)
        return false;
#endif
"""
SGEMM_NEW = """    // dflash-local: only products whose bits do not depend on the number of rows (see patch_ggml.py)
#if defined(__AVX2__)
    if (n < 2 && Atype != GGML_TYPE_F32 && Atype != GGML_TYPE_F16 && Atype != GGML_TYPE_BF16)
        return false;
    if (Atype == GGML_TYPE_IQ4_NL)
        return false;
#else
    return false;
#endif
"""
# tinyBLAS's q8_0-family tiles on AVX2 with 16 vector registers read 4 weight rows side by side, which the hardware
# prefetchers follow poorly (gemma's LM head, 262144 x 640 q8_0, 2 rows: 31 ms against 15 for one row by vec_dot): a
# prefetch 8 blocks ahead in each row, as batch_dot.c's tiles have (a hint: no bit changes), on the rows' first tile
# only (the next tiles of the same rows find them in cache; a prompt's 512 columns make 256 tiles of each 4 rows); and
# an odd number of columns went as 4x2 tiles plus a whole pass of 4x1 tiles for the last one, now the last three by
# 4x3 tiles (every element is still one tinyBLAS sum, whatever its tile: check_matmul.c)
Q0_PREFETCH_ANCHOR = """            for (int64_t l = 0; l < k; ++l) {
                uint64_t a_delta = ((uint64_t)A[lda * (ii + 3) + l].d << 48)"""
Q0_PREFETCH_NEW = """            for (int64_t l = 0; l < k; ++l) {
                // dflash-local: the 4 rows' blocks ahead, on their first tile (see patch_ggml.py)
                if (jj == n0)
                    for (int64_t i = 0; i < 4; ++i)
                        _mm_prefetch((const char *)(A + lda * (ii + i) + l + 8), _MM_HINT_T0);
                uint64_t a_delta = ((uint64_t)A[lda * (ii + 3) + l].d << 48)"""
Q0_ODD_ANCHOR = """#else
        case 0x44:
        case 0x43:
        case 0x42:
            mc = 4;
            nc = 2;
#if defined(__AVX2__) && defined(__F16C__)
            gemm4xN<2>(m0, m, n0, n);
#else
"""
Q0_ODD_NEW = """#else
        case 0x44:
        case 0x43:
        case 0x42:
            mc = 4;
            nc = 2;
#if defined(__AVX2__) && defined(__F16C__)
            if ((n - n0) % 2 == 1) {  // dflash-local: the last 3 columns by 4x3 tiles, not the last one by 4x1
                if (n - n0 > 3)
                    gemm4xN<2>(m0, m, n0, n - 3);
                gemm4xN<3>(m0, m, n - 3, n);
                nc = n - n0;
            } else {
                gemm4xN<2>(m0, m, n0, n);
            }
#else
"""
SGEMM_DEF_ANCHOR = "bool llamafile_sgemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,\n"
SGEMM_MARKER = """// dflash-local: this sgemm gives a row the same bits whatever the number of rows (see patch_ggml.py)
extern "C" bool dflash_sgemm_batch_invariant(void) { return true; }

"""
SOURCES_ANCHOR = "        ggml-cpu/quants.c\n"

# ggml's CPU flash attention computes a row by one of three paths, chosen by the batch: a one-token step over 512 cells
# or more splits the cache across threads and merges their partial sums, 32 rows or more go through its tiled kernel,
# and other batches run the one-row kernel. Each rounds differently, so a verify row or a prompt chunk's row would not
# have a decode step's bits. flash_attn.c computes every batch with the same operations per row (cells in blocks at
# fixed indices; rows and heads share only loads), and where it has no kernel every batch goes through the one-row
# kernel, whose bits do not depend on the batch either. flash_attn.c's marker tells dflash-local that -fa on keeps
# verification exact
FA_ANCHOR = """static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
"""
FA_CALL = """static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
    // dflash-local: the same bits for a row whatever the batch (flash_attn.c, patch_ggml.py)
    if (dflash_flash_attn(params, dst)) {
        return;
    }
"""
FA_REF_ANCHOR = """    // When use_ref is set, force the vec-only reference implementation (no tiling, no KV-chunking)
    const bool use_ref = params->use_ref;
"""
FA_REF_NEW = """    // dflash-local: every batch by the one-row kernel, whose bits do not depend on it (see patch_ggml.py)
    const bool use_ref = true;
"""
OPS_INCLUDE_ANCHOR = '#include "vec.h"\n'

# x86's quantize_row_q8_K (the activations of every q4_K and q6_K product) is the scalar reference: batch_dot.c gives
# its bytes with AVX2
Q8_K_ANCHOR = """void quantize_row_q8_K(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_q8_K_ref(x, y, k);
}
"""
Q8_K_CALL = """void quantize_row_q8_K(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    // dflash-local: the reference's bytes, 8 values at a time (batch_dot.c)
    if (!dflash_quantize_row_q8_K(x, y, k)) {
        quantize_row_q8_K_ref(x, y, k);
    }
}
"""
X86_INCLUDE_ANCHOR = '#include "../../quants.h"\n'


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
    c = replace_once(c, GEMM_ANCHOR, GEMM_CALL, cpu / "ggml-cpu.c")
    c = replace_once(c, GQA_ANCHOR, GQA_NEW, cpu / "ggml-cpu.c")
    sgemm = cpu / "llamafile" / "sgemm.cpp"
    g = replace_once(sgemm.read_text(), SGEMM_ANCHOR, SGEMM_NEW, sgemm)
    g = replace_once(g, SGEMM_DEF_ANCHOR, SGEMM_MARKER + SGEMM_DEF_ANCHOR, sgemm)
    g = replace_once(g, Q0_PREFETCH_ANCHOR, Q0_PREFETCH_NEW, sgemm)
    g = replace_once(g, Q0_ODD_ANCHOR, Q0_ODD_NEW, sgemm)
    ops = cpu / "ops.cpp"
    o = replace_once(ops.read_text(), OPS_INCLUDE_ANCHOR, OPS_INCLUDE_ANCHOR + '#include "flash_attn.h"\n', ops)
    o = replace_once(o, FA_ANCHOR, FA_CALL, ops)
    o = replace_once(o, FA_REF_ANCHOR, FA_REF_NEW, ops)
    quants = cpu / "arch" / "x86" / "quants.c"
    q = replace_once(quants.read_text(), X86_INCLUDE_ANCHOR, X86_INCLUDE_ANCHOR + '#include "../../batch_dot.h"\n',
                     quants)
    q = replace_once(q, Q8_K_ANCHOR, Q8_K_CALL, quants)
    cmake = cpu / "CMakeLists.txt"
    m = replace_once(cmake.read_text(), SOURCES_ANCHOR,
                     SOURCES_ANCHOR + "        ggml-cpu/batch_dot.c\n        ggml-cpu/flash_attn.c\n", cmake)
    for name in ("batch_dot.c", "batch_dot.h", "flash_attn.c", "flash_attn.h"):
        shutil.copyfile(HERE / name, cpu / name)
    (cpu / "ggml-cpu.c").write_text(c)
    sgemm.write_text(g)
    ops.write_text(o)
    quants.write_text(q)
    cmake.write_text(m)
    print(f"patched {cpu}: batch_dot.c added to ggml's CPU matmul, sgemm kept to batch-invariant products and given "
          "a cache slice's heads at once, its q8_0-family tiles prefetching; flash attention by flash_attn.c; q8_K rows "
          "quantized with AVX2")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
