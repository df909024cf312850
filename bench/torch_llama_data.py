"""Training data for a drafter of a llama-architecture target, made by PyTorch on a GPU (how the first SmolLM2
drafter's data was made, docs/measurements.md#on-an-nvidia-h100): the same samples as `dflash-local train`'s data
stage (train/data.py's format and meta.json, sample i from prompt i), but decoded by a plain PyTorch llama over the
GGUF's dequantized weights, with hundreds of answers side by side. That is not llama.cpp's arithmetic (its matmuls
quantize activations), so features and answers differ from the engine's by rounding: fine for training data, never
for verification.

Two steps, because the GPU machine has no llama.cpp:
  here:   python bench/torch_llama_data.py prepare -m TARGET.gguf --corpus C.jsonl -n N --chat -o PROMPTS.npz
          (the corpus's first N prompts in train's order, rendered by the chat template and tokenized by llama.cpp)
  there:  PYTHONPATH=. python bench/torch_llama_data.py make -m TARGET.gguf --prompts PROMPTS.npz -o RUN/data
          --layers 2,15,28 --max-new 256 --temp 0.8 --seconds 300
(PYTHONPATH=.: the source tree, where dflash-local is not installed; `make` needs no llama.cpp), then
`dflash-local train -o RUN --corpus C.jsonl --chat --data-temp 0.8 --samples S ...` trains on them.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dflash_local.atomic import atomic_output
from dflash_local.train.data import TOP_K, Sample, data_meta, sample_path, save_sample, to_bf16

N_PROMPT_MAX = 256  # as make_data's default


def prepare(args) -> None:
    from dflash_local import _native
    from dflash_local.train.corpus import training_prompts
    from dflash_local.train.data import chat_texts

    prompts = training_prompts(args.corpus, 0, chat=args.chat)[: args.n]
    model = _native.Model(args.target, n_gpu_layers=0)
    texts = chat_texts(args.target, model, dict(enumerate(prompts))) if args.chat else dict(enumerate(prompts))
    ids = [model.tokenize(texts[i], True, args.chat)[:N_PROMPT_MAX] for i in range(len(prompts))]
    eog = [t for t in range(model.n_vocab) if model.is_eog(t)]
    np.savez_compressed(args.out, prompts=np.array(prompts), lengths=np.array([len(x) for x in ids]),
                        tokens=np.concatenate([np.asarray(x, dtype=np.int32) for x in ids]),
                        eog=np.array(eog, dtype=np.int32), chat=args.chat)
    print(f"{len(prompts)} prompts, {sum(map(len, ids))} tokens, end-of-generation tokens {eog}")


class Llama:
    """A llama decoder over a GGUF's dequantized weights, with a left-padded batch KV cache."""

    def __init__(self, path: str, device: str):
        import torch

        from dflash_local.engine.torch_drafter import _dequantized
        from dflash_local.gguf_file import read_gguf

        info = read_gguf(path)
        if info.arch != "llama":
            raise SystemExit(f"{path}: a {info.arch} model; this script decodes llama only")
        kv = info.kv
        self.n_layer = kv["llama.block_count"]
        self.n_head, self.n_head_kv = kv["llama.attention.head_count"], kv["llama.attention.head_count_kv"]
        self.n_embd = kv["llama.embedding_length"]
        self.head_dim = self.n_embd // self.n_head
        self.eps = kv["llama.attention.layer_norm_rms_epsilon"]
        theta = kv.get("llama.rope.freq_base", 10000.0)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)

        def w(name):
            return torch.from_numpy(np.array(_dequantized(info, name), dtype=np.float32)).to(device)

        self.embd = w("token_embd.weight")
        self.head = w("output.weight") if "output.weight" in info.tensors else self.embd
        self.out_norm = w("output_norm.weight")
        self.blocks = [{k: w(f"blk.{i}.{k}.weight") for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
                       for i in range(self.n_layer)]
        self.device = device

    def norm(self, x, weight):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, pos):
        # llama.cpp's "normal" rope over the GGUF's (permuted) q/k: adjacent pairs rotate together
        import torch

        ang = pos[..., None].float() * self.inv_freq  # [B, T, D/2]
        cos, sin = torch.cos(ang)[:, :, None], torch.sin(ang)[:, :, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)

    def forward(self, tokens, pos, cache, col: int, mask, capture: list[int]):
        """tokens/pos [B, T] at cache columns col..col+T; mask [B, T, col+T] (True: attend). Returns the
        top TOP_K (log-probabilities, ids) [B, T, TOP_K] and the captured layer inputs [B, T, len(capture) * n_embd]."""
        import torch
        import torch.nn.functional as F

        B, T = tokens.shape
        x = self.embd[tokens]
        feats = {}
        for i, b in enumerate(self.blocks):
            if i in capture:
                feats[i] = x
            h = self.norm(x, b["attn_norm"])
            q = self.rope((h @ b["attn_q"].T).view(B, T, self.n_head, self.head_dim), pos)
            k = self.rope((h @ b["attn_k"].T).view(B, T, self.n_head_kv, self.head_dim), pos)
            v = (h @ b["attn_v"].T).view(B, T, self.n_head_kv, self.head_dim)
            cache[i][0][:, :, col : col + T] = k.transpose(1, 2)
            cache[i][1][:, :, col : col + T] = v.transpose(1, 2)
            keys, vals = cache[i][0][:, :, : col + T], cache[i][1][:, :, : col + T]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask[:, None],
                                               enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, -1) @ b["attn_output"].T
            h = self.norm(x, b["ffn_norm"])
            x = x + (F.silu(h @ b["ffn_gate"].T) * (h @ b["ffn_up"].T)) @ b["ffn_down"].T
        x = self.norm(x, self.out_norm).reshape(B * T, -1)
        top = [torch.log_softmax(x[r : r + 4096] @ self.head.T, -1).topk(TOP_K, -1) for r in range(0, B * T, 4096)]
        lp, ids = (torch.cat([t[j] for t in top]).view(B, T, TOP_K) for j in (0, 1))
        return lp, ids, torch.cat([feats[c] for c in capture], -1)


def decode_batch(m: Llama, prompts: list[list[int]], layers: list[int], max_new: int, eog, temps: list[float], gen):
    """Greedy (temperature 0) or sampled answers of a batch of prompts; returns per prompt (tokens, features,
    top_ids, top_logprobs) over its decoded positions, as make_data's samples hold them. Everything stays on the
    device until the batch ends (one host copy per batch; the end-of-answer check syncs every 8 steps)."""
    import torch

    B, P = len(prompts), max(map(len, prompts))
    dev = m.device
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    L = P + max_new
    tok = torch.zeros(B, L, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tok[b, P - len(p) : P] = torch.tensor(p, device=dev)
    cache = [[torch.zeros(B, m.n_head_kv, L, m.head_dim, device=dev) for _ in range(2)] for _ in range(m.n_layer)]
    width = len(layers) * m.n_embd
    feats = torch.zeros(B, L, width, dtype=torch.bfloat16, device=dev)
    top_lp = torch.zeros(B, L, TOP_K, device=dev)
    top_ids = torch.zeros(B, L, TOP_K, dtype=torch.long, device=dev)
    cols = torch.arange(L, device=dev)
    valid = cols[None] >= pad[:, None]  # [B, L]: a key column holds a real token
    # prefill: causal, real keys only (a padded query sees itself, so no row is empty)
    mask = (cols[None, :P, None] >= cols[None, None, :P]) & (valid[:, None, :P] | torch.eye(P, dtype=torch.bool,
                                                                                             device=dev))
    pos = (cols[None, :P] - pad[:, None]).clamp(min=0)
    top_lp[:, :P], top_ids[:, :P], f = m.forward(tok[:, :P], pos, cache, 0, mask, layers)
    feats[:, :P] = f.to(torch.bfloat16)
    is_eog = torch.zeros(m.embd.shape[0], dtype=torch.bool, device=dev)
    is_eog[list(eog)] = True
    temp = torch.tensor(temps, device=dev)
    n_new = torch.full((B,), max_new, device=dev)  # answer tokens kept: max_new unless it ends sooner
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    for t in range(max_new):
        col = P + t  # the column the new token goes to
        lp, ids = top_lp[:, col - 1], top_ids[:, col - 1]
        g = -torch.log(-torch.log(torch.rand(lp.shape, device=dev, generator=gen)))
        pick = torch.where(temp > 0, (lp / temp.clamp(min=1e-6)[:, None] + g).argmax(-1), 0)
        nxt = ids.gather(1, pick[:, None])[:, 0]
        ended = ~done & is_eog[nxt]
        n_new = torch.where(ended, t, n_new)
        done |= ended
        tok[:, col] = nxt
        if t % 8 == 7 and bool(done.all()):
            break
        if t == max_new - 1:  # the last token is never decoded
            break
        lp_, ids_, f = m.forward(nxt[:, None], (lengths + t)[:, None], cache, col, valid[:, None, : col + 1], layers)
        top_lp[:, col : col + 1], top_ids[:, col : col + 1], feats[:, col : col + 1] = lp_, ids_, f.to(torch.bfloat16)
    tok, feats, top_lp, top_ids, n_new = (x.cpu() for x in (tok, feats, top_lp, top_ids, n_new))
    res = []
    for b, p in enumerate(prompts):
        k = int(n_new[b])
        a, e = P - len(p), P + k  # the sample's tokens: columns a..e-1; rows for all but the last
        res.append((tok[b, a:e].tolist(), feats[b, a : e - 1].float().numpy(), top_ids[b, a : e - 1].numpy(),
                    top_lp[b, a : e - 1].numpy()))
    return res


def make(args) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    z = np.load(args.prompts)
    prompts, lengths, flat, eog = [str(x) for x in z["prompts"]], z["lengths"], z["tokens"], set(z["eog"].tolist())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    ids = [flat[starts[i]: starts[i + 1]].tolist() for i in range(len(prompts))]
    layers = [int(x) for x in args.layers.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = data_meta(args.target, layers, args.max_new, N_PROMPT_MAX, bool(z["chat"]), args.temp)
    with atomic_output(out / "meta.json") as tmp:  # as make_data writes it
        tmp.write_text(json.dumps(meta, indent=1))
    m = Llama(args.target, args.device)
    gen = torch.Generator(device=args.device).manual_seed(0)
    t0, made, i0 = time.perf_counter(), 0, 0
    writes, saved = ThreadPoolExecutor(4), []  # samples are written while the next batch decodes
    # batches of consecutive prompts, so the samples made are always 0..k-1 (train takes a prefix)
    while i0 < len(prompts) and time.perf_counter() - t0 < args.seconds:
        batch = list(range(i0, min(i0 + args.batch, len(prompts))))
        temps = [args.temp if i % 2 else 0.0 for i in batch]
        with torch.no_grad():
            res = decode_batch(m, [ids[i] for i in batch], layers, args.max_new, eog, temps, gen)
        for i, (toks, f, ti, tl) in zip(batch, res):
            s = Sample(np.asarray(toks, dtype=np.int32), len(ids[i]), to_bf16(f), prompts[i], ti.astype(np.int32),
                       tl.astype(np.float16))
            saved.append(writes.submit(save_sample, sample_path(out, i), s))
            made += len(toks) - len(ids[i])
        i0 = batch[-1] + 1
        print(f"samples 0-{i0 - 1}: {made} answer tokens, {made / (time.perf_counter() - t0):.0f} tokens/s",
              flush=True)
    for f in saved:
        f.result()  # a failed write fails the run
    print(f"made {i0} samples in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("-m", "--target", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("-n", type=int, required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("-o", "--out", required=True)
    p.set_defaults(func=prepare)
    k = sub.add_parser("make")
    k.add_argument("-m", "--target", required=True)
    k.add_argument("--prompts", required=True)
    k.add_argument("-o", "--out", required=True)
    k.add_argument("--layers", required=True)
    k.add_argument("--max-new", type=int, default=256)
    k.add_argument("--temp", type=float, default=0.0)
    k.add_argument("--batch", type=int, default=256)
    k.add_argument("--seconds", type=float, default=300)
    k.add_argument("--device", default="cuda")
    k.set_defaults(func=make)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
