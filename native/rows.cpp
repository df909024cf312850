// Session's row decoding for training data (decode_rows): each row's top-k tokens and their log-probabilities.

#include "session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

// Training data (traindata.py): one target batch of rows from several independent sequences (a token, its
// position and its sequence each), logits on every row. Returns each row's top_k tokens by logit, best first, and
// their log-probabilities; features() then holds the rows' features. The cache bookkeeping is the caller's:
// n_past is left alone (a session is used either this way or for generation, never both).
std::pair<py::array_t<int32_t>, py::array_t<float>> Session::decode_rows(const std::vector<llama_token> & tokens,
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
    const int n_seq = n_seq_user;
    for (int i = 0; i < n; ++i) {
        if (seq[i] < 0 || seq[i] >= n_seq || pos[i] < 0 || pos[i] >= n_ctx) {
            throw std::out_of_range("row " + std::to_string(i) + ": sequence " + std::to_string(seq[i]) +
                                    " position " + std::to_string(pos[i]) + " outside " +
                                    std::to_string(n_seq) + " sequences in a context of " + std::to_string(n_ctx));
        }
    }
    if (!unified && std::any_of(seq.begin(), seq.end(), [&](int q) { return q != seq[0]; })) {
        // a cache per sequence: llama.cpp regroups the rows by sequence, and features() would not be in batch order
        throw std::invalid_argument("rows of several sequences in one batch need a unified cache (kv_unified)");
    }
    check_tokens(tokens);
    LogScope log(verbose);
    llama_batch_ext_clear(batch_tgt);
    for (int i = 0; i < n; ++i) {
        add_token(batch_tgt, tokens[i], pos[i], true, seq[i]);
    }
    capture = true;
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
