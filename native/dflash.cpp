// The per-step work of DFlash speculative decoding, written directly against llama.cpp's C API.
//
// A Session owns a target context and, optionally, a DFlash drafter context that borrows the target's token
// embeddings and LM head (ctx_other). draft() proposes a block from the drafter; step() verifies a proposal (from
// this drafter or any other) with the target in one batch, accepts the longest agreeing prefix plus the target's own
// token, rolls back both caches (a recurrent target's state by snapshot, or by checkpoint and replay) and feeds the
// accepted positions' target features to the drafter.

#include "llama.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

// Declared in llama.cpp's src/llama-ext.h (C++ linkage, exported by libllama, absent from the public headers).
LLAMA_API void    llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid);
LLAMA_API int32_t llama_model_n_expert(const llama_model * model);
LLAMA_API int32_t llama_model_n_devices(const llama_model * model);
// llama.cpp's per-buffer-type memory report (same llama-ext.h; the struct's layout must match llama.cpp's)
struct llama_memory_breakdown_data {
    size_t model   = 0;  // weights
    size_t context = 0;  // KV cache
    size_t compute = 0;  // compute buffers
};
LLAMA_API std::map<ggml_backend_buffer_type_t, llama_memory_breakdown_data> llama_get_memory_breakdown(
    const llama_context * ctx);
// DFlash2: the drafter's selector lattice comes back in the "nextn" embeddings
LLAMA_API void    llama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked);
LLAMA_API float * llama_get_embeddings_nextn(llama_context * ctx);
LLAMA_API int32_t llama_model_dflash_selector_top_k(const llama_model * model);

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

// The buffer types -ot can name, as llama.cpp's common/arg.cpp lists them: each device's default buffer type.
static std::map<std::string, ggml_backend_buffer_type_t> buffer_types() {
    std::map<std::string, ggml_backend_buffer_type_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft) {
            out[ggml_backend_buft_name(buft)] = buft;
        }
    }
    return out;
}

// ggml's extra buffer types (CPU_REPACK, AMX, ...): where llama.cpp puts weights when use_extra_bufts is on, to run
// them with kernels that switch with the batch size. Listed so that a model's placement can be read back and checked.
static std::vector<std::string> extra_buffer_types() {
    std::vector<std::string> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
        for (ggml_backend_buffer_type_t * b = get ? get(dev) : nullptr; b && *b; ++b) {
            out.push_back(ggml_backend_buft_name(*b));
        }
    }
    return out;
}

// Where a model's weights go: the llama_model_params fields a user sets (llama.cpp's -ngl, -sm, -mg, -ts, -ot,
// --load-mode).
struct Placement {
    int n_gpu_layers = 0;
    int split_mode = LLAMA_SPLIT_MODE_LAYER;
    int main_gpu = 0;
    std::vector<float> tensor_split;                              // empty: llama.cpp's default split
    int load_mode = LLAMA_LOAD_MODE_AUTO;
    std::vector<std::pair<std::string, std::string>> overrides;  // tensor name regex -> buffer type name
    bool repack = false;
};

struct Model {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::atomic<bool> verbose;  // print llama.cpp's log during this model's calls
    const Placement placement;
    llama_model_params params;  // as given to llama.cpp (the pointers in it are not kept valid)

    const std::string path;

    Model(const std::string & path, const Placement & pl, bool verbose)
        : verbose(verbose), placement(pl), path(path) {
        LogScope log(verbose);
        params = model_params(pl);
        // kept alive through the load, which is the only time llama.cpp reads them
        std::vector<float> split(llama_max_devices(), 0.0f);
        std::copy(pl.tensor_split.begin(), pl.tensor_split.end(), split.begin());
        std::vector<llama_model_tensor_buft_override> ot;
        const auto bufts = buffer_types();
        for (auto & [pattern, name] : placement.overrides) {
            ot.push_back({pattern.c_str(), bufts.at(name)});
        }
        ot.push_back({nullptr, nullptr});
        llama_model_params mp = params;
        mp.tensor_split = pl.tensor_split.empty() ? nullptr : split.data();
        mp.tensor_buft_overrides = pl.overrides.empty() ? nullptr : ot.data();
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

    // Everything llama.cpp would abort or silently misread is refused here, before the load.
    static llama_model_params model_params(const Placement & pl) {
        if (pl.split_mode < LLAMA_SPLIT_MODE_NONE || pl.split_mode > LLAMA_SPLIT_MODE_TENSOR) {
            throw std::invalid_argument("unknown split mode " + std::to_string(pl.split_mode));
        }
        if (pl.load_mode < LLAMA_LOAD_MODE_AUTO || pl.load_mode > LLAMA_LOAD_MODE_DIRECT_IO) {
            throw std::invalid_argument("unknown load mode " + std::to_string(pl.load_mode));
        }
        if (pl.tensor_split.size() > llama_max_devices()) {
            throw std::invalid_argument("a tensor split of " + std::to_string(pl.tensor_split.size()) +
                                        " entries, but llama.cpp handles at most " +
                                        std::to_string(llama_max_devices()) + " devices");
        }
        for (float f : pl.tensor_split) {
            if (!(f >= 0.0f) || !std::isfinite(f)) {
                throw std::invalid_argument("tensor split proportions must be finite numbers >= 0");
            }
        }
        const auto bufts = buffer_types();
        for (auto & [pattern, name] : pl.overrides) {
            if (bufts.find(name) == bufts.end()) {
                std::string known;
                for (auto & b : bufts) {
                    known += (known.empty() ? "" : ", ") + b.first;
                }
                throw std::invalid_argument("unknown buffer type '" + name + "' (this build has: " + known + ")");
            }
            try {
                std::regex re(pattern);  // llama.cpp matches with std::regex_search: an invalid one throws inside
            } catch (const std::regex_error & e) {
                throw std::invalid_argument("invalid tensor pattern '" + pattern + "': " + e.what());
            }
        }
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = pl.n_gpu_layers;
        mp.split_mode = (llama_split_mode) pl.split_mode;
        mp.main_gpu = pl.main_gpu;
        mp.load_mode = (llama_load_mode) pl.load_mode;
        // repacked CPU weights switch kernels with the batch size, which changes rounding between a 1-token decode
        // and a verify batch; off keeps greedy verification bit-exact on CPUs
        mp.use_extra_bufts = pl.repack;
        return mp;
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

    // Whether the GGUF holds a tensor of this name: read from the file's header, since llama.cpp has no lookup by
    // name (a DSpark drafter is told from a DFlash one by its tensors, as upstream's speculative driver does).
    bool has_tensor(const std::string & name) const {
        gguf_init_params gp = {true, nullptr};
        gguf_context * g = gguf_init_from_file(path.c_str(), gp);
        if (!g) {
            return false;
        }
        const bool found = gguf_find_tensor(g, name.c_str()) >= 0;
        gguf_free(g);
        return found;
    }
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

// Further uniforms per generated token, independent of uniform(seed, index) and of each other: the redraw after a
// grammar refusal (stream 0), and rejection sampling's draft draw, acceptance test and residual draw (1, 2, 3).
static uint64_t second_seed(uint64_t seed, uint64_t stream = 0) {
    uint64_t z = seed ^ (0xD1B54A32D192ED03ull + stream * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCDull;
    z = (z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53ull;
    return z ^ (z >> 33);
}

class Sampler {
public:
    // The plain sampler: the Sampling parameters and no controls.
    Sampler(const Model & target, Sampling params) : params(params), n_vocab(target.n_vocab()), vocab(target.vocab) {}

    Sampler(const Model & target, Sampling params, std::vector<std::pair<llama_token, float>> logit_bias,
            Penalties penalties, const std::vector<llama_token> & prompt, const std::string & grammar_text,
            int n_logprobs)
        : Sampler(target, params) {
        for (const auto & [tok, b] : logit_bias) {
            check_token(tok);
            if (std::isnan(b) || b == INFINITY) {
                throw std::invalid_argument("a logit bias must be a number or -inf");
            }
        }
        if (penalties.last_n < 0) {
            throw std::invalid_argument("repeat_last_n must be >= 0");
        }
        if (!(penalties.repeat > 0.0f) || !std::isfinite(penalties.repeat) || !std::isfinite(penalties.freq) ||
            !std::isfinite(penalties.present)) {
            throw std::invalid_argument("repeat_penalty must be a number > 0, and the other penalties finite numbers");
        }
        for (llama_token t : prompt) {
            check_token(t);
        }
        bias = std::move(logit_bias);
        pen  = penalties;
        n_top = n_logprobs;
        const size_t from = prompt.size() > (size_t) pen.last_n ? prompt.size() - pen.last_n : 0;
        for (size_t i = from; pen.active() && i < prompt.size(); ++i) {
            remember(prompt[i]);
        }
        if (!grammar_text.empty()) {
            LogScope log(false);
            grammar = llama_sampler_init_grammar(vocab, grammar_text.c_str(), "root");
            if (!grammar) {
                std::string why;
                for (auto & line : log.tail) {
                    why += line;
                }
                while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) {
                    why.pop_back();
                }
                throw std::invalid_argument("the grammar does not parse" + (why.empty() ? "" : ": " + why));
            }
        }
    }

    ~Sampler() {
        if (grammar) {
            llama_sampler_free(grammar);
        }
    }
    Sampler(const Sampler &) = delete;
    Sampler & operator=(const Sampler &) = delete;

    bool has_grammar() const { return grammar != nullptr; }

    // Sample generated token number `index` from a target row, and take it in.
    llama_token next(const float * logits, uint64_t index, std::vector<Candidate> & cand) {
        const llama_token t = pick(logits, index, cand);
        take(logits, t);
        return t;
    }

    // Rejection sampling (speculative sampling with the drafter's distribution): accept the draft token x, drawn
    // from the drafter's distribution q, with probability min(1, p(x) / q(x)), p the distribution pick() draws from;
    // otherwise draw from the residual max(0, p - q), normalised. The result follows p whatever q is. The token is
    // taken in like next()'s.
    llama_token judge(const float * logits, llama_token x, const float * q, uint64_t index) {
        distribution(logits, p);
        llama_token t = x;
        if (!(uniform(second_seed(params.seed, 2), index) * q[x] < p[x])) {
            double z = 0.0;
            for (int i = 0; i < n_vocab; ++i) {
                z += std::max(0.0f, p[i] - q[i]);
            }
            // z > 0 whenever a rejection is possible (p(x) < q(x)); rounding aside, fall back to p itself
            const bool residual = z > 0.0;
            if (!residual) {
                z = 1.0;
            }
            const double target = uniform(second_seed(params.seed, 3), index) * z;
            double cum = 0.0;
            t = -1;
            for (int i = 0; i < n_vocab && t < 0; ++i) {
                cum += residual ? std::max(0.0f, p[i] - q[i]) : p[i];
                if (target < cum) {
                    t = i;
                }
            }
            if (t < 0) {  // the last token with mass, should rounding leave target at the very end
                for (t = n_vocab - 1; t > 0 && (residual ? p[t] - q[t] : p[t]) <= 0.0f; --t) {}
            }
        }
        take(logits, t);
        return t;
    }

    const Sampling & sampling() const { return params; }

    // The distribution pick() draws from, without a grammar: the row with biases and penalties, cut by top-k, top-p
    // (on the untempered softmax) and min-p, then tempered; probabilities over the vocabulary, 0 outside the cut.
    void distribution(const float * logits, std::vector<float> & out) {
        if (grammar || params.temperature <= 0.0f) {
            throw std::logic_error("rejection sampling needs a temperature > 0 and no grammar");
        }
        const float * x = controlled(logits);
        float lmin, lmax;
        logit_range(x, n_vocab, lmin, lmax);
        if (!std::isfinite(lmax)) {
            fail("no distribution to sample from (NaN or infinite logits)");
        }
        const bool  top_k = params.top_k > 0 && params.top_k < n_vocab;
        const bool  top_p = params.top_p < 1.0f;
        const float keep  = params.min_p > 0.0f ? lmax + std::log(params.min_p) : -INFINITY;
        auto better = [&](llama_token a, llama_token b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
        ranked.clear();
        if (top_k || top_p) {
            // Top-p alone ranks only the tokens within 40 nats of the best: the rest hold less than e^-40 of the mass
            // each, so even 10^9 of them cannot matter to a top_p below 1 by a float's precision.
            const float floor = top_k ? -INFINITY : lmax - 40.0f;
            for (int i = 0; i < n_vocab; ++i) {
                if (x[i] >= floor) {
                    ranked.push_back(i);
                }
            }
            if (top_k && (size_t) params.top_k < ranked.size()) {
                std::nth_element(ranked.begin(), ranked.begin() + params.top_k, ranked.end(), better);
                ranked.resize(params.top_k);
            }
            std::sort(ranked.begin(), ranked.end(), better);
            if (top_p) {
                double z = 0.0;  // over the candidates: the top-k, or the whole vocabulary
                if (top_k) {
                    for (llama_token i : ranked) z += std::exp((double) x[i] - lmax);
                } else {
                    for (int i = 0; i < n_vocab; ++i) z += std::exp((double) x[i] - lmax);
                }
                double cum = 0.0;
                size_t cut = ranked.size();
                for (size_t i = 0; i < ranked.size(); ++i) {
                    cum += std::exp((double) x[ranked[i]] - lmax);
                    if (cum >= params.top_p * z) {
                        cut = i + 1;
                        break;
                    }
                }
                ranked.resize(cut);
            }
            while (ranked.size() > 1 && x[ranked.back()] < keep) {
                ranked.pop_back();
            }
        } else {
            for (int i = 0; i < n_vocab; ++i) {
                if (x[i] >= keep) {
                    ranked.push_back(i);
                }
            }
        }
        out.assign(n_vocab, 0.0f);
        double zt = 0.0;
        for (llama_token i : ranked) {
            zt += temper(x[i], lmax, params.temperature);
        }
        for (llama_token i : ranked) {
            out[i] = (float) (temper(x[i], lmax, params.temperature) / zt);
        }
    }

    // Take in an emitted token: its logprobs, the penalty window and the grammar state.
    void take(const float * logits, llama_token t) {
        if (n_top >= 0) {
            logprobs.push_back(logprob_of(logits, t));
        }
        if (pen.active()) {
            remember(t);
        }
        if (grammar) {
            accept(grammar, t);
        }
    }

    // How many tokens at the start of `draft` the grammar allows, on a copy of its state.
    size_t grammar_prefix(const std::vector<llama_token> & draft) const {
        if (!grammar || draft.empty()) {
            return draft.size();
        }
        llama_sampler * g = llama_sampler_clone(grammar);
        size_t n = 0;
        while (n < draft.size() && allows(g, draft[n])) {
            accept(g, draft[n++]);
        }
        llama_sampler_free(g);
        return n;
    }

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
    std::vector<float> row;                            // the row with biases and penalties applied
    std::vector<llama_token_data> cur;                 // the row as the grammar sees it
    std::vector<float> kept;                           // the logits the grammar keeps, in vocabulary order
    std::vector<llama_token> kept_ids;
    std::vector<float> p;                              // judge(): the target's distribution at the row
    std::vector<llama_token> ranked;                   // distribution(): the kept tokens, best first when cut

    void check_token(llama_token t) const {
        if (t < 0 || t >= n_vocab) {
            throw std::out_of_range("token id " + std::to_string(t) + " outside the vocabulary (0.." +
                                    std::to_string(n_vocab - 1) + ")");
        }
    }

    // As llama.cpp's common sampler: draw without the grammar; if the grammar refuses that token, apply it to the
    // whole row and draw again (with an independent uniform, so the result follows the constrained distribution).
    llama_token pick(const float * logits, uint64_t index, std::vector<Candidate> & cand) {
        const float * x = controlled(logits);
        const llama_token t = sample_row(x, n_vocab, params, index, cand);
        if (!grammar || allows(grammar, t)) {
            return t;
        }
        cur.resize(n_vocab);
        for (int i = 0; i < n_vocab; ++i) {
            cur[i] = {i, x[i], 0.0f};
        }
        llama_token_data_array arr{cur.data(), (size_t) n_vocab, -1, false};
        llama_sampler_apply(grammar, &arr);
        kept.clear();
        kept_ids.clear();
        for (size_t i = 0; i < arr.size; ++i) {
            if (arr.data[i].logit != -INFINITY) {
                kept.push_back(arr.data[i].logit);
                kept_ids.push_back(arr.data[i].id);
            }
        }
        if (kept.empty()) {  // the grammar asks for text no token spells: the request's fault
            throw std::invalid_argument("the grammar allows no token here");
        }
        Sampling redraw = params;
        redraw.seed = second_seed(params.seed);
        return kept_ids[sample_row(kept.data(), (int) kept.size(), redraw, index, cand)];
    }

    // The row with the logit biases and penalties applied (a copy), or the row itself when there are none.
    const float * controlled(const float * logits) {
        if (bias.empty() && !pen.active()) {
            return logits;
        }
        row.assign(logits, logits + n_vocab);
        for (const auto & [tok, b] : bias) {
            row[tok] += b;
        }
        for (const auto & [tok, count] : counts) {
            float & l = row[tok];
            l = l <= 0 ? l * pen.repeat : l / pen.repeat;
            l -= float(count) * pen.freq + pen.present;
        }
        return row.data();
    }

    static bool allows(llama_sampler * g, llama_token t) {
        llama_token_data one{t, 1.0f, 0.0f};
        llama_token_data_array arr{&one, 1, -1, false};
        llama_sampler_apply(g, &arr);
        return arr.data[0].logit != -INFINITY;
    }

    // Only for a token allows() passed: llama.cpp aborts on an end-of-generation token its grammar does not allow.
    static void accept(llama_sampler * g, llama_token t) {
        try {
            llama_sampler_accept(g, t);
        } catch (const std::exception & e) {
            fail(std::string("the grammar refused token ") + std::to_string(t) + ": " + e.what());
        }
    }

    // llama.cpp's penalties sampler: a window of the last last_n tokens and their counts.
    void remember(llama_token t) {
        if ((int) window.size() >= pen.last_n) {
            const llama_token old = window.front();
            window.pop_front();
            auto it = std::find_if(counts.begin(), counts.end(), [&](const auto & c) { return c.first == old; });
            if (--it->second == 0) {
                *it = counts.back();
                counts.pop_back();
            }
        }
        window.push_back(t);
        auto it = std::find_if(counts.begin(), counts.end(), [&](const auto & c) { return c.first == t; });
        if (it == counts.end()) {
            counts.emplace_back(t, 1);
        } else {
            ++it->second;
        }
    }

    // The log-softmax of the target's row (before temperature and controls, as llama-server reports by default) at
    // the sampled token, and its n_top most likely tokens.
    TokenLogprob logprob_of(const float * logits, llama_token t) const {
        float lo, hi;
        logit_range(logits, n_vocab, lo, hi);
        double z = 0.0;
        for (int i = 0; i < n_vocab; ++i) {
            z += std::exp((double) logits[i] - hi);
        }
        const double log_z = hi + std::log(z);
        TokenLogprob r{t, (float) (logits[t] - log_z), {}};
        // a min-heap of the best n_top seen, in the one order the sampler uses (higher logit, then lower id)
        auto better = [&](llama_token a, llama_token b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        };
        std::vector<llama_token> heap;
        const size_t n = std::min<size_t>(n_top, n_vocab);
        for (int i = 0; i < n_vocab && n > 0; ++i) {
            if (heap.size() < n) {
                heap.push_back(i);
                std::push_heap(heap.begin(), heap.end(), better);
            } else if (better(i, heap.front())) {
                std::pop_heap(heap.begin(), heap.end(), better);
                heap.back() = i;
                std::push_heap(heap.begin(), heap.end(), better);
            }
        }
        std::sort(heap.begin(), heap.end(), better);
        for (llama_token i : heap) {
            r.top.emplace_back(i, (float) (logits[i] - log_z));
        }
        return r;
    }
};

// Draw from softmax(row / temperature) with uniform u, writing that distribution to q (rejection sampling's drafts).
// -1 for a row with no distribution (a NaN or infinite logit, from a drafter whose activations overflowed).
static llama_token draw_tempered(const float * row, int n_vocab, float temperature, double u, float * q) {
    float lmin, lmax;
    logit_range(row, n_vocab, lmin, lmax);
    if (!std::isfinite(lmax)) {
        return -1;
    }
    double z = 0.0;
    for (int i = 0; i < n_vocab; ++i) {
        z += temper(row[i], lmax, temperature);
    }
    if (!std::isfinite(z)) {  // a NaN logit that logit_range's compares passed over
        return -1;
    }
    const double target = u * z;
    double cum = 0.0;
    llama_token t = -1;
    for (int i = 0; i < n_vocab; ++i) {
        const double w = temper(row[i], lmax, temperature);
        q[i] = (float) (w / z);
        cum += w;
        if (t < 0 && target < cum) {
            t = i;
        }
    }
    return t < 0 ? argmax(row, n_vocab) : t;
}

// ---------------------------------------------------------------------------------------------------------------
// Session: target context, optional drafter context, and the speculative step.

struct Draft {
    std::vector<llama_token> tokens;      // the proposed tokens
    std::vector<float>       probs;       // the drafter's probability of each (when asked for)
    // The drafter's own estimate that each token is accepted, where it gives one at no cost: a DSpark confidence
    // head's output, DFlash2's selector probability along its path; empty for a plain DFlash drafter.
    std::vector<float>       confidence;
};

struct StepResult {
    std::vector<llama_token> tokens;       // accepted draft tokens followed by the target's own token
    std::vector<llama_token> draft;        // the proposal verified (cut where the context or the batch ends)
    int    n_accepted = 0;                 // accepted draft tokens (len(tokens) - 1)
    double draft_ms   = 0.0;               // drafter compute: feature injection (0: deferred to the next draft)
    double verify_ms  = 0.0;               // target compute: the verify batch
    double sample_ms  = 0.0;               // sampling the verify rows, one per token in `tokens`
    double head_ms    = 0.0;               // of verify_ms: the LM head of the rows computed on demand (CPU targets)
    int    head_rows  = 0;                 // those rows (0: llama.cpp computed every row's logits)
    double rollback_ms = 0.0;              // dropping the rejected drafts from the target (checkpoint and replay too)
    double step_ms    = 0.0;               // whole native step, sampling and bookkeeping included
    std::string rollback;                  // how they were dropped: "" (none rejected), "kv", "snapshot", "checkpoint"
};

// The llama_context_params fields a user sets (llama.cpp's -c, -b, -ub, -t, -tb, -fa, -ctk, -ctv, -ctkd, -ctvd).
struct ContextOptions {
    int n_ctx = 4096;  // 0: the model's trained context
    int n_batch = 512;  // the most tokens one target decode takes: a prompt chunk or a verify block
    int n_ubatch = 512;
    int n_threads = 1;
    int n_threads_batch = 1;
    int flash_attn = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    ggml_type type_k_draft = GGML_TYPE_F32;  // f32: drafts equal to a float32 reference implementation
    ggml_type type_v_draft = GGML_TYPE_F32;
    int n_rs_seq = -1;  // recurrent-state snapshots for rolling back drafts (-1: the drafter's longest draft)
    int n_seq = 1;      // independent sequences in the target's cache (training data decodes several side by side)
};

// KV cache types as llama.cpp's common/arg.cpp offers them, by ggml's names.
static ggml_type cache_type(const std::string & name) {
    for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
                        GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1}) {
        if (name == ggml_type_name(t)) {
            return t;
        }
    }
    throw std::invalid_argument("unknown KV cache type '" + name + "'");
}

// Errors: bad arguments raise ValueError or IndexError before anything changes. A llama.cpp failure raises
// NativeError, and the call that failed leaves the caches as they were at its start: both hold exactly the positions
// [0, n_past) they held before (the drafter may also hold a stale noise block past them, which it always clears
// before use). Should llama.cpp refuse even that rollback, or the target have recurrent memory (whose state at the
// call's start is gone), both caches are emptied and n_past is 0. Either way the session stays usable and n_past
// says what the caches hold.
class Session {
public:
    // opt.n_rs_seq: recurrent-state snapshots kept for rolling back drafts (-1: the longest draft of the drafter);
    // only architectures whose llama.cpp supports them keep any, the others roll back by checkpoint and replay.
    Session(Model & target, Model * drafter, std::vector<int> layers, const ContextOptions & opt, bool use_layer_api,
            bool verbose)
        : tgt(target), dft(drafter), layers(std::move(layers)), layer_api(use_layer_api), verbose(verbose) {
        LogScope log(verbose);
        check_arguments(opt);
        try {
            create_contexts(opt, opt.n_rs_seq < 0 ? max_draft : opt.n_rs_seq);
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
    const Model & target() const { return tgt; }
    int context_size() const { return n_ctx; }
    bool has_drafter() const { return ctx_dft != nullptr; }
    bool uses_layer_api() const { return layer_api; }
    int batch_size() const { return n_batch; }
    int ubatch_size() const { return (int) llama_n_ubatch(ctx_tgt); }
    int threads() const { return llama_n_threads(ctx_tgt); }
    int threads_batch() const { return llama_n_threads_batch(ctx_tgt); }

    // llama.cpp's memory report for one context ("target" or "drafter"): bytes of weights, KV cache and compute
    // buffers per buffer type (CPU, CUDA0, ...). The drafter's includes its own weights, not the target's it borrows.
    std::vector<std::tuple<std::string, size_t, size_t, size_t>> memory(const std::string & which) const {
        const llama_context * ctx = which == "target" ? ctx_tgt : which == "drafter" ? ctx_dft : nullptr;
        if (which != "target" && which != "drafter") {
            throw std::invalid_argument("memory of 'target' or 'drafter', not '" + which + "'");
        }
        std::vector<std::tuple<std::string, size_t, size_t, size_t>> out;
        if (ctx) {
            for (auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
                out.emplace_back(ggml_backend_buft_name(buft), mb.model, mb.context, mb.compute);
            }
        }
        return out;
    }
    bool is_recurrent() const { return recurrent; }
    int snapshots() const { return n_rs; }
    int pending_rows() const { return n_pending; }
    int checkpoint_pos() const { return prompt_ckpt_pos; }

    // With capture off the target runs as plain decoding (the baseline): no features, no drafter updates.
    void set_capture(bool on) { capture = on; }

    // Whether verify batches of a CPU target compute their LM head only for the rows the accept loop reaches (on by
    // default where the target's graph allows it; off: llama.cpp computes every row's logits in the batch).
    void set_head_on_demand(bool on) { head_on_demand = on; }
    bool head_on_demand_active() const { return head_on_demand && head_w; }

    // Forget everything from position n on, in both caches (n = 0 starts afresh; n > 0 reuses a cached prefix).
    // A recurrent state cannot be cut anywhere: a recurrent target goes back to 0 or to its checkpoint only.
    void truncate(int n) {
        if (n < 0 || n > past) {
            throw std::out_of_range("truncate position " + std::to_string(n) + " outside the " + std::to_string(past) +
                                    " cached tokens");
        }
        if (recurrent && n != 0 && n != past && n != prompt_ckpt_pos) {
            throw std::invalid_argument("the recurrent target can go back to position 0 or " +
                                        std::to_string(prompt_ckpt_pos) + " (its checkpoint), not " +
                                        std::to_string(n));
        }
        LogScope log(verbose);
        if (!keep(n)) {
            fail("the KV cache could not drop the positions from " + std::to_string(n) +
                 " on; both caches were emptied");
        }
    }

    // Decode tokens after the cached ones, feed their features to the drafter and sample the next token
    // (generated token number `index`); without a sampler (a prompt chunk before the last), sample nothing: -1.
    llama_token prefill(const std::vector<llama_token> & tokens, Sampler * s, uint64_t index) {
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
                    defer(past, (int) n);
                }
                past += (int) n;
            }
            if (!s) {
                return LLAMA_TOKEN_NULL;
            }
            return s->next(logits_row(ctx_tgt, -1, "target"), index, cand);
        });
    }

    // Save the target's recurrent state at the current position: truncate() can come back to it later (one
    // checkpoint, replacing the previous one). A no-op for targets without recurrent memory.
    void checkpoint() {
        if (!recurrent) {
            return;
        }
        LogScope log(verbose);
        save_state(prompt_ckpt);
        prompt_ckpt_pos = past;
    }

    // The llama.cpp drafter's proposal for up to n_draft tokens after `last` (the newest token, not yet in the
    // caches), at most a block.
    // With a sampler (rejection sampling) each draft token is drawn from the drafter's distribution at the
    // sampler's temperature instead of taken as its argmax, with the uniform of generated token index + i at draft
    // position i; the distributions are kept for step(..., rejection = true).
    Draft draft(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index) {
        if (!ctx_dft) {
            throw std::logic_error("this session has no llama.cpp drafter");
        }
        if (sampler && sampler->sampling().temperature <= 0.0f) {
            throw std::invalid_argument("sampled drafts need a temperature > 0");
        }
        if (sampler && top_k > 0) {
            throw std::invalid_argument("rejection sampling needs the drafter's distributions: a DFlash2 drafter "
                                        "drafts from its selector lattice");
        }
        if (sampler && dspark) {
            throw std::invalid_argument("rejection sampling needs the drafter's distributions: a DSpark drafter "
                                        "chains its Markov head on greedy drafts");
        }
        check_tokens({last});
        return transaction([&] {
            Draft d;
            q_tokens.clear();
            if (n_draft > 0) {
                flush();
                draft_block(last, std::min(n_draft, max_draft), with_probs, sampler, index, d);
            }
            return d;
        });
    }

    // One speculative step: verify `draft` (any drafter's proposal, possibly empty) after `last`, the newest token,
    // not yet in the caches.
    // The sampler takes in the emitted tokens; should the step fail, it is not rolled back with the caches.
    // rejection: verify by rejection sampling against the distributions of this session's last sampled draft
    // (draft() with a sampler), which `draft` must be (a prefix of). head_rows: the verify rows the caller expects
    // to read (its expected accepted drafts + 1), the first batch of the LM head where it runs on demand.
    StepResult step(llama_token last, const std::vector<llama_token> & draft, Sampler & s, uint64_t index,
                    bool rejection, int head_rows = 1) {
        check_tokens({last});
        head_first = std::max(head_rows, 1);
        check_tokens(draft);
        if (past + 1 > n_ctx) {
            throw std::length_error("context is full");
        }
        if (rejection) {
            if (s.has_grammar() || s.sampling().temperature <= 0.0f) {
                throw std::invalid_argument("rejection sampling needs a temperature > 0 and no grammar");
            }
            if (draft.size() > q_tokens.size() || !std::equal(draft.begin(), draft.end(), q_tokens.begin())) {
                throw std::invalid_argument("rejection sampling verifies the draft this session last sampled");
            }
        }
        StepResult r = transaction([&] { return step_unchecked(last, draft, s, index, rejection); });
        q_tokens.clear();  // its distributions are spent
        return r;
    }

    // Logits of one output row of the last target decode (rows of a verify batch: 0 = after `last`).
    py::array_t<float> logits(int row) {
        if (row < -n_out || row >= n_out) {
            throw std::out_of_range("row " + std::to_string(row) + " outside the " + std::to_string(n_out) +
                                    " output rows of the last target decode");
        }
        LogScope log(verbose);
        const int n_vocab = tgt.n_vocab();
        const float * src = target_row(row);
        py::array_t<float> out(n_vocab);
        std::memcpy(out.mutable_data(), src, n_vocab * sizeof(float));
        return out;
    }

    // Keep the logits of every noise block, for draft_logits() (parity checks and analysis; costs a copy).
    void keep_draft_logits(bool on) { keep_draft = on; }

    // Logits of the drafter's last noise block at its draft positions: [n, n_vocab] (DFlash2: after its logit
    // scale and soft-capping, which the selector reads).
    py::array_t<float> draft_logits() const {
        const size_t n_vocab = tgt.n_vocab();
        const size_t n = draft_rows.size() / n_vocab;
        py::array_t<float> out({n, n_vocab});
        std::memcpy(out.mutable_data(), draft_rows.data(), draft_rows.size() * sizeof(float));
        return out;
    }

    // DFlash2: the selector lattice of the drafter's last noise block at its draft positions (kept with the logits):
    // [n, top_k * (top_k + 1)], each row the top_k candidate ids then the top_k x top_k scores (see walk_lattice).
    py::array_t<float> draft_lattice() const {
        const size_t w = (size_t) top_k * (top_k + 1);
        py::array_t<float> out({w ? lattice_rows.size() / w : 0, w});
        std::memcpy(out.mutable_data(), lattice_rows.data(), lattice_rows.size() * sizeof(float));
        return out;
    }

    // Training data (traindata.py): one target batch of rows from several independent sequences (a token, its
    // position and its sequence each), logits on every row. Returns each row's top_k tokens by logit, best first, and
    // their log-probabilities; features() then holds the rows' features. The cache bookkeeping is the caller's:
    // n_past is left alone (a session is used either this way or for generation, never both).
    std::pair<py::array_t<int32_t>, py::array_t<float>> decode_rows(const std::vector<llama_token> & tokens,
                                                                  const std::vector<int> & pos,
                                                                  const std::vector<int> & seq, int top_k) {
        const int n = (int) tokens.size();
        if (n == 0 || n > n_batch || (int) pos.size() != n || (int) seq.size() != n) {
            throw std::invalid_argument("decode_rows needs 1.." + std::to_string(n_batch) +
                                        " rows with a position and a sequence each");
        }
        const int n_vocab = tgt.n_vocab();
        if (top_k < 1 || top_k > n_vocab) {
            throw std::invalid_argument("top_k must be 1.." + std::to_string(n_vocab));
        }
        const int n_seq = (int) llama_n_seq_max(ctx_tgt);
        for (int i = 0; i < n; ++i) {
            if (seq[i] < 0 || seq[i] >= n_seq || pos[i] < 0 || pos[i] >= n_ctx) {
                throw std::out_of_range("row " + std::to_string(i) + ": sequence " + std::to_string(seq[i]) +
                                        " position " + std::to_string(pos[i]) + " outside " +
                                        std::to_string(n_seq) + " sequences in a context of " + std::to_string(n_ctx));
            }
        }
        check_tokens(tokens);
        LogScope log(verbose);
        llama_batch_ext_clear(batch_tgt);
        for (int i = 0; i < n; ++i) {
            add_token(batch_tgt, tokens[i], pos[i], true, seq[i]);
        }
        run_target(n, n);
        std::vector<int32_t> ids((size_t) n * top_k);
        std::vector<float> logprobs((size_t) n * top_k);
        std::vector<const float *> rows(n);
        for (int i = 0; i < n; ++i) {
            rows[i] = logits_row(ctx_tgt, i, "target");  // may throw: here, not in a worker
        }
        auto rank_rows = [&](int i0, int i1) {
            std::vector<std::pair<float, llama_token>> best;
            for (int i = i0; i < i1; ++i) {
                const float * row = rows[i];
                // the top_k by a running threshold: one pass over the vocabulary, as cheap as an argmax for small k
                best.clear();
                float lmax = row[0];
                for (int t = 0; t < n_vocab; ++t) {
                    lmax = std::max(lmax, row[t]);
                    if ((int) best.size() < top_k || row[t] > best.front().first) {
                        best.emplace_back(row[t], -t);  // -t: among equal logits the lower id ranks first
                        std::push_heap(best.begin(), best.end(), std::greater<>());
                        if ((int) best.size() > top_k) {
                            std::pop_heap(best.begin(), best.end(), std::greater<>());
                            best.pop_back();
                        }
                    }
                }
                float z = 0.0f;
                for (int t = 0; t < n_vocab; ++t) {
                    z += exp_approx(std::max(row[t] - lmax, -87.0f));
                }
                const float lse = lmax + std::log(z);
                std::sort(best.begin(), best.end(), std::greater<>());
                for (int j = 0; j < top_k; ++j) {
                    ids[(size_t) i * top_k + j] = -best[j].second;
                    logprobs[(size_t) i * top_k + j] = best[j].first - lse;
                }
            }
        };
        // rows are independent; with the target on a GPU this ranking is most of the CPU's work per batch, so it is
        // spread over the batch threads (each row's result does not depend on the split)
        const int n_workers = std::max(1, std::min(n / 8, (int) llama_n_threads_batch(ctx_tgt)));
        std::vector<std::thread> workers;
        for (int w = 1; w < n_workers; ++w) {
            workers.emplace_back(rank_rows, n * w / n_workers, n * (w + 1) / n_workers);
        }
        rank_rows(0, n / n_workers);
        for (auto & t : workers) {
            t.join();
        }
        py::gil_scoped_acquire gil;  // the call runs without the GIL; numpy arrays need it
        py::array_t<int32_t> ids_out({n, top_k});
        py::array_t<float> lp_out({n, top_k});
        std::memcpy(ids_out.mutable_data(), ids.data(), ids.size() * sizeof(int32_t));
        std::memcpy(lp_out.mutable_data(), logprobs.data(), logprobs.size() * sizeof(float));
        return {ids_out, lp_out};
    }

    // Forget every position of one sequence of decode_rows.
    void drop_sequence(int seq) {
        if (seq < 0 || seq >= (int) llama_n_seq_max(ctx_tgt)) {
            throw std::out_of_range("no sequence " + std::to_string(seq));
        }
        LogScope log(verbose);
        if (!llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq, -1, -1)) {
            fail("the KV cache could not drop sequence " + std::to_string(seq));
        }
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
    // LogitsOnDemand: every row is an output, its LM head computed when target_row() first reads it (CPU targets)
    enum Logits { LogitsNone, LogitsLast, LogitsAll, LogitsOnDemand };

    static constexpr int max_block = 512;
    static constexpr int max_seq = 256;  // llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h, not in llama.h)

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
    int top_k = 0;  // DFlash2: candidates per position in the selector lattice; 0 for a plain DFlash drafter
    // DSpark: a Markov head biases each block slot's logits by the previous slot's argmax (in llama.cpp's graph);
    // anchor-first blocks draft from the anchor's slot on, and a confidence head rates each slot's draft
    bool dspark = false;
    bool dspark_conf = false;
    bool anchor_first = false;
    // the longest draft of one block: block_size - 1, or block_size when anchor-first. The same rule as the
    // engine's (validate.py, DraftSpec.longest_draft), kept here because draft() must bound the n_draft it is given
    // by the block this drafter decodes, whatever its caller asks, and the default n_rs_seq needs it
    int max_draft = 0;
    bool keep_draft = false;
    std::vector<float> draft_rows;  // [n_draft, n_vocab] logits of the last noise block, when kept
    std::vector<float> q_rows;          // [n_draft, n_vocab] the drafter's distributions of the last sampled draft
    std::vector<llama_token> q_tokens;  // that draft (empty once verified, or after an argmax draft)
    std::vector<float> lattice_rows;  // DFlash2: [n_draft, top_k * (top_k + 1)] of the last noise block, when kept
    int n_ctx = 0;
    int n_batch = 0;  // the most tokens one target decode takes
    int n_embd = 0;
    int past = 0;
    int n_out = 0;  // output (logits) rows of the last target decode

    // Recurrent (and hybrid) targets: their recurrent state cannot drop positions like a KV cache. llama.cpp keeps
    // per-token snapshots of the last decode (n_rs of them, where the architecture supports it); a rollback longer
    // than that restores a checkpoint taken before the verify batch and decodes the accepted tokens again.
    bool recurrent = false;
    int n_rs = 0;
    std::vector<uint8_t> step_ckpt;    // the recurrent state before the current verify batch
    std::vector<uint8_t> prompt_ckpt;  // the recurrent state at prompt_ckpt_pos, for the prefix cache
    int prompt_ckpt_pos = -1;
    bool collecting = false;           // the eval callback copies features only during decode_target

    std::vector<float> feats;     // [feat_rows, layers.size() * n_embd] from the last target decode
    int feat_rows = 0;
    // Deferred injection (defer): the drafter's cache holds the features of positions [0, dft_past), `pending` those
    // of [dft_past, dft_past + n_pending), at most one drafter batch.
    std::vector<float> pending;
    int n_pending = 0;
    int dft_past = 0;
    std::vector<int> rows_seen;   // eval-callback path: rows copied so far per layer (ubatches arrive in order)
    std::vector<float> cb_rows;   // eval-callback path: one layer's rows on their way from the backend
    std::vector<std::pair<float, llama_token>> cand;

    // LM head on demand. On a CPU a verify row's LM head costs as much as the rest of the row for a big vocabulary
    // and small model (gemma-3-270m: 262,144 x 640, docs/measurements.md), and the rows after the first rejected draft
    // are never read. So a verify batch stops after the final norm ("result_norm", the eval callback returns false
    // there) and target_row() multiplies a row by the target's own output matrix, with the same ggml CPU kernel as
    // its graph, when the accept loop first reads it. Batch-invariant CPU matmuls give each row the bits llama.cpp
    // would have written (tests/test_head.py). The matrix is found in the graph of the first decode with outputs:
    // on only where "result_output" is the graph's last node and a plain matmul of "result_norm" by a matrix in
    // host memory (no soft-capping or scale after it), and the whole target is on the CPU.
    bool head_on_demand = true;
    bool head_probed = false;          // the first decode with outputs looked for the matrix
    bool probing = false;              // the eval callback is looking for it in this decode
    ggml_tensor * probe_prev = nullptr;  // the node asked before
    ggml_tensor * probe_w = nullptr;
    int probe_tail = 0;                // nodes asked after the head
    ggml_tensor * head_w = nullptr;    // the target's output matrix; null: llama.cpp computes the logits
    ggml_backend_t head_cpu = nullptr;
    ggml_backend_set_n_threads_t head_set_threads = nullptr;
    bool lazy = false;                 // this decode stops after the final norm
    std::vector<float> hidden;         // [n_rows, n_embd] final-norm rows of the last on-demand decode
    int norm_seen = 0;                 // rows of them the eval callback copied
    int hidden_rows = 0;               // 0: the last decode's logits are llama.cpp's
    std::vector<float> head_logits;    // [hidden_rows, n_vocab], rows [0, head_done) computed
    int head_done = 0;
    int head_first = 1;                // rows of the first head call (step's head_rows)
    double head_ms = 0.0;              // time in compute_head since the step began

    // Logits of row i of the last target decode (llama.cpp's batch index; negative: from the last output).
    const float * target_row(int i) {
        if (hidden_rows == 0) {
            return logits_row(ctx_tgt, i, "target");
        }
        i = i < 0 ? i + hidden_rows : i;  // on demand, every row is an output
        if (i < 0 || i >= hidden_rows) {
            fail("no target logits for output row " + std::to_string(i));
        }
        if (i >= head_done) {
            // rows are read in order: first the head_first rows the step's caller expects to read, then as many
            // more as have been read (doubling): a call costs a few ms beyond its rows (docs/measurements.md), so a
            // batch whose drafts are accepted pays a few calls, and one rejected early one or two rows
            const int end = std::min(hidden_rows, std::max(i + 1, head_done ? 2 * head_done : head_first));
            compute_head(head_done, end);
            head_done = end;
        }
        return &head_logits[(size_t) i * tgt.n_vocab()];
    }

    void compute_head(int i0, int i1) {
        const auto t0 = std::chrono::steady_clock::now();
        const int n_vocab = tgt.n_vocab();
        const int r = i1 - i0;
        if (!head_cpu) {
            ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
            head_cpu = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
            if (!head_cpu) {
                fail("could not start a CPU backend for the LM head");
            }
            head_set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
                ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
        }
        if (head_set_threads) {
            head_set_threads(head_cpu, (int) (r > 1 ? llama_n_threads_batch(ctx_tgt) : llama_n_threads(ctx_tgt)));
        }
        ggml_init_params ip = {ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(8, false), nullptr, true};
        ggml_context * g = ggml_init(ip);
        if (!g) {
            fail("could not allocate the LM head's graph");
        }
        ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_embd, r);
        x->data = &hidden[(size_t) i0 * n_embd];
        ggml_tensor * y = ggml_mul_mat(g, head_w, x);
        y->data = &head_logits[(size_t) i0 * n_vocab];
        ggml_cgraph * gf = ggml_new_graph_custom(g, 8, false);
        ggml_build_forward_expand(gf, y);
        const ggml_status st = ggml_backend_graph_compute(head_cpu, gf);
        ggml_free(g);
        if (st != GGML_STATUS_SUCCESS) {
            fail("the LM head failed (ggml status " + std::to_string((int) st) + ")");
        }
        head_ms += ms_since(t0);
    }

    // Everything llama.cpp would assert on (and abort the process) is checked here, before any context exists.
    void check_arguments(const ContextOptions & o) {
        if (o.n_rs_seq > o.n_batch) {  // a snapshot per token of one decode at most
            throw std::invalid_argument("n_rs_seq must be at most n_batch (" + std::to_string(o.n_batch) + "), got " +
                                        std::to_string(o.n_rs_seq));
        }
        if (o.n_ctx != 0 && o.n_ctx < 2) {
            throw std::invalid_argument("n_ctx must be 0 (the model's) or at least 2, got " + std::to_string(o.n_ctx));
        }
        if (o.n_seq < 1 || o.n_seq > max_seq || (o.n_seq > 1 && dft)) {
            throw std::invalid_argument("n_seq must be 1.." + std::to_string(max_seq) +
                                        ", and 1 with a drafter, got " + std::to_string(o.n_seq));
        }
        if (o.n_threads < 1 || o.n_threads_batch < 1) {
            throw std::invalid_argument("thread counts must be at least 1");
        }
        if (o.n_batch < 1 || o.n_ubatch < 1 || o.n_ubatch > o.n_batch) {
            throw std::invalid_argument("need 1 <= n_ubatch <= n_batch, got n_batch " + std::to_string(o.n_batch) +
                                        ", n_ubatch " + std::to_string(o.n_ubatch));
        }
        if (o.flash_attn < LLAMA_FLASH_ATTN_TYPE_AUTO || o.flash_attn > LLAMA_FLASH_ATTN_TYPE_ENABLED) {
            throw std::invalid_argument("flash_attn must be -1 (auto), 0 (off) or 1 (on)");
        }
        // llama.cpp refuses these with a log line and no context; say why instead
        if (o.flash_attn == LLAMA_FLASH_ATTN_TYPE_DISABLED &&
            (ggml_is_quantized(o.type_v) || (dft && ggml_is_quantized(o.type_v_draft)))) {
            throw std::invalid_argument("a quantized V cache needs flash attention (flash_attn on or auto)");
        }
        recurrent = llama_model_is_recurrent(tgt.model) || llama_model_is_hybrid(tgt.model);
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
        if (block_size < 2 || block_size > max_block) {
            throw std::invalid_argument("the drafter's block size '" + bs + "' is outside 2.." +
                                        std::to_string(max_block));
        }
        top_k = std::max(0, llama_model_dflash_selector_top_k(dft->model));
        dspark = dft->has_tensor("markov_w1.weight");
        dspark_conf = dspark && dft->has_tensor("conf_proj.weight");
        // as llama.cpp's graph reads it: absent means anchor-first
        anchor_first = dspark && dft->meta("dflash.sample_from_anchor") != "false";
        max_draft = anchor_first ? block_size : block_size - 1;
    }

    void create_contexts(const ContextOptions & o, int n_rs_seq) {
        llama_context_params cp = context_params(o, o.n_ctx, o.n_batch, o.n_ubatch);
        cp.type_k = o.type_k;
        cp.type_v = o.type_v;
        // llama.cpp sets it back to 0 for architectures without snapshot rollback (qwen3next, mamba, rwkv, ...)
        cp.n_rs_seq = recurrent ? (uint32_t) n_rs_seq : 0;
        // Sequences share one unified cache: with a stream per sequence llama.cpp regroups a batch's rows by
        // sequence, and the eval callback needs them in batch order.
        cp.n_seq_max = (uint32_t) o.n_seq;
        cp.kv_unified = o.n_seq > 1;
        // A GPU build offloads large batches (the prompt) of a CPU-resident model to the GPU, whose kernels round
        // differently from the CPU's: on an H100 this broke bit-exact verification at -ngl 0. A target kept on the
        // CPU computes on the CPU.
        cp.op_offload = tgt.params.n_gpu_layers != 0;
        if ((!layers.empty() && !layer_api) || tgt.params.n_gpu_layers == 0) {  // features, or the LM head on demand
            cp.cb_eval           = eval_cb;
            cp.cb_eval_user_data = this;
        }
        ctx_tgt = llama_init_from_model(tgt.model, cp);
        if (!ctx_tgt) {
            fail("failed to create the target context");
        }
        n_ctx = (int) llama_n_ctx(ctx_tgt);
        n_batch = (int) llama_n_batch(ctx_tgt);  // at most n_ctx: llama.cpp caps it for causal attention
        n_rs = (int) llama_n_rs_seq(ctx_tgt);
        // llama.cpp keeps a decode's last n_rs + 1 tokens in one ubatch for its snapshots, and aborts the process
        // when a ubatch cannot hold them
        if (n_rs > 0 && (int) llama_n_ubatch(ctx_tgt) < n_rs + 2) {
            throw std::invalid_argument("with " + std::to_string(n_rs) + " recurrent-state snapshots (n_rs_seq) the "
                                        "ubatch must hold at least " + std::to_string(n_rs + 2) + " tokens, not " +
                                        std::to_string(llama_n_ubatch(ctx_tgt)));
        }
        batch_tgt = new_batch(ctx_tgt);
        if (layer_api) {
            for (int lid : layers) {
                llama_set_embeddings_layer_inp(ctx_tgt, (uint32_t) lid, true);
            }
        }
        if (!dft) {
            return;
        }
        // The noise block reaches past the target's last position. The drafter attends non-causally, and llama.cpp
        // then needs every batch in one ubatch: the drafter's batch and ubatch are equal and hold a whole target
        // batch's features or a noise block.
        const int n_dft_batch = std::max(n_batch, block_size);
        llama_context_params dp = context_params(o, n_ctx + block_size, n_dft_batch, n_dft_batch);
        dp.ctx_other = ctx_tgt;
        dp.type_k = o.type_k_draft;
        dp.type_v = o.type_v_draft;
        ctx_dft = llama_init_from_model(dft->model, dp);
        if (!ctx_dft) {
            fail("failed to create the drafter context");
        }
        if ((int) llama_n_ubatch(ctx_dft) < n_dft_batch) {
            fail("the drafter context's batch is too small");
        }
        batch_dft = new_batch(ctx_dft);
        llama_set_causal_attn(ctx_dft, dft->meta("dflash.attention.causal") == "true");
        if (top_k > 0 || dspark_conf) {
            // one lattice (DFlash2) or confidence (DSpark) row per block token, whether or not the token is a logits
            // output (unmasked)
            llama_set_embeddings_nextn(ctx_dft, true, false);
        }
    }

    static llama_context_params context_params(const ContextOptions & o, int n_ctx, int n_batch, int n_ubatch) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx           = n_ctx;
        cp.n_batch         = n_batch;
        cp.n_ubatch        = n_ubatch;
        cp.n_threads       = o.n_threads;
        cp.n_threads_batch = o.n_threads_batch;
        cp.no_perf         = true;
        // the CPU flash-attention kernel rounds through f16, and differently for one query than for a block
        cp.flash_attn_type = (llama_flash_attn_type) o.flash_attn;
        // Rollback relies on it (gemma3 and SWA drafters): a sliding-window cache of only the window (swa_full off)
        // evicts the positions that fell out of the window of a verify batch's last token, and after rejected
        // tokens are dropped the next token's window needs some of them again. (llama.cpp's default, pinned.)
        cp.swa_full        = true;
        return cp;
    }

    void free_all() {
        if (head_cpu) ggml_backend_free(head_cpu);
        head_cpu = nullptr;
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
            // decodes only add positions from p0 on, and rollbacks only drop them, so [0, p0) is intact; a
            // recurrent state may have moved past p0 with past unchanged, and is emptied
            feat_rows = 0;
            n_out = 0;
            collecting = false;
            draft_rows.clear();
            q_tokens.clear();
            lattice_rows.clear();
            keep(recurrent ? 0 : p0);
            throw;
        }
    }

    // Make both caches hold the positions [0, n) only. If llama.cpp refuses to drop part of a sequence, empty both
    // and return false. A recurrent target's state is only known at past and at its checkpoint: elsewhere (a failed
    // call going back to its start, after decoding) it is emptied too.
    bool keep(int n) {
        bool ok = true;
        if (recurrent && n != past && n != 0) {
            ok = n == prompt_ckpt_pos && restore_state(prompt_ckpt);
        }
        ok = ok && llama_memory_seq_rm(llama_get_memory(ctx_tgt), 0, n, -1);
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
        // deferred features of dropped positions go with them
        dft_past = std::min(dft_past, past);
        n_pending = std::clamp(past - dft_past, 0, n_pending);
        if (prompt_ckpt_pos > past) {
            prompt_ckpt_pos = -1;
            prompt_ckpt.clear();
        }
        return ok;
    }

    static constexpr llama_state_seq_flags partial = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;

    // The target's recurrent state (not its attention KV cache, which drops positions by itself).
    void save_state(std::vector<uint8_t> & buf) {
        buf.resize(llama_state_seq_get_size_ext(ctx_tgt, 0, partial));
        if (buf.empty() || llama_state_seq_get_data_ext(ctx_tgt, buf.data(), buf.size(), 0, partial) != buf.size()) {
            fail("could not save the target's recurrent state");
        }
    }

    bool restore_state(const std::vector<uint8_t> & buf) {
        return !buf.empty() && llama_state_seq_set_data_ext(ctx_tgt, buf.data(), buf.size(), 0, partial) == buf.size();
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

    static void add_token(llama_batch_ext * b, llama_token t, llama_pos pos, bool logits, llama_seq_id seq = 0) {
        const int32_t idx = llama_batch_ext_add_token(b, seq, t);
        if (idx < 0 || !llama_batch_ext_set_pos(b, idx, &pos) || !llama_batch_ext_set_output_logits(b, idx, logits)) {
            fail("could not add token " + std::to_string(t) + " at position " + std::to_string(pos) +
                 " to a batch (code " + std::to_string(idx) + ")");
        }
    }

    StepResult step_unchecked(llama_token last, const std::vector<llama_token> & draft, Sampler & s,
                              uint64_t index, bool rejection) {
        const auto t_step = std::chrono::steady_clock::now();
        StepResult r;
        // never verify past the end of the context or the batch
        const int room = std::min(n_ctx - past - 1, n_batch - 1);
        r.draft.assign(draft.begin(), draft.begin() + std::min<int>((int) draft.size(), room));
        r.draft.resize(s.grammar_prefix(r.draft));  // a draft token the grammar refuses could never be accepted

        std::vector<llama_token> block;
        block.reserve(r.draft.size() + 1);
        block.push_back(last);
        block.insert(block.end(), r.draft.begin(), r.draft.end());

        // snapshots cover a rollback of at most n_rs tokens; a longer draft could need more, so keep a checkpoint
        const bool ckpt = recurrent && (int) r.draft.size() > n_rs;
        if (ckpt) {
            const auto t0 = std::chrono::steady_clock::now();
            save_state(step_ckpt);
            r.rollback_ms += ms_since(t0);
        }

        const auto t1 = std::chrono::steady_clock::now();
        // a plain step reads its one row: nothing to save, and llama.cpp's own head skips a graph split
        decode_target(block.data(), (int) block.size(), past, r.draft.empty() ? LogitsAll : LogitsOnDemand);
        r.verify_ms = ms_since(t1);
        head_ms = 0.0;

        // accept while the target's own choice equals the draft (or, rejection sampling, while it keeps the draft
        // token); the first disagreement is the target's token
        const auto t_sample = std::chrono::steady_clock::now();
        const size_t n_vocab = tgt.n_vocab();
        int a = 0;
        for (;; ++a) {
            const float * row = target_row(a);
            const llama_token t = rejection && a < (int) r.draft.size()
                                      ? s.judge(row, r.draft[a], &q_rows[a * n_vocab], index + a)
                                      : s.next(row, index + a, cand);
            r.tokens.push_back(t);
            if (a == (int) r.draft.size() || t != r.draft[a]) {
                break;
            }
        }
        r.n_accepted = a;
        r.head_ms    = head_ms;  // the rows' LM head ran inside the loop: target compute, not sampling
        r.head_rows  = head_done;
        r.sample_ms  = ms_since(t_sample) - head_ms;
        r.verify_ms += head_ms;

        const int p0 = past;
        const int n_drop = (int) block.size() - (a + 1);
        if (n_drop > 0) {
            const auto t0 = std::chrono::steady_clock::now();
            if (!recurrent) {
                drop_from(ctx_tgt, p0 + a + 1, "target");
                r.rollback = "kv";
            } else if (n_drop <= n_rs) {
                // exact: within the last decode, and the anchor is always kept (see DESIGN, facts added later)
                drop_from(ctx_tgt, p0 + a + 1, "target");
                r.rollback = "snapshot";
            } else {
                if (!restore_state(step_ckpt)) {
                    fail("could not restore the target's recurrent checkpoint");
                }
                drop_from(ctx_tgt, p0, "target");
                replay(block.data(), a + 1, p0);
                r.rollback = "checkpoint";
            }
            r.rollback_ms += ms_since(t0);
        }
        if (ctx_dft && capture) {
            const auto t2 = std::chrono::steady_clock::now();
            defer(p0, a + 1);
            r.draft_ms += ms_since(t2);
        }
        past = p0 + a + 1;  // `last` and the accepted drafts are now in both caches
        r.step_ms = ms_since(t_step);
        return r;
    }

    void decode_target(const llama_token * toks, int n, int pos0, Logits logits) {
        llama_batch_ext_clear(batch_tgt);
        const bool all = logits == LogitsAll || logits == LogitsOnDemand;
        for (int i = 0; i < n; ++i) {
            add_token(batch_tgt, toks[i], pos0 + i, all || (logits == LogitsLast && i == n - 1));
        }
        run_target(n, all ? n : logits == LogitsLast ? 1 : 0, logits == LogitsOnDemand);
    }

    // Decode the n rows in batch_tgt (n_outputs of them with logits) and collect their features; on_demand: every
    // row is an output, and its LM head waits for target_row() where head_w allows.
    void run_target(int n, int n_outputs, bool on_demand = false) {
        const size_t width = layers.size() * (size_t) n_embd;
        lazy = on_demand && head_on_demand && head_w;
        probing = !head_probed && n_outputs > 0 && tgt.params.n_gpu_layers == 0;
        probe_prev = probe_w = nullptr;
        probe_tail = 0;
        hidden_rows = head_done = norm_seen = 0;
        if (lazy) {
            hidden.resize((size_t) n * n_embd);
            head_logits.resize((size_t) n * tgt.n_vocab());
        }
        feats.resize((size_t) n * width);
        feat_rows = n;
        rows_seen.assign(layers.size(), 0);
        if (!layer_api) {
            cb_rows.resize((size_t) n * n_embd);
        }
        n_out = 0;
        collecting = true;
        process(ctx_tgt, batch_tgt, "target decode");
        n_out = n_outputs;
        llama_synchronize(ctx_tgt);
        collecting = false;
        if (probing) {
            head_probed = true;
            probing = false;
            const bool plain_head = probe_w && probe_tail == 0 && probe_w->buffer &&
                                    ggml_backend_buffer_is_host(probe_w->buffer) && probe_w->ne[0] == n_embd &&
                                    probe_w->ne[1] == tgt.n_vocab();
            head_w = plain_head ? probe_w : nullptr;
        }
        if (lazy) {
            if (norm_seen != n) {
                fail("the final norm gave " + std::to_string(norm_seen) + " of " + std::to_string(n) + " rows");
            }
            hidden_rows = n;
        }
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
        if (!self->collecting) {
            return ask ? false : true;
        }
        if (self->probing && ask) {  // every node is asked once, in graph order
            // the head: the node right after the final norm, a matmul of it, and the graph's last node
            const bool head = strcmp(name, "result_output") == 0 && t->op == GGML_OP_MUL_MAT &&
                              t->type == GGML_TYPE_F32 && t->src[1] == self->probe_prev && t->src[1]->type ==
                              GGML_TYPE_F32 && strcmp(ggml_get_name(t->src[1]), "result_norm") == 0;
            self->probe_w = head ? t->src[0] : self->probe_w;
            self->probe_tail = head ? 0 : self->probe_tail + 1;
            self->probe_prev = t;
        }
        if (self->lazy && strcmp(name, "result_norm") == 0) {
            if (ask) {
                return true;
            }
            const int rows = (int) t->ne[1];
            if (t->type == GGML_TYPE_F32 && t->ne[0] == self->n_embd && self->norm_seen + rows <= (int) (
                    self->hidden.size() / self->n_embd)) {
                ggml_backend_tensor_get(t, &self->hidden[(size_t) self->norm_seen * self->n_embd], 0,
                                        (size_t) rows * self->n_embd * sizeof(float));
                self->norm_seen += rows;
            }
            return false;  // stop before the LM head: target_row() computes the rows it needs
        }
        if (self->layer_api || !self->capture || strncmp(name, "l_out-", 6) != 0) {  // layer_api: llama.cpp copies
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

    // Decode n tokens again at pos0.. into the target's caches after a checkpoint restore, leaving the features and
    // logits of the verify batch untouched (the replay has no outputs: logits() has no rows after it).
    void replay(const llama_token * toks, int n, int pos0) {
        llama_batch_ext_clear(batch_tgt);
        for (int i = 0; i < n; ++i) {
            add_token(batch_tgt, toks[i], pos0 + i, false);
        }
        n_out = 0;
        hidden_rows = 0;
        process(ctx_tgt, batch_tgt, "target replay");
    }

    // Keep the features of rows [0, n) of the last target decode, those of positions pos0.., for the drafter: they
    // go into its cache in one batch when it next drafts (or when a batch of them is full). Injected at every token,
    // they cost a drafter call at every plain step of the adaptive policy, which needs none of them until it drafts
    // again. The drafter's cache then holds the same K/V as with injection at every token: a feature row's K/V
    // depend on that row and its position only.
    void defer(int pos0, int n) {
        if (pos0 != dft_past + n_pending) {
            // positions decoded without capture lie between: the drafter never sees them (as before deferral)
            flush();
            dft_past = pos0;
        }
        const size_t width = layers.size() * (size_t) n_embd;
        const int cap = (int) llama_n_batch(ctx_dft);
        for (int i = 0; i < n;) {
            const int take = std::min(n - i, cap - n_pending);
            pending.resize((size_t) (n_pending + take) * width);
            std::memcpy(&pending[(size_t) n_pending * width], &feats[(size_t) i * width], take * width * sizeof(float));
            n_pending += take;
            i += take;
            if (n_pending == cap) {
                flush();
            }
        }
    }

    // Inject the deferred features into the drafter's cache, in one batch.
    void flush() {
        if (n_pending == 0) {
            return;
        }
        inject(dft_past, pending.data(), n_pending);
        dft_past += n_pending;
        n_pending = 0;
    }

    // Write n rows of target features into the drafter's cache at positions pos0...
    void inject(int pos0, const float * rows, int n) {
        // the previous noise block left its own K/V from pos0 on
        drop_from(ctx_dft, pos0, "drafter");
        const size_t width = layers.size() * (size_t) n_embd;
        llama_batch_ext_clear(batch_dft);
        for (int i = 0; i < n; ++i) {
            const int32_t idx = llama_batch_ext_add_embd(batch_dft, 0, llama_embd{&rows[i * width], 1, width});
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

    // Decode [last, mask x (n_draft - 1 + first)] at the next positions and read the draft from it, from block slot
    // `first` on: slot 1 (the first mask) for DFlash, slot 0 (the anchor's) for an anchor-first DSpark drafter.
    // DFlash takes the argmax at each slot (or, with a sampler, a draw from its distribution); DSpark's logits
    // already carry its Markov bias, chained slot after slot on the argmax by llama.cpp's graph, and its confidence
    // head's estimates come back as rows of "nextn" embeddings (each row the value repeated); DFlash2 walks its
    // selector lattice.
    void draft_block(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index,
                     Draft & d) {
        drop_from(ctx_dft, past, "drafter");
        llama_batch_ext_clear(batch_dft);
        const int first = anchor_first ? 0 : 1;
        // DFlash reads logits: every row is marked as an output, the anchor too, since the dflash graph computes
        // logits for all rows and llama.cpp keeps the first n_outputs of them (marking fewer would shift the rows).
        // DFlash2 reads the lattice, which has every row anyway: logits only when they are kept for inspection.
        const bool logits = top_k == 0 || keep_draft;
        for (int i = 0; i < n_draft + first; ++i) {
            add_token(batch_dft, i == 0 ? last : mask_token, past + i, logits);
        }
        process(ctx_dft, batch_dft, "drafter decode");
        const int n_vocab = tgt.n_vocab();
        draft_rows.clear();
        lattice_rows.clear();
        for (int i = 0; i < n_draft && keep_draft; ++i) {
            const float * row = logits_row(ctx_dft, first + i, "drafter");
            draft_rows.insert(draft_rows.end(), row, row + n_vocab);
        }
        if (top_k > 0) {
            walk_lattice(n_draft, with_probs, d);
            return;
        }
        if (dspark_conf) {
            const float * conf = llama_get_embeddings_nextn(ctx_dft);
            if (!conf) {
                fail("the DSpark drafter returned no confidences");
            }
            const size_t width = (size_t) llama_model_n_embd(dft->model);
            for (int i = 0; i < n_draft; ++i) {
                d.confidence.push_back(conf[(size_t) (first + i) * width]);
            }
        }
        for (int i = 0; i < n_draft; ++i) {
            const float * row = logits_row(ctx_dft, first + i, "drafter");
            if (sampler) {
                const Sampling & sp = sampler->sampling();
                q_rows.resize((size_t) (i + 1) * n_vocab);
                float * q = &q_rows[(size_t) i * n_vocab];
                const llama_token t = draw_tempered(row, n_vocab, sp.temperature,
                                                    uniform(second_seed(sp.seed, 1), index + i), q);
                if (t < 0) {
                    break;  // nothing to draw from: the draft ends here, and what came before is still judged exactly
                }
                q_tokens.push_back(t);
                d.tokens.push_back(t);
                if (with_probs) {
                    d.probs.push_back(q[t]);
                }
                continue;
            }
            const llama_token t = argmax(row, n_vocab);
            d.tokens.push_back(t);
            if (with_probs) {
                d.probs.push_back(top_prob(row, n_vocab, t));
            }
        }
    }

    // softmax(scores)[best]
    static float top_prob(const float * scores, int n, int best) {
        double z = 0.0;
        for (int j = 0; j < n; ++j) {
            z += std::exp(scores[j] - scores[best]);
        }
        return (float) (1.0 / z);
    }

    // DFlash2's selector lattice, one row of the drafter's width per block token: at draft position i >= 1, the
    // top_k candidate ids (as floats), then top_k x top_k scores, scores[p * top_k + j] that of candidate j after
    // candidate p of position i - 1 (at position 1 every p reads the anchor). The draft is the greedy path: each
    // position takes its best candidate after the one the previous position took. Its probability is the
    // softmax of that score row at the choice.
    void walk_lattice(int n_draft, bool with_probs, Draft & d) {
        const float * lattice = llama_get_embeddings_nextn(ctx_dft);
        if (!lattice) {
            fail("the DFlash2 drafter returned no selector lattice");
        }
        const size_t width = (size_t) llama_model_n_embd(dft->model);
        const int n_vocab = tgt.n_vocab();
        int prev = 0;
        for (int i = 1; i <= n_draft; ++i) {
            const float * row = lattice + (size_t) i * width;
            if (keep_draft) {
                lattice_rows.insert(lattice_rows.end(), row, row + top_k * (top_k + 1));
            }
            const float * scores = row + top_k + (size_t) prev * top_k;
            const int best = (int) (std::max_element(scores, scores + top_k) - scores);
            const float id = row[best];
            if (!(id >= 0.0f && id < (float) n_vocab)) {
                fail("the DFlash2 selector lattice names token " + std::to_string(id) + ", outside the vocabulary");
            }
            d.tokens.push_back((llama_token) id);
            d.confidence.push_back(top_prob(scores, top_k, best));
            if (with_probs) {
                d.probs.push_back(d.confidence.back());
            }
            prev = best;
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

    m.def("buffer_types", []() {
        std::vector<std::string> names;
        for (auto & b : buffer_types()) {
            names.push_back(b.first);
        }
        return names;
    }, "Buffer type names -ot can use: each device's default buffer type, as llama.cpp lists them.");
    m.def("extra_buffer_types", &extra_buffer_types,
          "ggml's extra buffer types in this build on this CPU (CPU_REPACK, AMX, ...): where repacked weights go.");
    m.def("gpu_devices", []() {
        std::vector<std::string> names;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(dev);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
                names.push_back(ggml_backend_dev_name(dev));
            }
        }
        return names;
    }, "The GPU devices llama.cpp sees (what -ngl, -ts and -mg place layers on).");
    m.def("max_devices", []() { return llama_max_devices(); });
    m.def("cache_types", []() {
        std::vector<std::string> names;
        for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                            GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1}) {
            names.push_back(ggml_type_name(t));
        }
        return names;
    }, "KV cache types (-ctk/-ctv), as llama.cpp offers them.");

    py::class_<TokenLogprob>(m, "TokenLogprob")
        .def_readonly("token", &TokenLogprob::token)
        .def_readonly("logprob", &TokenLogprob::logprob)
        .def_readonly("top", &TokenLogprob::top);

    py::class_<Model>(m, "Model")
        .def(py::init([](const std::string & path, int n_gpu_layers, bool repack, bool verbose, int split_mode,
                         int main_gpu, std::vector<float> tensor_split, int load_mode,
                         std::vector<std::pair<std::string, std::string>> overrides) {
                 Placement pl{n_gpu_layers, split_mode, main_gpu, std::move(tensor_split), load_mode,
                              std::move(overrides), repack};
                 return new Model(path, pl, verbose);
             }),
             py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("repack") = false, py::arg("verbose") = false,
             py::kw_only(), py::arg("split_mode") = (int) LLAMA_SPLIT_MODE_LAYER, py::arg("main_gpu") = 0,
             py::arg("tensor_split") = std::vector<float>{}, py::arg("load_mode") = (int) LLAMA_LOAD_MODE_AUTO,
             py::arg("overrides") = std::vector<std::pair<std::string, std::string>>{},
             py::call_guard<py::gil_scoped_release>())
        // the llama_model_params the model was loaded with
        .def_property_readonly("n_gpu_layers", [](const Model & mm) { return mm.params.n_gpu_layers; })
        .def_property_readonly("split_mode", [](const Model & mm) { return (int) mm.params.split_mode; })
        .def_property_readonly("main_gpu", [](const Model & mm) { return mm.params.main_gpu; })
        .def_property_readonly("load_mode", [](const Model & mm) {
            return std::string(llama_load_mode_name(mm.params.load_mode));
        })
        .def_property_readonly("repack", [](const Model & mm) { return mm.params.use_extra_bufts; })
        .def_property_readonly("tensor_split", [](const Model & mm) { return mm.placement.tensor_split; })
        .def_property_readonly("overrides", [](const Model & mm) { return mm.placement.overrides; })
        .def_property_readonly("n_devices", [](const Model & mm) { return llama_model_n_devices(mm.model); })
        .def_property_readonly("n_expert", [](const Model & mm) { return llama_model_n_expert(mm.model); })
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

    py::class_<Sampler>(m, "Sampler")
        .def(py::init([](const Model & target, Sampling params, std::vector<std::pair<llama_token, float>> logit_bias,
                         int repeat_last_n, float repeat_penalty, float frequency_penalty, float presence_penalty,
                         const std::vector<llama_token> & prompt, const std::string & grammar, int n_logprobs) {
                 const Penalties pen{repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty};
                 return new Sampler(target, params, std::move(logit_bias), pen, prompt, grammar, n_logprobs);
             }),
             py::arg("target"), py::arg("sampling"),
             py::arg("logit_bias") = std::vector<std::pair<llama_token, float>>{},
             py::arg("repeat_last_n") = 64, py::arg("repeat_penalty") = 1.0f, py::arg("frequency_penalty") = 0.0f,
             py::arg("presence_penalty") = 0.0f, py::arg("prompt") = std::vector<llama_token>{},
             py::arg("grammar") = "", py::arg("n_logprobs") = -1, py::keep_alive<1, 2>())
        .def_property_readonly("has_grammar", &Sampler::has_grammar)
        .def("grammar_prefix", &Sampler::grammar_prefix)
        .def("take_logprobs", &Sampler::take_logprobs);

    py::class_<Draft>(m, "Draft")
        .def_readonly("tokens", &Draft::tokens)
        .def_readonly("probs", &Draft::probs)
        .def_readonly("confidence", &Draft::confidence);

    py::class_<StepResult>(m, "StepResult")
        .def_readonly("tokens", &StepResult::tokens)
        .def_readonly("draft", &StepResult::draft)
        .def_readonly("n_accepted", &StepResult::n_accepted)
        .def_readonly("draft_ms", &StepResult::draft_ms)
        .def_readonly("verify_ms", &StepResult::verify_ms)
        .def_readonly("sample_ms", &StepResult::sample_ms)
        .def_readonly("head_ms", &StepResult::head_ms)
        .def_readonly("head_rows", &StepResult::head_rows)
        .def_readonly("rollback_ms", &StepResult::rollback_ms)
        .def_readonly("rollback", &StepResult::rollback)
        .def_readonly("step_ms", &StepResult::step_ms);

    py::class_<Session>(m, "Session")
        .def(py::init([](Model & target, Model * drafter, std::vector<int> layers, int n_ctx, int n_threads,
                         bool use_layer_api, int flash_attn, bool verbose, int n_threads_batch, int n_batch,
                         int n_ubatch, const std::string & type_k, const std::string & type_v,
                         const std::string & type_k_draft, const std::string & type_v_draft, int n_rs_seq, int n_seq) {
                 const int n_tb = n_threads_batch > 0 ? n_threads_batch : n_threads;
                 ContextOptions o{n_ctx, n_batch, n_ubatch, n_threads, n_tb, flash_attn, cache_type(type_k),
                                  cache_type(type_v), cache_type(type_k_draft), cache_type(type_v_draft), n_rs_seq,
                                  n_seq};
                 return new Session(target, drafter, std::move(layers), o, use_layer_api, verbose);
             }),
             py::arg("target"), py::arg("drafter"), py::arg("layers"), py::arg("n_ctx"), py::arg("n_threads"),
             py::arg("use_layer_api"), py::arg("flash_attn") = 0, py::arg("verbose") = false, py::kw_only(),
             py::arg("n_threads_batch") = 0, py::arg("n_batch") = 512, py::arg("n_ubatch") = 512,
             py::arg("type_k") = "f16", py::arg("type_v") = "f16", py::arg("type_k_draft") = "f32",
             py::arg("type_v_draft") = "f32", py::arg("n_rs_seq") = -1, py::arg("n_seq") = 1,
             py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_batch", &Session::batch_size)
        .def_property_readonly("n_ubatch", &Session::ubatch_size)
        .def_property_readonly("n_threads", &Session::threads)
        .def_property_readonly("n_threads_batch", &Session::threads_batch)
        .def("memory", &Session::memory, py::arg("which") = "target")
        .def_property("verbose", [](const Session & ss) { return ss.verbose.load(); },
                      [](Session & ss, bool v) { ss.verbose = v; })
        .def_property_readonly("n_past", &Session::n_past)
        .def_property_readonly("n_ctx", &Session::context_size)
        .def_property_readonly("has_drafter", &Session::has_drafter)
        .def_property_readonly("uses_layer_api", &Session::uses_layer_api)
        .def_property_readonly("recurrent", &Session::is_recurrent)
        .def_property_readonly("n_rs_seq", &Session::snapshots)
        .def_property_readonly("checkpoint_pos", &Session::checkpoint_pos)
        .def_property_readonly("n_pending", &Session::pending_rows)
        .def("checkpoint", &Session::checkpoint, py::call_guard<py::gil_scoped_release>())
        .def("set_capture", &Session::set_capture)
        .def("set_head_on_demand", &Session::set_head_on_demand, py::arg("on"))
        .def_property_readonly("head_on_demand", &Session::head_on_demand_active)
        .def("truncate", &Session::truncate, py::call_guard<py::gil_scoped_release>())
        .def("prefill", &Session::prefill, py::arg("tokens"), py::arg("sampler").none(true), py::arg("index"),
             py::call_guard<py::gil_scoped_release>())
        .def("prefill", [](Session & ss, const std::vector<llama_token> & tokens, const Sampling & s, uint64_t index) {
                 Sampler plain(ss.target(), s);
                 return ss.prefill(tokens, &plain, index);
             }, py::arg("tokens"), py::arg("sampling"), py::arg("index"), py::call_guard<py::gil_scoped_release>())
        .def("draft", &Session::draft, py::arg("last"), py::arg("n_draft"), py::arg("with_probs") = false,
             py::arg("sampler").none(true) = nullptr, py::arg("index") = 0, py::call_guard<py::gil_scoped_release>())
        .def("step", &Session::step, py::arg("last"), py::arg("draft"), py::arg("sampler"), py::arg("index"),
             py::arg("rejection") = false, py::arg("head_rows") = 1, py::call_guard<py::gil_scoped_release>())
        .def("step", [](Session & ss, llama_token last, const std::vector<llama_token> & draft, const Sampling & s,
                        uint64_t index, int head_rows) {
                 Sampler plain(ss.target(), s);
                 return ss.step(last, draft, plain, index, false, head_rows);
             }, py::arg("last"), py::arg("draft"), py::arg("sampling"), py::arg("index"), py::arg("head_rows") = 1,
             py::call_guard<py::gil_scoped_release>())
        .def("features", &Session::features)
        .def("decode_rows", &Session::decode_rows, py::arg("tokens"), py::arg("pos"), py::arg("seq"),
             py::arg("top_k") = 1, py::call_guard<py::gil_scoped_release>())
        .def("drop_sequence", &Session::drop_sequence, py::call_guard<py::gil_scoped_release>())
        .def("logits", &Session::logits)
        .def("keep_draft_logits", &Session::keep_draft_logits)
        .def("draft_logits", &Session::draft_logits)
        .def("draft_lattice", &Session::draft_lattice);
}
