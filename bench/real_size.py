"""Benchmark: what a CPU user of a real-size model gets. Verify cost T(1..16) and end-to-end speedup on targets with the
exact shapes of Qwen3-1.7B and Qwen3-8B, with drafts at a published DFlash acceptance profile.

    python bench/real_size.py --shape qwen3-1.7b [--tau 3.43 6.72] [-t 2] [--workdir /tmp/dflash-real-size]
        [--llama-bin .llama-server/bin] [--out bench/results/real-size-qwen3-1.7b.json]

The target: random weights at the model's shapes (hidden size, layers, heads, FFN, the 151,936-token vocabulary,
tied or untied head), written as an f16 GGUF with the tests' tokenizer padded to that vocabulary, then quantized to
Q4_K_M by llama.cpp's own llama-quantize (scripts/build-llama-server.sh builds it); kept in --workdir for later runs.
Random weights cost what trained ones do: every matmul has the same shapes and types.

The drafts: no trained drafter exists for a random target, so a scripted drafter proposes the target's own greedy
continuation and plants one error per draft at a geometric position, with the continuation probability q chosen so
that a full block of 16 (15 drafts) has the mean acceptance length tau. The default taus are the published z-lab
Qwen3-4B-DFlash-b16 drafter's on MT-Bench (3.43, chat) and HumanEval (6.72, code), block 16, greedy, as measured on
an SGLang harness and published in the Hugging Face dataset card seliny2/qwen3-4b-dflash-data ("z-lab M0" row).
The engine loads an untrained 1-layer DFlash drafter at the target's shapes (`dflash-local init-drafter`), whose
drafts the scripted ones replace; its measured draft step (the cost a trained drafter of that shape has) is added to
every step for the "with draft cost" figures (a bound from below for the adaptive policy, which drafts on fewer steps).
Every output is checked against plain decoding.

Also measured: upstream's own batch cost on the same file, `llama-bench -p 1,2,..,16 -n 0` (its default kernels:
repacked weights, llamafile sgemm, tiled K-quants), when --llama-bin has llama-bench.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import CHATML_TEMPLATE, _add_tokenizer, build_tokenizer  # noqa: E402

from dflash_local import Engine  # noqa: E402
from dflash_local.atomic import atomic_output  # noqa: E402
from dflash_local.bench import load_prompts, row_request, verify_cost_curve  # noqa: E402
from dflash_local.convert.init_drafter import init_drafter  # noqa: E402
from dflash_local.convert.gguf_out import add_model_hparams  # noqa: E402
from dflash_local.engine.drafter import Drafter  # noqa: E402
from dflash_local.engine.placement import Placement  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Hugging Face config.json of Qwen/Qwen3-1.7B and Qwen/Qwen3-8B
SHAPES = {
    "qwen3-1.7b": dict(n_embd=2048, n_ff=6144, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, tied=True),
    "qwen3-8b": dict(n_embd=4096, n_ff=12288, n_layer=36, n_head=32, n_head_kv=8, head_dim=128, tied=False),
}
N_VOCAB = 151936
BLOCK = 16


def write_f16_target(path: Path, shape: dict, seed: int = 0) -> None:
    """A qwen3 GGUF at `shape` with random f16 weights, written tensor by tensor (an 8B model never sits in memory)."""
    tok = build_tokenizer()
    n_pad = N_VOCAB - len(tok["tokens"])
    tok["tokens"] += [f"<|unused_{i}|>" for i in range(n_pad)]
    tok["types"] += [int(gguf.TokenType.UNUSED)] * n_pad
    e, f, hd = shape["n_embd"], shape["n_ff"], shape["head_dim"]
    q, kv = shape["n_head"] * hd, shape["n_head_kv"] * hd
    tensors = [("token_embd.weight", (N_VOCAB, e), 1.0, "embd")]
    for i in range(shape["n_layer"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (e,), 0, "norm"), (p + "attn_q.weight", (q, e), 1, "lin"),
                    (p + "attn_k.weight", (kv, e), 1, "lin"), (p + "attn_v.weight", (kv, e), 1, "lin"),
                    (p + "attn_output.weight", (e, q), 2, "lin"), (p + "attn_q_norm.weight", (hd,), 0, "norm"),
                    (p + "attn_k_norm.weight", (hd,), 0, "norm"), (p + "ffn_norm.weight", (e,), 0, "norm"),
                    (p + "ffn_gate.weight", (f, e), 1, "lin"), (p + "ffn_up.weight", (f, e), 1, "lin"),
                    (p + "ffn_down.weight", (e, f), 2, "lin")]
    tensors.append(("output_norm.weight", (e,), 0, "norm"))
    if not shape["tied"]:
        tensors.append(("output.weight", (N_VOCAB, e), 4, "lin"))
    rng = np.random.default_rng(seed)

    def make(shp, gain, kind):
        if kind == "norm":  # f32, as llama.cpp's converter keeps norms
            return (1.0 + 0.1 * rng.standard_normal(shp, dtype=np.float32)).astype(np.float32)
        scale = 1.0 if kind == "embd" else gain / math.sqrt(shp[1])
        return (rng.standard_normal(shp, dtype=np.float32) * scale).astype(np.float16)

    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(tmp, "qwen3")
        w.add_name(f"random-{path.stem}")
        add_model_hparams(w, n_ctx=40960, n_embd=e, n_ff=f, n_layer=shape["n_layer"], n_head=shape["n_head"],
                          n_head_kv=shape["n_head_kv"], head_dim=hd, rms_eps=1e-6, rope_theta=1e6)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        _add_tokenizer(w, tok, CHATML_TEMPLATE)
        for name, shp, _, kind in tensors:
            dtype = np.float32 if kind == "norm" else np.float16
            w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for k, (name, shp, gain, kind) in enumerate(tensors):
            w.write_tensor_data(make(shp, gain, kind))
            print(f"\rwriting {path.name}: {k + 1}/{len(tensors)} tensors", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        w.close()


def target_file(shape_name: str, workdir: Path, llama_bin: Path) -> Path:
    """The Q4_K_M target, made once: the f16 GGUF, then llama-quantize."""
    q4 = workdir / f"{shape_name}-random-q4_k_m.gguf"
    if q4.exists():
        return q4
    workdir.mkdir(parents=True, exist_ok=True)
    f16 = workdir / f"{shape_name}-random-f16.gguf"
    if not f16.exists():
        write_f16_target(f16, SHAPES[shape_name])
    quantize = llama_bin / "llama-quantize"
    if not quantize.exists():
        sys.exit(f"error: {quantize} not found: bash scripts/build-llama-server.sh builds it")
    with atomic_output(q4) as tmp:
        r = subprocess.run([str(quantize), str(f16), str(tmp), "Q4_K_M"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"error: llama-quantize failed:\n{r.stderr[-2000:]}")
    f16.unlink()  # only the quantized file is read from here on
    return q4


def continuation_probability(tau: float, n_draft: int = BLOCK - 1) -> float:
    """q such that sum_{i=1..n_draft} q^i = tau - 1: each draft is right with probability q given the ones before."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        if sum(q ** i for i in range(1, n_draft + 1)) < tau - 1:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


class ProfileDrafter(Drafter):
    """Proposes the known greedy continuation with its first error at a geometric position (right with probability q
    given the drafts before): mean acceptance length tau for full blocks. Its cost is not the engine's to measure."""

    def __init__(self, n_prompt: int, continuation: list[int], n_vocab: int, q: float, seed: int):
        self.n_prompt, self.continuation, self.n_vocab, self.q = n_prompt, continuation, n_vocab, q
        self.rng = random.Random(seed)

    def draft(self, tokens: list[int], n: int) -> list[int]:
        j = len(tokens) - self.n_prompt
        draft = list(self.continuation[j:j + n])
        draft += [0] * (n - len(draft))
        right = 0
        while right < n and self.rng.random() < self.q:
            right += 1
        if right < n:
            draft[right] = (draft[right] + 1) % self.n_vocab
        return draft


def llama_bench_curve(llama_bin: Path, model: Path, threads: int) -> dict | None:
    """Upstream's batch cost T(k) in ms on the same file (llama-bench -p 1..16 -n 0, its default kernels)."""
    exe = llama_bin / "llama-bench"
    if not exe.exists():
        return None
    sizes = ",".join(str(k) for k in range(1, BLOCK + 1))
    r = subprocess.run([str(exe), "-m", str(model), "-t", str(threads), "-p", sizes, "-n", "0", "-r", "3", "-o",
                        "json"], capture_output=True, text=True, check=True)
    return {int(x["n_prompt"]): x["avg_ns"] / 1e6 for x in json.loads(r.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--tau", type=float, nargs="+", default=[3.43, 6.72])
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help="prompts of bench/prompts.jsonl (default 3)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dflash-real-size"))
    ap.add_argument("--llama-bin", type=Path, default=ROOT / ".llama-server" / "bin")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    model = target_file(args.shape, args.workdir, args.llama_bin)
    drafter = args.workdir / f"{args.shape}-untrained-dflash.gguf"
    if not drafter.exists():
        n_layer = SHAPES[args.shape]["n_layer"]
        init_drafter(drafter, model, n_layer=1, target_layers=sorted({1, n_layer // 2, n_layer - 2}), block_size=BLOCK)
    placement = Placement(n_threads=args.threads)
    e = Engine(model, drafter, n_ctx=2048, placement=placement)
    print(f"{model.name}: {model.stat().st_size / 2**30:.2f} GiB, {placement.threads} threads", file=sys.stderr)
    curve = verify_cost_curve(e, BLOCK, repeats=3)
    print("T(k) ms:", " ".join(f"{k}:{v:.0f}" for k, v in curve.items()), file=sys.stderr)
    upstream = llama_bench_curve(args.llama_bin, model, placement.threads)
    rows = [row_request(r) for r in load_prompts(ROOT / "bench" / "prompts.jsonl")[:args.prompts]]
    plain_s = plain_tokens = 0
    plain = []
    for kw in rows:
        base = e.complete(**kw, max_tokens=args.max_tokens, draft=False)
        plain.append(base)
        plain_s += len(base.token_ids) / base.summary.tokens_per_second
        plain_tokens += len(base.token_ids)
    plain_speed = plain_tokens / plain_s
    # the drafter's own step at this shape (its drafts are random; only the time counts)
    e.draft_policy = "fixed"
    own = e.complete(**rows[0], max_tokens=16)
    draft_ms = own.summary.draft_ms / own.summary.steps
    results = []
    for tau in args.tau:
        q = continuation_probability(tau)
        for policy in ("auto", "fixed"):
            e.draft_policy = policy
            secs = toks = steps = 0
            for i, (kw, base) in enumerate(zip(rows, plain)):
                d = ProfileDrafter(len(e.prompt_tokens(**kw)), base.token_ids, e.target.n_vocab, q, seed=i)
                t0 = time.perf_counter()
                spec = e.complete(**kw, max_tokens=args.max_tokens, external_drafter=d)
                assert spec.token_ids == base.token_ids, "output differs from plain decoding"
                secs += len(spec.token_ids) / spec.summary.tokens_per_second
                toks += len(spec.token_ids)
                steps += spec.summary.steps
                print(f"tau {tau} {policy} prompt {i + 1}: {spec.summary.tokens_per_second:.2f} tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            with_draft = toks / (secs + steps * draft_ms / 1000)
            results.append({"tau": tau, "q": q, "policy": policy, "tokens_per_second": toks / secs,
                            "speedup": (toks / secs) / plain_speed, "speedup_with_draft_cost": with_draft / plain_speed,
                            "tokens_per_step": toks / steps if steps else None, "lossless": True})
    report = {"shape": args.shape, **SHAPES[args.shape], "n_vocab": N_VOCAB, "model": model.name,
              "threads": placement.threads, "max_tokens": args.max_tokens, "prompts": len(rows),
              "plain_tokens_per_second": plain_speed, "verify_ms": curve, "draft_ms_per_step": draft_ms,
              "llama_bench_ms": upstream, "rows": results,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with atomic_output(args.out) as tmp:
            Path(tmp).write_text(text + "\n")


if __name__ == "__main__":
    main()
