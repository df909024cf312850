// What Session's .cpp files share beyond session.h: Session::transaction (a template) and note_compute_buffer.

#pragma once

#include "session.h"

#include <cstring>

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

// For trim(): the host buffer a graph's scratch lives in, the one of its final norm or logits (never a view into a
// cache), noted at every decode, since llama.cpp reallocates it for a larger graph.
inline void note_compute_buffer(const ggml_tensor * t, const char * name, ggml_backend_buffer_t & buf) {
    if (t->view_src == nullptr && t->buffer && ggml_backend_buffer_is_host(t->buffer) &&
        (strcmp(name, "result_norm") == 0 || strcmp(name, "result_output") == 0)) {
        buf = t->buffer;
    }
}
