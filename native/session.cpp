// Session's core: construction and the step, top to bottom (prefill, verify, accept, roll back, the target decode).

#include "session_internal.h"

#include <algorithm>
#include <chrono>
#include <cstring>

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
    const std::vector<int> order = check_steps(steps);
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
            Group g = batch_blocks(steps, order, g0, res);
            // only the first decode may be given up: after it, slots have accepted tokens and moved their samplers on
            const double decode_ms = verify_blocks(g, steps, res, may_interrupt && g0 == 0);
            g0 += g.steps.size();
            read_rows(g, steps, res);
            for (size_t j = 0; j < g.steps.size(); ++j) {
                const SlotStep & st = steps[g.steps[j]];
                StepResult & r = res[g.steps[j]];
                const int rows = (int) r.draft.size() + 1;
                // a slot's part of the decode is what its rows added to the batch, and its head rows its own
                r.verify_ms = decode_ms * rows / g.n + r.head_ms;
                r.head_rows = hidden_rows > 0 ? head_ranges[j].done : 0;
                settle(r, st.last, rows, g.row0[j], st.slot);
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

// Every step of a batch checked before anything is decoded; the order of their slots.
std::vector<int> Session::check_steps(const std::vector<SlotStep> & steps) const {
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
    return order;
}

// The blocks of the steps order[g0..] that the batch holds, into batch_tgt: each step's draft cut (res), its first
// row and its head range.
Session::Group Session::batch_blocks(const std::vector<SlotStep> & steps, const std::vector<int> & order, size_t g0,
                                     std::vector<StepResult> & res) {
    Group g;
    llama_batch_ext_clear(batch_tgt);
    for (size_t i = g0; i < order.size(); ++i) {
        const int k = order[i];
        const SlotStep & st = steps[k];
        const Slot & sl = at(st.slot);
        StepResult & r = res[k];
        r.draft = cut_draft(sl, st.draft, *st.sampler);
        const int rows = (int) r.draft.size() + 1;
        if (g.n + rows > n_batch) {
            break;
        }
        g.steps.push_back(k);
        g.row0.push_back(g.n);
        g.ranges.push_back(head_range(g.n, g.n + rows, st.head_rows, *st.sampler, st.rejection, r.draft));
        for (int j = 0; j < rows; ++j) {
            add_token(batch_tgt, j == 0 ? st.last : r.draft[j - 1], sl.past + j, true, st.slot);
        }
        g.n += rows;
    }
    return g;
}

// The target decode of a group's blocks, its rows (hidden states, features) put back in batch order. Returns its
// milliseconds.
double Session::verify_blocks(const Group & g, const std::vector<SlotStep> & steps, std::vector<StepResult> & res,
                              bool may_interrupt) {
    const SlotStep & st0 = steps[g.steps[0]];
    if (recurrent && (int) res[g.steps[0]].draft.size() > n_rs) {
        // snapshots cover a rollback of at most n_rs tokens; a longer draft could need more
        const auto t0 = std::chrono::steady_clock::now();
        save_state(at(st0.slot).step_ckpt, st0.slot);
        res[g.steps[0]].rollback_ms += ms_since(t0);
    }
    const bool scratch = add_scratch(st0.last, g.n, at(st0.slot).past, true);
    // a plain step's one row goes llama.cpp's way where the greedy head has no part in it (nothing to save, and
    // llama.cpp's head skips a graph split; on AVX2 alone the greedy head takes no single row); every other row's LM
    // head waits for the accept loop
    const bool on_demand = g.n > 1 || pad || (g.ranges[0].keep && greedy_head && GreedyHead::fast());
    const auto t0 = std::chrono::steady_clock::now();
    capture = std::any_of(g.steps.begin(), g.steps.end(), [&](int k) { return at(steps[k].slot).capture; });
    interruptible = may_interrupt;
    t_interruptible = t0;
    // asked before the decode began: giving it up costs only the time to llama.cpp's first check, however late a
    // busy machine makes that
    const bool asked = interrupt_wanted.load(std::memory_order_relaxed);
    interrupt_within_ms = step_ms_per_row > 0.0 && !asked ? 0.5 * step_ms_per_row * g.n : 1e30;
    run_target(g.n + scratch, g.n + scratch, on_demand, g.n, g.n);
    interruptible = false;
    step_ms_per_row = ms_since(t0) / g.n;
    if (g.steps.size() > 1) {
        // with a cache per sequence llama.cpp computes the rows in its own order (ubatch_order): put the rows the
        // eval callback copied back in batch order
        std::vector<int> seq;
        for (int k : g.steps) {
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
    return ms_since(t0);
}

// Each slot of a decoded group reads its rows in order (accept); where its LM head runs on demand, every block's
// first rows are computed in one call, and then the rows the slots still wait for (as many more as each has read:
// target_row's doubling), in one call per round: the matrix is read once for all of them. Each slot's head_ms is its
// share of those calls.
void Session::read_rows(Group & g, const std::vector<SlotStep> & steps, std::vector<StepResult> & res) {
    const size_t n = g.steps.size();
    if (hidden_rows > 0) {
        head_ranges = std::move(g.ranges);
        std::vector<size_t> all(n);
        std::vector<int> first(n);
        int n_first = 0;
        for (size_t j = 0; j < n; ++j) {
            all[j] = j;
            first[j] = std::min(head_ranges[j].first, head_ranges[j].hi - head_ranges[j].lo);
            n_first += first[j];
        }
        const double ms = head_more(all, first);
        for (size_t j = 0; j < n; ++j) {
            res[g.steps[j]].head_ms += ms * first[j] / n_first;
        }
    }
    std::vector<char> known(n, 0);
    for (;;) {
        std::vector<size_t> waiting;
        for (size_t j = 0; j < n; ++j) {
            if (known[j]) {
                continue;
            }
            const SlotStep & st = steps[g.steps[j]];
            StepResult & r = res[g.steps[j]];
            const auto t_sample = std::chrono::steady_clock::now();
            known[j] = accept(r, g.row0[j], *st.sampler, st.index, st.rejection, st.slot,
                              hidden_rows > 0 ? &head_ranges[j] : nullptr);
            r.sample_ms += ms_since(t_sample);
            if (!known[j]) {
                waiting.push_back(j);
            }
        }
        if (waiting.empty()) {
            return;
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
            res[g.steps[waiting[w]]].head_ms += ms * more[w] / m_all;
        }
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
