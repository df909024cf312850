// The Sampler: one generation's sampling state (sampler.h): its controls (penalties, logit biases, grammar,
// logprobs) around sample_row (sample_row.cpp), and rejection sampling.

#include "sampler.h"

#include <algorithm>
#include <cmath>

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
