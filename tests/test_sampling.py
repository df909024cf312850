"""The native sampler against a straightforward full-sort reference written here in numpy, draw by draw."""

import math

import numpy as np
import pytest

from dflash_local import _native

MASK = 2**64 - 1


def uniform(seed: int, index: int) -> float:
    """hash(seed, index), the uniform number of generated token `index` (splitmix64, as in native/sample_row.cpp)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return (z >> 11) * (1.0 / 9007199254740992.0)


def descending(logits: np.ndarray) -> np.ndarray:
    return np.lexsort((np.arange(len(logits)), -logits))  # ties: the lower id first


def reference(logits, temperature, top_k, top_p, min_p, u, order=None) -> int:
    """The sampler's definition, literally: sort everything, filter, walk the cumulative sum in doubles.

    Sums run term by term (np.add.accumulate): z in vocabulary order, everything else in descending order.
    Float parameters are float32, as in the native Sampling.
    """
    t32, p32, m32 = (float(np.float32(v)) for v in (temperature, top_p, min_p))
    if t32 <= 0:
        return int(np.argmax(logits))
    n = len(logits)
    order = descending(logits) if order is None else order
    lmax = float(logits.max())
    x = logits.astype(np.float64) - lmax
    cand = order[:top_k] if 0 < top_k < n else order
    if p32 < 1:
        z = np.add.accumulate(np.exp(x[np.sort(cand)]))[-1]
        reached = np.nonzero(np.add.accumulate(np.exp(x[cand]) / z) >= p32)[0]
        if len(reached):
            cand = cand[: reached[0] + 1]
    if m32 > 0:
        keep = np.float32(logits.max()) + np.float32(math.log(m32))
        cand = cand[logits[cand] >= min(keep, logits.max())]
    cum = np.add.accumulate(np.exp(x[cand] / t32))
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))  # the first i with u * zt < cum[i]
    return int(cand[min(i, len(cand) - 1)])


def rows(rng: np.random.Generator):
    """Logit rows of many shapes: peaked, flat, tied, a long tail as in a 262,144-token vocabulary."""
    for _ in range(60):
        n = int(rng.integers(1, 3000))
        yield (rng.standard_normal(n) * rng.uniform(0.1, 8)).astype(np.float32)
    for _ in range(20):
        n = int(rng.integers(2, 3000))
        yield np.round(rng.standard_normal(n) * 3).astype(np.float32)  # ties everywhere
    yield np.ones(1000, np.float32)
    yield np.array([2.0, 1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
    # one token ahead of 20,000 equal ones: a draw in the tail lands among crowded boundaries
    tail = np.full(20001, -9.0, np.float32)
    tail[123] = 0.0
    yield tail
    for _ in range(3):  # a language model's shape: a few likely tokens, a long tail
        big = (rng.standard_normal(262144) * 3 - 10).astype(np.float32)
        big[rng.integers(0, 262144, 20)] += rng.uniform(8, 25, 20).astype(np.float32)
        yield big


SETTINGS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.0, 40, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.9, 50, 0.95, 0.02),
    (0.01, 0, 1.0, 0.0),
    (3.0, 0, 1.0, 0.0),
    (50.0, 0, 0.5, 0.0),
    (1.3, 1, 1.0, 0.0),
    (1.0, 0, 0.999, 0.001),
    (0.5, 7, 0.5, 0.3),
    (1.0, 0, 1e-6, 0.0),
    (1.0, 0, 1.0, 1.0),
    (2.0, 1000, 0.99, 0.0),
]


def test_native_sampler_picks_what_the_full_sort_reference_picks():
    rng = np.random.default_rng(1)
    draws = 0
    for r, logits in enumerate(rows(rng)):
        n, order = len(logits), descending(logits)
        for temperature, top_k, top_p, min_p in SETTINGS + [(1.0, n - 1, 1.0, 0.0), (1.0, n + 3, 0.8, 0.0)]:
            seed = int(rng.integers(0, 2**63))
            s = _native.Sampling(temperature, top_k, top_p, min_p, seed)
            for index in range(3 if n > 100000 else 12):
                want = reference(logits, temperature, top_k, top_p, min_p, uniform(seed, index), order)
                assert _native.sample(logits, s, index) == want, (r, n, temperature, top_k, top_p, min_p, index)
                draws += 1
    assert draws > 10000


def test_cuts_that_land_exactly_on_top_p():
    # four equal tokens: the cumulative probability is exactly 0.25, 0.5, ...; top_p 0.5 keeps two of them
    logits = np.zeros(4, np.float32)
    for top_k in (0, 4, 3):
        s = _native.Sampling(1.0, top_k, 0.5, 0.0, 9)
        picks = {_native.sample(logits, s, i) for i in range(200)}
        assert picks == {0, 1}
        for i in range(50):
            assert _native.sample(logits, s, i) == reference(logits, 1.0, top_k, 0.5, 0.0, uniform(9, i))


def test_bad_rows_are_errors_or_draws_never_crashes():
    with pytest.raises(ValueError, match="non-empty"):
        _native.sample(np.zeros(0, np.float32), _native.Sampling(1.0), 0)
    with pytest.raises(ValueError, match="non-empty"):
        _native.sample(np.zeros((2, 3), np.float32), _native.Sampling(1.0), 0)
    s = _native.Sampling(1.0, 5, 0.9, 0.1, 3)
    for row in ([np.nan, 1.0, 2.0], [1.0, np.nan, 3.0], [-np.inf, -np.inf], [np.inf, 0.0], [0.0, -np.inf, 1.0]):
        assert 0 <= _native.sample(np.array(row, np.float32), s, 0) < len(row)


def test_one_temperature_limit_for_the_engine_cli_server_and_tui(tmp_path, capsys):
    """sampling.MAX_TEMPERATURE bounds every frontend alike, above OpenAI's 2 (as llama.cpp)."""
    from pydantic import ValidationError

    from dflash_local.server.schema import GenerationRequest
    from dflash_local.cli import main
    from dflash_local.engine.sampling import MAX_TEMPERATURE, ParamError, SamplingParams
    from dflash_local.tui.settings import Settings, parse

    over = MAX_TEMPERATURE + 1
    for t in (2.5, MAX_TEMPERATURE):
        assert SamplingParams(t).temperature == t
        assert GenerationRequest(temperature=t).temperature == t
        fields = {"temperature": str(t), "top_p": "1", "max_tokens": "8", "block_size": "1", "system_prompt": ""}
        assert parse(fields, Settings(), 1).temperature == t
    with pytest.raises(ParamError, match=f"between 0 and {MAX_TEMPERATURE:g}") as e:
        SamplingParams(over)
    assert e.value.param == "temperature"
    with pytest.raises(ValidationError) as e:
        GenerationRequest(temperature=over)
    assert e.value.errors()[0]["loc"] == ("temperature",)
    with pytest.raises(ValueError, match=f"temperature: between 0 and {MAX_TEMPERATURE:g}"):
        parse(fields | {"temperature": str(over)}, Settings(), 1)
    # the CLI refuses it as it reads its arguments, before it looks for the model
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", str(tmp_path / "absent.gguf"), "-p", "x", "--temp", str(over)])
    assert e.value.code == 2 and f"temperature must be between 0 and {MAX_TEMPERATURE:g}" in capsys.readouterr().err
