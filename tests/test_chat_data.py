"""Training data for an instruct model's drafter: the chat corpus, answers through the chat template (greedy and
sampled), a time-boxed training run, a mask token for tokenizers without one, and the PyTorch llama data path
(bench/torch_llama_data.py) against the engine's own data."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from conftest import make_prompts
from fixtures import write_tiny_target

from dflash_local import _native
from dflash_local.cli import main
from dflash_local.convert.gguf_out import unused_control_token
from dflash_local.train.chat_corpus import OURS, chat_corpus
from dflash_local.train.data import chat_texts, load_sample, make_data, sample_path

ROOT = Path(__file__).parents[1]


def test_the_chat_corpus_mixes_code_chat_and_reasoning_with_provenance(tmp_path):
    rows = chat_corpus(0, 90)
    assert len(rows) == 90 and len({r.text for r in rows}) == 90
    assert [r.kind for r in rows[:6]] == ["code", "chat", "reasoning"] * 2
    for r in rows:  # a request on a snippet keeps the snippet's file and licence; a generated one is ours
        assert r.license and r.source
        assert r.source != "generated" or r.license == OURS
    assert any(r.source != "generated" for r in rows) and any(r.source == "generated" for r in rows)
    assert rows == chat_corpus(0, 90)  # reproducible
    held = [json.loads(line)["messages"][0]["content"] for line in (ROOT / "bench" / "chat-heldout.jsonl").open()]
    assert not set(held) & {r.text for r in chat_corpus(0)}  # the held-out messages are never trained on
    out = tmp_path / "chat.jsonl"
    assert main(["corpus", "--chat", "-n", "30", "-o", str(out)]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [r.text for r in chat_corpus(0, 30)]
    assert {w["kind"] for w in written} == {"code", "chat", "reasoning"}


def test_chat_data_is_the_targets_answers_through_its_template_greedy_and_sampled(tmp_path, tiny_target):
    messages = make_prompts(8, seed=3)
    folder = tmp_path / "data"
    make_data(tiny_target, folder, [1, 3], messages, 8, 24, n_parallel=4, chat=True, temperature=0.8)
    model = _native.Model(str(tiny_target), n_gpu_layers=0)
    rendered = chat_texts(tiny_target, model, dict(enumerate(messages)))
    im_start = model.tokenize("<|im_start|>", False, True)
    assert len(im_start) == 1
    sampled_off_greedy = 0
    for i, m in enumerate(messages):
        s = load_sample(sample_path(folder, i))
        assert s.prompt == m  # the message is recorded, the template's text is what the target read
        assert rendered[i].startswith("<|im_start|>user\n" + m) and rendered[i].endswith("<|im_start|>assistant\n")
        assert s.tokens[: s.n_prompt].tolist() == model.tokenize(rendered[i], True, True)
        assert s.tokens[0] == im_start[0]  # control tokens parsed, not spelled out
        answer = range(s.n_prompt, len(s.tokens))
        if i % 2 == 0:  # greedy: every answer token is the target's best after what came before
            assert all(s.tokens[j] == s.top_ids[j - 1, 0] for j in answer)
        else:  # sampled from the recorded top tokens
            assert all(s.tokens[j] in s.top_ids[j - 1] for j in answer)
            sampled_off_greedy += sum(s.tokens[j] != s.top_ids[j - 1, 0] for j in answer)
    assert sampled_off_greedy > 0
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["chat"] is True and meta["temperature"] == 0.8
    with pytest.raises(ValueError, match="made differently .*chat"):
        make_data(tiny_target, folder, [1, 3], messages, 8, 24)


def test_training_for_a_time_sets_the_steps_from_the_measured_rate(tmp_path, tiny_target, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(make_prompts(12, seed=5)) + "\n")
    out = tmp_path / "run"
    assert main(["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus), "--chat", "--samples", "6",
                 "--max-new", "16", "--draft-vocab", "300", "--layers", "1", "--target-layers", "1,3",
                 "--eval-every", "0", "--steps", "100000", "--train-seconds", "2", "--outtype", "f16",
                 "--threads", "2"]) == 0
    log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
    steps = log[-1]["step"]
    assert 20 < steps < 100000  # stopped by the time, not the step count, and exported
    assert f"training to step {steps}" in capsys.readouterr().err
    assert (out / "drafter-f16.gguf").exists()


def test_a_tokenizer_without_a_mask_token_lends_an_unused_control_token():
    # SmolLM2's tokenizer: control tokens 0-16, bos 1 / eos 2 named, <|im_start|>/<|im_end|> in the template
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>", "hello"]
    control = int(gguf.TokenType.CONTROL)
    info = SimpleNamespace(kv={
        "tokenizer.ggml.tokens": SimpleNamespace(values=tokens),
        "tokenizer.ggml.token_type": SimpleNamespace(values=[control] * 5 + [int(gguf.TokenType.NORMAL)]),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "<|im_start|>{{ m }}<|im_end|>"})
    assert unused_control_token(info) == 4
    info.kv["tokenizer.chat_template"] += "<empty_output>"
    assert unused_control_token(info) == 3
    info.kv["tokenizer.ggml.token_type"].values = [control] * 3 + [int(gguf.TokenType.NORMAL)] * 3
    assert unused_control_token(info) is None


def test_the_pytorch_llama_data_matches_the_engines(tmp_path):
    pytest.importorskip("torch")
    target = write_tiny_target(tmp_path / "llama.gguf", arch="llama", seed=11)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(6, seed=9)))
    script = str(ROOT / "bench" / "torch_llama_data.py")
    run = dict(capture_output=True, text=True, timeout=600, cwd=ROOT)
    r = subprocess.run([sys.executable, script, "prepare", "-m", str(target), "--corpus", str(corpus), "-n", "6",
                        "--chat", "-o", str(tmp_path / "p.npz")], **run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, script, "make", "-m", str(target), "--prompts", str(tmp_path / "p.npz"),
                        "-o", str(tmp_path / "torch"), "--layers", "1,3", "--max-new", "20", "--device", "cpu",
                        "--batch", "4"], **run)
    assert r.returncode == 0, r.stderr
    from dflash_local.train.corpus import training_prompts

    prompts = training_prompts(corpus, 0)
    make_data(target, tmp_path / "engine", [1, 3], prompts, 6, 20, n_parallel=3, chat=True)
    assert json.loads((tmp_path / "torch" / "meta.json").read_text()) == \
        json.loads((tmp_path / "engine" / "meta.json").read_text())
    for i in range(6):  # all greedy (without --temp)
        a, b = load_sample(sample_path(tmp_path / "engine", i)), load_sample(sample_path(tmp_path / "torch", i))
        assert a.prompt == b.prompt and a.n_prompt == b.n_prompt
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.top_ids[:, 0].tolist() == b.top_ids[:, 0].tolist()
        fa, fb = a.features_f32(), b.features_f32()
        cos = (fa * fb).sum(1) / np.linalg.norm(fa, axis=1) / np.linalg.norm(fb, axis=1)
        assert cos.min() > 0.999
        np.testing.assert_allclose(a.top_logprobs.astype(np.float32), b.top_logprobs.astype(np.float32), atol=0.02)
