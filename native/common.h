// Shared by every file of the extension: llama.cpp's declarations missing from its public headers (llama-ext.h),
// errors (NativeError, fail) and llama.cpp's log per Model or Session (LogScope), the helpers around a decode and
// its logits, and the entry points of llama.cpp's RPC backend (rpc.cpp).

#pragma once

#include "llama.h"
#include "ggml-backend.h"

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>

// Declared in llama.cpp's src/llama-ext.h (C++ linkage, exported by libllama, absent from the public headers).
LLAMA_API void    llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid);
LLAMA_API int32_t llama_model_n_expert(const llama_model * model);
LLAMA_API int32_t llama_model_n_devices(const llama_model * model);
// llama.cpp's per-buffer-type memory report (same llama-ext.h; the struct's layout must match llama.cpp's)
struct llama_memory_breakdown_data {
    size_t model   = 0;  // weights
    size_t context = 0;  // KV cache
    size_t compute = 0;  // compute buffers
};
LLAMA_API std::map<ggml_backend_buffer_type_t, llama_memory_breakdown_data> llama_get_memory_breakdown(
    const llama_context * ctx);
// DFlash2: the drafter's selector lattice comes back in the "nextn" embeddings
LLAMA_API void    llama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked);
LLAMA_API float * llama_get_embeddings_nextn(llama_context * ctx);
LLAMA_API int32_t llama_model_dflash_selector_top_k(const llama_model * model);

namespace py = pybind11;

// ---------------------------------------------------------------------------------------------------------------
// Errors and logging.
//
// A llama.cpp failure becomes a NativeError (a RuntimeError in Python) that carries the warnings and errors
// llama.cpp logged during the failing call. llama.cpp's log callback is process-wide, but verbosity belongs to one
// Model or Session: each of their calls into llama.cpp runs inside a LogScope that tells the callback, for the calling
// thread, whether to print. Lines logged outside every scope (llama-cpp-python's own models, say) go on to the
// callback ours replaced, so other users of libllama in the process log as if this module were not there.

struct NativeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A decode given up at the caller's request (Session::interrupt): nothing went wrong, and the call can run again.
struct Interrupted : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct LogScope {
    explicit LogScope(bool verbose);
    ~LogScope();
    LogScope(const LogScope &) = delete;
    LogScope & operator=(const LogScope &) = delete;

    bool verbose;
    LogScope * outer;                           // the scope this one runs inside, if any
    ggml_log_level level = GGML_LOG_LEVEL_NONE;  // of the last line, for GGML_LOG_LEVEL_CONT lines
    std::deque<std::string> tail;               // the last warnings and errors, for the exception message
};

[[noreturn]] void fail(const std::string & what);

// A decode (throwing Interrupted if its abort callback stopped it), an output row's logits and a new batch, each
// failing with a NativeError; milliseconds since t0.
void process(llama_context * ctx, llama_batch_ext * batch, const std::string & what);
const float * logits_row(llama_context * ctx, int32_t i, const std::string & what);
llama_batch_ext * new_batch(llama_context * ctx);
double ms_since(std::chrono::steady_clock::time_point t0);
bool sgemm_built_in();
bool sgemm_skips_one_row();
bool flash_attn_batch_invariant();

// llama.cpp's RPC backend (rpc.cpp)
int add_rpc_server(const std::string & endpoint);
void serve_rpc(const std::string & endpoint, int n_threads, const std::string & cache_dir);
