// dflash_batch_dot against ggml's vec_dot: every element of every tile of 2..16 rows bit for bit, on random rows of
// each type it has a kernel for (exit status 1 and the counts where one differs; "no kernel" where this CPU has
// none), and with "bench" the time of a 4096 x 2048 product of 16 rows both ways. Then dflash_batch_gemm the same
// way: whole products of 4..64 rows shared by 1, 2 and 3 threads ("gemm TYPE: no kernel" where it has none), and
// with "bench" a 2048 x 640 product of 512 rows (a prompt chunk through gemma-3-270m's q5_0 layers, and q4_0 and
// q4_1; q4_K 2048 x 2048).
// Then the q8_K quantizer against the reference, byte for byte. Built and run by tests/test_batch_dot.py against the
// installed llama.cpp:
//   cc -O2 -march=native -I SITE/include check_batch_dot.c -L SITE/llama_cpp/lib -lggml-cpu -lggml-base -lggml
// (batch_dot.c is in libggml-cpu, built by scripts/setup.sh).
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

bool dflash_batch_dot(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                      size_t y_stride, int ny, float * dst, size_t dst_stride);
bool dflash_batch_gemm(enum ggml_type type, int n, const void * w, size_t w_stride, int nw, const void * y,
                       size_t y_stride, int ny, float * dst, size_t dst_stride, int ith, int nth);
bool dflash_quantize_row_q8_K(const float * x, void * y, int64_t k);
void quantize_row_q8_K_ref(const float * x, void * y, int64_t k);  // ggml-base (ggml-quants.h)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

// nw random weight rows of `type` (scales varying by row) into W and ny activation rows of vt into Y, n columns each
static void random_rows(enum ggml_type type, enum ggml_type vt, int n, int nw, int ny, char * W, char * Y) {
    const size_t ws = ggml_row_size(type, n), ys = ggml_row_size(vt, n);
    float * f = malloc(sizeof(float) * n);
    for (int i = 0; i < nw; ++i) {
        float sc = (rand() % 100) / 10.0f + 0.01f;
        for (int k = 0; k < n; ++k) f[k] = sc * ((rand() / (float) RAND_MAX) * 2 - 1);
        ggml_quantize_chunk(type, f, W + i * ws, 0, 1, n, NULL);
    }
    for (int j = 0; j < ny; ++j) {
        for (int k = 0; k < n; ++k) f[k] = (rand() / (float) RAND_MAX) * 2 - 1 + (k % 7 == 0 ? 3 : 0);
        ggml_get_type_traits_cpu(vt)->from_float(f, Y + j * ys, n);
    }
    free(f);
}

// ggml's q8_K quantizer (the CPU build's, batch_dot.c's where it has one) against quantize_row_q8_K_ref, byte for
// byte: random super-blocks of many scales, and ones made to be hard (all zero, a tie for the largest magnitude, values
// that scale to halves, -0, subnormals, infinities, NaN). "q8_K: no kernel" where the build has none.
static int check_q8_K(int bench) {
    enum { BLOCKS = 64, QK = 256 };
    const size_t bs = ggml_row_size(GGML_TYPE_Q8_K, QK);
    float * x = malloc(sizeof(float) * QK * BLOCKS);
    for (int b = 0; b < BLOCKS; ++b) {
        const float sc = b % 2 ? (rand() % 1000) / 10.0f + 1e-3f : 1e-30f * (b + 1);
        for (int k = 0; k < QK; ++k) x[b * QK + k] = sc * ((rand() / (float) RAND_MAX) * 2 - 1);
    }
    float * hard = x + (BLOCKS - 8) * QK;
    memset(hard, 0, sizeof(float) * QK * 4);                       // all zero, then:
    hard[QK + 7] = 3.0f, hard[QK + 100] = -3.0f, hard[QK + 101] = 1.0f;  // a tie: the first wins
    for (int k = 0; k < QK; ++k) hard[2 * QK + k] = k % 2 ? -127.0f : 0.5f + (k % 100);  // iscale 1: exact halves
    for (int k = 0; k < QK; ++k) hard[3 * QK + k] = (k % 3 - 1) * 1e-40f * k;  // subnormals and -0
    hard[4 * QK + 3] = INFINITY;
    hard[5 * QK + 4] = NAN;
    hard[6 * QK + 0] = -INFINITY, hard[6 * QK + 1] = NAN;
    char * ref = malloc(bs * BLOCKS), * out = malloc(bs * BLOCKS);
    memset(ref, 0xab, bs * BLOCKS);
    memset(out, 0xab, bs * BLOCKS);
    quantize_row_q8_K_ref(x, ref, (int64_t) QK * BLOCKS);
    if (!dflash_quantize_row_q8_K(x, out, (int64_t) QK * BLOCKS)) {
        printf("q8_K: no kernel\n");
        free(x); free(ref); free(out);
        return 0;
    }
    int diff = 0;
    for (int b = 0; b < BLOCKS; ++b) diff += memcmp(out + b * bs, ref + b * bs, bs) != 0;
    memset(out, 0xab, bs * BLOCKS);
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x, out, (int64_t) QK * BLOCKS);  // what ggml's matmul calls
    for (int b = 0; b < BLOCKS; ++b) diff += memcmp(out + b * bs, ref + b * bs, bs) != 0;
    if (diff || bench) {
        const double t0 = now();
        for (int r = 0; r < 1000; ++r) quantize_row_q8_K_ref(x, ref, (int64_t) QK * BLOCKS);
        const double t1 = now();
        for (int r = 0; r < 1000; ++r) dflash_quantize_row_q8_K(x, out, (int64_t) QK * BLOCKS);
        const double t2 = now();
        printf("q8_K: %d of %d super-blocks differ; reference %.2f us, AVX2 %.2f us per %d values\n", diff,
               2 * BLOCKS, (t1 - t0) * 1e3, (t2 - t1) * 1e3, QK * BLOCKS);
    }
    free(x); free(ref); free(out);
    return diff;
}

int main(int argc, char ** argv) {
    int bench = argc > 1 && !strcmp(argv[1], "bench");
    ggml_cpu_init();
    enum ggml_type types[] = {GGML_TYPE_Q8_0, GGML_TYPE_Q5_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K};
    int bad = 0;
    srand(1);
    for (int t = 0; t < (int) (sizeof(types) / sizeof(types[0])); ++t) {
        enum ggml_type type = types[t];
        const struct ggml_type_traits_cpu * tw = ggml_get_type_traits_cpu(type);
        enum ggml_type vt = tw->vec_dot_type;
        int n = bench ? 2048 : (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K ? 768 : 640);
        int nw = bench ? 4096 : 64, ny = 16;
        size_t ws = ggml_row_size(type, n), ys = ggml_row_size(vt, n);
        char * W = malloc(ws * nw), * Y = malloc(ys * ny);
        random_rows(type, vt, n, nw, ny, W, Y);
        float * ref = malloc(sizeof(float) * nw * ny), * out = malloc(sizeof(float) * nw * ny);
        double t0 = now();
        int reps = bench ? 5 : 1;
        for (int r = 0; r < reps; ++r)
        for (int i0 = 0; i0 < nw; i0 += 16)
            for (int j = 0; j < ny; ++j)
                for (int i = i0; i < i0 + 16 && i < nw; ++i)
                    tw->vec_dot(n, &ref[j * nw + i], 0, W + i * ws, 0, Y + j * ys, 0, 1);
        double t1 = now();
        for (int cnt = 2; cnt <= ny; ++cnt) {
            if (bench && cnt != ny) continue;
            memset(out, 0xff, sizeof(float) * nw * ny);
            double t2 = now();
            int ok = 1;
            for (int r = 0; r < reps; ++r)
            for (int i0 = 0; i0 < nw; i0 += 16)
                ok &= dflash_batch_dot(type, n, W + i0 * ws, ws, nw - i0 < 16 ? nw - i0 : 16, Y, ys, cnt, out + i0, nw);
            double t3 = now();
            if (!ok) { printf("%s: no kernel\n", ggml_type_name(type)); break; }
            int diff = 0;
            for (int j = 0; j < cnt; ++j)
                for (int i = 0; i < nw; ++i)
                    diff += memcmp(&out[j * nw + i], &ref[j * nw + i], 4) != 0;
            bad += diff;
            if (diff || bench) {
                printf("%s rows %d: %d of %d differ; vec_dot %.2f ms, batch %.2f ms (%.2fx)\n", ggml_type_name(type),
                       cnt, diff, cnt * nw, (t1 - t0) * 1e3 / reps, (t3 - t2) * 1e3 / reps, (t1 - t0) / (t3 - t2));
            }
        }
        free(W); free(Y); free(ref); free(out);
    }
    const enum ggml_type gemm_types[] = {GGML_TYPE_Q5_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q4_K};
    for (int t = 0; t < 4; ++t) {
        const enum ggml_type type = gemm_types[t];
        const struct ggml_type_traits_cpu * tw = ggml_get_type_traits_cpu(type);
        const int n = type == GGML_TYPE_Q4_K ? (bench ? 2048 : 768) : 640, nw = bench ? 2048 : 67,
                  nmax = bench ? 512 : 64;
        const size_t ws = ggml_row_size(type, n), ys = ggml_row_size(tw->vec_dot_type, n);
        char * W = malloc(ws * nw), * Y = malloc(ys * nmax);
        random_rows(type, tw->vec_dot_type, n, nw, nmax, W, Y);
        float * ref = malloc(sizeof(float) * nw * nmax), * out = malloc(sizeof(float) * nw * nmax);
        const double t0 = now();
        for (int j = 0; j < nmax; ++j)
            for (int i = 0; i < nw; ++i)
                tw->vec_dot(n, &ref[j * nw + i], 0, W + i * ws, 0, Y + j * ys, 0, 1);
        const double t1 = now();
        const int counts[] = {4, 5, 31, 32, 33, 64, 512}, n_counts = sizeof(counts) / sizeof(counts[0]);
        for (int c = 0; c < n_counts; ++c) {
            const int cnt = counts[c];
            if (type == GGML_TYPE_Q4_K && cnt < 32) continue;  // those go to the 16-row tiles
            if (cnt > nmax || (bench && cnt != nmax)) continue;
            for (int nth = bench ? 1 : 3; nth >= 1; --nth) {  // the threads' shares, one after the other
                memset(out, 0xff, sizeof(float) * nw * nmax);
                const double t2 = now();
                int ok = 1;
                for (int ith = 0; ith < nth; ++ith)
                    ok &= dflash_batch_gemm(type, n, W, ws, nw, Y, ys, cnt, out, nw, ith, nth);
                const double t3 = now();
                if (!ok) { printf("gemm %s: no kernel\n", ggml_type_name(type)); c = n_counts; break; }
                int diff = 0;
                for (int i = 0; i < nw * cnt; ++i) diff += memcmp(&out[i], &ref[i], 4) != 0;
                bad += diff;
                if (diff || bench) {
                    printf("gemm %s rows %d, %d threads: %d of %d differ; vec_dot %.2f ms, gemm %.2f ms (%.2fx)\n",
                           ggml_type_name(type), cnt, nth, diff, cnt * nw, (t1 - t0) * 1e3, (t3 - t2) * 1e3,
                           (t1 - t0) / (t3 - t2));
                }
            }
        }
        free(W); free(Y); free(ref); free(out);
    }
    bad += check_q8_K(bench);
    printf("%s\n", bad ? "FAIL" : "all identical");
    return bad != 0;
}
