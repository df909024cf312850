"""Mean acceptance length of drafters with full blocks on a prompt set, all in one process.

Each drafter drafts a full block at every step (the bench's "fixed blocks" row), greedy, over every prompt; tau is
(accepted drafts + steps) / steps, the figure the issue's bar and the tables in docs/measurements.md quote, and the
draft's wall-clock milliseconds per step come with it. One process and the same prompts for every drafter, so
drafters compare fairly. docs/measurements.md, "Drafter training experiments".

    python bench/acceptance.py DRAFTER.gguf [DRAFTER.gguf ...] [-m TARGET] [--prompts bench/prompts.jsonl] [-n 64] [-c 2048]

A prompt set whose rows carry a "kind" (bench/chat-heldout.jsonl: chat, code, reasoning) gets tau per kind too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from dflash_local import Engine
from dflash_local.bench import load_prompts, row_request
from dflash_local import models
from dflash_local.engine.stats import pooled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("-m", "--target", default=None, help="target GGUF or a built-in pair's name (default: the default pair)")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "prompts.jsonl"))
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (long prompts need more)")
    args = ap.parse_args()
    rows = load_prompts(args.prompts)
    target = str(models.pair(args.target)[0])
    for drafter in args.drafters:
        engine = Engine(target, drafter, n_ctx=args.ctx_size, draft_policy="fixed")
        runs = [engine.complete(**row_request(row), max_tokens=args.max_tokens).summary
                for row in tqdm(rows, desc=drafter.split("/")[-1], leave=False)]
        s = pooled(runs)
        by_position = ", ".join(f"{r:.2f}" for r, d in zip(s.acceptance_rate, s.drafted_at) if d)
        print(f"{drafter}: tau {s.mean_acceptance_length:.3f} over {s.steps} steps; accepted by position "
              f"{by_position}; draft {s.draft_ms / s.steps:.1f} ms per step", flush=True)
        kinds = sorted({row["kind"] for row in rows if "kind" in row})  # a prompt set's categories, if it has them
        for kind in kinds:
            k = pooled([r for r, row in zip(runs, rows) if row.get("kind") == kind])
            print(f"  {kind}: tau {k.mean_acceptance_length:.3f} over {k.steps} steps", flush=True)
        del engine


if __name__ == "__main__":
    main()
