// Sampling a row: sample_row (llama.cpp's chain, bit for bit) and the ranked-selection math behind it (Ranked, logit
// ranges, exp sums with error bounds, the draws), and draw_tempered for sampled drafts.

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
void logit_range(const float * logits, int n, float & lo, float & hi) {
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

double temper(float logit, float lmax, float temperature) {
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
