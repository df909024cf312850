"""Output types of the converter and the encoding of one tensor, a slab of rows at a time.

f32/f16/bf16/q8_0/q4_0 are encoded here with gguf-py's reference quantizers; the K-quant mixes (q4_k_m, q5_k_m,
q6_k) are made by llama.cpp's own quantizer from a staged file (llama_quantize.py), since their per-tensor choices
(which tensors get more bits) live there. Norms always stay f32, as in every llama.cpp conversion, and so does fc
where the matrices would be f16 (F32_NOT_F16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType, quants

from .errors import ConvertError
from .safetensors_file import read_rows, read_tensor
from .zlab_checkpoint import PlannedTensor

Q = GGMLQuantizationType


@dataclass(frozen=True)
class OutType:
    name: str
    matrix: GGMLQuantizationType | None  # type of 2-D weights; None: chosen by llama.cpp's quantizer
    file_type: LlamaFileType

    @property
    def by_llama(self) -> bool:
        return self.matrix is None


OUTTYPES = {
    "f32": OutType("f32", Q.F32, LlamaFileType.ALL_F32),
    "f16": OutType("f16", Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": OutType("bf16", Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": OutType("q8_0", Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": OutType("q4_0", Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": OutType("q4_k_m", None, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": OutType("q5_k_m", None, LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": OutType("q6_k", None, LlamaFileType.MOSTLY_Q6_K),
}

# fc multiplies the target's raw hidden states, and ggml's f16 matmul rounds its input to f16 first: a target's outlier
# activations past f16's 65,504 (gemma-3-270m's reach 100,975 at the first position) become inf, then every draft
# NaN. Upstream's converter writes it f16 and has that bug; kept f32, this one tensor doubles in size.
F32_NOT_F16 = frozenset({"fc.weight"})

SLAB_BYTES = 32 << 20  # float32 bytes converted at once: bounds the working memory whatever the tensor size


def tensor_type(t: PlannedTensor, matrix_type: GGMLQuantizationType) -> GGMLQuantizationType:
    if t.kind == "index":
        return Q.I64
    if t.kind == "vector":
        return Q.F32
    block, _ = GGML_QUANT_SIZES[matrix_type]
    # rows that do not split into whole blocks cannot be quantized (upstream falls back alike)
    qtype = Q.F16 if t.shape[1] % block else matrix_type
    if qtype == Q.F16 and t.name in F32_NOT_F16:
        return Q.F32
    return qtype


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def encode(t: PlannedTensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes in `qtype`, read and encoded slab by slab into one preallocated output array."""
    if t.kind == "index":
        return np.ascontiguousarray(t.data, dtype=np.int64)
    if t.kind == "vector":
        return (t.data if t.data is not None else read_tensor(t.src)).astype(np.float32)
    rows, cols = t.shape
    if qtype == Q.F32:
        out = np.empty((rows, cols), np.float32)
    elif qtype == Q.F16:
        out = np.empty((rows, cols), np.float16)
    else:
        out = np.empty((rows, tensor_nbytes((cols,), qtype)), np.uint8)
    slab = max(1, SLAB_BYTES // (4 * cols))
    for r0 in range(0, rows, slab):
        r1 = min(rows, r0 + slab)
        if t.data is not None:
            x = t.data[r0:r1]
        elif qtype == Q.BF16 and t.src.dtype == "BF16":
            out[r0:r1] = read_rows(t.src, r0, r1, raw=True).view(np.uint8)  # bit-exact copy
            continue
        else:
            x = read_rows(t.src, r0, r1)
        if qtype == Q.F32:
            out[r0:r1] = x
        elif qtype == Q.F16:
            y = x.astype(np.float16)
            if not np.isfinite(y).all() and np.isfinite(x).all():
                raise ConvertError(f"{t.name}: values beyond float16's range; use --outtype bf16 or f32")
            out[r0:r1] = y
        else:
            out[r0:r1] = quants.quantize(x, qtype)
    return out
