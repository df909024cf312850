"""dflash-local: DFlash speculative decoding for local GGUF models on llama.cpp.

The packages draw the architecture; imports go one way, frontends -> engine -> native (tests/test_layout.py):
- frontends: cli.py (every command), server/, tui/ (the Textual app), train/, bench.py (with peers.py and
  llama_server.py: upstream's llama-server as the peer it is measured against), pull.py, rpc.py;
- engine/: the pair, the generation loop, drafters, policy, sampling, placement;
- chat/ (templates, streamed text, reasoning and tool calls) and convert/ (the GGUF converter), beneath the engine;
- the base modules: gguf_file.py (GGUF headers), validate.py (what a valid target/drafter pair is), atomic.py (file
  writes), extras.py (optional dependencies), models.py (the default pair);
- _native: the C++ per-step work over llama.cpp's C API (native/).
"""

import importlib

# The engine (and with it llama.cpp) loads on first use of these names, so that `import dflash_local.convert` or
# `dflash-local inspect` do not load llama.cpp.
_LAZY = {
    **dict.fromkeys(["Engine", "Generation", "ContextOverflowError", "EngineBusyError", "Finished", "Prefilled",
                     "TextDelta"],
                    "engine.engine"),
    "StepStats": "engine.stats", "Summary": "engine.stats",
}
__all__ = list(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dflash_local' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dflash_local.{_LAZY[name]}"), name)
