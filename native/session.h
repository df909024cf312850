// Session: a target context, an optional drafter context, and the speculative step (draft, verify, roll back), with
// their options (ContextOptions) and results (Draft, StepResult). The member functions, with the comments that
// explain them, are in session.cpp (construction and the step), contexts.cpp (the contexts and each slot's sequence
// in their caches), head.cpp (the LM head on demand), features.cpp (feature capture and injection), drafting.cpp (the
// drafter's side) and rows.cpp (training's decode_rows); session_internal.h holds what those files share.

#pragma once

#include "greedy_head.h"
#include "model.h"
#include "sampler.h"

#include <pybind11/numpy.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// One slot's part of a step that verifies several slots' blocks in one target decode (Session::step_batch).
struct SlotStep {
    int slot = 0;
    llama_token last = 0;
    std::vector<llama_token> draft;
    Sampler * sampler = nullptr;
    uint64_t index = 0;
    bool rejection = false;
    int head_rows = 1;
};

// The llama_context_params fields a user sets (llama.cpp's -c, -b, -ub, -t, -tb, -fa, -ctk, -ctv, -ctkd, -ctvd).
struct ContextOptions {
    int n_ctx = 4096;  // 0: the model's trained context
    int n_batch = 512;  // the most tokens one target decode takes: a prompt chunk or a verify block
    int n_ubatch = 512;
    int n_threads = 1;
    int n_threads_batch = 1;
    int flash_attn = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int flash_attn_draft = LLAMA_FLASH_ATTN_TYPE_DISABLED;  // the drafter's context
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    ggml_type type_k_draft = GGML_TYPE_F32;  // f32: drafts equal to a float32 reference implementation
    ggml_type type_v_draft = GGML_TYPE_F32;
    int n_rs_seq = -1;  // recurrent-state snapshots for rolling back drafts (-1: the drafter's longest draft)
    // Independent sequences (llama.cpp's n_seq_max): a server's slots, each generating on its own (Session::Slot),
    // or training data decoding several side by side (decode_rows). n_ctx is each sequence's context.
    int n_seq = 1;
    // One cache that every sequence shares (llama.cpp's --kv-unified): decode_rows' batches of several sequences
    // need it (the rows then stay in batch order). Without it each sequence has a cache of its own, laid out as if
    // it were alone: a slot's attention then sums its cells in the same order whatever the other slots hold, and
    // its output is bit for bit that of the same request run alone.
    bool kv_unified = false;
};

ggml_type cache_type(const std::string & name);

// The per-step work of DFlash speculative decoding, written directly against llama.cpp's C API.
//
// A Session owns a target context and, optionally, a DFlash drafter context that borrows the target's token
// embeddings and LM head (ctx_other). draft() proposes a block from the drafter; step() verifies a proposal (from
// this drafter or any other) with the target in one batch, accepts the longest agreeing prefix plus the target's own
// token, rolls back both caches (a recurrent target's state by snapshot, or by checkpoint and replay) and feeds the
// accepted positions' target features to the drafter.
//
// A session has one or more slots (ContextOptions.n_seq), each a sequence of its own in both caches with its own
// position, deferred drafter features and recurrent checkpoints: the calls that generate take the slot they work on.
// Features, logits and the LM head on demand are those of the last target decode, whichever slot it was.
//
// Errors: bad arguments raise ValueError or IndexError before anything changes. A llama.cpp failure raises
// NativeError, and the call that failed leaves the caches as they were at its start: both hold exactly the positions
// [0, n_past) they held before (the drafter may also hold a stale noise block past them, which it always clears
// before use). Should llama.cpp refuse even that rollback, or the target have recurrent memory (whose state at the
// call's start is gone), both caches are emptied and n_past is 0. Either way the session stays usable and n_past
// says what the caches hold. (A failure touches the slot of the call only.)
class Session {
public:
    Session(Model & target, Model * drafter, std::vector<int> layers, const ContextOptions & opt, bool use_layer_api,
            bool verbose);
    ~Session();
    Session(const Session &) = delete;
    Session & operator=(const Session &) = delete;

    std::atomic<bool> verbose;  // print llama.cpp's log during this session's calls

    int n_past(int slot = 0) const { return at(slot).past; }
    int n_slots() const { return (int) slots.size(); }
    const Model & target() const { return tgt; }
    int context_size() const { return n_ctx; }
    bool has_drafter() const { return ctx_dft != nullptr; }
    bool uses_layer_api() const { return layer_api; }
    int batch_size() const { return n_batch; }
    int ubatch_size() const { return (int) llama_n_ubatch(ctx_tgt); }
    int threads() const { return llama_n_threads(ctx_tgt); }
    int threads_batch() const { return llama_n_threads_batch(ctx_tgt); }

    std::vector<std::tuple<std::string, size_t, size_t, size_t>> memory(const std::string & which) const;
    bool is_recurrent() const { return recurrent; }
    // whether a prompt's state is worth a checkpoint: a recurrent state, or a window cache, cannot go back anywhere
    bool checkpoints() const { return recurrent || n_swa > 0; }
    int snapshots() const { return n_rs; }
    int pending_rows(int slot = 0) const { return at(slot).n_pending; }
    int checkpoint_pos(int slot = 0) const { return at(slot).prompt_ckpt_pos; }
    int reuse_floor(int slot = 0) const;
    bool pads_rows() const { return pad; }

    // With capture off the slot runs as plain decoding (the baseline): no features, no drafter updates.
    void set_capture(bool on, int slot = 0) { at(slot).capture = on; }

    // Whether verify batches of a CPU target compute their LM head only for the rows the accept loop reaches (on by
    // default where the target's graph allows it; off: llama.cpp computes every row's logits in the batch).
    void set_head_on_demand(bool on) { head_on_demand = on; }
    bool head_on_demand_active() const { return head_on_demand && head_w; }
    // Whether greedy rows compute only their argmax, and top-k rows their top (greedy_head.h): true wherever the
    // head's type and the CPU allow, false never, none (the default) where the head is a large part of the target.
    // On AVX2 without AVX512-VNNI a plain step's one row stays in llama.cpp's graph.
    void set_greedy_head(std::optional<bool> on);
    bool greedy_head_active() const { return head_on_demand_active() && greedy_head != nullptr; }
    size_t greedy_head_bytes() const { return greedy_head ? greedy_head->bytes() : 0; }
    // Rows the greedy head has computed since the session began: for their argmax only, and for their top.
    std::pair<int64_t, int64_t> pruned_rows() const { return {n_argmax_rows, n_top_rows}; }

    void truncate(int n, int slot = 0);
    llama_token prefill(const std::vector<llama_token> & tokens, Sampler * s, uint64_t index, int slot = 0);
    void checkpoint(int slot = 0);
    std::vector<Draft> draft_batch(const std::vector<std::tuple<int, llama_token, int>> & drafts);
    Draft draft(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index,
                int slot = 0);
    StepResult step(llama_token last, const std::vector<llama_token> & draft, Sampler & s, uint64_t index,
                    bool rejection, int head_rows = 1, int slot = 0);
    std::vector<StepResult> step_batch(const std::vector<SlotStep> & steps);
    void interrupt(bool on = true) { interrupt_wanted = on; }
    void trim();
    py::array_t<float> logits(int row);
    py::array_t<float> greedy_logits(int row, int top_k, std::vector<llama_token> forced);

    // Keep the logits of every noise block, for draft_logits() (parity checks and analysis; costs a copy).
    void keep_draft_logits(bool on) { keep_draft = on; }

    py::array_t<float> draft_logits() const;
    py::array_t<float> draft_lattice() const;
    std::pair<py::array_t<int32_t>, py::array_t<float>> decode_rows(const std::vector<llama_token> & tokens,
                                                                  const std::vector<int> & pos,
                                                                  const std::vector<int> & seq, int top_k);
    void drop_sequence(int seq);
    py::array_t<float> features() const;

private:
    // One slot's sequence (its seq_id is its index) and what the session keeps for it between calls.
    struct Slot {
        int past = 0;        // positions [0, past) are in both caches
        bool capture = true;
        // Deferred injection (defer): the drafter's cache holds the features of positions [0, dft_past), `pending`
        // those of [dft_past, dft_past + n_pending), at most one drafter batch.
        std::vector<float> pending;
        int n_pending = 0;
        int dft_past = 0;
        // recurrent targets: the state before the current verify batch, and at prompt_ckpt_pos (the prefix cache)
        std::vector<uint8_t> step_ckpt;
        std::vector<uint8_t> prompt_ckpt;
        int prompt_ckpt_pos = -1;
        std::vector<float> q_rows;          // [n_draft, n_vocab] the drafter's distributions of the last sampled draft
        std::vector<llama_token> q_tokens;  // that draft (empty once verified, or after an argmax draft)
    };

    static constexpr int max_block = 512;
    static constexpr int max_seq = 256;  // llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h, not in llama.h)

    Model & tgt;
    Model * dft;
    std::vector<int> layers;
    bool layer_api;
    bool capture = true;  // the target decode running now captures features (its slot's setting)
    llama_context * ctx_tgt = nullptr;
    llama_context * ctx_dft = nullptr;
    // interrupt(): a batched step's decode gives up if it is in its first half (by the last one's time per row) or
    // was asked before it began, once per request, so that a new request's prompt need not wait for the whole step
    // (step_batch)
    std::atomic<bool> interrupt_wanted{false};
    bool interruptible = false;  // the decode running now is a batched step's that may be given up
    std::chrono::steady_clock::time_point t_interruptible;
    double interrupt_within_ms = 0.0;
    double step_ms_per_row = 0.0;  // the last batched step's decode
    static bool abort_cb(void * data);
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
    std::vector<float> lattice_rows;  // DFlash2: [n_draft, top_k * (top_k + 1)] of the last noise block, when kept
    int n_ctx = 0;
    int n_batch = 0;  // the most tokens one target decode takes
    int n_embd = 0;
    std::vector<Slot> slots;
    int n_out = 0;  // output (logits) rows of the last target decode
    int n_rows = 0; // rows of the last target decode, the scratch row not counted
    // the most output rows one decode of each context asked for: llama.cpp's output buffer holds as many rows of
    // logits from then on (trim)
    int max_out_tgt = 0;
    int max_out_dft = 0;
    ggml_backend_buffer_t compute_buf = nullptr;      // the target's compute buffer, where in host memory (eval_cb)
    ggml_backend_buffer_t compute_buf_dft = nullptr;  // the drafter's (drafter_eval_cb)

    // Batch invariance with upstream's llamafile sgemm (a GGML_LLAMAFILE build not patched by setup.sh). Its kernels
    // give an element of a product the same bits whatever the number of rows, but ggml calls them from two rows on
    // only: a row alone goes to vec_dot, which rounds differently (the attention's f16 products too, in every model).
    // So with such a build and the target on the CPU (pad), no position's layers are computed in a row of their
    // own: a one-token decode carries a scratch row (its token again, at position 0 of a sequence of its own,
    // dropped right after), and no batch leaves a ubatch of one row. A plain step's scratch row is an output, as
    // every row of a verify block is, so that the last layer (which computes only the output rows) sees two rows
    // there too. The LM head on demand goes the other way: every row by vec_dot, in our own loop, as llama.cpp
    // computes a prompt's one output row, so that a plain step pays for one row of it (two by sgemm cost what two
    // by vec_dot do). The last cell of the context has no room for a scratch row: no verify block reaches it, and
    // it is decoded alone in every mode. Recurrent and hybrid targets are not padded: their recurrent layers multiply
    // per sequence, one row each in a padded one-token decode, so sgemm still misses those rows (the engine says
    // bit_exact_verify false for them on such a build). Measured in docs/measurements.md ("A llamafile build").
    bool pad = false;
    int n_seq_user = 1;                // the caller's sequences (slots); the scratch row's is the next one
    bool unified = false;              // ContextOptions.kv_unified
    std::vector<char> head_q;          // head rows converted to the kernel's type (pad)

    // Recurrent (and hybrid) targets: their recurrent state cannot drop positions like a KV cache. llama.cpp keeps
    // per-token snapshots of the last decode (n_rs of them, where the architecture supports it); a rollback longer
    // than that restores a checkpoint taken before the verify batch and decodes the accepted tokens again.
    bool recurrent = false;
    int n_rs = 0;

    // Sliding-window layers keep only their window (n_swa + n_ubatch cells a sequence, position p in cell p mod
    // size: native/llama/patch_llama.py), unless the cache is shared by several sequences. A prompt cache can then
    // go back only as far as the cells still hold a full window (reuse_floor).
    int n_swa = 0;                     // the window, where the target's sliding-window layers keep only theirs
    bool collecting = false;           // the eval callback copies features only during decode_target

    std::vector<float> feats;     // [feat_rows, layers.size() * n_embd] from the last target decode
    int feat_rows = 0;
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
    std::vector<float> head_logits;    // [hidden_rows, n_vocab]
    // The rows of one slot's block in the last decode, [lo, hi): the accept loop reads them in order, and rows
    // [lo, lo + done) have their LM head computed; the first call computes `first` rows (step's head_rows).
    // keep: how much of a row its sampler reads (Sampler::keep: 0 all, 1 the argmax, K its top K), and forced the
    // tokens whose logits it may change (sorted: its controls' tokens and the block's drafts), for the greedy head.
    struct HeadRange {
        int lo, hi, done, first;
        int keep;
        std::vector<int32_t> forced;
    };
    std::vector<HeadRange> head_ranges;
    // The greedy LM head (greedy_head.h), where the output matrix is at least a quarter of the target's weights
    // (gemma's 262k-token head: two thirds): rows of a greedy range are computed for their argmax only, and rows of
    // a top-k range for their top (PRUNED_ARGMAX, PRUNED_TOP in row_pruned); logits() computes such a row in full.
    int greedy_head_mode = -1;         // -1: where it pays, 0: off, 1: wherever it can
    std::unique_ptr<GreedyHead> greedy_head;
    int64_t n_argmax_rows = 0, n_top_rows = 0;
    enum : char { FULL = 0, PRUNED_ARGMAX = 1, PRUNED_TOP = 2 };
    std::vector<char> row_pruned;      // [hidden_rows]
    std::vector<int32_t> row_best;     // [hidden_rows] the argmax of a pruned row, whose logits are not written
    std::vector<GreedyHead::Top> row_top;  // [hidden_rows] the top of a PRUNED_TOP row (its logits are not written)
    // head_more's rows and logits: kept between calls, since a fresh 1 MB per row each call costs page faults
    std::vector<float> head_x, head_y;

    // contexts.cpp: the contexts, and each slot's sequence in their caches
    void check_arguments(const ContextOptions & o);
    void create_contexts(const ContextOptions & o, int n_rs_seq);
    static llama_context_params context_params(const ContextOptions & o, int n_ctx, int n_batch, int n_ubatch);
    void free_all();
    Slot & at(int slot);
    const Slot & at(int slot) const;
    template <class F> auto transaction(int slot, F && f) -> decltype(f());  // defined in session_internal.h
    bool keep(int n, int slot);

    static constexpr llama_state_seq_flags partial = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;

    void save_state(std::vector<uint8_t> & buf, int slot);
    bool restore_state(const std::vector<uint8_t> & buf, int slot);
    static void drop_from(llama_context * ctx, llama_pos p0, const char * which, int slot);

    // session.cpp: the step, and the target decode under it (abort_cb above)
    void check_tokens(const std::vector<llama_token> & toks) const;
    static void add_token(llama_batch_ext * b, llama_token t, llama_pos pos, bool logits, llama_seq_id seq = 0);
    void check_step(const Slot & sl, llama_token last, const std::vector<llama_token> & draft, const Sampler & s,
                    bool rejection) const;
    // The steps of one target decode of step_batch: indices into its steps, their first rows and head ranges
    struct Group {
        std::vector<int> steps;
        std::vector<int> row0;
        std::vector<HeadRange> ranges;
        int n = 0;  // rows
    };
    std::vector<int> check_steps(const std::vector<SlotStep> & steps) const;
    Group batch_blocks(const std::vector<SlotStep> & steps, const std::vector<int> & order, size_t g0,
                       std::vector<StepResult> & res);
    double verify_blocks(const Group & g, const std::vector<SlotStep> & steps, std::vector<StepResult> & res,
                         bool may_interrupt);
    void read_rows(Group & g, const std::vector<SlotStep> & steps, std::vector<StepResult> & res);
    std::vector<llama_token> cut_draft(const Slot & sl, const std::vector<llama_token> & draft, Sampler & s) const;
    bool accept(StepResult & r, int row0, Sampler & s, uint64_t index, bool rejection, int slot,
                const HeadRange * wait = nullptr);
    void settle(StepResult & r, llama_token last, int n_block, int row0, int slot);
    static std::vector<int> ubatch_order(const std::vector<int> & seq, int n_ubatch);
    void decode_target(const llama_token * toks, int n, int pos0, bool last, int slot);
    bool add_scratch(llama_token tok, int n, int pos0, bool output);
    void drop_scratch();
    void run_target(int n, int n_outputs, bool on_demand = false, int n_real = -1, int n_real_out = -1);

    // head.cpp: the LM head on demand and the greedy head's rows
    const float * target_row(int i, bool full = false);
    llama_token sample_row_of(int i, Sampler & s, uint64_t index);
    void compute_head(const float * x_rows, float * y_rows, int r);
    void greedy_argmax(const float * x_rows, int32_t * best, int r);
    void top_rows(const float * x_rows, GreedyHead::Top * out, int r, const std::vector<const HeadRange *> & of);
    char pruned_kind(const HeadRange & h) const;
    HeadRange head_range(int lo, int hi, int first, const Sampler & s, bool rejection,
                         const std::vector<llama_token> & draft) const;
    int head_threads(int r) const;
    void build_greedy_head();
    double head_more(const std::vector<size_t> & which, const std::vector<int> & more);
    void head_vec_dot(const float * x_rows, float * out, int r, int nth);

    // features.cpp: feature capture and deferred injection into the drafter
    static bool eval_cb(ggml_tensor * t, bool ask, void * user);
    void replay(const llama_token * toks, int n, int pos0, int slot);
    void defer(int pos0, int n, int slot, int row0 = 0);
    void flush(int slot);
    void inject(int pos0, const float * rows, int n, int slot);

    // drafting.cpp: the drafter's side
    static bool drafter_eval_cb(ggml_tensor * t, bool ask, void * user);
    void draft_block(llama_token last, int n_draft, bool with_probs, const Sampler * sampler, uint64_t index,
                     Draft & d, int slot);
    static float top_prob(const float * scores, int n, int best);
    void walk_lattice(int n_draft, bool with_probs, Draft & d);
};
