"""The engine: a target/drafter pair loaded and checked, and the generation loop over it (engine.py).

Beside the loop live what it is made of: the drafters (drafter.py: the interface and llama.cpp's DFlash drafter;
torch_drafter.py: the PyTorch one; ngram.py: the lookup in the context), the draft-length policy (policy.py), the
prompt cache, sampling parameters and grammars, placement (where weights and caches go, llama.cpp's flags) and the
step statistics. It imports chat/, convert/'s checkpoint readers, the base modules (gguf_file, validate, extras,
atomic, models) and _native; never a frontend (server/, train/, tui/, cli, bench). tests/test_layout.py checks it.
"""
