// Batch-invariant matrix products for ggml's CPU matmul (built into ggml-cpu by scripts/setup.sh, see README.md
// beside this file).
//
// ggml computes a product of several rows by calling the one-row kernel (vec_dot) once per output element, so a
// verify batch costs almost what as many single-token decodes cost. The kernels here compute a tile of weight rows x
// activation rows at once, two activation rows per 512-bit register, with the weight block unpacked once for all of
// them. Each output element goes through the same operations as vec_dot gives it (the same exact integer lane sums,
// then the same float multiply, fused multiply-add per lane in block order, and the same horizontal sum), so its bits
// are vec_dot's: a batch of any size gives every row what a one-row decode gives it, and speculative decoding stays
// token-identical to plain decoding.
//
// Where vec_dot takes the AVX2 path with AVX512-VNNI lane sums (and not AVX-VNNI-INT8's), every type of
// dflash_batch_dot is computed in pairs of activation rows per 512-bit register. On other CPUs with AVX2 (most
// desktops: AMD Zen 2 and 3, Intel's client cores) q4_K and q6_K, whose vec_dot is AVX2 everywhere, are computed a
// 256-bit activation row at a time, the weight's super-block unpacked once for all of them (q8_0 and q5_0 go to
// llamafile's sgemm there, README.md). dflash_batch_gemm takes whole products of q5_0, q4_0, q4_1 and q4_K weights and
// 4 rows or more (prompt chunks, verify blocks) on every CPU with AVX2, and dflash_quantize_row_q8_K gives the
// reference's q8_K bytes with AVX2.
// Elsewhere both return false and ggml calls vec_dot as before.

#include "batch_dot.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define DFLASH_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && !defined(__AVXVNNIINT8__)
#define DFLASH_BATCH_DOT 1
#endif
#endif

#ifdef DFLASH_AVX2

// ggml's block layouts (ggml-common.h)
typedef struct { uint16_t d; int8_t qs[32]; } q8_0_block;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } q5_0_block;
typedef struct { uint16_t d; uint8_t qs[16]; } q4_0_block;
typedef struct { uint16_t d, m; uint8_t qs[16]; } q4_1_block;
typedef struct { uint16_t d, s; int8_t qs[32]; } q8_1_block;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } q8_K_block;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } q4_K_block;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } q6_K_block;

_Static_assert(sizeof(q8_0_block) == 34, "q8_0 layout");
_Static_assert(sizeof(q5_0_block) == 22, "q5_0 layout");
_Static_assert(sizeof(q4_0_block) == 18, "q4_0 layout");
_Static_assert(sizeof(q4_1_block) == 20, "q4_1 layout");
_Static_assert(sizeof(q8_1_block) == 36, "q8_1 layout");
_Static_assert(sizeof(q8_K_block) == 292, "q8_K layout");
_Static_assert(sizeof(q4_K_block) == 144, "q4_K layout");
_Static_assert(sizeof(q6_K_block) == 210, "q6_K layout");

enum { MAX_ROWS = 16 };  // activation rows in one call (ggml's tile); 8 pairs of accumulators

static inline float f16(uint16_t h) { return _cvtsh_ss(h); }

// A block's 16 bytes of 4-bit quants as 32 bytes 0..15: the low nibbles (quants 0..15), then the high ones.
static inline __m256i nibbles(const uint8_t * qs) {
    const __m128i lo = _mm_loadu_si128((const __m128i *) qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), _mm256_set1_epi8(0x0F));
}

// The horizontal sums vec_dot ends with: of 4 lanes (q4_K's mins), pairs then the last two; of 8, the high half onto
// the low half first.
static inline float hsum4(__m128 r) {
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline float hsum8(__m256 x) {
    return hsum4(_mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x)));
}

// The 6-bit scales (0..7) and mins (8..15) of a q4_K super-block's 8 sub-blocks, unpacked as vec_dot does.
static inline void q4_K_scales(const q4_K_block * x, uint32_t u[4]) {
    memcpy(u, x->scales, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t u1 = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = u1;
    u[0] &= 0x3f3f3f3f;
}

// The 8 mins of q4_K_scales' u as 16-bit lanes.
static inline __m128i q4_K_mins(const uint32_t u[4]) {
    return _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int) u[3], (int) u[2]));
}

// A q8_K super-block's 16 sums of 16 quants added in pairs (vec_dot's hadd): the sums of its 8 sub-blocks of 32.
static inline __m128i q8_K_pair_sums(const q8_K_block * y) {
    const __m256i sums = _mm256_loadu_si256((const __m256i *) y->bsums);
    return _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
}

// q6_K's 6-bit quants of a super-block, unsigned (0..63; vec_dot takes the 32 off through the bsums), in 8 chunks of
// 32: chunk c pairs with the activation's quants 32c..32c + 31.
static inline void q6_K_quants(const q6_K_block * x, __m256i q[8]) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int j = 0; j < 2; ++j) {
        const __m256i l1 = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * j));
        const __m256i l2 = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * j + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *) (x->qh + 32 * j));
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2);
        const __m256i h2 = _mm256_and_si256(hb, _mm256_set1_epi8(48));
        const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char) 0xC0)), 2);
        q[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(l1, m15), h0);
        q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(l2, m15), h1);
        q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), h2);
        q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15), h3);
    }
}

// Chunk c's scales as 16-bit lanes: its first 16 quants take scale 2c, the next 16 scale 2c + 1.
static inline __m256i q6_K_chunk_scales(const q6_K_block * x, int c) {
    return _mm256_set_m128i(_mm_set1_epi16(x->scales[2 * c + 1]), _mm_set1_epi16(x->scales[2 * c]));
}

// ---- q5_0 and q4_0 weights against q8_0 activations: whole products of many rows, on every CPU with AVX2 ----------
// vec_dot, per block of 32: acc[lane] = fma(x.d * y.d, float(sum of the lane's 4 products), acc[lane]); then hsum8.
// llamafile's sgemm gives a product of two rows or more these bits too, but it unpacks a tile's 4 weight rows again for
// every 2 activation rows (each weight row 256 times in a prompt chunk of 512) and spends two sign operations a block
// product. Here a thread unpacks a few weight rows once for all the activation rows: each quant plus the type's offset
// (q5_0: 16, q4_0: 8), unsigned as maddubs takes its first operand, and each block's scale over 8 lanes. A block
// product is then maddubs + madd less offset x the activation lane's sum of quants (once per activation block for the
// tile's weight rows): vec_dot's integers (two products of at most 31 x 128 fit int16), then vec_dot's float operations.
// 4 weight rows x 2 activation rows a tile: a 2048 x 640 q5_0 product of 512 rows (one thread, best of 7) took 18.4
// ms, 4 x 3 and 3 x 4 tiles 20-25, 2 x 4 22, sgemm 30; from 4 activation rows it is faster than sgemm (1.2x at 4, 1.5x
// at 16). The unpacked rows go on the stack (GEMM_MAX_BLOCKS: 128 KB); wider rows go to sgemm.
enum { GEMM_ROWS = 4, GEMM_COLS = 2, GEMM_MIN_COLS = 4, GEMM_MIN_COLS_K = 32, GEMM_MAX_BLOCKS = 512 };

typedef struct { __m256i q; __m256 d; } q0_unpacked;

// q5_0: 4 low bits, the fifth from qh: the value plus 16, 0..31.
static inline __m256i unsigned_q5_0(const q5_0_block * x) {
    uint32_t qh;
    memcpy(&qh, x->qh, 4);
    // byte i takes bit i of qh: each 8-byte group of the broadcast keeps its byte of qh, then one bit per byte
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int) qh),
                                              _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201);
    const __m256i high = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_or_si256(nibbles(x->qs), _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
}

// acc + the sums of each 32-bit lane's 4 products of unsigned u and signed s bytes (no pair of products over int16)
static inline __m256i lane_dot(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// R unpacked weight rows (x[b * R + r]) x C activation rows.
static inline __attribute__((always_inline)) void gemm_q0_tile(const int R, const int C, const q0_unpacked * x, int nb,
                                                               int offset, const char * y, size_t y_stride,
                                                               float * dst, size_t dst_stride) {
    const __m256i zero = _mm256_setzero_si256(), off = _mm256_set1_epi8((char) offset);
    __m256 acc[GEMM_ROWS][GEMM_COLS];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
        }
    }
    for (int b = 0; b < nb; ++b) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            const q8_0_block * yb = (const q8_0_block *) (y + c * y_stride) + b;
            const __m256i qy = _mm256_loadu_si256((const __m256i *) yb->qs);
            const __m256i corr = _mm256_sub_epi32(zero, lane_dot(zero, off, qy));  // less offset x the lane's quants
            const __m256 yd = _mm256_set1_ps(f16(yb->d));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const q0_unpacked * xb = &x[b * R + r];
                const __m256i sums = lane_dot(corr, xb->q, qy);
                acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(xb->d, yd), _mm256_cvtepi32_ps(sums), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            dst[c * dst_stride + r] = hsum8(acc[r][c]);
        }
    }
}

static inline __attribute__((always_inline)) void gemm_q0_rows(const int R, const q0_unpacked * x, int nb, int offset,
                                                               const char * y, size_t y_stride, int ny, float * dst,
                                                               size_t dst_stride) {
    int c = 0;
    for (; c + GEMM_COLS <= ny; c += GEMM_COLS) {
        gemm_q0_tile(R, GEMM_COLS, x, nb, offset, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
    for (; c < ny; ++c) {
        gemm_q0_tile(R, 1, x, nb, offset, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
}

static void gemm_q0(enum ggml_type type, int nb, const char * w, size_t w_stride, int nw, const char * y,
                    size_t y_stride, int ny, float * dst, size_t dst_stride, int ith, int nth) {
    q0_unpacked x[GEMM_ROWS * nb];
    const bool q5 = type == GGML_TYPE_Q5_0;
    const int offset = q5 ? 16 : 8;
    const int tiles = (nw + GEMM_ROWS - 1) / GEMM_ROWS;
    for (int t = tiles * ith / nth; t < tiles * (ith + 1) / nth; ++t) {
        const int i0 = t * GEMM_ROWS, R = nw - i0 < GEMM_ROWS ? nw - i0 : GEMM_ROWS;
        for (int r = 0; r < R; ++r) {
            const char * row = w + (size_t) (i0 + r) * w_stride;
            for (int b = 0; b < nb; ++b) {
                const q5_0_block * b5 = (const q5_0_block *) row + b;
                const q4_0_block * b4 = (const q4_0_block *) row + b;
                q0_unpacked * o = &x[b * R + r];
                o->q = q5 ? unsigned_q5_0(b5) : nibbles(b4->qs);  // q4_0: the value plus 8, 0..15
                o->d = _mm256_set1_ps(f16(q5 ? b5->d : b4->d));
            }
        }
        switch (R) {  // constant tile shapes, so that the accumulators stay in registers
            case 4: gemm_q0_rows(4, x, nb, offset, y, y_stride, ny, dst + i0, dst_stride); break;
            case 3: gemm_q0_rows(3, x, nb, offset, y, y_stride, ny, dst + i0, dst_stride); break;
            case 2: gemm_q0_rows(2, x, nb, offset, y, y_stride, ny, dst + i0, dst_stride); break;
            default: gemm_q0_rows(1, x, nb, offset, y, y_stride, ny, dst + i0, dst_stride); break;
        }
    }
}

// ---- q4_1 weights against q8_1 activations: whole products of many rows, on every CPU with AVX2 ----------------
// vec_dot, per block of 32: acc[lane] = fma(x.d * y.d, float(lane sum of 4 products), acc[lane]), and beside it
// summs = fma(x.m, y.s, summs) (GCC and clang contract its `summs += x.m * y.s`); then hsum8(acc) + summs. The
// nibbles are unsigned, so maddubs + madd (or dpbusd) gives vec_dot's integers. A thread unpacks 4 weight rows once
// for all the activation rows and computes tiles of 4 x 2, whose 8 running sums of mins are the 8 lanes of one
// register (lane r + 4c): the same fused multiply-add per lane, one instruction a block for the tile.
// `check_batch_dot bench` (one thread, the 2-core EPYC, AVX512-VNNI): a 2048 x 640 product of 512 rows 12.3 ms against
// vec_dot's 31.3. The same kernel in 16-row tiles took 3.1 ms for 4096 x 2048 against the previous tiles' 5.85, so it
// replaced them; below 4 rows vec_dot is faster (1536 x 576 by 2 rows: 109 us, vec_dot 81).
_Static_assert(GEMM_ROWS * GEMM_COLS == 8, "a q4_1 tile's running sums of mins are the 8 lanes of one register");

static inline __attribute__((always_inline)) void gemm_q4_1_tile(const int R, const int C, const __m256i * xq,
                                                                 const __m256 * xd, const __m256 * xm, int nb,
                                                                 const char * y, size_t y_stride, float * dst,
                                                                 size_t dst_stride) {
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[GEMM_ROWS][GEMM_COLS];
    __m256 summs = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
        }
    }
    for (int b = 0; b < nb; ++b) {
        const q8_1_block * yb[GEMM_COLS];
        for (int c = 0; c < C; ++c) {
            yb[c] = (const q8_1_block *) (y + c * y_stride) + b;
        }
        const __m128 s0 = _mm_set1_ps(f16(yb[0]->s));
        const __m256 ys = _mm256_set_m128(C > 1 ? _mm_set1_ps(f16(yb[C - 1]->s)) : _mm_setzero_ps(), s0);
        summs = _mm256_fmadd_ps(xm[b], ys, summs);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            const __m256i qy = _mm256_loadu_si256((const __m256i *) yb[c]->qs);
            const __m256 yd = _mm256_set1_ps(f16(yb[c]->d));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const __m256i sums = lane_dot(zero, xq[b * R + r], qy);
                acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(xd[b * R + r], yd), _mm256_cvtepi32_ps(sums), acc[r][c]);
            }
        }
    }
    float m[8];
    _mm256_storeu_ps(m, summs);
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            dst[c * dst_stride + r] = hsum8(acc[r][c]) + m[r + 4 * c];
        }
    }
}

static inline __attribute__((always_inline)) void gemm_q4_1_rows(const int R, const __m256i * xq,
                                                                 const __m256 * xd, const __m256 * xm, int nb,
                                                                 const char * y, size_t y_stride, int ny, float * dst,
                                                                 size_t dst_stride) {
    int c = 0;
    for (; c + GEMM_COLS <= ny; c += GEMM_COLS) {
        gemm_q4_1_tile(R, GEMM_COLS, xq, xd, xm, nb, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
    for (; c < ny; ++c) {
        gemm_q4_1_tile(R, 1, xq, xd, xm, nb, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
}

static void gemm_q4_1(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                      float * dst, size_t dst_stride, int ith, int nth) {
    __m256i xq[GEMM_ROWS * nb];
    __m256 xd[GEMM_ROWS * nb], xm[nb];  // each row's scale over 8 lanes; the rows' mins, lane r + 4c taking row r's
    const int tiles = (nw + GEMM_ROWS - 1) / GEMM_ROWS;
    for (int t = tiles * ith / nth; t < tiles * (ith + 1) / nth; ++t) {
        const int i0 = t * GEMM_ROWS, R = nw - i0 < GEMM_ROWS ? nw - i0 : GEMM_ROWS;
        for (int b = 0; b < nb; ++b) {
            float m[4] = {0, 0, 0, 0};
            for (int r = 0; r < R; ++r) {
                const q4_1_block * xb = (const q4_1_block *) (w + (size_t) (i0 + r) * w_stride) + b;
                xq[b * R + r] = nibbles(xb->qs);
                xd[b * R + r] = _mm256_set1_ps(f16(xb->d));
                m[r] = f16(xb->m);
            }
            const __m128 m4 = _mm_loadu_ps(m);
            xm[b] = _mm256_set_m128(m4, m4);
        }
        switch (R) {
            case 4: gemm_q4_1_rows(4, xq, xd, xm, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            case 3: gemm_q4_1_rows(3, xq, xd, xm, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            case 2: gemm_q4_1_rows(2, xq, xd, xm, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            default: gemm_q4_1_rows(1, xq, xd, xm, nb, y, y_stride, ny, dst + i0, dst_stride); break;
        }
    }
}

// ---- q4_K weights against q8_K activations: whole products, on every CPU with AVX2 ----------------------------------
// vec_dot per super-block (as dot_q4_K below): the exact integer sum over its 8 sub-blocks of scale x (maddubs + madd
// of quants), one fused multiply-add by y.d * x.d into 8 float lanes, and the mins' part (the activation's 16-value
// sums paired by hadd, madd by the 8 mins) by -y.d * x.dmin into 4 more; then hsum8 + hsum4. A tile of 4 weight rows
// x 2 activation rows shares each loaded activation and each weight's unpacked quants: the integer sums, their order
// free (exact), and the same float operations per element. A weight row's scales and mins are unpacked once per tile.
typedef struct { int16_t sc[8]; __m128i mins; float d, dmin; } q4_K_unpacked;

static inline __attribute__((always_inline)) void gemm_q4_K_tile(const int R, const int C, const q4_K_block * const * w,
                                                                 const q4_K_unpacked * u, int nb, const char * y,
                                                                 size_t y_stride, float * dst, size_t dst_stride) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[GEMM_ROWS][GEMM_COLS];
    __m128 acc_m[GEMM_ROWS][GEMM_COLS];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            acc_m[r][c] = _mm_setzero_ps();
        }
    }
    for (int b = 0; b < nb; ++b) {
        const q8_K_block * yb[GEMM_COLS];
        __m256i sumi[GEMM_ROWS][GEMM_COLS];
        for (int c = 0; c < C; ++c) {
            yb[c] = (const q8_K_block *) (y + c * y_stride) + b;
            for (int r = 0; r < R; ++r) {
                sumi[r][c] = _mm256_setzero_si256();
            }
        }
        for (int j = 0; j < 4; ++j) {
            __m256i yl[GEMM_COLS], yh[GEMM_COLS];
            for (int c = 0; c < C; ++c) {
                yl[c] = _mm256_loadu_si256((const __m256i *) (yb[c]->qs + 64 * j));
                yh[c] = _mm256_loadu_si256((const __m256i *) (yb[c]->qs + 64 * j + 32));
            }
            for (int r = 0; r < R; ++r) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *) (w[r][b].qs + 32 * j));
                const __m256i ql = _mm256_and_si256(bits, m4), qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                const q4_K_unpacked * ub = &u[b * R + r];
                const __m256i sl = _mm256_set1_epi16(ub->sc[2 * j]), sh = _mm256_set1_epi16(ub->sc[2 * j + 1]);
                for (int c = 0; c < C; ++c) {
                    const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, yl[c]));
                    const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, yh[c]));
                    sumi[r][c] = _mm256_add_epi32(sumi[r][c], _mm256_add_epi32(pl, ph));
                }
            }
        }
        for (int c = 0; c < C; ++c) {
            const __m128i q8s = q8_K_pair_sums(yb[c]);
            for (int r = 0; r < R; ++r) {
                const q4_K_unpacked * ub = &u[b * R + r];
                const float d = yb[c]->d * ub->d, dmin = -yb[c]->d * ub->dmin;
                acc_m[r][c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(ub->mins, q8s)),
                                           acc_m[r][c]);
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r][c]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            dst[c * dst_stride + r] = hsum8(acc[r][c]) + hsum4(acc_m[r][c]);
        }
    }
}

static inline __attribute__((always_inline)) void gemm_q4_K_rows(const int R, const q4_K_block * const * w,
                                                                 const q4_K_unpacked * u, int nb, const char * y,
                                                                 size_t y_stride, int ny, float * dst,
                                                                 size_t dst_stride) {
    int c = 0;
    for (; c + GEMM_COLS <= ny; c += GEMM_COLS) {
        gemm_q4_K_tile(R, GEMM_COLS, w, u, nb, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
    for (; c < ny; ++c) {
        gemm_q4_K_tile(R, 1, w, u, nb, y + c * y_stride, y_stride, dst + c * dst_stride, dst_stride);
    }
}

static void gemm_q4_K(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                      float * dst, size_t dst_stride, int ith, int nth) {
    q4_K_unpacked u[GEMM_ROWS * nb];
    const int tiles = (nw + GEMM_ROWS - 1) / GEMM_ROWS;
    for (int t = tiles * ith / nth; t < tiles * (ith + 1) / nth; ++t) {
        const int i0 = t * GEMM_ROWS, R = nw - i0 < GEMM_ROWS ? nw - i0 : GEMM_ROWS;
        const q4_K_block * rows[GEMM_ROWS];
        for (int r = 0; r < R; ++r) {
            rows[r] = (const q4_K_block *) (w + (size_t) (i0 + r) * w_stride);
            for (int b = 0; b < nb; ++b) {
                uint32_t s4[4];
                q4_K_scales(&rows[r][b], s4);
                const uint8_t * sc = (const uint8_t *) s4;
                q4_K_unpacked * o = &u[b * R + r];
                for (int k = 0; k < 8; ++k) {
                    o->sc[k] = sc[k];
                }
                o->mins = q4_K_mins(s4);
                o->d = f16(rows[r][b].d);
                o->dmin = f16(rows[r][b].dmin);
            }
        }
        switch (R) {
            case 4: gemm_q4_K_rows(4, rows, u, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            case 3: gemm_q4_K_rows(3, rows, u, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            case 2: gemm_q4_K_rows(2, rows, u, nb, y, y_stride, ny, dst + i0, dst_stride); break;
            default: gemm_q4_K_rows(1, rows, u, nb, y, y_stride, ny, dst + i0, dst_stride); break;
        }
    }
}

#endif  // DFLASH_AVX2

#ifdef DFLASH_BATCH_DOT

// Two activation rows' 32 bytes side by side.
static inline __m512i pair(const void * a, const void * b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) a)),
                              _mm256_loadu_si256((const __m256i *) b), 1);
}

// The outputs of pair p (activation rows 2p and 2p + 1, the second only if there are ny rows) for weight row i.
static inline void put_pair(float * dst, size_t dst_stride, int ny, int p, int i, float a, float b) {
    dst[(size_t) (2 * p) * dst_stride + i] = a;
    if (2 * p + 1 < ny) {
        dst[(size_t) (2 * p + 1) * dst_stride + i] = b;
    }
}

// A pair's accumulator, lanes 0..7 row a's vec_dot accumulator and 8..15 row b's, summed as vec_dot sums, put out.
static inline void store_pair(__m512 acc, float * dst, size_t dst_stride, int ny, int p, int i) {
    put_pair(dst, dst_stride, ny, p, i, hsum8(_mm512_castps512_ps256(acc)), hsum8(_mm512_extractf32x8_ps(acc, 1)));
}

// ---- q8_0 and q5_0 weights against q8_0 activations -------------------------------------------------------------
// vec_dot: acc[lane] = fma(wd * yd, float(sum of 4 products |w| * sign(y, w)), acc[lane]) per block, then hsum8.

typedef __m256i (*unpack_fn)(const void *);

// Two activation rows of one q8_0 block, side by side as the pair kernel reads them.
typedef struct {
    int8_t qs[64];     // row a's 32 quants, then row b's
    float d[16];       // [a.d x 8, b.d x 8]
    int32_t corr[16];  // -offset x the sum of each lane's 4 quants: a's 8 lanes, then b's
} q8_0_pair;

// Per thread, grown as needed: the activation rows of the current tile, packed in pairs (an odd last row pairs with
// itself).
static _Thread_local char * pairs_buf;
static _Thread_local size_t pairs_size;

static void * pairs_alloc(size_t size) {
    if (size > pairs_size) {
        free(pairs_buf);
        pairs_buf = aligned_alloc(64, (size + 63) / 64 * 64);
        pairs_size = pairs_buf ? size : 0;
    }
    return pairs_buf;
}

// The weights are unpacked as unsigned bytes (the value plus `offset`), so the lane sums come from dpbusd alone:
// sum((w + offset) * y) - offset * sum(y), the same integers as vec_dot's sum(|w| * sign(y, w)).
static const q8_0_pair * pack_pairs(const char * y, size_t y_stride, int ny, int nb, int offset) {
    const int np = (ny + 1) / 2;
    q8_0_pair * out = pairs_alloc((size_t) np * nb * sizeof(q8_0_pair));
    if (!out) {
        return NULL;
    }
    for (int p = 0; p < np; ++p) {
        const q8_0_block * a = (const q8_0_block *) (y + 2 * p * y_stride);
        const q8_0_block * b = (const q8_0_block *) (y + (2 * p + 1 < ny ? 2 * p + 1 : 2 * p) * y_stride);
        for (int k = 0; k < nb; ++k) {
            q8_0_pair * o = &out[(size_t) p * nb + k];
            const __m512i yy = pair(a[k].qs, b[k].qs);
            _mm512_store_si512((__m512i *) o->qs, yy);
            _mm512_store_ps(o->d, _mm512_insertf32x8(_mm512_set1_ps(f16(a[k].d)), _mm256_set1_ps(f16(b[k].d)), 1));
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), yy);
            _mm512_store_si512((__m512i *) o->corr, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-offset)));
        }
    }
    return out;
}

// q8_0: the value plus 128 (the sign bit flipped), 1..255.
static inline __m256i unpack_q8_0(const void * b) {
    const __m256i q = _mm256_loadu_si256((const __m256i *) ((const q8_0_block *) b)->qs);
    return _mm256_xor_si256(q, _mm256_set1_epi8((char) 0x80));
}

// q5_0: 4 low bits, the fifth from qh: the value plus 16, 0..31.
static inline __m256i unpack_q5_0(const void * b) {
    const q5_0_block * x = (const q5_0_block *) b;
    uint32_t qh;
    memcpy(&qh, x->qh, 4);
    return _mm256_or_si256(nibbles(x->qs), _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(0x10)));
}

typedef __m256i (*unpack_fn)(const void *);

// WR weight rows x PR pairs of activation rows, one accumulator each: each pair's quants are loaded once for the WR
// rows, each weight block unpacked once for the PR pairs.
static inline __attribute__((always_inline)) void tile_q0(unpack_fn unpack, const int WR, const int PR, size_t wsize,
                                                          int nb, const char * w, size_t w_stride, const q8_0_pair * yp,
                                                          int p0, float * dst, size_t dst_stride, int i0, int ny) {
    __m512 acc[2][4];
    for (int r = 0; r < WR; ++r) {
        for (int p = 0; p < PR; ++p) {
            acc[r][p] = _mm512_setzero_ps();
        }
    }
    for (int b = 0; b < nb; ++b) {
        __m512i wu[2];
        __m512 wd[2];
        for (int r = 0; r < WR; ++r) {
            const char * wb = w + (i0 + r) * w_stride + b * wsize;
            // the tile reads WR rows side by side, which the hardware prefetchers follow poorly: on gemma-3-270m's
            // LM head (262k x 640 q8_0, one thread, 4 rows a tile then) 8 blocks ahead took 2 activation rows from 30
            // to 17 ms, 4 rows from 35 to 23 (4 or 16 blocks ahead: no gain). A hint only: every element's bits are
            // as before.
            _mm_prefetch(wb + 8 * wsize, _MM_HINT_T0);
            wu[r] = _mm512_broadcast_i64x4(unpack(wb));
            wd[r] = _mm512_set1_ps(f16(*(const uint16_t *) wb));
        }
        for (int p = 0; p < PR; ++p) {
            const q8_0_pair * yb = &yp[(size_t) (p0 + p) * nb + b];
            const __m512i qs = _mm512_load_si512((const __m512i *) yb->qs);
            const __m512i corr = _mm512_load_si512((const __m512i *) yb->corr);
            const __m512 yd = _mm512_load_ps(yb->d);
            for (int r = 0; r < WR; ++r) {
                const __m512i sums = _mm512_dpbusd_epi32(corr, wu[r], qs);
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(wd[r], yd), _mm512_cvtepi32_ps(sums), acc[r][p]);
            }
        }
    }
    for (int r = 0; r < WR; ++r) {
        for (int p = 0; p < PR; ++p) {
            store_pair(acc[r][p], dst, dst_stride, ny, p0 + p, i0 + r);
        }
    }
}

static inline __attribute__((always_inline)) bool dot_q0(unpack_fn unpack, int offset, size_t wsize, int nb,
                                                         const char * w, size_t w_stride, int nw, const char * y,
                                                         size_t y_stride, int ny, float * dst, size_t dst_stride) {
    const q8_0_pair * yp = pack_pairs(y, y_stride, ny, nb, offset);
    if (!yp) {
        return false;
    }
    const int np = (ny + 1) / 2;
    // 2 weight rows a tile: on gemma's LM head shape (one thread) 2..16 activation rows took 0.6-0.85x the time of 4
    // weight rows a tile, which keep more registers busy but read 4 streams of weights (1 and 3 rows: between them)
    for (int p0 = 0; p0 < np; p0 += 4) {
        const int pr = np - p0 < 4 ? np - p0 : 4;
        int i = 0;
        for (; i + 2 <= nw; i += 2) {
            switch (pr) {  // constant tile shapes, so that the accumulators stay in registers
                case 4: tile_q0(unpack, 2, 4, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                case 3: tile_q0(unpack, 2, 3, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                case 2: tile_q0(unpack, 2, 2, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                default: tile_q0(unpack, 2, 1, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
            }
        }
        for (; i < nw; ++i) {
            switch (pr) {
                case 4: tile_q0(unpack, 1, 4, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                case 3: tile_q0(unpack, 1, 3, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                case 2: tile_q0(unpack, 1, 2, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
                default: tile_q0(unpack, 1, 1, wsize, nb, w, w_stride, yp, p0, dst, dst_stride, i, ny); break;
            }
        }
    }
    return true;
}

// ---- q4_K and q6_K weights against q8_K activations --------------------------------------------------------------
// vec_dot, per super-block of 256: exact int32 lane sums of (sub-block scale x products), then acc[lane] =
// fma(y.d * x.d, float(lane sum), acc[lane]); q4_K also keeps its mins' term in a 4-lane accumulator.

// Two activation rows of one super-block, side by side as the pair kernels read them.
typedef struct {
    int8_t qs[8][64];   // 32-quant chunk c: row a's, then row b's
    float d[16];        // [a.d x 8, b.d x 8]
    float negd[8];      // [-a.d x 4, -b.d x 4] (q4_K's mins)
    int16_t q8s[16];    // q4_K: sums of pairs of bsums (its hadd), a's 8 then b's 8
    int16_t bsums[32];  // a's 16, then b's 16
} q8_K_pair;

_Static_assert(sizeof(q8_K_pair) % 64 == 0, "q8_K_pair alignment");

static const q8_K_pair * pack_pairs_K(const char * y, size_t y_stride, int ny, int nb) {
    const int np = (ny + 1) / 2;
    if (!pairs_alloc((size_t) np * nb * sizeof(q8_K_pair))) {
        return NULL;
    }
    q8_K_pair * out = (q8_K_pair *) pairs_buf;
    for (int p = 0; p < np; ++p) {
        const q8_K_block * a = (const q8_K_block *) (y + 2 * p * y_stride);
        const q8_K_block * b = (const q8_K_block *) (y + (2 * p + 1 < ny ? 2 * p + 1 : 2 * p) * y_stride);
        for (int k = 0; k < nb; ++k) {
            q8_K_pair * o = &out[(size_t) p * nb + k];
            for (int c = 0; c < 8; ++c) {
                memcpy(o->qs[c], a[k].qs + 32 * c, 32);
                memcpy(o->qs[c] + 32, b[k].qs + 32 * c, 32);
            }
            for (int l = 0; l < 8; ++l) {
                o->d[l] = a[k].d;
                o->d[8 + l] = b[k].d;
                o->q8s[l] = (int16_t) (a[k].bsums[2 * l] + a[k].bsums[2 * l + 1]);
                o->q8s[8 + l] = (int16_t) (b[k].bsums[2 * l] + b[k].bsums[2 * l + 1]);
            }
            for (int l = 0; l < 4; ++l) {
                o->negd[l] = -a[k].d;
                o->negd[4 + l] = -b[k].d;
            }
            memcpy(o->bsums, a[k].bsums, 32);
            memcpy(o->bsums + 16, b[k].bsums, 32);
        }
    }
    return out;
}

static inline __m512i bcast256(__m256i x) { return _mm512_broadcast_i64x4(x); }

static bool dot_q4_K(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                     float * dst, size_t dst_stride) {
    const q8_K_pair * yp = pack_pairs_K(y, y_stride, ny, nb);
    if (!yp) {
        return false;
    }
    const int np = (ny + 1) / 2;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nw; ++i) {
        const q4_K_block * x = (const q4_K_block *) (w + i * w_stride);
        __m512 acc[MAX_ROWS / 2];
        __m256 acc_m[MAX_ROWS / 2];
        for (int p = 0; p < np; ++p) {
            acc[p] = _mm512_setzero_ps();
            acc_m[p] = _mm256_setzero_ps();
        }
        for (int b = 0; b < nb; ++b) {
            uint32_t u[4];
            q4_K_scales(&x[b], u);
            const uint8_t * sc = (const uint8_t *) u;  // scales 0..7, then mins 0..7
            const __m256i mins2 = _mm256_broadcastsi128_si256(q4_K_mins(u));
            const __m512 xd = _mm512_set1_ps(f16(x[b].d));
            const __m256 xdmin = _mm256_set1_ps(f16(x[b].dmin));
            __m512i ql[4], qh[4], sl[4], sh[4];
            for (int j = 0; j < 4; ++j) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *) (x[b].qs + 32 * j));
                ql[j] = bcast256(_mm256_and_si256(bits, m4));
                qh[j] = bcast256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4));
                sl[j] = _mm512_set1_epi16(sc[2 * j]);
                sh[j] = _mm512_set1_epi16(sc[2 * j + 1]);
            }
            for (int p = 0; p < np; ++p) {
                const q8_K_pair * yb = &yp[(size_t) p * nb + b];
                const __m256i prod = _mm256_madd_epi16(mins2, _mm256_load_si256((const __m256i *) yb->q8s));
                acc_m[p] = _mm256_fmadd_ps(_mm256_mul_ps(xdmin, _mm256_load_ps(yb->negd)), _mm256_cvtepi32_ps(prod),
                                           acc_m[p]);
                // the same exact lane sums as vec_dot's maddubs, madd by the scale, add; dpwssd fuses the last two
                __m512i sumi = _mm512_setzero_si512();
                for (int j = 0; j < 4; ++j) {
                    sumi = _mm512_dpwssd_epi32(
                        sumi, sl[j], _mm512_maddubs_epi16(ql[j], _mm512_load_si512((const __m512i *) yb->qs[2 * j])));
                    const __m512i yh = _mm512_load_si512((const __m512i *) yb->qs[2 * j + 1]);
                    sumi = _mm512_dpwssd_epi32(sumi, sh[j], _mm512_maddubs_epi16(qh[j], yh));
                }
                const __m512 d = _mm512_mul_ps(xd, _mm512_load_ps(yb->d));
                acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc[p]);
            }
        }
        for (int p = 0; p < np; ++p) {
            float out[2];
            for (int h = 0; h < 2; ++h) {
                const __m128 m = h ? _mm256_extractf128_ps(acc_m[p], 1) : _mm256_castps256_ps128(acc_m[p]);
                const __m256 a = h ? _mm512_extractf32x8_ps(acc[p], 1) : _mm512_castps512_ps256(acc[p]);
                out[h] = hsum8(a) + hsum4(m);
            }
            put_pair(dst, dst_stride, ny, p, i, out[0], out[1]);
        }
    }
    return true;
}

static bool dot_q6_K(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                     float * dst, size_t dst_stride) {
    const q8_K_pair * yp = pack_pairs_K(y, y_stride, ny, nb);
    if (!yp) {
        return false;
    }
    const int np = (ny + 1) / 2;
    for (int i = 0; i < nw; ++i) {
        const q6_K_block * x = (const q6_K_block *) (w + i * w_stride);
        __m512 acc[MAX_ROWS / 2];
        for (int p = 0; p < np; ++p) {
            acc[p] = _mm512_setzero_ps();
        }
        for (int b = 0; b < nb; ++b) {
            __m256i q256[8];
            q6_K_quants(&x[b], q256);
            __m512i q[8], s[8];
            for (int c = 0; c < 8; ++c) {
                q[c] = bcast256(q256[c]);
                s[c] = bcast256(q6_K_chunk_scales(&x[b], c));
            }
            const __m512i scales16 = bcast256(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[b].scales)));
            const __m512 xd = _mm512_set1_ps(f16(x[b].d));
            for (int p = 0; p < np; ++p) {
                const q8_K_pair * yb = &yp[(size_t) p * nb + b];
                const __m512i sub = _mm512_slli_epi32(
                    _mm512_madd_epi16(_mm512_load_si512((const __m512i *) yb->bsums), scales16), 5);
                __m512i sumi = _mm512_setzero_si512();
                for (int c = 0; c < 8; ++c) {
                    sumi = _mm512_dpwssd_epi32(
                        sumi, s[c], _mm512_maddubs_epi16(q[c], _mm512_load_si512((const __m512i *) yb->qs[c])));
                }
                sumi = _mm512_sub_epi32(sumi, sub);
                const __m512 d = _mm512_mul_ps(xd, _mm512_load_ps(yb->d));
                acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc[p]);
            }
        }
        for (int p = 0; p < np; ++p) {
            store_pair(acc[p], dst, dst_stride, ny, p, i);
        }
    }
    return true;
}

#endif  // DFLASH_BATCH_DOT

#if defined(DFLASH_AVX2) && !defined(DFLASH_BATCH_DOT)

// ---- q4_K and q6_K on AVX2 without VNNI: a weight row against up to 16 activation rows --------------------------------------
// Each activation row goes through vec_dot's own AVX2 operations (the same instructions, lane for lane), with the
// weight's super-block unpacked once for all of them instead of once per row.

static bool dot_q4_K(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                     float * dst, size_t dst_stride) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nw; ++i) {
        const q4_K_block * x = (const q4_K_block *) (w + i * w_stride);
        __m256 acc[MAX_ROWS];
        __m128 acc_m[MAX_ROWS];
        for (int r = 0; r < ny; ++r) {
            acc[r] = _mm256_setzero_ps();
            acc_m[r] = _mm_setzero_ps();
        }
        for (int b = 0; b < nb; ++b) {
            uint32_t u[4];
            q4_K_scales(&x[b], u);
            const uint8_t * sc = (const uint8_t *) u;
            const __m128i mins = q4_K_mins(u);
            const float xd = f16(x[b].d), xdmin = f16(x[b].dmin);
            __m256i ql[4], qh[4];
            for (int j = 0; j < 4; ++j) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *) (x[b].qs + 32 * j));
                ql[j] = _mm256_and_si256(bits, m4);
                qh[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            }
            for (int r = 0; r < ny; ++r) {
                const q8_K_block * yb = (const q8_K_block *) (y + r * y_stride) + b;
                const float d = yb->d * xd;
                const float dmin = -yb->d * xdmin;
                const __m128i prod = _mm_madd_epi16(mins, q8_K_pair_sums(yb));
                acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                __m256i sumi = _mm256_setzero_si256();
                for (int j = 0; j < 4; ++j) {
                    const __m256i yl = _mm256_loadu_si256((const __m256i *) (yb->qs + 64 * j));
                    const __m256i yh = _mm256_loadu_si256((const __m256i *) (yb->qs + 64 * j + 32));
                    const __m256i pl = _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j]), _mm256_maddubs_epi16(ql[j], yl));
                    const __m256i ph =
                        _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j + 1]), _mm256_maddubs_epi16(qh[j], yh));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for (int r = 0; r < ny; ++r) {
            dst[(size_t) r * dst_stride + i] = hsum8(acc[r]) + hsum4(acc_m[r]);
        }
    }
    return true;
}

static bool dot_q6_K(int nb, const char * w, size_t w_stride, int nw, const char * y, size_t y_stride, int ny,
                     float * dst, size_t dst_stride) {
    for (int i = 0; i < nw; ++i) {
        const q6_K_block * x = (const q6_K_block *) (w + i * w_stride);
        __m256 acc[MAX_ROWS];
        for (int r = 0; r < ny; ++r) {
            acc[r] = _mm256_setzero_ps();
        }
        for (int b = 0; b < nb; ++b) {
            __m256i q[8], s[8];
            q6_K_quants(&x[b], q);
            for (int c = 0; c < 8; ++c) {
                s[c] = q6_K_chunk_scales(&x[b], c);
            }
            const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[b].scales));
            const float xd = f16(x[b].d);
            for (int r = 0; r < ny; ++r) {
                const q8_K_block * yb = (const q8_K_block *) (y + r * y_stride) + b;
                const float d = yb->d * xd;
                const __m256i sub = _mm256_slli_epi32(
                    _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), scales16), 5);
                __m256i sumi = _mm256_setzero_si256();
                for (int c = 0; c < 8; ++c) {
                    const __m256i yq = _mm256_loadu_si256((const __m256i *) (yb->qs + 32 * c));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(s[c], _mm256_maddubs_epi16(q[c], yq)));
                }
                sumi = _mm256_sub_epi32(sumi, sub);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for (int r = 0; r < ny; ++r) {
            dst[(size_t) r * dst_stride + i] = hsum8(acc[r]);
        }
    }
    return true;
}

#endif

#ifdef DFLASH_AVX2

// ---- q8_K activations (the rows that meet q4_K and q6_K weights) ---------------------------------------------------
// quantize_row_q8_K_ref, which ggml's x86 build calls for every such row (ggml-base has no vector flags: plain float
// multiplies and adds, no fused ones): per super-block of 256 the first value of largest magnitude, iscale = -127 / it,
// each value's nearest_int(iscale * x) (x + 12582912 as a float, its low 22 bits less 2^22: ties to even) kept under
// 128 and stored as its low byte, the sums of each 16, and d = 1 / iscale; an all-zero block gets d = 0 and zero quants
// and keeps its sums. The same float operations 8 lanes at a time give the same bits, non-finite values included.
static void quantize_q8_K(const float * x, q8_K_block * y, int64_t k) {
    const __m256 sign = _mm256_set1_ps(-0.0f), magic = _mm256_set1_ps(12582912.0f);
    const __m256i low = _mm256_set1_epi32(0x007fffff), bias = _mm256_set1_epi32(0x00400000),
                  top = _mm256_set1_epi32(127), byte = _mm256_set1_epi32(0xff);
    for (int64_t i = 0; i < k / 256; ++i, x += 256) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8)  // a NaN lane keeps m's: the reference's `ax > amax` skips NaN
            m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if (amax == 0.0f) {
            y[i].d = 0.0f;
            memset(y[i].qs, 0, 256);
            continue;
        }
        int first = 0;  // the first value of that magnitude, as the reference's strict `>` finds it
        for (int j = 0; j < 256; j += 8) {
            const int hit = _mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (hit) {
                first = j + __builtin_ctz((unsigned) hit);
                break;
            }
        }
        const float iscale = -127.0f / x[first];
        const __m256 vs = _mm256_set1_ps(iscale);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int h = 0; h < 4; ++h) {
                const __m256 t = _mm256_add_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 8 * h)), magic);
                const __m256i v = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(t), low), bias);
                q[h] = _mm256_min_epi32(v, top);
            }
            // the sums of each 16 values as stored (their low bytes, sign-extended)
            for (int h = 0; h < 4; h += 2) {
                const __m256i s = _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(q[h], 24), 24),
                                                   _mm256_srai_epi32(_mm256_slli_epi32(q[h + 1], 24), 24));
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
                y[i].bsums[(j + 8 * h) / 16] = (int16_t) _mm_cvtsi128_si32(s4);
            }
            // the low bytes, in order (the packs interleave 128-bit lanes; the permute puts them back)
            const __m256i w01 = _mm256_packus_epi32(_mm256_and_si256(q[0], byte), _mm256_and_si256(q[1], byte));
            const __m256i w23 = _mm256_packus_epi32(_mm256_and_si256(q[2], byte), _mm256_and_si256(q[3], byte));
            const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *) (y[i].qs + j), b);
        }
        y[i].d = 1.0f / iscale;
    }
}

#endif  // DFLASH_AVX2

bool dflash_quantize_row_q8_K(const float * x, void * y, int64_t k) {
#ifdef DFLASH_AVX2
    if (k % 256) {
        return false;
    }
    quantize_q8_K(x, (q8_K_block *) y, k);
    return true;
#else
    (void) x, (void) y, (void) k;
    return false;
#endif
}

bool dflash_batch_dot(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                      size_t y_stride, int ny, float * dst, size_t dst_stride) {
#ifdef DFLASH_AVX2
    if (ny < 2 || ny > MAX_ROWS || nw < 1) {
        return false;
    }
    switch (type) {
#ifdef DFLASH_BATCH_DOT  // on other AVX2 CPUs these go to sgemm
        case GGML_TYPE_Q8_0:
            return dot_q0(unpack_q8_0, 128, sizeof(q8_0_block), n / 32, (const char *) w, w_stride, nw,
                          (const char *) y, y_stride, ny, dst, dst_stride);
        case GGML_TYPE_Q5_0:
            return dot_q0(unpack_q5_0, 16, sizeof(q5_0_block), n / 32, (const char *) w, w_stride, nw,
                          (const char *) y, y_stride, ny, dst, dst_stride);
#endif
        case GGML_TYPE_Q4_K:
            return dot_q4_K(n / 256, (const char *) w, w_stride, nw, (const char *) y, y_stride, ny, dst, dst_stride);
        case GGML_TYPE_Q6_K:
            return dot_q6_K(n / 256, (const char *) w, w_stride, nw, (const char *) y, y_stride, ny, dst, dst_stride);
        default:
            return false;
    }
#else
    (void) type, (void) n, (void) w, (void) w_stride, (void) nw, (void) y, (void) y_stride, (void) ny, (void) dst;
    (void) dst_stride;
    return false;
#endif
}

bool dflash_batch_gemm(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                       size_t y_stride, int ny, float * dst, size_t dst_stride, int ith, int nth) {
#ifdef DFLASH_AVX2
    if (ny < GEMM_MIN_COLS || nw < 1 || n / 32 > GEMM_MAX_BLOCKS) {
        return false;  // on every thread alike
    }
    switch (type) {
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q4_0:
            gemm_q0(type, n / 32, (const char *) w, w_stride, nw, (const char *) y, y_stride, ny, dst, dst_stride, ith,
                    nth);
            return true;
        case GGML_TYPE_Q4_1:
            gemm_q4_1(n / 32, (const char *) w, w_stride, nw, (const char *) y, y_stride, ny, dst, dst_stride, ith,
                      nth);
            return true;
        case GGML_TYPE_Q4_K:  // below 32 rows (verify blocks) the 16-row tiles are as fast, on 2 threads faster
            if (ny < GEMM_MIN_COLS_K) {
                return false;
            }
            gemm_q4_K(n / 256, (const char *) w, w_stride, nw, (const char *) y, y_stride, ny, dst, dst_stride, ith,
                      nth);
            return true;
        default:
            return false;
    }
#else
    (void) type, (void) n, (void) w, (void) w_stride, (void) nw, (void) y, (void) y_stride, (void) ny, (void) dst;
    (void) dst_stride, (void) ith, (void) nth;
    return false;
#endif
}
