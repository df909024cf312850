"""Benchmark: the greedy LM head (native/greedy_head.cpp) against the full head, in one process, taking turns.

    python bench/greedy_head.py [-m TARGET] [-t 2] [--prompts 6] [-n 96] [--rounds 3]

Reported: the LM head's milliseconds in a verify block of k rows, every draft accepted (the target's own continuation,
so every row's head computed in one call), the median over the rounds; plain decoding tokens/s over the first prompts
of bench/prompts.jsonl, the two heads alternating within every round; and whether every output is the same with both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m Q4_K_M)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("-n", "--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from dflash_local import Engine, _native
    from dflash_local.bench import load_prompts, own_continuation
    from dflash_local.engine.placement import Placement
    from dflash_local import models

    e = Engine(models.pair(args.model)[0], n_ctx=2048, placement=Placement(n_threads=args.threads))
    s, greedy = e.session, _native.Sampling()
    prompts = [p["prompt"] for p in load_prompts(ROOT / "bench" / "prompts.jsonl")][: args.prompts]
    last = s.prefill(e.prompt_tokens(prompts[0]), greedy, 0)
    if not s.greedy_head:
        raise SystemExit("this target gets no greedy head (head type, share of the weights or CPU): nothing to compare")
    print(f"greedy head: {s.greedy_head_bytes / 2**20:.0f} MiB")
    own = own_continuation(s, last, 17, greedy)
    p0 = s.n_past
    ks = (2, 4, 8, 12, 16)
    head = {}
    for _ in range(args.rounds):
        for k in ks:
            for on in (True, False):
                s.set_greedy_head(on)
                r = s.step(last, own[1:k], greedy, 1, k)
                assert r.tokens == own[1 : k + 1]
                head.setdefault((k, on), []).append(r.head_ms)
                s.truncate(p0)
    print("LM head of a verify block, every draft accepted (ms, median):")
    for k in ks:
        g, f = statistics.median(head[(k, True)]), statistics.median(head[(k, False)])
        print(f"  k={k:2d}: greedy {g:6.1f}  full {f:6.1f}  ({g / f:.2f}x)")

    speed, outputs = {True: [], False: []}, {}
    for _ in range(args.rounds):
        for on in (True, False):
            s.set_greedy_head(on)
            n, t0 = 0, time.perf_counter()
            for p in prompts:
                e.cache.clear()
                out = e.complete(p, max_tokens=args.max_tokens, draft=False)
                outputs.setdefault((on, p), out.token_ids)
                n += len(out.token_ids)
            speed[on].append(n / (time.perf_counter() - t0))
    s.set_greedy_head(None)
    same = sum(outputs[(True, p)] == outputs[(False, p)] for p in prompts)
    print("plain decoding tokens/s, per round:")
    for on in (True, False):
        print(f"  {'greedy' if on else 'full  '} head: " + " ".join(f"{x:.1f}" for x in speed[on]))
    print(f"outputs identical: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
