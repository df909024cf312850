"""Checks on a target GGUF and a DFlash drafter GGUF, made before llama.cpp sees them.

llama.cpp aborts the whole process on many failed asserts (a feature layer out of range, a feature width that does
not match the drafter's fc, a missing mask token), so everything it would trip on is checked here first.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_file import ArrayInfo, GGUFInfo, read_gguf


class PairError(ValueError):
    """The drafter does not fit the target."""


@dataclass
class DraftSpec:
    layers: list[int]  # target layer-input indices whose hidden states feed the drafter
    block_size: int
    mask_token: int
    anchor_first: bool = False  # DSpark: the block's first slot drafts too, so a block drafts block_size tokens

    def longest_draft(self, block_size: int) -> int:
        """The longest draft of a block of block_size slots: its mask slots, and its anchor slot too when the
        drafter is anchor-first (DSpark). The one copy of this rule on the Python side (native/session.h keeps its
        own to bound the drafts it is asked for)."""
        return block_size if self.anchor_first else block_size - 1

    @property
    def max_draft(self) -> int:
        """The longest draft of a trained-size block."""
        return self.longest_draft(self.block_size)


def drafter_variant(draft: GGUFInfo) -> str:
    """Which graph llama.cpp builds for a dflash GGUF: the tensor that switches each variant on."""
    if "selector_hidden.weight" in draft.tensors:
        return "DFlash2"
    return "DSpark" if "markov_w1.weight" in draft.tensors else "DFlash"


def _need(info: GGUFInfo, key: str):
    value = info.get(key)
    if value is None:
        raise PairError(f"{info.path.name}: missing metadata '{info.arch}.{key}'")
    return value


def check_target(info: GGUFInfo) -> None:
    if not info.arch:
        raise PairError(f"{info.path.name}: no general.architecture")
    if info.arch == "dflash":
        raise PairError(f"{info.path.name} is a DFlash drafter, not a target model")
    if info.n_vocab == 0:
        raise PairError(f"{info.path.name}: no tokenizer vocabulary")
    _need(info, "block_count")
    _need(info, "embedding_length")


def check_pair(target: GGUFInfo, draft: GGUFInfo) -> DraftSpec:
    """Validate that `draft` is a DFlash drafter made for `target`; return what the runtime needs."""
    name = draft.path.name
    if draft.arch != "dflash":
        raise PairError(f"{name}: architecture is '{draft.arch}', expected a 'dflash' drafter")
    _need(target, "block_count")
    n_layer = target.n_layer
    n_embd = _need(target, "embedding_length")

    layers = draft.get("target_layers")
    if not isinstance(layers, ArrayInfo) or not layers.values:
        raise PairError(f"{name}: missing 'dflash.target_layers'")
    layers = [int(v) for v in layers.values]
    bad = [lid for lid in layers if not 1 <= lid < n_layer]
    if bad:
        raise PairError(
            f"{name}: target layers {bad} do not exist in {target.path.name}, whose layer inputs run 1..{n_layer - 1} "
            f"(the drafter was made for a deeper model)"
        )

    fc = draft.tensors.get("fc.weight")
    if fc is None:
        raise PairError(f"{name}: missing tensor fc.weight")
    if fc.shape[0] != len(layers) * n_embd:
        raise PairError(
            f"{name}: fc.weight takes {fc.shape[0]} features, but {len(layers)} layers of {target.path.name} "
            f"give {len(layers)} x {n_embd} = {len(layers) * n_embd} (hidden size mismatch)"
        )
    d_embd = _need(draft, "embedding_length")
    if "token_embd.weight" not in draft.tensors and d_embd != n_embd:
        raise PairError(
            f"{name}: hidden size {d_embd} differs from the target's {n_embd}, and the drafter has no embeddings "
            f"of its own to use instead of the target's"
        )

    if draft.n_vocab != target.n_vocab:
        raise PairError(f"{name}: vocabulary of {draft.n_vocab} tokens, the target has {target.n_vocab}")
    if draft.kv["tokenizer.ggml.tokens"].digest != target.kv["tokenizer.ggml.tokens"].digest:
        raise PairError(f"{name}: its tokenizer differs from the target's (same size, different tokens)")
    mask = draft.kv.get("tokenizer.ggml.mask_token_id")
    if mask is None or not 0 <= mask < target.n_vocab:
        raise PairError(f"{name}: missing or invalid tokenizer.ggml.mask_token_id ({mask})")

    block_size = int(draft.get("block_size", 16))
    if not 2 <= block_size <= 64:
        raise PairError(f"{name}: block size {block_size} outside 2..64")
    variant = drafter_variant(draft)
    if variant == "DFlash2":
        _check_dflash2(draft, target.n_vocab)
    anchor_first = variant == "DSpark" and _check_dspark(draft, target.n_vocab)
    return DraftSpec(layers, block_size, int(mask), anchor_first)


def check_checkpoint_pair(c, target: GGUFInfo, warn) -> int | None:
    """Check that a z-lab checkpoint was made for `target`, before anything is converted or loaded; return its mask
    token id (the checkpoint's, else the target's; None if neither names one). `c` is the checkpoint's config
    (dflash_local.convert.zlab_checkpoint.DrafterConfig): its hidden, target_layer_ids, num_target_layers,
    vocab_size and mask_token_id are read. The converter checks with it, and so does the PyTorch drafter, which runs
    a checkpoint folder unconverted: it lives with the pair checks so that the engine never imports the converter."""
    name = target.path.name
    if not target.arch:
        raise PairError(f"{name}: no general.architecture: not a model GGUF")
    if target.arch == "dflash":
        raise PairError(f"{name} is a DFlash drafter; --target must be the target model the drafter serves")
    n_vocab, n_embd, n_layer = target.n_vocab, target.get("embedding_length"), target.n_layer
    if not n_vocab or not n_embd or not n_layer:
        raise PairError(f"{name}: missing tokenizer, embedding_length or block_count metadata")
    if c.hidden != n_embd:
        raise PairError(
            f"drafter/target mismatch: the drafter's hidden size is {c.hidden}, {name} has {n_embd} "
            f"(the drafter was made for another model)"
        )
    bad = [i for i in c.target_layer_ids if not 0 <= i <= n_layer - 2]
    if bad:
        raise PairError(
            f"drafter/target mismatch: target_layer_ids {bad} do not exist in {name}, whose {n_layer} layers give "
            f"features 0..{n_layer - 2} (the drafter was made for a deeper model)"
        )
    if c.num_target_layers and c.num_target_layers != n_layer:
        warn(f"the drafter was trained on a {c.num_target_layers}-layer target, {name} has {n_layer} layers")
    if c.vocab_size and c.vocab_size != n_vocab:
        raise PairError(
            f"drafter/target mismatch: the drafter's vocabulary has {c.vocab_size} tokens, {name} has {n_vocab}"
        )
    mask = c.mask_token_id
    if mask is None:
        mask = target.kv.get("tokenizer.ggml.mask_token_id")
    if mask is not None and not 0 <= int(mask) < n_vocab:
        raise PairError(f"drafter/target mismatch: mask token {mask} is outside {name}'s {n_vocab} tokens")
    return mask


def _check_dflash2(draft: GGUFInfo, n_vocab: int) -> None:
    """DFlash2's selector picks its top_k candidates from the vocabulary (more than it has aborts in ggml) and packs
    top_k * (top_k + 1) values into a row of the drafter's width."""
    name = draft.path.name
    keys = ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size")
    values = {k: draft.get(k) for k in keys}
    missing = [k for k, v in values.items() if not v]
    if missing:
        raise PairError(f"{name}: a DFlash2 drafter without {', '.join(f'dflash.{k}' for k in missing)}")
    k, width = values["selector_top_k"], _need(draft, "embedding_length")
    if k > n_vocab or k * (k + 1) > width:
        raise PairError(f"{name}: selector_top_k {k} does not fit (vocabulary {n_vocab}, a lattice row of {width})")


def _check_dspark(draft: GGUFInfo, n_vocab: int) -> bool:
    """DSpark's heads, shaped as llama.cpp's loader wants them (it throws on a mismatch, after loading the rest);
    returns whether its blocks are anchor-first (llama.cpp's default when the key is absent)."""
    name = draft.path.name
    w1, width = draft.tensors["markov_w1.weight"], _need(draft, "embedding_length")
    rank = w1.shape[0]
    if w1.shape[1] != n_vocab:
        raise PairError(f"{name}: markov_w1 has {w1.shape[1]} rows, the vocabulary {n_vocab} tokens")
    conf = draft.tensors.get("conf_proj.weight")
    if conf is not None and tuple(conf.shape) != (width + rank, 1):
        raise PairError(f"{name}: conf_proj.weight is {list(conf.shape)}, llama.cpp needs [{width + rank}, 1]")
    return bool(draft.get("sample_from_anchor", True))


def load_infos(model_path, draft_path=None) -> tuple[GGUFInfo, GGUFInfo | None]:
    target = read_gguf(model_path)
    check_target(target)
    draft = read_gguf(draft_path) if draft_path else None
    return target, draft
