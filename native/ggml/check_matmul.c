// ggml's CPU matmul, batch invariance end to end: for each weight type, a product of k activation rows (k = 2 .. 512)
// computed through ggml's own graph, with the threads a session uses, must give every row the bits of that row's
// product alone, whichever kernel ggml picks for each (sgemm, batch_dot.c, vec_dot). Also the attention's shape: f16
// weights shared by 4 heads' rows (grouped-query attention), whose rows must also each be their own head's product.
// Prints the rows that differ per type and count; exit status 1 where any does. With "bench", the time of a decode
// step's two attention products at 4096 cells instead. Built and run by tests/test_batch_dot.py against the installed
// llama.cpp:
//   cc -O2 -march=native -I SITE/include check_matmul.c -L SITE/llama_cpp/lib -lggml-cpu -lggml-base -lggml
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

static int n_threads = 2;

// dst [m, n, heads] = W [k, m] x X [k, n, heads], by ggml's graph on the CPU
static void matmul(enum ggml_type type, const char * w, int k, int m, const float * x, int n, int heads, float * dst) {
    const size_t bytes = ggml_row_size(type, k) * m + sizeof(float) * (size_t) (k * 2 + m) * n * heads;
    struct ggml_init_params ip = {(size_t) 64 * 1024 * 1024 + bytes, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(ctx, type, k, m);
    memcpy(W->data, w, ggml_nbytes(W));
    struct ggml_tensor * X = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n, heads);
    memcpy(X->data, x, ggml_nbytes(X));
    struct ggml_tensor * Y = ggml_mul_mat(ctx, W, X);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, Y);
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "compute failed\n");
        exit(2);
    }
    memcpy(dst, Y->data, sizeof(float) * (size_t) m * n * heads);
    ggml_free(ctx);
}

// microseconds per product of an f16 [k, m] slice and one token's rows of 4 heads (a decode step: k = head size and m
// = cells for K x Q, the other way round for V x softmax)
static double attention_us(int k, int m) {
    struct ggml_init_params ip = {(size_t) 16 * 1024 * 1024 + (size_t) k * m * 2, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, k, m);
    struct ggml_tensor * X = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, 4);
    for (int64_t i = 0; i < (int64_t) k * m; ++i) ((ggml_fp16_t *) W->data)[i] = ggml_fp32_to_fp16(rand() / (float) RAND_MAX - 0.5f);
    for (int i = 0; i < k * 4; ++i) ((float *) X->data)[i] = rand() / (float) RAND_MAX - 0.5f;
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ggml_mul_mat(ctx, W, X));
    struct ggml_cplan plan = ggml_graph_plan(gf, n_threads, NULL);
    plan.work_data = malloc(plan.work_size + 64);
    const int reps = 1000;
    struct timespec t0, t1;
    for (int i = 0; i < reps / 10; ++i) ggml_graph_compute(gf, &plan);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < reps; ++i) ggml_graph_compute(gf, &plan);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(plan.work_data);
    ggml_free(ctx);
    return ((t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3) / reps;
}

int main(int argc, char ** argv) {
    if (argc > 1) n_threads = atoi(argv[1]);
    setenv("GGML_CPU_TILED_MM", "0", 0);  // as dflash-local's sessions set it (native/bindings.cpp)
    ggml_cpu_init();
    if (argc > 2 && !strcmp(argv[2], "bench")) {
        printf("decode step's attention, 4 heads, 4096 cells, %d threads: K x Q %.1f us, V x softmax %.1f us\n",
               n_threads, attention_us(256, 4096), attention_us(4096, 256));
        return 0;
    }
    const enum ggml_type types[] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q5_0,
                                    GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
                                    GGML_TYPE_Q6_K};
    const int counts[] = {2, 3, 4, 5, 8, 16, 17, 64, 512};
    int bad = 0;
    srand(1);
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); ++t) {
        const enum ggml_type type = types[t];
        for (int heads = 1; heads <= 4; heads += 3) {
            if (heads > 1 && type != GGML_TYPE_F16) continue;  // the attention's products: f16 cache x f32 rows
            const int k = 768, m = 99, nmax = 512;  // 99: tiles of weight rows end short
            float * f = malloc(sizeof(float) * (size_t) k * m);
            for (int i = 0; i < k * m; ++i) f[i] = ((rand() / (float) RAND_MAX) * 2 - 1) * (1 + (i / k) % 5);
            char * w = malloc(ggml_row_size(type, k) * m);
            ggml_quantize_chunk(type, f, w, 0, m, k, NULL);
            float * x = malloc(sizeof(float) * (size_t) k * nmax * heads);
            for (int i = 0; i < k * nmax * heads; ++i) {
                x[i] = (rand() / (float) RAND_MAX) * 2 - 1 + (i % 7 == 0 ? 3 : 0);
            }
            float * one = malloc(sizeof(float) * m * heads), * all = malloc(sizeof(float) * (size_t) m * nmax * heads);
            float * xr = malloc(sizeof(float) * k * heads);
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); ++c) {
                const int n = counts[c];
                float * xb = malloc(sizeof(float) * (size_t) k * n * heads);
                for (int h = 0; h < heads; ++h) {
                    memcpy(xb + (size_t) h * k * n, x + (size_t) h * k * nmax, sizeof(float) * k * n);
                }
                matmul(type, w, k, m, xb, n, heads, all);
                int diff = 0;
                for (int j = 0; j < n; ++j) {
                    for (int h = 0; h < heads; ++h) {
                        memcpy(xr + h * k, x + (size_t) h * k * nmax + (size_t) j * k, sizeof(float) * k);
                    }
                    matmul(type, w, k, m, xr, 1, heads, one);
                    for (int h = 0; h < heads; ++h)
                        diff += memcmp(one + h * m, all + (size_t) h * m * n + (size_t) j * m, sizeof(float) * m) != 0;
                    for (int h = 0; heads > 1 && h < heads; ++h) {  // each head's row is its own product
                        for (int i = 0; i < m; ++i) {
                            double want = 0, scale = 0;
                            for (int l = 0; l < k; ++l) {
                                const double t = ggml_fp16_to_fp32(((const ggml_fp16_t *) w)[(size_t) i * k + l]) *
                                                 ggml_fp16_to_fp32(ggml_fp32_to_fp16(xr[h * k + l]));
                                want += t;
                                scale += fabs(t);
                            }
                            if (fabs(one[h * m + i] - want) > 1e-5 * scale) {
                                printf("f16 x%d heads: head %d, element %d is %g, not %g\n", heads, h, i,
                                       one[h * m + i], want);
                                diff++;
                                i = m;
                            }
                        }
                    }
                }
                free(xb);
                if (diff) {
                    printf("%s x%d heads, %d rows: %d of %d rows differ from the row alone\n", ggml_type_name(type),
                           heads, n, diff, n * heads);
                }
                bad += diff;
            }
            free(f); free(w); free(x); free(one); free(all); free(xr);
        }
    }
    printf("%s\n", bad ? "FAIL" : "all identical");
    return bad != 0;
}
