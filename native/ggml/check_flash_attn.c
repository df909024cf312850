// ggml's CPU flash attention, batch invariance end to end: a batch of n query rows (n = 1 .. 512) over a cache of
// f16 or q8_0 cells, computed through ggml's own graph with the threads a session uses, must give every row the bits
// of that row alone over a cache that holds only the cells up to its own (a one-token decode), with causal and
// sliding-window masks, grouped-query heads and a soft cap. Each row is also checked against a double-precision
// softmax of the same cells. Prints what differs; exit status 1 where anything does. With "bench", the time of a
// decode step and of a 512-row prompt chunk at 4096 cells instead. Built and run by tests/test_batch_dot.py:
//   cc -O2 -march=native -I SITE/include check_flash_attn.c -L SITE/llama_cpp/lib -lggml-cpu -lggml-base -lggml
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

static int n_threads = 2;

struct shape {
    int dk, dv, n_head, n_head_kv, window;  // window 0: causal over the whole cache
    float softcap;
};

struct cache {
    struct shape s;
    enum ggml_type type;
    int n_cells;
    char * k, * v;  // n_cells rows of each head, in the cache's type
};

static float frand(void) { return rand() / (float) RAND_MAX * 2 - 1; }

static int visible(const struct shape * s, int cell, int pos) {
    return cell <= pos && (s->window == 0 || cell > pos - s->window);
}

// out [dv, n_head, n] = attention of the n rows of q (at positions pos[0..n)) over the first n_kv cells
static void attend(const struct cache * c, int n_kv, const float * q, const int * pos, int n, float * out,
                   double * us) {
    const struct shape * s = &c->s;
    const size_t kbytes = ggml_row_size(c->type, s->dk), vbytes = ggml_row_size(c->type, s->dv);
    struct ggml_init_params ip = {(size_t) 64 * 1024 * 1024 + (size_t) n_kv * s->n_head_kv * (kbytes + vbytes) +
                                      sizeof(float) * (size_t) n * s->n_head * (s->dk + s->dv) + 2 * (size_t) n_kv * n,
                                  NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * Q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, s->dk, n, s->n_head);
    struct ggml_tensor * K = ggml_new_tensor_3d(ctx, c->type, s->dk, n_kv, s->n_head_kv);
    struct ggml_tensor * V = ggml_new_tensor_3d(ctx, c->type, s->dv, n_kv, s->n_head_kv);
    struct ggml_tensor * M = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    for (int h = 0; h < s->n_head; h++)
        for (int i = 0; i < n; i++)
            memcpy((char *) Q->data + h * Q->nb[2] + i * Q->nb[1], q + ((size_t) h * n + i) * s->dk, s->dk * 4);
    for (int h = 0; h < s->n_head_kv; h++) {
        memcpy((char *) K->data + h * K->nb[2], c->k + (size_t) h * c->n_cells * kbytes, n_kv * kbytes);
        memcpy((char *) V->data + h * V->nb[2], c->v + (size_t) h * c->n_cells * vbytes, n_kv * vbytes);
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n_kv; j++)
            ((ggml_fp16_t *) M->data)[(size_t) i * n_kv + j] = ggml_fp32_to_fp16(visible(s, j, pos[i]) ? 0 : -INFINITY);
    struct ggml_tensor * Y = ggml_flash_attn_ext(ctx, Q, K, V, M, 1.0f / sqrtf((float) s->dk), 0.0f, s->softcap);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, Y);
    struct ggml_cplan plan = ggml_graph_plan(gf, n_threads, NULL);
    plan.work_data = malloc(plan.work_size + 64);
    const int reps = us ? (n == 1 ? 200 : 5) : 1;
    struct timespec t0, t1;
    ggml_graph_compute(gf, &plan);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 1; r < reps; r++) ggml_graph_compute(gf, &plan);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (us) *us = ((t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3) / (reps - 1);
    memcpy(out, Y->data, sizeof(float) * (size_t) s->dv * s->n_head * n);
    free(plan.work_data);
    ggml_free(ctx);
}

static struct cache new_cache(struct shape s, enum ggml_type type, int n_cells) {
    struct cache c = {s, type, n_cells, NULL, NULL};
    const int rows = n_cells * s.n_head_kv;
    float * f = malloc(sizeof(float) * (size_t) rows * (s.dk > s.dv ? s.dk : s.dv));
    c.k = malloc(ggml_row_size(type, s.dk) * rows);
    c.v = malloc(ggml_row_size(type, s.dv) * rows);
    for (size_t i = 0; i < (size_t) rows * s.dk; i++) f[i] = frand() * (1 + i % 3);
    ggml_quantize_chunk(type, f, c.k, 0, rows, s.dk, NULL);
    for (size_t i = 0; i < (size_t) rows * s.dv; i++) f[i] = frand();
    ggml_quantize_chunk(type, f, c.v, 0, rows, s.dv, NULL);
    free(f);
    return c;
}

// the largest difference of a row's outputs from a double-precision softmax of the same cells, relative to the
// largest output
static double error(const struct cache * c, const float * q, int pos, const float * out) {
    const struct shape * s = &c->s;
    float * kf = malloc(sizeof(float) * s->dk), * vf = malloc(sizeof(float) * s->dv);
    double * acc = malloc(sizeof(double) * s->dv), * w = malloc(sizeof(double) * c->n_cells);
    const ggml_to_float_t to_float = ggml_get_type_traits(c->type)->to_float;
    double worst = 0, largest = 1e-30;
    for (int h = 0; h < s->n_head; h++) {
        const int kvh = h / (s->n_head / s->n_head_kv);
        double m = -INFINITY, sum = 0;
        for (int j = 0; j <= pos; j++) {
            w[j] = -INFINITY;
            if (!visible(s, j, pos)) continue;
            to_float(c->k + ((size_t) kvh * c->n_cells + j) * ggml_row_size(c->type, s->dk), kf, s->dk);
            double d = 0;
            for (int l = 0; l < s->dk; l++) d += (double) q[(size_t) h * s->dk + l] * kf[l];
            d /= sqrt((double) s->dk);
            if (s->softcap != 0) d = s->softcap * tanh(d / s->softcap);
            w[j] = d;
            m = d > m ? d : m;
        }
        memset(acc, 0, sizeof(double) * s->dv);
        for (int j = 0; j <= pos; j++) {
            if (w[j] == -INFINITY) continue;
            const double e = exp(w[j] - m);
            sum += e;
            to_float(c->v + ((size_t) kvh * c->n_cells + j) * ggml_row_size(c->type, s->dv), vf, s->dv);
            for (int l = 0; l < s->dv; l++) acc[l] += e * vf[l];
        }
        for (int l = 0; l < s->dv; l++) {
            const double want = acc[l] / sum, got = out[(size_t) h * s->dv + l];
            worst = fabs(got - want) > worst ? fabs(got - want) : worst;
            largest = fabs(want) > largest ? fabs(want) : largest;
        }
    }
    free(kf); free(vf); free(acc); free(w);
    return worst / largest;
}

int main(int argc, char ** argv) {
    if (argc > 1) n_threads = atoi(argv[1]);
    ggml_cpu_init();
    srand(1);
    if (argc > 2 && !strcmp(argv[2], "bench")) {
        const struct shape s = {256, 256, 4, 1, 0, 0.0f};  // gemma-3's full-attention layers
        const int n_kv = 4096, n = 512;
        struct cache c = new_cache(s, GGML_TYPE_F16, n_kv);
        float * q = malloc(sizeof(float) * s.dk * s.n_head * n), * out = malloc(sizeof(float) * s.dv * s.n_head * n);
        int * pos = malloc(sizeof(int) * n);
        for (int i = 0; i < s.dk * s.n_head * n; i++) q[i] = frand();
        for (int i = 0; i < n; i++) pos[i] = n_kv - n + i;
        double step, chunk;
        attend(&c, n_kv, q, pos + n - 1, 1, out, &step);
        attend(&c, n_kv, q, pos, n, out, &chunk);
        printf("flash attention, 4 heads of 256, 4096 cells, %d threads: a decode step %.1f us, a 512-row chunk "
               "%.1f ms\n", n_threads, step, chunk / 1000);
        const struct shape smol = {64, 64, 9, 3, 0, 0.0f};  // SmolLM2-135M: 9 query heads on 3 K/V heads
        struct cache cs = new_cache(smol, GGML_TYPE_F16, n_kv);
        attend(&cs, n_kv, q, pos + n - 1, 1, out, &step);
        attend(&cs, n_kv, q, pos, n, out, &chunk);
        printf("flash attention, 9 heads of 64 on 3 K/V heads, 4096 cells, %d threads: a decode step %.1f us, a "
               "512-row chunk %.1f ms\n", n_threads, step, chunk / 1000);
        return 0;
    }
    const struct shape shapes[] = {
        {256, 256, 4, 1, 0, 0.0f},    // gemma-3: 4 query heads on one K/V head
        {256, 256, 4, 1, 300, 0.0f},  // its sliding-window layers
        {128, 128, 8, 2, 0, 0.0f},    // a Qwen3: 2 K/V heads
        {64, 64, 2, 2, 0, 30.0f},     // a soft cap (gemma-2), one query head a K/V head
        {64, 64, 9, 3, 0, 0.0f},      // SmolLM2: 3 K/V heads, which 2 threads share by segments
    };
    const enum ggml_type types[] = {GGML_TYPE_F16, GGML_TYPE_Q8_0};
    const int counts[] = {2, 3, 8, 33, 64, 512};
    const int n_kv = 1100;  // not a whole number of 64-cell blocks
    int bad = 0;
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
            const struct shape * s = &shapes[si];
            struct cache c = new_cache(*s, types[ti], n_kv);
            const int nmax = 512, qrow = s->dk * s->n_head;
            float * q = malloc(sizeof(float) * (size_t) qrow * nmax);
            for (size_t i = 0; i < (size_t) qrow * nmax; i++) q[i] = frand() * 2;
            float * all = malloc(sizeof(float) * (size_t) s->dv * s->n_head * nmax);
            float * one = malloc(sizeof(float) * s->dv * s->n_head), * qr = malloc(sizeof(float) * qrow);
            int * pos = malloc(sizeof(int) * nmax);
            double worst = 0;
            for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
                const int n = counts[ci];
                for (int i = 0; i < n; i++) pos[i] = n_kv - n - 7 + i;  // the last 7 cells: a later row's, masked
                float * qb = malloc(sizeof(float) * (size_t) qrow * n);
                for (int h = 0; h < s->n_head; h++)
                    for (int i = 0; i < n; i++)
                        memcpy(qb + ((size_t) h * n + i) * s->dk, q + ((size_t) i * s->n_head + h) * s->dk,
                               sizeof(float) * s->dk);
                attend(&c, n_kv, qb, pos, n, all, NULL);
                int diff = 0;
                for (int i = 0; i < n; i++) {
                    // the row alone, over a cache that ends at its own cell
                    attend(&c, pos[i] + 1, q + (size_t) i * qrow, &pos[i], 1, one, NULL);
                    diff += memcmp(one, all + (size_t) i * s->dv * s->n_head, sizeof(float) * s->dv * s->n_head) != 0;
                    if (i % 37 == 0 || i == n - 1) {
                        const double e = error(&c, q + (size_t) i * qrow, pos[i], one);
                        worst = e > worst ? e : worst;
                    }
                }
                free(qb);
                if (diff) {
                    printf("%s, %d of 256 heads %d/%d window %d, %d rows: %d rows differ from the row alone\n",
                           ggml_type_name(types[ti]), s->dk, s->n_head, s->n_head_kv, s->window, n, diff, n);
                }
                bad += diff;
            }
            if (worst > 1e-4) {
                printf("%s, heads of %d: a row differs from a double-precision softmax by %g of its largest value\n",
                       ggml_type_name(types[ti]), s->dk, worst);
                bad++;
            }
            free(q); free(all); free(one); free(qr); free(pos); free(c.k); free(c.v);
        }
    }
    printf("%s\n", bad ? "FAIL" : "all identical");
    return bad != 0;
}
