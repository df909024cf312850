"""`dflash-local inspect FILE.gguf`: metadata, tensors and their types, read with the fast header reader.

Big arrays (a 262k-token vocabulary) are summarised, not printed. For a DFlash drafter its variant (DFlash,
DFlash2 or DSpark) and the settings the engine uses (feature layers, block size, mask token, DFlash2's selector,
DSpark's heads) come first.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from gguf import LlamaFileType

from dflash_local.gguf_file import ArrayInfo, GGUFInfo, read_gguf
from dflash_local.validate import drafter_variant

_VTYPES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "str", 10: "u64",
           11: "i64", 12: "f64"}


def _value(v, full: bool = False) -> str:
    if isinstance(v, ArrayInfo):
        kind = f"[{_VTYPES.get(v.type, v.type)} x {v.length}]"
        if v.values is None:
            return kind
        shown = v.values if full else v.values[:8]
        more = ", ..." if len(shown) < v.length else ""
        return f"{kind} {', '.join(repr(x) for x in shown)}{more}"
    if isinstance(v, str):
        text = v if full or len(v) <= 80 else v[:77] + "..."
        return json.dumps(text, ensure_ascii=False)
    if isinstance(v, float):
        return f"{v:.7g}"  # float32 values: more digits are noise
    return repr(v)


def _file_type(info: GGUFInfo) -> str:
    ft = info.kv.get("general.file_type")
    try:
        return LlamaFileType(ft).name if ft is not None else "unknown"
    except ValueError:
        return str(ft)


def _n_elements(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def summary(info: GGUFInfo) -> dict:
    """What inspect prints, as plain data (also the --json output)."""
    tensors = [
        {"name": t.name, "type": t.type, "shape": list(t.shape), "n_elements": _n_elements(t.shape), "bytes": t.nbytes}
        for t in info.tensors.values()
    ]
    kv = {}
    for k, v in info.kv.items():
        if isinstance(v, ArrayInfo):
            kv[k] = {"type": _VTYPES.get(v.type, v.type), "length": v.length,
                     "values": v.values if v.values is not None and v.length <= 64 else None}
        else:
            kv[k] = v
    out = {
        "path": str(info.path),
        "size_bytes": info.path.stat().st_size,
        "gguf_version": info.version,
        "architecture": info.arch,
        "file_type": _file_type(info),
        "n_params": sum(t["n_elements"] for t in tensors if t["type"] not in ("I64", "I32")),
        "tensor_types": dict(Counter(t["type"] for t in tensors)),
        "metadata": kv,
        "tensors": tensors,
    }
    if info.arch == "dflash":
        layers = info.get("target_layers")
        variant = drafter_variant(info)
        out["dflash"] = {
            "variant": variant,
            "target_layers": layers.values if isinstance(layers, ArrayInfo) else None,
            "block_size": info.get("block_size"),
            "mask_token_id": info.kv.get("tokenizer.ggml.mask_token_id"),
            "n_layer": info.get("block_count"),
            "hidden": info.get("embedding_length"),
            "draft_vocab": info.tensors["d2t"].shape[0] if "d2t" in info.tensors else None,
            "own_lm_head": "output.weight" in info.tensors,
        }
        if variant == "DFlash2":
            out["dflash"].update({k: info.get(k) for k in ("selector_top_k", "selector_rank", "conv_kernel_size",
                                                          "conv_group_size")})
        if variant == "DSpark":
            out["dflash"].update(markov_rank=info.tensors["markov_w1.weight"].shape[0],
                                 confidence_head="conf_proj.weight" in info.tensors,
                                 sample_from_anchor=info.get("sample_from_anchor", True))
    return out


def format_text(s: dict, full: bool = False) -> str:
    lines = [
        (f"{s['path']}: GGUF v{s['gguf_version']}, {s['size_bytes'] / 2**20:.1f} MiB, {len(s['tensors'])} tensors, "
         f"{len(s['metadata'])} metadata keys"),
        f"architecture {s['architecture'] or '?'}, file type {s['file_type']}, {s['n_params'] / 1e6:.2f} M parameters",
        "tensor types: " + ", ".join(f"{k} x {v}" for k, v in sorted(s["tensor_types"].items())),
    ]
    d = s.get("dflash")
    if d:
        vocab = f", reduced draft vocabulary of {d['draft_vocab']} tokens" if d["draft_vocab"] else ""
        dflash2 = ""
        if d["variant"] == "DFlash2":
            dflash2 = (f", selector top-{d['selector_top_k']} of rank {d['selector_rank']}, conv kernel "
                       f"{d['conv_kernel_size']} in groups of {d['conv_group_size']}")
        if d["variant"] == "DSpark":
            dflash2 = (f", Markov head of rank {d['markov_rank']}, "
                       f"{'a' if d['confidence_head'] else 'no'} confidence head, "
                       f"{'anchor-first blocks' if d['sample_from_anchor'] else 'a bonus anchor slot'}")
        lines.append(
            f"{d['variant']} drafter: {d['n_layer']} layers, hidden {d['hidden']}, "
            f"target layers (inputs) {d['target_layers']}, block size {d['block_size']}, "
            f"mask token {d['mask_token_id']}{vocab}{dflash2}"
        )
    lines.append("")
    lines.append("metadata:")
    for k, v in s["metadata"].items():
        if isinstance(v, dict):  # an array
            shown = v["values"] if full else (v["values"] or [])[:8]
            body = f"[{v['type']} x {v['length']}]"
            if v["values"] is not None:
                more = ", ..." if len(shown) < v["length"] else ""
                body += " " + ", ".join(repr(x) for x in shown) + more
        else:
            body = _value(v, full)
        lines.append(f"  {k} = {body}")
    lines.append("")
    lines.append("tensors:")
    width = max((len(t["name"]) for t in s["tensors"]), default=4)
    for t in s["tensors"]:
        shape = " x ".join(str(d) for d in t["shape"])
        lines.append(f"  {t['name']:<{width}}  {t['type']:<6}  {shape:<18}  {t['bytes'] / 2**20:9.2f} MiB")
    return "\n".join(lines)


def add_inspect_args(p) -> None:
    p.add_argument("file", help="GGUF file to describe")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--full", action="store_true", help="print long strings and small arrays in full")


def run_inspect(args) -> int:
    s = summary(read_gguf(args.file))
    if args.json:
        json.dump(s, sys.stdout, ensure_ascii=False, default=str)
        print()
    else:
        print(format_text(s, args.full))
    return 0

