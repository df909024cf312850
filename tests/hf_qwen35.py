"""A tiny Hugging Face Qwen3.5 checkpoint (Qwen3_5ForCausalLM) with random weights, for upstream's converter.

config.json carries the keys of Qwen3.5's text config as Qwen publishes it (model_type qwen3_5_text, layer_types,
linear_* for the Gated DeltaNet layers, attn_output_gate, rope_parameters with interleaved M-RoPE sections and a
partial rotary factor, one MTP layer); model.safetensors holds BF16 weights under the HF names and shapes of
transformers' modeling_qwen3_5: linear_attn.{in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, conv1d, dt_bias, A_log,
norm, out_proj} in the linear-attention layers, self_attn.{q_proj (queries and output gate), k_proj, v_proj, o_proj,
q_norm, k_norm} in the full-attention ones, and the mtp.* block. Written here from the model's definition, not from
any converter: the GGUF comes from upstream llama.cpp's own converter (tests/upstream_convert.py).

Qwen3.5's RMS norms scale by (1 + weight) (the converter adds the 1), except the gated norm of the linear-attention
output, which scales by its weight. There are more value heads than key heads, as in the real models (which makes
upstream reorder the value heads).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
from zlab import write_safetensors


def qwen35_config(*, vocab_size: int, hidden=64, n_layer=4, full_attention_interval=2, n_head=4, n_kv=2, head_dim=32,
                  n_ff=128, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, conv_kernel=4, mrope_section=(2, 1, 1)) -> dict:
    """Qwen3.5's text config at a tiny size: head_dim * 0.25 = 8 rotated dimensions, 4 pairs in the M-RoPE sections
    (Qwen3.5-9B: 256 * 0.25 = 64, sections 11 + 11 + 10 = 32)."""
    layer_types = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                   for i in range(n_layer)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "full_attention_interval": full_attention_interval,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": n_ff,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": conv_kernel,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "max_position_embeddings": 2048,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": n_layer,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": list(mrope_section), "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _attention(p: str, c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return [(p + "self_attn.q_proj.weight", (2 * q, h)),  # each head's query, then its output gate
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,))]


def _block(p: str, c: dict, linear: bool) -> list[tuple[str, tuple[int, ...]]]:
    h, ff = c["hidden_size"], c["intermediate_size"]
    out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
           (p + "mlp.gate_proj.weight", (ff, h)), (p + "mlp.up_proj.weight", (ff, h)),
           (p + "mlp.down_proj.weight", (h, ff))]
    if not linear:
        return out + _attention(p, c)
    key_dim = c["linear_key_head_dim"] * c["linear_num_key_heads"]
    n_v = c["linear_num_value_heads"]
    value_dim = c["linear_value_head_dim"] * n_v
    conv_dim = 2 * key_dim + value_dim
    return out + [(p + "linear_attn.in_proj_qkv.weight", (conv_dim, h)),
                  (p + "linear_attn.in_proj_z.weight", (value_dim, h)),
                  (p + "linear_attn.in_proj_a.weight", (n_v, h)),
                  (p + "linear_attn.in_proj_b.weight", (n_v, h)),
                  (p + "linear_attn.conv1d.weight", (conv_dim, 1, c["linear_conv_kernel_dim"])),
                  (p + "linear_attn.dt_bias", (n_v,)),
                  (p + "linear_attn.A_log", (n_v,)),
                  (p + "linear_attn.norm.weight", (c["linear_value_head_dim"],)),
                  (p + "linear_attn.out_proj.weight", (h, value_dim))]


def qwen35_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, v = c["hidden_size"], c["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for i, kind in enumerate(c["layer_types"]):
        out += _block(f"model.layers.{i}.", c, kind == "linear_attention")
    # the MTP block: a full-attention layer over fc([norm(embedding); norm(hidden)])
    out += [("mtp.fc.weight", (h, 2 * h)), ("mtp.pre_fc_norm_embedding.weight", (h,)),
            ("mtp.pre_fc_norm_hidden.weight", (h,)), ("mtp.norm.weight", (h,))]
    for i in range(c["mtp_num_hidden_layers"]):
        out += _block(f"mtp.layers.{i}.", c, linear=False)
    return sorted(out)  # safetensors files list tensors by name


def _init(name: str, shape: tuple[int, ...], seed: int, silent: list[int]) -> np.ndarray:
    """Unit embeddings, a strong LM head and weak residual branches: the next token depends mostly on the current one
    and a little on the context, so greedy continuations keep coming back to the same paths, and a drafter trained
    on them for a few hundred steps drafts some of them right on prompts it has not seen (partial acceptances)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("A_log"):
        return rng.uniform(-1, 1, shape).astype(np.float32)
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:  # (1 + weight) norms: near 1 in effect, not all equal
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "model.embed_tokens.weight":
        return rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[-1] if len(shape) == 2 else shape[-1] * shape[-2]
    gain = 4.0 if name == "lm_head.weight" else 0.25 if name.endswith(
        ("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(fan_in))
    if name == "lm_head.weight":
        w[silent] = 0.0  # logit 0, never the largest: generations run to their token limit
    return w


def write_qwen35_checkpoint(path, *, vocab_size: int, silent: list[int] = (), seed: int = 5, **shape) -> Path:
    """config.json and model.safetensors of a random Qwen3_5ForCausalLM. `silent`: token ids the LM head never
    picks (the control tokens)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = qwen35_config(vocab_size=vocab_size, **shape)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_safetensors(path / "model.safetensors",
                      [(n, "BF16", s, lambda n=n, s=s: _init(n, s, seed, list(silent))) for n, s in qwen35_shapes(cfg)])
    return path
