"""The DFlash draft model in PyTorch, and a draft backend that runs it beside the llama.cpp target.

Semantics (as upstream llama.cpp's `dflash` graph and z-lab's reference): the target features of accepted positions
go through fc and hidden_norm; every layer caches their K/V (no input norm, RoPE at their positions). A noise block
[last token, mask x n] at the next positions is embedded with the target's embeddings; each layer attends from the
block to [cached context ; block] without a causal mask; the final norm and the target's LM head give the drafts.

Weights are named the GGUF way (fc.weight, enc.output_norm.weight, blk.N.attn_q.weight, ...), so one loader serves
a z-lab checkpoint (renamed by the converter's reader) and a (dequantized) DFlash GGUF. Runs on cuda, mps or cpu.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .extras import needs_extra

with needs_extra("torch", "--draft-backend torch"):
    import torch
    import torch.nn.functional as F
    from torch import nn

from .drafter import Drafter
from .gguf_file import read_gguf


@dataclass
class DraftShape:
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

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """The weights under their GGUF names (the inverse of the constructor), as float32 numpy (d2t as ids)."""
        out = {"fc.weight": self.fc, "enc.output_norm.weight": self.hidden_norm, "output_norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            out.update({f"blk.{i}.{n}.weight": w for n, w in layer.items()})
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

    def forward(self, noise: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                attn_mask: torch.Tensor | None = None):
        """Hidden states of the noise block. noise: [n, hidden] embeddings; ctx: per-layer cached (K, V).
        attn_mask [n, len(ctx) + n] (True = attend) lets training run many blocks at once; None = all of ctx."""
        s = self.shape
        x = noise
        n = x.shape[0]
        for L, (ck, cv) in zip(self.layers, ctx):
            h = rms_norm(x, L["attn_norm"], s.rms_eps)
            q = rope(rms_norm((h @ L["attn_q"].T).view(n, s.n_head, s.head_dim), L["attn_q_norm"], s.rms_eps),
                     pos, s.rope_theta)
            k = rope(rms_norm((h @ L["attn_k"].T).view(n, s.n_head_kv, s.head_dim), L["attn_k_norm"], s.rms_eps),
                     pos, s.rope_theta)
            v = (h @ L["attn_v"].T).view(n, s.n_head_kv, s.head_dim)
            k, v = torch.cat([ck, k]), torch.cat([cv, v])
            rep = s.n_head // s.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = attn_mask
            if s.causal:  # a causal drafter still sees the whole context
                m = k.shape[0] - n
                causal = torch.ones(n, m + n, dtype=torch.bool, device=x.device).tril(m)
                mask = causal if mask is None else mask & causal
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=1.0 / math.sqrt(s.head_dim))
            x = x + a.transpose(0, 1).reshape(n, -1) @ L["attn_output"].T
            h = rms_norm(x, L["ffn_norm"], s.rms_eps)
            x = x + (F.silu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
        return rms_norm(x, self.norm, s.rms_eps)


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
    )


def load_gguf_drafter(path) -> DFlashDrafter:
    info = read_gguf(path)
    shape = shape_from_gguf(info)
    names = [n for n in info.tensors if n.startswith(("fc.", "enc.", "output", "blk.")) or n == "d2t"]
    return DFlashDrafter(shape, {n: _dequantized(info, n) for n in names})


def load_zlab_drafter(path, target_info) -> DFlashDrafter:
    """A z-lab checkpoint folder (safetensors, any dtype), checked against the target GGUF's metadata."""
    from dflash_local.convert.gguf_out import noise_embedding_scale
    from dflash_local.convert.hf_to_gguf import check_against_target
    from dflash_local.convert.safetensors_file import read_tensor
    from dflash_local.convert.zlab_checkpoint import open_checkpoint

    ck = open_checkpoint(path)
    c = ck.config
    mask = check_against_target(c, target_info, warn=lambda msg: print(f"dflash-local: {msg}", file=sys.stderr))
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
    def logits(self, last: int, n: int) -> torch.Tensor:
        """Draft logits [n, vocab] for the n positions after `last` (which sits at the next context position)."""
        s = self.model.shape
        tokens = torch.tensor([last] + [s.mask_token] * n, device=self.device)
        pos = torch.arange(self.n, self.n + n + 1, device=self.device)
        noise = self.embed[tokens] * s.embedding_scale
        h = self.model(noise, pos, self.ctx)[1:]
        if self.model.lm_head is None:
            return h @ self.head.T
        full = torch.full((n, self.head.shape[0]), -torch.inf, dtype=h.dtype, device=h.device)
        full[:, self.model.d2t] = h @ self.model.lm_head.T
        return full

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return self.logits(tokens[-1], k).argmax(-1).tolist()


def pick_device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--draft-device cuda: PyTorch sees no CUDA device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--draft-device mps: PyTorch sees no Metal device")
    return name

