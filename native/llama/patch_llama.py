"""Fix llama.cpp's KV cache in an unpacked llama-cpp-python sdist (scripts/setup.sh runs this before building the
wheel). Every anchor must match this llama.cpp exactly; anything else is an error. Two changes:

1. A sliding-window cache puts position p in cell p mod size, where its stream holds one sequence. llama.cpp takes
the first free cell from a moving head, so which cell a position lands in depends on what the cache held before (a
longer earlier prompt, rejected draft tokens); attention sums the window's cells in cell order, so the same token
rounded differently after another history. With the cell a function of the position, a sliding-window layer keeps
only its window (n_swa + n_ubatch cells, not the whole context) and still gives every token the same bits. The
cache's size is at least n_swa + n_ubatch, so a ubatch, or a verify block rolled back, only overwrites cells already
out of the window of every position still to come (docs/lossless.md).

2. llama_kv_cache::prepare() places every ubatch of a decode to check that the batch fits, then puts the cells and each
stream's head back. It puts a head back from the old heads by the ubatch's stream index (0, 1, ...), not by the stream
itself, so with a cache per sequence a stream of a later ubatch gets another stream's head. Applying that ubatch sets
the head again; a decode stopped before it (an abort callback, as an interrupted batched step, or a failed ubatch)
leaves it, and the next decode places that sequence's cells after a gap: its attention then sums the same cells in
other lanes and rounds differently (docs/lossless.md). Upstream llama.cpp has the same lines (November 2026).

    python native/llama/patch_llama.py SDIST_DIR
"""

import sys
from pathlib import Path

KV_ANCHOR = """            cells.set(sinfo.idxs[s], it->v_cells[s]);
            head = it->v_heads_old[s];
"""
KV_FIX = """            cells.set(sinfo.idxs[s], it->v_cells[s]);
            head = it->v_heads_old[sinfo.strm[s]];  // dflash-local: the stream's own head (native/llama/patch_llama.py)
"""


SLOT_ANCHOR = """        if (n_tokens > cells.size()) {
            LLAMA_LOG_ERROR("%s: n_tokens = %d > size = %u\\n", __func__, n_tokens, cells.size());
            return { };
        }
"""
SLOT_FIX = SLOT_ANCHOR + """
        // dflash-local: a sliding-window cache with one sequence per stream puts position p in cell p mod size
        // (native/llama/patch_llama.py); a cell still in the window of the ubatch's first position is not free.
        // Positions that do not follow each other (several per token) keep llama.cpp's search.
        const llama_pos * pos = ubatch.pos + s*n_tokens;
        if (n_stream == n_seq_max && (swa_type == LLAMA_SWA_TYPE_STANDARD || swa_type == LLAMA_SWA_TYPE_CHUNKED) &&
                ubatch.n_pos == 1 && pos[n_tokens - 1] == pos[0] + (llama_pos) n_tokens - 1) {
            for (uint32_t i = 0; i < n_tokens; ++i) {
                const uint32_t idx = (uint32_t) pos[i] % cells.size();
                if (!cells.is_empty(idx) && (cells.seq_count(idx) != 1 ||
                        !llama_hparams::is_masked_swa(n_swa, swa_type, cells.pos_get(idx),
                                                      cells.seq_pos_max(cells.seq_get(idx)) + 1))) {
                    LLAMA_LOG_ERROR("%s: the window cell of position %d is in use\\n", __func__, pos[i]);
                    return { };
                }
                res.idxs[s].push_back(idx);
            }
            continue;
        }
"""


def replace_once(path: Path, anchor: str, fix: str, what: str) -> None:
    text = path.read_text()
    if text.count(anchor) != 1:
        raise SystemExit(f"patch_llama: {path} does not have the expected {what} (this llama.cpp changed)")
    path.write_text(text.replace(anchor, fix))


def patch(sdist: Path) -> None:
    path = sdist / "vendor" / "llama.cpp" / "src" / "llama-kv-cache.cpp"
    replace_once(path, SLOT_ANCHOR, SLOT_FIX, "find_slot() size check")
    replace_once(path, KV_ANCHOR, KV_FIX, "prepare() restore")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: patch_llama.py SDIST_DIR")
    patch(Path(sys.argv[1]))
