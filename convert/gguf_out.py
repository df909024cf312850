"""Writing GGUF files: the keys DFlash drafters carry, the target's tokenizer, and safe writing (through
dflash_local.atomic: a temporary file beside the destination, renamed into place only when complete).

Shared by init_drafter (small drafters built in memory) and the HF converter (tensors streamed one at a time).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf

from dflash_local.atomic import atomic_output
from dflash_local.gguf_file import ArrayInfo, read_gguf

# targets whose GGUF tokenizer has no mask token get one of their unused special tokens
_MASK_CANDIDATES = ("<mask>", "<|mask|>", "[MASK]", "<unused0>", "<|reserved_special_token_0|>")


def add_model_hparams(w: gguf.GGUFWriter, *, n_ctx, n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim, rms_eps,
                      rope_theta) -> None:
    """The Qwen3-style transformer hyperparameters, under the writer's architecture."""
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_theta)


def add_dflash_keys(w: gguf.GGUFWriter, target_layers: list[int], block_size: int, causal: bool,
                    embedding_scale: float | None) -> None:
    """The keys llama.cpp's dflash loader reads (gguf-py has no helpers for them)."""
    # layer-INPUT indices: z-lab's "output of layer i" is the input of layer i + 1
    w.add_key_value("dflash.target_layers", [int(i) for i in target_layers], gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.INT32)
    w.add_uint32("dflash.block_size", block_size)
    w.add_bool("dflash.attention.causal", causal)
    if embedding_scale is not None:
        w.add_float32("dflash.embedding_scale", float(embedding_scale))


def noise_embedding_scale(target_arch: str, hidden: int, given: float | None = None) -> float | None:
    """Scale for the drafter's noise embeddings, which come from the target's embedding table. Gemma multiplies its
    embeddings by sqrt(hidden) inside the model, not in the GGUF tensor, so its drafters must do the same."""
    if given is None and target_arch.startswith("gemma"):
        return math.sqrt(hidden)
    return given


def write_gguf_atomic(path: str | os.PathLike, arch: str, fill) -> Path:
    """Build a GGUF through fill(writer) in a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            fill(w)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path


def unused_control_token(info) -> int | None:
    """The last control token that is none of the tokenizer's named ones (bos, eos, ...) and not in the chat
    template: text never holds it, so it can stand for a masked position (SmolLM2's <empty_output>)."""
    tokens = info.kv["tokenizer.ggml.tokens"].values
    types = info.kv.get("tokenizer.ggml.token_type")
    if types is None:
        return None
    named = {v for k, v in info.kv.items() if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    template = info.kv.get("tokenizer.chat_template") or ""
    unused = [i for i, t in enumerate(types.values)
              if t == gguf.TokenType.CONTROL and i not in named and tokens[i] not in template]
    return unused[-1] if unused else None


def tokenizer_kv(target_path, mask_token_id: int | None = None) -> list[tuple]:
    """The target's tokenizer.* metadata as (key, value, type, array element type), with a mask token set.

    mask_token_id overrides the target's own; without either, an unused special token of the target is taken."""
    info = read_gguf(target_path, full_arrays="tokenizer.")
    out = []
    for key, value in info.kv.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(info.types[key])
        if isinstance(value, ArrayInfo):
            out.append((key, value.values, vtype, gguf.GGUFValueType(value.type)))
        else:
            out.append((key, value, vtype, None))
    if mask_token_id is None:
        mask_token_id = info.kv.get("tokenizer.ggml.mask_token_id")
    if mask_token_id is None:
        tokens = info.kv["tokenizer.ggml.tokens"].values
        mask_token_id = next((tokens.index(t) for t in _MASK_CANDIDATES if t in tokens), None)
    if mask_token_id is None:
        mask_token_id = unused_control_token(info)
        if mask_token_id is None:
            raise ValueError(f"{target_path}: the tokenizer has no mask token; pass one explicitly")
    out = [kv for kv in out if kv[0] != "tokenizer.ggml.mask_token_id"]
    out.append(("tokenizer.ggml.mask_token_id", int(mask_token_id), gguf.GGUFValueType.UINT32, None))
    return out
