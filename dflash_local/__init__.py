"""dflash-local: DFlash speculative decoding for local GGUF models on llama.cpp."""

from .engine import ContextOverflowError, Engine, EngineBusyError, Finished, TextDelta
from .stats import StepStats, Summary

__all__ = ["Engine", "ContextOverflowError", "EngineBusyError", "Finished", "StepStats", "Summary", "TextDelta"]
__version__ = "0.1.0"
