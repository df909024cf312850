"""Mean acceptance length of drafters with full blocks on a prompt set, all in one process.

Each drafter drafts a full block at every step (the bench's "fixed blocks" row), greedy, over every prompt; tau is
(accepted drafts + steps) / steps, the figure the issue's bar and the README tables quote, and the draft's wall-clock
milliseconds per step come with it. One process and the same prompts for every drafter, so drafters compare fairly.
README, "Training a drafter".

    python bench/acceptance.py DRAFTER.gguf [DRAFTER.gguf ...] [-m TARGET] [--prompts bench/prompts.jsonl] [-n 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from dflash_local import Engine
from dflash_local.bench import load_prompts
from dflash_local.models import default_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("-m", "--target", default=None, help="target GGUF (default: the gemma-3-270m default model)")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "prompts.jsonl"))
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = load_prompts(args.prompts)
    target = args.target or str(default_target())
    for drafter in args.drafters:
        engine = Engine(target, drafter, n_ctx=2048, draft_policy="fixed")
        runs = []
        for row in tqdm(rows, desc=drafter.split("/")[-1], leave=False):
            kw = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
            runs.append(engine.complete(**kw, max_tokens=args.max_tokens).summary)
        steps, accepted = sum(s.steps for s in runs), sum(s.n_accepted for s in runs)
        draft_ms = sum(s.draft_ms for s in runs)
        accepted_at = [sum(col) for col in zip(*(s.accepted_at for s in runs))]
        drafted_at = [sum(col) for col in zip(*(s.drafted_at for s in runs))]
        by_position = ", ".join(f"{a / d:.2f}" for a, d in zip(accepted_at, drafted_at) if d)
        print(f"{drafter}: tau {(accepted + steps) / steps:.3f} over {steps} steps; accepted by position {by_position}; "
              f"draft {draft_ms / steps:.1f} ms per step", flush=True)
        del engine


if __name__ == "__main__":
    main()
