"""What computing a CPU target's LM head only for the rows a step reads saves, against llama.cpp computing every row's
(native/head.cpp, "LM head on demand"), in one process. Two parts:

1. Verify cost by hand: batches of k = 1..block tokens after one prompt, their drafts all accepted (the target's own
   continuation: every row read) or the first one rejected (one row read), the head on demand and off taking turns;
   median milliseconds of target time and, on demand, of the head's part.
2. End to end (--prompts): each prompt generated plainly, then with the default drafting (the n-gram lookup and the
   drafter, adaptive) and with full blocks of the drafter alone, each with the head on demand and off, taking turns
   (two engines, one per setting), greedy; tokens/s of each (outputs must be identical) over all prompts.

    python bench/head_on_demand.py [-m TARGET -d DRAFTER] [--prompts bench/prompts.jsonl] [-n 256] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_local import Engine, _native
from dflash_local.bench import DEFAULT_PROMPTS, load_prompts, own_continuation, row_request
from dflash_local import models
from dflash_local.engine.ngram import NgramSpec


def verify_costs(engine: Engine, block: int, repeats: int) -> None:
    s, sp = engine.session, _native.Sampling()
    last = s.prefill(engine.prompt_tokens(DEFAULT_PROMPTS[1]["prompt"]), sp, 0)
    p0, own = s.n_past, own_continuation(s, last, block - 1, sp)
    wrong = (own[1] + 1) % engine.target.n_vocab
    print("k  | accepted: off, on (head)  | first rejected: off, on (head)  [ms]")
    for k in range(1, block + 1):
        cells = []
        for draft in (own[1:k], [wrong] + own[2:k]):
            t = {False: [], True: []}
            head = []
            for _ in range(repeats):
                for on in (False, True):
                    s.set_head_on_demand(on)
                    r = s.step(last, draft[: k - 1], sp, 1, k if draft[:1] != [wrong] else 1)
                    t[on].append(r.verify_ms)
                    if on:
                        head.append(r.head_ms)
                    s.truncate(p0)
            cells.append(f"{statistics.median(t[False]):6.1f}, {statistics.median(t[True]):6.1f} "
                         f"({statistics.median(head):5.1f})")
        print(f"{k:2d} | " + " | ".join(cells), flush=True)
    s.set_head_on_demand(True)
    s.truncate(0)


def end_to_end(target, drafter, rows: list[dict], n: int, threads: int) -> None:
    engines = {on: Engine(target, drafter, n_threads=threads, ngram=NgramSpec()) for on in (True, False)}
    for on, e in engines.items():
        e.complete("Hello", max_tokens=2)  # the first decode finds the head
        e.session.set_head_on_demand(on)
    assert engines[True].session.head_on_demand, "this target's head is not computed on demand"
    runs = [("plain", True, {"draft": False})]
    for on in (True, False):
        runs += [(f"default, head {'on demand' if on else 'off'}", on, {}),
                 (f"full blocks, head {'on demand' if on else 'off'}", on, {"ngram": False, "fixed": True})]
    total, n_tokens = {name: 0.0 for name, _, _ in runs}, 0
    for i, row in enumerate(rows):
        req = row_request(row)
        ref = None
        for name, on, kw in runs if i % 2 == 0 else runs[::-1]:
            e = engines[on]
            e.draft_policy = "fixed" if kw.get("fixed") else "auto"
            t0 = time.perf_counter()
            out = e.complete(**req, max_tokens=n, **{k: v for k, v in kw.items() if k != "fixed"})
            total[name] += time.perf_counter() - t0
            assert ref is None or out.token_ids == ref, f"prompt {i}: {name} differs"
            ref = out.token_ids
        n_tokens += len(ref)
        print(f"prompt {i}: {len(ref)} tokens", flush=True)
    for name, secs in total.items():
        print(f"{name:32s} {n_tokens / secs:6.1f} tokens/s  {total['plain'] / secs:5.3f}x plain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--prompts", default=None, help="JSONL of prompts for the end-to-end part (default: skip it)")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    target, drafter = models.pair(a.model, a.draft)
    verify_costs(Engine(target, n_threads=a.threads), a.block, a.repeats)
    if a.prompts:
        end_to_end(target, drafter, load_prompts(a.prompts), a.n, a.threads)


if __name__ == "__main__":
    main()
