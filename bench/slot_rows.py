"""Benchmark: what a verified row costs when several slots' blocks share one target decode (Session.step_batch).

    python bench/slot_rows.py [-m TARGET] [--slots 1,2,4] [--blocks 1,4,8] [--repeats 5]

For each number of slots S and block length k (the last token and k - 1 drafts, every draft the target's own
continuation, so every row is read and its LM head computed), the median milliseconds of a step that verifies S
blocks of k rows in one decode, and per row. One slot's block of k rows is what one client's DFlash step costs;
S x k rows is what a round of the server's runner costs with S clients (bench/serve_chat.py). On a CPU a row costs
about the same in either, once k fills the kernels' tiles: that bounds what parallel slots add to DFlash there.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_local import Engine, _native
from dflash_local import models

PROMPTS = ["def total(values):\n", "The quick brown fox", "Once upon a time", "Hello world, this is",
           "import numpy as np\n", "The history of the printing press", "Dear Sir or Madam,", "SELECT name FROM"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m Q4_K_M)")
    ap.add_argument("--slots", default="1,2,4")
    ap.add_argument("--blocks", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    slots = [int(x) for x in args.slots.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    n_slots = max(slots)
    e = Engine(models.pair(args.model)[0], n_ctx=1024 * n_slots, n_slots=n_slots, draft_policy="fixed")
    s = e.session
    # each slot's plain continuation: drafts that are all accepted
    want = [e.complete(p, max_tokens=max(blocks) + 1, draft=False).token_ids for p in PROMPTS[:n_slots]]
    ids = [e.prompt_tokens(p) for p in PROMPTS[:n_slots]]
    print("| slots | rows per slot | rows | step ms (median) | ms per row |")
    print("|---|---|---|---|---|")
    for k in blocks:
        for n in slots:
            times = []
            for _ in range(args.repeats):
                samplers = [_native.Sampler(e.target, _native.Sampling()) for _ in range(n)]
                for j in range(n):
                    s.truncate(0, j)
                    first = s.prefill(ids[j], samplers[j], 0, j)
                    assert first == want[j][0]
                steps = [(j, want[j][0], list(want[j][1:k]), samplers[j], 1, False, k) for j in range(n)]
                t0 = time.perf_counter()
                res = s.step_batch(steps) if n > 1 else [s.step(want[0][0], list(want[0][1:k]), samplers[0], 1,
                                                                 False, k, 0)]
                times.append((time.perf_counter() - t0) * 1000)
                assert all(r.n_accepted == k - 1 for r in res)
            ms = statistics.median(times)
            print(f"| {n} | {k} | {n * k} | {ms:.1f} | {ms / (n * k):.2f} |", flush=True)


if __name__ == "__main__":
    main()
