"""Fast GGUF header reader: metadata and tensor table, without parsing big arrays.

gguf.GGUFReader parses every element of every array; for a 262k-token vocabulary that takes over 20 seconds.
Validation only needs scalars, array lengths and a digest of the tokenizer, so arrays are skipped or hashed.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"

# GGUF value types
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


@dataclass
class ArrayInfo:
    """An array value that was not materialised: its element type, length and a digest of its raw bytes."""

    type: int
    length: int
    digest: str
    values: list | None = None  # kept for small arrays (<= 1024 elements) and for keys asked for in full


@dataclass
class TensorInfo:
    name: str
    type: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    offset: int
    nbytes: int


@dataclass
class GGUFInfo:
    path: Path
    version: int
    kv: dict = field(default_factory=dict)
    types: dict = field(default_factory=dict)  # key -> GGUF value type (int), to write a value back unchanged
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return self.kv.get("general.architecture", "")

    def get(self, key: str, default=None):
        """Architecture-relative lookup: get('block_count') reads '<arch>.block_count'."""
        return self.kv.get(f"{self.arch}.{key}", default)

    @property
    def n_layer(self) -> int:
        """The layers the target's graph runs, as llama.cpp's llama_model_n_layer counts them: block_count less the
        multi-token-prediction (nextn) layers upstream's converter appends (Qwen3.5, GLM-4.5, DeepSeek-V3, ...)."""
        return (self.get("block_count") or 0) - (self.get("nextn_predict_layers") or 0)

    @property
    def n_vocab(self) -> int:
        tokens = self.kv.get("tokenizer.ggml.tokens")
        return tokens.length if isinstance(tokens, ArrayInfo) else 0


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path
        self.full = False  # materialise the next array whatever its length

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("I"), self.take("Q")
            start = self.pos
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype]) * n
                if start + size > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF header")
                self.pos += size
                values = None
                if n <= 1024 or self.full:
                    values = np.frombuffer(self.buf, dtype="<" + _SCALARS[etype], count=n, offset=start).tolist()
            elif etype == _STRING:
                values = [] if n <= 1024 or self.full else None
                for _ in range(n):
                    s = self.string()
                    if values is not None:
                        values.append(s)
            else:
                raise GGUFError(f"{self.path}: unsupported GGUF array element type {etype}")
            digest = hashlib.sha1(self.buf[start : self.pos]).hexdigest()
            return ArrayInfo(etype, n, digest, values)
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype}")


def read_gguf(path: str | Path, full_arrays: str | None = None) -> GGUFInfo:
    """Read a GGUF file's metadata and tensor table and check that the tensor data is all there.

    Arrays whose key starts with `full_arrays` (e.g. "tokenizer.") are read in full, to be copied elsewhere."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: not a GGUF file (too small)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        c = _Cursor(buf, path)
        c.pos = 4
        version = c.take("I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = c.take("Q"), c.take("Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{path}: corrupt GGUF header (counts {n_tensors}, {n_kv})")
        info = GGUFInfo(path, version)
        for _ in range(n_kv):
            key = c.string()
            vtype = c.take("I")
            c.full = full_arrays is not None and key.startswith(full_arrays)
            info.kv[key], info.types[key] = c.value(vtype), vtype
        raw_tensors = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.take("I")
            if n_dims > 4:
                raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions")
            shape = tuple(c.take("Q") for _ in range(n_dims))
            raw_tensors.append((name, c.take("I"), shape, c.take("Q")))
        align = info.kv.get("general.alignment", 32)
        data_start = (c.pos + align - 1) // align * align
    for name, ttype, shape, offset in raw_tensors:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name} has unknown type {ttype}") from None
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = n // block * type_size
        if data_start + offset + nbytes > size:
            raise GGUFError(f"{path}: truncated: tensor {name} ends past the end of the file")
        info.tensors[name] = TensorInfo(name, qtype.name, shape, data_start + offset, nbytes)
    return info
