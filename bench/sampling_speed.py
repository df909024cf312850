"""Plain decoding speed when sampling vs greedy, and the sampler's own time per row, in one process.

    python bench/sampling_speed.py [-m target.gguf] [-n 64] [--rounds 5] [--greedy-head auto|on|off] [--json out.json]

Plain decoding (no drafter) of a few prompts under several sampling settings; every round runs each setting once,
in turn, so a busy machine slows all settings alike. Reports the median tokens/s per setting and its ratio to greedy
(temperature 0), then the native sampler alone on real logits rows of the target (`_native.sample`, the function
every decode step calls), per row, next to greedy's argmax.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from dflash_local import _native
from dflash_local.bench import DEFAULT_PROMPTS
from dflash_local.engine.engine import Engine
from dflash_local import models

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temp 1": dict(temperature=1.0),
    "temp 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temp 1, top_k 40": dict(temperature=1.0, top_k=40),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # and llama-server's
    "temp 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
}


def decode_speed(engine: Engine, prompts: list[str], max_tokens: int, rounds: int) -> dict[str, list[float]]:
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(rounds):
        for name, kw in SETTINGS.items():
            for i, p in enumerate(prompts):
                res = engine.complete(p, max_tokens=max_tokens, draft=False, seed=1000 * r + i, **kw)
                speeds[name].append(res.summary.tokens_per_second)
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
    return speeds


def logits_rows(engine: Engine, prompts: list[str], per_prompt: int = 8) -> list[np.ndarray]:
    """The target's logits after each of the first `per_prompt` greedy tokens of every prompt."""
    rows = []
    for p in prompts:
        ids = engine.prompt_tokens(p) + engine.complete(p, max_tokens=per_prompt, draft=False).token_ids
        for n in range(len(ids) - per_prompt, len(ids)):
            engine.cache.truncate(engine.session, 0)  # driven by hand below: the prompt cache then claims none of it
            engine.session.prefill(ids[:n], _native.Sampling(), 0)
            rows.append(engine.session.logits(-1))
    return rows


def sampler_ms(rows: list[np.ndarray], repeats: int) -> dict[str, float]:
    """Median over rows of the fastest of `repeats` calls, per setting, in milliseconds."""
    out = {}
    for name, kw in SETTINGS.items():
        s = _native.Sampling(kw.get("temperature", 0.0), kw.get("top_k", 0), kw.get("top_p", 1.0),
                             kw.get("min_p", 0.0), 7)
        per_row = []
        for j, row in enumerate(rows):
            best = float("inf")
            for k in range(repeats):
                t0 = time.perf_counter()
                _native.sample(row, s, j * repeats + k)
                best = min(best, time.perf_counter() - t0)
            per_row.append(best * 1000)
        out[name] = statistics.median(per_row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the gemma-3-270m default target)")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help="how many of the bench's default prompts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--greedy-head", choices=["auto", "on", "off"], default="auto",
                    help="the greedy head (argmax and top-k rows): where it pays (default), wherever it can, never")
    args = ap.parse_args(argv)

    engine = Engine(models.pair(args.model)[0], None, n_ctx=1024, n_threads=args.threads)
    prompts = [p["prompt"] for p in DEFAULT_PROMPTS[: args.prompts]]
    engine.complete(prompts[0], max_tokens=8, draft=False)  # warm-up
    engine.session.set_greedy_head({"auto": None, "on": True, "off": False}[args.greedy_head])
    speeds = decode_speed(engine, prompts, args.max_tokens, args.rounds)
    rows = logits_rows(engine, prompts)
    per_row = sampler_ms(rows, repeats=5)

    greedy = statistics.median(speeds["greedy"])
    argmax_rows, top_rows = engine.session.pruned_rows
    print(f"plain decoding, {len(prompts)} prompts x {args.max_tokens} tokens x {args.rounds} rounds "
          f"(settings alternating), vocabulary {engine.target.n_vocab}; greedy head "
          f"{'on' if engine.session.greedy_head else 'off'} ({argmax_rows} rows computed for their argmax, {top_rows} "
          f"for their top)")
    print(f"{'setting':<22} {'tok/s':>7} {'vs greedy':>9} {'sampler ms/row':>15}")
    report = {}
    for name in SETTINGS:
        tps = statistics.median(speeds[name])
        print(f"{name:<22} {tps:7.1f} {tps / greedy:9.3f} {per_row[name]:15.3f}")
        report[name] = {"tokens_per_second": tps, "ratio_to_greedy": tps / greedy, "sampler_ms_per_row": per_row[name],
                        "runs": speeds[name]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
