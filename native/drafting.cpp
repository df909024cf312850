// Session's drafter side: draft(), draft_batch(), a noise block's decode and its reading (DFlash, DSpark, DFlash2).

#include "session_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>

// The llama.cpp drafter's proposal for up to n_draft tokens after `last` (the newest token, not yet in the
// caches), at most a block.
// With a sampler (rejection sampling) each draft token is drawn from the drafter's distribution at the
// sampler's temperature instead of taken as its argmax, with the uniform of generated token index + i at draft
// position i; the distributions are kept for step(..., rejection = true).
Draft Session::draft(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index,
                     int slot) {
    Slot & sl = at(slot);
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
    return transaction(slot, [&] {
        Draft d;
        sl.q_tokens.clear();
        if (n_draft > 0) {
            flush(slot);
            draft_block(last, std::min(n_draft, max_draft), with_probs, sampler, index, d, slot);
        }
        return d;
    });
}

// Several slots' greedy drafts, (slot, last, n_draft) each: what draft() gives each. The slots that draft as many
// tokens share one drafter decode: the drafter attends non-causally, so a block must lie in one ubatch, and with a
// cache per sequence llama.cpp puts as many rows of each sequence in a ubatch, so only blocks of one length can
// share a decode. A DSpark drafter (its Markov head chains along the batch's rows) and DFlash2 (its selector) draft
// one slot at a time, as does a session that keeps the drafts' logits. Should it fail, every slot is put back.
std::vector<Draft> Session::draft_batch(const std::vector<std::tuple<int, llama_token, int>> & drafts) {
    if (!ctx_dft) {
        throw std::logic_error("this session has no llama.cpp drafter");
    }
    for (size_t k = 0; k < drafts.size(); ++k) {
        const auto & [slot, last, n] = drafts[k];
        at(slot);
        check_tokens({last});
        for (size_t j = 0; j < k; ++j) {
            if (std::get<0>(drafts[j]) == slot) {
                throw std::invalid_argument("slot " + std::to_string(slot) + " has two drafts in one batch");
            }
        }
    }
    LogScope log(verbose);
    std::vector<Draft> out(drafts.size());
    const bool shared = top_k == 0 && !dspark && !keep_draft;
    const int first = anchor_first ? 0 : 1;
    const int cap = (int) llama_n_batch(ctx_dft);
    try {
        std::vector<int> order;  // the slots that draft, by length
        for (size_t k = 0; k < drafts.size(); ++k) {
            const auto & [slot, last, n] = drafts[k];
            at(slot).q_tokens.clear();
            if (n > 0) {
                flush(slot);
                order.push_back((int) k);
            }
        }
        auto len = [&](int k) { return std::min(std::get<2>(drafts[k]), max_draft); };
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return len(a) < len(b); });
        for (size_t g0 = 0; g0 < order.size();) {
            const int n = len(order[g0]);
            std::vector<int> group;
            while (g0 + group.size() < order.size() && len(order[g0 + group.size()]) == n &&
                   (group.empty() || (shared && (int) (group.size() + 1) * (n + first) <= cap))) {
                group.push_back(order[g0 + group.size()]);
            }
            g0 += group.size();
            if (group.size() == 1) {
                const auto & [slot, last, n_draft] = drafts[group[0]];
                draft_block(last, n, false, nullptr, 0, out[group[0]], slot);
                continue;
            }
            llama_batch_ext_clear(batch_dft);
            for (int k : group) {  // every row an output, as in draft_block
                const auto & [slot, last, n_draft] = drafts[k];
                const int past = at(slot).past;
                drop_from(ctx_dft, past, "drafter", slot);
                for (int i = 0; i < n + first; ++i) {
                    add_token(batch_dft, i == 0 ? last : mask_token, past + i, true, slot);
                }
            }
            process(ctx_dft, batch_dft, "drafter decode");
            max_out_dft = std::max(max_out_dft, (int) group.size() * (n + first));
            const int n_vocab = tgt.n_vocab();
            for (size_t j = 0; j < group.size(); ++j) {
                for (int i = 0; i < n; ++i) {
                    const int row = (int) j * (n + first) + first + i;
                    out[group[j]].tokens.push_back(argmax(logits_row(ctx_dft, row, "drafter"), n_vocab));
                }
            }
        }
    } catch (...) {
        draft_rows.clear();
        lattice_rows.clear();
        for (const auto & [slot, last, n] : drafts) {
            at(slot).q_tokens.clear();
            keep(recurrent ? 0 : at(slot).past, slot);
        }
        throw;
    }
    return out;
}

// Decode [last, mask x (n_draft - 1 + first)] at the next positions and read the draft from it, from block slot
// `first` on: slot 1 (the first mask) for DFlash, slot 0 (the anchor's) for an anchor-first DSpark drafter.
// DFlash takes the argmax at each slot (or, with a sampler, a draw from its distribution); DSpark's logits
// already carry its Markov bias, chained slot after slot on the argmax by llama.cpp's graph, and its confidence
// head's estimates come back as rows of "nextn" embeddings (each row the value repeated); DFlash2 walks its
// selector lattice.
void Session::draft_block(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index,
                          Draft & d, int slot) {
    Slot & sl = at(slot);
    const int past = sl.past;
    drop_from(ctx_dft, past, "drafter", slot);
    llama_batch_ext_clear(batch_dft);
    const int first = anchor_first ? 0 : 1;
    // DFlash reads logits: every row is marked as an output, the anchor too, since the dflash graph computes
    // logits for all rows and llama.cpp keeps the first n_outputs of them (marking fewer would shift the rows).
    // DFlash2 reads the lattice, which has every row anyway: logits only when they are kept for inspection.
    const bool logits = top_k == 0 || keep_draft;
    for (int i = 0; i < n_draft + first; ++i) {
        add_token(batch_dft, i == 0 ? last : mask_token, past + i, logits, slot);
    }
    process(ctx_dft, batch_dft, "drafter decode");
    max_out_dft = std::max(max_out_dft, logits ? n_draft + first : 0);
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
            sl.q_rows.resize((size_t) (i + 1) * n_vocab);
            float * q = &sl.q_rows[(size_t) i * n_vocab];
            const llama_token t = draw_tempered(row, n_vocab, sp.temperature,
                                                uniform(second_seed(sp.seed, 1), index + i), q);
            if (t < 0) {
                break;  // nothing to draw from: the draft ends here, and what came before is still judged exactly
            }
            sl.q_tokens.push_back(t);
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
float Session::top_prob(const float * scores, int n, int best) {
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
void Session::walk_lattice(int n_draft, bool with_probs, Draft & d) {
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

// The drafter's callback, on a CPU drafter only: it needs no node, it notes where the drafter's graph lives.
bool Session::drafter_eval_cb(ggml_tensor * t, bool ask, void * user) {
    if (ask) {
        note_compute_buffer(t, ggml_get_name(t), ((Session *) user)->compute_buf_dft);
    }
    return !ask;
}

// Logits of the drafter's last noise block at its draft positions: [n, n_vocab] (DFlash2: after its logit
// scale and soft-capping, which the selector reads).
py::array_t<float> Session::draft_logits() const {
    const size_t n_vocab = tgt.n_vocab();
    const size_t n = draft_rows.size() / n_vocab;
    py::array_t<float> out({n, n_vocab});
    std::memcpy(out.mutable_data(), draft_rows.data(), draft_rows.size() * sizeof(float));
    return out;
}

// DFlash2: the selector lattice of the drafter's last noise block at its draft positions (kept with the logits):
// [n, top_k * (top_k + 1)], each row the top_k candidate ids then the top_k x top_k scores (see walk_lattice).
py::array_t<float> Session::draft_lattice() const {
    const size_t w = (size_t) top_k * (top_k + 1);
    py::array_t<float> out({w ? lattice_rows.size() / w : 0, w});
    std::memcpy(out.mutable_data(), lattice_rows.data(), lattice_rows.size() * sizeof(float));
    return out;
}
