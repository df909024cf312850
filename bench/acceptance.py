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
        steps = accepted = 0
        draft_ms = 0.0
        accepted_at, drafted_at = [], []
        for row in tqdm(rows, desc=drafter.split("/")[-1], leave=False):
            kw = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
            s = engine.complete(**kw, max_tokens=args.max_tokens).summary
            steps, accepted, draft_ms = steps + s.steps, accepted + s.n_accepted, draft_ms + s.draft_ms
            accepted_at = [a + b for a, b in zip(accepted_at, s.accepted_at)] if accepted_at else list(s.accepted_at)
            drafted_at = [a + b for a, b in zip(drafted_at, s.drafted_at)] if drafted_at else list(s.drafted_at)
        by_position = ", ".join(f"{a / d:.2f}" for a, d in zip(accepted_at, drafted_at) if d)
        print(f"{drafter}: tau {(accepted + steps) / steps:.3f} over {steps} steps; accepted by position {by_position}; "
              f"draft {draft_ms / steps:.1f} ms per step", flush=True)
        del engine


if __name__ == "__main__":
    main()
