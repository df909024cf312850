// Session's LM head on demand: a verify row's logits when the accept loop first reads it, and the greedy head's part.

#include "session.h"

#include <ggml-cpu.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

// The greedy head's forced tokens: sorted, each once.
static void sort_unique(std::vector<llama_token> & v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
}

// A slot's block of rows [lo, hi) in the next decode, read by sampler s: the first head call computes `first` of
// them, and where s reads only a row's top (not when it judges drafts by rejection sampling), only that; the tokens
// whose logits s may change meanwhile are its controls' and the drafts it may take in before the last row.
Session::HeadRange Session::head_range(int lo, int hi, int first, const Sampler & s, bool rejection,
                                       const std::vector<llama_token> & draft) const {
    HeadRange h{lo, hi, 0, std::max(first, 1), rejection ? 0 : s.keep(), {}};
    if (h.keep > 1) {
        h.forced = s.touched();
        h.forced.insert(h.forced.end(), draft.begin(), draft.end());
        sort_unique(h.forced);
    }
    return h;
}

// How a range's rows are computed: their argmax only, their top, or in full (without the greedy head, in full).
char Session::pruned_kind(const HeadRange & h) const {
    return !greedy_head || h.keep == 0 ? FULL : h.keep == 1 ? PRUNED_ARGMAX : PRUNED_TOP;
}

// The LM head of the next more[w] rows of each of the head ranges `which` (after the rows they have), in one call
// per kind of row (argmax, top, full): the matrix is read once for all of them. Returns its milliseconds.
double Session::head_more(const std::vector<size_t> & which, const std::vector<int> & more) {
    const auto t0 = std::chrono::steady_clock::now();
    const int n_vocab = tgt.n_vocab();
    std::vector<float> & x = head_x;
    std::vector<float> & y = head_y;
    std::vector<int32_t> best;
    for (char kind : {PRUNED_ARGMAX, PRUNED_TOP, FULL}) {
        x.clear();
        std::vector<const HeadRange *> of;  // each row's range
        for (size_t w = 0; w < which.size(); ++w) {
            const HeadRange & h = head_ranges[which[w]];
            if (pruned_kind(h) == kind) {
                x.insert(x.end(), &hidden[(size_t) (h.lo + h.done) * n_embd],
                         &hidden[(size_t) (h.lo + h.done + more[w]) * n_embd]);
                of.insert(of.end(), more[w], &h);
            }
        }
        const int m_all = (int) (x.size() / n_embd);
        if (m_all == 0) {
            continue;
        }
        std::vector<GreedyHead::Top> tops;
        if (kind == PRUNED_ARGMAX) {
            best.resize(m_all);
            greedy_argmax(x.data(), best.data(), m_all);
        } else if (kind == PRUNED_TOP) {
            tops.resize(m_all);
            top_rows(x.data(), tops.data(), m_all, of);
        } else {
            if (y.size() < (size_t) m_all * n_vocab) {
                y.resize((size_t) m_all * n_vocab);
            }
            compute_head(x.data(), y.data(), m_all);
        }
        int off = 0;
        for (size_t w = 0; w < which.size(); ++w) {
            HeadRange & h = head_ranges[which[w]];
            if (pruned_kind(h) != kind) {
                continue;
            }
            if (kind == PRUNED_ARGMAX) {
                std::copy_n(&best[off], more[w], &row_best[h.lo + h.done]);
            } else if (kind == PRUNED_TOP) {
                std::move(&tops[off], &tops[off + more[w]], &row_top[h.lo + h.done]);
            } else {
                std::memcpy(&head_logits[(size_t) (h.lo + h.done) * n_vocab], &y[(size_t) off * n_vocab],
                            (size_t) more[w] * n_vocab * sizeof(float));
            }
            std::fill_n(&row_pruned[h.lo + h.done], more[w], kind);
            off += more[w];
            h.done += more[w];
        }
    }
    return ms_since(t0);
}

// Logits of row i of the last target decode (llama.cpp's batch index; negative: from the last output). A row of a
// greedy or top-k range comes back null, unless `full`: the greedy head gave only its argmax (row_best) or its top
// (row_top).
const float * Session::target_row(int i, bool full) {
    if (hidden_rows == 0) {
        return logits_row(ctx_tgt, i < 0 ? i + n_rows : i, "target");  // the scratch row's are not ours
    }
    i = i < 0 ? i + hidden_rows : i;  // on demand, every row is an output
    if (i < 0 || i >= hidden_rows) {
        fail("no target logits for output row " + std::to_string(i));
    }
    auto h = std::find_if(head_ranges.begin(), head_ranges.end(), [&](const HeadRange & r) { return i < r.hi; });
    if (h == head_ranges.end() || i < h->lo) {
        fail("no target logits for output row " + std::to_string(i));
    }
    const size_t n_vocab = tgt.n_vocab();
    if (i >= h->lo + h->done) {
        // a block's rows are read in order: first the `first` rows the step's caller expects to read, then as many
        // more as have been read (doubling): a call costs a few ms beyond its rows (docs/measurements.md), so a
        // block whose drafts are accepted pays a few calls, and one rejected early one or two rows
        const int end = std::min(h->hi, std::max(i + 1, h->lo + (h->done ? 2 * h->done : h->first)));
        const int i0 = h->lo + h->done;
        const char kind = full ? FULL : pruned_kind(*h);
        if (kind == PRUNED_ARGMAX) {
            greedy_argmax(&hidden[(size_t) i0 * n_embd], &row_best[i0], end - i0);
        } else if (kind == PRUNED_TOP) {
            top_rows(&hidden[(size_t) i0 * n_embd], &row_top[i0], end - i0,
                     std::vector<const HeadRange *>(end - i0, &*h));
        } else {
            compute_head(&hidden[(size_t) i0 * n_embd], &head_logits[i0 * n_vocab], end - i0);
        }
        std::fill(&row_pruned[i0], &row_pruned[end], kind);
        h->done = end - h->lo;
    }
    if (full && row_pruned[i] != FULL) {
        compute_head(&hidden[(size_t) i * n_embd], &head_logits[i * n_vocab], 1);
        row_pruned[i] = FULL;
    }
    return row_pruned[i] != FULL ? nullptr : &head_logits[i * n_vocab];
}

// The token the sampler takes from row i of the last target decode (as target_row counts rows): a pruned row's
// argmax, which is what next() takes from a greedy sampler's row (and it takes nothing in), else next()'s.
llama_token Session::sample_row_of(int i, Sampler & s, uint64_t index) {
    const float * row = target_row(i);
    if (!row) {
        i = i < 0 ? i + hidden_rows : i;
        return row_pruned[i] == PRUNED_TOP ? s.next_top(row_top[i], index, cand) : row_best[i];
    }
    return s.next(row, index, cand);
}

// The threads of a head call of r rows: the decode's for one row, the batch's for more, as llama.cpp's own head.
int Session::head_threads(int r) const {
    return (int) (r > 1 ? llama_n_threads_batch(ctx_tgt) : llama_n_threads(ctx_tgt));
}

// The argmax of r final-norm rows x of greedy ranges, by the greedy head.
void Session::greedy_argmax(const float * x_rows, int32_t * best, int r) {
    const auto t0 = std::chrono::steady_clock::now();
    greedy_head->argmax(x_rows, best, r, head_threads(r));
    n_argmax_rows += r;
}

// The top of r final-norm rows x of top-k ranges, by the greedy head: row j's of[j]->keep largest logits and its
// range's forced tokens.
void Session::top_rows(const float * x_rows, GreedyHead::Top * out, int r, const std::vector<const HeadRange *> & of) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int> k(r);
    std::vector<std::vector<int32_t>> forced(r);
    for (int j = 0; j < r; ++j) {
        k[j] = of[j]->keep;
        forced[j] = of[j]->forced;
    }
    greedy_head->top(x_rows, r, head_threads(r), k.data(), forced.data(), out);
    n_top_rows += r;
}

// The LM head of r final-norm rows x into their logits y.
void Session::compute_head(const float * x_rows, float * y_rows, int r) {
    const auto t0 = std::chrono::steady_clock::now();
    const int n_vocab = tgt.n_vocab();
    const int nth = head_threads(r);
    if (pad && !head_w->extra) {  // extra: a repacked layout, which only ggml's own matmul reads
        head_vec_dot(x_rows, y_rows, r, nth);
        return;
    }
    if (!head_cpu) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        head_cpu = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
        if (!head_cpu) {
            fail("could not start a CPU backend for the LM head");
        }
        head_set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
    }
    if (head_set_threads) {
        head_set_threads(head_cpu, nth);
    }
    ggml_init_params ip = {ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(8, false), nullptr, true};
    ggml_context * g = ggml_init(ip);
    if (!g) {
        fail("could not allocate the LM head's graph");
    }
    ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_embd, r);
    x->data = const_cast<float *>(x_rows);
    ggml_tensor * y = ggml_mul_mat(g, head_w, x);
    y->data = y_rows;
    ggml_cgraph * gf = ggml_new_graph_custom(g, 8, false);
    ggml_build_forward_expand(gf, y);
    const ggml_status st = ggml_backend_graph_compute(head_cpu, gf);
    ggml_free(g);
    if (st != GGML_STATUS_SUCCESS) {
        fail("the LM head failed (ggml status " + std::to_string((int) st) + ")");
    }
}

// pad: rows [i0, i0 + r) of the LM head with ggml's one-row kernel (vec_dot), each row's bits those of llama.cpp's
// head for a prompt's one output row; as ggml's own loop does, the rows go through the matrix in blocks of 16
// matrix rows, each block read once for every row. (ggml's matmul would give two rows or more to sgemm.)
void Session::head_vec_dot(const float * x_rows, float * out, int r, int nth) {
    const int n_vocab = tgt.n_vocab();
    const ggml_type_traits_cpu * tw = ggml_get_type_traits_cpu(head_w->type);
    const ggml_type vt = tw->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, n_embd);
    head_q.resize((size_t) r * xrow);
    for (int j = 0; j < r; ++j) {  // as ggml converts a matmul's rows to the kernel's type
        const float * src = &x_rows[(size_t) j * n_embd];
        if (vt == GGML_TYPE_F32) {
            std::memcpy(&head_q[j * xrow], src, xrow);
        } else {
            ggml_get_type_traits_cpu(vt)->from_float(src, &head_q[j * xrow], n_embd);
        }
    }
    const char * w = (const char *) head_w->data;
    const size_t wrow = head_w->nb[1];
    auto work = [&](int v0, int v1) {
        for (int b0 = v0; b0 < v1; b0 += 16) {
            const int b1 = std::min(v1, b0 + 16);
            for (int j = 0; j < r; ++j) {
                for (int v = b0; v < b1; ++v) {
                    tw->vec_dot(n_embd, &out[(size_t) j * n_vocab + v], 0, w + v * wrow, 0, &head_q[j * xrow], 0, 1);
                }
            }
        }
    };
    // ggml's OpenMP team, whose threads would otherwise spin beside ours
#pragma omp parallel for num_threads(nth) schedule(static, 1)
    for (int t = 0; t < nth; ++t) {
        work((int) ((int64_t) n_vocab * t / nth), (int) ((int64_t) n_vocab * (t + 1) / nth));
    }
}

// By default the greedy head is built where it pays, where the LM head is a large part of a verify row: a quarter of
// the target's weights or more; asked for, wherever the head and CPU allow.
void Session::build_greedy_head() {
    if (greedy_head_mode == 0 || !head_w || greedy_head || !GreedyHead::supported(head_w)) {
        return;
    }
    if (greedy_head_mode == 1 || 4 * ggml_nbytes(head_w) >= llama_model_size(tgt.model)) {
        greedy_head = std::make_unique<GreedyHead>(head_w, (int) llama_n_threads_batch(ctx_tgt));
    }
}

void Session::set_greedy_head(std::optional<bool> on) {
    greedy_head_mode = on ? (int) *on : -1;
    greedy_head.reset();
    build_greedy_head();
}

// Logits of one output row of the last target decode (rows of a verify batch: 0 = after `last`).
py::array_t<float> Session::logits(int row) {
    if (row < -n_out || row >= n_out) {
        throw std::out_of_range("row " + std::to_string(row) + " outside the " + std::to_string(n_out) +
                                " output rows of the last target decode");
    }
    LogScope log(verbose);
    const int n_vocab = tgt.n_vocab();
    const float * src = target_row(row, true);
    py::array_t<float> out(n_vocab);
    std::memcpy(out.mutable_data(), src, n_vocab * sizeof(float));
    return out;
}

py::array_t<float> Session::greedy_logits(int row, int top_k, std::vector<llama_token> forced) {
    if (!greedy_head_active() || row < 0 || row >= hidden_rows) {
        throw std::invalid_argument("no greedy head for row " + std::to_string(row) + " of the last target decode");
    }
    if (top_k < 1) {
        throw std::invalid_argument("top_k must be at least 1");
    }
    check_tokens(forced);
    sort_unique(forced);
    LogScope log(verbose);
    py::array_t<float> out(tgt.n_vocab());
    GreedyHead::Top top;
    greedy_head->top(&hidden[(size_t) row * n_embd], 1, head_threads(1), &top_k, &forced, &top);
    std::fill_n(out.mutable_data(), tgt.n_vocab(), -INFINITY);
    for (const auto & [v, e] : top) {
        out.mutable_data()[v] = e;
    }
    return out;
}
