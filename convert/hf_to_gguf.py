"""`dflash-local convert`: a DFlash, DFlash2 or DSpark drafter (Hugging Face safetensors) -> a GGUF in llama.cpp's
`dflash` layout.

Only the target GGUF is needed besides the checkpoint: its tokenizer is copied into the drafter (llama.cpp requires
the pair's vocabularies to match) and its shapes are checked against the drafter's before anything is written.
Tensors are streamed: read a slab of rows, encode, write, so memory holds about one tensor. The output appears
only when complete and accepted by the engine's own pair check; a failure leaves no file behind.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from dflash_local.atomic import atomic_output
from dflash_local.gguf_file import GGUFError, GGUFInfo, read_gguf
from dflash_local.validate import PairError, check_checkpoint_pair, check_pair

from .draft_vocab import read_token_ids, target_rows
from .errors import ConvertError
from .gguf_out import add_dflash_keys, add_model_hparams, noise_embedding_scale, tokenizer_kv
from .hub import resolve_source
from .outtypes import OUTTYPES, OutType, encode, tensor_nbytes, tensor_type
from .safetensors_file import read_tensor
from .zlab_checkpoint import Checkpoint, DrafterConfig, PlannedTensor, open_checkpoint

Q = gguf.GGMLQuantizationType


@dataclass
class ConvertResult:
    path: Path
    outtype: str
    n_tensors: int
    n_params: int
    size_bytes: int
    seconds: float
    warnings: list[str] = field(default_factory=list)


def _d2t_ids(t: PlannedTensor, n_vocab: int) -> np.ndarray:
    """The checkpoint's d2t holds offsets (target id = d2t[i] + i); GGUF holds the target ids themselves."""
    ids = read_tensor(t.src).astype(np.int64).reshape(-1) + np.arange(t.shape[0], dtype=np.int64)
    if np.any((ids < 0) | (ids >= n_vocab)):
        raise ConvertError(f"d2t maps draft tokens outside the target's vocabulary of {n_vocab}")
    if np.unique(ids).size != ids.size:
        raise ConvertError("d2t maps two draft tokens to the same target token")
    return ids


def _add_metadata(w: gguf.GGUFWriter, c: DrafterConfig, target: GGUFInfo, name: str, file_type, tok_kv) -> None:
    w.add_name(name)
    w.add_file_type(int(file_type))
    if file_type not in (gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_F16, gguf.LlamaFileType.MOSTLY_BF16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_model_hparams(w, n_ctx=c.context_length or target.get("context_length") or 4096, n_embd=c.hidden,
                      n_ff=c.n_ff, n_layer=c.n_layer, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                      rms_eps=c.rms_eps, rope_theta=c.rope_theta)
    if c.n_rot is not None:
        w.add_rope_dimension_count(c.n_rot)
    s = c.rope_scaling
    if s:
        kind, factor = s.get("rope_type", s.get("type")), s.get("factor")
        if kind == "linear" and factor:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif kind == "yarn" and factor:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
        else:
            raise ConvertError(f"config.json: RoPE scaling {kind!r} is not supported for DFlash drafters")
    add_dflash_keys(w, [i + 1 for i in c.target_layer_ids], c.block_size, c.causal,
                    noise_embedding_scale(target.arch, c.hidden, c.embedding_scale))
    if c.selector_top_k:  # DFlash2: the selector_hidden tensor switches it on, these keys size it
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            w.add_uint32(f"dflash.{key}", getattr(c, key))
    if c.dspark:  # the markov_w1 tensor switches DSpark on; these say where its drafts start and if it has a cut
        w.add_bool("dflash.sample_from_anchor", c.sample_from_anchor)
        w.add_bool("dflash.has_confidence_head", c.has_confidence_head)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
        w.add_key_value("dflash.attention.sliding_window_pattern", c.swa_layers, gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.BOOL)
    if c.logit_scale is not None:
        w.add_float32("dflash.logit_scale", float(c.logit_scale))
    if c.logit_softcap:
        w.add_float32("dflash.final_logit_softcapping", float(c.logit_softcap))
    if c.value_scale is not None:
        w.add_float32("dflash.attention.value_scale", float(c.value_scale))
    for key, value, vtype, sub in tok_kv:
        w.add_key_value(key, value, vtype, sub)


def _write_gguf(path: Path, plan: list[tuple[PlannedTensor, Q]], fill_kv, bar) -> None:
    """Tensor infos first, then each tensor encoded and written in turn: one tensor in memory at a time."""
    w = gguf.GGUFWriter(path, "dflash")
    try:
        fill_kv(w)
        for t, q in plan:
            dtype = np.int64 if q == Q.I64 else np.float32
            w.add_tensor_info(t.name, t.shape, np.dtype(dtype), tensor_nbytes(t.shape, q), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, q in plan:
            bar.set_postfix_str(t.name, refresh=False)
            data = encode(t, q)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
            del data
    except OSError as e:
        raise ConvertError(f"{path.parent}: write failed: {e.strerror or e}") from None
    finally:
        w.close()


def _stage_type(t: PlannedTensor) -> Q:
    """What llama.cpp's quantizer reads: BF16 sources stay BF16 (lossless and half the disk), the rest F32."""
    if t.kind != "matrix":
        return tensor_type(t, Q.F32)
    return Q.BF16 if t.src is not None and t.src.dtype == "BF16" else Q.F32


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, leave=True)


def convert_drafter(
    source: str | os.PathLike,
    target: str | os.PathLike,
    output: str | os.PathLike,
    outtype: str = "f16",
    *,
    revision: str | None = None,
    draft_vocab: str | os.PathLike | None = None,
    name: str | None = None,
    threads: int | None = None,
    progress: bool = False,
    verbose: bool = False,
) -> ConvertResult:
    """Convert a DFlash, DFlash2 or DSpark drafter (directory or Hub id) for `target` into a dflash GGUF at `output`."""
    t0 = time.perf_counter()
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    ot: OutType = OUTTYPES[outtype]
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        print(f"dflash-local convert: warning: {msg}", file=sys.stderr)

    try:
        tgt = read_gguf(target)
    except GGUFError as e:
        raise ConvertError(f"target: {e}") from None
    src_dir = resolve_source(str(source), revision)
    ckpt: Checkpoint = open_checkpoint(src_dir)
    c = ckpt.config
    try:
        mask = check_checkpoint_pair(c, tgt, warn)
    except PairError as e:
        raise ConvertError(str(e)) from None
    try:
        tok_kv = tokenizer_kv(target, mask)
    except ValueError as e:
        raise ConvertError(f"{e} (and the drafter's dflash_config names none)") from None

    tensors = list(ckpt.tensors)
    for i, t in enumerate(tensors):
        if t.kind == "index":
            tensors[i] = PlannedTensor(t.name, t.src, t.shape, t.kind, _d2t_ids(t, tgt.n_vocab))
    if draft_vocab is not None:
        if any(t.name == "output.weight" for t in tensors):
            raise ConvertError(f"{src_dir}: the checkpoint already has its own LM head; --draft-vocab cannot apply")
        ids = read_token_ids(draft_vocab, tgt.n_vocab)
        head = target_rows(tgt, ids)
        tensors.append(PlannedTensor("output.weight", None, head.shape, "matrix", head))
        tensors.append(PlannedTensor("d2t", None, ids.shape, "index", ids))

    if name is None:
        name = str(source).rstrip("/").split("/")[-1] if src_dir != Path(source) else Path(c.name).name
    output = Path(output)
    if output.is_dir():
        raise ConvertError(f"{output} is a directory; give the output file's path")

    try:
        with atomic_output(output) as tmp:
            if ot.by_llama:
                _convert_by_llama(tmp, tensors, ot, c, tgt, name, tok_kv, threads, progress, verbose)
            else:
                plan = [(t, tensor_type(t, ot.matrix)) for t in tensors]
                total = sum(tensor_nbytes(t.shape, q) for t, q in plan)
                with _progress(total, f"{output.name} ({outtype})", progress) as bar:
                    _write_gguf(tmp, plan, lambda w: _add_metadata(w, c, tgt, name, ot.file_type, tok_kv), bar)
            try:
                check_pair(tgt, read_gguf(tmp))  # what the engine checks at load: refuse to publish a file it rejects
            except (PairError, GGUFError) as e:
                raise ConvertError(f"the converted drafter does not pass the engine's pair check: {e}") from None
            size = tmp.stat().st_size
    except OSError as e:
        # making the temporary file or its folder failed: nothing was written
        raise ConvertError(f"cannot write {output}: {e.strerror or e}") from None
    n_params = sum(math.prod(t.shape) for t in tensors if t.kind != "index")
    return ConvertResult(output, outtype, len(tensors), n_params, size, time.perf_counter() - t0, warnings)


def _convert_by_llama(tmp, tensors, ot, c, tgt, name, tok_kv, threads, progress, verbose) -> None:
    """Stage the drafter unquantized beside the output, then let llama.cpp's quantizer write the K-quant mix."""
    from .llama_quantize import quantize_gguf

    plan = [(t, _stage_type(t)) for t in tensors]
    stage_ft = gguf.LlamaFileType.MOSTLY_BF16 if any(q == Q.BF16 for _, q in plan) else gguf.LlamaFileType.ALL_F32
    total = sum(tensor_nbytes(t.shape, q) for t, q in plan)
    fd, stage = tempfile.mkstemp(dir=tmp.parent, prefix=f"{tmp.name}.stage.", suffix=".part")
    os.close(fd)
    stage = Path(stage)
    try:
        with _progress(total, "staging", progress) as bar:
            _write_gguf(stage, plan, lambda w: _add_metadata(w, c, tgt, name, stage_ft, tok_kv), bar)
        from tqdm import tqdm

        with tqdm(total=len(plan), desc=f"quantizing to {ot.name} (llama.cpp)", unit="tensor", file=sys.stderr,
                  disable=not progress, leave=True) as bar:
            quantize_gguf(stage, tmp, int(ot.file_type), threads=threads, bar=bar, verbose=verbose)
    finally:
        stage.unlink(missing_ok=True)


# -- command line ---------------------------------------------------------------------------------------------------


def add_convert_args(p) -> None:
    p.add_argument("source", help="DFlash, DFlash2 or DSpark drafter: a directory (config.json + safetensors) or a "
                                  "Hub id (org/name)")
    p.add_argument("-m", "--target", required=True, help="the target model's GGUF (tokenizer and shapes come from it)")
    p.add_argument("-o", "--output", help="GGUF to write (default: <name>-<outtype>.gguf in the current directory)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16",
                   help="weight type (default f16); K-quants are made by llama.cpp's quantizer; norms stay f32, and "
                        "fc, which reads the target's raw hidden states, stays f32 where it would be f16")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit) when SOURCE is a Hub id")
    p.add_argument("--draft-vocab", metavar="FILE",
                   help="reduced draft vocabulary: a file of target token ids (JSON list or whitespace separated); "
                        "the drafter then scores only these (its own LM head rows and a d2t map)")
    p.add_argument("--name", help="general.name of the output (default: the checkpoint's name)")
    p.add_argument("-t", "--threads", type=int, help="threads for llama.cpp's quantizer (default: all cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's quantizer log")


def run_convert(args) -> int:
    output = args.output
    if output is None:
        stem = re.sub(r"[^\w.-]+", "-", args.name or str(args.source).rstrip("/").split("/")[-1]) or "drafter"
        output = Path.cwd() / f"{stem}-{args.outtype}.gguf"
    r = convert_drafter(
        args.source,
        args.target,
        output,
        args.outtype,
        revision=args.revision,
        draft_vocab=args.draft_vocab,
        name=args.name,
        threads=args.threads,
        progress=not args.quiet,
        verbose=args.verbose,
    )
    print(
        f"wrote {r.path} ({r.outtype}, {r.n_tensors} tensors, {r.n_params / 1e6:.1f} M parameters, "
        f"{r.size_bytes / 2**20:.1f} MiB) in {r.seconds:.1f} s",
        file=sys.stderr,
    )
    print(r.path)
    return 0
