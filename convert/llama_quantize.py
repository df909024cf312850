"""K-quant mixes through llama.cpp's own quantizer (llama_model_quantize from the llama-cpp-python bindings).

llama.cpp decides per tensor which ones get more bits in a _M mix; doing that here would be a second, drifting copy
of its rules. It reads the staged GGUF tensor by tensor (bounded by max_buf_size), so memory stays small. Its log
is captured while it runs: the "[ i/ n]" lines drive the progress bar, warnings and errors go into error messages.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from pathlib import Path

from .errors import ConvertError

_PROGRESS = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]")


def import_llama_cpp():
    """The llama_cpp bindings, imported without taking over llama.cpp's log callback.

    Importing llama_cpp installs its own logger, which would silently replace the one the engine's native module
    installed in the same process (its quiet default and the log tail of its error messages)."""
    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"]
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError("K-quants need llama-cpp-python (llama.cpp's quantizer), which is not installed")
    libdir = Path(spec.submodule_search_locations[0]) / "lib"
    lib = next((libdir / n for n in ("libllama.so", "libllama.dylib", "llama.dll") if (libdir / n).exists()), None)
    saved = None
    if lib is not None:
        cdll = ctypes.CDLL(str(lib))  # the library the native module already mapped, if it did
        cb_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        cb, ud = cb_type(), ctypes.c_void_p()
        cdll.llama_log_get(ctypes.byref(cb), ctypes.byref(ud))
        if ctypes.cast(cb, ctypes.c_void_p).value:
            saved = (cdll, cb, ud)
    import llama_cpp

    if saved is not None:
        cdll, cb, ud = saved
        cdll.llama_log_set(cb, ud)
    return llama_cpp


def quantize_gguf(src: Path, dst: Path, ftype: int, *, threads: int | None = None, bar=None, verbose: bool = False):
    """Quantize the staged GGUF `src` to llama_ftype `ftype`, written to `dst`."""
    llama_cpp = import_llama_cpp()

    tail: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):
        if verbose:
            os.write(2, text)
        m = _PROGRESS.search(text)
        if m and bar is not None:
            bar.n = int(m.group(1)) - 1
            bar.total = int(m.group(2))
            bar.refresh()
        if level in (2, 3):  # warn, error
            tail.append(text.decode("utf-8", "replace").strip())
            del tail[:-6]

    # restore whoever logged before (the engine's native module keeps its own callback)
    prev_cb, prev_ud = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = threads or os.cpu_count() or 1
    params.max_buf_size = 64 << 20  # rows kept in memory at once
    llama_cpp.llama_log_set(on_log, None)
    try:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(prev_cb, prev_ud)
    if rc != 0:
        detail = "; ".join(t for t in tail if t) or f"code {rc}"
        raise ConvertError(f"llama.cpp's quantizer failed: {detail}")
    if bar is not None and bar.total:
        bar.n = bar.total
        bar.refresh()
