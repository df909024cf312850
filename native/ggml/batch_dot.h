// Batch-invariant matrix products for ggml's CPU matmul: batch_dot.c.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// dst[j * dst_stride + i] = the dot product of weight row i (of nw, type `type`, n columns, rows w_stride bytes
// apart) and activation row j (of ny, in the type's vec_dot type, y_stride bytes apart), with the bits ggml's vec_dot
// gives it. Returns false, computing nothing, where this CPU build or the type has no such kernel (or ny is not
// 2..16): the caller then calls vec_dot.
#if defined(__GNUC__)
__attribute__((visibility("default")))  // tests/test_batch_dot.py calls it in the built library
#endif
bool dflash_batch_dot(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                      size_t y_stride, int ny, float * dst, size_t dst_stride);

// The same for a whole product of ny >= 4 activation rows (q4_K: 32), a prompt chunk or a verify block, thread ith of
// nth computing its share of the weight rows (nothing shared). False, computing nothing, on every thread alike where it
// has no kernel: the caller goes on to its other paths.
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
bool dflash_batch_gemm(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                       size_t y_stride, int ny, float * dst, size_t dst_stride, int ith, int nth);

// quantize_row_q8_K_ref's bytes, computed with AVX2 (x86's quantize_row_q8_K is that scalar reference). False,
// writing nothing, where this build has no such kernel (or k is not a multiple of 256).
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
bool dflash_quantize_row_q8_K(const float * x, void * y, int64_t k);

#ifdef __cplusplus
}
#endif
