"""A reduced draft vocabulary: the drafter scores only a chosen subset of the target's tokens.

With a big vocabulary (gemma's 262k tokens) the LM head dominates the drafter's cost. A drafter GGUF with its own
`output.weight` (the target head's rows for the kept tokens) and `d2t` (draft row -> target token id) makes
llama.cpp score only those rows and scatter them back into the full vocabulary (the others get -inf). The logits of
the kept tokens are exactly the full head's, so drafts only change where the full argmax was a dropped token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from dflash_local.gguf_file import GGUFInfo

from .errors import ConvertError


def read_token_ids(path: str | Path, n_vocab: int) -> np.ndarray:
    """Token ids from a file: a JSON list, or integers separated by whitespace or commas. Sorted, checked."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConvertError(f"{path}: cannot read the draft vocabulary: {e.strerror or e}") from None
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.replace(",", " ").split()]
        ids = np.asarray(ids, dtype=np.int64)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise ConvertError(f"{path}: the draft vocabulary must be a list of token ids") from None
    if ids.ndim != 1 or ids.size == 0:
        raise ConvertError(f"{path}: the draft vocabulary is empty")
    bad = ids[(ids < 0) | (ids >= n_vocab)]
    if bad.size:
        raise ConvertError(f"{path}: token ids {bad[:5].tolist()} are outside the target's vocabulary of {n_vocab}")
    if np.unique(ids).size != ids.size:
        raise ConvertError(f"{path}: the draft vocabulary lists some token ids twice")
    return np.sort(ids)


def target_rows(target: GGUFInfo, ids: np.ndarray, name: str | None = None) -> np.ndarray:
    """Rows `ids` of a target matrix, dequantized to float32; by default of its LM head (its output matrix, or the
    tied embeddings)."""
    t = target.tensors.get(name) if name else target.tensors.get("output.weight") or target.tensors.get(
        "token_embd.weight")
    if t is None or len(t.shape) != 2:
        raise ConvertError(f"{target.path.name}: no {name or 'LM head (output.weight or token_embd.weight)'} to take "
                           f"rows from")
    qtype = GGMLQuantizationType[t.type]
    n_embd, n_rows = t.shape
    row_bytes = t.nbytes // n_rows
    head = np.memmap(target.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(n_rows, row_bytes))
    try:
        rows = np.array(head[ids])  # only the chosen rows are read
    finally:
        del head
    if qtype == GGMLQuantizationType.F32:
        return rows.view(np.float32).reshape(len(ids), n_embd)
    return quants.dequantize(rows, qtype).reshape(len(ids), n_embd).astype(np.float32)
