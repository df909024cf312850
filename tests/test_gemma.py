"""The real gemma-3-270m Q4_K_M target (from its PyPI package). gemma3 does not record layer inputs, so these tests
run the eval-callback feature capture."""

import json
import subprocess
import sys

from conftest import make_prompts
from lossless import assert_lossless, assert_scripted_lossless

from dflash_local import _native


def test_gemma_uses_the_eval_callback(gemma_engine):
    info = gemma_engine.model_info()
    assert info["target"]["arch"] == "gemma3"
    assert info["target"]["quant"] == "Q4_K_M"
    assert info["feature_capture"] == "callback"
    assert not _native.arch_records_layer_inputs("gemma3")


def test_gemma_greedy_dflash_is_token_identical_on_50_prompts(gemma_engine):
    assert_lossless(gemma_engine, make_prompts(50, seed=11), max_tokens=12)


def test_gemma_scripted_drafts_accept_and_roll_back(gemma_engine):
    assert_scripted_lossless(gemma_engine, "The history of the printing press", max_tokens=96)


def test_gemma_sampling_matches_baseline_with_the_same_seed(gemma_engine):
    kw = dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=5)
    assert gemma_engine.complete("Once upon a time", **kw).token_ids == gemma_engine.complete(
        "Once upon a time", draft=False, **kw
    ).token_ids


def test_gemma_chat_falls_back_to_the_gemma_turn_format(gemma_engine):
    assert gemma_engine.target_info.kv.get("tokenizer.chat_template") is None
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    assert gemma_engine.chat_prompt(msgs) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = gemma_engine.prompt_tokens(messages=msgs)
    assert ids.count(gemma_engine.target.bos) == 1
    start_of_turn = gemma_engine.target.tokenize("<start_of_turn>", False, True)
    assert len(start_of_turn) == 1 and ids.count(start_of_turn[0]) == 2
    r = gemma_engine.complete(messages=msgs, max_tokens=16)
    assert r.summary.finish_reason in ("eos", "length")


def test_cli_json_on_gemma(gemma_target, gemma_drafter, tmp_path):
    out = {}
    for mode in ("draft", "no-draft"):
        cmd = [sys.executable, "-m", "dflash_local", "generate", "-m", str(gemma_target), "-p", "The sky is",
               "-n", "16", "--json"]
        cmd += ["-d", str(gemma_drafter)] if mode == "draft" else ["--no-draft"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=True)
        out[mode] = json.loads(r.stdout)
    for key in ("token_ids", "text", "finish_reason", "tokens_per_second", "mean_acceptance_length", "draft_ms",
                "verify_ms", "other_ms", "steps"):
        assert key in out["draft"]
    assert out["draft"]["token_ids"] == out["no-draft"]["token_ids"]
    assert out["draft"]["draft_ms"] > 0 and out["no-draft"]["draft_ms"] == 0
    assert out["draft"]["finish_reason"] == "length" and len(out["draft"]["token_ids"]) == 16


def test_cli_streams_text_and_stats(gemma_target, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dflash_local", "generate", "-m", str(gemma_target), "--no-draft", "-p", "Hello",
         "-n", "8"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "finish: length" in r.stderr
