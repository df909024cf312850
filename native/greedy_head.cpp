#include "greedy_head.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define GREEDY_VNNI 1
#    include <immintrin.h>
#endif

// The bound. A logit is the real dot product of the dequantized row w and the dequantized q8_0 activation a (vec_dot
// sums exact integer products, then scales them in float: its float rounding is far below 1e-5 |w| |a| for any
// width). With the copy w' = s q and the activation requantized with one scale, a' = d q'',
//   w . a = w' . a' + (w - w') . a + w' . (a - a'),  |(w - w') . a| <= |w - w'| |a|,  |w' . (a - a')| <= |w'| |a - a'|,
// and w' . a' is an exact integer times s d. err adds 1e-3 |w| for the float rounding of both sides: upper bounds
// ub >= logit >= lb (the estimate minus the same margin), so every token whose logit could reach the largest lower
// bound, and the best estimate's exact logit, is computed exactly.
static constexpr double ROUNDING_MARGIN = 1e-3;

// The int8 pass's kernel on this CPU: 2 AVX512-VNNI, 1 AVX2, 0 none.
static int kernel() {
#ifdef GREEDY_VNNI
    static const int k = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vnni")
                             ? 2
                         : __builtin_cpu_supports("avx2") ? 1
                                                          : 0;
    return k;
#else
    return 0;
#endif
}

bool GreedyHead::fast() {
    return kernel() == 2;
}

bool GreedyHead::supported(const ggml_tensor * w) {
    if (kernel() == 0 || !w || !w->data || w->extra || ggml_n_dims(w) != 2 || !ggml_is_contiguous(w) ||
        (w->buffer && !ggml_backend_buffer_is_host(w->buffer))) {
        return false;
    }
    const bool q8_rows = w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q5_0 || w->type == GGML_TYPE_Q4_0;
    return q8_rows && ggml_get_type_traits_cpu(w->type)->vec_dot_type == GGML_TYPE_Q8_0 &&
           ggml_get_type_traits(w->type)->to_float && ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float;
}

#ifdef GREEDY_VNNI
// One row of the copy: its bytes into the tile (the row's slot of each 256-byte chunk), and the sums of squares of
// the row, of the copy and of their difference (16 float lanes; their rounding is far inside the bound's margin).
__attribute__((target("avx512f"))) static void quantize_row_512(const float * x, int n_pad, uint8_t * tile,
                                                              float & scale, double & e2, double & n2, double & w2) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n_pad; i += 16) {
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    }
    const float amax = _mm512_reduce_max_ps(m);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / s), sv = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.0f);
    __m512 e = _mm512_setzero_ps(), n = e, w = e;
    for (int i = 0; i < n_pad; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xv, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        k = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), k));  // NaN: caught below
        const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(k, _mm512_set1_ps(128.0f))));
        _mm_storeu_si128((__m128i *) (tile + 256 * (i / 64) + i % 64), b);
        const __m512 c = _mm512_mul_ps(sv, k);
        const __m512 d = _mm512_sub_ps(xv, c);
        e = _mm512_fmadd_ps(d, d, e);
        n = _mm512_fmadd_ps(c, c, n);
        w = _mm512_fmadd_ps(xv, xv, w);
    }
    scale = s;
    e2 = _mm512_reduce_add_ps(e);
    n2 = _mm512_reduce_add_ps(n);
    w2 = _mm512_reduce_add_ps(w);
}

// The same in plain code, for CPUs without AVX512 (the same bytes: rounding to nearest, ties to even).
static void quantize_row_any(const float * x, int n_pad, uint8_t * tile, float & scale, double & e2, double & n2,
                             double & w2) {
    float amax = 0.0f;
    for (int i = 0; i < n_pad; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / s;
    float e[16] = {}, n[16] = {}, w[16] = {};
    for (int i = 0; i < n_pad; ++i) {
        const float k = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inv)));
        tile[256 * (i / 64) + i % 64] = (uint8_t) (int) (k + 128.0f);
        const float c = s * k;
        const float d = x[i] - c;
        e[i % 16] += d * d;
        n[i % 16] += c * c;
        w[i % 16] += x[i] * x[i];
    }
    scale = s;
    e2 = n2 = w2 = 0.0;
    for (int l = 0; l < 16; ++l) {
        e2 += e[l];
        n2 += n[l];
        w2 += w[l];
    }
}
#endif

GreedyHead::GreedyHead(const ggml_tensor * w, int nth)
    : w(w), n_embd((int) w->ne[0]), n_vocab((int) w->ne[1]), n_pad(((int) w->ne[0] + 63) / 64 * 64),
      n_bytes((size_t) (n_vocab + 3) / 4 * 4 * n_pad), q(new uint8_t[n_bytes]) {  // written by the threads below
    for (int v = n_vocab; v % 4; ++v) {  // the last tile's missing rows: zeros
        for (int c0 = 0; c0 < n_pad; c0 += 64) {
            std::memset(&q[(size_t) (v / 4) * 4 * n_pad + 4 * c0 + 64 * (v % 4)], 128, 64);
        }
    }
    scale.resize(n_vocab);
    err.resize(n_vocab);
    norm.resize(n_vocab);
#ifdef GREEDY_VNNI
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
#    pragma omp parallel num_threads(nth)
    {
        std::vector<float> row(n_pad, 0.0f);  // padding: zeros, which add nothing
#    pragma omp for schedule(static)
        for (int v = 0; v < n_vocab; ++v) {
            to_float((const char *) w->data + (size_t) v * w->nb[1], row.data(), n_embd);
            uint8_t * tile = &q[(size_t) (v / 4) * 4 * n_pad + 64 * (v % 4)];  // dots_vnni's order
            double e2, n2, w2;
            if (kernel() == 2) {
                quantize_row_512(row.data(), n_pad, tile, scale[v], e2, n2, w2);
            } else {
                quantize_row_any(row.data(), n_pad, tile, scale[v], e2, n2, w2);
            }
            if (!std::isfinite(e2 + n2 + w2)) {  // a broken row is always computed exactly
                scale[v] = 0.0f;
                err[v] = std::numeric_limits<float>::infinity();
                norm[v] = 0.0f;
                continue;
            }
            err[v] = (float) ((std::sqrt(e2) + ROUNDING_MARGIN * std::sqrt(w2)) * (1.0 + 1e-3));
            norm[v] = (float) (std::sqrt(n2) * (1.0 + 1e-3));
        }
    }
#endif
}

#ifdef GREEDY_VNNI
// The four lanes' sums of four accumulators, in order.
__attribute__((target("avx512f,avx512bw"))) static inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i y = _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
}

// dots[j * stride + v - v0] = sum_i q[v][i] * a[j][i] for rows [v0, v1) of the copy (v0 a multiple of 4; whole tiles
// are written) and r activation rows: tiles of 4 matrix rows x 4 activation rows, every product one vpdpbusd lane.
// The copy is laid out in the order this loop reads it (tile by tile, 64 bytes of each of its 4 rows in turn), and
// prefetched: one stream.
__attribute__((target("avx512f,avx512bw,avx512vnni"), optimize("unroll-loops"))) static void dots_vnni(const uint8_t * q, int n_pad, int v0,
                                                                                 int v1, const int8_t * a, int r,
                                                                                 int32_t * dots, int stride) {
    const int nk = n_pad / 64;
    for (int v = v0; v < v1; v += 4) {
        const uint8_t * tile = q + (size_t) v * n_pad;
        for (int j = 0; j < r; j += 4) {
            const int8_t * x[4];
            for (int l = 0; l < 4; ++l) {
                x[l] = a + (size_t) std::min(j + l, r - 1) * n_pad;
            }
            __m512i c[4][4];
            for (int i = 0; i < 4; ++i) {
                for (int l = 0; l < 4; ++l) {
                    c[i][l] = _mm512_setzero_si512();
                }
            }
            for (int k = 0; k < nk; ++k) {
                const uint8_t * wk = tile + 256 * k;
                for (int b = 0; b < 256; b += 64) {
                    _mm_prefetch((const char *) wk + 2048 + b, _MM_HINT_T0);
                }
                __m512i xv[4], wv[4];
                for (int l = 0; l < 4; ++l) {
                    xv[l] = _mm512_loadu_si512(x[l] + 64 * k);
                    wv[l] = _mm512_loadu_si512(wk + 64 * l);
                }
                for (int i = 0; i < 4; ++i) {
                    for (int l = 0; l < 4; ++l) {
                        c[i][l] = _mm512_dpbusd_epi32(c[i][l], wv[i], xv[l]);
                    }
                }
            }
            for (int l = 0; l < 4 && j + l < r; ++l) {
                _mm_storeu_si128((__m128i *) &dots[(size_t) (j + l) * stride + v - v0],
                                 sum4(c[0][l], c[1][l], c[2][l], c[3][l]));
            }
        }
    }
}

#endif

#ifdef GREEDY_VNNI
// dots_vnni's result on AVX2: the copy's bytes back to signed (q - 128, within +-127) so that vpmaddubsw's pairs of
// |w| x (+-a) stay within int16 (2 x 127 x 127), plus 128 sum_i a[j][i] (off[j]), which vpdpbusd's unsigned bytes
// carry.
__attribute__((target("avx2"))) static inline __m128i sum4_avx2(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// L activation rows (1 or 2) against one tile of the copy: their 4 sums each.
template <int L>
__attribute__((target("avx2"), optimize("unroll-loops"))) static inline void tile_avx2(const uint8_t * tile, int nk,
                                                                                      const int8_t * const * x,
                                                                                      __m256i (&c)[4][2]) {
    const __m256i flip = _mm256_set1_epi8((char) 0x80), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 4; ++i) {
        c[i][0] = c[i][1] = _mm256_setzero_si256();
    }
    for (int k = 0; k < nk; ++k) {
        const uint8_t * wk = tile + 256 * k;
        _mm_prefetch((const char *) wk + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *) wk + 2048 + 128, _MM_HINT_T0);
        for (int h = 0; h < 64; h += 32) {
            __m256i xv[L];
            for (int l = 0; l < L; ++l) {
                xv[l] = _mm256_loadu_si256((const __m256i *) (x[l] + 64 * k + h));
            }
            for (int i = 0; i < 4; ++i) {
                const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (wk + 64 * i + h)), flip);
                const __m256i aw = _mm256_sign_epi8(w, w);
                for (int l = 0; l < L; ++l) {
                    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[l], w));
                    c[i][l] = _mm256_add_epi32(c[i][l], _mm256_madd_epi16(p, ones));
                }
            }
        }
    }
}

__attribute__((target("avx2"))) static void dots_avx2(const uint8_t * q, int n_pad, int v0, int v1, const int8_t * a,
                                                     int r, const int32_t * off, int32_t * dots, int stride) {
    const int nk = n_pad / 64;
    for (int v = v0; v < v1; v += 4) {
        const uint8_t * tile = q + (size_t) v * n_pad;
        for (int j = 0; j < r; j += 2) {
            const int8_t * x[2] = {a + (size_t) j * n_pad, a + (size_t) std::min(j + 1, r - 1) * n_pad};
            __m256i c[4][2];
            if (j + 1 < r) {
                tile_avx2<2>(tile, nk, x, c);
            } else {
                tile_avx2<1>(tile, nk, x, c);
            }
            for (int l = 0; l < 2 && j + l < r; ++l) {
                const __m128i s =
                    _mm_add_epi32(sum4_avx2(c[0][l], c[1][l], c[2][l], c[3][l]), _mm_set1_epi32(off[j + l]));
                _mm_storeu_si128((__m128i *) &dots[(size_t) (j + l) * stride + v - v0], s);
            }
        }
    }
}
#endif

// Add x to the min-heap h of the k largest values seen.
template <class T> static void keep_largest(std::vector<T> & h, const T & x, int k) {
    h.push_back(x);
    std::push_heap(h.begin(), h.end(), std::greater<T>());
    if ((int) h.size() > k) {
        std::pop_heap(h.begin(), h.end(), std::greater<T>());
        h.pop_back();
    }
}

void GreedyHead::top(const float * x, int r, int nth, const int * k, const std::vector<int32_t> * forced, Top * out) {
    const ggml_type_traits_cpu * tq = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    const ggml_to_float_t dequant = ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float;
    const size_t xrow = ggml_row_size(GGML_TYPE_Q8_0, n_embd);
    std::vector<char> xq((size_t) r * xrow);  // the rows as vec_dot reads them
    std::vector<int8_t> a((size_t) r * n_pad, 0);
    std::vector<float> d(r), na(r), ea(r), ad(n_embd);
    std::vector<int32_t> sum(r), off(r);
    bool finite = true;
    for (int j = 0; j < r; ++j) {
        tq->from_float(x + (size_t) j * n_embd, &xq[j * xrow], n_embd);
        dequant(&xq[j * xrow], ad.data(), n_embd);
        float amax = 0.0f;
        bool row_finite = true;
        for (float v : ad) {
            row_finite = row_finite && std::isfinite(v);
            amax = std::max(amax, std::fabs(v));
        }
        if (!row_finite) {  // every row still converted: the exact pass below reads them all
            finite = false;
            continue;
        }
        d[j] = amax > 0.0f ? amax / 127.0f : 1.0f;
        double n2 = 0.0, e2 = 0.0;
        int32_t s = 0;
        for (int i = 0; i < n_embd; ++i) {
            const int q8 = std::clamp((int) std::lround(ad[i] / d[j]), -127, 127);
            a[(size_t) j * n_pad + i] = (int8_t) q8;
            s += q8;
            const double c = (double) d[j] * q8;
            n2 += (double) ad[i] * ad[i];
            e2 += (ad[i] - c) * (ad[i] - c);
        }
        sum[j] = s;
        off[j] = 128 * s;
        na[j] = (float) (std::sqrt(n2) * (1.0 + 1e-6));
        ea[j] = (float) (std::sqrt(e2) * (1.0 + 1e-6));
    }
    const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(w->type)->vec_dot;
    auto exact = [&](int v, int j) {
        float out;
        vec_dot(n_embd, &out, 0, (const char *) w->data + (size_t) v * w->nb[1], 0, &xq[j * xrow], 0, 1);
        return out;
    };
    for (int j = 0; j < r; ++j) {
        out[j].clear();
    }
    if (!finite) {
        for (int j = 0; j < r; ++j) {
            out[j].resize(n_vocab);
        }
#pragma omp parallel for num_threads(nth) schedule(static)
        for (int v = 0; v < n_vocab; ++v) {
            for (int j = 0; j < r; ++j) {
                out[j][v] = {v, exact(v, j)};
            }
        }
        return;
    }
#ifndef GREEDY_VNNI
    throw std::logic_error("the greedy head has no kernel on this CPU");
#else
    auto is_forced = [&](int j, int v) {
        return forced && std::binary_search(forced[j].begin(), forced[j].end(), v);
    };
    auto argmax_row = [&](int j) { return k[j] == 1 && (!forced || forced[j].empty()); };
    auto bounds = [&](int t) {  // thread t's rows of the matrix, in whole tiles
        return t == nth ? n_vocab : (int) ((int64_t) n_vocab * t / nth) / 4 * 4;
    };
    const bool vnni = kernel() == 2;
    // pass 1, per thread and row: the k largest lower bounds so far, of tokens not forced (a min-heap; greedy: the
    // largest, lo), the tokens whose upper bound reaches the k-th of them when seen (with that bound), and the tokens
    // with the k largest estimates (greedy: the largest)
    std::vector<std::vector<std::pair<int, float>>> seen((size_t) nth * r);
    std::vector<float> low((size_t) nth * r, -INFINITY);
    std::vector<std::vector<float>> heaps((size_t) nth * r);
    std::vector<std::vector<std::pair<float, int>>> top_est((size_t) nth * r);
    std::vector<std::pair<float, int>> best((size_t) nth * r, {-INFINITY, 0});
#    pragma omp parallel for num_threads(nth) schedule(static, 1)
    for (int t = 0; t < nth; ++t) {
        constexpr int CHUNK = 256;
        std::vector<int32_t> dots((size_t) CHUNK * r);
        std::vector<float> est(CHUNK), ub(CHUNK), lb(CHUNK);
        for (int c0 = bounds(t); c0 < bounds(t + 1); c0 += CHUNK) {
            const int c1 = std::min(c0 + CHUNK, bounds(t + 1));
            if (vnni) {
                dots_vnni(q.get(), n_pad, c0, c1, a.data(), r, dots.data(), CHUNK);
            } else {
                dots_avx2(q.get(), n_pad, c0, c1, a.data(), r, off.data(), dots.data(), CHUNK);
            }
            for (int j = 0; j < r; ++j) {
                const int32_t * dj = &dots[(size_t) j * CHUNK];
                float top = -INFINITY;
                float lo = low[(size_t) t * r + j];
                for (int v = c0; v < c1; ++v) {
                    const float e = (float) (dj[v - c0] - off[j]) * (scale[v] * d[j]);
                    const float margin = err[v] * na[j] + norm[v] * ea[j];  // NaN for a broken row: kept below
                    est[v - c0] = e;
                    ub[v - c0] = e + margin;
                    lb[v - c0] = e - margin;
                    top = std::max(top, e);
                }
                if (argmax_row(j)) {
                    for (int v = c0; v < c1; ++v) {
                        lo = lb[v - c0] > lo ? lb[v - c0] : lo;
                    }
                } else {
                    auto & h = heaps[(size_t) t * r + j];
                    auto & te = top_est[(size_t) t * r + j];
                    float elo = (int) te.size() == k[j] ? te.front().first : -INFINITY;
                    float lb_max = -INFINITY;
                    for (int v = c0; v < c1; ++v) {
                        lb_max = lb[v - c0] > lb_max ? lb[v - c0] : lb_max;
                    }
                    // once the heaps are full, most chunks have nothing above them: a vectorized max says so
                    for (int v = c0; (lb_max > lo || top > elo) && v < c1; ++v) {
                        if (lb[v - c0] > lo && !is_forced(j, v)) {
                            keep_largest(h, lb[v - c0], k[j]);
                            lo = (int) h.size() == k[j] ? h.front() : -INFINITY;
                        }
                        if (est[v - c0] > elo && !is_forced(j, v)) {
                            keep_largest(te, {est[v - c0], v}, k[j]);
                            elo = (int) te.size() == k[j] ? te.front().first : -INFINITY;
                        }
                    }
                }
                low[(size_t) t * r + j] = lo;
                auto & keep = seen[(size_t) t * r + j];
                for (int v = c0; v < c1; ++v) {
                    if (!(ub[v - c0] < lo) && !is_forced(j, v)) {
                        keep.push_back({v, ub[v - c0]});
                    }
                }
                auto & b = best[(size_t) t * r + j];
                if (top > b.first) {
                    b = {top, c0 + (int) (std::find(est.begin(), est.begin() + (c1 - c0), top) - est.begin())};
                }
            }
        }
    }
    // the threshold: the k-th largest lower bound over all threads, or where larger the k-th largest exact logit of
    // the k best estimates (greedy: the best estimate's); a token not forced whose upper bound is below it has k
    // tokens above it
    std::vector<float> floor(r);
    for (int j = 0; j < r; ++j) {
        if (argmax_row(j)) {
            std::pair<float, int> b = best[j];
            float lo = low[j];
            for (int t = 1; t < nth; ++t) {
                b = std::max(b, best[(size_t) t * r + j]);
                lo = std::max(lo, low[(size_t) t * r + j]);
            }
            const float e = exact(b.second, j);
            floor[j] = e > lo ? e : lo;
            continue;
        }
        std::vector<float> all;
        for (int t = 0; t < nth; ++t) {
            all.insert(all.end(), heaps[(size_t) t * r + j].begin(), heaps[(size_t) t * r + j].end());
        }
        floor[j] = -INFINITY;
        if ((int) all.size() >= k[j]) {
            std::nth_element(all.begin(), all.begin() + (k[j] - 1), all.end(), std::greater<float>());
            floor[j] = all[k[j] - 1];
        }
        std::vector<std::pair<float, int>> ests;
        for (int t = 0; t < nth; ++t) {
            ests.insert(ests.end(), top_est[(size_t) t * r + j].begin(), top_est[(size_t) t * r + j].end());
        }
        if ((int) ests.size() >= k[j]) {
            std::nth_element(ests.begin(), ests.begin() + (k[j] - 1), ests.end(),
                             std::greater<std::pair<float, int>>());
            std::vector<float> ex;
            for (int i = 0; i < k[j]; ++i) {
                const float e = exact(ests[i].second, j);
                if (std::isfinite(e)) {
                    ex.push_back(e);
                }
            }
            if ((int) ex.size() == k[j]) {
                const float kth = *std::min_element(ex.begin(), ex.end());
                floor[j] = kth > floor[j] ? kth : floor[j];
            }
        }
    }
    // pass 2: the exact logits of the tokens whose bound reaches it (NaN bounds included); the threads' tokens in
    // order, thread after thread
    std::vector<Top> kept((size_t) nth * r);
#    pragma omp parallel for num_threads(nth) schedule(static, 1)
    for (int t = 0; t < nth; ++t) {
        for (int j = 0; j < r; ++j) {
            for (const auto & [v, u] : seen[(size_t) t * r + j]) {
                if (!(u < floor[j])) {
                    kept[(size_t) t * r + j].push_back({v, exact(v, j)});
                }
            }
        }
    }
    for (int j = 0; j < r; ++j) {
        for (int t = 0; t < nth; ++t) {
            const auto & kt = kept[(size_t) t * r + j];
            out[j].insert(out[j].end(), kt.begin(), kt.end());
        }
        if (forced && !forced[j].empty()) {
            for (int32_t v : forced[j]) {
                out[j].push_back({v, exact(v, j)});
            }
            std::sort(out[j].begin(), out[j].end());
        }
    }
#endif
}

// The first token with the largest logit, as std::max_element finds it in the row compute() gives: a token below
// the largest never changes what it finds, whatever else the row holds.
void GreedyHead::argmax(const float * x, int32_t * tokens, int r, int nth) {
    std::vector<Top> rows(r);
    const std::vector<int> ones(r, 1);
    top(x, r, nth, ones.data(), nullptr, rows.data());
    for (int j = 0; j < r; ++j) {
        int best = 0;
        float top = -INFINITY;  // token 0's, unless it is a candidate
        for (const auto & [v, e] : rows[j]) {
            if (v == 0) {  // where std::max_element starts
                top = e;
            } else if (top < e) {
                best = v;
                top = e;
            }
        }
        tokens[j] = best;
    }
}
