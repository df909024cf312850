"""Each way of decoding on one engine at long context, the prompt decoded once and reused: plain, the default
(n-gram lookup + DFlash, adaptive), the n-gram lookup alone, DFlash alone. Prints, per prompt, each mode's decode
tok/s, the prompt tokens it reused and whether its output equals plain decoding's; then the default's steps by kind
(plain, n-gram, DFlash) and draft length: how many, the tokens they made and their mean verify milliseconds.

    python bench/modes_at_depth.py bench/long-prompts-12k.jsonl [-c 16384] [-n 256] [-t 2]
"""

import argparse
import json
from collections import defaultdict

from dflash_local import Engine
from dflash_local.engine.stats import StepStats
from dflash_local.engine.ngram import NgramSpec
from dflash_local import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", help="JSONL, one object per line with 'prompt'")
    ap.add_argument("-m", "--model", help="target GGUF or a built-in pair's name (default: the default pair; the "
                    "figures in docs/measurements.md: -m gemma)")
    ap.add_argument("-c", "--ctx-size", type=int, default=16384)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    e = Engine(*models.pair(a.model), n_ctx=a.ctx_size, n_threads=a.threads, ngram=NgramSpec())
    modes = [("plain", dict(draft=False)), ("default", {}),
             ("n-gram alone", dict(external_drafter=lambda tokens, n: [])), ("DFlash alone", dict(ngram=False))]
    for line in open(a.prompts):
        prompt = json.loads(line)["prompt"]
        e.complete(prompt, max_tokens=1, draft=False)  # the prompt once; the modes reuse it
        events = {name: list(e.generate(prompt, max_tokens=a.max_tokens, **kw)) for name, kw in modes}
        runs = {name: ev[-1] for name, ev in events.items()}  # Finished comes last
        plain = runs["plain"].token_ids
        print({name: (round(f.summary.tokens_per_second, 1), f.summary.n_cached, f.token_ids == plain)
               for name, f in runs.items()}, flush=True)
        kinds = defaultdict(list)
        for st in (ev for ev in events["default"] if isinstance(ev, StepStats)):
            kinds["n-gram" if st.ngram else "DFlash" if st.n_drafted else "plain", st.n_drafted].append(st)
        print("  default's steps:", "; ".join(
            f"{kind} {n}: {len(ss)} x, {sum(st.n_tokens for st in ss)} tokens, "
            f"{sum(st.verify_ms for st in ss) / len(ss):.1f} ms" for (kind, n), ss in sorted(kinds.items())), flush=True)


if __name__ == "__main__":
    main()
