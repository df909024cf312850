// Sampling: the parameters, the one uniform number per generated token, sample_row (llama.cpp's top-k, top-p,
// min-p and temperature, bit for bit); Sampler, one generation's sampling state (penalties, logit biases, a grammar,
// logprobs, rejection sampling); draw_tempered for sampled drafts. sample_row.cpp holds the ranked-selection math,
// sampler.cpp the Sampler.

#pragma once

#include "model.h"

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

// Sampling. Every generated token k draws one uniform number u_k = hash(seed, k), whatever the draft length, so a
// speculative run and a plain run with the same seed sample the same tokens: verification stays exact when sampling.

struct Sampling {
    float    temperature = 0.0f;
    int      top_k       = 0;
    float    top_p       = 1.0f;
    float    min_p       = 0.0f;
    uint64_t seed        = 0;
};

double uniform(uint64_t seed, uint64_t index);
llama_token argmax(const float * logits, int n);

using Candidate = std::pair<float, llama_token>;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define DFLASH_AVX2 1  // the vocabulary-wide float pass is also compiled for AVX2 + FMA, picked at run time
#    define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#    define ALWAYS_INLINE inline
#endif

// exp(x) for -87 <= x <= 0 in float, in a form the compiler vectorizes: x = k ln 2 + r (k rounded in the low mantissa
// bits of a float), exp(r) by its Taylor polynomial, k added to the exponent bits. Relative error below 3.4e-6, with
// or without FMA (measured against the double exp of every float in [-87, 0]). In the header: Session::decode_rows
// uses it too.
static ALWAYS_INLINE float exp_approx(float x) {
    const float big = 0x1.8p23f;
    const float kf  = x * 1.44269504f + big;
    const float k   = kf - big;
    const float r   = (x - k * 0x1.62e400p-1f) - k * 0x1.7f7d1cp-20f;  // ln 2 in two parts: k * hi is exact
    float p = 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t kb, pb;
    std::memcpy(&kb, &kf, sizeof(kb));
    std::memcpy(&pb, &p, sizeof(pb));
    pb += kb << 23;  // k is two's complement in the low bits: adds k to the exponent
    float out;
    std::memcpy(&out, &pb, sizeof(out));
    return out;
}

llama_token sample_row(const float * logits, int n_vocab, const Sampling & s, uint64_t index,
                       std::vector<Candidate> & cand);
void logit_range(const float * logits, int n, float & lo, float & hi);  // a row's smallest and largest logit
double temper(float logit, float lmax, float temperature);              // exp((logit - lmax) / temperature)

// ---------------------------------------------------------------------------------------------------------------
// Sampler: one generation's sampling state. Besides the Sampling parameters it holds the controls llama.cpp's common
// sampler applies before them (a grammar, logit biases, repetition penalties over a window of recent tokens) and
// their state. It only ever takes in emitted tokens: the prompt (penalties only, as llama-server does) and each
// sampled token, in order. A verify row is sampled after the rows before it, whose tokens were emitted (a row is only
// sampled while the draft before it matched), so every row sees exactly the state plain decoding would: the output
// stays token-identical, and a rejected draft leaves nothing to roll back.

struct Penalties {
    int   last_n  = 64;    // the window: the last last_n tokens (0 = off)
    float repeat  = 1.0f;  // 1 = off
    float freq    = 0.0f;
    float present = 0.0f;

    bool active() const { return last_n != 0 && (repeat != 1.0f || freq != 0.0f || present != 0.0f); }
};

struct TokenLogprob {
    llama_token token;
    float       logprob;
    std::vector<std::pair<llama_token, float>> top;  // the most likely tokens of the row, best first
};

uint64_t second_seed(uint64_t seed, uint64_t stream = 0);

class Sampler {
public:
    // The plain sampler: the Sampling parameters and no controls.
    Sampler(const Model & target, Sampling params) : params(params), n_vocab(target.n_vocab()), vocab(target.vocab) {}

    Sampler(const Model & target, Sampling params, std::vector<std::pair<llama_token, float>> logit_bias,
            Penalties penalties, const std::vector<llama_token> & prompt, const std::string & grammar_text,
            int n_logprobs);
    ~Sampler();
    Sampler(const Sampler &) = delete;
    Sampler & operator=(const Sampler &) = delete;

    bool has_grammar() const { return grammar != nullptr; }
    // next() is the row's argmax: temperature 0 and no controls (a greedy LM head may skip the other logits)
    bool greedy() const {
        return params.temperature <= 0.0f && bias.empty() && !pen.active() && !grammar && n_top < 0;
    }
    // How much of a row next() reads: 1 its argmax only (greedy()); K > 1 its K largest logits after the logit biases
    // and penalties, the tokens past them never drawn whatever their logits (a top-k of at most MAX_TOP_ROW, and no
    // grammar, whose redraw reads the whole row, nor logprobs); 0 all of it. A row may then hold -inf past its top,
    // except at touched() tokens (docs/lossless.md).
    int keep() const;
    // The tokens whose logits the controls change: the logit biases' and, with penalties, the window's.
    std::vector<llama_token> touched() const;
    static constexpr int MAX_TOP_ROW = 1024;
    llama_token next(const float * logits, uint64_t index, std::vector<Candidate> & cand);
    // next() on a row given by its top (keep() > 1): its tokens in ascending order with their logits, every token it
    // lacks below the keep()-th largest logit and untouched; the token next() takes from the whole row, taken in.
    llama_token next_top(const std::vector<std::pair<llama_token, float>> & top, uint64_t index,
                         std::vector<Candidate> & cand);
    llama_token judge(const float * logits, llama_token x, const float * q, uint64_t index);
    const Sampling & sampling() const { return params; }
    void distribution(const float * logits, std::vector<float> & out);
    void take(const float * logits, llama_token t);
    size_t grammar_prefix(const std::vector<llama_token> & draft) const;
    std::vector<TokenLogprob> take_logprobs() { return std::exchange(logprobs, {}); }

private:
    Sampling params;
    int n_vocab;
    const llama_vocab * vocab;
    std::vector<std::pair<llama_token, float>> bias;
    Penalties pen;
    std::deque<llama_token> window;                    // the last pen.last_n tokens
    std::vector<std::pair<llama_token, int>> counts;   // how often each token occurs in the window
    llama_sampler * grammar = nullptr;
    int n_top = -1;                                    // top logprobs to report per token (-1 = no logprobs)
    std::vector<TokenLogprob> logprobs;                // for the tokens sampled since the last take_logprobs()
    std::vector<float> row;                            // the row with biases and penalties applied (next_top: its top)
    std::vector<llama_token_data> cur;                 // the row as the grammar sees it
    std::vector<float> kept;                           // the logits the grammar keeps, in vocabulary order
    std::vector<llama_token> kept_ids;
    std::vector<float> p;                              // judge(): the target's distribution at the row
    std::vector<llama_token> ranked;                   // distribution(): the kept tokens, best first when cut

    void check_token(llama_token t) const;
    llama_token pick(const float * logits, uint64_t index, std::vector<Candidate> & cand);
    const float * controlled(const float * logits);
    static bool allows(llama_sampler * g, llama_token t);
    static void accept(llama_sampler * g, llama_token t);
    void remember(llama_token t);
    TokenLogprob logprob_of(const float * logits, llama_token t) const;
};

llama_token draw_tempered(const float * row, int n_vocab, float temperature, double u, float * q);
