// Sampling: sample_row and the ranked-selection math behind it (Ranked, logit ranges, exp sums with error bounds,
// the draws), the Sampler's controls (penalties, logit biases, grammar, logprobs, rejection sampling), draw_tempered.

#include "sampler.h"

#include <algorithm>
#include <cmath>

double uniform(uint64_t seed, uint64_t index) {
    uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (z >> 11) * (1.0 / 9007199254740992.0);
}

llama_token argmax(const float * logits, int n) {
    return (llama_token) (std::max_element(logits, logits + n) - logits);
}

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
            // a -inf token is never drawn (its term is 0 in every sum): a row with -inf past its top (the greedy
            // head's, Sampler::keep) or banned tokens need not list them
            if (logits[i] >= next && logits[i] < lo && logits[i] > -INFINITY) {
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
llama_token sample_row(const float * logits, int n_vocab, const Sampling & s, uint64_t index,
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
// Sampler: one generation's sampling state (sampler.h).

// Further uniforms per generated token, independent of uniform(seed, index) and of each other: the redraw after a
// grammar refusal (stream 0), and rejection sampling's draft draw, acceptance test and residual draw (1, 2, 3).
uint64_t second_seed(uint64_t seed, uint64_t stream) {
    uint64_t z = seed ^ (0xD1B54A32D192ED03ull + stream * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCDull;
    z = (z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53ull;
    return z ^ (z >> 33);
}

Sampler::Sampler(const Model & target, Sampling params, std::vector<std::pair<llama_token, float>> logit_bias,
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

Sampler::~Sampler() {
    if (grammar) {
        llama_sampler_free(grammar);
    }
}

int Sampler::keep() const {
    if (greedy()) {
        return 1;
    }
    const bool top_row = params.temperature > 0.0f && params.top_k > 0 && params.top_k <= MAX_TOP_ROW &&
                         params.top_k < n_vocab && !grammar && n_top < 0;
    return top_row ? std::max(params.top_k, 2) : 0;
}

std::vector<llama_token> Sampler::touched() const {
    std::vector<llama_token> out;
    for (const auto & [tok, b] : bias) {
        out.push_back(tok);
    }
    for (const auto & [tok, count] : counts) {
        out.push_back(tok);
    }
    return out;
}

// Sample generated token number `index` from a target row, and take it in.
llama_token Sampler::next(const float * logits, uint64_t index, std::vector<Candidate> & cand) {
    const llama_token t = pick(logits, index, cand);
    take(logits, t);
    return t;
}

// The controls' changes on the listed tokens, as controlled() makes them on the whole row, then the chain over the
// list: its tokens in ascending order break ties as their ids do, and every token past it ranks below the top-k.
llama_token Sampler::next_top(const std::vector<std::pair<llama_token, float>> & top, uint64_t index,
                              std::vector<Candidate> & cand) {
    row.resize(top.size());
    for (size_t i = 0; i < top.size(); ++i) {
        row[i] = top[i].second;
    }
    auto logit = [&](llama_token t) -> float & {
        const auto it = std::lower_bound(top.begin(), top.end(), t, [](const auto & a, llama_token b) {
            return a.first < b;
        });
        if (it == top.end() || it->first != t) {
            fail("the row's top lacks token " + std::to_string(t) + ", whose logit a control changes");
        }
        return row[it - top.begin()];
    };
    for (const auto & [tok, b] : bias) {
        logit(tok) += b;
    }
    for (const auto & [tok, count] : counts) {
        float & l = logit(tok);
        l = l <= 0 ? l * pen.repeat : l / pen.repeat;
        l -= float(count) * pen.freq + pen.present;
    }
    const llama_token t = top[sample_row(row.data(), (int) row.size(), params, index, cand)].first;
    if (pen.active()) {
        remember(t);
    }
    return t;
}

// Rejection sampling (speculative sampling with the drafter's distribution): accept the draft token x, drawn
// from the drafter's distribution q, with probability min(1, p(x) / q(x)), p the distribution pick() draws from;
// otherwise draw from the residual max(0, p - q), normalised. The result follows p whatever q is. The token is
// taken in like next()'s.
llama_token Sampler::judge(const float * logits, llama_token x, const float * q, uint64_t index) {
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

// The distribution pick() draws from, without a grammar: the row with biases and penalties, cut by top-k, top-p
// (on the untempered softmax) and min-p, then tempered; probabilities over the vocabulary, 0 outside the cut.
void Sampler::distribution(const float * logits, std::vector<float> & out) {
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
void Sampler::take(const float * logits, llama_token t) {
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
size_t Sampler::grammar_prefix(const std::vector<llama_token> & draft) const {
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

void Sampler::check_token(llama_token t) const {
    if (t < 0 || t >= n_vocab) {
        throw std::out_of_range("token id " + std::to_string(t) + " outside the vocabulary (0.." +
                                std::to_string(n_vocab - 1) + ")");
    }
}

// As llama.cpp's common sampler: draw without the grammar; if the grammar refuses that token, apply it to the
// whole row and draw again (with an independent uniform, so the result follows the constrained distribution).
llama_token Sampler::pick(const float * logits, uint64_t index, std::vector<Candidate> & cand) {
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
const float * Sampler::controlled(const float * logits) {
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

bool Sampler::allows(llama_sampler * g, llama_token t) {
    llama_token_data one{t, 1.0f, 0.0f};
    llama_token_data_array arr{&one, 1, -1, false};
    llama_sampler_apply(g, &arr);
    return arr.data[0].logit != -INFINITY;
}

// Only for a token allows() passed: llama.cpp aborts on an end-of-generation token its grammar does not allow.
void Sampler::accept(llama_sampler * g, llama_token t) {
    try {
        llama_sampler_accept(g, t);
    } catch (const std::exception & e) {
        fail(std::string("the grammar refused token ") + std::to_string(t) + ": " + e.what());
    }
}

// llama.cpp's penalties sampler: a window of the last last_n tokens and their counts.
void Sampler::remember(llama_token t) {
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
TokenLogprob Sampler::logprob_of(const float * logits, llama_token t) const {
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

// Draw from softmax(row / temperature) with uniform u, writing that distribution to q (rejection sampling's drafts).
// -1 for a row with no distribution (a NaN or infinite logit, from a drafter whose activations overflowed).
llama_token draw_tempered(const float * row, int n_vocab, float temperature, double u, float * q) {
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
