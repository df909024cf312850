"""Benchmark: a CPU kernel choice's speed and whether verification stays exact under it, in one process per choice.

    python bench/kernels.py --kernels exact|repack|fa|tiled [--pad auto|0|1] [-m TARGET] [-t 2] [--prompts 14] [-n 96]

exact: the default (no repacking, no flash attention, ggml's tiled matmul off). repack: the target's weights repacked
(--repack target). fa: flash attention on. tiled: ggml's tiled K-quant matmul for every row, a one-row decode included
(GGML_CPU_TILED_MM=1 GGML_CPU_TILED_MM_FORCE=1, read once per process, so one choice per run). --pad: two rows at
least in every target decode (DFLASH_PAD_ROWS; auto: where llama.cpp has llamafile's sgemm, see native/session.h).
Which llama.cpp build is measured is the venv's: run the script with that venv's python.

Reported: T(1..16) with every draft accepted (every row's LM head computed), the same with the first draft rejected
(one head row: the layers' cost), plain decoding tokens/s over the first 6 prompts of bench/prompts.jsonl (128
tokens), and exactness: for each prompt, greedy output with the drafter's own drafts and with a scripted drafter (plain
decoding's continuation with planted errors, every acceptance length) against plain decoding under the same kernels.
Compare speeds between runs only when they alternate on a quiet machine: each choice needs a process of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", choices=["exact", "repack", "fa", "tiled"], default="exact")
    ap.add_argument("--pad", choices=["auto", "0", "1"], default="auto")
    ap.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m Q4_K_M)")
    ap.add_argument("-d", "--draft", help="drafter GGUF (default: the shipped drafter, with the default target)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=14, help="prompts of the exactness check (default 14)")
    ap.add_argument("-n", "--max-tokens", type=int, default=96)
    args = ap.parse_args()
    if args.kernels == "tiled":  # before ggml reads them (the native module sets the first one to 0 unless set)
        os.environ["GGML_CPU_TILED_MM"] = "1"
        os.environ["GGML_CPU_TILED_MM_FORCE"] = "1"
    if args.pad != "auto":
        os.environ["DFLASH_PAD_ROWS"] = args.pad

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_prompts
    from scripted import ScriptedDrafter

    from dflash_local import Engine, _native
    from dflash_local.bench import load_prompts, row_request, verify_cost_curve
    from dflash_local.engine.placement import Placement
    from dflash_local import models

    target, drafter = models.pair(args.model, args.draft)
    placement = Placement(n_threads=args.threads, repack=args.kernels == "repack",
                          flash_attn="on" if args.kernels == "fa" else "off")
    e = Engine(target, drafter, n_ctx=2048, draft_policy="fixed", placement=placement)
    name = f"{args.kernels} (sgemm built in: {_native.sgemm_built_in()}, padded: {e.session.pads_rows})"
    curve = verify_cost_curve(e, 16, repeats=5)
    print(name, "T(k) ms:", " ".join(f"{k}:{v:.1f}" for k, v in curve.items()))
    curve = verify_cost_curve(e, 16, repeats=5, rejected=True)
    print(name, "T(k) ms, first draft rejected:", " ".join(f"{k}:{v:.1f}" for k, v in curve.items()))

    tokens = seconds = 0.0
    for row in load_prompts(ROOT / "bench" / "prompts.jsonl")[:6]:
        r = e.complete(**row_request(row), max_tokens=128, draft=False)
        tokens += len(r.token_ids)
        seconds += len(r.token_ids) / r.summary.tokens_per_second
    print(name, f"plain decoding {tokens / seconds:.1f} tok/s")

    differ = 0
    prompts = make_prompts(args.prompts - 2, seed=3) + ["The history of the printing press", "def fibonacci(n):"]
    for p in prompts:
        base = e.complete(p, max_tokens=args.max_tokens, draft=False)
        own = e.complete(p, max_tokens=args.max_tokens) if e.has_drafter else base
        scripted = ScriptedDrafter(len(e.prompt_tokens(p)), base.token_ids, e.target.n_vocab)
        spec = e.complete(p, max_tokens=args.max_tokens, external_drafter=scripted)
        differ += own.token_ids != base.token_ids or spec.token_ids != base.token_ids
    print(name, f"exactness: {differ} of {len(prompts)} outputs differ from plain decoding")


if __name__ == "__main__":
    main()
