// Model: a loaded GGUF plus its vocabulary, and where its weights go (Placement, the buffer types -ot can name);
// which architectures record layer inputs for feature capture.

#pragma once

#include "common.h"

#include <atomic>
#include <string>
#include <utility>
#include <vector>

std::map<std::string, ggml_backend_buffer_type_t> buffer_types();
std::vector<std::string> extra_buffer_types();
bool arch_records_layer_inputs(const std::string & arch);

// Where a model's weights go: the llama_model_params fields a user sets (llama.cpp's -ngl, -sm, -mg, -ts, -ot,
// --load-mode).
struct Placement {
    int n_gpu_layers = 0;
    int split_mode = LLAMA_SPLIT_MODE_LAYER;
    int main_gpu = 0;
    std::vector<float> tensor_split;                              // empty: llama.cpp's default split
    int load_mode = LLAMA_LOAD_MODE_AUTO;
    std::vector<std::pair<std::string, std::string>> overrides;  // tensor name regex -> buffer type name
    bool repack = false;
};

struct Model {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::atomic<bool> verbose;  // print llama.cpp's log during this model's calls
    const Placement placement;
    llama_model_params params;  // as given to llama.cpp (the pointers in it are not kept valid)

    const std::string path;

    Model(const std::string & path, const Placement & pl, bool verbose);
    static llama_model_params model_params(const Placement & pl);
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    std::string meta(const std::string & key) const;
    std::string arch() const { return meta("general.architecture"); }
    bool has_tensor(const std::string & name) const;
    int n_vocab() const { return llama_vocab_n_tokens(vocab); }
    void need_tokenizer() const;
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    py::bytes piece(llama_token tok, bool special) const;
};
