"""Benchmark: tokens per hour of each stage of `dflash-local train` on the default target (gemma-3-270m).

    python bench/train_throughput.py [--parallel 1,4,16] [--samples 32] [--max-new 96] [--passages 32] [-t 2]
                                     [--steps 40]

Data: the same prompts (the default corpus's first --samples) continued with -np 1, 4, 16 ... sequences side by side,
one run each, in this process: target tokens per second of wall time and per CPU-second (the second holds up when other
work shares the machine). Then --passages corpus passages read by the target (--text-samples): tokens read per second,
and how many exact labels (of the 7 block positions) an anchor gets on average, where a continuation's get all 7.
Training: --steps steps of the shipped drafter's shape (2 layers, features of layers 2, 9 and 16, block 8, draft
vocabulary 8192, 4 sequences x 16 blocks) on that data: steps and predicted tokens per second.
Writes bench/results/train-throughput.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from dflash_local.train.corpus import training_prompts
from dflash_local import models
from dflash_local.engine.placement import Placement
from dflash_local.train.data import PASSAGE_TOKENS, load_sample, make_data

LAYERS = [2, 9, 16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", default="1,4,16", help="comma-separated -np values to compare")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--passages", type=int, default=32, help="passages to read (0: none)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="training steps to time (0: skip training)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train-throughput.json"))
    args = ap.parse_args()

    target = models.default_target()
    prompts = training_prompts()[: args.samples]
    work = Path(tempfile.mkdtemp(prefix="dflash-train-bench-"))
    placement = Placement(n_threads=args.threads)
    results = {"target": target.name, "threads": args.threads, "samples": args.samples, "max_new": args.max_new,
               "data": []}
    try:
        for npar in [int(x) for x in args.parallel.split(",")]:
            folder = work / f"np{npar}"
            made = [0]
            t0, c0 = time.perf_counter(), time.process_time()
            make_data(target, folder, LAYERS, prompts, args.samples, args.max_new, n_parallel=npar,
                      placement=placement, progress=lambda i, n: made.__setitem__(0, made[0] + n))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            row = {"parallel": npar, "tokens": made[0], "tokens_per_s": made[0] / wall,
                   "tokens_per_cpu_s": made[0] / cpu, "tokens_per_hour": made[0] / wall * 3600}
            results["data"].append(row)
            print(f"data -np {npar:3d}: {made[0]} tokens, {row['tokens_per_s']:6.1f} tok/s "
                  f"({row['tokens_per_hour'] / 1e3:.0f} k/hour), {row['tokens_per_cpu_s']:6.1f} tok per CPU-s",
                  flush=True)
        if args.passages:
            results["passages"] = time_passages(target, work / "passages", placement, args)
        if args.steps:
            results["train"] = time_training(target, work, folder, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


def time_passages(target, folder: Path, placement: Placement, args) -> dict:
    read = [0]
    t0, c0 = time.perf_counter(), time.process_time()
    paths = make_data(target, folder, LAYERS, training_prompts(passages=True), args.passages, 0,
                      n_prompt_max=PASSAGE_TOKENS, placement=placement,
                      progress=lambda i, n: read.__setitem__(0, read[0] + n))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    labels = anchors = 0
    for path in paths:  # per anchor: block positions whose label is exact (train.sequence_loss's rule)
        s = load_sample(path)
        own = s.tokens[1:] == s.top_ids[:, 0]
        for a in range(1, len(s.tokens) - 1):
            anchors += 1
            k = 1
            while k < 7 and a + k < len(own) and own[a + k - 1]:
                k += 1
            labels += k
    row = {"passages": args.passages, "tokens": read[0], "tokens_per_s": read[0] / wall,
           "tokens_per_cpu_s": read[0] / cpu, "tokens_per_hour": read[0] / wall * 3600,
           "exact_labels_per_anchor": labels / anchors}
    print(f"passages: {read[0]} tokens read, {row['tokens_per_s']:6.1f} tok/s ({row['tokens_per_hour'] / 1e3:.0f} "
          f"k/hour), {row['tokens_per_cpu_s']:6.1f} tok per CPU-s, {labels / anchors:.2f} exact labels of 7 per "
          f"anchor", flush=True)
    return row


def time_training(target, work: Path, data: Path, args) -> dict:
    from dflash_local.train.run import Trainer, TrainConfig

    run = work / "run"
    shutil.copytree(data, run / "data")
    cfg = TrainConfig(target=str(target), out=str(run), n_layer=2, target_layers=LAYERS, block_size=8,
                      draft_vocab=8192, samples=args.samples, max_new=args.max_new, steps=args.steps, eval_every=0,
                      save_every=10**9, placement={"n_threads": args.threads})
    Trainer(cfg, log=lambda m: None).run()
    rate = json.loads((run / "train.log.jsonl").read_text().splitlines()[-1])["steps_per_s"]  # the last 50 steps
    predicted = cfg.batch * cfg.anchors * (cfg.block_size - 1)  # block positions per step
    row = {"steps": args.steps, "steps_per_s": rate, "predicted_tokens_per_s": rate * predicted,
           "predicted_tokens_per_hour": rate * predicted * 3600}
    print(f"train: {rate:.2f} steps/s, {rate * predicted:.0f} predicted tokens/s "
          f"({rate * predicted * 3600 / 1e3:.0f} k/hour)", flush=True)
    return row


if __name__ == "__main__":
    main()
