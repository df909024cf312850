// Model: loading a GGUF with its placement checked first (Placement, buffer types), its metadata, tensors and
// vocabulary (tokenize, piece); which architectures record layer inputs.

#include "model.h"

#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <regex>

// The buffer types -ot can name, as llama.cpp's common/arg.cpp lists them: each device's default buffer type.
std::map<std::string, ggml_backend_buffer_type_t> buffer_types() {
    std::map<std::string, ggml_backend_buffer_type_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft) {
            out[ggml_backend_buft_name(buft)] = buft;
        }
    }
    return out;
}

// ggml's extra buffer types (CPU_REPACK, AMX, ...): where llama.cpp puts weights when use_extra_bufts is on, to run
// them with kernels that switch with the batch size. Listed so that a model's placement can be read back and checked.
std::vector<std::string> extra_buffer_types() {
    std::vector<std::string> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
        for (ggml_backend_buffer_type_t * b = get ? get(dev) : nullptr; b && *b; ++b) {
            out.push_back(ggml_backend_buft_name(*b));
        }
    }
    return out;
}

Model::Model(const std::string & path, const Placement & pl, bool verbose)
    : verbose(verbose), placement(pl), path(path) {
    LogScope log(verbose);
    params = model_params(pl);
    // kept alive through the load, which is the only time llama.cpp reads them
    std::vector<float> split(llama_max_devices(), 0.0f);
    std::copy(pl.tensor_split.begin(), pl.tensor_split.end(), split.begin());
    std::vector<llama_model_tensor_buft_override> ot;
    const auto bufts = buffer_types();
    for (auto & [pattern, name] : placement.overrides) {
        ot.push_back({pattern.c_str(), bufts.at(name)});
    }
    ot.push_back({nullptr, nullptr});
    llama_model_params mp = params;
    mp.tensor_split = pl.tensor_split.empty() ? nullptr : split.data();
    mp.tensor_buft_overrides = pl.overrides.empty() ? nullptr : ot.data();
    model = llama_model_load_from_file(path.c_str(), mp);
    if (!model) {
        fail("failed to load model from " + path);
    }
    vocab = llama_model_get_vocab(model);
    if (!vocab) {
        llama_model_free(model);
        fail("model " + path + " has no vocabulary");
    }
}

// Everything llama.cpp would abort or silently misread is refused here, before the load.
llama_model_params Model::model_params(const Placement & pl) {
    if (pl.split_mode < LLAMA_SPLIT_MODE_NONE || pl.split_mode > LLAMA_SPLIT_MODE_TENSOR) {
        throw std::invalid_argument("unknown split mode " + std::to_string(pl.split_mode));
    }
    if (pl.load_mode < LLAMA_LOAD_MODE_AUTO || pl.load_mode > LLAMA_LOAD_MODE_DIRECT_IO) {
        throw std::invalid_argument("unknown load mode " + std::to_string(pl.load_mode));
    }
    if (pl.tensor_split.size() > llama_max_devices()) {
        throw std::invalid_argument("a tensor split of " + std::to_string(pl.tensor_split.size()) +
                                    " entries, but llama.cpp handles at most " +
                                    std::to_string(llama_max_devices()) + " devices");
    }
    for (float f : pl.tensor_split) {
        if (!(f >= 0.0f) || !std::isfinite(f)) {
            throw std::invalid_argument("tensor split proportions must be finite numbers >= 0");
        }
    }
    const auto bufts = buffer_types();
    for (auto & [pattern, name] : pl.overrides) {
        if (bufts.find(name) == bufts.end()) {
            std::string known;
            for (auto & b : bufts) {
                known += (known.empty() ? "" : ", ") + b.first;
            }
            throw std::invalid_argument("unknown buffer type '" + name + "' (this build has: " + known + ")");
        }
        try {
            std::regex re(pattern);  // llama.cpp matches with std::regex_search: an invalid one throws inside
        } catch (const std::regex_error & e) {
            throw std::invalid_argument("invalid tensor pattern '" + pattern + "': " + e.what());
        }
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = pl.n_gpu_layers;
    mp.split_mode = (llama_split_mode) pl.split_mode;
    mp.main_gpu = pl.main_gpu;
    mp.load_mode = (llama_load_mode) pl.load_mode;
    // repacked CPU weights switch kernels with the batch size, which changes rounding between a 1-token decode
    // and a verify batch; off keeps greedy verification bit-exact on CPUs
    mp.use_extra_bufts = pl.repack;
    return mp;
}

Model::~Model() {
    LogScope log(verbose);
    llama_model_free(model);
}

std::string Model::meta(const std::string & key) const {
    std::vector<char> buf(256);
    int32_t n = llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
    if (n < 0) {
        return "";
    }
    if ((size_t) n >= buf.size()) {
        buf.resize(n + 1);
        llama_model_meta_val_str(model, key.c_str(), buf.data(), buf.size());
    }
    return std::string(buf.data());
}

// Whether the GGUF holds a tensor of this name: read from the file's header, since llama.cpp has no lookup by
// name (a DSpark drafter is told from a DFlash one by its tensors, as upstream's speculative driver does).
bool Model::has_tensor(const std::string & name) const {
    gguf_init_params gp = {true, nullptr};
    gguf_context * g = gguf_init_from_file(path.c_str(), gp);
    if (!g) {
        return false;
    }
    const bool found = gguf_find_tensor(g, name.c_str()) >= 0;
    gguf_free(g);
    return found;
}

// llama.cpp aborts the process when a model without a tokenizer is asked to tokenize or detokenize
void Model::need_tokenizer() const {
    if (llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_NONE || n_vocab() <= 0) {
        throw std::invalid_argument("the '" + arch() + "' model has no tokenizer");
    }
}

std::vector<llama_token> Model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    need_tokenizer();
    if (text.size() > (size_t) INT32_MAX / 2) {
        throw std::length_error("text too long to tokenize");
    }
    LogScope log(verbose);
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, parse_special);
    if (n < 0 && n != INT32_MIN) {
        out.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                           add_special, parse_special);
    }
    if (n < 0) {
        fail("tokenization failed");
    }
    out.resize(n);
    return out;
}

// Raw bytes of one token; a UTF-8 character may be split across tokens, so Python joins bytes, not strings.
// special: control tokens give their text (for chat templates' bos_token); otherwise they give nothing.
py::bytes Model::piece(llama_token tok, bool special) const {
    need_tokenizer();
    if (tok < 0 || tok >= n_vocab()) {
        throw std::out_of_range("token id " + std::to_string(tok) + " outside the vocabulary");
    }
    LogScope log(verbose);
    char buf[256];
    int32_t n = llama_token_to_piece(vocab, tok, buf, sizeof(buf), 0, special);
    if (n < 0) {
        std::string big(-n, '\0');
        n = llama_token_to_piece(vocab, tok, big.data(), (int32_t) big.size(), 0, special);
        return py::bytes(big.data(), std::max(n, 0));
    }
    return py::bytes(buf, n);
}

// Architectures whose llama.cpp graph records layer inputs (res->t_layer_inp). For any other architecture,
// enabling llama_set_embeddings_layer_inp aborts the process inside llama_decode, so they use the eval callback.
bool arch_records_layer_inputs(const std::string & arch) {
    static const char * archs[] = {
        "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "gemma4", "gpt-oss",
        "lfm2", "minimax-m2", "nemotron_h", "deepseek4",
    };
    for (const char * a : archs) {
        if (arch == a) {
            return true;
        }
    }
    return false;
}
