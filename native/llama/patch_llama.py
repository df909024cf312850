"""Fix llama.cpp's KV cache in an unpacked llama-cpp-python sdist (scripts/setup.sh runs this before building the
wheel). Every anchor must match this llama.cpp exactly; anything else is an error.

llama_kv_cache::prepare() places every ubatch of a decode to check that the batch fits, then puts the cells and each
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


def patch(sdist: Path) -> None:
    path = sdist / "vendor" / "llama.cpp" / "src" / "llama-kv-cache.cpp"
    text = path.read_text()
    if text.count(KV_ANCHOR) != 1:
        raise SystemExit(f"patch_llama: {path} does not have the expected prepare() restore (this llama.cpp changed)")
    path.write_text(text.replace(KV_ANCHOR, KV_FIX))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: patch_llama.py SDIST_DIR")
    patch(Path(sys.argv[1]))
