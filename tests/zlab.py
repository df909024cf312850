"""z-lab DFlash drafter checkpoints for tests, a NumPy reference forward, and a llama.cpp probe of the ggml drafter.

- write_checkpoint: random weights in z-lab's exact layout (config.json with DFlashDraftModel and dflash_config,
  BF16 safetensors shards with an index json), written tensor by tensor so a 0.5 B model needs little memory;
  with a zlab2_config, a DFlash2DraftModel (conv and selector tensors as z-lab publishes them); with a
  zlab_gemma4_config, z-lab's Gemma-4 layout (sliding-window layers, the target's logit soft-cap); with a
  dspark_config, a DSparkDraftModel (Markov and confidence heads) in DeepSpec's or the speculators' config schema.
- Reference: the DFlash forward in float64 NumPy, written from the model's definition, not from the converter:
  ctx = hidden_norm(fc(features)); per layer, queries from the noise block only, keys/values from [ctx; noise]
  (ctx K/V from the ctx hidden itself, no input_layernorm, as llama.cpp's dflash graph does), per-head q/k RMS norm,
  NeoX RoPE at absolute positions, no causal mask; final norm; the target's LM head.
- LlamaProbe: llama.cpp's own dflash graph on a converted GGUF through the llama-cpp-python C bindings, with an f32
  KV cache and no flash attention, returning the raw logits of every position of a noise block.
"""

from __future__ import annotations

import ctypes
import json
import struct
import zlib
from pathlib import Path

import numpy as np

# -- safetensors, written and read without the converter's code ----------------------------------------------------

_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"),
              "BOOL": np.dtype("?")}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, entries) -> None:
    """entries: list of (name, dtype, shape, make) where make() returns the array; written one at a time."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        n = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape, make in entries:
            a = make()
            if dtype == "BF16" and a.dtype != np.uint16:
                a = to_bf16_bits(a)
            a = np.ascontiguousarray(a, dtype=_ST_DTYPES[dtype])
            assert a.shape == tuple(shape), (name, a.shape, shape)
            a.tofile(f)


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a file: floats as float32, integers and booleans as they are."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        a = np.frombuffer(data[b:end], dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"])
        out[name] = from_bf16_bits(a) if e["dtype"] == "BF16" else a if a.dtype.kind in "ib" else a.astype(np.float32)
    return out


def read_checkpoint(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


# -- synthetic z-lab checkpoints --------------------------------------------------------------------------------------


def zlab_config(*, hidden, n_layer, n_head, n_kv, head_dim, n_ff, target_layer_ids, num_target_layers, vocab_size,
                mask_token_id, block_size=16, rope_theta=1000000.0, rms_eps=1e-6, max_pos=40960) -> dict:
    """config.json with the fields z-lab's Qwen3 drafters carry (Qwen3-4B-DFlash-b16 layout)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": n_ff,
        "layer_types": ["full_attention"] * n_layer,
        "max_position_embeddings": max_pos,
        "max_window_layers": n_layer,
        "model_type": "qwen3",
        "num_attention_heads": n_head,
        "num_hidden_layers": n_layer,
        "num_key_value_heads": n_kv,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": rms_eps,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def zlab2_config(*, conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=4,
                 output_multiplier=None, final_logit_softcapping=None, sliding_window=None, **kw) -> dict:
    """config.json of a DFlash2 drafter, laid out as z-lab's published one (tests/fixtures/dflash2-config.json in
    z-lab/dflash): DFlash2DraftModel, is_causal false, block size and the conv/selector settings in dflash_config,
    rope in rope_parameters, optional sliding window on every layer."""
    cfg = zlab_config(**kw)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["is_causal"] = False
    del cfg["auto_map"], cfg["block_size"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    dc = cfg["dflash_config"]
    dc.update(block_size=kw.get("block_size", 16), conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
              selector_rank=selector_rank, selector_top_k=selector_top_k)
    if output_multiplier is not None:
        dc["output_multiplier"] = output_multiplier
    if final_logit_softcapping is not None:
        dc["final_logit_softcapping"] = final_logit_softcapping
    if sliding_window:
        cfg.update(use_sliding_window=True, sliding_window=sliding_window,
                   layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    cfg["tie_word_embeddings"] = False
    cfg["transformers_version"] = "5.15.0"
    return cfg


def zlab_gemma4_config(*, sliding_window=2048, n_full=1, final_logit_softcapping=30.0, input_embedding_scale=None,
                       **kw) -> dict:
    """config.json of a z-lab Gemma-4 DFlash drafter (z-lab/gemma-4-31B-it-DFlash: a DFlashDraftModel of Qwen3
    layers with sliding-window attention, window 2048, on all but the last `n_full` layers, the target's final
    logit soft-cap of 30 and rope_theta 1e6). input_embedding_scale, when given, is written in dflash_config, where
    upstream's converter reads it."""
    cfg = zlab_config(**{"rope_theta": 1000000.0, **kw})
    n = cfg["num_hidden_layers"]
    cfg.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=n,
               layer_types=["sliding_attention"] * (n - n_full) + ["full_attention"] * n_full,
               final_logit_softcapping=final_logit_softcapping)
    if input_embedding_scale is not None:
        cfg["dflash_config"]["input_embedding_scale"] = input_embedding_scale
    return cfg


def dspark_config(*, markov_rank=16, confidence=True, schema="deepspec", draft_vocab_size=None, **kw) -> dict:
    """config.json of a DSpark drafter. schema "deepspec": as deepseek-ai's published dspark_* checkpoints
    (DSparkDraftModel, Qwen3 fields, block_size, target_layer_ids and mask_token_id at the top level, markov_rank,
    markov_head_type vanilla, enable_confidence_head, confidence_head_with_markov; anchor-first blocks).
    "speculators": the EAGLE3-style export (a nested transformer_layer_config, 1-based aux_hidden_state_layer_ids;
    drafts after a bonus anchor slot). draft_vocab_size (top level in both, where upstream's converter reads it): a
    reduced draft vocabulary, with its own lm_head and markov_w2 of that many rows; the checkpoint then also needs
    the d2t (and t2d) tensors, given to write_checkpoint as `extra`."""
    cfg = zlab_config(**kw)
    dc = cfg.pop("dflash_config")
    del cfg["auto_map"]
    cfg["architectures"] = ["DSparkDraftModel"]
    heads = {"markov_rank": markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": confidence,
             "confidence_head_with_markov": True}
    if draft_vocab_size is not None:
        heads["draft_vocab_size"] = draft_vocab_size
    if schema == "deepspec":
        return {**cfg, "target_layer_ids": dc["target_layer_ids"], "mask_token_id": dc["mask_token_id"], **heads}
    top = ("architectures", "block_size", "dtype", "transformers_version")
    return {**{k: cfg[k] for k in top}, "aux_hidden_state_layer_ids": [i + 1 for i in dc["target_layer_ids"]],
            "mask_token_id": dc["mask_token_id"], **heads,
            "transformer_layer_config": {k: v for k, v in cfg.items() if k not in top}}


def edit_config(path: Path, edit) -> Path:
    """Apply `edit` to the checkpoint's config.json in place; returns the checkpoint folder."""
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _flat(cfg: dict) -> dict:
    """A config's model fields and target layer ids, whatever the schema."""
    flat = {**cfg, **cfg.get("transformer_layer_config", {})}
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids") or cfg.get("target_layer_ids")
    flat["target_layer_ids"] = ids or [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]
    return flat


def _dspark_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, v, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    n_draft = cfg.get("draft_vocab_size") or v  # w1 embeds any target token, w2 scores the draft vocabulary
    out = [("markov_head.markov_w1.weight", (v, r)), ("markov_head.markov_w2.weight", (n_draft, r))]
    if n_draft < v:
        out.append(("lm_head.weight", (n_draft, h)))
    if cfg["enable_confidence_head"]:
        out += [("confidence_head.proj.weight", (1, h + r)), ("confidence_head.proj.bias", (1,))]
    return out


def _dflash2_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    dc, h = cfg["dflash_config"], cfg["hidden_size"]
    k, r = dc["conv_kernel_size"], dc["selector_rank"]
    proj = (2 * k * (h // dc["conv_group_size"]), h)
    out = [("candidate_selector.predecessor_codebook", (cfg["vocab_size"], r)),
           ("candidate_selector.successor_codebook", (cfg["vocab_size"], r)),
           ("candidate_selector.hidden_projection.weight", (r, h))]
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            out += [(f"layers.{i}.{conv}.base_kernel", (2, k, h)),
                    (f"layers.{i}.{conv}.kernel_projection.weight", proj)]
    return out


def _shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    cfg = _flat(cfg)
    h, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("fc.weight", (h, len(cfg["target_layer_ids"]) * h)), ("hidden_norm.weight", (h,)),
           ("norm.weight", (h,))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "mlp.gate_proj.weight", (ff, h)),
            (p + "mlp.up_proj.weight", (ff, h)),
            (p + "mlp.down_proj.weight", (h, ff)),
        ]
    if cfg["architectures"] == ["DFlash2DraftModel"]:
        out += _dflash2_shapes(cfg)
    if cfg["architectures"] == ["DSparkDraftModel"]:
        out += _dspark_shapes(cfg)
    return sorted(out)  # safetensors files list tensors by name


def write_checkpoint(path, cfg: dict, *, n_shards: int = 2, dtype: str = "BF16", seed: int = 0,
                     residual_gain: float | None = None, extra: dict | None = None, index: bool = True) -> Path:
    """Random weights for `cfg` in z-lab's layout. extra: more tensors (name -> (dtype, array)), e.g. d2t/lm_head.

    Linear weights are N(0, 1/fan_in); the projections into the residual stream (o_proj, down_proj) are scaled by
    residual_gain, 1/sqrt(2 * layers) by default as in GPT-2-style initialisation, which keeps the residual stream
    and the logit margins in the range of a trained model instead of near-uniform logits."""
    if residual_gain is None:
        residual_gain = 1.0 / np.sqrt(2 * _flat(cfg)["num_hidden_layers"])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))

    def maker(name, shape):
        def make():
            # a generator per tensor: the same weights whatever the sharding, and one tensor in memory at a time
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            if len(shape) == 1:
                return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if name.endswith("base_kernel"):  # DFlash2 conv: near the identity (tap 0 about 1, older taps small)
                w = 0.2 * rng.standard_normal(shape)
                w[:, 0] += 1.0
                return w.astype(np.float32)
            if name.endswith("kernel_projection.weight"):  # small input-dependent corrections to the kernel
                return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.3 / np.sqrt(shape[1]))
            if "codebook" in name:  # pairwise selector scores of about unit size
                return rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[1] ** -0.25)
            if name.endswith("markov_w1.weight"):  # unit embeddings: a Markov bias of about one logit...
                return rng.standard_normal(shape, dtype=np.float32)
            if name.endswith("markov_w2.weight"):  # ...and four for every 16th token: peaked, as trained heads are
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[1]))
                w[::16] *= 4
                return w
            gain = residual_gain if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[1]))
        return make

    entries = [(n, dtype, s, maker(n, s)) for n, s in _shapes(cfg)]
    for name, (dt, arr) in (extra or {}).items():
        entries.append((name, dt, arr.shape, lambda a=arr: a))
    sizes = [int(np.prod(s)) for _, _, s, _ in entries]
    bounds, acc, k = [], 0, 1
    for i, n in enumerate(sizes):
        acc += n
        if acc >= k * sum(sizes) / n_shards and k < n_shards:
            bounds.append(i + 1)
            k += 1
    parts = [entries[a:b] for a, b in zip([0, *bounds], [*bounds, len(entries)], strict=True) if b > a]
    if len(parts) == 1:
        write_safetensors(path / "model.safetensors", parts[0])
        return path
    weight_map = {}
    for j, part in enumerate(parts):
        fname = f"model-{j + 1:05d}-of-{len(parts):05d}.safetensors"
        write_safetensors(path / fname, part)
        weight_map.update({n: fname for n, *_ in part})
    if index:
        total = sum(int(np.prod(s)) * _ST_DTYPES[d].itemsize for _, d, s, _ in entries)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    return path


# -- NumPy reference forward ----------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x, pos, theta):
    """NeoX RoPE (rotate the two halves of each head), Qwen3's convention. x: [n, heads, head_dim]."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Reference:
    """The DFlash drafter in float64, from the checkpoint's own weights and the target's embeddings and head."""

    def __init__(self, ckpt_dir, target_embd: np.ndarray, target_head: np.ndarray):
        self.cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
        self.w = {k.removeprefix("model."): v.astype(np.float64) if v.dtype != np.int64 else v
                  for k, v in read_checkpoint(ckpt_dir).items()}
        self.embd = target_embd.astype(np.float64)
        head = target_head.astype(np.float64)
        self.d2t = None
        if "d2t" in self.w:
            self.d2t = self.w["d2t"].reshape(-1) + np.arange(self.w["d2t"].size)
            head = self.w["lm_head.weight"]
        self.head = head

    def hidden(self, feats: np.ndarray, tokens, pos0: int | None = None) -> np.ndarray:
        c, w = self.cfg, self.w
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        n_ctx, n_blk = feats.shape[0], len(tokens)
        pos0 = n_ctx if pos0 is None else pos0
        ctx = _rms(feats.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        h = self.embd[np.asarray(tokens)]
        pos_ctx, pos_blk = np.arange(n_ctx), pos0 + np.arange(n_blk)
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            q = _rope_neox(_rms((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n_blk, nh, hd),
                                w[p + "self_attn.q_norm.weight"], eps), pos_blk, theta)

            def kv(src, pos, p=p):
                k = (src @ w[p + "self_attn.k_proj.weight"].T).reshape(len(src), nkv, hd)
                k = _rope_neox(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, theta)
                return k, (src @ w[p + "self_attn.v_proj.weight"].T).reshape(len(src), nkv, hd)

            k_ctx, v_ctx = kv(ctx, pos_ctx)
            k_blk, v_blk = kv(x, pos_blk)
            k, v = np.concatenate([k_ctx, k_blk]), np.concatenate([v_ctx, v_blk])
            group = nh // nkv  # query head j reads kv head j // group
            att = np.empty((n_blk, nh, hd))
            for j in range(nh):
                s = q[:, j, :] @ k[:, j // group, :].T / np.sqrt(hd)  # every block row sees every key: non-causal
                s = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, j, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, j // group, :]
            h = h + att.reshape(n_blk, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            h = h + (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
        return _rms(h, w["norm.weight"], eps)

    def logits(self, feats: np.ndarray, tokens, pos0: int | None = None) -> np.ndarray:
        out = self.hidden(feats, tokens, pos0) @ self.head.T
        if self.d2t is None:
            return out
        full = np.full((out.shape[0], self.embd.shape[0]), -np.inf)
        full[:, self.d2t] = out
        return full


def target_matrices(target_path) -> tuple[np.ndarray, np.ndarray]:
    """The tiny f32 target's token embeddings and LM head, [n_vocab, n_embd] each."""
    import gguf

    r = gguf.GGUFReader(str(target_path))
    names = ("token_embd.weight", "output.weight")
    t = {x.name: np.array(x.data, dtype=np.float32) for x in r.tensors if x.name in names}
    return t["token_embd.weight"], t.get("output.weight", t["token_embd.weight"])


# -- llama.cpp's dflash graph, driven through the C API ---------------------------------------------------------------


class LlamaProbe:
    """Raw draft logits of llama.cpp's dflash graph for given target features and a noise block.

    An f32 KV cache and no flash attention, so what differs from the reference is the weights' encoding alone."""

    def __init__(self, target_path, drafter_path, n_ctx: int = 512, n_threads: int = 2):
        from dflash_local.convert.llama_quantize import import_llama_cpp

        L = self.L = import_llama_cpp()  # keeps the engine's quiet log callback
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.tm = L.llama_model_load_from_file(str(target_path).encode(), mp)
        self.dm = L.llama_model_load_from_file(str(drafter_path).encode(), mp)
        assert self.tm and self.dm, "model load failed"
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = n_threads
        self.tctx = L.llama_init_from_model(self.tm, cp)
        dp = L.llama_context_default_params()
        dp.n_ctx = dp.n_batch = dp.n_ubatch = n_ctx
        dp.n_threads = dp.n_threads_batch = n_threads
        dp.type_k = dp.type_v = L.GGML_TYPE_F32
        dp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        dp.ctx_other = self.tctx
        self.dctx = L.llama_init_from_model(self.dm, dp)
        assert self.tctx and self.dctx, "context creation failed"
        L.llama_set_causal_attn(self.dctx, False)
        self.batch = L.llama_batch_ext_init(self.dctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.tm))

    def logits(self, feats: np.ndarray, tokens) -> np.ndarray:
        L, b = self.L, self.batch
        L.llama_memory_clear(L.llama_get_memory(self.dctx), True)
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        L.llama_batch_ext_clear(b)
        fptr = feats.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        width = feats.shape[1]
        for i in range(feats.shape[0]):
            row = ctypes.cast(ctypes.addressof(fptr.contents) + 4 * i * width, ctypes.POINTER(ctypes.c_float))
            idx = L.llama_batch_ext_add_embd(b, 0, L.llama_embd(row, 1, width))
            assert idx >= 0, f"feature row rejected ({idx})"
            pos = (L.llama_pos * 4)(i, i, i, 0)
            L.llama_batch_ext_set_pos(b, idx, pos)
            L.llama_batch_ext_set_output_logits(b, idx, False)
        assert L.llama_process(self.dctx, L.LLAMA_PROCESS_TYPE_DECODE, b) == 0
        L.llama_batch_ext_clear(b)
        p0 = feats.shape[0]
        for i, tok in enumerate(tokens):
            idx = L.llama_batch_ext_add_token(b, 0, int(tok))
            pos = (L.llama_pos * 4)(p0 + i, p0 + i, p0 + i, 0)
            L.llama_batch_ext_set_pos(b, idx, pos)
            L.llama_batch_ext_set_output_logits(b, idx, True)
        assert L.llama_process(self.dctx, L.LLAMA_PROCESS_TYPE_DECODE, b) == 0
        rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(self.dctx, i), shape=(self.n_vocab,)).copy()
                for i in range(len(tokens))]
        return np.stack(rows)

    def close(self) -> None:
        L = self.L
        L.llama_batch_ext_free(self.batch)
        L.llama_free(self.dctx)
        L.llama_free(self.tctx)
        L.llama_model_free(self.dm)
        L.llama_model_free(self.tm)
