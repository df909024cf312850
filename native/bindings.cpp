// The Python module dflash_local._native: the backend set-up done at import, and the pybind11 bindings of the
// module functions, Model, Sampler and Session.

#include "common.h"
#include "model.h"
#include "sampler.h"
#include "session.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

PYBIND11_MODULE(_native, m) {
    m.doc() = "DFlash speculative decoding steps over llama.cpp";

    // Backend set-up only: the log callback is installed by the first Model or Session (LogScope).
    // ggml's tiled CPU matmul takes over from 8 rows up and rounds differently from the one-row kernel, so a
    // verify batch would not reproduce plain decoding bit for bit. It is read once, at the first matmul; a value
    // already set by the user is kept.
    setenv("GGML_CPU_TILED_MM", "0", 0);
    llama_backend_init();
#if defined(__GLIBC__)
    // glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB); buffers of a megabyte
    // and more (a row of logits of a big vocabulary, a sampler's candidates) then come from the heap, where a burst
    // of parallel slots leaves them scattered and Session::trim cannot give them back. A fixed threshold keeps them
    // in mappings of their own, returned when freed.
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif

    py::register_exception<NativeError>(m, "NativeError", PyExc_RuntimeError);
    py::register_exception<Interrupted>(m, "Interrupted", PyExc_RuntimeError);
    m.def("system_info", []() { return std::string(llama_print_system_info()); });
    // llamafile's sgemm (a GGML_LLAMAFILE build) is batch-invariant; upstream's leaves a row alone to vec_dot, and
    // sessions give every target decode two rows at least there (Session::pad)
    m.def("cpu_matmul_batch_invariant", []() {
        const char * tiled = getenv("GGML_CPU_TILED_MM");
        return tiled && std::string(tiled) == "0";
    }, "Whether CPU matmuls give a verify-batch row the same bits as a single-token decode.");
    m.def("sgemm_built_in", &sgemm_built_in, "Whether this llama.cpp has llamafile's sgemm (GGML_LLAMAFILE).");
    m.def("sgemm_skips_one_row", &sgemm_skips_one_row,
          "Whether its sgemm leaves a row alone to vec_dot, as upstream's does (setup.sh's keeps it invariant).");
    m.def("cpu_flash_attn_batch_invariant", &flash_attn_batch_invariant,
          "Whether CPU flash attention gives a row the same bits whatever the batch (setup.sh's build).");
    m.def("greedy_head_fast", &GreedyHead::fast,
          "Whether the greedy head's int8 pass has AVX512-VNNI (then it takes a plain step's row too).");
    m.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); });
    m.def("supports_rpc", []() { return llama_supports_rpc(); });
    m.def("add_rpc_server", &add_rpc_server, py::arg("endpoint"),
          "Use an rpc-server's devices (host:port) for the layers of every model loaded from now on; returns how "
          "many devices it offers.");
    m.def("serve_rpc", &serve_rpc, py::arg("endpoint"), py::arg("n_threads"), py::arg("cache_dir") = "",
          "Serve this machine's devices to llama.cpp RPC clients on endpoint (host:port); returns when it fails.");
    m.def("arch_records_layer_inputs", &arch_records_layer_inputs);

    py::class_<Sampling>(m, "Sampling")
        .def(py::init([](float temperature, int top_k, float top_p, float min_p, uint64_t seed) {
                 // sample_row needs at least one candidate left after the filters
                 if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
                     throw std::invalid_argument("temperature must be a finite number >= 0");
                 }
                 if (top_k < 0) {
                     throw std::invalid_argument("top_k must be >= 0");
                 }
                 if (!(top_p > 0.0f && top_p <= 1.0f)) {
                     throw std::invalid_argument("top_p must be in (0, 1]");
                 }
                 if (!(min_p >= 0.0f && min_p <= 1.0f)) {
                     throw std::invalid_argument("min_p must be in [0, 1]");
                 }
                 return Sampling{temperature, top_k, top_p, min_p, seed};
             }),
             py::arg("temperature") = 0.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f, py::arg("min_p") = 0.0f,
             py::arg("seed") = 0)
        .def_readonly("temperature", &Sampling::temperature)
        .def_readonly("top_k", &Sampling::top_k)
        .def_readonly("top_p", &Sampling::top_p)
        .def_readonly("min_p", &Sampling::min_p)
        .def_readonly("seed", &Sampling::seed);

    m.def("sample", [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, const Sampling & s,
                       uint64_t index) {
        if (logits.ndim() != 1 || logits.size() == 0 || logits.size() > INT32_MAX) {
            throw std::invalid_argument("sample needs one non-empty row of at most 2^31 - 1 logits");
        }
        std::vector<Candidate> cand;
        return sample_row(logits.data(), (int) logits.size(), s, index, cand);
    }, "Sample one token from a logits row exactly as the native step does.");

    m.def("buffer_types", []() {
        std::vector<std::string> names;
        for (auto & b : buffer_types()) {
            names.push_back(b.first);
        }
        return names;
    }, "Buffer type names -ot can use: each device's default buffer type, as llama.cpp lists them.");
    m.def("extra_buffer_types", &extra_buffer_types,
          "ggml's extra buffer types in this build on this CPU (CPU_REPACK, AMX, ...): where repacked weights go.");
    m.def("gpu_devices", []() {
        std::vector<std::string> names;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(dev);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
                names.push_back(ggml_backend_dev_name(dev));
            }
        }
        return names;
    }, "The GPU devices llama.cpp sees (what -ngl, -ts and -mg place layers on).");
    m.def("max_devices", []() { return llama_max_devices(); });
    m.def("cache_types", []() {
        std::vector<std::string> names;
        for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                            GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1}) {
            names.push_back(ggml_type_name(t));
        }
        return names;
    }, "KV cache types (-ctk/-ctv), as llama.cpp offers them.");

    py::class_<TokenLogprob>(m, "TokenLogprob")
        .def_readonly("token", &TokenLogprob::token)
        .def_readonly("logprob", &TokenLogprob::logprob)
        .def_readonly("top", &TokenLogprob::top);

    py::class_<Model>(m, "Model")
        .def(py::init([](const std::string & path, int n_gpu_layers, bool repack, bool verbose, int split_mode,
                         int main_gpu, std::vector<float> tensor_split, int load_mode,
                         std::vector<std::pair<std::string, std::string>> overrides) {
                 Placement pl{n_gpu_layers, split_mode, main_gpu, std::move(tensor_split), load_mode,
                              std::move(overrides), repack};
                 return new Model(path, pl, verbose);
             }),
             py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("repack") = false, py::arg("verbose") = false,
             py::kw_only(), py::arg("split_mode") = (int) LLAMA_SPLIT_MODE_LAYER, py::arg("main_gpu") = 0,
             py::arg("tensor_split") = std::vector<float>{}, py::arg("load_mode") = (int) LLAMA_LOAD_MODE_AUTO,
             py::arg("overrides") = std::vector<std::pair<std::string, std::string>>{},
             py::call_guard<py::gil_scoped_release>())
        // the llama_model_params the model was loaded with
        .def_property_readonly("n_gpu_layers", [](const Model & mm) { return mm.params.n_gpu_layers; })
        .def_property_readonly("split_mode", [](const Model & mm) { return (int) mm.params.split_mode; })
        .def_property_readonly("main_gpu", [](const Model & mm) { return mm.params.main_gpu; })
        .def_property_readonly("load_mode", [](const Model & mm) {
            return std::string(llama_load_mode_name(mm.params.load_mode));
        })
        .def_property_readonly("repack", [](const Model & mm) { return mm.params.use_extra_bufts; })
        .def_property_readonly("tensor_split", [](const Model & mm) { return mm.placement.tensor_split; })
        .def_property_readonly("overrides", [](const Model & mm) { return mm.placement.overrides; })
        .def_property_readonly("n_devices", [](const Model & mm) { return llama_model_n_devices(mm.model); })
        .def_property_readonly("n_expert", [](const Model & mm) { return llama_model_n_expert(mm.model); })
        .def_property("verbose", [](const Model & mm) { return mm.verbose.load(); },
                      [](Model & mm, bool v) { mm.verbose = v; })
        .def("meta", &Model::meta)
        // without the GIL: a long text takes a while, and the server's other threads go on meanwhile
        .def("tokenize", &Model::tokenize, py::arg("text"), py::arg("add_special") = true,
             py::arg("parse_special") = false, py::call_guard<py::gil_scoped_release>())
        .def("piece", &Model::piece, py::arg("tok"), py::arg("special") = false)
        .def("is_eog", [](const Model & mm, llama_token t) { return llama_vocab_is_eog(mm.vocab, t); })
        .def_property_readonly("arch", &Model::arch)
        .def_property_readonly("n_vocab", &Model::n_vocab)
        .def_property_readonly("n_embd", [](const Model & mm) { return llama_model_n_embd(mm.model); })
        .def_property_readonly("n_layer", [](const Model & mm) { return llama_model_n_layer(mm.model); })
        .def_property_readonly("n_ctx_train", [](const Model & mm) { return llama_model_n_ctx_train(mm.model); })
        .def_property_readonly("bos", [](const Model & mm) { return llama_vocab_bos(mm.vocab); })
        .def_property_readonly("eos", [](const Model & mm) { return llama_vocab_eos(mm.vocab); })
        .def_property_readonly("mask", [](const Model & mm) { return llama_vocab_mask(mm.vocab); })
        // fill-in-the-middle tokens, -1 where the vocabulary has none (llama.cpp also finds them by their text)
        .def_property_readonly("fim", [](const Model & mm) {
            return std::map<std::string, llama_token>{
                {"pre", llama_vocab_fim_pre(mm.vocab)}, {"suf", llama_vocab_fim_suf(mm.vocab)},
                {"mid", llama_vocab_fim_mid(mm.vocab)}, {"pad", llama_vocab_fim_pad(mm.vocab)},
                {"rep", llama_vocab_fim_rep(mm.vocab)}, {"sep", llama_vocab_fim_sep(mm.vocab)}};
        })
        .def_property_readonly("size", [](const Model & mm) { return llama_model_size(mm.model); })
        .def_property_readonly("desc", [](const Model & mm) {
            char buf[256];
            llama_model_desc(mm.model, buf, sizeof(buf));
            return std::string(buf);
        });

    py::class_<Sampler>(m, "Sampler")
        .def(py::init([](const Model & target, Sampling params, std::vector<std::pair<llama_token, float>> logit_bias,
                         int repeat_last_n, float repeat_penalty, float frequency_penalty, float presence_penalty,
                         const std::vector<llama_token> & prompt, const std::string & grammar, int n_logprobs) {
                 const Penalties pen{repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty};
                 return new Sampler(target, params, std::move(logit_bias), pen, prompt, grammar, n_logprobs);
             }),
             py::arg("target"), py::arg("sampling"),
             py::arg("logit_bias") = std::vector<std::pair<llama_token, float>>{},
             py::arg("repeat_last_n") = 64, py::arg("repeat_penalty") = 1.0f, py::arg("frequency_penalty") = 0.0f,
             py::arg("presence_penalty") = 0.0f, py::arg("prompt") = std::vector<llama_token>{},
             py::arg("grammar") = "", py::arg("n_logprobs") = -1, py::keep_alive<1, 2>(),
             py::call_guard<py::gil_scoped_release>())  // a grammar takes a while to load
        .def_property_readonly("has_grammar", &Sampler::has_grammar)
        .def("grammar_prefix", &Sampler::grammar_prefix)
        .def_property_readonly("keep", &Sampler::keep, "How much of a row the sampler reads: 1 its argmax, K its top K, 0 all")
        .def("take_logprobs", &Sampler::take_logprobs);

    py::class_<Draft>(m, "Draft")
        .def_readonly("tokens", &Draft::tokens)
        .def_readonly("probs", &Draft::probs)
        .def_readonly("confidence", &Draft::confidence);

    py::class_<StepResult>(m, "StepResult")
        .def_readonly("tokens", &StepResult::tokens)
        .def_readonly("draft", &StepResult::draft)
        .def_readonly("n_accepted", &StepResult::n_accepted)
        .def_readonly("draft_ms", &StepResult::draft_ms)
        .def_readonly("verify_ms", &StepResult::verify_ms)
        .def_readonly("sample_ms", &StepResult::sample_ms)
        .def_readonly("head_ms", &StepResult::head_ms)
        .def_readonly("head_rows", &StepResult::head_rows)
        .def_readonly("rollback_ms", &StepResult::rollback_ms)
        .def_readonly("rollback", &StepResult::rollback)
        .def_readonly("step_ms", &StepResult::step_ms);

    py::class_<Session>(m, "Session")
        .def(py::init([](Model & target, Model * drafter, std::vector<int> layers, int n_ctx, int n_threads,
                         bool use_layer_api, int flash_attn, bool verbose, int n_threads_batch, int n_batch,
                         int n_ubatch, const std::string & type_k, const std::string & type_v,
                         const std::string & type_k_draft, const std::string & type_v_draft, int n_rs_seq, int n_seq,
                         bool kv_unified, int flash_attn_draft) {
                 const int n_tb = n_threads_batch > 0 ? n_threads_batch : n_threads;
                 ContextOptions o{n_ctx, n_batch, n_ubatch, n_threads, n_tb, flash_attn, flash_attn_draft,
                                  cache_type(type_k), cache_type(type_v), cache_type(type_k_draft),
                                  cache_type(type_v_draft), n_rs_seq, n_seq, kv_unified};
                 return new Session(target, drafter, std::move(layers), o, use_layer_api, verbose);
             }),
             py::arg("target"), py::arg("drafter"), py::arg("layers"), py::arg("n_ctx"), py::arg("n_threads"),
             py::arg("use_layer_api"), py::arg("flash_attn") = 0, py::arg("verbose") = false, py::kw_only(),
             py::arg("n_threads_batch") = 0, py::arg("n_batch") = 512, py::arg("n_ubatch") = 512,
             py::arg("type_k") = "f16", py::arg("type_v") = "f16", py::arg("type_k_draft") = "f32",
             py::arg("type_v_draft") = "f32", py::arg("n_rs_seq") = -1, py::arg("n_seq") = 1,
             py::arg("kv_unified") = false, py::arg("flash_attn_draft") = 0,
             py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_batch", &Session::batch_size)
        .def_property_readonly("n_ubatch", &Session::ubatch_size)
        .def_property_readonly("n_threads", &Session::threads)
        .def_property_readonly("n_threads_batch", &Session::threads_batch)
        .def("memory", &Session::memory, py::arg("which") = "target")
        .def_property("verbose", [](const Session & ss) { return ss.verbose.load(); },
                      [](Session & ss, bool v) { ss.verbose = v; })
        .def_property_readonly("n_past", [](const Session & ss) { return ss.n_past(0); })
        .def("past", &Session::n_past, py::arg("slot"), "Positions in the caches of one slot (n_past: slot 0's).")
        .def_property_readonly("n_slots", &Session::n_slots)
        .def_property_readonly("n_ctx", &Session::context_size)
        .def_property_readonly("has_drafter", &Session::has_drafter)
        .def_property_readonly("uses_layer_api", &Session::uses_layer_api)
        .def_property_readonly("recurrent", &Session::is_recurrent)
        .def_property_readonly("checkpoints", &Session::checkpoints)
        .def_property_readonly("n_rs_seq", &Session::snapshots)
        .def_property_readonly("checkpoint_pos", [](const Session & ss) { return ss.checkpoint_pos(0); })
        .def("checkpoint_at", &Session::checkpoint_pos, py::arg("slot"))
        .def("reuse_floor", &Session::reuse_floor, py::arg("slot") = 0)
        .def_property_readonly("n_pending", [](const Session & ss) { return ss.pending_rows(0); })
        .def("pending", &Session::pending_rows, py::arg("slot"),
             "Positions of one slot whose features wait to go into the drafter (n_pending: slot 0's).")
        .def_property_readonly("pads_rows", &Session::pads_rows)
        .def("checkpoint", &Session::checkpoint, py::arg("slot") = 0, py::call_guard<py::gil_scoped_release>())
        .def("set_capture", &Session::set_capture, py::arg("on"), py::arg("slot") = 0)
        .def("set_head_on_demand", &Session::set_head_on_demand, py::arg("on"))
        .def_property_readonly("head_on_demand", &Session::head_on_demand_active)
        .def("set_greedy_head", &Session::set_greedy_head, py::arg("on").none(true),
             py::call_guard<py::gil_scoped_release>(),
             "True: the greedy LM head wherever the head's type and the CPU allow; False: never; None (the default): "
             "where the head is a quarter of the target's weights or more.")
        .def_property_readonly("greedy_head", &Session::greedy_head_active)
        .def_property_readonly("greedy_head_bytes", &Session::greedy_head_bytes)
        .def_property_readonly("pruned_rows", &Session::pruned_rows,
                               "Rows the greedy head computed since the session began: (for their argmax, for their top)")
        .def("greedy_logits", &Session::greedy_logits, py::arg("row"), py::arg("top_k") = 1,
             py::arg("forced") = std::vector<llama_token>{},
             "Row `row` of the last verify batch as the greedy head computes it: the exact logits of the tokens that "
             "could be among its top_k largest and of the tokens `forced`, -inf elsewhere.")
        .def("truncate", &Session::truncate, py::arg("n"), py::arg("slot") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def("prefill", &Session::prefill, py::arg("tokens"), py::arg("sampler").none(true), py::arg("index"),
             py::arg("slot") = 0, py::call_guard<py::gil_scoped_release>())
        .def("prefill", [](Session & ss, const std::vector<llama_token> & tokens, const Sampling & s, uint64_t index,
                           int slot) {
                 Sampler plain(ss.target(), s);
                 return ss.prefill(tokens, &plain, index, slot);
             }, py::arg("tokens"), py::arg("sampling"), py::arg("index"), py::arg("slot") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def("draft", &Session::draft, py::arg("last"), py::arg("n_draft"), py::arg("with_probs") = false,
             py::arg("sampler").none(true) = nullptr, py::arg("index") = 0, py::arg("slot") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def("draft_batch", &Session::draft_batch, py::arg("drafts"), py::call_guard<py::gil_scoped_release>(),
             "Several slots' greedy drafts, (slot, last, n_draft) each, those of one length in one drafter decode: "
             "what draft() gives each, in the same order.")
        .def("step", &Session::step, py::arg("last"), py::arg("draft"), py::arg("sampler"), py::arg("index"),
             py::arg("rejection") = false, py::arg("head_rows") = 1, py::arg("slot") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def("step", [](Session & ss, llama_token last, const std::vector<llama_token> & draft, const Sampling & s,
                        uint64_t index, int head_rows, int slot) {
                 Sampler plain(ss.target(), s);
                 return ss.step(last, draft, plain, index, false, head_rows, slot);
             }, py::arg("last"), py::arg("draft"), py::arg("sampling"), py::arg("index"), py::arg("head_rows") = 1,
             py::arg("slot") = 0, py::call_guard<py::gil_scoped_release>())
        .def("step_batch", [](Session & ss, const std::vector<std::tuple<int, llama_token, std::vector<llama_token>,
                                                                 Sampler *, uint64_t, bool, int>> & steps) {
                 std::vector<SlotStep> v;
                 for (const auto & [slot, last, draft, sampler, index, rejection, head_rows] : steps) {
                     v.push_back({slot, last, draft, sampler, index, rejection, head_rows});
                 }
                 return ss.step_batch(v);
             }, py::arg("steps"), py::call_guard<py::gil_scoped_release>(),
             "Several slots' steps in one target decode: (slot, last, draft, sampler, index, rejection, head_rows) "
             "each; their StepResults in the same order.")
        .def("trim", &Session::trim, py::call_guard<py::gil_scoped_release>(),
             "Give the memory of the per-decode buffers back (the server calls it when idle); generating goes on as "
             "before.")
        .def("interrupt", &Session::interrupt, py::arg("on") = true,
             "Ask the batched step in flight (another thread's step_batch) to give up its decode if it has only "
             "begun: it raises Interrupted with every slot as before it. False withdraws the request.")
        .def("features", &Session::features)
        .def("decode_rows", &Session::decode_rows, py::arg("tokens"), py::arg("pos"), py::arg("seq"),
             py::arg("top_k") = 1, py::call_guard<py::gil_scoped_release>())
        .def("drop_sequence", &Session::drop_sequence, py::call_guard<py::gil_scoped_release>())
        .def("logits", &Session::logits)
        .def("keep_draft_logits", &Session::keep_draft_logits)
        .def("draft_logits", &Session::draft_logits)
        .def("draft_lattice", &Session::draft_lattice);
}
