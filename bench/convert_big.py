"""Benchmark: convert a drafter shaped like z-lab's Qwen3-4B DFlash drafter, then load it and draft in the engine.

    python bench/convert_big.py [--outtype q8_0] [--workdir /tmp/dflash-bench-convert] [--tokenizer gemma|tiny]

The drafter is synthetic (random weights) in z-lab's exact layout: hidden 2560, 5 layers, 32 query / 8 KV heads of
128, intermediate 9728, 5 target layers, BF16, 4 shards with an index json: 0.54 B parameters, 1.08 GB. The target is
a minimal qwen3 GGUF with the same hidden size and 36 thin layers (so z-lab's layer ids 1, 9, 17, 25, 33 exist),
carrying a real tokenizer: gemma-3's 262k-token one by default (its tied embeddings in Q4_0), or the tests' tiny one.

The conversion runs in a child process; its wall time and peak resident memory (VmHWM) are reported.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zlab import write_checkpoint, zlab_config

from dflash_local.convert.gguf_out import tokenizer_kv, write_gguf_atomic

HIDDEN, TARGET_LAYERS = 2560, 36
LAYER_IDS = [1, 9, 17, 25, 33]  # z-lab's defaults for a 36-layer target and 5 drafter layers


def write_target(path: Path, tokenizer: str) -> tuple[int, int]:
    """A qwen3 target with hidden 2560 and 36 one-head layers; returns (n_vocab, mask token id)."""
    if tokenizer == "gemma":
        from dflash_local import models

        tok = tokenizer_kv(models.target("gemma"))  # picks gemma's <mask> as the mask token
    else:
        from fixtures import write_tiny_target

        tiny = write_tiny_target(path.parent / "tiny-tokenizer.gguf")
        tok = tokenizer_kv(tiny)
    n_vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    mask = next(v for k, v, *_ in tok if k == "tokenizer.ggml.mask_token_id")
    rng = np.random.default_rng(0)
    hd = 64

    def fill(w):
        w.add_name("bench-target-2560")
        w.add_context_length(4096)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(64)
        w.add_block_count(TARGET_LAYERS)
        w.add_head_count(1)
        w.add_head_count_kv(1)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(1000000.0)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        for key, value, vtype, sub in tok:
            w.add_key_value(key, value, vtype, sub)
        # tied embeddings (also the LM head), Q4_0 to keep 262k x 2560 at 360 MiB; made a slab at a time
        q = gguf.GGMLQuantizationType.Q4_0
        row = HIDDEN // 32 * 18
        embd = np.empty((n_vocab, row), np.uint8)
        for r0 in range(0, n_vocab, 8192):
            r1 = min(n_vocab, r0 + 8192)
            embd[r0:r1] = gguf.quants.quantize(rng.standard_normal((r1 - r0, HIDDEN), dtype=np.float32), q)
        w.add_tensor("token_embd.weight", embd, raw_dtype=q)  # byte rows; gguf derives the element shape

        def lin(n_out, n_in, gain=1.0):
            return (rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(gain / np.sqrt(n_in)))

        for i in range(TARGET_LAYERS):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
            w.add_tensor(p + "attn_q.weight", lin(hd, HIDDEN))
            w.add_tensor(p + "attn_k.weight", lin(hd, HIDDEN))
            w.add_tensor(p + "attn_v.weight", lin(hd, HIDDEN))
            w.add_tensor(p + "attn_output.weight", lin(HIDDEN, hd, 0.3))
            w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
            w.add_tensor(p + "ffn_gate.weight", lin(64, HIDDEN))
            w.add_tensor(p + "ffn_up.weight", lin(64, HIDDEN))
            w.add_tensor(p + "ffn_down.weight", lin(HIDDEN, 64, 0.3))
        w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))

    write_gguf_atomic(path, "qwen3", fill)
    return n_vocab, mask


def _peak_rss_code(body: str) -> str:
    # VmHWM is the peak resident size of this process's own address space; ru_maxrss of a child would also count
    # the parent's pages it was forked from
    return body + (
        "for line in open('/proc/self/status'):\n"
        "    if line.startswith('VmHWM:'):\n"
        "        print('PEAK_RSS_KB', line.split()[1], file=sys.stderr)\n"
    )


def _run_child(code: str, argv: list[str], cwd) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *argv], check=False, cwd=cwd, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    peak = 0
    for line in proc.stderr.splitlines():
        if line.startswith("PEAK_RSS_KB"):
            peak = int(line.split()[1]) * 1024
        else:
            print(line.rsplit("\r", 1)[-1], file=sys.stderr)  # the last state of the progress bar
    return wall, peak, proc.returncode


def convert_in_child(ckpt: Path, target: Path, out: Path, outtype: str) -> tuple[float, int, int]:
    """Run the conversion in a fresh process; return (wall seconds, peak RSS bytes, exit code)."""
    code = _peak_rss_code(
        "import sys\n"
        "from dflash_local.convert.hf_to_gguf import convert_drafter\n"
        "r = convert_drafter(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], progress=True)\n"
        "print(f'{r.n_params} parameters, {r.size_bytes} bytes, {r.n_tensors} tensors', file=sys.stderr)\n"
    )
    # run from the output folder: a child started in a source checkout would import the uninstalled package
    return _run_child(code, [str(ckpt), str(target), str(out), outtype], out.parent)


def baseline_rss() -> int:
    """Peak RSS of a child that only imports the converter: the interpreter, numpy and gguf."""
    return _run_child(_peak_rss_code("import sys\nimport dflash_local.convert.hf_to_gguf\n"), [], "/")[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/dflash-bench-convert")
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--tokenizer", choices=["gemma", "tiny"], default="gemma")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--no-engine", action="store_true", help="skip loading the result in the engine")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)

    target = work / f"target-2560-{args.tokenizer}.gguf"
    if not target.exists():
        t0 = time.perf_counter()
        n_vocab, mask = write_target(target, args.tokenizer)
        print(f"target: {target} ({target.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)")
    from dflash_local.gguf_file import read_gguf

    ti = read_gguf(target)
    n_vocab, mask = ti.n_vocab, ti.kv["tokenizer.ggml.mask_token_id"]

    ckpt = work / f"Qwen3-4B-DFlash-synthetic-{n_vocab}"
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        cfg = zlab_config(hidden=HIDDEN, n_layer=5, n_head=32, n_kv=8, head_dim=128, n_ff=9728,
                          target_layer_ids=LAYER_IDS, num_target_layers=TARGET_LAYERS, vocab_size=n_vocab,
                          mask_token_id=mask, block_size=16)
        write_checkpoint(ckpt, cfg, n_shards=args.shards, dtype="BF16")
        print(f"checkpoint: {ckpt} ({time.perf_counter() - t0:.1f} s)")
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    shards = len(list(ckpt.glob("*.safetensors")))
    print(f"checkpoint: {size / 1e9:.2f} GB BF16 in {shards} shards")

    out = work / f"drafter-{args.outtype}.gguf"
    out.unlink(missing_ok=True)
    base = baseline_rss()
    wall, peak, rc = convert_in_child(ckpt, target, out, args.outtype)
    if rc != 0:
        print(f"conversion failed (exit {rc})")
        return 1
    print(
        f"convert -> {args.outtype}: {wall:.1f} s wall, peak RSS {peak / 2**20:.0f} MiB "
        f"(a child that only imports the converter: {base / 2**20:.0f} MiB), "
        f"output {out.stat().st_size / 2**20:.0f} MiB"
    )

    if not args.no_engine:
        from dflash_local import Engine

        t0 = time.perf_counter()
        engine = Engine(target, out, n_ctx=256, block_size=8)
        load = time.perf_counter() - t0
        prompt = "The history of the printing press"
        spec = engine.complete(prompt, max_tokens=12)
        base_run = engine.complete(prompt, max_tokens=12, draft=False)
        s = spec.summary
        print(
            f"engine: loaded in {load:.1f} s; {s.steps} steps drafted {s.n_drafted} tokens "
            f"(draft {s.draft_ms / max(s.steps, 1):.0f} ms/step, verify {s.verify_ms / max(s.steps, 1):.0f} ms/step); "
            f"output identical to plain decoding: {spec.token_ids == base_run.token_ids}"
        )
        if not (s.n_drafted > 0 and spec.token_ids == base_run.token_ids):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
