"""Benchmark model: our n-gram lookup against upstream's ngram-mod rule, replayed over plain decoding's outputs.

    python bench/ngram_replay.py [--prompts bench/prompts.jsonl] [-n 256] [--row-ms 4.2,3,2.5,2] [--outputs F.json]

Decodes each prompt plainly (greedy, the default target) once, then replays the generation step by step with each
lookup drafting from the context so far: the target accepts the longest prefix of the draft that matches the plain
output, plus its own token. A step is charged T(1) + (k - 1) x row_ms for its k verified rows, T(1) from the target's
own one-row step, so the figures say how each rule fares at a given cost of a verified row, with every other cost
left out (the engine's policy, which may verify less than the draft, the drafter, sampling). Rules: ours
(`ngram-simple`'s: the newest earlier match of the last 12 tokens, up to 48 of the tokens after it, going round a loop
that reaches the newest token) and upstream's `ngram-mod` (common/ngram-mod.cpp: a hash table from 24-token contexts
to the next token, kept across the prompts in their order, drafting 48 to 64 tokens by walking it, or none; here the
table learns the context at every step, upstream's every 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_local.engine.ngram import NgramDrafter, NgramSpec


class NgramMod:
    """Upstream's ngram-mod rule: context of n tokens -> the token that last followed it, shared by all prompts."""

    def __init__(self, n: int = 24, n_min: int = 48, n_max: int = 64):
        self.n, self.n_min, self.n_max = n, n_min, n_max
        self.table: dict[tuple[int, ...], int] = {}

    def add(self, tokens: list[int], start: int = 0) -> None:
        """The contexts of tokens that begin at start or later, with their next token."""
        for i in range(start, len(tokens) - self.n):
            self.table[tuple(tokens[i : i + self.n])] = tokens[i + self.n]

    def draft(self, tokens: list[int]) -> list[int]:
        ctx, out = list(tokens[-self.n :]), []
        while len(ctx) == self.n and len(out) < self.n_max and tuple(ctx) in self.table:
            out.append(self.table[tuple(ctx)])
            ctx = ctx[1:] + out[-1:]
        return out if len(out) >= self.n_min else []


def replay(runs: list[tuple[list[int], list[int]]], rule: str, t1: float, row_ms: float) -> dict:
    """Tokens/s of the replay, with steps, drafted and accepted tokens."""
    mod = NgramMod()
    ms = steps = drafted = accepted = tokens = 0
    for prompt, out in runs:
        lookup = NgramDrafter(NgramSpec())
        added = 0  # the table has this generation's contexts that begin before this
        t = 1  # the first token comes with the prompt
        while t < len(out):
            ctx = prompt + out[:t]
            if rule == "ngram-mod":
                mod.add(ctx, added)
                added = max(added, len(ctx) - mod.n)
                d = mod.draft(ctx)
            else:
                d = lookup.draft(ctx, 48)
            d = d[: len(out) - t - 1]
            a = 0
            while a < len(d) and d[a] == out[t + a]:
                a += 1
            ms += t1 + len(d) * row_ms
            steps, drafted, accepted, tokens, t = steps + 1, drafted + len(d), accepted + a, tokens + a + 1, t + a + 1
        mod.add(prompt + out, added)
    return {"tokens_per_second": 1000 * tokens / ms, "steps": steps, "drafted": drafted, "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--row-ms", default="4.2,3,2.5,2", help="costs of a verified row beyond the first, ms")
    ap.add_argument("--outputs", help="a JSON file of the plain outputs: written if missing, read if there")
    args = ap.parse_args()
    if args.outputs and Path(args.outputs).is_file():
        saved = json.loads(Path(args.outputs).read_text())
        runs, t1 = [(r["prompt"], r["out"]) for r in saved["runs"]], saved["t1_ms"]
    else:
        from dflash_local.bench import load_prompts, row_request
        from dflash_local.engine.engine import Engine
        from dflash_local import models

        e = Engine(str(models.default_target()), None)
        runs, decode_ms, n_tokens = [], 0.0, 0
        for row in load_prompts(args.prompts):
            kw = row_request(row)
            r = e.complete(**kw, max_tokens=args.n, draft=False)
            runs.append((e.prompt_tokens(**kw), r.token_ids))
            decode_ms, n_tokens = decode_ms + r.summary.decode_ms, n_tokens + len(r.token_ids) - 1
        t1 = decode_ms / n_tokens
        if args.outputs:
            Path(args.outputs).write_text(json.dumps({"t1_ms": t1, "runs": [{"prompt": p, "out": o} for p, o in runs],
                                                      "made": time.strftime("%Y-%m-%d %H:%M")}))
    print(f"plain: {1000 / t1:.1f} tok/s (T(1) {t1:.1f} ms), {len(runs)} prompts")
    print("| row ms | ours (ngram-simple rule, loops) tok/s | drafted / accepted | ngram-mod rule tok/s | drafted / accepted |")
    print("|---|---|---|---|---|")
    for row_ms in (float(x) for x in args.row_ms.split(",")):
        a, b = replay(runs, "ours", t1, row_ms), replay(runs, "ngram-mod", t1, row_ms)
        print(f"| {row_ms} | {a['tokens_per_second']:.1f} | {a['drafted']} / {a['accepted']} | "
              f"{b['tokens_per_second']:.1f} | {b['drafted']} / {b['accepted']} |")


if __name__ == "__main__":
    main()
