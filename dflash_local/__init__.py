"""dflash-local: DFlash speculative decoding for local GGUF models on llama.cpp."""

import importlib

# The engine (and with it llama.cpp) loads on first use of these names, so that `import dflash_local.convert` or
# `dflash-local inspect` do not load llama.cpp.
_LAZY = {
    "Engine": "engine", "ContextOverflowError": "engine", "EngineBusyError": "engine", "Finished": "engine",
    "TextDelta": "engine", "StepStats": "stats", "Summary": "stats",
}
__all__ = list(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dflash_local' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dflash_local.{_LAZY[name]}"), name)
