"""The DFlash draft model in PyTorch, and a draft backend that runs it beside the llama.cpp target.

Semantics (as upstream llama.cpp's `dflash` graph and z-lab's reference): the target features of accepted positions
go through fc and hidden_norm; every layer caches their K/V (no input norm, RoPE at their positions). A noise block
[last token, mask x n] at the next positions is embedded with the target's embeddings; each layer attends from the
block to [cached context ; block] without a causal mask; the final norm and the target's LM head give the drafts.

DFlash2 (z-lab's DFlash2DraftModel) adds two things. Each layer wraps its attention and its MLP in a grouped dynamic
causal convolution over the block's positions: from the layer's normed input, a projection gives per-position kernel
corrections for both sides (one coefficient per group of channels and tap), which add to learned base kernels; the
input of the attention (MLP) is convolved with side 0, its output with side 1. And a candidate selector reads the
drafts: at each draft position the top_k tokens of the logits (after the logit scale and soft-capping) are scored
after each candidate of the previous position (the anchor token for the first), score = logit + the pairwise term
<predecessor codebook row * projected hidden, successor codebook row>; the draft is the greedy path through them.

DSpark (DFlash + a Markov head and an optional confidence head) reads its drafts from block slot 0 on (the anchor's
slot, "anchor-first"; some exports keep DFlash's layout, drafting from slot 1). Each slot's logits get a low-rank
bias from the previous draft token, markov_w2 @ markov_w1[prev] (prev: the anchor for the first slot, then the
argmax of the previous slot's biased logits), and the confidence head rates the slot's draft as
sigmoid(conf_proj . [final hidden ; markov_w1[prev]] + bias), as llama.cpp's graph computes them.

Weights are named the GGUF way (fc.weight, enc.output_norm.weight, blk.N.attn_q.weight, ...), so one loader serves
a z-lab checkpoint (renamed by the converter's reader) and a (dequantized) DFlash GGUF. Runs on cuda, mps or cpu.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..extras import needs_extra

with needs_extra("torch", "--draft-backend torch"):
    import torch
    import torch.nn.functional as F
    from torch import nn

from .drafter import Drafter
from ..gguf_file import read_gguf
from ..validate import check_checkpoint_pair


@dataclass
class DraftShape:
    """The graph the torch drafter builds, in GGUF terms (layer-input indices, the mask token to use): read from a
    drafter GGUF (shape_from_gguf) or from a checkpoint's DrafterConfig (convert/zlab_checkpoint.py), which stays a
    record of its own because it keeps the checkpoint's config as written (z-lab's names, output-layer ids, fields only
    conversion reads, None where the config is silent)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    target_layers: list[int]  # layer-input indices of the target
    block_size: int
    mask_token: int
    embedding_scale: float = 1.0
    causal: bool = False
    sliding_window: int | None = None  # keys at least this far before a query are not seen...
    swa_layers: list[bool] | None = None  # ...in these layers (None: all)
    logit_scale: float = 1.0  # DFlash2 applies these to the logits its selector reads
    logit_softcap: float = 0.0
    conv_group_size: int = 0  # DFlash2; 0 for DFlash
    selector_top_k: int = 0
    anchor_first: bool = False  # DSpark: block slot 0 drafts too


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NEOX-style rotary embedding (rotate halves), as Qwen3 and llama.cpp's dflash graph. x: [T, heads, dim]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [T, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def grouped_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """DFlash2's convolution over a block's positions. x [..., n, H]; dynamic [..., n, K, H / group], the output
    position's corrections per tap and channel group; base [K, H]. out[t] = sum over taps o <= t of
    (base[o] + dynamic[t, o]) * x[t - o]: positions before the block's first read as zeros. Leading dimensions are
    separate blocks."""
    w = base + dynamic.repeat_interleave(group, dim=-1)  # [..., n, K, H]
    n = x.shape[-2]
    out = torch.zeros_like(x)
    for o in range(min(base.shape[0], n)):
        out[..., o:, :] += w[..., o:, o, :] * x[..., : n - o, :]
    return out


class DFlashDrafter(nn.Module):
    def __init__(self, shape: DraftShape, weights: dict[str, np.ndarray]):
        super().__init__()
        self.shape = shape

        def p(name):
            return nn.Parameter(torch.tensor(np.asarray(weights[name], dtype=np.float32)))

        self.fc = p("fc.weight")
        self.hidden_norm = p("enc.output_norm.weight")
        self.norm = p("output_norm.weight")
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down"]
        self.layers = nn.ModuleList()
        for i in range(shape.n_layer):
            layer = nn.ParameterDict({n: p(f"blk.{i}.{n}.weight") for n in names})
            self.layers.append(layer)
        # a reduced draft vocabulary: its own LM head rows and their target token ids
        self.lm_head = p("output.weight") if "output.weight" in weights else None
        d2t = torch.tensor(np.asarray(weights["d2t"], dtype=np.int64)) if "d2t" in weights else None
        self.register_buffer("d2t", d2t)
        self.selector = None
        if "selector_hidden.weight" in weights:  # DFlash2
            for i, layer in enumerate(self.layers):
                layer.update({n: p(f"blk.{i}.{n}") for n in ("attn_conv_base", "ffn_conv_base")})
                layer.update({n: p(f"blk.{i}.{n}.weight") for n in ("attn_conv_proj", "ffn_conv_proj")})
            self.selector = nn.ParameterDict({n: p(f"selector_{n}.weight")
                                              for n in ("predecessor", "successor", "hidden")})
        self.markov = None
        if "markov_w1.weight" in weights:  # DSpark: w1 [vocab, rank], w2 [draft vocab, rank], conf [1, hidden + rank]
            names = {"w1": "markov_w1.weight", "w2": "markov_w2.weight", "conf": "conf_proj.weight",
                     "conf_bias": "conf_proj.bias"}
            self.markov = nn.ParameterDict({k: p(n) for k, n in names.items() if n in weights})

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """The weights under their GGUF names (the inverse of the constructor), as float32 numpy (d2t as ids)."""
        out = {"fc.weight": self.fc, "enc.output_norm.weight": self.hidden_norm, "output_norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            out.update({f"blk.{i}.{n}" + ("" if n.endswith("_base") else ".weight"): w for n, w in layer.items()})
        if self.selector is not None:
            out.update({f"selector_{n}.weight": w for n, w in self.selector.items()})
        if self.markov is not None:
            names = {"w1": "markov_w1.weight", "w2": "markov_w2.weight", "conf": "conf_proj.weight",
                     "conf_bias": "conf_proj.bias"}
            out.update({names[k]: w for k, w in self.markov.items()})
        if self.lm_head is not None:
            out["output.weight"] = self.lm_head
        out = {n: w.detach().float().cpu().numpy() for n, w in out.items()}
        if self.d2t is not None:
            out["d2t"] = self.d2t.cpu().numpy()
        return out

    def context_kv(self, features: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of context positions, per layer, from the target features [T, n_layers * target_hidden]."""
        s = self.shape
        g = rms_norm(features @ self.fc.T, self.hidden_norm, s.rms_eps)
        out = []
        for L in self.layers:
            k = rms_norm((g @ L["attn_k"].T).view(-1, s.n_head_kv, s.head_dim), L["attn_k_norm"], s.rms_eps)
            v = (g @ L["attn_v"].T).view(-1, s.n_head_kv, s.head_dim)
            out.append((rope(k, pos, s.rope_theta), v))
        return out

    def conv(self, L, side: str, h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFlash2: convolve a sublayer's normed input (kernel side 0) in blocks of `block` rows; return it and the
        output side's kernels."""
        if self.selector is None:
            return h, None
        k, g = L[f"{side}_conv_base"].shape[1], self.shape.conv_group_size
        blocks = h.view(-1, block, h.shape[-1])
        dynamic = (blocks @ L[f"{side}_conv_proj"].T).view(*blocks.shape[:2], 2, k, -1)
        out = grouped_causal_conv(blocks, dynamic[:, :, 0], L[f"{side}_conv_base"][0], g)
        return out.view_as(h), dynamic[:, :, 1]

    def conv_out(self, L, side: str, y: torch.Tensor, dynamic: torch.Tensor | None) -> torch.Tensor:
        if dynamic is None:
            return y
        blocks = y.view(*dynamic.shape[:2], y.shape[-1])
        out = grouped_causal_conv(blocks, dynamic, L[f"{side}_conv_base"][1], self.shape.conv_group_size)
        return out.view_as(y)

    def forward(self, noise: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                attn_mask: torch.Tensor | None = None, block: int | None = None):
        """Hidden states of the noise block. noise: [n, hidden] embeddings; ctx: per-layer cached (K, V).
        attn_mask [n, len(ctx) + n] (True = attend) lets training run many blocks at once; None = all of ctx.
        A DFlash2 drafter's convolutions run over blocks of `block` rows (None: the whole input is one block)."""
        s = self.shape
        x = noise
        n = x.shape[0]
        block = block or n
        window = None
        if s.sliding_window and attn_mask is None:  # drafting: the context holds positions 0 .. m - 1
            key_pos = torch.cat([torch.arange(ctx[0][0].shape[0], device=x.device), pos])
            window = (pos[:, None] - key_pos[None, :]) < s.sliding_window
        for i, (L, (ck, cv)) in enumerate(zip(self.layers, ctx)):
            h, attn_dyn = self.conv(L, "attn", rms_norm(x, L["attn_norm"], s.rms_eps), block)
            q = rope(rms_norm((h @ L["attn_q"].T).view(n, s.n_head, s.head_dim), L["attn_q_norm"], s.rms_eps),
                     pos, s.rope_theta)
            k = rope(rms_norm((h @ L["attn_k"].T).view(n, s.n_head_kv, s.head_dim), L["attn_k_norm"], s.rms_eps),
                     pos, s.rope_theta)
            v = (h @ L["attn_v"].T).view(n, s.n_head_kv, s.head_dim)
            k, v = torch.cat([ck, k]), torch.cat([cv, v])
            rep = s.n_head // s.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = attn_mask
            if window is not None and (s.swa_layers is None or s.swa_layers[i]):
                mask = window
            if s.causal:  # a causal drafter still sees the whole context
                m = k.shape[0] - n
                causal = torch.ones(n, m + n, dtype=torch.bool, device=x.device).tril(m)
                mask = causal if mask is None else mask & causal
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=1.0 / math.sqrt(s.head_dim))
            x = x + self.conv_out(L, "attn", a.transpose(0, 1).reshape(n, -1) @ L["attn_output"].T, attn_dyn)
            h, ffn_dyn = self.conv(L, "ffn", rms_norm(x, L["ffn_norm"], s.rms_eps), block)
            x = x + self.conv_out(L, "ffn", (F.silu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T,
                                  ffn_dyn)
        return rms_norm(x, self.norm, s.rms_eps)

    def selector_lattice(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, top_k: int):
        """DFlash2's lattice for draft positions 1..n. hidden [n, H] (final-normed), logits [n, V] (scaled and
        capped). Returns the candidates [n, k] and the scores [n, k, k]: scores[i, p, j] that of candidate j at
        position i after candidate p of position i - 1 (after the anchor at i = 0, the same for every p)."""
        unary, cand = torch.topk(logits, top_k, dim=-1)
        gate = hidden @ self.selector["hidden"].T  # [n, R]
        prev = torch.cat([torch.full((1, top_k), anchor, device=cand.device), cand[:-1]])  # [n, k]
        pred = self.selector["predecessor"][prev] * gate[:, None, :]  # [n, k, R]
        pair = torch.einsum("npr,njr->npj", pred, self.selector["successor"][cand])
        return cand, unary[:, None, :] + pair

    def markov_chain(self, hidden: torch.Tensor, base: torch.Tensor, anchor: int, d2t: torch.Tensor | None,
                     given: list[int] | None = None):
        """DSpark: the biased logits [n, V] of the n slots and their confidences [n] (None without a confidence
        head), from the slots' final hidden states [n, H] and unbiased logits [n, V]. Each slot's bias follows the
        previous slot's argmax, or the previous of the `given` drafts (to compare slot by slot with another run)."""
        m = self.markov
        prev, rows, conf = anchor, [], []
        for i in range(base.shape[0]):
            emb = m["w1"][prev]
            bias = m["w2"] @ emb
            if d2t is not None:  # a reduced draft vocabulary: the bias lands on the target rows its drafts map to
                bias = torch.zeros(base.shape[1], dtype=base.dtype, device=base.device).index_copy(0, d2t, bias)
            rows.append(base[i] + bias)
            if "conf" in m:
                z = m["conf"][0] @ torch.cat([hidden[i], emb])
                conf.append(torch.sigmoid(z + m["conf_bias"][0] if "conf_bias" in m else z))
            prev = int(rows[-1].argmax()) if given is None else given[i]
        return torch.stack(rows), torch.stack(conf) if conf else None

    @staticmethod
    def walk(cand: torch.Tensor, scores: torch.Tensor) -> tuple[list[int], list[float]]:
        """The greedy path through a lattice: the draft tokens and the selector's probability of each."""
        tokens, probs, prev = [], [], 0
        for i in range(cand.shape[0]):
            row = scores[i, prev]
            prev = int(row.argmax())
            tokens.append(int(cand[i, prev]))
            probs.append(float(torch.softmax(row.double(), -1)[prev]))
        return tokens, probs


def _dequantized(info, name: str) -> np.ndarray:
    """A GGUF tensor as float32 numpy in row-major (rows = ggml's last dimension)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = info.tensors[name]
    raw = np.memmap(info.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
    qtype = GGMLQuantizationType[t.type]
    shape = tuple(reversed(t.shape))
    if qtype == GGMLQuantizationType.F32:
        return np.frombuffer(raw, dtype=np.float32).reshape(shape)
    if qtype in (GGMLQuantizationType.I32, GGMLQuantizationType.I64):  # d2t
        return np.frombuffer(raw, dtype=np.int32 if qtype == GGMLQuantizationType.I32 else np.int64).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return np.frombuffer(raw, dtype=np.float16).reshape(shape).astype(np.float32)
    return dequantize(raw.reshape(shape[:-1] + (-1,)), qtype).reshape(shape)


def shape_from_gguf(info) -> DraftShape:
    n_head = info.get("attention.head_count")
    return DraftShape(
        n_embd=info.get("embedding_length"),
        n_layer=info.get("block_count"),
        n_head=n_head,
        n_head_kv=info.get("attention.head_count_kv") or n_head,
        head_dim=info.get("attention.key_length") or info.get("embedding_length") // n_head,
        rms_eps=info.get("attention.layer_norm_rms_epsilon"),
        rope_theta=info.get("rope.freq_base") or 10000.0,
        target_layers=[int(v) for v in info.get("target_layers").values],
        block_size=int(info.get("block_size", 16)),
        mask_token=int(info.kv["tokenizer.ggml.mask_token_id"]),
        embedding_scale=info.get("embedding_scale") or 1.0,
        causal=bool(info.get("attention.causal", False)),
        sliding_window=info.get("attention.sliding_window") or None,
        swa_layers=swa.values if (swa := info.get("attention.sliding_window_pattern")) is not None else None,
        logit_scale=info.get("logit_scale") or 1.0,
        logit_softcap=info.get("final_logit_softcapping") or 0.0,
        conv_group_size=info.get("conv_group_size") or 0,
        selector_top_k=info.get("selector_top_k") or 0,
        anchor_first="markov_w1.weight" in info.tensors and bool(info.get("sample_from_anchor", True)),
    )


def load_gguf_drafter(path) -> DFlashDrafter:
    info = read_gguf(path)
    shape = shape_from_gguf(info)
    names = [n for n in info.tensors
             if n.startswith(("fc.", "enc.", "output", "blk.", "selector_", "markov_", "conf_proj")) or n == "d2t"]
    return DFlashDrafter(shape, {n: _dequantized(info, n) for n in names})


def load_zlab_drafter(path, target_info) -> DFlashDrafter:
    """A z-lab checkpoint folder (safetensors, any dtype), checked against the target GGUF's metadata."""
    from dflash_local.convert.gguf_out import noise_embedding_scale
    from dflash_local.convert.safetensors_file import read_tensor
    from dflash_local.convert.zlab_checkpoint import open_checkpoint

    ck = open_checkpoint(path)
    c = ck.config
    mask = check_checkpoint_pair(c, target_info, warn=lambda msg: print(f"dflash-local: {msg}", file=sys.stderr))
    if mask is None:
        raise ValueError(f"{path}: no mask token in dflash_config or in the target's tokenizer")
    shape = DraftShape(
        n_embd=c.hidden,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_head_kv=c.n_head_kv,
        head_dim=c.head_dim,
        rms_eps=c.rms_eps,
        rope_theta=c.rope_theta,
        target_layers=[i + 1 for i in c.target_layer_ids],
        block_size=c.block_size,
        mask_token=int(mask),
        embedding_scale=noise_embedding_scale(target_info.arch, c.hidden, c.embedding_scale) or 1.0,
        causal=c.causal,
        sliding_window=c.sliding_window,
        swa_layers=c.swa_layers,
        logit_scale=c.logit_scale if c.logit_scale is not None else 1.0,
        logit_softcap=c.logit_softcap or 0.0,
        conv_group_size=c.conv_group_size or 0,
        selector_top_k=c.selector_top_k or 0,
        anchor_first=c.dspark and c.sample_from_anchor,
    )
    weights = {t.name: read_tensor(t.src) for t in ck.tensors if t.src is not None}
    if "d2t" in weights:  # stored as offsets: target id = d2t[i] + i
        weights["d2t"] = weights["d2t"].astype(np.int64) + np.arange(len(weights["d2t"]))
    return DFlashDrafter(shape, weights)


class TorchDraftBackend(Drafter):
    """Runs a DFlashDrafter beside the llama.cpp target: keeps the context K/V per position, drafts blocks."""

    def __init__(self, model: DFlashDrafter, embed: np.ndarray, head: np.ndarray, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.model = model.to(self.device, dtype).eval()
        self.embed = torch.tensor(embed, dtype=dtype, device=self.device)
        self.head = self.embed if head is embed else torch.tensor(head, dtype=dtype, device=self.device)
        self.dtype = dtype
        self.ctx: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (K, V), positions 0..n-1
        self.n = 0

    @classmethod
    def load(cls, draft_path, target_path, device: str = "cpu") -> TorchDraftBackend:
        """From a DFlash GGUF or a z-lab checkpoint folder; embeddings and LM head come from the target GGUF."""
        t = read_gguf(target_path)
        model = load_zlab_drafter(draft_path, t) if Path(draft_path).is_dir() else load_gguf_drafter(draft_path)
        embed = _dequantized(t, "token_embd.weight")
        head = _dequantized(t, "output.weight") if "output.weight" in t.tensors else embed
        return cls(model, embed, head, device)

    def context(self) -> int:
        return self.n

    def crop(self, n: int) -> None:
        """Forget context positions from n on."""
        self.ctx = [(k[:n], v[:n]) for k, v in self.ctx]
        self.n = min(self.n, n)

    def extend(self, session, pos0: int, n: int) -> None:
        self.add(session.features()[:n], pos0)

    @torch.inference_mode()
    def add(self, features: np.ndarray, pos0: int) -> None:
        """Append the target features of positions pos0.. (pos0 must be the current context length)."""
        if pos0 != self.n:
            raise ValueError(f"context positions must stay contiguous: have {self.n}, got {pos0}")
        f = torch.from_numpy(np.ascontiguousarray(features)).to(self.device, self.dtype)
        pos = torch.arange(pos0, pos0 + f.shape[0], device=self.device)
        new = self.model.context_kv(f, pos)
        self.ctx = new if not self.ctx else [(torch.cat([k, nk]), torch.cat([v, nv]))
                                             for (k, v), (nk, nv) in zip(self.ctx, new)]
        self.n += f.shape[0]

    @torch.inference_mode()
    def hidden_and_logits(self, last: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [n, H] and draft logits [n, vocab] of the n draft slots of the block after `last`
        (which sits at the next context position): slots 1..n, or 0..n-1 for an anchor-first DSpark drafter.
        DFlash2's logits after its logit scale and soft-capping; DSpark's without its Markov bias."""
        s = self.model.shape
        first = 0 if s.anchor_first else 1
        tokens = torch.tensor([last] + [s.mask_token] * (n - 1 + first), device=self.device)
        pos = torch.arange(self.n, self.n + n + first, device=self.device)
        noise = self.embed[tokens] * s.embedding_scale
        h = self.model(noise, pos, self.ctx)[first:]
        if self.model.lm_head is None:
            out = h @ self.head.T
        else:
            out = torch.full((n, self.head.shape[0]), -torch.inf, dtype=h.dtype, device=h.device)
            out[:, self.model.d2t] = h @ self.model.lm_head.T
        if self.model.selector is not None:
            out = out * s.logit_scale
            if s.logit_softcap > 0:
                out = torch.tanh(out / s.logit_softcap) * s.logit_softcap
        return h, out

    def logits(self, last: int, n: int) -> torch.Tensor:
        return self.hidden_and_logits(last, n)[1]

    @torch.inference_mode()
    def lattice(self, last: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2: the selector lattice of the n positions after `last` (DFlashDrafter.selector_lattice)."""
        h, logits = self.hidden_and_logits(last, n)
        return self.model.selector_lattice(h, logits, last, self.model.shape.selector_top_k)

    @torch.inference_mode()
    def dspark(self, last: int, n: int, given: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DSpark: the biased draft logits [n, vocab] of the n slots after `last` and their confidences [n]
        (DFlashDrafter.markov_chain)."""
        h, base = self.hidden_and_logits(last, n)
        return self.model.markov_chain(h, base, last, self.model.d2t, given)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return self.draft_rated(tokens, k)[0]

    def draft_rated(self, tokens: list[int], k: int) -> tuple[list[int], list[float] | None]:
        if self.model.selector is not None:
            return self.model.walk(*self.lattice(tokens[-1], k))
        if self.model.markov is not None:
            logits, conf = self.dspark(tokens[-1], k)
            return logits.argmax(-1).tolist(), conf.tolist() if conf is not None else None
        return self.logits(tokens[-1], k).argmax(-1).tolist(), None


def pick_device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--draft-device cuda: PyTorch sees no CUDA device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--draft-device mps: PyTorch sees no Metal device")
    return name

