// Session: creating the target and drafter contexts, prefill, draft, the verify step and its rollback, feature
// capture (layer API or eval callback) and deferred injection into the drafter, and the LM head on demand.

#include "session.h"

#include <ggml-cpu.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

// KV cache types as llama.cpp's common/arg.cpp offers them, by ggml's names.
ggml_type cache_type(const std::string & name) {
    for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
                        GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1}) {
        if (name == ggml_type_name(t)) {
            return t;
        }
    }
    throw std::invalid_argument("unknown KV cache type '" + name + "'");
}

// opt.n_rs_seq: recurrent-state snapshots kept for rolling back drafts (-1: the longest draft of the drafter);
// only architectures whose llama.cpp supports them keep any, the others roll back by checkpoint and replay.
Session::Session(Model & target, Model * drafter, std::vector<int> layers, const ContextOptions & opt,
                 bool use_layer_api, bool verbose)
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

Session::~Session() {
    LogScope log(verbose);
    free_all();
}

// llama.cpp's memory report for one context ("target" or "drafter"): bytes of weights, KV cache and compute
// buffers per buffer type (CPU, CUDA0, ...). The drafter's includes its own weights, not the target's it borrows.
std::vector<std::tuple<std::string, size_t, size_t, size_t>> Session::memory(const std::string & which) const {
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

// Forget everything from position n on, in both caches (n = 0 starts afresh; n > 0 reuses a cached prefix).
// A recurrent state cannot be cut anywhere: a recurrent target goes back to 0 or to its checkpoint only.
void Session::truncate(int n, int slot) {
    const Slot & sl = at(slot);
    if (n < 0 || n > sl.past) {
        throw std::out_of_range("truncate position " + std::to_string(n) + " outside the " +
                                std::to_string(sl.past) + " cached tokens");
    }
    if (recurrent && n != 0 && n != sl.past && n != sl.prompt_ckpt_pos) {
        throw std::invalid_argument("the recurrent target can go back to position 0 or " +
                                    std::to_string(sl.prompt_ckpt_pos) + " (its checkpoint), not " +
                                    std::to_string(n));
    }
    LogScope log(verbose);
    if (!keep(n, slot)) {
        fail("the KV cache could not drop the positions from " + std::to_string(n) +
             " on; both caches were emptied");
    }
}

Session::Slot & Session::at(int slot) {
    if (slot < 0 || slot >= (int) slots.size()) {
        throw std::out_of_range("no slot " + std::to_string(slot) + " (the session has " +
                                std::to_string(slots.size()) + ")");
    }
    return slots[slot];
}

const Session::Slot & Session::at(int slot) const {
    return const_cast<Session *>(this)->at(slot);
}

// Decode tokens after the cached ones, feed their features to the drafter and sample the next token
// (generated token number `index`); without a sampler (a prompt chunk before the last), sample nothing: -1.
llama_token Session::prefill(const std::vector<llama_token> & tokens, Sampler * s, uint64_t index, int slot) {
    Slot & sl = at(slot);
    if (tokens.empty()) {
        throw std::invalid_argument("prefill needs at least one token");
    }
    if (sl.past + (int) tokens.size() >= n_ctx) {
        throw std::length_error("prompt does not fit in the context");
    }
    check_tokens(tokens);
    return transaction(slot, [&] {
        const int n_ub = (int) llama_n_ubatch(ctx_tgt);
        for (size_t off = 0, n; off < tokens.size(); off += n) {
            n = std::min<size_t>(n_batch, tokens.size() - off);
            if (pad && n > 1 && (int) n % n_ub == 1) {
                --n;  // no ubatch of one row: the next chunk takes the token
            }
            const bool last_chunk = off + n == tokens.size();
            decode_target(tokens.data() + off, (int) n, sl.past, last_chunk, slot);
            if (ctx_dft && sl.capture) {
                defer(sl.past, (int) n, slot);
            }
            sl.past += (int) n;
        }
        if (!s) {
            return LLAMA_TOKEN_NULL;
        }
        return sample_row_of(-1, *s, index);
    });
}

// Save the target's recurrent state at the current position: truncate() can come back to it later (one
// checkpoint, replacing the previous one). A no-op for targets without recurrent memory.
void Session::checkpoint(int slot) {
    Slot & sl = at(slot);
    if (!recurrent) {
        return;
    }
    LogScope log(verbose);
    save_state(sl.prompt_ckpt, slot);
    sl.prompt_ckpt_pos = sl.past;
}

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

// One speculative step: verify `draft` (any drafter's proposal, possibly empty) after `last`, the newest token,
// not yet in the caches. It is step_batch() with one slot.
// The sampler takes in the emitted tokens; should the step fail, it is not rolled back with the caches.
// rejection: verify by rejection sampling against the distributions of this session's last sampled draft
// (draft() with a sampler), which `draft` must be (a prefix of). head_rows: the verify rows the caller expects
// to read (its expected accepted drafts + 1), the first batch of the LM head where it runs on demand.
StepResult Session::step(llama_token last, const std::vector<llama_token> & draft, Sampler & s, uint64_t index,
                         bool rejection, int head_rows, int slot) {
    return step_batch({SlotStep{slot, last, draft, &s, index, rejection, head_rows}})[0];
}

void Session::check_step(const Slot & sl, llama_token last, const std::vector<llama_token> & draft,
                         const Sampler & s, bool rejection) const {
    check_tokens({last});
    check_tokens(draft);
    if (sl.past + 1 > n_ctx) {
        throw std::length_error("context is full");
    }
    if (rejection) {
        if (s.has_grammar() || s.sampling().temperature <= 0.0f) {
            throw std::invalid_argument("rejection sampling needs a temperature > 0 and no grammar");
        }
        if (draft.size() > sl.q_tokens.size() || !std::equal(draft.begin(), draft.end(), sl.q_tokens.begin())) {
            throw std::invalid_argument("rejection sampling verifies the draft this slot last sampled");
        }
    }
}

// The steps of several slots, their blocks (last token and draft) in as few target decodes as the batch holds, the
// slots in ascending order; each slot accepts, rolls back and feeds its drafter from its own rows. A slot's rows are
// computed as in a decode of its own (a cache per sequence, batch-invariant kernels), so each slot's result is the
// one its step alone gives. A recurrent target or a padded session steps one slot at a time (their checkpoints and
// scratch row are per decode). Should it fail, every slot of the batch is put back as it was; so it is when
// interrupt() stops its first decode (Interrupted), and the same steps can run again (not with rejection sampling,
// whose drafts' distributions would be gone, nor a recurrent target, whose state would be: never interrupted).
std::vector<StepResult> Session::step_batch(const std::vector<SlotStep> & steps) {
    if ((recurrent || pad) && steps.size() > 1) {
        throw std::logic_error("a recurrent target or a padded session steps one slot at a time");
    }
    std::vector<int> order(steps.size());
    for (size_t k = 0; k < steps.size(); ++k) {
        const SlotStep & st = steps[k];
        if (!st.sampler) {
            throw std::invalid_argument("every slot's step needs its sampler");
        }
        check_step(at(st.slot), st.last, st.draft, *st.sampler, st.rejection);
        for (size_t j = 0; j < k; ++j) {
            if (steps[j].slot == st.slot) {
                throw std::invalid_argument("slot " + std::to_string(st.slot) + " has two steps in one batch");
            }
        }
        order[k] = (int) k;
    }
    std::sort(order.begin(), order.end(), [&](int a, int b) { return steps[a].slot < steps[b].slot; });
    LogScope log(verbose);
    const bool may_interrupt = !recurrent && std::none_of(steps.begin(), steps.end(), [](const SlotStep & st) {
        return st.rejection;
    });
    std::vector<StepResult> res(steps.size());
    std::vector<int> p0(steps.size());
    for (size_t k = 0; k < steps.size(); ++k) {
        p0[k] = at(steps[k].slot).past;
    }
    try {
        for (size_t g0 = 0; g0 < order.size();) {
            std::vector<int> group;  // this decode's steps
            std::vector<int> row0;   // their first rows
            std::vector<HeadRange> ranges;
            int n = 0;
            llama_batch_ext_clear(batch_tgt);
            for (size_t g = g0; g < order.size(); ++g) {
                const int k = order[g];
                const SlotStep & st = steps[k];
                Slot & sl = at(st.slot);
                StepResult & r = res[k];
                r.draft = cut_draft(sl, st.draft, *st.sampler);
                const int rows = (int) r.draft.size() + 1;
                if (n + rows > n_batch) {
                    break;
                }
                group.push_back(k);
                row0.push_back(n);
                ranges.push_back(head_range(n, n + rows, st.head_rows, *st.sampler, st.rejection, r.draft));
                for (int i = 0; i < rows; ++i) {
                    add_token(batch_tgt, i == 0 ? st.last : r.draft[i - 1], sl.past + i, true, st.slot);
                }
                n += rows;
            }
            g0 += group.size();
            const SlotStep & st0 = steps[group[0]];
            if (recurrent && (int) res[group[0]].draft.size() > n_rs) {
                // snapshots cover a rollback of at most n_rs tokens; a longer draft could need more
                const auto t0 = std::chrono::steady_clock::now();
                save_state(at(st0.slot).step_ckpt, st0.slot);
                res[group[0]].rollback_ms += ms_since(t0);
            }
            const bool scratch = add_scratch(st0.last, n, at(st0.slot).past, true);
            // a plain step's one row goes llama.cpp's way where the greedy head has no part in it (nothing to save,
            // and llama.cpp's head skips a graph split); every other row's LM head waits for the accept loop
            const bool on_demand = n > 1 || pad || (ranges[0].keep && greedy_head);
            const auto t0 = std::chrono::steady_clock::now();
            capture = std::any_of(group.begin(), group.end(), [&](int k) { return at(steps[k].slot).capture; });
            // only the first decode: after it, slots have accepted tokens and moved their samplers on
            interruptible = may_interrupt && g0 == group.size();
            t_interruptible = t0;
            // asked before the decode began: giving it up costs only the time to llama.cpp's first check, however
            // late a busy machine makes that
            const bool asked = interrupt_wanted.load(std::memory_order_relaxed);
            interrupt_within_ms = step_ms_per_row > 0.0 && !asked ? 0.5 * step_ms_per_row * n : 1e30;
            run_target(n + scratch, n + scratch, on_demand, n, n);
            interruptible = false;
            step_ms_per_row = ms_since(t0) / n;
            if (group.size() > 1) {
                // with a cache per sequence llama.cpp computes the rows in its own order (ubatch_order): put the rows
                // the eval callback copied back in batch order
                std::vector<int> seq;
                for (int k : group) {
                    seq.insert(seq.end(), (int) res[k].draft.size() + 1, steps[k].slot);
                }
                const std::vector<int> perm = ubatch_order(seq, (int) llama_n_ubatch(ctx_tgt));
                auto unshuffle = [&](std::vector<float> & rows, size_t width, int n_rows) {
                    if (n_rows == 0 || width == 0) {
                        return;
                    }
                    std::vector<float> tmp(rows.begin(), rows.begin() + (size_t) n_rows * width);
                    for (int i = 0; i < n_rows; ++i) {
                        std::memcpy(&rows[(size_t) perm[i] * width], &tmp[(size_t) i * width], width * sizeof(float));
                    }
                };
                unshuffle(hidden, n_embd, hidden_rows);
                if (!layer_api) {
                    unshuffle(feats, layers.size() * (size_t) n_embd, feat_rows);
                }
            }
            const double decode_ms = ms_since(t0);
            if (hidden_rows > 0) {
                head_ranges = std::move(ranges);
                // every block's first rows in one head call: the matrix is read once for all of them
                std::vector<size_t> all(group.size());
                std::vector<int> first(group.size());
                int n_first = 0;
                for (size_t j = 0; j < group.size(); ++j) {
                    all[j] = j;
                    first[j] = std::min(head_ranges[j].first, head_ranges[j].hi - head_ranges[j].lo);
                    n_first += first[j];
                }
                const double ms = head_more(all, first);
                for (size_t j = 0; j < group.size(); ++j) {
                    res[group[j]].head_ms += ms * first[j] / n_first;
                }
            }
            // every slot reads its rows in order; where slots need rows whose head is not computed yet, the rows all
            // of them wait for (as many more as each has read: target_row's doubling) are computed in one call
            std::vector<char> known(group.size(), 0);
            for (;;) {
                std::vector<size_t> waiting;
                for (size_t j = 0; j < group.size(); ++j) {
                    const int k = group[j];
                    const SlotStep & st = steps[k];
                    if (known[j]) {
                        continue;
                    }
                    const auto t_sample = std::chrono::steady_clock::now();
                    known[j] = accept(res[k], row0[j], *st.sampler, st.index, st.rejection, st.slot,
                                      hidden_rows > 0 ? &head_ranges[j] : nullptr);
                    res[k].sample_ms += ms_since(t_sample);
                    if (!known[j]) {
                        waiting.push_back(j);
                    }
                }
                if (waiting.empty()) {
                    break;
                }
                std::vector<int> more;
                int m_all = 0;
                for (size_t j : waiting) {
                    const HeadRange & h = head_ranges[j];
                    more.push_back(std::min(h.hi, h.lo + 2 * h.done) - (h.lo + h.done));
                    m_all += more.back();
                }
                const double ms = head_more(waiting, more);
                for (size_t w = 0; w < waiting.size(); ++w) {
                    res[group[waiting[w]]].head_ms += ms * more[w] / m_all;
                }
            }
            for (size_t j = 0; j < group.size(); ++j) {
                const int k = group[j];
                const SlotStep & st = steps[k];
                StepResult & r = res[k];
                const int rows = (int) r.draft.size() + 1;
                // a slot's part of the decode is what its rows added to the batch, and its head rows its own
                r.verify_ms = decode_ms * rows / n + r.head_ms;
                r.head_rows = hidden_rows > 0 ? head_ranges[j].done : 0;
                settle(r, st.last, rows, row0[j], st.slot);
                at(st.slot).q_tokens.clear();  // its distributions are spent
            }
        }
        for (StepResult & r : res) {
            r.step_ms = r.verify_ms + r.sample_ms + r.rollback_ms + r.draft_ms;
        }
    } catch (...) {
        // decodes only add positions from p0 on, and rollbacks only drop them, so [0, p0) is intact; a recurrent
        // state may have moved past p0 with past unchanged, and is emptied
        interruptible = false;
        feat_rows = 0;
        n_out = 0;
        collecting = false;
        draft_rows.clear();
        lattice_rows.clear();
        for (size_t k = 0; k < steps.size(); ++k) {
            at(steps[k].slot).q_tokens.clear();
            keep(recurrent ? 0 : p0[k], steps[k].slot);
        }
        throw;
    }
    return res;
}

// The LM head of the next more[w] rows of each of the head ranges `which` (after the rows they have), in one call
// per kind of row (argmax, top, full): the matrix is read once for all of them. Returns its milliseconds.
double Session::head_more(const std::vector<size_t> & which, const std::vector<int> & more) {
    const auto t0 = std::chrono::steady_clock::now();
    const int n_vocab = tgt.n_vocab();
    std::vector<float> & x = head_x;
    std::vector<float> & y = head_y;
    std::vector<int32_t> best;
    for (char kind : {PRUNED_ARGMAX, PRUNED_TOP, FULL}) {
        x.clear();
        std::vector<const HeadRange *> of;  // each row's range
        for (size_t w = 0; w < which.size(); ++w) {
            const HeadRange & h = head_ranges[which[w]];
            if (pruned_kind(h) == kind) {
                x.insert(x.end(), &hidden[(size_t) (h.lo + h.done) * n_embd],
                         &hidden[(size_t) (h.lo + h.done + more[w]) * n_embd]);
                of.insert(of.end(), more[w], &h);
            }
        }
        const int m_all = (int) (x.size() / n_embd);
        if (m_all == 0) {
            continue;
        }
        std::vector<GreedyHead::Top> tops;
        if (kind == PRUNED_ARGMAX) {
            best.resize(m_all);
            greedy_argmax(x.data(), best.data(), m_all);
        } else if (kind == PRUNED_TOP) {
            tops.resize(m_all);
            top_rows(x.data(), tops.data(), m_all, of);
        } else {
            if (y.size() < (size_t) m_all * n_vocab) {
                y.resize((size_t) m_all * n_vocab);
            }
            compute_head(x.data(), y.data(), m_all);
        }
        int off = 0;
        for (size_t w = 0; w < which.size(); ++w) {
            HeadRange & h = head_ranges[which[w]];
            if (pruned_kind(h) != kind) {
                continue;
            }
            if (kind == PRUNED_ARGMAX) {
                std::copy_n(&best[off], more[w], &row_best[h.lo + h.done]);
            } else if (kind == PRUNED_TOP) {
                std::move(&tops[off], &tops[off + more[w]], &row_top[h.lo + h.done]);
            } else {
                std::memcpy(&head_logits[(size_t) (h.lo + h.done) * n_vocab], &y[(size_t) off * n_vocab],
                            (size_t) more[w] * n_vocab * sizeof(float));
            }
            std::fill_n(&row_pruned[h.lo + h.done], more[w], kind);
            off += more[w];
            h.done += more[w];
        }
    }
    return ms_since(t0);
}

// The greedy head's forced tokens: sorted, each once.
static void sort_unique(std::vector<llama_token> & v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
}

// How a range's rows are computed: their argmax only, their top, or in full (without the greedy head, in full).
char Session::pruned_kind(const HeadRange & h) const {
    return !greedy_head || h.keep == 0 ? FULL : h.keep == 1 ? PRUNED_ARGMAX : PRUNED_TOP;
}

// A slot's block of rows [lo, hi) in the next decode, read by sampler s: the first head call computes `first` of
// them, and where s reads only a row's top (not when it judges drafts by rejection sampling), only that; the tokens
// whose logits s may change meanwhile are its controls' and the drafts it may take in before the last row.
Session::HeadRange Session::head_range(int lo, int hi, int first, const Sampler & s, bool rejection,
                                       const std::vector<llama_token> & draft) const {
    HeadRange h{lo, hi, 0, std::max(first, 1), rejection ? 0 : s.keep(), {}};
    if (h.keep > 1) {
        h.forced = s.touched();
        h.forced.insert(h.forced.end(), draft.begin(), draft.end());
        sort_unique(h.forced);
    }
    return h;
}

// llama.cpp's abort callback on the target context, asked between the graph's nodes: give up a batched step's decode
// when interrupt() asked for it and the decode is young enough that giving it up costs less than waiting for it.
bool Session::abort_cb(void * data) {
    Session * self = static_cast<Session *>(data);
    if (!self->interruptible || !self->interrupt_wanted.load(std::memory_order_relaxed) ||
        ms_since(self->t_interruptible) > self->interrupt_within_ms) {
        return false;
    }
    self->interrupt_wanted = false;  // one interruption per request
    return true;
}

// The order in which llama.cpp computes the rows of a batch when each sequence has a cache of its own (its
// split_equal, sequential): ubatch after ubatch, each taking a run of sequences with consecutive ids and as many rows
// of each as the shortest of them has left (and the ubatch holds), sequence after sequence. Returns, for each row in
// that order, its index in the batch.
std::vector<int> Session::ubatch_order(const std::vector<int> & seq, int n_ubatch) {
    const int n = (int) seq.size();
    std::vector<char> used(n, 0);
    std::vector<int> out;
    while ((int) out.size() < n) {
        std::vector<int> seqs;
        for (int i = 0; i < n; ++i) {
            if (used[i] || std::find(seqs.begin(), seqs.end(), seq[i]) != seqs.end() ||
                (!seqs.empty() && seq[i] != seqs.back() + 1)) {
                continue;
            }
            seqs.push_back(seq[i]);
            if ((int) seqs.size() > n_ubatch) {
                break;
            }
        }
        std::vector<std::vector<int>> rows(seqs.size());
        std::vector<int> next(seqs.size(), 0);
        auto next_row = [&](size_t s) {  // the next unused row of seqs[s], or -1
            for (int & i = next[s]; i < n; ++i) {
                if (!used[i] && seq[i] == seqs[s]) {
                    return i;
                }
            }
            return -1;
        };
        while (true) {
            bool all = true;
            for (size_t s = 0; s < seqs.size() && all; ++s) {
                all = next_row(s) >= 0;
            }
            if (!all) {
                break;
            }
            for (size_t s = 0; s < seqs.size(); ++s) {
                const int i = next_row(s);
                rows[s].push_back(i);
                used[i] = 1;
            }
            if ((rows[0].size() + 1) * seqs.size() > (size_t) n_ubatch) {
                break;
            }
        }
        for (auto & r : rows) {
            out.insert(out.end(), r.begin(), r.end());
        }
    }
    return out;
}

#if defined(__linux__)
// Hand the whole pages of [p, p + bytes) back to the system: private anonymous memory reads as zeros after it, and
// every buffer given here is written before it is read again.
static void release_pages(const void * p, size_t bytes) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t) p + page - 1) & ~(page - 1);
    const uintptr_t hi = ((uintptr_t) p + bytes) & ~(page - 1);
    if (p && hi > lo) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
}
#endif

// Between requests nothing in the per-decode buffers is needed: give their memory back. A burst of parallel slots
// grows them to its largest batch (a megabyte of logits per row for a 262k vocabulary), and llama.cpp keeps its
// own at their largest (its output buffer only grows, output_reserve; the compute buffer is touched as far as the
// largest graph reached). Only for contexts wholly on the CPU, whose buffers are plain host memory.
void Session::trim() {
    LogScope log(verbose);
    for (std::vector<float> * v : {&hidden, &head_logits, &head_x, &head_y, &feats, &cb_rows, &draft_rows,
                                  &lattice_rows}) {
        std::vector<float>().swap(*v);
    }
    std::vector<char>().swap(head_q);
    std::vector<char>().swap(row_pruned);
    std::vector<int32_t>().swap(row_best);
    std::vector<GreedyHead::Top>().swap(row_top);
    n_out = feat_rows = hidden_rows = norm_seen = 0;  // the last decode's rows are gone
#if defined(__linux__)
    auto release_buffer = [](ggml_backend_buffer_t buf) {  // noted only where in host memory
        if (buf) {
            release_pages(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf));
        }
    };
    if (tgt.params.n_gpu_layers == 0) {
        release_pages(llama_get_logits(ctx_tgt), (size_t) max_out_tgt * tgt.n_vocab() * sizeof(float));
        release_buffer(compute_buf);
    }
    if (ctx_dft && dft->params.n_gpu_layers == 0) {
        release_pages(llama_get_logits(ctx_dft), (size_t) max_out_dft * dft->n_vocab() * sizeof(float));
        release_buffer(compute_buf_dft);
    }
#endif
#if defined(__GLIBC__)
    malloc_trim(0);  // what the vectors and llama.cpp's smaller buffers freed, which glibc keeps otherwise
#endif
}

// By default the greedy head is built where it pays, where the LM head is a large part of a verify row: a quarter of
// the target's weights or more; asked for, wherever the head and CPU allow.
void Session::build_greedy_head() {
    if (greedy_head_mode == 0 || !head_w || greedy_head || !GreedyHead::supported(head_w)) {
        return;
    }
    if (greedy_head_mode == 1 || (GreedyHead::fast() && 4 * ggml_nbytes(head_w) >= llama_model_size(tgt.model))) {
        greedy_head = std::make_unique<GreedyHead>(head_w, (int) llama_n_threads_batch(ctx_tgt));
    }
}

void Session::set_greedy_head(std::optional<bool> on) {
    greedy_head_mode = on ? (int) *on : -1;
    greedy_head.reset();
    build_greedy_head();
}

// Logits of one output row of the last target decode (rows of a verify batch: 0 = after `last`).
py::array_t<float> Session::logits(int row) {
    if (row < -n_out || row >= n_out) {
        throw std::out_of_range("row " + std::to_string(row) + " outside the " + std::to_string(n_out) +
                                " output rows of the last target decode");
    }
    LogScope log(verbose);
    const int n_vocab = tgt.n_vocab();
    const float * src = target_row(row, true);
    py::array_t<float> out(n_vocab);
    std::memcpy(out.mutable_data(), src, n_vocab * sizeof(float));
    return out;
}

py::array_t<float> Session::greedy_logits(int row, int top_k, std::vector<llama_token> forced) {
    if (!greedy_head_active() || row < 0 || row >= hidden_rows) {
        throw std::invalid_argument("no greedy head for row " + std::to_string(row) + " of the last target decode");
    }
    if (top_k < 1) {
        throw std::invalid_argument("top_k must be at least 1");
    }
    check_tokens(forced);
    sort_unique(forced);
    LogScope log(verbose);
    py::array_t<float> out(tgt.n_vocab());
    GreedyHead::Top top;
    greedy_head->top(&hidden[(size_t) row * n_embd], 1, head_threads(1), &top_k, &forced, &top);
    std::fill_n(out.mutable_data(), tgt.n_vocab(), -INFINITY);
    for (const auto & [v, e] : top) {
        out.mutable_data()[v] = e;
    }
    return out;
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

// Forget every position of one sequence of decode_rows.
void Session::drop_sequence(int seq) {
    if (seq < 0 || seq >= n_seq_user) {
        throw std::out_of_range("no sequence " + std::to_string(seq));
    }
    LogScope log(verbose);
    if (!llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq, -1, -1)) {
        fail("the KV cache could not drop sequence " + std::to_string(seq));
    }
}

// Target features of the rows of the last target decode: [rows, n_layers * n_embd], layers in the given order.
// Empty after a failed call.
py::array_t<float> Session::features() const {
    const size_t width = layers.size() * (size_t) n_embd;
    py::array_t<float> out({(size_t) feat_rows, width});
    std::memcpy(out.mutable_data(), feats.data(), (size_t) feat_rows * width * sizeof(float));
    return out;
}

// Logits of row i of the last target decode (llama.cpp's batch index; negative: from the last output). A row of a
// greedy or top-k range comes back null, unless `full`: the greedy head gave only its argmax (row_best) or its top
// (row_top).
const float * Session::target_row(int i, bool full) {
    if (hidden_rows == 0) {
        return logits_row(ctx_tgt, i < 0 ? i + n_rows : i, "target");  // the scratch row's are not ours
    }
    i = i < 0 ? i + hidden_rows : i;  // on demand, every row is an output
    if (i < 0 || i >= hidden_rows) {
        fail("no target logits for output row " + std::to_string(i));
    }
    auto h = std::find_if(head_ranges.begin(), head_ranges.end(), [&](const HeadRange & r) { return i < r.hi; });
    if (h == head_ranges.end() || i < h->lo) {
        fail("no target logits for output row " + std::to_string(i));
    }
    const size_t n_vocab = tgt.n_vocab();
    if (i >= h->lo + h->done) {
        // a block's rows are read in order: first the `first` rows the step's caller expects to read, then as many
        // more as have been read (doubling): a call costs a few ms beyond its rows (docs/measurements.md), so a
        // block whose drafts are accepted pays a few calls, and one rejected early one or two rows
        const int end = std::min(h->hi, std::max(i + 1, h->lo + (h->done ? 2 * h->done : h->first)));
        const int i0 = h->lo + h->done;
        const char kind = full ? FULL : pruned_kind(*h);
        if (kind == PRUNED_ARGMAX) {
            greedy_argmax(&hidden[(size_t) i0 * n_embd], &row_best[i0], end - i0);
        } else if (kind == PRUNED_TOP) {
            top_rows(&hidden[(size_t) i0 * n_embd], &row_top[i0], end - i0,
                     std::vector<const HeadRange *>(end - i0, &*h));
        } else {
            compute_head(&hidden[(size_t) i0 * n_embd], &head_logits[i0 * n_vocab], end - i0);
        }
        std::fill(&row_pruned[i0], &row_pruned[end], kind);
        h->done = end - h->lo;
    }
    if (full && row_pruned[i] != FULL) {
        compute_head(&hidden[(size_t) i * n_embd], &head_logits[i * n_vocab], 1);
        row_pruned[i] = FULL;
    }
    return row_pruned[i] != FULL ? nullptr : &head_logits[i * n_vocab];
}

// The token the sampler takes from row i of the last target decode (as target_row counts rows): a pruned row's
// argmax, which is what next() takes from a greedy sampler's row (and it takes nothing in), else next()'s.
llama_token Session::sample_row_of(int i, Sampler & s, uint64_t index) {
    const float * row = target_row(i);
    if (!row) {
        i = i < 0 ? i + hidden_rows : i;
        return row_pruned[i] == PRUNED_TOP ? s.next_top(row_top[i], index, cand) : row_best[i];
    }
    return s.next(row, index, cand);
}

// The threads of a head call of r rows: the decode's for one row, the batch's for more, as llama.cpp's own head.
int Session::head_threads(int r) const {
    return (int) (r > 1 ? llama_n_threads_batch(ctx_tgt) : llama_n_threads(ctx_tgt));
}

// The argmax of r final-norm rows x of greedy ranges, by the greedy head.
void Session::greedy_argmax(const float * x_rows, int32_t * best, int r) {
    const auto t0 = std::chrono::steady_clock::now();
    greedy_head->argmax(x_rows, best, r, head_threads(r));
    n_argmax_rows += r;
}

// The top of r final-norm rows x of top-k ranges, by the greedy head: row j's of[j]->keep largest logits and its
// range's forced tokens.
void Session::top_rows(const float * x_rows, GreedyHead::Top * out, int r, const std::vector<const HeadRange *> & of) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int> k(r);
    std::vector<std::vector<int32_t>> forced(r);
    for (int j = 0; j < r; ++j) {
        k[j] = of[j]->keep;
        forced[j] = of[j]->forced;
    }
    greedy_head->top(x_rows, r, head_threads(r), k.data(), forced.data(), out);
    n_top_rows += r;
}

// The LM head of r final-norm rows x into their logits y.
void Session::compute_head(const float * x_rows, float * y_rows, int r) {
    const auto t0 = std::chrono::steady_clock::now();
    const int n_vocab = tgt.n_vocab();
    const int nth = head_threads(r);
    if (pad && !head_w->extra) {  // extra: a repacked layout, which only ggml's own matmul reads
        head_vec_dot(x_rows, y_rows, r, nth);
        return;
    }
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
        head_set_threads(head_cpu, nth);
    }
    ggml_init_params ip = {ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(8, false), nullptr, true};
    ggml_context * g = ggml_init(ip);
    if (!g) {
        fail("could not allocate the LM head's graph");
    }
    ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_embd, r);
    x->data = const_cast<float *>(x_rows);
    ggml_tensor * y = ggml_mul_mat(g, head_w, x);
    y->data = y_rows;
    ggml_cgraph * gf = ggml_new_graph_custom(g, 8, false);
    ggml_build_forward_expand(gf, y);
    const ggml_status st = ggml_backend_graph_compute(head_cpu, gf);
    ggml_free(g);
    if (st != GGML_STATUS_SUCCESS) {
        fail("the LM head failed (ggml status " + std::to_string((int) st) + ")");
    }
}

// pad: rows [i0, i0 + r) of the LM head with ggml's one-row kernel (vec_dot), each row's bits those of llama.cpp's
// head for a prompt's one output row; as ggml's own loop does, the rows go through the matrix in blocks of 16
// matrix rows, each block read once for every row. (ggml's matmul would give two rows or more to sgemm.)
void Session::head_vec_dot(const float * x_rows, float * out, int r, int nth) {
    const int n_vocab = tgt.n_vocab();
    const ggml_type_traits_cpu * tw = ggml_get_type_traits_cpu(head_w->type);
    const ggml_type vt = tw->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, n_embd);
    head_q.resize((size_t) r * xrow);
    for (int j = 0; j < r; ++j) {  // as ggml converts a matmul's rows to the kernel's type
        const float * src = &x_rows[(size_t) j * n_embd];
        if (vt == GGML_TYPE_F32) {
            std::memcpy(&head_q[j * xrow], src, xrow);
        } else {
            ggml_get_type_traits_cpu(vt)->from_float(src, &head_q[j * xrow], n_embd);
        }
    }
    const char * w = (const char *) head_w->data;
    const size_t wrow = head_w->nb[1];
    auto work = [&](int v0, int v1) {
        for (int b0 = v0; b0 < v1; b0 += 16) {
            const int b1 = std::min(v1, b0 + 16);
            for (int j = 0; j < r; ++j) {
                for (int v = b0; v < b1; ++v) {
                    tw->vec_dot(n_embd, &out[(size_t) j * n_vocab + v], 0, w + v * wrow, 0, &head_q[j * xrow], 0, 1);
                }
            }
        }
    };
    // ggml's OpenMP team, whose threads would otherwise spin beside ours
#pragma omp parallel for num_threads(nth) schedule(static, 1)
    for (int t = 0; t < nth; ++t) {
        work((int) ((int64_t) n_vocab * t / nth), (int) ((int64_t) n_vocab * (t + 1) / nth));
    }
}

// Everything llama.cpp would assert on (and abort the process) is checked here, before any context exists.
void Session::check_arguments(const ContextOptions & o) {
    if (o.n_rs_seq > o.n_batch) {  // a snapshot per token of one decode at most
        throw std::invalid_argument("n_rs_seq must be at most n_batch (" + std::to_string(o.n_batch) + "), got " +
                                    std::to_string(o.n_rs_seq));
    }
    if (o.n_ctx != 0 && o.n_ctx < 2) {
        throw std::invalid_argument("n_ctx must be 0 (the model's) or at least 2, got " + std::to_string(o.n_ctx));
    }
    if (o.n_seq < 1 || o.n_seq > max_seq) {
        throw std::invalid_argument("n_seq must be 1.." + std::to_string(max_seq) + ", got " +
                                    std::to_string(o.n_seq));
    }
    if (o.n_seq > 1 && o.kv_unified && dft) {
        throw std::invalid_argument("slots that draft need a cache per sequence, not a unified one (kv_unified)");
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

void Session::create_contexts(const ContextOptions & o, int n_rs_seq) {
    // DFLASH_PAD_ROWS=1 or 0 forces it either way (tests of the mechanism where the build has no sgemm)
    const char * force = std::getenv("DFLASH_PAD_ROWS");
    pad = force ? std::strcmp(force, "1") == 0 : sgemm_built_in() && tgt.params.n_gpu_layers == 0;
    pad = pad && o.n_batch >= 2 && o.n_ubatch >= 2;  // one-row ubatches: every row by vec_dot, exact as it is
    pad = pad && !recurrent;  // see Session::pad
    // With a cache per sequence llama.cpp puts rows of two sequences in one ubatch only where their ids are
    // consecutive, one row each: a slot's scratch row would need a sequence beside the slot's. One slot only.
    pad = pad && o.n_seq == 1;
    n_seq_user = o.n_seq;
    slots.assign(o.n_seq, Slot{});
    // The scratch row shares the slot's cache (its cell is freed right after). n_ctx is each sequence's context:
    // llama.cpp's n_ctx is the whole cache's.
    unified = o.kv_unified || pad;
    const int per_seq = o.n_ctx ? o.n_ctx : (int) llama_model_n_ctx_train(tgt.model);
    llama_context_params cp = context_params(o, unified ? o.n_ctx : per_seq * o.n_seq, o.n_batch, o.n_ubatch);
    cp.type_k = o.type_k;
    cp.type_v = o.type_v;
    // llama.cpp sets it back to 0 for architectures without snapshot rollback (qwen3next, mamba, rwkv, ...)
    cp.n_rs_seq = recurrent ? (uint32_t) n_rs_seq : 0;
    cp.n_seq_max = (uint32_t) (o.n_seq + pad);
    cp.kv_unified = unified;
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
    llama_set_abort_callback(ctx_tgt, abort_cb, this);
    n_ctx = (int) llama_n_ctx_seq(ctx_tgt);
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
    llama_context_params dp = context_params(o, (n_ctx + block_size) * o.n_seq, n_dft_batch, n_dft_batch);
    dp.n_seq_max = (uint32_t) o.n_seq;
    dp.kv_unified = false;
    dp.ctx_other = ctx_tgt;
    dp.type_k = o.type_k_draft;
    dp.type_v = o.type_v_draft;
    if (dft->params.n_gpu_layers == 0) {
        dp.cb_eval           = drafter_eval_cb;
        dp.cb_eval_user_data = this;
    }
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

llama_context_params Session::context_params(const ContextOptions & o, int n_ctx, int n_batch, int n_ubatch) {
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

void Session::free_all() {
    if (head_cpu) ggml_backend_free(head_cpu);
    head_cpu = nullptr;
    if (batch_dft) llama_batch_ext_free(batch_dft);
    if (ctx_dft) llama_free(ctx_dft);
    if (batch_tgt) llama_batch_ext_free(batch_tgt);
    if (ctx_tgt) llama_free(ctx_tgt);
    batch_dft = batch_tgt = nullptr;
    ctx_dft = ctx_tgt = nullptr;
}

// Run a call on one slot that changes the caches; if it throws, put that slot's caches back as they were at its
// start.
template <class F> auto Session::transaction(int slot, F && f) -> decltype(f()) {
    LogScope log(verbose);
    Slot & sl = at(slot);
    const int p0 = sl.past;
    try {
        return f();
    } catch (...) {
        // decodes only add positions from p0 on, and rollbacks only drop them, so [0, p0) is intact; a
        // recurrent state may have moved past p0 with past unchanged, and is emptied
        feat_rows = 0;
        n_out = 0;
        collecting = false;
        draft_rows.clear();
        sl.q_tokens.clear();
        lattice_rows.clear();
        keep(recurrent ? 0 : p0, slot);
        throw;
    }
}

// Make both caches hold the positions [0, n) only of the slot's sequence. If llama.cpp refuses to drop part of it,
// empty the sequence (should even that fail, every slot's) and return false. A recurrent target's state is only
// known at past and at the checkpoint: elsewhere (a failed call going back to its start, after decoding) it is
// emptied too.
bool Session::keep(int n, int slot) {
    Slot & sl = at(slot);
    llama_memory_t mem_tgt = llama_get_memory(ctx_tgt);
    llama_memory_t mem_dft = ctx_dft ? llama_get_memory(ctx_dft) : nullptr;
    bool ok = true;
    if (recurrent && n != sl.past && n != 0) {
        ok = n == sl.prompt_ckpt_pos && restore_state(sl.prompt_ckpt, slot);
    }
    ok = ok && llama_memory_seq_rm(mem_tgt, slot, n, -1);
    if (pad) {  // a decode that failed may have left its scratch row
        ok = llama_memory_seq_rm(mem_tgt, n_seq_user, -1, -1) && ok;
    }
    if (mem_dft) {
        ok = llama_memory_seq_rm(mem_dft, slot, n, -1) && ok;
    }
    sl.past = n;
    if (!ok) {
        sl.past = 0;
        const bool emptied = llama_memory_seq_rm(mem_tgt, slot, -1, -1) &&
                             (!mem_dft || llama_memory_seq_rm(mem_dft, slot, -1, -1));
        if (!emptied) {
            llama_memory_clear(mem_tgt, false);
            if (mem_dft) {
                llama_memory_clear(mem_dft, false);
            }
            for (Slot & other : slots) {
                const bool capture = other.capture;
                other = Slot{};
                other.capture = capture;
            }
        }
    }
    for (Slot & s : slots) {
        // deferred features of dropped positions go with them
        s.dft_past = std::min(s.dft_past, s.past);
        s.n_pending = std::clamp(s.past - s.dft_past, 0, s.n_pending);
        if (s.prompt_ckpt_pos > s.past) {
            s.prompt_ckpt_pos = -1;
            s.prompt_ckpt.clear();
        }
    }
    return ok;
}

// The target's recurrent state of one slot (not its attention KV cache, which drops positions by itself).
void Session::save_state(std::vector<uint8_t> & buf, int slot) {
    buf.resize(llama_state_seq_get_size_ext(ctx_tgt, slot, partial));
    if (buf.empty() || llama_state_seq_get_data_ext(ctx_tgt, buf.data(), buf.size(), slot, partial) != buf.size()) {
        fail("could not save the target's recurrent state");
    }
}

bool Session::restore_state(const std::vector<uint8_t> & buf, int slot) {
    return !buf.empty() &&
           llama_state_seq_set_data_ext(ctx_tgt, buf.data(), buf.size(), slot, partial) == buf.size();
}

void Session::drop_from(llama_context * ctx, llama_pos p0, const char * which, int slot) {
    if (!llama_memory_seq_rm(llama_get_memory(ctx), slot, p0, -1)) {
        fail(std::string("the ") + which + " KV cache could not drop the positions from " + std::to_string(p0) +
             " on");
    }
}

void Session::check_tokens(const std::vector<llama_token> & toks) const {
    const int n_vocab = tgt.n_vocab();
    for (llama_token t : toks) {
        if (t < 0 || t >= n_vocab) {
            throw std::out_of_range("token id " + std::to_string(t) + " outside the vocabulary (0.." +
                                    std::to_string(n_vocab - 1) + ")");
        }
    }
}

void Session::add_token(llama_batch_ext * b, llama_token t, llama_pos pos, bool logits, llama_seq_id seq) {
    const int32_t idx = llama_batch_ext_add_token(b, seq, t);
    if (idx < 0 || !llama_batch_ext_set_pos(b, idx, &pos) || !llama_batch_ext_set_output_logits(b, idx, logits)) {
        fail("could not add token " + std::to_string(t) + " at position " + std::to_string(pos) +
             " to a batch (code " + std::to_string(idx) + ")");
    }
}

// The part of a draft a step verifies: never past the end of the context or the batch (pad: nor into the last
// cell, which is decoded alone), nor past a token the grammar refuses, which could never be accepted.
std::vector<llama_token> Session::cut_draft(const Slot & sl, const std::vector<llama_token> & draft,
                                            Sampler & s) const {
    const int room = std::max(0, std::min(n_ctx - sl.past - 1 - pad, n_batch - 1));
    std::vector<llama_token> d(draft.begin(), draft.begin() + std::min<int>((int) draft.size(), room));
    d.resize(s.grammar_prefix(d));
    if (pad && !d.empty() && ((int) d.size() + 1) % (int) llama_n_ubatch(ctx_tgt) == 1) {
        d.pop_back();  // no ubatch of one row
    }
    return d;
}

// Accept while the target's own choice (row row0 + a of the last decode) equals the draft (or, rejection sampling,
// while it keeps the draft token); the first disagreement is the target's token. It goes on from the rows already
// read (r.tokens); with `wait`, it stops (false) at a row whose LM head that range has not computed yet, for
// step_batch to compute the rows several slots wait for in one call. True once the step's tokens are all known.
bool Session::accept(StepResult & r, int row0, Sampler & s, uint64_t index, bool rejection, int slot,
                     const HeadRange * wait) {
    const size_t n_vocab = tgt.n_vocab();
    const Slot & sl = at(slot);
    for (int a = (int) r.tokens.size();; ++a) {
        if (wait && a >= wait->done) {
            return false;
        }
        const llama_token t = rejection && a < (int) r.draft.size()
                                  ? s.judge(target_row(row0 + a), r.draft[a], &sl.q_rows[a * n_vocab], index + a)
                                  : sample_row_of(row0 + a, s, index + a);
        r.tokens.push_back(t);
        if (a == (int) r.draft.size() || t != r.draft[a]) {
            r.n_accepted = a;
            return true;
        }
    }
}

// After the accept loop: drop the rejected rows of the slot's block (n_block rows from its position, rows row0.. of
// the last decode) from the target, and keep the accepted positions' features for the drafter.
void Session::settle(StepResult & r, llama_token last, int n_block, int row0, int slot) {
    Slot & sl = at(slot);
    const int p0 = sl.past;
    const int a = r.n_accepted;
    const int n_drop = n_block - (a + 1);
    if (n_drop > 0) {
        const auto t0 = std::chrono::steady_clock::now();
        if (!recurrent) {
            drop_from(ctx_tgt, p0 + a + 1, "target", slot);
            r.rollback = "kv";
        } else if (n_drop <= n_rs) {
            // exact: within the last decode, and the anchor is always kept (see DESIGN, facts added later)
            drop_from(ctx_tgt, p0 + a + 1, "target", slot);
            r.rollback = "snapshot";
        } else {
            if (!restore_state(sl.step_ckpt, slot)) {
                fail("could not restore the target's recurrent checkpoint");
            }
            drop_from(ctx_tgt, p0, "target", slot);
            std::vector<llama_token> kept{last};
            kept.insert(kept.end(), r.draft.begin(), r.draft.begin() + a);
            replay(kept.data(), a + 1, p0, slot);
            r.rollback = "checkpoint";
        }
        r.rollback_ms += ms_since(t0);
    }
    if (ctx_dft && sl.capture) {
        const auto t2 = std::chrono::steady_clock::now();
        defer(p0, a + 1, slot, row0);
        r.draft_ms += ms_since(t2);
    }
    sl.past = p0 + a + 1;  // `last` and the accepted drafts are now in both caches
}

// A prompt chunk: decode n tokens at pos0.., with the last one's logits if `last`.
void Session::decode_target(const llama_token * toks, int n, int pos0, bool last, int slot) {
    llama_batch_ext_clear(batch_tgt);
    for (int i = 0; i < n; ++i) {
        add_token(batch_tgt, toks[i], pos0 + i, last && i == n - 1, slot);
    }
    capture = at(slot).capture;
    const bool scratch = add_scratch(toks[0], n, pos0, false);
    run_target(n + scratch, last, false, n, last);
}

// pad: a one-row decode of n tokens at pos0 gets the scratch row (its token again, with logits if `output`), where
// the cache has a cell for it. Returns whether it did.
bool Session::add_scratch(llama_token tok, int n, int pos0, bool output) {
    if (!pad || n != 1 || pos0 + 2 > n_ctx) {
        return false;
    }
    add_token(batch_tgt, tok, 0, output, n_seq_user);
    return true;
}

void Session::drop_scratch() {
    if (!llama_memory_seq_rm(llama_get_memory(ctx_tgt), n_seq_user, -1, -1)) {
        fail("the KV cache could not drop the scratch row");
    }
}

// Decode the n rows in batch_tgt (n_outputs of them with logits) and collect their features; on_demand: every
// row is an output, and its LM head waits for target_row() where head_w allows. The first n_real rows are the
// caller's (n_real_out of them outputs), a scratch row may follow (pad).
void Session::run_target(int n, int n_outputs, bool on_demand, int n_real, int n_real_out) {
    n_real = n_real < 0 ? n : n_real;
    n_real_out = n_real_out < 0 ? n_outputs : n_real_out;
    const size_t width = layers.size() * (size_t) n_embd;
    lazy = on_demand && head_on_demand && head_w;
    probing = !head_probed && n_outputs > 0 && tgt.params.n_gpu_layers == 0;
    probe_prev = probe_w = nullptr;
    probe_tail = 0;
    hidden_rows = norm_seen = 0;
    head_ranges.clear();
    if (lazy) {
        hidden.resize((size_t) n * n_embd);
        if (head_logits.size() < (size_t) n * tgt.n_vocab()) {  // only grows: rows are written before they are read
            head_logits.resize((size_t) n * tgt.n_vocab());
        }
        row_pruned.assign(n, 0);
        row_best.resize(n);
        row_top.resize(n);
    }
    feats.resize((size_t) n * width);
    feat_rows = n;
    rows_seen.assign(layers.size(), 0);
    if (!layer_api) {
        cb_rows.resize((size_t) n * n_embd);
    }
    n_out = n_rows = 0;
    collecting = true;
    max_out_tgt = std::max(max_out_tgt, n_outputs);
    process(ctx_tgt, batch_tgt, "target decode");
    llama_synchronize(ctx_tgt);
    collecting = false;
    if (n > n_real) {
        drop_scratch();
    }
    n_out = n_real_out;
    n_rows = n_real;
    if (probing) {
        head_probed = true;
        probing = false;
        const bool plain_head = probe_w && probe_tail == 0 && probe_w->buffer &&
                                ggml_backend_buffer_is_host(probe_w->buffer) && probe_w->ne[0] == n_embd &&
                                probe_w->ne[1] == tgt.n_vocab();
        head_w = plain_head ? probe_w : nullptr;
        build_greedy_head();
    }
    if (lazy) {
        if (norm_seen != n) {
            fail("the final norm gave " + std::to_string(norm_seen) + " of " + std::to_string(n) + " rows");
        }
        hidden_rows = n_real;  // their head ranges are the caller's (step_batch)
    }
    if (!capture || layers.empty()) {
        feat_rows = 0;
    } else if (layer_api) {
        feat_rows = n_real;
        for (size_t k = 0; k < layers.size(); ++k) {
            const float * src = llama_get_embeddings_layer_inp(ctx_tgt, (uint32_t) layers[k]);
            if (!src) {
                fail("no features for layer " + std::to_string(layers[k]));
            }
            for (int i = 0; i < n_real; ++i) {
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
        feat_rows = n_real;
    }
}

// For trim(): the host buffer a graph's scratch lives in, the one of its final norm or logits (never a view into a
// cache), noted at every decode, since llama.cpp reallocates it for a larger graph.
static void note_compute_buffer(const ggml_tensor * t, const char * name, ggml_backend_buffer_t & buf) {
    if (t->view_src == nullptr && t->buffer && ggml_backend_buffer_is_host(t->buffer) &&
        (strcmp(name, "result_norm") == 0 || strcmp(name, "result_output") == 0)) {
        buf = t->buffer;
    }
}

// The drafter's callback, on a CPU drafter only: it needs no node, it notes where the drafter's graph lives.
bool Session::drafter_eval_cb(ggml_tensor * t, bool ask, void * user) {
    if (ask) {
        note_compute_buffer(t, ggml_get_name(t), ((Session *) user)->compute_buf_dft);
    }
    return !ask;
}

// Scheduler callback: the output of layer N ("l_out-N") is the input of layer N + 1. It runs inside llama.cpp
// and must not throw: a tensor it cannot use is skipped, and decode_target reports the missing rows.
bool Session::eval_cb(ggml_tensor * t, bool ask, void * user) {
    auto * self = (Session *) user;
    const char * name = ggml_get_name(t);
    if (ask) {
        note_compute_buffer(t, name, self->compute_buf);
    }
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
void Session::replay(const llama_token * toks, int n, int pos0, int slot) {
    llama_batch_ext_clear(batch_tgt);
    for (int i = 0; i < n; ++i) {
        add_token(batch_tgt, toks[i], pos0 + i, false, slot);
    }
    n_out = n_rows = 0;
    hidden_rows = 0;
    process(ctx_tgt, batch_tgt, "target replay");
}

// Keep the features of rows [0, n) of the last target decode, those of positions pos0.., for the drafter: they
// go into its cache in one batch when it next drafts (or when a batch of them is full). Injected at every token,
// they cost a drafter call at every plain step of the adaptive policy, which needs none of them until it drafts
// again. The drafter's cache then holds the same K/V as with injection at every token: a feature row's K/V
// depend on that row and its position only.
void Session::defer(int pos0, int n, int slot, int row0) {
    Slot & sl = at(slot);
    if (pos0 != sl.dft_past + sl.n_pending) {
        // positions decoded without capture lie between: the drafter never sees them (as before deferral)
        flush(slot);
        sl.dft_past = pos0;
    }
    const size_t width = layers.size() * (size_t) n_embd;
    const int cap = (int) llama_n_batch(ctx_dft);
    for (int i = 0; i < n;) {
        const int take = std::min(n - i, cap - sl.n_pending);
        sl.pending.resize((size_t) (sl.n_pending + take) * width);
        std::memcpy(&sl.pending[(size_t) sl.n_pending * width], &feats[(size_t) (row0 + i) * width],
                    take * width * sizeof(float));
        sl.n_pending += take;
        i += take;
        if (sl.n_pending == cap) {
            flush(slot);
        }
    }
}

// Inject the deferred features into the drafter's cache, in one batch.
void Session::flush(int slot) {
    Slot & sl = at(slot);
    if (sl.n_pending == 0) {
        return;
    }
    inject(sl.dft_past, sl.pending.data(), sl.n_pending, slot);
    sl.dft_past += sl.n_pending;
    sl.n_pending = 0;
}

// Write n rows of target features into the drafter's cache at positions pos0...
void Session::inject(int pos0, const float * rows, int n, int slot) {
    // the previous noise block left its own K/V from pos0 on
    drop_from(ctx_dft, pos0, "drafter", slot);
    const size_t width = layers.size() * (size_t) n_embd;
    llama_batch_ext_clear(batch_dft);
    for (int i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_embd(batch_dft, slot, llama_embd{&rows[i * width], 1, width});
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
