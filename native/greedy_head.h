// The LM head of a row whose sampler reads only its top: a greedy row its argmax, a top-k row its K largest logits.
// On a CPU the exact logits of a 262k-token vocabulary cost as much as the rest of a verify row. An int8 copy of the
// output matrix with one scale per row gives every logit within a bound (Cauchy-Schwarz on the roundings of the
// matrix and of the activation); only the tokens whose upper bound reaches the K-th largest lower bound (greedy: the
// best exact logit found) get their exact logit, from ggml's vec_dot, the bits of the full head. Their logits and
// -inf elsewhere: the row's argmax, or top K, is the full row's, ties included (docs/lossless.md).

#pragma once

#include "ggml.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

class GreedyHead {
public:
    // Matrices whose vec_dot meets q8_0 activations (q8_0, q5_0, q4_0: integer sums times the two scales), on x86
    // CPUs with AVX512-VNNI or AVX2; host memory.
    static bool supported(const ggml_tensor * w);
    // Whether the int8 pass runs on AVX512-VNNI, which it pays on wherever the head is large; on AVX2 only, it
    // takes three instructions for VNNI's one.
    static bool fast();
    GreedyHead(const ggml_tensor * w, int nth);  // builds the copy: n_vocab x n_embd bytes
    // For r final-norm rows x [r, n_embd], row j's exact logit of every token that could be among its k[j] largest
    // and of the tokens forced[j] (sorted; those whose logits a sampler's controls change), in token order (a row with
    // a value that is not finite: every token); every other token has k[j] tokens above it. forced may be null.
    using Top = std::vector<std::pair<int32_t, float>>;
    void top(const float * x, int r, int nth, const int * k, const std::vector<int32_t> * forced, Top * out);
    // The argmax of each row's logits (the first of equal ones), the full head's, with no row written: what a greedy
    // sampler takes from a row.
    void argmax(const float * x, int32_t * tokens, int r, int nth);
    size_t bytes() const { return n_bytes + 3 * scale.size() * sizeof(float); }

private:
    const ggml_tensor * w;
    int n_embd, n_vocab, n_pad;  // n_pad: n_embd rounded up to 64 bytes
    size_t n_bytes;
    std::unique_ptr<uint8_t[]> q;  // [n_vocab, n_pad]: round(row / scale) + 128, padding 128, in tiles of 4 rows
    std::vector<float> scale;    // per row: its largest |value| / 127
    std::vector<float> err;      // per row: |row - scale q| plus a margin for float rounding (see greedy_head.cpp)
    std::vector<float> norm;     // per row: |scale q|

};
