"""Acceptance under sampling: match verification (the default, output identical to plain decoding with the same
seed) against rejection sampling (--spec-sampling rejection), on the same prompts, seeds and drafter.

    python bench/spec_sampling.py [-m target.gguf -d drafter.gguf] [--prompts bench/prompts.jsonl] [-n 128]
                                  [--limit 8] [--temps 0.7,1.0] [--json out.json]

Full blocks every step (draft policy fixed), so the mean acceptance length (accepted drafts + 1 per step) measures
the drafter, not the policy. Modes take turns prompt by prompt, so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash_local.bench import load_prompts
from dflash_local.engine.engine import Engine
from dflash_local import models

MODES = ("match", "rejection")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("-d", "--draft")
    ap.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.jsonl")))
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=8, help="first N prompts")
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, draft = models.pair(args.model, args.draft)
    if not draft:
        sys.exit("a drafter is needed (-d)")
    engine = Engine(model, draft, n_ctx=2048, n_threads=args.threads, draft_policy="fixed")
    prompts = load_prompts(args.prompts)[: args.limit]
    temps = [float(t) for t in args.temps.split(",")]
    totals = {(t, m): dict(steps=0, accepted=0, tokens=0, seconds=0.0) for t in temps for m in MODES}
    for t in temps:
        for i, row in enumerate(prompts):
            print(f"T={t} prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
            for mode in MODES:
                t0 = time.perf_counter()
                done = engine.complete(**row, max_tokens=args.max_tokens, temperature=t, seed=i,
                                       spec_sampling=mode)
                tot = totals[(t, mode)]
                tot["seconds"] += time.perf_counter() - t0
                tot["steps"] += done.summary.steps
                tot["accepted"] += done.summary.n_accepted
                tot["tokens"] += done.summary.n_generated
    rows = []
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, full blocks of {engine.block_size}")
    print(f"{'temperature':>11} {'mode':>10} {'mean acceptance length':>23} {'tok/s':>7}")
    for (t, mode), tot in totals.items():
        tau = (tot["accepted"] + tot["steps"]) / tot["steps"] if tot["steps"] else 0.0
        speed = tot["tokens"] / tot["seconds"] if tot["seconds"] else 0.0
        rows.append(dict(temperature=t, mode=mode, mean_acceptance_length=tau, tokens_per_second=speed, **tot))
        print(f"{t:>11} {mode:>10} {tau:>23.3f} {speed:>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
