"""The out-of-the-box pair: gemma-3-270m Q4_K_M and its drafter (drafters/, README "The default pair")."""

import json
from pathlib import Path

from dflash_local import Engine
from dflash_local.gguf_file import read_gguf
from dflash_local.models import default_drafter, default_target

HELD_OUT = [json.loads(x)["prompt"] for x in (Path(__file__).parents[1] / "bench" / "prompts.jsonl").open()]


def test_the_shipped_drafter_is_installed_and_fits_the_default_target():
    path = default_drafter()
    assert path is not None and path.name == "gemma-3-270m-dflash-q8_0.gguf"
    info = read_gguf(path)
    assert info.arch == "dflash" and "d2t" in info.tensors and info.tensors["fc.weight"].type == "Q8_0"
    assert path.stat().st_size < 32 * 1024 * 1024  # small enough to ship in the repository
    engine = Engine(default_target(), path)
    assert engine.model_info()["bit_exact_verify"]


def test_the_shipped_drafter_is_lossless_and_accepts_drafts_on_held_out_prompts():
    engine = Engine(default_target(), default_drafter(), n_ctx=2048, draft_policy="fixed")
    steps = accepted = 0
    for p in HELD_OUT[::4]:  # 6 prompts never used in training
        spec = engine.complete(p, max_tokens=48)
        assert spec.token_ids == engine.complete(p, max_tokens=48, draft=False).token_ids, p
        steps, accepted = steps + spec.summary.steps, accepted + spec.summary.n_accepted
    tau = (steps + accepted) / steps
    assert tau > 1.15, tau  # measured 1.36 here; an untrained drafter gets 1.0

