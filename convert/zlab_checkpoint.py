"""A z-lab DFlash drafter checkpoint (Hugging Face layout): its config and its tensors, named the GGUF way.

The layout: config.json with `architectures: ["DFlashDraftModel"]`, Qwen3 fields and `dflash_config`
({target_layer_ids, mask_token_id}); weights in one or several safetensors shards (an index json maps names to
shards when there are several), named without a `model.` prefix: fc, hidden_norm, layers.N.*, norm. No embeddings
and no LM head: the target's are used. Everything is checked here, before a byte of output is written.

DFlash2 (`DFlash2DraftModel`) adds to dflash_config conv_kernel_size, conv_group_size, selector_rank and
selector_top_k, and to the weights a grouped dynamic convolution around each layer's attention and MLP
(layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}) and a candidate selector
(candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}).

DSpark (`DSparkDraftModel` and the other names upstream's converter registers) is DFlash plus a Markov head
(markov_head.markov_w1 [vocab, rank], an embedding of the previous block token, and markov_head.markov_w2
[draft vocab, rank], its projection to a logit bias) and an optional confidence head (confidence_head.proj, a
[1, hidden + rank] linear with bias over the final hidden state and the Markov embedding). Its config comes in two
schemas, normalized here as upstream's converter does: DeepSpec's (Qwen3 fields, target_layer_ids and
mask_token_id at the top level or in dflash_config; anchor-first blocks) and the speculators/SpecForge one
(transformer_layer_config nested, 1-based aux_hidden_state_layer_ids; a bonus anchor slot before the drafts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_local.atomic import atomic_output

from .errors import ConvertError
from .safetensors_file import SafeTensor, read_header

DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel")
SUPPORTED_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel") + DSPARK_ARCHS

# z-lab name (after "layers.N.") -> GGUF name (after "blk.N."), as upstream llama.cpp's dflash architecture loads them
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # DFlash2's convolutions; the base kernels have no ".weight" in either naming
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",  # the norm after fc ("encoder" output norm upstream)
    "norm.weight": "output_norm.weight",
    "embed_tokens.weight": "token_embd.weight",  # optional: drafters normally borrow the target's
    "lm_head.weight": "output.weight",  # optional: present with a reduced draft vocabulary
    "d2t": "d2t",  # draft row -> target token, stored as offsets (target id = d2t[i] + i)
    # DFlash2's candidate selector
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    # DSpark's Markov and confidence heads
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
_SKIPPED = ("t2d",)  # the inverse map, unused at runtime (upstream drops it too)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass
class DrafterConfig:
    hidden: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]  # z-lab ids: the OUTPUT of layer i; GGUF stores i + 1 (layer-input index)
    mask_token_id: int | None
    vocab_size: int | None
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None
    context_length: int | None = None
    rope_scaling: dict | None = None
    n_rot: int | None = None  # partial rotary
    causal: bool = False
    sliding_window: int | None = None
    swa_layers: list[bool] | None = None
    embedding_scale: float | None = None
    logit_scale: float | None = None
    logit_softcap: float | None = None
    value_scale: float | None = None
    name: str = ""
    # DFlash2 only (None for DFlash)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # DSpark only
    dspark: bool = False
    markov_rank: int | None = None  # from config.json when it says, else from markov_w1's shape
    sample_from_anchor: bool = True  # the first block slot drafts (False: a bonus anchor slot, as DFlash's)
    has_confidence_head: bool = False

    @property
    def variant(self) -> str:
        return "DFlash2" if self.selector_top_k else "DSpark" if self.dspark else "DFlash"


@dataclass
class PlannedTensor:
    name: str  # GGUF name
    src: SafeTensor | None  # where its values are read from, or None when `data` holds them
    shape: tuple[int, ...]  # numpy order: (rows, row length) or (n,)
    kind: str  # "matrix" (quantizable), "vector" (norms, kept f32) or "index" (d2t, int64)
    data: np.ndarray | None = None  # values made by the converter (d2t as absolute ids, a reduced LM head)


@dataclass
class Checkpoint:
    path: Path
    config: DrafterConfig
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        n = 0
        for t in self.tensors:
            k = 1
            for d in t.shape:
                k *= d
            n += k
        return n

    @property
    def source_dtypes(self) -> set[str]:
        return {t.src.dtype for t in self.tensors if t.kind == "matrix" and t.src is not None}


def _need(cfg: dict, key: str, where: str = "config.json"):
    if key not in cfg or cfg[key] is None:
        raise ConvertError(f"{where}: missing '{key}'")
    return cfg[key]


def read_config(path: Path) -> DrafterConfig:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{cfg_path}: unreadable: {e}") from None
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        raise ConvertError(
            f"{cfg_path}: unknown architecture {archs or '(none)'}; the converter reads z-lab DFlash drafters "
            f"({', '.join(SUPPORTED_ARCHS)})"
        )
    dspark = any(a in DSPARK_ARCHS for a in archs)
    if dspark:
        cfg = _dspark_config(cfg, cfg_path)
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        raise ConvertError(
            f"{cfg_path}: missing 'dflash_config' (with target_layer_ids and mask_token_id): not a DFlash drafter "
            f"config, or an incomplete one"
        )
    ids = dc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ConvertError(f"{cfg_path}: dflash_config.target_layer_ids must be a non-empty list of layer numbers")
    hidden = int(_need(cfg, "hidden_size"))
    n_head = int(_need(cfg, "num_attention_heads"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"{cfg_path}: hidden_act '{cfg['hidden_act']}' is not supported (DFlash drafters use silu)")
    if cfg.get("attention_bias"):
        raise ConvertError(f"{cfg_path}: attention biases are not supported by llama.cpp's dflash architecture")
    if cfg.get("rope_is_neox_style", True) is False:
        raise ConvertError(f"{cfg_path}: interleaved (non-NeoX) RoPE checkpoints are not supported")

    # transformers >= 5 nests rope settings in rope_parameters; older configs have rope_theta and rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type"))
    scaling = rope if rope_type not in (None, "default") else None
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))

    n_layer = int(_need(cfg, "num_hidden_layers"))
    sliding, swa_layers = None, None
    if cfg.get("use_sliding_window") or dc.get("use_swa"):
        sliding = dc.get("swa_window_size") or cfg.get("sliding_window")
        if sliding:
            layer_types = cfg.get("layer_types") or []
            swa_layers = [t == "sliding_attention" for t in layer_types]
            if dc.get("use_swa") or not layer_types:
                swa_layers = [True] * n_layer
    causal = cfg.get("is_causal", dc.get("causal", False))
    dflash2 = _dflash2_fields(dc, hidden, cfg.get("vocab_size"), cfg_path) if "DFlash2DraftModel" in archs else {}
    return DrafterConfig(
        hidden=hidden,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        n_ff=int(_need(cfg, "intermediate_size")),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
        target_layer_ids=list(ids),
        mask_token_id=dc.get("mask_token_id"),
        vocab_size=cfg.get("vocab_size"),
        num_target_layers=cfg.get("num_target_layers"),
        draft_vocab_size=cfg.get("draft_vocab_size"),
        context_length=cfg.get("max_position_embeddings"),
        rope_scaling=scaling,
        n_rot=int(head_dim * partial) if partial is not None else None,
        causal=bool(causal),
        sliding_window=int(sliding) if sliding else None,
        swa_layers=swa_layers,
        embedding_scale=dc.get("input_embedding_scale", cfg.get("input_embedding_scale")),
        logit_scale=dc.get("output_multiplier", cfg.get("output_multiplier")),
        logit_softcap=dc.get("final_logit_softcapping", cfg.get("final_logit_softcapping")),
        value_scale=dc.get("attention_value_scale"),
        name=str(cfg.get("_name_or_path") or path.name),
        dspark=dspark,
        markov_rank=cfg.get("markov_rank") if dspark else None,
        sample_from_anchor=bool(cfg.get("sample_from_anchor", True)) if dspark else True,
        **dflash2,
    )


def _dspark_config(cfg: dict, cfg_path: Path) -> dict:
    """A DSpark config in DFlash's shape, normalized as upstream's converter does: EAGLE3-style exports (a nested
    transformer_layer_config, 1-based aux_hidden_state_layer_ids) draft after a bonus anchor slot unless they say
    sample_from_anchor; the others draft from the anchor slot on, with their layer ids and mask token in
    dflash_config or at the top level."""
    eagle = "transformer_layer_config" in cfg or "aux_hidden_state_layer_ids" in cfg
    out = {**cfg, "sample_from_anchor": cfg.get("sample_from_anchor", not eagle)}
    if isinstance(cfg.get("transformer_layer_config"), dict):
        out.update(cfg["transformer_layer_config"])
    if "dflash_config" not in out:
        if "aux_hidden_state_layer_ids" in out:
            aux = out["aux_hidden_state_layer_ids"]
            if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
                raise ConvertError(f"{cfg_path}: aux_hidden_state_layer_ids must be a list of layer numbers")
            out["dflash_config"] = {"mask_token_id": out.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]}
        else:
            out["dflash_config"] = {k: out[k] for k in ("target_layer_ids", "mask_token_id") if k in out}
    if out.get("markov_head_type", "vanilla") != "vanilla":
        raise ConvertError(f"{cfg_path}: markov_head_type {out['markov_head_type']!r} is not supported (llama.cpp "
                           f"runs the 'vanilla' Markov head only)")
    return out


def _dflash2_fields(dc: dict, hidden: int, vocab_size, cfg_path: Path) -> dict:
    """DFlash2's settings, read from dflash_config (where upstream's converter reads them), checked as llama.cpp's
    loader and graph will need them."""
    out = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v = dc.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConvertError(f"{cfg_path}: a DFlash2 drafter needs dflash_config.{key} (a positive integer), "
                               f"got {v!r}")
        out[key] = v
    if hidden % out["conv_group_size"]:
        raise ConvertError(f"{cfg_path}: hidden_size {hidden} is not a multiple of conv_group_size "
                           f"{out['conv_group_size']}")
    k = out["selector_top_k"]
    if k * (k + 1) > hidden:  # llama.cpp packs k candidates and k x k scores into one hidden-wide row
        raise ConvertError(f"{cfg_path}: selector_top_k {k} needs a hidden size of at least {k * (k + 1)}, "
                           f"not {hidden}")
    if not vocab_size:
        raise ConvertError(f"{cfg_path}: a DFlash2 drafter needs vocab_size (its selector has a row per token)")
    if k > vocab_size:
        raise ConvertError(f"{cfg_path}: selector_top_k {k} is larger than the vocabulary ({vocab_size})")
    return out


def find_tensors(path: Path) -> dict[str, SafeTensor]:
    """All tensors of the checkpoint, from the index json when there is one, else from every *.safetensors."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    tensors: dict[str, SafeTensor] = {}
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{indexes[0]}: unreadable index ({e})") from None
        headers = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise ConvertError(f"{path}: shard {shard} listed in {indexes[0].name} is missing")
            headers[shard] = read_header(path / shard)
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise ConvertError(f"{path / shard}: tensor {name} listed in {indexes[0].name} is not in the shard")
            tensors[name] = headers[shard][name]
        return tensors
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ConvertError(f"{path}: no *.safetensors weights")
    for shard in shards:
        for name, t in read_header(shard).items():
            if name in tensors:
                raise ConvertError(f"{path}: tensor {name} is in both {tensors[name].path.name} and {shard.name}")
            tensors[name] = t
    return tensors


def _expected_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv = c.hidden, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    out = {
        "fc.weight": (h, len(c.target_layer_ids) * h),
        "enc.output_norm.weight": (h,),
        "output_norm.weight": (h,),
    }
    for i in range(c.n_layer):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": (h,),
            p + "ffn_norm.weight": (h,),
            p + "attn_q.weight": (q, h),
            p + "attn_k.weight": (kv, h),
            p + "attn_v.weight": (kv, h),
            p + "attn_output.weight": (h, q),
            p + "attn_q_norm.weight": (c.head_dim,),
            p + "attn_k_norm.weight": (c.head_dim,),
            p + "ffn_gate.weight": (c.n_ff, h),
            p + "ffn_up.weight": (c.n_ff, h),
            p + "ffn_down.weight": (h, c.n_ff),
        })
        if c.selector_top_k:
            conv = (2, c.conv_kernel_size, h)
            proj = (2 * c.conv_kernel_size * (h // c.conv_group_size), h)
            out.update({p + "attn_conv_base": conv, p + "attn_conv_proj.weight": proj,
                        p + "ffn_conv_base": conv, p + "ffn_conv_proj.weight": proj})
    if c.dspark:
        r, n_draft = c.markov_rank, c.draft_vocab_size or c.vocab_size
        out.update({"markov_w1.weight": (c.vocab_size, r), "markov_w2.weight": (n_draft, r)})
    if c.selector_top_k:
        out.update({
            "selector_predecessor.weight": (c.vocab_size, c.selector_rank),
            "selector_successor.weight": (c.vocab_size, c.selector_rank),
            "selector_hidden.weight": (c.selector_rank, h),
        })
    return out


def gguf_name(name: str) -> str | None:
    """GGUF name of a z-lab tensor; None for tensors dropped on purpose; ConvertError for unknown ones."""
    name = name.removeprefix("model.")
    if name in _SKIPPED:
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ConvertError(
        f"unexpected tensor '{name}': not part of a DFlash, DFlash2 or DSpark drafter (other variants are not "
        f"supported)"
    )


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a z-lab drafter directory: config, shards, tensor names and shapes."""
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"{path}: no such directory")
    c = read_config(path)
    found = find_tensors(path)
    if c.dspark:
        _check_dspark(c, found, path)
    expected = _expected_shapes(c)
    planned: dict[str, PlannedTensor] = {}
    for hf_name, t in found.items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        shape = tuple(t.shape)
        if _is_dflash2_name(name) and not c.selector_top_k:
            raise ConvertError(
                f"unexpected tensor '{hf_name}': a DFlash2 tensor, but config.json says {c.variant} "
                f"(architectures: DFlash2DraftModel, with its conv and selector settings)"
            )
        if name.startswith(("markov_", "conf_proj")) and not c.dspark:
            raise ConvertError(f"unexpected tensor '{hf_name}': a DSpark tensor, but config.json says {c.variant} "
                               f"(architectures: DSparkDraftModel)")
        if c.dspark and name == "output.weight" and not (c.draft_vocab_size or c.vocab_size) < (c.vocab_size or 0):
            continue  # a full-vocabulary DSpark drafter uses the target's LM head (upstream drops its copy too)
        if name in expected and shape != expected[name]:
            raise ConvertError(
                f"{t.path.name}: tensor {hf_name} has shape {list(shape)}, config.json implies {list(expected[name])}"
            )
        if name.startswith("blk.") and int(name.split(".")[1]) >= c.n_layer:
            raise ConvertError(f"{t.path.name}: tensor {hf_name} is past num_hidden_layers = {c.n_layer}")
        kind = "index" if name == "d2t" else "matrix" if len(shape) == 2 else "vector"
        planned[name] = PlannedTensor(name, t, shape, kind)
    missing = [n for n in expected if n not in planned]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConvertError(f"{path}: missing tensors {', '.join(missing[:3])}{more}")
    _check_draft_vocab(c, planned, path)
    extra = ("token_embd.weight", "output.weight", "d2t", "conf_proj.weight", "conf_proj.bias")
    order = list(expected) + [n for n in extra if n in planned]
    return Checkpoint(path, c, [planned[n] for n in order])


def _check_dspark(c: DrafterConfig, found: dict[str, SafeTensor], path: Path) -> None:
    """The Markov rank (from the heads when config.json does not say it), and a confidence head llama.cpp can run:
    it reads [final hidden ; Markov embedding of the previous token], so the head must be [1, hidden + rank]."""
    found = {n.removeprefix("model."): t for n, t in found.items()}
    w1 = found.get("markov_head.markov_w1.weight")
    if w1 is None or len(w1.shape) != 2:
        raise ConvertError(f"{path}: a DSpark drafter needs markov_head.markov_w1.weight [vocab, rank]")
    if not c.vocab_size:
        raise ConvertError(f"{path}: a DSpark drafter needs vocab_size (its Markov head has a row per token)")
    rank = int(w1.shape[1])
    if c.markov_rank is not None and c.markov_rank != rank:
        raise ConvertError(f"{w1.path.name}: markov_w1 has rank {rank}, config.json says markov_rank {c.markov_rank}")
    c.markov_rank = rank
    c.has_confidence_head = "confidence_head.proj.weight" in found
    conf = found.get("confidence_head.proj.weight")
    if conf is not None and tuple(conf.shape) != (1, c.hidden + rank):
        raise ConvertError(
            f"{conf.path.name}: confidence_head.proj.weight has shape {list(conf.shape)}; llama.cpp's DSpark graph "
            f"reads [hidden ; Markov embedding], i.e. [1, {c.hidden + rank}] (confidence_head_with_markov)"
        )
    bias = found.get("confidence_head.proj.bias")
    if bias is not None and (conf is None or tuple(bias.shape) != (1,)):
        raise ConvertError(f"{path}: confidence_head.proj.bias must be [1] beside confidence_head.proj.weight")


def _is_dflash2_name(name: str) -> bool:
    return name.startswith("selector_") or "_conv_" in name


def _check_draft_vocab(c: DrafterConfig, planned: dict[str, PlannedTensor], path: Path) -> None:
    head, d2t = planned.get("output.weight"), planned.get("d2t")
    n_draft = c.draft_vocab_size
    if d2t is None and head is None and n_draft and c.vocab_size and n_draft < c.vocab_size:
        raise ConvertError(f"{path}: draft_vocab_size {n_draft} < vocab_size {c.vocab_size} but no d2t/lm_head")
    if d2t is not None:
        if head is None:
            raise ConvertError(f"{path}: a d2t table without lm_head.weight (the reduced LM head)")
        if d2t.src.dtype not in ("I64", "I32") or len(d2t.shape) != 1:
            raise ConvertError(f"{path}: d2t must be a 1-D integer tensor, not {d2t.src.dtype} {list(d2t.shape)}")
        if head.shape[0] != d2t.shape[0] or (n_draft and n_draft != d2t.shape[0]):
            raise ConvertError(
                f"{path}: d2t has {d2t.shape[0]} entries, lm_head {head.shape[0]} rows, draft_vocab_size {n_draft}"
            )
    if head is not None and head.shape[1] != c.hidden:
        raise ConvertError(f"{path}: lm_head.weight has shape {list(head.shape)}, hidden size is {c.hidden}")


def zlab_name(name: str) -> str:
    """The z-lab name of a GGUF-named drafter tensor (the inverse of gguf_name)."""
    for hf, g in _GLOBAL_NAMES.items():
        if g == name:
            return hf
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    inverse = {g: hf for hf, g in _LAYER_NAMES.items()}
    if not m or m.group(2) not in inverse:
        raise ValueError(f"{name} is not a DFlash drafter tensor")
    return f"layers.{m.group(1)}.{inverse[m.group(2)]}"


def write_checkpoint(folder: str | Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """A z-lab checkpoint folder (config.json, model.safetensors) from GGUF-named tensors; each file atomically."""
    from .safetensors_file import write_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", {zlab_name(n): a for n, a in tensors.items()})
    with atomic_output(folder / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    return folder
