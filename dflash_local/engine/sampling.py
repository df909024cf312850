"""Sampling parameters and controls. The sampling itself runs natively (native/sampler.cpp, Sampler) inside each step.

Lossless sampling: verification samples the target's own distribution at each block position and accepts a draft
token only if it equals that sample. Generated token k always uses the uniform number hash(seed, k), so with the
same seed a DFlash run and a plain run produce the same tokens, not just the same distribution. The controls (grammar,
logit bias, penalties) keep that: the native sampler applies them to each verify row with the state of the tokens
emitted before it, exactly as plain decoding does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .. import _native


# The highest temperature the engine, the CLI's --temp, the server's `temperature` and the TUI's setting accept.
# OpenAI documents 0..2 and its clients keep to it, so a higher limit refuses them nothing; llama.cpp takes any value
# (llama-cli's --temp, llama-server's temperature), and its users do go above 2, with min-p say, which filters before
# the temperature flattens what is left (the order here too). 100 only stops nonsense: that far up the draw is near
# uniform over the tokens the filters keep, and a higher value would change little.
MAX_TEMPERATURE = 100.0
# llama.cpp keeps penalties and biases as 32-bit floats: a larger number would become infinity there
FLOAT_MAX = 3.4028234663852886e38


class ParamError(ValueError):
    """A sampling parameter the engine refuses; `param` names it (the request field, for the server's 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = a random seed
    # llama.cpp's controls, applied before the above: a logit bias per token id (-inf bans), repetition penalties
    # over the last repeat_last_n tokens (prompt included; -1 = the whole context, 0 = off), and a GBNF grammar
    logit_bias: dict[int, float] | None = None
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str | None = None

    def __post_init__(self):
        check_temperature(self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ParamError("top_k", f"top_k must be a non-negative integer, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(8), "little")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ParamError("seed", f"seed must be an integer, got {self.seed!r}")
        for name in ("repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= FLOAT_MAX:
                raise ParamError(name, f"{name} must be a number within +-{FLOAT_MAX:.4g}, got {v!r}")
        if self.repeat_penalty <= 0:
            raise ParamError("repeat_penalty", f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            raise ParamError("repeat_last_n", f"repeat_last_n must be an integer >= -1, got {self.repeat_last_n!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ParamError("grammar", "grammar must be a string (GBNF)")
        self.logit_bias = parse_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def native(self) -> _native.Sampling:
        return _native.Sampling(
            float(self.temperature), self.top_k, float(self.top_p), float(self.min_p), self.seed & (2**64 - 1)
        )

    def sampler(self, target: _native.Model, prompt: list[int], n_ctx: int,
                n_logprobs: int | None = None) -> _native.Sampler:
        """One generation's native sampling state, after `prompt`; it records the logprobs of every sampled token
        with its n_logprobs most likely alternatives when n_logprobs is not None. A grammar that does not parse
        raises ValueError, a bias for a token outside the vocabulary ParamError."""
        for tok in self.logit_bias or {}:
            if tok >= target.n_vocab:
                raise ParamError("logit_bias", f"logit_bias: token id {tok} is outside the vocabulary "
                                               f"(0..{target.n_vocab - 1})")
        return _native.Sampler(
            target, self.native(), list((self.logit_bias or {}).items()),
            n_ctx if self.repeat_last_n == -1 else self.repeat_last_n, float(self.repeat_penalty),
            float(self.frequency_penalty), float(self.presence_penalty), prompt, self.grammar or "",
            -1 if n_logprobs is None else n_logprobs,
        )


def check_temperature(t) -> None:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TEMPERATURE:
        raise ParamError("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {t!r}")


def parse_logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's map {"token id": bias} or llama-server's list [[token id, bias], ...]; a bias of false bans."""
    if bias is None:
        return None
    pairs = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple, type({}.items()))):
        raise ParamError("logit_bias", "logit_bias must map token ids to biases")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ParamError("logit_bias", "logit_bias must map token ids to biases, or be a list of [token id, bias] "
                                           "pairs")
        tok, b = pair
        try:
            tok = int(tok) if not isinstance(tok, (bool, float)) else None
        except ValueError:
            tok = None
        if tok is None or tok < 0:
            raise ParamError("logit_bias", f"logit_bias: {pair[0]!r} is not a token id")
        if b is False:
            b = -math.inf
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (abs(b) <= FLOAT_MAX or b == -math.inf):
            raise ParamError("logit_bias", f"logit_bias: the bias of token {tok} must be a number within "
                                           f"+-{FLOAT_MAX:.4g} or false, got {b!r}")
        out[tok] = out.get(tok, 0.0) + float(b)
    return out
