"""Benchmark: what rolling back rejected drafts costs on a hybrid (Gated DeltaNet + attention) qwen35 target.

    python bench/rollback_cost.py [--n-embd 512] [--n-layer 8] [-n 256] [--workdir /tmp/dflash-bench-rollback]

The target is the tests' qwen35 builder at a larger shape (random weights, the tiny tokenizer); the drafts come from
the tests' scripted drafter (the plain continuation with one planted error per block, at a random position), so
every run rolls back the same tokens. Each run is checked against plain decoding. Reported per n_rs_seq: verify and
rollback milliseconds per step, rollback milliseconds per rolled-back step by path (snapshot, or checkpoint + replay).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import write_tiny_drafter, write_tiny_qwen35  # noqa: E402
from scripted import ScriptedDrafter  # noqa: E402

from dflash_local import Engine, StepStats  # noqa: E402

PROMPT = "def total(values):\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--workdir", default="/tmp/dflash-bench-rollback")
    args = ap.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    heads = args.n_embd // 64
    target = write_tiny_qwen35(work / "qwen35.gguf", n_embd=args.n_embd, n_layer=args.n_layer,
                               full_attention_interval=4, n_head=heads, n_head_kv=max(heads // 4, 1), head_dim=64,
                               n_ff=3 * args.n_embd, d_state=64, n_group=max(heads // 2, 1), n_v_heads=heads)
    drafter = write_tiny_drafter(work / "qwen35-drafter.gguf", target, target_layers=(1, args.n_layer - 1),
                                 block_size=8)
    print(f"target: qwen35, hidden {args.n_embd}, {args.n_layer} layers (every 4th attention), block 8")
    base = None
    for n_rs in (7, 3, 0):
        e = Engine(target, drafter, n_ctx=2048, n_threads=args.threads, draft_policy="fixed", n_rs_seq=n_rs)
        if base is None:
            base = e.complete(PROMPT, max_tokens=args.max_tokens, draft=False)
        sd = ScriptedDrafter(len(e.prompt_tokens(PROMPT)), base.token_ids, e.target.n_vocab, seed=3)
        events = list(e.generate(PROMPT, max_tokens=args.max_tokens, external_drafter=sd))
        steps = [ev for ev in events if isinstance(ev, StepStats)]
        done = events[-1]
        by = {k: [s.rollback_ms for s in steps if s.rollback == k] for k in ("snapshot", "checkpoint")}
        verify = statistics.median(s.verify_ms for s in steps)
        line = (f"n_rs_seq {n_rs} (llama.cpp keeps {e.session.n_rs_seq}): {len(steps)} steps, verify median "
                f"{verify:.2f} ms, rollback {done.summary.rollback_ms / len(steps):.3f} ms per step")
        for k, v in by.items():
            if v:
                line += f"; {k} x{len(v)}: median {statistics.median(v):.3f} ms"
        line += f"; lossless: {done.token_ids == base.token_ids}"
        print(line)


if __name__ == "__main__":
    main()
