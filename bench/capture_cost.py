"""What the drafter costs while the adaptive policy decodes plainly, against plain decoding, in one process.

The target's features must be captured at every token for the drafts to come, even while no draft pays. Two parts:

1. Plain steps by hand: rounds of N plain greedy steps after one prompt, feature capture off and on taking turns;
   the median per step of the whole step's CPU time, of the target decode (which includes the capture) and of the
   drafter's part (feature injection before deferral; keeping the rows for the next draft after it).
2. End to end: each prompt of --prompts generated plainly and with the adaptive draft length, taking turns, greedy;
   CPU time per token of both (the outputs must be identical), and the drafter's milliseconds (drafts and feature
   injection) per step of the adaptive runs.

Times are the calling thread's CPU time: on one thread llama.cpp computes on the calling thread, so they hold on a
machine shared with other jobs, where wall-clock times do not. docs/measurements.md, "The draft-length policy".

    python bench/capture_cost.py [-m TARGET -d DRAFTER] [--prompts bench/code-heldout.jsonl] [-n 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_local import Engine, _native
from dflash_local.bench import load_prompts
from dflash_local import models


def cpu_ms(f):
    t0 = time.thread_time()
    out = f()
    return out, (time.thread_time() - t0) * 1000


def plain_steps(engine: Engine, prompt: str, rounds: int, n: int) -> None:
    s, sp = engine.session, _native.Sampling()
    ids = engine.prompt_tokens(prompt)
    times = {on: {"cpu": [], "decode": [], "drafter": []} for on in (False, True)}
    for _ in range(rounds):
        for on in (False, True):
            s.truncate(0)
            s.set_capture(on)
            last = s.prefill(ids, sp, 0)
            for i in range(n):
                r, ms = cpu_ms(lambda: s.step(last, [], sp, i + 1))
                times[on]["cpu"].append(ms)
                times[on]["decode"].append(r.verify_ms)
                times[on]["drafter"].append(r.draft_ms)
                last = r.tokens[0]
    s.truncate(0)
    engine.cache.clear()  # the session was driven by hand
    med = {on: {k: statistics.median(v) for k, v in t.items()} for on, t in times.items()}
    for on in (False, True):
        m = med[on]
        print(f"plain steps, capture {'on ' if on else 'off'}: CPU {m['cpu']:.3f} ms per step; wall: target decode "
              f"{m['decode']:.3f} ms, drafter {m['drafter']:.4f} ms (medians of {len(times[on]['cpu'])} steps)")
    print(f"capture on / off, CPU per step: {med[True]['cpu'] / med[False]['cpu']:.4f}")


def end_to_end(engine: Engine, prompts: list[dict], max_tokens: int) -> None:
    plain_ms = adaptive_ms = drafter_ms = 0.0
    n_tokens = steps = drafting = 0
    for i, row in enumerate(prompts):
        kw = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
        runs = {}
        for draft in ((False, True) if i % 2 == 0 else (True, False)):  # neither always goes first
            runs[draft] = cpu_ms(lambda: engine.complete(**kw, max_tokens=max_tokens, draft=draft))
        (base, base_ms), (spec, spec_ms) = runs[False], runs[True]
        if spec.token_ids != base.token_ids:
            raise SystemExit(f"prompt {i}: the adaptive output differs from plain decoding")
        plain_ms, adaptive_ms = plain_ms + base_ms, adaptive_ms + spec_ms
        n_tokens += len(base.token_ids)
        steps += spec.summary.steps
        drafter_ms += spec.summary.draft_ms
        drafting += spec.summary.drafted_at[0] if spec.summary.drafted_at else 0  # steps that drafted
    print(f"end to end, {len(prompts)} prompts x {max_tokens} tokens: plain {plain_ms / n_tokens:.3f} ms CPU per "
          f"token, adaptive {adaptive_ms / n_tokens:.3f}; adaptive / plain speed {plain_ms / adaptive_ms:.4f}; "
          f"drafter (drafts + injection) {drafter_ms / steps:.3f} ms wall per step, {drafting} of {steps} steps "
          f"drafted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--prompts", default="bench/code-heldout.jsonl")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of plain steps, capture off and on")
    ap.add_argument("--steps", type=int, default=64, help="plain steps per round")
    args = ap.parse_args()
    engine = Engine(*models.pair(args.model, args.draft), n_threads=1)
    prompts = load_prompts(args.prompts)
    plain_steps(engine, prompts[0].get("prompt", "Hello"), args.rounds, args.steps)
    end_to_end(engine, prompts, args.max_tokens)


if __name__ == "__main__":
    main()
