"""What prompt processing and a step cost as the context grows, with the installed llama.cpp alone (its low-level API,
as llama.cpp loads a model; no dflash-local session): a prompt decoded in chunks of 512 rows up to each depth, each
chunk's tok/s, then the median time of a batch of k rows (every row an output) at that depth.

    python bench/prompt_cost.py [MODEL.gguf] [--depths 64,4096] [--ks 1,2,4,8] [--swa-full 1] [-t 2]

--swa-full 0 gives sliding-window layers a cache of their window only, as llama-server and dflash-local's sessions
have it; 1 keeps the whole context there (the sessions before their window cache), and they attend over all of it.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # as dflash-local's sessions set it (native/bindings.cpp)
import llama_cpp as L  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the default target)")
    ap.add_argument("--depths", default="64,4096", help="context depths, comma-separated")
    ap.add_argument("--ks", default="1,2,4,8", help="batch sizes k to time at each depth, comma-separated")
    ap.add_argument("--swa-full", type=int, default=0, choices=(0, 1))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("-fa", "--flash-attn", type=int, default=0, choices=(0, 1))
    ap.add_argument("-ctk", "--cache-type-k", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("-ctv", "--cache-type-v", default="f16", choices=("f16", "q8_0"))
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    if a.model is None or not Path(a.model).exists():  # a built-in pair's name (or none: the default)
        from dflash_local import models  # only here: the script runs with llama-cpp-python alone

        a.model = str(models.pair(a.model)[0])
    model = a.model

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # no repacked weights, as dflash-local loads a target
    m = L.llama_model_load_from_file(model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = max(depths) + 1024
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.flash_attn_type = a.flash_attn
    cp.type_k, cp.type_v = (L.GGML_TYPE_F16 if t == "f16" else L.GGML_TYPE_Q8_0
                            for t in (a.cache_type_k, a.cache_type_v))
    cp.swa_full = bool(a.swa_full)
    ctx = L.llama_init_from_model(m, cp)
    mem = L.llama_get_memory(ctx)

    def decode(tokens: list[int], pos0: int, all_rows: bool) -> float:
        b = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, pos0 + i, 1, 0
            b.logits[i] = int(all_rows or i == len(tokens) - 1)
        b.n_tokens = len(tokens)
        t0 = time.perf_counter()
        rc = L.llama_decode(ctx, b)
        dt = time.perf_counter() - t0
        L.llama_batch_free(b)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
        return dt * 1000

    print(L.llama_print_system_info().decode().strip())
    print(f"{model}: {a.threads} threads, swa_full {a.swa_full}, -fa {a.flash_attn}, -ctk {a.cache_type_k} -ctv {a.cache_type_v}")
    for depth in depths:
        pos, chunks = 0, []
        while pos < depth:
            n = min(512, depth - pos)
            ms = decode([1000 + (i * 7 + pos) % 5000 for i in range(n)], pos, False)
            if n == 512:
                chunks.append(round(512 / ms * 1000))
            pos += n
        costs = {}
        for k in (int(x) for x in a.ks.split(",")):
            times = []
            for r in range(a.reps):
                times.append(decode(list(range(2000 + r, 2000 + r + k)), depth, True))
                L.llama_memory_seq_rm(mem, 0, depth, -1)
            costs[k] = statistics.median(times)
        print(f"depth {depth}: prompt chunks of 512, tok/s: {chunks or '-'}; a batch of k rows, ms: "
              + ", ".join(f"T({k}) {v:.1f}" for k, v in costs.items()), flush=True)
        L.llama_memory_seq_rm(mem, 0, 0, -1)


if __name__ == "__main__":
    main()
