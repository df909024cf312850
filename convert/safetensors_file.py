"""A small safetensors reader that needs neither torch nor the safetensors package.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw little-endian data. Tensors are read a slab of rows at a time with plain file reads, so memory
holds one slab, never the model: a mapping of the whole file would count every page it touched as resident.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_local.atomic import atomic_output

from .errors import ConvertError

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element)
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted by hand: numpy has no bfloat16
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),  # the speculators' t2d mask beside a reduced draft vocabulary (read, then dropped)
}

_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass
class SafeTensor:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def n_rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def row_len(self) -> int:
        return int(np.prod(self.shape[1:] if len(self.shape) > 1 else self.shape, dtype=np.int64))


def read_header(path: str | Path) -> dict[str, SafeTensor]:
    """Parse one safetensors file's header and check that every tensor's bytes are inside the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ConvertError(f"{path}: truncated or not a safetensors file (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: not a safetensors file (bad JSON header: {e})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: not a safetensors file (header is not a JSON object)")
    start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: malformed header entry for tensor {name}") from None
        if dtype not in DTYPES:
            raise ConvertError(f"{path}: tensor {name} has dtype {dtype}, which the converter does not read")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != nbytes or begin < 0:
            raise ConvertError(f"{path}: tensor {name}: byte range {begin}..{end} does not fit its shape {list(shape)}")
        if start + end > size:
            raise ConvertError(
                f"{path}: truncated: tensor {name} ends at byte {start + end} but the file has {size} bytes "
                f"(an interrupted download?)"
            )
        out[name] = SafeTensor(name, dtype, shape, path, start + begin, nbytes)
    return out


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored bits -> float32. BF16 is the top half of a float32, so shifting it up is exact."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def read_rows(t: SafeTensor, r0: int, r1: int, raw: bool = False) -> np.ndarray:
    """Rows [r0, r1) of a tensor as a 2-D array (a 1-D tensor is one row); float32 unless raw."""
    dt = DTYPES[t.dtype]
    row_bytes = t.row_len * dt.itemsize
    count = (r1 - r0) * t.row_len
    try:
        with open(t.path, "rb") as f:
            f.seek(t.offset + r0 * row_bytes)
            data = np.fromfile(f, dtype=dt, count=count)
    except OSError as e:
        raise ConvertError(f"{t.path}: read failed: {e.strerror or e}") from None
    if data.size != count:
        raise ConvertError(f"{t.path}: truncated while reading tensor {t.name}")
    data = data.reshape(r1 - r0, t.row_len)
    return data if raw else to_float32(data, t.dtype)


def read_tensor(t: SafeTensor) -> np.ndarray:
    """A whole tensor in its own shape, float32 for float dtypes, the stored type otherwise (small tensors only)."""
    data = read_rows(t, 0, t.n_rows, raw=not t.dtype.startswith(("F", "BF")))
    return data.reshape(t.shape)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> Path:
    """Write float32 and int64 arrays as one safetensors file, atomically."""
    names = {np.dtype("<f4"): "F32", np.dtype("<i8"): "I64"}
    header, offset, arrays = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype="<i8" if np.issubdtype(a.dtype, np.integer) else "<f4")
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    return Path(path)
