// dflash-local: ggml's CPU flash attention with the same bits for a row whatever batch it is in (README.md).
//
// A row's result is a function of the row alone. Its cells go in segments of FA_SEGMENT at fixed cell indices, each
// in blocks of FA_CELLS. In a block, each score is one dot product (one 8-lane fused multiply-add chain over the
// head's values in order, then the lanes summed in a fixed tree, hsum4's); the block's maximum updates the segment's
// running one; the block's probabilities are exponentials of the scores less that maximum (masked cells: 0), summed
// 8 lanes at a time (lane j: cells j, j + 8, ...) then by the same tree; the running sum is scaled by exp(old maximum -
// new maximum) and the block's sum added in one fused multiply-add, and the output is scaled once and the value rows
// added to it in cell order by fused multiply-adds. The segments' sums and outputs are merged in segment
// order. Masked cells add exact zeros, so cells a batch holds beyond a row's own (a longer cache, a later row's
// positions) change nothing, and a block or segment with no cell for a row is skipped. How rows, heads and segments
// are shared among threads and tiles only decides which loads are shared and where states wait: every score and
// output element goes through the same operations. Where this file has no kernel (no AVX2/FMA/F16C, other Q types,
// head sizes not a multiple of 8) dflash_flash_attn returns false and ggml runs its one-row kernel for every batch.

#include "flash_attn.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "vec.h"

#include <math.h>
#include <string.h>

bool dflash_flash_attn_batch_invariant(void) {
    return true;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define FA_CELLS 64  // cells per block
#define FA_PAIRS 64  // most (row, head) pairs a thread takes at once: they share each block's converted K and V
#define FA_IN_PLACE 4  // at most this many pairs read an f16 cache in place rather than converted
#define FA_SEGMENT 512  // cells per segment: a row's partial sums, merged in order (whole blocks)

// Converted K rows: 4 pairs' dot products with 4 cells at a time where AVX512VL gives 32 vector registers, else 2
#if defined(__AVX512VL__)
#define FA_TILE_PAIRS 4
#else
#define FA_TILE_PAIRS 2
#endif

// exponentials of 16 lanes, two halves: one 512-bit vector where the build has them (vec.h's ggml_v_expf takes the
// widest vector the build has). Each lane is computed on its own, so a cell gets the same bits wherever it sits
static inline void exp16(__m256 a, __m256 b, __m256 * ea, __m256 * eb) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const __m512 e = ggml_v_expf(_mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1));
    *ea = _mm512_castps512_ps256(e);
    *eb = _mm512_extractf32x8_ps(e, 1);
#else
    *ea = ggml_v_expf(a);
    *eb = ggml_v_expf(b);
#endif
}

// the lane sums of four 8-lane vectors, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the one order every
// score and block sum is summed in, however many are summed at once
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// lanes 0 .. n - 1 set
static inline __m256 first_lanes(int n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// a block's K or V rows: floats (converted, or an f32 cache), or f16 read in place (the conversion is exact either way)
struct rows {
    const char * data;
    size_t stride;  // bytes from a cell's row to the next's
    bool half;
};

static inline __attribute__((always_inline)) __m256 load8(const char * row, int64_t i, bool half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (row + 2 * i)))
                : _mm256_loadu_ps((const float *) row + i);
}

// the dot products of np query rows with nc cells from cell c, each one chain over the head's values (np <= 4,
// nc <= 4 and half constants at every call, so each shape compiles with its accumulators in registers)
static inline __attribute__((always_inline)) void dots(int np, int nc, bool half, const float * const * q,
                                                       struct rows k, int c, int64_t dk, float * s) {
    __m256 acc[4][4];
    for (int p = 0; p < np; p++)
        for (int j = 0; j < nc; j++)
            acc[p][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dk; d += 8) {
        __m256 kv[4];
        for (int j = 0; j < nc; j++)
            kv[j] = load8(k.data + (c + j) * k.stride, d, half);
        for (int p = 0; p < np; p++) {
            const __m256 qv = _mm256_loadu_ps(q[p] + d);
            for (int j = 0; j < nc; j++)
                acc[p][j] = _mm256_fmadd_ps(qv, kv[j], acc[p][j]);
        }
    }
    for (int p = 0; p < np; p++) {
        const __m128 r = hsum4(acc[p][0], acc[p][nc > 1 ? 1 : 0], acc[p][nc > 2 ? 2 : 0], acc[p][nc > 3 ? 3 : 0]);
        if (nc == 4) {
            _mm_storeu_ps(s + p * FA_CELLS + c, r);
        } else {
            float t[4];
            _mm_storeu_ps(t, r);
            for (int j = 0; j < nc; j++)
                s[p * FA_CELLS + c + j] = t[j];
        }
    }
}

// prefetch 4 cells' rows of `bytes` each: in a cache a cell's row holds every K/V head, so a head's rows are strided,
// which the CPU's own prefetchers do not follow well, and a long context's cache does not fit the CPU's caches
static inline __attribute__((always_inline)) void fetch_rows(const char * p, size_t stride, int64_t bytes) {
    for (int j = 0; j < 4; j++)
        for (int64_t b = 0; b < bytes; b += 64)
            _mm_prefetch(p + j * stride + b, _MM_HINT_T0);
}

// s[p][0..nc) for the np (<= 2) query rows q, f16 cells read in place: 4 cells at a time, then one; with v, the rows
// that come next are prefetched
static inline __attribute__((always_inline)) void block_dots_half(int np, const float * const * q, struct rows k,
                                                                  int nc, int64_t dk, float * s, const struct rows * v,
                                                                  int64_t dv) {
    int c = 0;
    for (; c + 4 <= nc; c += 4) {
        if (v) {  // the next block's K rows and this block's V rows on their way from memory (fetch_rows)
            fetch_rows(k.data + (c + FA_CELLS) * k.stride, k.stride, 2 * dk);
            fetch_rows(v->data + c * v->stride, v->stride, 2 * dv);
        }
        if (np == 2) dots(2, 4, true, q, k, c, dk, s);
        else         dots(1, 4, true, q, k, c, dk, s);
    }
    for (; c < nc; c++) {
        if (np == 2) dots(2, 1, true, q, k, c, dk, s);
        else         dots(1, 1, true, q, k, c, dk, s);
    }
}

// the same for np (<= FA_TILE_PAIRS) query rows over converted cells: 4 cells at a time (each cell loaded once for the
// rows), then one
static void block_dots(int np, const float * const * q, struct rows k, int nc, int64_t dk, float * s) {
    int c = 0;
    for (; c + 4 <= nc; c += 4) {
        switch (np) {
#if FA_TILE_PAIRS == 4
            case 4:  dots(4, 4, false, q, k, c, dk, s); break;
            case 3:  dots(3, 4, false, q, k, c, dk, s); break;
#endif
            case 2:  dots(2, 4, false, q, k, c, dk, s); break;
            default: dots(1, 4, false, q, k, c, dk, s); break;
        }
    }
    for (; c < nc; c++) {
        switch (np) {
#if FA_TILE_PAIRS == 4
            case 4:  dots(4, 1, false, q, k, c, dk, s); break;
            case 3:  dots(3, 1, false, q, k, c, dk, s); break;
#endif
            case 2:  dots(2, 1, false, q, k, c, dk, s); break;
            default: dots(1, 1, false, q, k, c, dk, s); break;
        }
    }
}

// o = o * alpha, then o += e[c] * V[c] for the cells in order (those with e[c] == 0 add nothing and are skipped);
// 64 values at a time in registers
static inline __attribute__((always_inline)) void add_values(bool half, float * o, float alpha, const float * e,
                                                             struct rows v, int nc, int64_t dv) {
    const __m256 va = _mm256_set1_ps(alpha);
    int64_t d = 0;
    for (; d + 64 <= dv; d += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_mul_ps(_mm256_loadu_ps(o + d + 8 * j), va);
        for (int c = 0; c < nc; c++) {
            if (e[c] == 0.0f) continue;
            const __m256 w = _mm256_set1_ps(e[c]);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(w, load8(v.data + c * v.stride, d + 8 * j, half), acc[j]);
        }
        for (int j = 0; j < 8; j++)
            _mm256_storeu_ps(o + d + 8 * j, acc[j]);
    }
    for (; d < dv; d += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + d), va);
        for (int c = 0; c < nc; c++) {
            if (e[c] == 0.0f) continue;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(e[c]), load8(v.data + c * v.stride, d, half), acc);
        }
        _mm256_storeu_ps(o + d, acc);
    }
}

// add_values for np (<= 4) pairs over converted cells, 16 values of each at a time: a cell's values are loaded once
// for the np pairs; where one of them has e[c] == 0, only the others add it (every lane's operations as add_values')
static inline __attribute__((always_inline)) void add_values_tile(int np, float * const * o, const float * alpha,
                                                                  const float * const * e, struct rows v, int nc,
                                                                  int64_t dv) {
    bool all[FA_CELLS];  // every pair adds cell c (almost always: the test leaves the inner loop)
    for (int c = 0; c < nc; c++) {
        all[c] = true;
        for (int p = 0; p < np; p++)
            all[c] = all[c] && e[p][c] != 0.0f;
    }
    for (int64_t d = 0; d < dv; d += 16) {
        __m256 acc[4][2];
        for (int p = 0; p < np; p++)
            for (int j = 0; j < 2; j++)
                acc[p][j] = _mm256_mul_ps(_mm256_loadu_ps(o[p] + d + 8 * j), _mm256_set1_ps(alpha[p]));
        for (int c = 0; c < nc; c++) {
            const float * vc = (const float *) (v.data + c * v.stride) + d;
            const __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8);
            for (int p = 0; p < np; p++) {
                if (!all[c] && e[p][c] == 0.0f) continue;
                const __m256 w = _mm256_broadcast_ss(&e[p][c]);
                acc[p][0] = _mm256_fmadd_ps(w, v0, acc[p][0]);
                acc[p][1] = _mm256_fmadd_ps(w, v1, acc[p][1]);
            }
        }
        for (int p = 0; p < np; p++)
            for (int j = 0; j < 2; j++)
                _mm256_storeu_ps(o[p] + d + 8 * j, acc[p][j]);
    }
}

static void to_f32(const struct ggml_tensor * t, const char * row, float * out, int64_t n) {
    switch (t->type) {
        case GGML_TYPE_F32:  memcpy(out, row, n * sizeof(float)); break;
        case GGML_TYPE_F16:  ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) row, out, n); break;
        case GGML_TYPE_BF16: ggml_cpu_bf16_to_fp32((const ggml_bf16_t *) row, out, n); break;
        default:             ggml_get_type_traits(t->type)->to_float(row, out, n); break;
    }
}

static bool convertible(enum ggml_type type) {
    return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 ||
           ggml_get_type_traits(type)->to_float != NULL;
}

// one (query row, head) pair, and where its softmax stands: maximum, sum and output over the cells taken so far
struct pair {
    const float * q;
    const ggml_fp16_t * mask;  // its row of the mask, or NULL
    float slope;
    int64_t head, row;
};

struct state {
    float * max, * sum, * out;  // per pair: 1, 1 and dv floats
};

struct attn {
    const struct ggml_tensor * q, * k, * v, * mask, * sinks;
    struct ggml_tensor * dst;
    int64_t dk, dv, n_kv, n_rows, n_head, rk2, rk3;
    float scale, softcap, max_bias, m0, m1;
    uint32_t n_head_log2;
    int64_t group, n_groups, per_unit, units_per_group;  // pairs per K/V head, K/V heads, pairs per unit
};

static void state_init(struct state st, int64_t np, int64_t dv) {
    for (int64_t p = 0; p < np; p++) {
        st.max[p] = -INFINITY;
        st.sum[p] = 0.0f;
        memset(st.out + p * dv, 0, dv * sizeof(float));
    }
}

// the pairs of unit u (consecutive pairs of one K/V head: rows by the query heads that share it); returns how many
static int64_t unit_pairs(const struct attn * a, int64_t u, struct pair * pairs, int64_t * kvh, int64_t * iq3) {
    const int64_t g = u / a->units_per_group, first = (u % a->units_per_group) * a->per_unit;
    const int64_t np = first + a->per_unit <= a->group ? a->per_unit : a->group - first;
    *iq3 = g / (a->n_head / a->rk2);
    *kvh = g % (a->n_head / a->rk2);
    for (int64_t p = 0; p < np; p++) {
        const int64_t iq1 = (first + p) / a->rk2, iq2 = *kvh * a->rk2 + (first + p) % a->rk2;
        const struct ggml_tensor * m = a->mask;
        pairs[p].row = iq1;
        pairs[p].head = iq2;
        pairs[p].q = (const float *) ((const char *) a->q->data + iq1 * a->q->nb[1] + iq2 * a->q->nb[2] +
                                      *iq3 * a->q->nb[3]);
        pairs[p].mask = m ? (const ggml_fp16_t *) ((const char *) m->data + iq1 * m->nb[1] +
                                                   (iq2 % m->ne[2]) * m->nb[2] + (*iq3 % m->ne[3]) * m->nb[3])
                          : NULL;
        pairs[p].slope = a->max_bias > 0.0f ? (uint32_t) iq2 < a->n_head_log2
                                                  ? powf(a->m0, iq2 + 1)
                                                  : powf(a->m1, 2 * (iq2 - a->n_head_log2) + 1)
                                            : 1.0f;
    }
    return np;
}

// n (<= 8) consecutive cells' floats as 8 lanes, the lanes past them 0; and 8 lanes back into n cells
static inline __m256 load_cells(const float * p, int n) {
    float t[8] = {0};
    if (n == 8) {
        return _mm256_loadu_ps(p);
    }
    memcpy(t, p, n * sizeof(float));
    return _mm256_loadu_ps(t);
}

static inline void store_cells(float * p, int n, __m256 v) {
    float t[8];
    if (n == 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    _mm256_storeu_ps(t, v);
    memcpy(p, t, n * sizeof(float));
}

// a pair's block: scores scaled, capped and masked in place, the running maximum updated; the rescale of its output
// (alpha), the block's probabilities e (masked cells 0) and their sum. False where the block has no cell for the pair.
// Cells go 8 at a time (the last few padded, adding exact zeros), so a cell's operations do not depend on where the
// cache ends
static bool probabilities(const struct attn * a, const struct pair * pr, int64_t c0, int nc, float * s,
                          float * run_max, float * alpha, float * e, float * sum) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY), scale = _mm256_set1_ps(a->scale);
    __m256 vmax = minus_inf;
    const ggml_fp16_t zero = GGML_CPU_FP32_TO_FP16(0.0f), masked = GGML_CPU_FP32_TO_FP16(-INFINITY);
    for (int c = 0; c < nc; c += 8) {
        const int n = nc - c < 8 ? nc - c : 8;
        float tanh8[8];
        ggml_fp16_t mp[8];
        const ggml_fp16_t * mc = pr->mask ? pr->mask + c0 + c : NULL;
        if (n < 8 || !mc) {  // padded: the lanes past the block are masked
            for (int j = 0; j < 8; j++)
                mp[j] = j >= n ? masked : mc ? mc[j] : zero;
            mc = mp;
        }
        __m256 x = _mm256_mul_ps(load_cells(s + c, n), scale);
        if (a->softcap != 0.0f) {
            _mm256_storeu_ps(tanh8, x);
            for (int j = 0; j < 8; j++)
                tanh8[j] = a->softcap * tanhf(tanh8[j]);
            x = _mm256_loadu_ps(tanh8);
        }
        const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(pr->slope), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) mc)));
        const __m256 r = _mm256_blendv_ps(_mm256_add_ps(x, mv), minus_inf, _mm256_cmp_ps(mv, minus_inf, _CMP_EQ_OQ));
        store_cells(s + c, n, r);
        vmax = _mm256_max_ps(vmax, r);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float block_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (block_max == -INFINITY) {
        return false;
    }
    const float new_max = *run_max > block_max ? *run_max : block_max;
    *alpha = expf(*run_max - new_max);  // 0 at the first block
    // exp(s - new_max), 16 cells at a time, each lane on its own; masked cells and lanes past the block 0, and the
    // sum over 8 lanes
    const __m256 none = _mm256_setzero_ps(), vmax_new = _mm256_set1_ps(new_max);
    __m256 vsum = none;
    for (int c = 0; c < nc; c += 16) {  // (e may be s itself: each group is read before it is written)
        const int na = nc - c < 8 ? nc - c : 8, nb = nc - c - 8 < 8 ? nc - c - 8 : 8;  // nb <= 0: no second half
        const __m256 xa = load_cells(s + c, na), xb = nb > 0 ? load_cells(s + c + 8, nb) : minus_inf;
        __m256 ea, eb;
        exp16(_mm256_sub_ps(xa, vmax_new), _mm256_sub_ps(xb, vmax_new), &ea, &eb);
        ea = _mm256_and_ps(_mm256_blendv_ps(ea, none, _mm256_cmp_ps(xa, minus_inf, _CMP_EQ_OQ)), first_lanes(na));
        store_cells(e + c, na, ea);
        vsum = _mm256_add_ps(vsum, ea);
        if (nb > 0) {
            eb = _mm256_and_ps(_mm256_blendv_ps(eb, none, _mm256_cmp_ps(xb, minus_inf, _CMP_EQ_OQ)), first_lanes(nb));
            store_cells(e + c + 8, nb, eb);
            vsum = _mm256_add_ps(vsum, eb);
        }
    }
    *sum = _mm_cvtss_f32(hsum4(vsum, vsum, vsum, vsum));
    *run_max = new_max;
    return true;
}

// the cells [c_begin, c_end) (whole blocks but the cache's last) for np pairs of K/V head kvh, from state st;
// scratch: FA_CELLS * (dk + dv + np + 1) floats
static void attend_cells(const struct attn * a, const struct pair * pairs, int64_t np, int64_t kvh, int64_t iq3,
                         int64_t c_begin, int64_t c_end, struct state st, float * scratch) {
    const struct ggml_tensor * k = a->k, * v = a->v;
    const int64_t dk = a->dk, dv = a->dv;
    float * kf = scratch, * vf = kf + FA_CELLS * dk, * sc = vf + FA_CELLS * dv;
    const char * kbase = (const char *) k->data + kvh * k->nb[2] + (iq3 / a->rk3) * k->nb[3];
    const char * vbase = (const char *) v->data + kvh * v->nb[2] + (iq3 / a->rk3) * v->nb[3];
    int64_t idx[FA_PAIRS];

    for (int64_t c0 = c_begin; c0 < c_end; c0 += FA_CELLS) {
        const int nc = (int) (c_end - c0 < FA_CELLS ? c_end - c0 : FA_CELLS);
        int64_t nl = 0;  // the pairs with a cell in this block
        for (int64_t p = 0; p < np; p++) {
            bool live = !pairs[p].mask;
            for (int c = 0; c < nc && !live; c++)
                live = GGML_CPU_FP16_TO_FP32(pairs[p].mask[c0 + c]) != -INFINITY;
            if (live)
                idx[nl++] = p;
        }
        if (nl == 0) {
            continue;
        }

        // f16 rows in place where few pairs share them (a decode step), else converted once for all the pairs
        struct rows kr = {kbase + c0 * k->nb[1], k->nb[1], true}, vr = {vbase + c0 * v->nb[1], v->nb[1], true};
        if (k->type != GGML_TYPE_F16 || nl > FA_IN_PLACE) {
            for (int c = 0; c < nc; c++)
                to_f32(k, kbase + (c0 + c) * k->nb[1], kf + c * dk, dk);
            kr = (struct rows) {(const char *) kf, dk * sizeof(float), false};
        }
        if (v->type != GGML_TYPE_F16 || nl > FA_IN_PLACE) {
            for (int c = 0; c < nc; c++)
                to_f32(v, vbase + (c0 + c) * v->nb[1], vf + c * dv, dv);
            vr = (struct rows) {(const char *) vf, dv * sizeof(float), false};
        }

        // scores: pairs side by side (two in place, FA_TILE_PAIRS over converted cells), each's row of sc
        const int64_t step = kr.half ? 2 : FA_TILE_PAIRS;
        for (int64_t i = 0; i < nl; i += step) {
            const int n = (int) (nl - i < step ? nl - i : step);
            const float * qs[FA_TILE_PAIRS > 2 ? FA_TILE_PAIRS : 2];
            for (int p = 0; p < n; p++)
                qs[p] = pairs[idx[i + p]].q;
            if (kr.half) block_dots_half(n, qs, kr, nc, dk, sc + i * FA_CELLS, i == 0 && vr.half ? &vr : NULL, dv);
            else         block_dots(n, qs, kr, nc, dk, sc + i * FA_CELLS);
        }

        // probabilities pair by pair (sc's rows become e) and the running sums, then value rows: in place pair by
        // pair, converted four pairs at a time
        int64_t nv = 0;  // the pairs with a cell in the block that adds
        float alpha[FA_PAIRS];
        for (int64_t i = 0; i < nl; i++) {  // row nv <= i: the live pairs' e packed at the front of sc
            const int64_t p = idx[i];
            float sum;
            if (probabilities(a, &pairs[p], c0, nc, sc + i * FA_CELLS, &st.max[p], &alpha[nv], sc + nv * FA_CELLS,
                              &sum)) {
                st.sum[p] = fmaf(st.sum[p], alpha[nv], sum);
                idx[nv++] = p;
            }
        }
        if (vr.half) {
            for (int64_t i = 0; i < nv; i++)
                add_values(true, st.out + idx[i] * dv, alpha[i], sc + i * FA_CELLS, vr, nc, dv);
            continue;
        }
        for (int64_t i = 0; i < nv; i += 4) {
            const int n = (int) (nv - i < 4 ? nv - i : 4);
            float * o[4];
            const float * e[4];
            for (int p = 0; p < n; p++) {
                o[p] = st.out + idx[i + p] * dv;
                e[p] = sc + (i + p) * FA_CELLS;
            }
            if (dv % 16) {
                for (int p = 0; p < n; p++)
                    add_values(false, o[p], alpha[i + p], e[p], vr, nc, dv);
                continue;
            }
            switch (n) {
                case 4:  add_values_tile(4, o, alpha + i, e, vr, nc, dv); break;
                case 3:  add_values_tile(3, o, alpha + i, e, vr, nc, dv); break;
                case 2:  add_values_tile(2, o, alpha + i, e, vr, nc, dv); break;
                default: add_values_tile(1, o, alpha + i, e, vr, nc, dv); break;
            }
        }
    }
}

// total += part, pair by pair: both rescaled to the larger maximum (a part with no cell adds nothing)
static void merge(struct state total, struct state part, int64_t np, int64_t dv) {
    for (int64_t p = 0; p < np; p++) {
        if (part.max[p] == -INFINITY) {
            continue;
        }
        const float m = total.max[p] > part.max[p] ? total.max[p] : part.max[p];
        const float ta = expf(total.max[p] - m), pa = expf(part.max[p] - m);
        total.sum[p] = total.sum[p] * ta + part.sum[p] * pa;
        total.max[p] = m;
        float * o = total.out + p * dv;
        const float * po = part.out + p * dv;
        for (int64_t d = 0; d < dv; d += 8)
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(po + d), _mm256_set1_ps(pa),
                                                    _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(ta))));
    }
}

// the sinks' share of the softmax, the division by the sum, and the rows into dst
static void finish(const struct attn * a, const struct pair * pairs, int64_t np, int64_t iq3, struct state st) {
    struct ggml_tensor * dst = a->dst;
    for (int64_t p = 0; p < np; p++) {
        float * o = st.out + p * a->dv;
        if (a->sinks) {  // a per-head logit that takes a share of the softmax and adds no value row
            const float sink = ((const float *) a->sinks->data)[pairs[p].head];
            const float m = st.max[p] > sink ? st.max[p] : sink;
            const float alpha = expf(st.max[p] - m);
            st.sum[p] = st.sum[p] * alpha + expf(sink - m);
            for (int64_t d = 0; d < a->dv; d++)
                o[d] *= alpha;
        }
        const float inv = st.sum[p] == 0.0f ? 0.0f : 1.0f / st.sum[p];
        float * y = (float *) ((char *) dst->data +
                               (iq3 * dst->ne[2] * dst->ne[1] + pairs[p].head + pairs[p].row * dst->ne[1]) * dst->nb[1]);
        for (int64_t d = 0; d < a->dv; d++)
            y[d] = o[d] * inv;
    }
}

bool dflash_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    struct attn a = {0};
    a.q = dst->src[0];
    a.k = dst->src[1];
    a.v = dst->src[2];
    a.mask = dst->src[3];
    a.sinks = dst->src[4];
    a.dst = dst;
    a.dk = a.k->ne[0];
    a.dv = a.v->ne[0];
    a.n_kv = a.k->ne[1];
    a.n_rows = a.q->ne[1];
    a.n_head = a.q->ne[2];
    const int64_t n_seq = a.q->ne[3];
    // what decides the kernel depends on the types and head sizes, never on the number of rows
    if (a.q->type != GGML_TYPE_F32 || a.dk % 8 || a.dv % 8 || !convertible(a.k->type) || !convertible(a.v->type) ||
        (a.mask && a.mask->type != GGML_TYPE_F16) || (a.sinks && a.sinks->type != GGML_TYPE_F32) ||
        a.n_head % a.k->ne[2] || a.k->ne[2] != a.v->ne[2] || n_seq % a.k->ne[3] || a.k->ne[3] != a.v->ne[3]) {
        return false;
    }
    memcpy(&a.scale, (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&a.max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&a.softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (a.softcap != 0) {
        a.scale /= a.softcap;
    }
    a.n_head_log2 = 1u << (uint32_t) floor(log2((double) a.n_head));
    a.m0 = powf(2.0f, -(a.max_bias) / a.n_head_log2);
    a.m1 = powf(2.0f, -(a.max_bias / 2.0f) / a.n_head_log2);
    a.rk2 = a.n_head / a.k->ne[2];  // query heads per K/V head
    a.rk3 = n_seq / a.k->ne[3];

    // per thread: a block's K and V as floats and its scores, and two states (a segment's and the total), within
    // what ggml_graph_plan reserves a thread for its own tiled kernel (a function of the head sizes alone)
    const int nth = params->nth, ith = params->ith;
    const int64_t dv = a.dv;
    const size_t state_floats = FA_PAIRS * (dv + 2), scratch_floats = FA_CELLS * (a.dk + dv + FA_PAIRS + 1);
    const size_t need = scratch_floats + 2 * state_floats;
    if (need > (size_t) (64 * a.dk + 2 * 64 * 64 + 64 * dv + 64 * dv + 64 * a.dk)) {
        return false;
    }
    GGML_ASSERT(params->wsize >= nth * need * sizeof(float));
    float * scratch = (float *) params->wdata + ith * need;
    struct pair pairs[FA_PAIRS];
    int64_t kvh, iq3;

    // A row's cells go in segments of FA_SEGMENT at fixed indices, each from a fresh state, merged in order; the
    // threads share units of up to FA_PAIRS pairs of one K/V head. With few pairs (a decode step, a short verify
    // block), or units that would leave threads idle for a tenth of the time or more (SmolLM2's 3 K/V heads on 2
    // threads: a quarter), and at least a segment a thread, units are whole K/V heads and the threads share their
    // segments, keeping the states in the work buffer past the scratch. The same operations either way
    a.group = a.n_rows * a.rk2;  // pairs per K/V head: rows by the query heads that share it
    a.n_groups = n_seq * (a.n_head / a.rk2);
    const int64_t n_segs = (a.n_kv + FA_SEGMENT - 1) / FA_SEGMENT;
    int64_t per_thread = (a.group * a.n_groups + nth - 1) / nth;
    per_thread = per_thread < 1 ? 1 : per_thread > FA_PAIRS ? FA_PAIRS : per_thread;
    const int64_t units = a.n_groups * ((a.group + per_thread - 1) / per_thread);
    const int64_t rounds = (units + nth - 1) / nth;
    const bool idle = 10 * (rounds * nth - units) > rounds * nth;
    a.per_unit = a.group < FA_PAIRS ? a.group : FA_PAIRS;
    a.units_per_group = (a.group + a.per_unit - 1) / a.per_unit;
    const size_t unit_state = (size_t) a.per_unit * (dv + 2);
    const size_t shared = (size_t) a.n_groups * a.units_per_group * n_segs * unit_state;
    const size_t split_need = scratch_floats + unit_state;  // the scratch and a total state
    if ((a.group * a.n_groups <= (int64_t) nth * FA_IN_PLACE || idle) && n_segs >= nth &&
        params->wsize >= (nth * split_need + shared) * sizeof(float)) {
        scratch = (float *) params->wdata + ith * split_need;
        float * states = (float *) params->wdata + nth * split_need;
        const int64_t n_units = a.n_groups * a.units_per_group;
        // segment after segment, each unit's part of it: a cache cell's row holds all its K/V heads, so the heads of
        // one segment go together while its rows are in the CPU's caches
        for (int64_t item = ith; item < n_units * n_segs; item += nth) {
            const int64_t seg = item / n_units, u = item % n_units;
            const int64_t np = unit_pairs(&a, u, pairs, &kvh, &iq3);
            float * b = states + (u * n_segs + seg) * unit_state;
            struct state st = {b, b + a.per_unit, b + 2 * a.per_unit};
            state_init(st, np, dv);
            const int64_t end = (seg + 1) * FA_SEGMENT < a.n_kv ? (seg + 1) * FA_SEGMENT : a.n_kv;
            attend_cells(&a, pairs, np, kvh, iq3, seg * FA_SEGMENT, end, st, scratch);
        }
        ggml_barrier(params->threadpool);
        float * sbuf = scratch + scratch_floats;
        struct state total = {sbuf, sbuf + a.per_unit, sbuf + 2 * a.per_unit};
        for (int64_t u = ith; u < n_units; u += nth) {
            const int64_t np = unit_pairs(&a, u, pairs, &kvh, &iq3);
            state_init(total, np, dv);
            for (int64_t seg = 0; seg < n_segs; seg++) {
                float * b = states + (u * n_segs + seg) * unit_state;
                merge(total, (struct state) {b, b + a.per_unit, b + 2 * a.per_unit}, np, dv);
            }
            finish(&a, pairs, np, iq3, total);
        }
        return true;
    }

    a.per_unit = per_thread;  // as evenly as the threads go
    a.units_per_group = (a.group + a.per_unit - 1) / a.per_unit;
    float * sbuf = scratch + scratch_floats;
    struct state part = {sbuf, sbuf + FA_PAIRS, sbuf + 2 * FA_PAIRS};
    sbuf += state_floats;
    struct state total = {sbuf, sbuf + FA_PAIRS, sbuf + 2 * FA_PAIRS};
    for (int64_t u = ith; u < a.n_groups * a.units_per_group; u += nth) {
        const int64_t np = unit_pairs(&a, u, pairs, &kvh, &iq3);
        state_init(total, np, dv);
        for (int64_t seg = 0; seg < n_segs; seg++) {
            state_init(part, np, dv);
            const int64_t end = (seg + 1) * FA_SEGMENT < a.n_kv ? (seg + 1) * FA_SEGMENT : a.n_kv;
            attend_cells(&a, pairs, np, kvh, iq3, seg * FA_SEGMENT, end, part, scratch);
            merge(total, part, np, dv);
        }
        finish(&a, pairs, np, iq3, total);
    }
    return true;
}

#else

bool dflash_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    (void) params;
    (void) dst;
    return false;
}

#endif
