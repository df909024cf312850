"""The n-gram lookup's size: the default (n-gram lookup + DFlash) with each `--spec-ngram-simple-size-n` on one
engine, the sizes taking turns round after round (this machine's speed drifts). Prints each round's decode tok/s per
size; every output is checked against plain decoding's (sampled: the same seed).

    python bench/ngram_sizes.py [--prompts bench/long-prompts.jsonl] [--sizes 12,8] [-n 256] [--rounds 3] [-c 8192]
                                [--temp 0.8]
"""

import argparse
import json
from pathlib import Path

from dflash_local import Engine
from dflash_local.engine.ngram import NgramSpec
from dflash_local import models

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "long-prompts.jsonl"), help="JSONL with 'prompt'")
    ap.add_argument("--sizes", default="12,8", help="the n to compare, comma-separated")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-m", "--model", help="target GGUF or a built-in pair's name (default: the default pair; the "
                    "figures in docs/measurements.md: -m gemma)")
    ap.add_argument("-c", "--ctx-size", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--temp", type=float, default=0.0, help="sampled with llama.cpp's default chain, seed 1")
    a = ap.parse_args()
    e = Engine(*models.pair(a.model), n_ctx=a.ctx_size, n_threads=a.threads, ngram=NgramSpec())
    sampling = dict(temperature=a.temp, top_k=40, top_p=0.95, min_p=0.05, seed=1) if a.temp > 0 else {}
    prompts = [json.loads(line)["prompt"] for line in open(a.prompts)]
    plain = {p: e.complete(p, max_tokens=a.max_tokens, draft=False, **sampling).token_ids for p in prompts}
    sizes = [int(n) for n in a.sizes.split(",")]
    speed = {n: [] for n in sizes}
    for _ in range(a.rounds):
        for n in sizes:
            e.ngram = NgramSpec(size_n=n, size_m=e.ngram.size_m)  # each generation builds its lookup from it
            tokens = ms = 0
            for p in prompts:
                f = e.complete(p, max_tokens=a.max_tokens, **sampling)
                if f.token_ids != plain[p]:
                    raise SystemExit(f"n = {n}: an output differs from plain decoding's ({p[:40]!r})")
                tokens += f.summary.n_generated - 1
                ms += f.summary.decode_ms
            speed[n].append(tokens / ms * 1000)
            print(f"n = {n}: {speed[n][-1]:.1f} tok/s", flush=True)
    print("decode tok/s per round: " + "; ".join(f"n = {n}: " + ", ".join(f"{x:.1f}" for x in v)
                                                  for n, v in speed.items()) + "; every output = plain")


if __name__ == "__main__":
    main()
