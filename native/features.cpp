// Session's feature capture (eval callback or layer API) and its deferred injection into the drafter's cache.

#include "session_internal.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

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

// Target features of the rows of the last target decode: [rows, n_layers * n_embd], layers in the given order.
// Empty after a failed call.
py::array_t<float> Session::features() const {
    const size_t width = layers.size() * (size_t) n_embd;
    py::array_t<float> out({(size_t) feat_rows, width});
    std::memcpy(out.mutable_data(), feats.data(), (size_t) feat_rows * width * sizeof(float));
    return out;
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
