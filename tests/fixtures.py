"""Deterministic tiny GGUF models for tests: qwen3, qwen3moe, mamba, qwen35 and gemma4 targets and a dflash drafter.

Pure python + numpy + gguf. Run `python tests/fixtures.py OUTDIR` to write
OUTDIR/tiny-target.gguf and OUTDIR/tiny-drafter.gguf.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

from dflash_local.convert.gguf_out import add_model_hparams, write_gguf_atomic
from dflash_local.convert.init_drafter import init_drafter

VOCAB_SIZE = 512  # upper bound; the corpus runs out of repeated pairs a bit earlier
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# fill-in-the-middle tokens, Qwen2.5-Coder's (write_tiny_target(fim=True)), with their GGUF keys
FIM_TOKENS = {"<|fim_prefix|>": gguf.Keys.Tokenizer.FIM_PRE_ID, "<|fim_suffix|>": gguf.Keys.Tokenizer.FIM_SUF_ID,
              "<|fim_middle|>": gguf.Keys.Tokenizer.FIM_MID_ID, "<|fim_pad|>": gguf.Keys.Tokenizer.FIM_PAD_ID,
              "<|repo_name|>": gguf.Keys.Tokenizer.FIM_REP_ID, "<|file_sep|>": gguf.Keys.Tokenizer.FIM_SEP_ID}
RMS_EPS = 1e-6
ROPE_BASE = 10000.0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small mixed English + code corpus; only used to learn BPE merges.
CORPUS = """
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox
ran back into the forest where the other animals were waiting for the evening.
Speculative decoding is a way to make language models generate text faster. A small
draft model proposes several tokens, and the large target model verifies them in a
single forward pass. When the draft is right, many tokens are accepted at once; when
it is wrong, the target model keeps the correct prefix and the generation continues.
This is the same output that the target model would produce on its own, only faster.
Hello world! Hello there, how are you today? I am fine, thank you. What is the time?
It is ten past three in the afternoon, and the weather is warm and sunny outside.
Please write a function that returns the sum of a list of numbers. Then test it.
The user asked the assistant to explain the code, and the assistant explained it.

def add(a, b):
    return a + b


def total(values):
    result = 0
    for value in values:
        result = result + value
    return result


class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count


if __name__ == "__main__":
    numbers = [1, 2, 3, 4, 5]
    print("total:", total(numbers))
    print("add:", add(2, 3))
    for i in range(10):
        if i % 2 == 0:
            print(i, "is even")
        else:
            print(i, "is odd")

import os
import sys

def read_file(path):
    with open(path, "r", encoding="utf-8") as f:
        return f.read()

def write_file(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)

The model reads the input text, splits it into tokens, and then predicts the next
token again and again until it reaches the end of the text or the end token.
Tokens are pieces of words: common words become a single token, while rare words are
split into several smaller pieces that the model has seen before during training.
"""

# Close to llama.cpp's "qwen2" pre-tokenizer regex, using only the stdlib `re`
# (letters = [^\W\d_]). Exactness doesn't matter: merges only need to be plausible.
_PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2 byte->char table: printable bytes map to themselves, the rest to 256+n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _train_bpe(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE over pre-tokenized words; ties broken by pair order for determinism."""
    b2u = _bytes_to_unicode()
    words = Counter(tuple(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def build_tokenizer(vocab_size: int = VOCAB_SIZE, specials=tuple(SPECIAL_TOKENS)) -> dict:
    """Token list, types, merges and special ids of the tiny byte-level BPE vocab."""
    tokens = _bytes_to_unicode()  # id == byte value
    merges = _train_bpe(CORPUS, vocab_size - 256 - len(SPECIAL_TOKENS))
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:  # two merge paths can spell the same string
            seen.add(a + b)
            tokens.append(a + b)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    special = {}
    for s in specials:
        special[s] = len(tokens)
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
    return {
        "tokens": tokens,
        "types": [int(t) for t in types],
        "merges": [f"{a} {b}" for a, b in merges],
        "special": special,
    }


def _add_tokenizer(w: gguf.GGUFWriter, tok: dict, chat_template: str | None = CHATML_TEMPLATE,
                   eos: int | None = None) -> None:
    sp = tok["special"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # qwen2 keeps clean_spaces off, so detokenize is exact
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(sp["<|endoftext|>"])
    w.add_eos_token_id(sp["<|endoftext|>"] if eos is None else eos)
    w.add_eot_token_id(sp["<|im_end|>"])
    w.add_pad_token_id(sp["<|endoftext|>"])
    w.add_mask_token_id(sp["<|mask|>"])
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


class _Init:
    """Seeded weight factory. Arrays are numpy (out, in) == ggml ne {in, out}."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        # near 1 so norms are not all identical, which would hide layout bugs
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)


def _add_layer(w, init: _Init, i, n_embd, n_head, n_head_kv, head_dim, n_ff, gain, qk_norm=True, layer_type=None):
    p = f"blk.{i}."

    def matrix(name, a):  # layer_type (a gguf.GGMLQuantizationType) quantizes the layer's matrices
        if layer_type is None:
            w.add_tensor(p + name, a)
        else:
            w.add_tensor(p + name, gguf.quants.quantize(a, layer_type), raw_dtype=layer_type)

    w.add_tensor(p + "attn_norm.weight", init.norm(n_embd))
    matrix("attn_q.weight", init.linear(n_head * head_dim, n_embd))
    matrix("attn_k.weight", init.linear(n_head_kv * head_dim, n_embd))
    matrix("attn_v.weight", init.linear(n_head_kv * head_dim, n_embd))
    matrix("attn_output.weight", init.linear(n_embd, n_head * head_dim, gain))
    if qk_norm:  # qwen3's, not llama's
        w.add_tensor(p + "attn_q_norm.weight", init.norm(head_dim))
        w.add_tensor(p + "attn_k_norm.weight", init.norm(head_dim))
    w.add_tensor(p + "ffn_norm.weight", init.norm(n_embd))
    matrix("ffn_gate.weight", init.linear(n_ff, n_embd))
    matrix("ffn_up.weight", init.linear(n_ff, n_embd))
    matrix("ffn_down.weight", init.linear(n_embd, n_ff, gain))


def _add_hparams(w, **shape):
    add_model_hparams(w, **shape, rms_eps=RMS_EPS, rope_theta=ROPE_BASE)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_tiny_target(path, *, seed=0, n_embd=64, n_layer=4, n_head=4, n_head_kv=2,
                      head_dim=16, n_ff=128, n_ctx_train=2048, vocab_size=VOCAB_SIZE,
                      chat_template: str | None = CHATML_TEMPLATE, eos=None, head_type=None, fim=False,
                      arch="qwen3", layer_type=None) -> Path:
    """Random-weight qwen3 (or arch="llama": no q/k norms) model with a real tiny BPE tokenizer; chat_template=None
    writes none. `eos` makes another
    token the end-of-generation token (the weights, so the logits, stay the same). head_type (a
    gguf.GGMLQuantizationType) quantizes the token embeddings and the LM head, layer_type the layers' matrices. fim:
    the vocabulary has fill-in-the-middle tokens (FIM_TOKENS)."""
    tok = build_tokenizer(vocab_size, (*SPECIAL_TOKENS, *(FIM_TOKENS if fim else ())))
    n_vocab = len(tok["tokens"])
    init = _Init(seed)

    def fill(w):
        w.add_name("tiny-target")
        _add_hparams(w, n_ctx=n_ctx_train, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer,
                     n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
        _add_tokenizer(w, tok, chat_template, eos)
        for text, key in FIM_TOKENS.items() if fim else ():
            w.add_uint32(key, tok["special"][text])
        # Unit-variance embeddings and strong residual branches keep the random model
        # chaotic enough that greedy decoding does not lock onto one token at once.
        def vocab_rows(a):
            return a if head_type is None else gguf.quants.quantize(a, head_type)

        w.add_tensor("token_embd.weight",
                     vocab_rows(init.rng.standard_normal((n_vocab, n_embd)).astype(np.float32)), raw_dtype=head_type)
        for i in range(n_layer):
            _add_layer(w, init, i, n_embd, n_head, n_head_kv, head_dim, n_ff, gain=2.0, qk_norm=arch == "qwen3",
                       layer_type=layer_type)
        w.add_tensor("output_norm.weight", init.norm(n_embd))
        # separate (untied) head: a tied head mostly predicts the input token again
        w.add_tensor("output.weight", vocab_rows(init.linear(n_vocab, n_embd, gain=4.0)), raw_dtype=head_type)

    return write_gguf_atomic(path, arch, fill)


def write_tiny_moe(path, *, seed=3, n_embd=64, n_layer=4, n_head=2, n_head_kv=1, head_dim=32, n_expert=4,
                   n_expert_used=2, n_ff_exp=64, n_ctx_train=1024) -> Path:
    """Random-weight qwen3moe model (llama.cpp's tensor names: blk.N.ffn_{gate,up,down}_exps, ffn_gate_inp) with the
    tiny tokenizer. Heads of 32 values take quantized KV caches (blocks of 32)."""
    tok = build_tokenizer()
    n_vocab = len(tok["tokens"])
    init = _Init(seed)

    def q4_0(a: np.ndarray) -> np.ndarray:
        return gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_0)

    def fill(w):
        w.add_name("tiny-moe")
        _add_hparams(w, n_ctx=n_ctx_train, n_embd=n_embd, n_ff=n_ff_exp, n_layer=n_layer,
                     n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        _add_tokenizer(w, tok)
        w.add_tensor("token_embd.weight", init.rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "attn_q.weight", init.linear(n_head * head_dim, n_embd))
            w.add_tensor(p + "attn_k.weight", init.linear(n_head_kv * head_dim, n_embd))
            w.add_tensor(p + "attn_v.weight", init.linear(n_head_kv * head_dim, n_embd))
            w.add_tensor(p + "attn_output.weight", init.linear(n_embd, n_head * head_dim, 2.0))
            w.add_tensor(p + "attn_q_norm.weight", init.norm(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", init.norm(head_dim))
            w.add_tensor(p + "ffn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "ffn_gate_inp.weight", init.linear(n_expert, n_embd, 4.0))
            for name, (n_out, n_in, gain) in {"gate": (n_ff_exp, n_embd, 1.0), "up": (n_ff_exp, n_embd, 1.0),
                                              "down": (n_embd, n_ff_exp, 2.0)}.items():
                experts = np.stack([init.linear(n_out, n_in, gain) for _ in range(n_expert)])
                w.add_tensor(p + f"ffn_{name}_exps.weight", q4_0(experts), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        w.add_tensor("output_norm.weight", init.norm(n_embd))
        w.add_tensor("output.weight", init.linear(n_vocab, n_embd, gain=4.0))

    return write_gguf_atomic(path, "qwen3moe", fill)


def write_tiny_drafter(path, target_path, *, target_layers=(2, 3), block_size=8, **kw) -> Path:
    """A tiny DFlash drafter for the target, written by the product's own initialiser."""
    return init_drafter(path, target_path, target_layers=list(target_layers), block_size=block_size,
                        n_head=4, n_head_kv=2, head_dim=16, n_ff=128, seed=1, **kw)


def with_inf_in_fc(src, dst) -> Path:
    """A copy of an f32 drafter GGUF with one inf in fc.weight: every target feature row it projects, and so every
    draft logit (and DFlash2 lattice score), comes out NaN, as an f16 fc made them on gemma-3's features."""
    shutil.copyfile(src, dst)
    fc = next(t for t in gguf.GGUFReader(dst, "r+").tensors if t.name == "fc.weight")
    assert fc.tensor_type == gguf.GGMLQuantizationType.F32
    fc.data[0, 0] = np.inf
    fc.data.flush()
    return Path(dst)


def write_tiny_mamba(path, *, n_embd=32, n_layer=2, d_inner=64, d_state=8, d_conv=4, dt_rank=4) -> Path:
    """Random-weight mamba (purely recurrent memory) model with the tiny tokenizer."""
    tok = build_tokenizer()
    n_vocab = len(tok["tokens"])
    init = _Init(2)

    def fill(w):
        w.add_name("tiny-mamba")
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        _add_tokenizer(w, tok)
        w.add_tensor("token_embd.weight", init.rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "ssm_in.weight", init.linear(2 * d_inner, n_embd))
            w.add_tensor(p + "ssm_conv1d.weight", init.linear(d_inner, d_conv))
            w.add_tensor(p + "ssm_conv1d.bias", init.norm(d_inner))
            w.add_tensor(p + "ssm_x.weight", init.linear(dt_rank + 2 * d_state, d_inner))
            w.add_tensor(p + "ssm_dt.weight", init.linear(d_inner, dt_rank))
            w.add_tensor(p + "ssm_dt.bias", init.norm(d_inner))
            w.add_tensor(p + "ssm_a", -np.ones((d_inner, d_state), dtype=np.float32))
            w.add_tensor(p + "ssm_d", init.norm(d_inner))
            w.add_tensor(p + "ssm_out.weight", init.linear(n_embd, d_inner))
        w.add_tensor("output_norm.weight", init.norm(n_embd))

    return write_gguf_atomic(path, "mamba", fill)


def write_tiny_qwen35(path, *, seed=3, n_embd=64, n_layer=4, full_attention_interval=2, n_head=4, n_head_kv=2,
                      head_dim=16, n_ff=128, d_state=16, n_group=2, n_v_heads=4, d_conv=4) -> Path:
    """Random-weight qwen35 (Qwen3.5) hybrid model: Gated DeltaNet layers with an attention layer every
    `full_attention_interval` layers, as llama.cpp's qwen35 loader reads them (src/models/qwen35.cpp)."""
    tok = build_tokenizer()
    n_vocab = len(tok["tokens"])
    init = _Init(seed)
    arch = "qwen35"
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads

    def fill(w):
        w.add_name("tiny-qwen35")
        _add_hparams(w, n_ctx=2048, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head,
                     n_head_kv=n_head_kv, head_dim=head_dim)
        w.add_rope_dimension_count(head_dim)
        # text-only positions: the M-RoPE sections only need to cover the rotated pairs
        w.add_key_value(f"{arch}.rope.dimension_sections", [3, 3, 2, 0], gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.INT32)
        w.add_uint32(f"{arch}.full_attention_interval", full_attention_interval)
        w.add_uint32(f"{arch}.ssm.conv_kernel", d_conv)
        w.add_uint32(f"{arch}.ssm.inner_size", value_dim)
        w.add_uint32(f"{arch}.ssm.state_size", d_state)
        w.add_uint32(f"{arch}.ssm.time_step_rank", n_v_heads)
        w.add_uint32(f"{arch}.ssm.group_count", n_group)
        _add_tokenizer(w, tok)
        w.add_tensor("token_embd.weight", init.rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "post_attention_norm.weight", init.norm(n_embd))
            if (i + 1) % full_attention_interval == 0:
                # the query projection also yields the output gate: 2 * head_dim per head
                w.add_tensor(p + "attn_q.weight", init.linear(2 * n_head * head_dim, n_embd))
                w.add_tensor(p + "attn_k.weight", init.linear(n_head_kv * head_dim, n_embd))
                w.add_tensor(p + "attn_v.weight", init.linear(n_head_kv * head_dim, n_embd))
                w.add_tensor(p + "attn_output.weight", init.linear(n_embd, n_head * head_dim, 2.0))
                w.add_tensor(p + "attn_q_norm.weight", init.norm(head_dim))
                w.add_tensor(p + "attn_k_norm.weight", init.norm(head_dim))
            else:
                w.add_tensor(p + "attn_qkv.weight", init.linear(2 * key_dim + value_dim, n_embd))
                w.add_tensor(p + "attn_gate.weight", init.linear(value_dim, n_embd))
                w.add_tensor(p + "ssm_conv1d.weight", init.linear(2 * key_dim + value_dim, d_conv))
                w.add_tensor(p + "ssm_dt.bias", init.norm(n_v_heads))
                w.add_tensor(p + "ssm_a", -np.exp(init.rng.uniform(-1, 1, n_v_heads)).astype(np.float32))
                w.add_tensor(p + "ssm_beta.weight", init.linear(n_v_heads, n_embd))
                w.add_tensor(p + "ssm_alpha.weight", init.linear(n_v_heads, n_embd))
                w.add_tensor(p + "ssm_norm.weight", init.norm(d_state))
                w.add_tensor(p + "ssm_out.weight", init.linear(n_embd, value_dim, 2.0))
            w.add_tensor(p + "ffn_gate.weight", init.linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_up.weight", init.linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_down.weight", init.linear(n_embd, n_ff, 2.0))
        w.add_tensor("output_norm.weight", init.norm(n_embd))
        head = init.linear(n_vocab, n_embd, gain=4.0)
        # control tokens get logit 0, never the largest: generations run to max_tokens, over hundreds of steps
        head[[tok["special"][t] for t in SPECIAL_TOKENS]] = 0.0
        w.add_tensor("output.weight", head)

    return write_gguf_atomic(path, arch, fill)


def write_tiny_gemma4(path, *, seed=4, n_embd=64, n_head=4, head_dim_swa=16, head_dim_full=32, n_ff=128,
                      swa_pattern=(True, True, True, False, True, False), n_shared_kv=2, sliding_window=8,
                      n_embd_per_layer=8, softcap=30.0) -> Path:
    """Random-weight gemma4 model with the parts llama.cpp's gemma4 loader and graph read (src/models/gemma4.cpp):
    sliding-window layers (a window shorter than the prompts) beside full-attention layers with their own head
    size, KV head count, RoPE base and proportional RoPE (rope_freqs); full layers whose V is their K (no attn_v);
    the last `n_shared_kv` layers reading the KV cache of earlier ones; per-layer token embeddings; post-attention
    and post-FFN norms, GELU FFNs, a per-layer output scale; embeddings scaled by sqrt(n_embd) in the graph and
    final logit soft-capping."""
    tok = build_tokenizer()
    n_vocab = len(tok["tokens"])
    init = _Init(seed)
    arch = "gemma4"
    n_layer = len(swa_pattern)
    n_kv_layers = n_layer - n_shared_kv
    # llama.cpp's KV reuse: a shared sliding layer reads layer n_kv_layers - 2, a shared full one n_kv_layers - 1
    assert swa_pattern[n_kv_layers - 2] and not swa_pattern[n_kv_layers - 1]
    n_head_kv = [2 if swa else 1 for swa in swa_pattern]
    n_rot_full = head_dim_full // 4  # proportional RoPE: a quarter of a full layer's head rotates

    def fill(w):
        w.add_name("tiny-gemma4")
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_block_count(n_layer)
        w.add_head_count(n_head)
        w.add_key_value(f"{arch}.attention.head_count_kv", n_head_kv, gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.UINT32)
        w.add_key_length(head_dim_full)
        w.add_value_length(head_dim_full)
        w.add_uint32(f"{arch}.attention.key_length_swa", head_dim_swa)
        w.add_uint32(f"{arch}.attention.value_length_swa", head_dim_swa)
        w.add_rope_dimension_count(head_dim_full)
        w.add_uint32(f"{arch}.rope.dimension_count_swa", head_dim_swa)
        w.add_rope_freq_base(1e6)
        w.add_float32(f"{arch}.rope.freq_base_swa", ROPE_BASE)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_sliding_window(sliding_window)
        w.add_key_value(f"{arch}.attention.sliding_window_pattern", list(swa_pattern), gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.BOOL)
        w.add_uint32(f"{arch}.attention.shared_kv_layers", n_shared_kv)
        w.add_uint32(f"{arch}.embedding_length_per_layer_input", n_embd_per_layer)
        w.add_float32(f"{arch}.final_logit_softcapping", softcap)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        _add_tokenizer(w, tok)
        # the graph multiplies the embeddings by sqrt(n_embd): rows of norm ~1 give a unit-scale residual stream that
        # the layers' normed branches can move (much larger embeddings would make a bigram model of it)
        w.add_tensor("token_embd.weight", init.linear(n_vocab, n_embd))
        w.add_tensor("per_layer_token_embd.weight", init.linear(n_vocab, n_embd_per_layer * n_layer))
        w.add_tensor("per_layer_model_proj.weight", init.linear(n_embd_per_layer * n_layer, n_embd))
        w.add_tensor("per_layer_proj_norm.weight", init.norm(n_embd_per_layer))
        # full layers rotate their first n_rot_full / 2 pairs; a huge frequency factor stops the other pairs
        n_pairs = head_dim_full // 2
        w.add_tensor("rope_freqs.weight", np.array([1.0] * (n_rot_full // 2) + [1e30] * (n_pairs - n_rot_full // 2),
                                                   dtype=np.float32))
        for i, swa in enumerate(swa_pattern):
            p = f"blk.{i}."
            hd = head_dim_swa if swa else head_dim_full
            w.add_tensor(p + "attn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "attn_q.weight", init.linear(n_head * hd, n_embd))
            w.add_tensor(p + "attn_q_norm.weight", init.norm(hd))
            if i < n_kv_layers:  # the shared layers have no K/V of their own
                w.add_tensor(p + "attn_k.weight", init.linear(n_head_kv[i] * hd, n_embd))
                if swa:  # full layers use their K as V (attention_k_eq_v)
                    w.add_tensor(p + "attn_v.weight", init.linear(n_head_kv[i] * hd, n_embd))
                w.add_tensor(p + "attn_k_norm.weight", init.norm(hd))
            w.add_tensor(p + "attn_output.weight", init.linear(n_embd, n_head * hd))
            w.add_tensor(p + "post_attention_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "ffn_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "ffn_gate.weight", init.linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_up.weight", init.linear(n_ff, n_embd))
            w.add_tensor(p + "ffn_down.weight", init.linear(n_embd, n_ff))
            w.add_tensor(p + "post_ffw_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "inp_gate.weight", init.linear(n_embd_per_layer, n_embd))
            w.add_tensor(p + "proj.weight", init.linear(n_embd, n_embd_per_layer))
            w.add_tensor(p + "post_norm.weight", init.norm(n_embd))
            w.add_tensor(p + "layer_output_scale.weight", init.norm(1))
        w.add_tensor("output_norm.weight", init.norm(n_embd))
        head = init.linear(n_vocab, n_embd, gain=4.0)
        # control tokens get logit 0, never the largest: generations run to max_tokens
        head[[tok["special"][t] for t in SPECIAL_TOKENS]] = 0.0
        w.add_tensor("output.weight", head)

    return write_gguf_atomic(path, arch, fill)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/fixtures.py OUTDIR")
    out = Path(sys.argv[1])
    tgt = write_tiny_target(out / "tiny-target.gguf")
    dft = write_tiny_drafter(out / "tiny-drafter.gguf", tgt)
    print(tgt)
    print(dft)
