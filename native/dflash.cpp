// The per-step work of DFlash speculative decoding, written directly against llama.cpp's C API.
//
// A Session owns a target context and, optionally, a DFlash drafter context that borrows the target's token
// embeddings and LM head (ctx_other). draft() proposes a block from the drafter; step() verifies a proposal (from
// this drafter or any other) with the target in one batch, accepts the longest agreeing prefix plus the target's own
// token, rolls back both KV caches and feeds the accepted positions' target features to the drafter.

#include "llama.h"
#include "ggml-backend.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

// Declared in llama.cpp's src/llama-ext.h (C++ linkage, exported by libllama, absent from the public headers).
LLAMA_API void    llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid);

namespace py = pybind11;

// ---------------------------------------------------------------------------------------------------------------
// Errors and logging.
//
// A llama.cpp failure becomes a NativeError (a RuntimeError in Python) that carries the warnings and errors
// llama.cpp logged during the failing call. llama.cpp's log callback is process-wide, but verbosity belongs to one
// Model or Session: each of their calls into llama.cpp runs inside a LogScope that tells the callback, for the calling
// thread, whether to print. Lines logged outside every scope (llama-cpp-python's own models, say) go on to the
// callback ours replaced, so other users of libllama in the process log as if this module were not there.

struct NativeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct LogScope {
    explicit LogScope(bool verbose);
    ~LogScope();
    LogScope(const LogScope &) = delete;
    LogScope & operator=(const LogScope &) = delete;

    bool verbose;
    LogScope * outer;                           // the scope this one runs inside, if any
    ggml_log_level level = GGML_LOG_LEVEL_NONE;  // of the last line, for GGML_LOG_LEVEL_CONT lines
    std::deque<std::string> tail;               // the last warnings and errors, for the exception message
};

static thread_local LogScope * t_scope = nullptr;

static std::mutex        g_log_mutex;
static ggml_log_callback g_prev_log     = nullptr;
static void *            g_prev_log_ud  = nullptr;

static void log_cb(ggml_log_level level, const char * text, void *) {
    LogScope * s = t_scope;
    if (!s) {
        ggml_log_callback prev;
        void * prev_ud;
        {
            std::lock_guard<std::mutex> lock(g_log_mutex);
            prev    = g_prev_log;
            prev_ud = g_prev_log_ud;
        }
        if (prev) {
            prev(level, text, prev_ud);  // outside the lock: it may be a Python callback waiting for the GIL
        }
        return;
    }
    if (level != GGML_LOG_LEVEL_CONT) {
        s->level = level;
    }
    if (s->verbose) {
        fputs(text, stderr);
    }
    if (s->level == GGML_LOG_LEVEL_ERROR || s->level == GGML_LOG_LEVEL_WARN) {
        s->tail.emplace_back(text);
        if (s->tail.size() > 8) {
            s->tail.pop_front();
        }
    }
}

// Installed at the first scope rather than at import, and again if someone replaced it since (importing
// llama_cpp after this module installs llama-cpp-python's callback, which prints everything by default).
LogScope::LogScope(bool verbose) : verbose(verbose), outer(t_scope) {
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        ggml_log_callback cur;
        void * cur_ud;
        llama_log_get(&cur, &cur_ud);
        if (cur != log_cb) {
            g_prev_log    = cur;
            g_prev_log_ud = cur_ud;
            llama_log_set(log_cb, nullptr);
        }
    }
    t_scope = this;
}

LogScope::~LogScope() { t_scope = outer; }

[[noreturn]] static void fail(const std::string & what) {
    std::string tail;
    if (t_scope) {
        for (auto & line : t_scope->tail) {
            tail += line;
        }
        t_scope->tail.clear();
    }
    while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) {
        tail.pop_back();
    }
    throw NativeError(tail.empty() ? what : what + " (llama.cpp: " + tail + ")");
}

// llama_decode / llama_process status codes (llama.h)
static std::string process_status(int32_t rc) {
    switch (rc) {
        case 1:  return "no KV cache slot for the batch";
        case 2:  return "aborted";
        case -1: return "invalid batch";
        case -2: return "could not allocate or prepare the batch";
        case -3: return "the computation failed";
    }
    return rc < 0 ? "error" : "warning";
}

static void process(llama_context * ctx, llama_batch_ext * batch, const std::string & what) {
    const int32_t rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch);
    if (rc != 0) {
        fail(what + " failed: " + process_status(rc) + " (code " + std::to_string(rc) + ")");
    }
}

static const float * logits_row(llama_context * ctx, int32_t i, const std::string & what) {
    const float * row = llama_get_logits_ith(ctx, i);
    if (!row) {
        fail("no " + what + " logits for output row " + std::to_string(i));
    }
    return row;
}

static llama_batch_ext * new_batch(llama_context * ctx) {
    llama_batch_ext * b = llama_batch_ext_init(ctx);
    if (!b) {
        fail("could not allocate a batch");
    }
    return b;
}

static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Architectures whose llama.cpp graph records layer inputs (res->t_layer_inp). For any other architecture,
// enabling llama_set_embeddings_layer_inp aborts the process inside llama_decode, so they use the eval callback.
static bool arch_records_layer_inputs(const std::string & arch) {
    static const char * archs[] = {
        "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "gemma4", "gpt-oss",
        "lfm2", "minimax-m2", "nemotron_h", "deepseek4",
    };
    for (const char * a : archs) {
        if (arch == a) {
            return true;
        }
    }
    return false;
}

// ---------------------------------------------------------------------------------------------------------------
// Model: a loaded GGUF plus its vocabulary.

struct Model {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::atomic<bool> verbose;  // print llama.cpp's log during this model's calls
    const int n_gpu_layers;

    Model(const std::string & path, int n_gpu_layers, bool repack, bool verbose)
        : verbose(verbose), n_gpu_layers(n_gpu_layers) {
        LogScope log(verbose);
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = n_gpu_layers;
        // repacked CPU weights switch kernels with the batch size, which changes rounding between a 1-token decode
        // and a verify batch; off keeps greedy verification bit-exact on CPUs
        mp.use_extra_bufts = repack;
        model = llama_model_load_from_file(path.c_str(), mp);
        if (!model) {
            fail("failed to load model from " + path);
        }
        vocab = llama_model_get_vocab(model);
        if (!vocab) {
            llama_model_free(model);
            fail("model " + path + " has no vocabulary");
        }
    }
    ~Model() {
        LogScope log(verbose);
        llama_model_free(model);
    }
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    std::string meta(const std::string & key) const {
        std::vector<char> buf(256);
        int32_t n = llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
        if (n < 0) {
            return "";
        }
        if ((size_t) n >= buf.size()) {
            buf.resize(n + 1);
            llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
        }
        return std::string(buf.data());
    }
    std::string arch() const { return meta("general.architecture"); }
    int n_vocab() const { return llama_vocab_n_tokens(vocab); }

    // llama.cpp aborts the process when a model without a tokenizer is asked to tokenize or detokenize
    void need_tokenizer() const {
        if (llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_NONE || n_vocab() <= 0) {
            throw std::invalid_argument("the '" + arch() + "' model has no tokenizer");
        }
    }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const {
        need_tokenizer();
        if (text.size() > (size_t) INT32_MAX / 2) {
            throw std::length_error("text too long to tokenize");
        }
        LogScope log(verbose);
        std::vector<llama_token> out(text.size() + 8);
        int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                                   add_special, parse_special);
        if (n < 0 && n != INT32_MIN) {
            out.resize(-n);
            n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, parse_special);
        }
        if (n < 0) {
            fail("tokenization failed");
        }
        out.resize(n);
        return out;
    }

    // Raw bytes of one token; a UTF-8 character may be split across tokens, so Python joins bytes, not strings.
    // special: control tokens give their text (for chat templates' bos_token); otherwise they give nothing.
    py::bytes piece(llama_token tok, bool special) const {
        need_tokenizer();
        if (tok < 0 || tok >= n_vocab()) {
            throw std::out_of_range("token id " + std::to_string(tok) + " outside the vocabulary");
        }
        LogScope log(verbose);
        char buf[256];
        int32_t n = llama_token_to_piece(vocab, tok, buf, sizeof(buf), 0, special);
        if (n < 0) {
            std::string big(-n, '\0');
            n = llama_token_to_piece(vocab, tok, big.data(), (int32_t) big.size(), 0, special);
            return py::bytes(big.data(), std::max(n, 0));
        }
        return py::bytes(buf, n);
    }
};

// ---------------------------------------------------------------------------------------------------------------
// Sampling. Every generated token k draws one uniform number u_k = hash(seed, k), whatever the draft length, so a
// speculative run and a plain run with the same seed sample the same tokens: verification stays exact when sampling.

struct Sampling {
    float    temperature = 0.0f;
    int      top_k       = 0;
    float    top_p       = 1.0f;
    float    min_p       = 0.0f;
    uint64_t seed        = 0;
};

static double uniform(uint64_t seed, uint64_t index) {
    uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (z >> 11) * (1.0 / 9007199254740992.0);
}

static llama_token argmax(const float * logits, int n) {
    return (llama_token) (std::max_element(logits, logits + n) - logits);
}

using Candidate = std::pair<float, llama_token>;

// Descending logits, ties broken by the lower token id: the one order every walk over the candidates uses.
static bool ranks_before(const Candidate & a, const Candidate & b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The largest and smallest logit, in eight lanes: one running maximum would be one long chain of dependent compares.
static void logit_range(const float * logits, int n, float & lo, float & hi) {
    float mx[8], mn[8];
    for (int j = 0; j < 8; ++j) {
        mx[j] = mn[j] = logits[0];
    }
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; ++j) {
            mx[j] = logits[i + j] > mx[j] ? logits[i + j] : mx[j];
            mn[j] = logits[i + j] < mn[j] ? logits[i + j] : mn[j];
        }
    }
    for (; i < n; ++i) {
        mx[0] = logits[i] > mx[0] ? logits[i] : mx[0];
        mn[0] = logits[i] < mn[0] ? logits[i] : mn[0];
    }
    hi = *std::max_element(mx, mx + 8);
    lo = *std::min_element(mn, mn + 8);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define DFLASH_AVX2 1  // the vocabulary-wide float pass is also compiled for AVX2 + FMA, picked at run time
#    define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#    define ALWAYS_INLINE inline
#endif

// exp(x) for -87 <= x <= 0 in float, in a form the compiler vectorizes: x = k ln 2 + r (k rounded in the low mantissa
// bits of a float), exp(r) by its Taylor polynomial, k added to the exponent bits. Relative error below 3.4e-6, with
// or without FMA (measured against the double exp of every float in [-87, 0]).
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

static double temper(float logit, float lmax, float temperature) {
    return std::exp(((double) logit - lmax) / temperature);
}

// A row's tokens in descending order, sorted only as far as they are read. The set is the tokens with logits at or
// above floor; cand holds those >= lo, cand[0, n_sorted) are the largest of them in order, and the others rank after
// them. Tokens are extracted in bands reaching gap, 2 gap and 4 gap below the maximum, then all the rest: a peaked
// row sorts a few hundred tokens.
struct Ranked {
    const float *            logits;
    int                      n_vocab;
    float                    lmax, lmin;
    float                    floor;
    std::vector<Candidate> & cand;
    float                    gap;
    float                    lo       = INFINITY;
    int                      bands    = 0;
    size_t                   n_sorted = 0;
    bool                     complete = false;  // cand holds the whole set

    // Put the set's (i+1)-th token at cand[i]; false if the set is smaller.
    bool reach(size_t i) {
        while (i >= n_sorted) {
            if (n_sorted == cand.size()) {
                if (complete) {
                    return false;
                }
                extend();
                continue;
            }
            const size_t m = std::max<size_t>(64, 2 * n_sorted);
            if (4 * m < cand.size()) {
                std::partial_sort(cand.begin() + n_sorted, cand.begin() + m, cand.end(), ranks_before);
                n_sorted = m;
            } else {  // a heap over most of it is slower than sorting all of it
                std::sort(cand.begin() + n_sorted, cand.end(), ranks_before);
                n_sorted = cand.size();
            }
        }
        return true;
    }

    // Keep only the set's k highest tokens (in no order yet): the set is then complete.
    void keep_top(size_t k) {
        while (cand.size() < k && !complete) {
            extend();
        }
        if (cand.size() > k) {
            std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), ranks_before);
            cand.resize(k);
        }
        complete = true;
    }

    // The whole set, sorted; its size.
    size_t all() {
        while (!complete) {
            extend();
        }
        std::sort(cand.begin() + n_sorted, cand.end(), ranks_before);
        n_sorted = cand.size();
        return n_sorted;
    }

    void extend() {
        const float next = bands < 3 ? std::max(lmax - gap, floor) : floor;
        for (int i = 0; i < n_vocab; ++i) {
            if (logits[i] >= next && logits[i] < lo) {
                cand.push_back({logits[i], i});
            }
        }
        lo       = next;
        gap     *= 2.0f;
        bands   += 1;
        complete = next <= floor || next <= lmin;
    }
};

struct SumEstimate {
    double sum;    // of exp((l - lmax) / T) over the set
    double bound;  // on its distance from the same sum taken in doubles with std::exp, in any order
};

constexpr int TAIL_CHUNK = 256;  // floats are summed in eight lanes per chunk, the chunks in doubles

// The sum of exp_approx((l - lmax) * inv) over the tokens with floor <= l < lo, in vectorized loops.
static ALWAYS_INLINE double tail_sum(const float * logits, int n, float lmax, float inv, float floor, float lo) {
    constexpr int C = TAIL_CHUNK;
    float  x[C];
    double sum = 0.0;
    for (int c = 0; c < n; c += C) {
        const int m = std::min(C, n - c);
        for (int i = 0; i < m; ++i) {
            const float l  = logits[c + i];
            const float xi = std::max((l - lmax) * inv, -87.0f);
            x[i] = (l >= floor) & (l < lo) ? xi : -87.0f;  // `&`, not `&&`: no branch, so it vectorizes
        }
        for (int i = m; i < C; ++i) {
            x[i] = -87.0f;
        }
        float acc[8] = {};
        for (int i = 0; i < C; i += 8) {
            for (int j = 0; j < 8; ++j) {
                acc[j] += exp_approx(x[i + j]);
            }
        }
        for (int j = 0; j < 8; ++j) {
            sum += acc[j];
        }
    }
    return sum;
}

#ifdef DFLASH_AVX2
__attribute__((target("avx2,fma"))) static double tail_sum_avx2(const float * logits, int n, float lmax, float inv,
                                                                 float floor, float lo) {
    return tail_sum(logits, n, lmax, inv, floor, lo);  // twice the lanes: half the time
}
#endif

// The sum over the set when Ranked holds its first band, or all of it: those tokens exactly, the rest (a few percent
// of the mass, most of the vocabulary) in one vectorized float pass, several times cheaper than std::exp in doubles.
static SumEstimate estimate_sum(const Ranked & r, float temperature) {
    double head = 0.0;
    for (const Candidate & c : r.cand) {
        head += temper(c.first, r.lmax, temperature);
    }
    if (r.complete) {
        return {head, 2.3e-16 * r.cand.size() * head};  // only the order of the terms differs
    }
    const float inv = 1.0f / temperature;
#ifdef DFLASH_AVX2
    static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const double tail = avx2 ? tail_sum_avx2(r.logits, r.n_vocab, r.lmax, inv, r.floor, r.lo)
                             : tail_sum(r.logits, r.n_vocab, r.lmax, inv, r.floor, r.lo);
#else
    const double tail = tail_sum(r.logits, r.n_vocab, r.lmax, inv, r.floor, r.lo);
#endif
    const double n     = r.n_vocab + TAIL_CHUNK;
    const double x_max = std::min(87.0f, (r.lmax - r.lmin) * inv) + 1.0;
    // Per tail token: exp_approx is off by 3.4e-6 relative, x by three float roundings (2^-22 |x| <= 2^-22 x_max
    // relative in exp), std::exp by an ulp, and a lane's float sum of 32 terms by 31 2^-24 = 1.9e-6 relative; a
    // token clamped to -87 or outside the tail by 1.7e-38 absolute. A double sum of n terms is within n 2^-53 of
    // their exact sum, whatever the order.
    return {head + tail, 1.01 * (5.5e-6 + 2.4e-7 * x_max) * tail + 2.3e-16 * n * (head + tail) + n * 2e-38};
}

// The same sum with every term as the definition computes it, so only their order differs; several times the cost.
static SumEstimate sum_in_doubles(const Ranked & r, float temperature) {
    double sum = 0.0;
    for (const Candidate & c : r.cand) {
        sum += temper(c.first, r.lmax, temperature);
    }
    if (!r.complete) {  // and the tokens of the set not extracted yet
        for (int i = 0; i < r.n_vocab; ++i) {
            if (r.logits[i] >= r.floor && r.logits[i] < r.lo) {
                sum += temper(r.logits[i], r.lmax, temperature);
            }
        }
    }
    return {sum, 2.3e-16 * r.n_vocab * sum};
}

// top-p's z as specified: over the candidates (the top-k set, or the vocabulary) in vocabulary order.
static double exact_z(const Ranked & r, bool top_k) {
    const Candidate last = top_k ? *std::max_element(r.cand.begin(), r.cand.end(), ranks_before) : Candidate{};
    double z = 0.0;
    for (int i = 0; i < r.n_vocab; ++i) {
        if (!top_k || !ranks_before(last, {r.logits[i], i})) {
            z += std::exp((double) r.logits[i] - r.lmax);
        }
    }
    return z;
}

// top-p over the set's first n tokens (n = SIZE_MAX: all of it), with its normalizer z known to within `bound`: how
// many tokens the cut keeps. False if z's uncertainty could move the cut.
static bool top_p_cut(Ranked & r, size_t n, double z, double bound, float top_p, size_t & cut) {
    double cum = 0.0, prev = 0.0;
    size_t i = 0;
    for (; i < n && r.reach(i); ++i) {
        prev = cum;
        cum += std::exp((double) r.cand[i].first - r.lmax) / z;
        if (cum >= top_p) {
            cut = i + 1;
            const double slack = 2.0 * bound / z + (4.0 * i + 8.0) * 0x1p-53;  // z's error, i + 1 terms' roundings
            return bound == 0.0 || (cum * (1.0 - slack) >= top_p && prev * (1.0 + slack) < top_p);
        }
    }
    cut = i;  // never reached: the whole set
    return bound == 0.0 || cum * (1.0 + 2.0 * bound / z + (4.0 * i + 8.0) * 0x1p-53) < top_p;
}

// The draw over the whole set with an estimate of its normalizer: false if the estimate's error could move u * zt
// across a token boundary (in the far tail, where the boundaries crowd).
static bool draw_estimated(Ranked & r, float temperature, double u, const SumEstimate & est, llama_token & token) {
    const double t = u * est.sum;
    const double d = 1.01 * u * est.bound + t * 0x1p-50;  // and the rounding of both products
    double cum = 0.0;
    for (size_t i = 0; r.reach(i); ++i) {
        cum += temper(r.cand[i].first, r.lmax, temperature);
        if (cum > t + d) {
            token = r.cand[i].second;
            return true;
        }
        if (!(cum <= t - d)) {
            return false;
        }
    }
    return false;
}

// llama.cpp's default order: top-k, top-p, min-p on the untempered distribution, then temperature. In full:
//
//   candidates  the top_k highest logits, or all; in descending order, ties broken by the lower token id
//   top-p       the shortest head whose sum of exp(l - lmax) / z reaches top_p, z the sum of exp(l - lmax) over the
//               candidates in vocabulary order
//   min-p       then only the tokens with l >= lmax + log(min_p)
//   the draw    the first token i with u * zt < sum_{j <= i} exp((l_j - lmax) / T), zt that sum over all of them
//
// in doubles, every sum taken term by term in the order stated, u = uniform(seed, index). Done literally, that sorts
// the whole vocabulary for every row (gemma: 262,144 tokens, 26 ms). This picks the same token, bit for bit, sorting
// only as far down as its walks go (Ranked); a normalizer over the whole vocabulary (z without top-k, zt without a
// cut) is estimated with an error bound instead (estimate_sum), and a cut or draw the bound leaves in doubt is
// redone with a better one, then exactly.
static llama_token sample_row(const float * logits, int n_vocab, const Sampling & s, uint64_t index,
                              std::vector<Candidate> & cand) {
    if (s.temperature <= 0.0f) {
        return argmax(logits, n_vocab);
    }
    float lmin, lmax;
    logit_range(logits, n_vocab, lmin, lmax);
    if (!std::isfinite(lmax)) {  // a broken row (NaN or infinite logits): no distribution to draw from
        if (std::all_of(logits, logits + n_vocab, [](float x) { return std::isnan(x); })) {
            fail("no token left to sample (NaN logits)");
        }
        return argmax(logits, n_vocab);
    }
    const bool  top_k = s.top_k > 0 && s.top_k < n_vocab;
    const bool  top_p = s.top_p < 1.0f;
    const float keep  = s.min_p > 0.0f ? std::min(lmax, lmax + std::log(s.min_p)) : -INFINITY;
    cand.clear();
    // With no top-k or top-p cut, min-p's threshold bounds the set itself, and the first band is 8 nats of the
    // tempered distribution: most of a draw's mass.
    const bool  implicit = !top_k && !top_p;
    const float gap      = implicit ? 8.0f * std::max(1.0f, s.temperature) : 8.0f;
    Ranked r{logits, n_vocab, lmax, lmin, implicit ? keep : -INFINITY, cand, gap};

    size_t n = SIZE_MAX;  // the set is cand[0, n), or (SIZE_MAX) all of Ranked's
    if (top_k) {
        r.keep_top(s.top_k);
        n = cand.size();
    }
    if (top_p) {
        r.reach(0);
        const SumEstimate est = estimate_sum(r, 1.0f);
        size_t cut = 0;
        if (!top_p_cut(r, n, est.sum, est.bound, s.top_p, cut)) {
            top_p_cut(r, n, exact_z(r, top_k), 0.0, s.top_p, cut);
        }
        n = cut;
    }
    if (s.min_p > 0.0f && n != SIZE_MAX) {
        // min-p drops a tail of the sorted order; cand[0, n) is the set, sorted or not
        const auto kept = std::count_if(cand.begin(), cand.begin() + n, [&](const Candidate & c) {
            return c.first >= keep;
        });
        n = std::max<size_t>(1, kept);
    }

    const double u = uniform(s.seed, index);
    llama_token  token;
    if (n == SIZE_MAX) {
        // the normalizer in floats; if that leaves the draw in doubt, in doubles; if still, exactly (a full sort)
        if (r.reach(0) && !r.complete) {
            if (draw_estimated(r, s.temperature, u, estimate_sum(r, s.temperature), token) ||
                draw_estimated(r, s.temperature, u, sum_in_doubles(r, s.temperature), token)) {
                return token;
            }
        }
        n = r.all();
    }
    if (n == 0) {
        fail("no token left to sample");
    }
    r.reach(n - 1);
    double zt = 0.0;
    for (size_t i = 0; i < n; ++i) {
        zt += temper(cand[i].first, lmax, s.temperature);
    }
    const double target = u * zt;
    double cum = 0.0;
    for (size_t i = 0; i < n; ++i) {
        cum += temper(cand[i].first, lmax, s.temperature);
        if (target < cum) {
            return cand[i].second;
        }
    }
    return cand[n - 1].second;
}

// ---------------------------------------------------------------------------------------------------------------
// Session: target context, optional drafter context, and the speculative step.

struct Draft {
    std::vector<llama_token> tokens;  // the proposed tokens
    std::vector<float>       probs;   // the drafter's probability of each (when asked for)
};

struct StepResult {
    std::vector<llama_token> tokens;       // accepted draft tokens followed by the target's own token
    std::vector<llama_token> draft;        // the proposal verified (cut where the context or the batch ends)
    int    n_accepted = 0;                 // accepted draft tokens (len(tokens) - 1)
    double draft_ms   = 0.0;               // drafter compute: feature injection
    double verify_ms  = 0.0;               // target compute: the verify batch
    double sample_ms  = 0.0;               // sampling the verify rows, one per token in `tokens`
    double step_ms    = 0.0;               // whole native step, sampling and bookkeeping included
};

// Errors: bad arguments raise ValueError or IndexError before anything changes. A llama.cpp failure raises
// NativeError, and the call that failed leaves the caches as they were at its start: both hold exactly the positions
// [0, n_past) they held before (the drafter may also hold a stale noise block past them, which it always clears
// before use). Should llama.cpp refuse even that rollback, both caches are emptied and n_past is 0. Either way the
// session stays usable and n_past says what the caches hold.
class Session {
public:
    Session(Model & target, Model * drafter, std::vector<int> layers, int n_ctx, int n_threads, bool use_layer_api,
            bool flash_attn, bool verbose)
        : tgt(target), dft(drafter), layers(std::move(layers)), layer_api(use_layer_api), verbose(verbose) {
        LogScope log(verbose);
        check_arguments(n_ctx, n_threads);
        try {
            create_contexts(n_ctx, n_threads, flash_attn);
        } catch (...) {
            free_all();  // the destructor does not run for a constructor that throws
            throw;
        }
    }

    ~Session() {
        LogScope log(verbose);
        free_all();
    }
    Session(const Session &) = delete;
    Session & operator=(const Session &) = delete;

    std::atomic<bool> verbose;  // print llama.cpp's log during this session's calls

    int n_past() const { return past; }
    int context_size() const { return n_ctx; }
    bool has_drafter() const { return ctx_dft != nullptr; }
    bool uses_layer_api() const { return layer_api; }

    // With capture off the target runs as plain decoding (the baseline): no features, no drafter updates.
    void set_capture(bool on) { capture = on; }

    // Forget everything from position n on, in both caches (n = 0 starts afresh; n > 0 reuses a cached prefix).
    void truncate(int n) {
        if (n < 0 || n > past) {
            throw std::out_of_range("truncate position " + std::to_string(n) + " outside the " + std::to_string(past) +
                                    " cached tokens");
        }
        LogScope log(verbose);
        if (!keep(n)) {
            fail("the KV cache could not drop the positions from " + std::to_string(n) +
                 " on; both caches were emptied");
        }
    }

    // Decode tokens after the cached ones, feed their features to the drafter and sample the next token
    // (generated token number `index`).
    llama_token prefill(const std::vector<llama_token> & tokens, const Sampling & s, uint64_t index) {
        if (tokens.empty()) {
            throw std::invalid_argument("prefill needs at least one token");
        }
        if (past + (int) tokens.size() >= n_ctx) {
            throw std::length_error("prompt does not fit in the context");
        }
        check_tokens(tokens);
        return transaction([&] {
            for (size_t off = 0; off < tokens.size(); off += n_batch) {
                const size_t n = std::min<size_t>(n_batch, tokens.size() - off);
                const bool last_chunk = off + n == tokens.size();
                decode_target(tokens.data() + off, (int) n, past, last_chunk ? LogitsLast : LogitsNone);
                if (ctx_dft && capture) {
                    inject(past, (int) n);
                }
                past += (int) n;
            }
            return sample_row(logits_row(ctx_tgt, -1, "target"), tgt.n_vocab(), s, index, cand);
        });
    }

    // The llama.cpp drafter's proposal for up to n_draft tokens after `last` (the newest token, not yet in the
    // caches), at most a block.
    Draft draft(llama_token last, int n_draft, bool with_probs) {
        if (!ctx_dft) {
            throw std::logic_error("this session has no llama.cpp drafter");
        }
        check_tokens({last});
        return transaction([&] {
            Draft d;
            if (n_draft > 0) {
                draft_block(last, std::min(n_draft, block_size - 1), with_probs, d);
            }
            return d;
        });
    }

    // One speculative step: verify `draft` (any drafter's proposal, possibly empty) after `last`, the newest token,
    // not yet in the caches.
    StepResult step(llama_token last, const std::vector<llama_token> & draft, const Sampling & s, uint64_t index) {
        check_tokens({last});
        check_tokens(draft);
        if (past + 1 > n_ctx) {
            throw std::length_error("context is full");
        }
        return transaction([&] { return step_unchecked(last, draft, s, index); });
    }

    // Logits of one output row of the last target decode (rows of a verify batch: 0 = after `last`).
    py::array_t<float> logits(int row) const {
        if (row < -n_out || row >= n_out) {
            throw std::out_of_range("row " + std::to_string(row) + " outside the " + std::to_string(n_out) +
                                    " output rows of the last target decode");
        }
        LogScope log(verbose);
        const int n_vocab = tgt.n_vocab();
        const float * src = logits_row(ctx_tgt, row, "target");
        py::array_t<float> out(n_vocab);
        std::memcpy(out.mutable_data(), src, n_vocab * sizeof(float));
        return out;
    }

    // Keep the logits of every noise block, for draft_logits() (parity checks and analysis; costs a copy).
    void keep_draft_logits(bool on) { keep_draft = on; }

    // Logits of the drafter's last noise block at its draft positions: [n, n_vocab].
    py::array_t<float> draft_logits() const {
        const size_t n_vocab = tgt.n_vocab();
        const size_t n = draft_rows.size() / n_vocab;
        py::array_t<float> out({n, n_vocab});
        std::memcpy(out.mutable_data(), draft_rows.data(), draft_rows.size() * sizeof(float));
        return out;
    }

    // Target features of the rows of the last target decode: [rows, n_layers * n_embd], layers in the given order.
    // Empty after a failed call.
    py::array_t<float> features() const {
        const size_t width = layers.size() * (size_t) n_embd;
        py::array_t<float> out({(size_t) feat_rows, width});
        std::memcpy(out.mutable_data(), feats.data(), (size_t) feat_rows * width * sizeof(float));
        return out;
    }

private:
    enum Logits { LogitsNone, LogitsLast, LogitsAll };

    static constexpr int max_batch = 512;

    Model & tgt;
    Model * dft;
    std::vector<int> layers;
    bool layer_api;
    bool capture = true;
    llama_context * ctx_tgt = nullptr;
    llama_context * ctx_dft = nullptr;
    llama_batch_ext * batch_tgt = nullptr;
    llama_batch_ext * batch_dft = nullptr;
    llama_token mask_token = -1;
    int block_size = 16;
    bool keep_draft = false;
    std::vector<float> draft_rows;  // [n_draft, n_vocab] logits of the last noise block, when kept
    int n_ctx = 0;
    int n_batch = 0;  // the most tokens one target decode takes
    int n_embd = 0;
    int past = 0;
    int n_out = 0;  // output (logits) rows of the last target decode

    std::vector<float> feats;     // [feat_rows, layers.size() * n_embd] from the last target decode
    int feat_rows = 0;
    std::vector<int> rows_seen;   // eval-callback path: rows copied so far per layer (ubatches arrive in order)
    std::vector<float> cb_rows;   // eval-callback path: one layer's rows on their way from the backend
    std::vector<std::pair<float, llama_token>> cand;

    // Everything llama.cpp would assert on (and abort the process) is checked here, before any context exists.
    void check_arguments(int n_ctx, int n_threads) {
        if (n_ctx < 2) {
            throw std::invalid_argument("n_ctx must be at least 2, got " + std::to_string(n_ctx));
        }
        if (n_threads < 1) {
            throw std::invalid_argument("n_threads must be at least 1, got " + std::to_string(n_threads));
        }
        if (llama_model_is_recurrent(tgt.model) || llama_model_is_hybrid(tgt.model)) {
            throw std::invalid_argument("the '" + tgt.arch() + "' target has recurrent or hybrid memory, which "
                                        "cannot roll back drafted tokens; such targets are not supported yet");
        }
        n_embd = llama_model_n_embd(tgt.model);
        const int n_layer = llama_model_n_layer(tgt.model);
        for (size_t k = 0; k < layers.size(); ++k) {
            const int lid = layers[k];
            if (lid < 1 || lid >= n_layer) {
                throw std::invalid_argument("feature layer " + std::to_string(lid) + " is outside the target's 1.." +
                                            std::to_string(n_layer - 1));
            }
            if (std::find(layers.begin(), layers.begin() + k, lid) != layers.begin() + k) {
                throw std::invalid_argument("feature layer " + std::to_string(lid) + " is listed twice");
            }
        }
        if (layer_api && !arch_records_layer_inputs(tgt.arch())) {
            throw std::invalid_argument("architecture '" + tgt.arch() + "' does not record layer inputs");
        }
        if (!dft) {
            return;
        }
        if (layers.empty()) {
            throw std::invalid_argument("a drafter needs target feature layers");
        }
        if (dft->arch() != "dflash") {
            throw std::invalid_argument("the drafter's architecture is '" + dft->arch() + "', not 'dflash'");
        }
        // the drafter's logits rows are read with the target's vocabulary size
        if (dft->n_vocab() != tgt.n_vocab()) {
            throw std::invalid_argument("the drafter's vocabulary has " + std::to_string(dft->n_vocab()) +
                                        " tokens, the target's " + std::to_string(tgt.n_vocab()));
        }
        mask_token = llama_vocab_mask(dft->vocab);
        if (mask_token < 0 || mask_token >= tgt.n_vocab()) {
            throw std::invalid_argument("the drafter has no valid mask token (tokenizer.ggml.mask_token_id)");
        }
        const std::string bs = dft->meta("dflash.block_size");
        block_size = bs.empty() ? 16 : std::atoi(bs.c_str());
        // a noise block is one batch, and a non-causal one must fit in one ubatch
        if (block_size < 2 || block_size > max_batch) {
            throw std::invalid_argument("the drafter's block size '" + bs + "' is outside 2.." +
                                        std::to_string(max_batch));
        }
    }

    void create_contexts(int n_ctx_want, int n_threads, bool flash_attn) {
        llama_context_params cp = context_params(n_ctx_want, n_threads, flash_attn);
        // A GPU build offloads large batches (the prompt) of a CPU-resident model to the GPU, whose kernels round
        // differently from the CPU's: on an H100 this broke bit-exact verification at -ngl 0. A target kept on the
        // CPU computes on the CPU.
        cp.op_offload = tgt.n_gpu_layers != 0;
        if (!layers.empty() && !layer_api) {
            cp.cb_eval           = eval_cb;
            cp.cb_eval_user_data = this;
        }
        ctx_tgt = llama_init_from_model(tgt.model, cp);
        if (!ctx_tgt) {
            fail("failed to create the target context");
        }
        n_ctx = (int) llama_n_ctx(ctx_tgt);
        n_batch = (int) llama_n_batch(ctx_tgt);  // less than max_batch when n_ctx was (llama.cpp rounds n_ctx up)
        batch_tgt = new_batch(ctx_tgt);
        if (layer_api) {
            for (int lid : layers) {
                llama_set_embeddings_layer_inp(ctx_tgt, (uint32_t) lid, true);
            }
        }
        if (!dft) {
            return;
        }
        // the noise block reaches past the target's last position
        llama_context_params dp = context_params(n_ctx + block_size, n_threads, false);
        dp.ctx_other = ctx_tgt;
        // the drafter's cache is small; f32 keeps its drafts equal to a float32 reference implementation
        dp.type_k = GGML_TYPE_F32;
        dp.type_v = GGML_TYPE_F32;
        ctx_dft = llama_init_from_model(dft->model, dp);
        if (!ctx_dft) {
            fail("failed to create the drafter context");
        }
        // the drafter takes a whole target chunk's features, or a whole noise block, in one batch
        if ((int) llama_n_batch(ctx_dft) < std::max(n_batch, block_size)) {
            fail("the drafter context's batch is too small");
        }
        batch_dft = new_batch(ctx_dft);
        llama_set_causal_attn(ctx_dft, dft->meta("dflash.attention.causal") == "true");
    }

    static llama_context_params context_params(int n_ctx, int n_threads, bool flash_attn) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx           = n_ctx;
        cp.n_batch         = max_batch;
        cp.n_ubatch        = max_batch;
        cp.n_threads       = n_threads;
        cp.n_threads_batch = n_threads;
        cp.no_perf         = true;
        // the CPU flash-attention kernel rounds through f16, and differently for one query than for a block
        cp.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        // Rollback relies on it (gemma3 and SWA drafters): a sliding-window cache of only the window (swa_full off)
        // evicts the positions that fell out of the window of a verify batch's last token, and after rejected
        // tokens are dropped the next token's window needs some of them again. (llama.cpp's default, pinned.)
        cp.swa_full        = true;
        return cp;
    }

    void free_all() {
        if (batch_dft) llama_batch_ext_free(batch_dft);
        if (ctx_dft) llama_free(ctx_dft);
        if (batch_tgt) llama_batch_ext_free(batch_tgt);
        if (ctx_tgt) llama_free(ctx_tgt);
        batch_dft = batch_tgt = nullptr;
        ctx_dft = ctx_tgt = nullptr;
    }

    // Run a call that changes the caches; if it throws, put the caches back as they were at its start.
    template <class F> auto transaction(F && f) -> decltype(f()) {
        LogScope log(verbose);
        const int p0 = past;
        try {
            return f();
        } catch (...) {
            // decodes only add positions from p0 on, and rollbacks only drop them, so [0, p0) is intact
            feat_rows = 0;
            n_out = 0;
            draft_rows.clear();
            keep(p0);
            throw;
        }
    }

    // Make both caches hold the positions [0, n) only. If llama.cpp refuses to drop part of a sequence, empty both
    // and return false.
    bool keep(int n) {
        bool ok = llama_memory_seq_rm(llama_get_memory(ctx_tgt), 0, n, -1);
        if (ctx_dft) {
            ok = llama_memory_seq_rm(llama_get_memory(ctx_dft), 0, n, -1) && ok;
        }
        past = n;
        if (!ok) {
            llama_memory_clear(llama_get_memory(ctx_tgt), false);
            if (ctx_dft) {
                llama_memory_clear(llama_get_memory(ctx_dft), false);
            }
            past = 0;
        }
        return ok;
    }

    static void drop_from(llama_context * ctx, llama_pos p0, const char * which) {
        if (!llama_memory_seq_rm(llama_get_memory(ctx), 0, p0, -1)) {
            fail(std::string("the ") + which + " KV cache could not drop the positions from " + std::to_string(p0) +
                 " on");
        }
    }

    void check_tokens(const std::vector<llama_token> & toks) const {
        const int n_vocab = tgt.n_vocab();
        for (llama_token t : toks) {
            if (t < 0 || t >= n_vocab) {
                throw std::out_of_range("token id " + std::to_string(t) + " outside the vocabulary (0.." +
                                        std::to_string(n_vocab - 1) + ")");
            }
        }
    }

    static void add_token(llama_batch_ext * b, llama_token t, llama_pos pos, bool logits) {
        const int32_t idx = llama_batch_ext_add_token(b, 0, t);
        if (idx < 0 || !llama_batch_ext_set_pos(b, idx, &pos) || !llama_batch_ext_set_output_logits(b, idx, logits)) {
            fail("could not add token " + std::to_string(t) + " at position " + std::to_string(pos) +
                 " to a batch (code " + std::to_string(idx) + ")");
        }
    }

    StepResult step_unchecked(llama_token last, const std::vector<llama_token> & draft, const Sampling & s,
                              uint64_t index) {
        const auto t_step = std::chrono::steady_clock::now();
        StepResult r;
        // never verify past the end of the context or the batch
        const int room = std::min(n_ctx - past - 1, n_batch - 1);
        r.draft.assign(draft.begin(), draft.begin() + std::min<int>((int) draft.size(), room));

        std::vector<llama_token> block;
        block.reserve(r.draft.size() + 1);
        block.push_back(last);
        block.insert(block.end(), r.draft.begin(), r.draft.end());

        const auto t1 = std::chrono::steady_clock::now();
        decode_target(block.data(), (int) block.size(), past, LogitsAll);
        r.verify_ms = ms_since(t1);

        // accept while the target's own choice equals the draft; the first disagreement is the target's token
        const auto t_sample = std::chrono::steady_clock::now();
        const int n_vocab = tgt.n_vocab();
        int a = 0;
        for (;; ++a) {
            const llama_token t = sample_row(logits_row(ctx_tgt, a, "target"), n_vocab, s, index + a, cand);
            r.tokens.push_back(t);
            if (a == (int) r.draft.size() || t != r.draft[a]) {
                break;
            }
        }
        r.n_accepted = a;
        r.sample_ms  = ms_since(t_sample);

        const int p0 = past;
        if (a + 1 < (int) block.size()) {
            drop_from(ctx_tgt, p0 + a + 1, "target");
        }
        if (ctx_dft && capture) {
            const auto t2 = std::chrono::steady_clock::now();
            inject(p0, a + 1);
            r.draft_ms += ms_since(t2);
        }
        past = p0 + a + 1;  // `last` and the accepted drafts are now in both caches
        r.step_ms = ms_since(t_step);
        return r;
    }

    void decode_target(const llama_token * toks, int n, int pos0, Logits logits) {
        llama_batch_ext_clear(batch_tgt);
        for (int i = 0; i < n; ++i) {
            add_token(batch_tgt, toks[i], pos0 + i, logits == LogitsAll || (logits == LogitsLast && i == n - 1));
        }
        const size_t width = layers.size() * (size_t) n_embd;
        feats.resize((size_t) n * width);
        feat_rows = n;
        rows_seen.assign(layers.size(), 0);
        if (!layer_api) {
            cb_rows.resize((size_t) n * n_embd);
        }
        n_out = 0;
        process(ctx_tgt, batch_tgt, "target decode");
        n_out = logits == LogitsAll ? n : logits == LogitsLast ? 1 : 0;
        llama_synchronize(ctx_tgt);
        if (!capture || layers.empty()) {
            feat_rows = 0;
        } else if (layer_api) {
            for (size_t k = 0; k < layers.size(); ++k) {
                const float * src = llama_get_embeddings_layer_inp(ctx_tgt, (uint32_t) layers[k]);
                if (!src) {
                    fail("no features for layer " + std::to_string(layers[k]));
                }
                for (int i = 0; i < n; ++i) {
                    std::memcpy(&feats[i * width + k * n_embd], src + (size_t) i * n_embd, n_embd * sizeof(float));
                }
            }
        } else {
            for (size_t k = 0; k < layers.size(); ++k) {
                if (rows_seen[k] != n) {
                    fail("feature capture saw " + std::to_string(rows_seen[k]) + " of " + std::to_string(n) +
                         " rows of layer " + std::to_string(layers[k]));
                }
            }
        }
    }

    // Scheduler callback: the output of layer N ("l_out-N") is the input of layer N + 1. It runs inside llama.cpp
    // and must not throw: a tensor it cannot use is skipped, and decode_target reports the missing rows.
    static bool eval_cb(ggml_tensor * t, bool ask, void * user) {
        auto * self = (Session *) user;
        const char * name = ggml_get_name(t);
        if (!self->capture || strncmp(name, "l_out-", 6) != 0) {
            return ask ? false : true;
        }
        const int lid = atoi(name + 6) + 1;
        const auto it = std::find(self->layers.begin(), self->layers.end(), lid);
        if (it == self->layers.end()) {
            return ask ? false : true;
        }
        if (ask) {
            return true;
        }
        const size_t k = it - self->layers.begin();
        const int n_embd = self->n_embd;
        const int rows = (int) t->ne[1];
        if (t->type != GGML_TYPE_F32 || t->ne[0] != n_embd || self->rows_seen[k] + rows > self->feat_rows) {
            return true;
        }
        const size_t width = self->layers.size() * (size_t) n_embd;
        float * tmp = self->cb_rows.data();  // sized by decode_target: nothing here may allocate or throw
        ggml_backend_tensor_get(t, tmp, 0, (size_t) rows * n_embd * sizeof(float));
        for (int i = 0; i < rows; ++i) {
            std::memcpy(&self->feats[(self->rows_seen[k] + i) * width + k * n_embd], &tmp[(size_t) i * n_embd],
                        n_embd * sizeof(float));
        }
        self->rows_seen[k] += rows;
        return true;
    }

    // Write the features of rows [0, n) of the last target decode into the drafter's cache at positions pos0...
    void inject(int pos0, int n) {
        // the previous noise block left its own K/V from pos0 on
        drop_from(ctx_dft, pos0, "drafter");
        const size_t width = layers.size() * (size_t) n_embd;
        llama_batch_ext_clear(batch_dft);
        for (int i = 0; i < n; ++i) {
            const int32_t idx = llama_batch_ext_add_embd(batch_dft, 0, llama_embd{&feats[i * width], 1, width});
            if (idx < 0) {
                fail("the drafter rejected the target features (width " + std::to_string(width) + ", code " +
                     std::to_string(idx) + ")");
            }
            const llama_pos pos[4] = {pos0 + i, pos0 + i, pos0 + i, 0};
            if (!llama_batch_ext_set_pos(batch_dft, idx, pos) || !llama_batch_ext_set_output_logits(batch_dft, idx, false)) {
                fail("could not place the target features at position " + std::to_string(pos0 + i));
            }
        }
        process(ctx_dft, batch_dft, "drafter feature injection");
    }

    // Decode [last, mask x n_draft] at the next positions; the argmax at each mask is the draft.
    void draft_block(llama_token last, int n_draft, bool with_probs, Draft & d) {
        drop_from(ctx_dft, past, "drafter");
        llama_batch_ext_clear(batch_dft);
        // every row is marked as an output, the anchor too: the dflash graph computes logits for all rows and
        // llama.cpp keeps the first n_outputs of them, so marking fewer would shift the rows
        for (int i = 0; i <= n_draft; ++i) {
            add_token(batch_dft, i == 0 ? last : mask_token, past + i, true);
        }
        process(ctx_dft, batch_dft, "drafter decode");
        const int n_vocab = tgt.n_vocab();
        draft_rows.clear();
        for (int i = 0; i < n_draft; ++i) {
            const float * row = logits_row(ctx_dft, i + 1, "drafter");
            if (keep_draft) {
                draft_rows.insert(draft_rows.end(), row, row + n_vocab);
            }
            const llama_token t = argmax(row, n_vocab);
            d.tokens.push_back(t);
            if (with_probs) {
                const float lmax = row[t];
                double z = 0.0;
                for (int j = 0; j < n_vocab; ++j) {
                    z += std::exp(row[j] - lmax);
                }
                d.probs.push_back((float) (1.0 / z));
            }
        }
    }
};

// ---------------------------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------------------------
// llama.cpp's RPC backend (built with GGML_RPC=ON): remote devices that take a model's offloaded layers, and the
// server that offers this machine's devices to another. Looked up through the backend registry, as llama.cpp's
// own tools do, so a build without RPC fails with a message instead of a missing symbol.

static ggml_backend_reg_t rpc_backend() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    if (!reg) {
        throw std::runtime_error("this llama.cpp was built without the RPC backend: rerun scripts/setup.sh, which "
                                 "builds it with -DGGML_RPC=ON");
    }
    return reg;
}

// Register the devices of one rpc-server (host:port) for every model loaded afterwards in this process. llama.cpp
// aborts the process when the server cannot be reached or does not answer the handshake: the caller checks first.
static int add_rpc_server(const std::string & endpoint) {
    using add_fn = ggml_backend_reg_t (*)(const char *);
    auto add = (add_fn) ggml_backend_reg_get_proc_address(rpc_backend(), "ggml_backend_rpc_add_server");
    if (!add) {
        throw std::runtime_error("the RPC backend has no ggml_backend_rpc_add_server");
    }
    ggml_backend_reg_t reg;
    {
        py::gil_scoped_release nogil;
        reg = add(endpoint.c_str());
    }
    if (!reg) {
        fail("the RPC server at " + endpoint + " offers no devices");
    }
    ggml_backend_register(reg);
    return (int) ggml_backend_reg_dev_count(reg);
}

// Serve this machine's devices (GPUs if any, else the CPU, as llama.cpp's rpc-server picks them) on endpoint until
// the process ends. cache_dir (may be empty) keeps tensors sent before, for faster reloads.
static void serve_rpc(const std::string & endpoint, int n_threads, const std::string & cache_dir) {
    using serve_fn = void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *);
    auto serve = (serve_fn) ggml_backend_reg_get_proc_address(rpc_backend(), "ggml_backend_rpc_start_server");
    if (!serve) {
        throw std::runtime_error("the RPC backend has no ggml_backend_rpc_start_server");
    }
    std::vector<ggml_backend_dev_t> devices;
    for (auto type : {GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_CPU}) {
        for (size_t i = 0; i < ggml_backend_dev_count() && devices.empty(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            // an RPC device registered in this process is someone else's server
            if (ggml_backend_dev_type(dev) == type && ggml_backend_dev_backend_reg(dev) != rpc_backend()) {
                devices.push_back(dev);
            }
        }
    }
    if (devices.empty()) {
        throw std::runtime_error("no device to serve");
    }
    py::gil_scoped_release nogil;
    serve(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(), (size_t) n_threads, devices.size(),
          devices.data());
}

PYBIND11_MODULE(_native, m) {
    m.doc() = "DFlash speculative decoding steps over llama.cpp";

    // Backend set-up only: the log callback is installed by the first Model or Session (LogScope).
    // ggml's tiled CPU matmul takes over from 8 rows up and rounds differently from the one-row kernel, so a
    // verify batch would not reproduce plain decoding bit for bit. It is read once, at the first matmul; a value
    // already set by the user is kept.
    setenv("GGML_CPU_TILED_MM", "0", 0);
    llama_backend_init();

    py::register_exception<NativeError>(m, "NativeError", PyExc_RuntimeError);
    m.def("system_info", []() { return std::string(llama_print_system_info()); });
    m.def("cpu_matmul_batch_invariant", []() {
        const char * tiled = getenv("GGML_CPU_TILED_MM");
        const bool llamafile = std::string(llama_print_system_info()).find("LLAMAFILE = 1") != std::string::npos;
        return tiled && std::string(tiled) == "0" && !llamafile;
    }, "Whether CPU matmuls give a verify-batch row the same bits as a single-token decode.");
    m.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); });
    m.def("supports_rpc", []() { return llama_supports_rpc(); });
    m.def("add_rpc_server", &add_rpc_server, py::arg("endpoint"),
          "Use an rpc-server's devices (host:port) for the layers of every model loaded from now on; returns how "
          "many devices it offers.");
    m.def("serve_rpc", &serve_rpc, py::arg("endpoint"), py::arg("n_threads"), py::arg("cache_dir") = "",
          "Serve this machine's devices to llama.cpp RPC clients on endpoint (host:port); returns when it fails.");
    m.def("arch_records_layer_inputs", &arch_records_layer_inputs);

    py::class_<Sampling>(m, "Sampling")
        .def(py::init([](float temperature, int top_k, float top_p, float min_p, uint64_t seed) {
                 // sample_row needs at least one candidate left after the filters
                 if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
                     throw std::invalid_argument("temperature must be a finite number >= 0");
                 }
                 if (top_k < 0) {
                     throw std::invalid_argument("top_k must be >= 0");
                 }
                 if (!(top_p > 0.0f && top_p <= 1.0f)) {
                     throw std::invalid_argument("top_p must be in (0, 1]");
                 }
                 if (!(min_p >= 0.0f && min_p <= 1.0f)) {
                     throw std::invalid_argument("min_p must be in [0, 1]");
                 }
                 return Sampling{temperature, top_k, top_p, min_p, seed};
             }),
             py::arg("temperature") = 0.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f, py::arg("min_p") = 0.0f,
             py::arg("seed") = 0)
        .def_readonly("temperature", &Sampling::temperature)
        .def_readonly("top_k", &Sampling::top_k)
        .def_readonly("top_p", &Sampling::top_p)
        .def_readonly("min_p", &Sampling::min_p)
        .def_readonly("seed", &Sampling::seed);

    m.def("sample", [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, const Sampling & s,
                       uint64_t index) {
        if (logits.ndim() != 1 || logits.size() == 0 || logits.size() > INT32_MAX) {
            throw std::invalid_argument("sample needs one non-empty row of at most 2^31 - 1 logits");
        }
        std::vector<Candidate> cand;
        return sample_row(logits.data(), (int) logits.size(), s, index, cand);
    }, "Sample one token from a logits row exactly as the native step does.");

    py::class_<Model>(m, "Model")
        .def(py::init<const std::string &, int, bool, bool>(), py::arg("path"), py::arg("n_gpu_layers") = 0,
             py::arg("repack") = false, py::arg("verbose") = false,
             py::call_guard<py::gil_scoped_release>())
        .def_property("verbose", [](const Model & mm) { return mm.verbose.load(); },
                      [](Model & mm, bool v) { mm.verbose = v; })
        .def("meta", &Model::meta)
        .def("tokenize", &Model::tokenize, py::arg("text"), py::arg("add_special") = true,
             py::arg("parse_special") = false)
        .def("piece", &Model::piece, py::arg("tok"), py::arg("special") = false)
        .def("is_eog", [](const Model & mm, llama_token t) { return llama_vocab_is_eog(mm.vocab, t); })
        .def_property_readonly("arch", &Model::arch)
        .def_property_readonly("n_vocab", &Model::n_vocab)
        .def_property_readonly("n_embd", [](const Model & mm) { return llama_model_n_embd(mm.model); })
        .def_property_readonly("n_layer", [](const Model & mm) { return llama_model_n_layer(mm.model); })
        .def_property_readonly("n_ctx_train", [](const Model & mm) { return llama_model_n_ctx_train(mm.model); })
        .def_property_readonly("bos", [](const Model & mm) { return llama_vocab_bos(mm.vocab); })
        .def_property_readonly("eos", [](const Model & mm) { return llama_vocab_eos(mm.vocab); })
        .def_property_readonly("mask", [](const Model & mm) { return llama_vocab_mask(mm.vocab); })
        .def_property_readonly("size", [](const Model & mm) { return llama_model_size(mm.model); })
        .def_property_readonly("desc", [](const Model & mm) {
            char buf[256];
            llama_model_desc(mm.model, buf, sizeof(buf));
            return std::string(buf);
        });

    py::class_<Draft>(m, "Draft")
        .def_readonly("tokens", &Draft::tokens)
        .def_readonly("probs", &Draft::probs);

    py::class_<StepResult>(m, "StepResult")
        .def_readonly("tokens", &StepResult::tokens)
        .def_readonly("draft", &StepResult::draft)
        .def_readonly("n_accepted", &StepResult::n_accepted)
        .def_readonly("draft_ms", &StepResult::draft_ms)
        .def_readonly("verify_ms", &StepResult::verify_ms)
        .def_readonly("sample_ms", &StepResult::sample_ms)
        .def_readonly("step_ms", &StepResult::step_ms);

    py::class_<Session>(m, "Session")
        .def(py::init([](Model & target, Model * drafter, std::vector<int> layers, int n_ctx, int n_threads,
                         bool use_layer_api, bool flash_attn, bool verbose) {
                 return new Session(target, drafter, std::move(layers), n_ctx, n_threads, use_layer_api, flash_attn,
                                    verbose);
             }),
             py::arg("target"), py::arg("drafter"), py::arg("layers"), py::arg("n_ctx"), py::arg("n_threads"),
             py::arg("use_layer_api"), py::arg("flash_attn") = false, py::arg("verbose") = false,
             py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::call_guard<py::gil_scoped_release>())
        .def_property("verbose", [](const Session & ss) { return ss.verbose.load(); },
                      [](Session & ss, bool v) { ss.verbose = v; })
        .def_property_readonly("n_past", &Session::n_past)
        .def_property_readonly("n_ctx", &Session::context_size)
        .def_property_readonly("has_drafter", &Session::has_drafter)
        .def_property_readonly("uses_layer_api", &Session::uses_layer_api)
        .def("set_capture", &Session::set_capture)
        .def("truncate", &Session::truncate, py::call_guard<py::gil_scoped_release>())
        .def("prefill", &Session::prefill, py::arg("tokens"), py::arg("sampling"), py::arg("index"),
             py::call_guard<py::gil_scoped_release>())
        .def("draft", &Session::draft, py::arg("last"), py::arg("n_draft"), py::arg("with_probs") = false,
             py::call_guard<py::gil_scoped_release>())
        .def("step", &Session::step, py::arg("last"), py::arg("draft"), py::arg("sampling"), py::arg("index"),
             py::call_guard<py::gil_scoped_release>())
        .def("features", &Session::features)
        .def("logits", &Session::logits)
        .def("keep_draft_logits", &Session::keep_draft_logits)
        .def("draft_logits", &Session::draft_logits);
}
