// llama.cpp's RPC backend (built with GGML_RPC=ON): remote devices that take a model's offloaded layers, and the
// server that offers this machine's devices to another. Looked up through the backend registry, as llama.cpp's
// own tools do, so a build without RPC fails with a message instead of a missing symbol.

#include "common.h"

#include <vector>

static ggml_backend_reg_t rpc_backend() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    if (!reg) {
        throw std::runtime_error("this llama.cpp was built without the RPC backend: rerun scripts/setup.sh, which "
                                 "builds it with -DGGML_RPC=ON");
    }
    return reg;
}

// Register the devices of one rpc-server (host:port) for every model loaded afterwards in this process. llama.cpp
// aborts the process when the server cannot be reached or does not answer the handshake: the caller checks first.
int add_rpc_server(const std::string & endpoint) {
    using add_fn = ggml_backend_reg_t (*)(const char *);
    auto add = (add_fn) ggml_backend_reg_get_proc_address(rpc_backend(), "ggml_backend_rpc_add_server");
    if (!add) {
        throw std::runtime_error("the RPC backend has no ggml_backend_rpc_add_server");
    }
    ggml_backend_reg_t reg;
    {
        py::gil_scoped_release nogil;
        reg = add(endpoint.c_str());
    }
    if (!reg) {
        fail("the RPC server at " + endpoint + " offers no devices");
    }
    ggml_backend_register(reg);
    return (int) ggml_backend_reg_dev_count(reg);
}

// Serve this machine's devices (GPUs if any, else the CPU, as llama.cpp's rpc-server picks them) on endpoint until
// the process ends. cache_dir (may be empty) keeps tensors sent before, for faster reloads.
void serve_rpc(const std::string & endpoint, int n_threads, const std::string & cache_dir) {
    using serve_fn = void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *);
    auto serve = (serve_fn) ggml_backend_reg_get_proc_address(rpc_backend(), "ggml_backend_rpc_start_server");
    if (!serve) {
        throw std::runtime_error("the RPC backend has no ggml_backend_rpc_start_server");
    }
    std::vector<ggml_backend_dev_t> devices;
    for (auto type : {GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_CPU}) {
        for (size_t i = 0; i < ggml_backend_dev_count() && devices.empty(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            // an RPC device registered in this process is someone else's server
            if (ggml_backend_dev_type(dev) == type && ggml_backend_dev_backend_reg(dev) != rpc_backend()) {
                devices.push_back(dev);
            }
        }
    }
    if (devices.empty()) {
        throw std::runtime_error("no device to serve");
    }
    py::gil_scoped_release nogil;
    serve(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(), (size_t) n_threads, devices.size(),
          devices.data());
}
