"""Training a drafter for any GGUF target, `dflash-local train`: run.py (the command and the training loop), data.py
(the target's own continuations, generated with the engine, as training data) and corpus.py (the prompts). A
frontend: it imports engine/, convert/ and the base modules (PyTorch from the torch extra), no other frontend.
tests/test_layout.py checks it.
"""
