// Errors and logging: llama.cpp's log callback, the LogScope that routes it per calling thread, fail(); and the
// helpers around a decode and its logits (common.h).

#include "common.h"

#include <cstdio>
#include <cstring>
#include <mutex>

#if defined(__APPLE__)
#include <dlfcn.h>
#elif defined(__ELF__)
// defined by the sgemm and the flash attention of setup.sh's build (native/ggml/patch_ggml.py); null elsewhere
extern "C" __attribute__((weak)) bool dflash_sgemm_batch_invariant(void);
extern "C" __attribute__((weak)) bool dflash_flash_attn_batch_invariant(void);
#endif

static thread_local LogScope * t_scope = nullptr;

static std::mutex        g_log_mutex;
static ggml_log_callback g_prev_log     = nullptr;
static void *            g_prev_log_ud  = nullptr;

static void log_cb(ggml_log_level level, const char * text, void *) {
    LogScope * s = t_scope;
    if (!s) {
        ggml_log_callback prev;
        void * prev_ud;
        {
            std::lock_guard<std::mutex> lock(g_log_mutex);
            prev    = g_prev_log;
            prev_ud = g_prev_log_ud;
        }
        if (prev) {
            prev(level, text, prev_ud);  // outside the lock: it may be a Python callback waiting for the GIL
        }
        return;
    }
    if (level != GGML_LOG_LEVEL_CONT) {
        s->level = level;
    }
    if (s->verbose) {
        fputs(text, stderr);
    }
    if (s->level == GGML_LOG_LEVEL_ERROR || s->level == GGML_LOG_LEVEL_WARN) {
        s->tail.emplace_back(text);
        if (s->tail.size() > 8) {
            s->tail.pop_front();
        }
    }
}

// Installed at the first scope rather than at import, and again if someone replaced it since (importing
// llama_cpp after this module installs llama-cpp-python's callback, which prints everything by default).
LogScope::LogScope(bool verbose) : verbose(verbose), outer(t_scope) {
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        ggml_log_callback cur;
        void * cur_ud;
        llama_log_get(&cur, &cur_ud);
        if (cur != log_cb) {
            g_prev_log    = cur;
            g_prev_log_ud = cur_ud;
            llama_log_set(log_cb, nullptr);
        }
    }
    t_scope = this;
}

LogScope::~LogScope() { t_scope = outer; }

[[noreturn]] void fail(const std::string & what) {
    std::string tail;
    if (t_scope) {
        for (auto & line : t_scope->tail) {
            tail += line;
        }
        t_scope->tail.clear();
    }
    while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) {
        tail.pop_back();
    }
    throw NativeError(tail.empty() ? what : what + " (llama.cpp: " + tail + ")");
}

// llama_decode / llama_process status codes (llama.h)
static std::string process_status(int32_t rc) {
    switch (rc) {
        case 1:  return "no KV cache slot for the batch";
        case 2:  return "aborted";
        case -1: return "invalid batch";
        case -2: return "could not allocate or prepare the batch";
        case -3: return "the computation failed";
    }
    return rc < 0 ? "error" : "warning";
}

void process(llama_context * ctx, llama_batch_ext * batch, const std::string & what) {
    const int32_t rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch);
    if (rc == 2) {
        throw Interrupted(what + " interrupted");
    }
    if (rc != 0) {
        fail(what + " failed: " + process_status(rc) + " (code " + std::to_string(rc) + ")");
    }
}

const float * logits_row(llama_context * ctx, int32_t i, const std::string & what) {
    const float * row = llama_get_logits_ith(ctx, i);
    if (!row) {
        fail("no " + what + " logits for output row " + std::to_string(i));
    }
    return row;
}

llama_batch_ext * new_batch(llama_context * ctx) {
    llama_batch_ext * b = llama_batch_ext_init(ctx);
    if (!b) {
        fail("could not allocate a batch");
    }
    return b;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Whether this llama.cpp was built with llamafile's sgemm (GGML_LLAMAFILE), which ggml uses for two rows or more.
bool sgemm_built_in() {
    static const bool on = std::strstr(llama_print_system_info(), "LLAMAFILE = 1") != nullptr;
    return on;
}

// Whether ggml leaves a product's row alone to vec_dot, which rounds differently from sgemm's rows: llamafile's sgemm
// as upstream builds it. setup.sh's build keeps sgemm to products whose bits do not depend on the number of rows
// (native/ggml/patch_ggml.py), and says so by a symbol.
bool sgemm_skips_one_row() {
#if defined(__APPLE__)
    return sgemm_built_in() && dlsym(RTLD_DEFAULT, "dflash_sgemm_batch_invariant") == nullptr;
#elif defined(__ELF__)
    return sgemm_built_in() && dflash_sgemm_batch_invariant == nullptr;
#else
    return sgemm_built_in();
#endif
}

// Whether ggml's CPU flash attention gives a row the same bits whatever the batch, as setup.sh's build does
// (native/ggml/flash_attn.c): upstream's splits a one-token step's cache across threads and tiles large batches, each
// rounding differently.
bool flash_attn_batch_invariant() {
#if defined(__APPLE__)
    return dlsym(RTLD_DEFAULT, "dflash_flash_attn_batch_invariant") != nullptr;
#elif defined(__ELF__)
    return dflash_flash_attn_batch_invariant != nullptr;
#else
    return false;
#endif
}
