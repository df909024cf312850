// Session's contexts: checking the options, creating and freeing them, and each slot's sequence in their caches.

#include "session.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>

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
    for (int fa : {o.flash_attn, o.flash_attn_draft}) {
        if (fa < LLAMA_FLASH_ATTN_TYPE_AUTO || fa > LLAMA_FLASH_ATTN_TYPE_ENABLED) {
            throw std::invalid_argument("flash_attn must be -1 (auto), 0 (off) or 1 (on)");
        }
    }
    // llama.cpp refuses these with a log line and no context; say why instead
    if ((o.flash_attn == LLAMA_FLASH_ATTN_TYPE_DISABLED && ggml_is_quantized(o.type_v)) ||
        (dft && o.flash_attn_draft == LLAMA_FLASH_ATTN_TYPE_DISABLED && ggml_is_quantized(o.type_v_draft))) {
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
    // DFLASH_PAD_ROWS=1 or 0 forces it either way (tests of the mechanism where the build needs no padding)
    const char * force = std::getenv("DFLASH_PAD_ROWS");
    pad = force ? std::strcmp(force, "1") == 0 : sgemm_skips_one_row() && tgt.params.n_gpu_layers == 0;
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
    // llama.cpp's window cache (swa_full off) with our cell per position, where a stream holds one sequence
    cp.swa_full = unified && cp.n_seq_max > 1;
    n_swa = cp.swa_full ? 0 : std::max(0, llama_model_n_swa(tgt.model));
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
    dp.flash_attn_type = (llama_flash_attn_type) o.flash_attn_draft;
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
    // A sliding-window drafter keeps every position (llama.cpp's default): its non-causal noise blocks reach past
    // the target's positions. The target's cache is set in create_contexts.
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
    if (n != 0 && n != sl.past && n < reuse_floor(slot) && n != sl.prompt_ckpt_pos) {
        const std::string ckpt = sl.prompt_ckpt_pos > 0
            ? " (and at its checkpoint " + std::to_string(sl.prompt_ckpt_pos) + ")" : "";
        throw std::invalid_argument("the sliding-window cache holds a full window from position " +
                                    std::to_string(reuse_floor(slot)) + " on" + ckpt + ", not at " +
                                    std::to_string(n));
    }
    LogScope log(verbose);
    if (!keep(n, slot)) {
        fail("the KV cache could not drop the positions from " + std::to_string(n) +
             " on; both caches were emptied");
    }
}

// The shortest prefix other than none that truncate can keep: where the window cache still holds the n_swa - 1
// positions before it. (The oldest cells are overwritten once a sequence is longer than the cache.)
int Session::reuse_floor(int slot) const {
    const Slot & sl = at(slot);
    if (n_swa == 0 || sl.past == 0) {
        return 0;
    }
    const llama_pos lo = llama_memory_seq_pos_min(llama_get_memory(ctx_tgt), slot);
    return lo <= 0 ? 0 : std::min(sl.past, (int) lo + n_swa - 1);
}

// Make both caches hold the positions [0, n) only of the slot's sequence. If llama.cpp refuses to drop part of it,
// empty the sequence (should even that fail, every slot's) and return false. A recurrent target's state is only
// known at past and at the checkpoint: elsewhere (a failed call going back to its start, after decoding) it is
// emptied too; so is a window cache's below its reuse floor.
bool Session::keep(int n, int slot) {
    Slot & sl = at(slot);
    llama_memory_t mem_tgt = llama_get_memory(ctx_tgt);
    llama_memory_t mem_dft = ctx_dft ? llama_get_memory(ctx_dft) : nullptr;
    bool ok = true;
    if ((recurrent || n < reuse_floor(slot)) && n != sl.past && n != 0) {
        // the checkpoint's state (recurrent, or the window's cells) comes back; the full layers then drop the rest
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

// Save the target's recurrent state, or its window cache's cells, at the current position: truncate() can come back
// to it later (one checkpoint, replacing the previous one), as to a position the window still holds. A no-op for
// targets whose cache drops positions by itself.
void Session::checkpoint(int slot) {
    Slot & sl = at(slot);
    if (!checkpoints()) {
        return;
    }
    LogScope log(verbose);
    save_state(sl.prompt_ckpt, slot);
    sl.prompt_ckpt_pos = sl.past;
}

// The target's recurrent state and window cache of one slot (not its full attention layers' KV cache, which drops
// positions by itself).
void Session::save_state(std::vector<uint8_t> & buf, int slot) {
    buf.resize(llama_state_seq_get_size_ext(ctx_tgt, slot, partial));
    if (buf.empty() || llama_state_seq_get_data_ext(ctx_tgt, buf.data(), buf.size(), slot, partial) != buf.size()) {
        fail("could not save the target's checkpoint state");
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
