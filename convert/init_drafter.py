"""Write a freshly initialised DFlash drafter GGUF for a target GGUF.

The file has upstream llama.cpp's `dflash` layout and the target's tokenizer, so it loads anywhere a trained drafter
does. Its weights are random: it is the starting point for training and a way to check a pipeline end to end, and it
drafts nothing useful by itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from dflash_local.gguf_file import ArrayInfo, read_gguf

from .gguf_out import add_dflash_keys, add_model_hparams, noise_embedding_scale, tokenizer_kv, write_gguf_atomic


def default_target_layers(n_layer: int, k: int) -> list[int]:
    """z-lab's default feature layers (outputs of layers round(1 + i(L-4)/(k-1))) as layer-input indices (+1)."""
    if k == 1:
        ids = [n_layer // 2]
    else:
        ids = [round(1 + i * (n_layer - 4) / (k - 1)) for i in range(k)]
    return [i + 1 for i in ids]


def init_drafter(
    out,
    target_path,
    *,
    n_layer: int = 1,
    n_target_layers: int | None = None,
    target_layers: list[int] | None = None,
    block_size: int = 16,
    n_head: int | None = None,
    n_head_kv: int | None = None,
    head_dim: int | None = None,
    n_ff: int | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised drafter for the target; shapes default to the target's own."""
    t = read_gguf(target_path)
    arch = t.arch
    n_embd = t.get("embedding_length")
    t_layers = t.n_layer
    n_head = n_head or t.get("attention.head_count")
    n_head_kv = n_head_kv or t.get("attention.head_count_kv") or n_head
    head_dim = head_dim or t.get("attention.key_length") or n_embd // n_head
    n_ff = n_ff or t.get("feed_forward_length")
    if isinstance(n_ff, ArrayInfo):  # per-layer feed-forward sizes
        n_ff = max(n_ff.values)
    if target_layers is None:
        target_layers = default_target_layers(t_layers, n_target_layers or max(n_layer, 1))
    bad = [lid for lid in target_layers if not 1 <= lid < t_layers]
    if bad:
        raise ValueError(f"target layers {bad} outside the target's layer inputs 1..{t_layers - 1}")
    tok = tokenizer_kv(target_path, mask_token_id)
    rng = np.random.default_rng(seed)

    def linear(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    def fill(w):
        w.add_name(f"dflash drafter (untrained) for {t.kv.get('general.name', arch)}")
        add_model_hparams(w, n_ctx=t.get("context_length") or 4096, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer,
                          n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                          rms_eps=t.get("attention.layer_norm_rms_epsilon") or 1e-6,
                          rope_theta=t.get("rope.freq_base") or 10000.0)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        add_dflash_keys(w, target_layers, block_size, False, noise_embedding_scale(arch, n_embd))
        for key, value, vtype, sub in tok:
            w.add_key_value(key, value, vtype, sub)
        w.add_tensor("fc.weight", linear(n_embd, len(target_layers) * n_embd))
        w.add_tensor("enc.output_norm.weight", ones(n_embd))
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", ones(n_embd))
            w.add_tensor(p + "attn_q.weight", linear(n_head * head_dim, n_embd))
            w.add_tensor(p + "attn_k.weight", linear(n_head_kv * head_dim, n_embd))
            w.add_tensor(p + "attn_v.weight", linear(n_head_kv * head_dim, n_embd))
            w.add_tensor(p + "attn_output.weight", linear(n_embd, n_head * head_dim))
            w.add_tensor(p + "attn_q_norm.weight", ones(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", ones(head_dim))
            w.add_tensor(p + "ffn_norm.weight", ones(n_embd))
            w.add_tensor(p + "ffn_gate.weight", linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_up.weight", linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_down.weight", linear(n_embd, n_ff))
        w.add_tensor("output_norm.weight", ones(n_embd))

    return write_gguf_atomic(out, "dflash", fill)
