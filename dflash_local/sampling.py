"""Sampling parameters. The sampling itself runs natively (native/dflash.cpp, sample_row) inside each step.

Lossless sampling: verification samples the target's own distribution at each block position and accepts a draft
token only if it equals that sample. Generated token k always uses the uniform number hash(seed, k), so with the
same seed a DFlash run and a plain run produce the same tokens, not just the same distribution.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _native


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = a random seed

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(8), "little")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def native(self) -> _native.Sampling:
        return _native.Sampling(
            float(self.temperature), self.top_k, float(self.top_p), float(self.min_p), self.seed & (2**64 - 1)
        )
