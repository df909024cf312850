"""Placement and memory flags in llama.cpp's spelling: they reach llama.cpp (read back through the native module and
llama.cpp's own memory report and log), bad combinations are refused before llama.cpp sees them, and a tiny MoE
target with its experts placed by --n-cpu-moe and -ot stays lossless."""

import argparse
import asyncio
import json
import subprocess
import sys

import pytest
from conftest import make_prompts
from fixtures import write_tiny_drafter, write_tiny_moe
from lossless import assert_lossless, assert_scripted_lossless

from dflash_local import Engine, _native
from dflash_local.cli import main
from dflash_local.engine.placement import PlacementError, add_placement_args, from_args
from dflash_local.tui.app import ChatApp
from dflash_local.tui.panels import ModelPanel


@pytest.fixture(scope="module")
def moe(models_dir):
    return write_tiny_moe(models_dir / "tiny-moe.gguf")


@pytest.fixture(scope="module")
def moe_drafter(models_dir, moe):
    return write_tiny_drafter(models_dir / "tiny-moe-drafter.gguf", moe, target_layers=(1, 3), block_size=8)


def placement(*flags):
    p = argparse.ArgumentParser()
    add_placement_args(p)
    return from_args(p.parse_args(list(flags)))


def kv_bytes(engine, which="target"):
    return sum(row["context"] for row in engine.model_info()["memory"][which])


def model_bytes(engine, buffer_type):
    return sum(r["model"] for r in engine.model_info()["memory"]["target"] if r["buffer_type"] == buffer_type)


def test_context_flags_reach_llama_cpp(moe, moe_drafter):
    e = Engine(moe, moe_drafter, n_ctx=512, placement=placement(
        "-b", "64", "-ub", "16", "-t", "1", "-tb", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"))
    s = e.session
    assert (s.n_ctx, s.n_batch, s.n_ubatch, s.n_threads, s.n_threads_batch) == (512, 64, 16, 1, 2)
    # the KV cache's size in llama.cpp's memory report: q8_0 stores a row of 32 values in 34 bytes, f16 in 64
    plain = Engine(moe, moe_drafter, n_ctx=512)
    assert kv_bytes(e) * 64 == kv_bytes(plain) * 34
    # the drafter's cache is f32 on the CPU by default, f16 with -ctkd/-ctvd f16
    half = Engine(moe, moe_drafter, n_ctx=512, placement=placement("-ctkd", "f16", "-ctvd", "f16"))
    assert kv_bytes(plain, "drafter") == 2 * kv_bytes(half, "drafter")
    assert plain.model_info()["placement"]["cache_type_k_draft"] == "f32"
    info = e.model_info()["placement"]
    assert (info["cache_type_k"], info["cache_type_v"], info["flash_attn"]) == ("q8_0", "q8_0", "on")
    # a verify block is at most -b tokens; the output stays that of plain decoding with the same caches
    assert e.complete("Hello world", max_tokens=24).token_ids == e.complete("Hello world", max_tokens=24,
                                                                              draft=False).token_ids


def test_model_flags_reach_llama_cpp(moe):
    e = Engine(moe, n_ctx=256, placement=placement(
        "-ngl", "3", "-sm", "none", "-mg", "0", "-ts", "1", "--no-mmap", "--mlock"))
    t = e.target
    assert (t.n_gpu_layers, t.split_mode, t.main_gpu, t.tensor_split, t.load_mode) == (3, 0, 0, [1.0], "mlock")
    # without a GPU the layers stay on the CPU, and the panel says so
    assert e.model_info()["placement"]["target_layers_on_gpu"] == 0
    # --no-mmap reads the weights into a CPU buffer instead of mapping the file
    mapped = Engine(moe, n_ctx=256)
    assert model_bytes(mapped, "CPU_Mapped") > 0 and model_bytes(e, "CPU_Mapped") == 0
    assert model_bytes(e, "CPU") == model_bytes(mapped, "CPU_Mapped")
    assert mapped.target.load_mode == "auto"


def test_ctx_size_0_is_the_trained_context(moe):
    e = Engine(moe, n_ctx=0)
    assert e.session.n_ctx == e.target.n_ctx_train == 1024 == e.n_ctx == e.model_info()["n_ctx"]


def test_override_and_n_cpu_moe_reach_the_loader(moe, tmp_path):
    # llama.cpp logs each tensor an override matched (the C API does not tell a tensor's buffer)
    r = subprocess.run([sys.executable, "-m", "dflash_local", "generate", "-m", str(moe), "--no-draft", "-p", "Hi",
                        "-n", "2", "-v", "--n-cpu-moe", "2", "-ot", r"blk\.3\.ffn_down_exps=CPU", "-c", "128"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    overridden = {line.split()[1] for line in r.stderr.splitlines() if "buffer type overridden" in line}
    assert overridden == {f"blk.{i}.ffn_{w}_exps.weight" for i in (0, 1) for w in ("up", "down", "gate")} | {
        "blk.3.ffn_down_exps.weight"}


def test_moe_with_experts_on_the_cpu_is_lossless(moe, moe_drafter):
    e = Engine(moe, moe_drafter, n_ctx=1024, draft_policy="fixed",
               placement=placement("--n-cpu-moe", "2", "-ot", "ffn_(up|gate)_exps=CPU"))
    assert e.target.n_expert == 4 and len(e.target.overrides) == 3
    for p in make_prompts(8, seed=2):
        assert_lossless(e, p, max_tokens=40, drafted=False)
        assert_scripted_lossless(e, p, max_tokens=40)
    # the same tokens as the model loaded without overrides
    plain = Engine(moe, n_ctx=1024)
    assert plain.complete("Q: river code?\nA:", max_tokens=40).token_ids == e.complete(
        "Q: river code?\nA:", max_tokens=40).token_ids


BAD = [
    (["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "off"], "quantized V cache (-ctv) needs flash attention"),
    (["-ctvd", "q4_0"], "quantized V cache (-ctvd) needs flash attention"),  # a CPU drafter's default: off
    (["-ctk", "q9_0"], "invalid choice: 'q9_0'"),
    (["-fa", "maybe"], "invalid choice: 'maybe'"),
    (["-ot", "ffn_up_exps"], "give PATTERN=BUFFER_TYPE"),
    (["-ot", "exps=VRAM"], "unknown buffer type (this build has CPU)"),
    (["-ot", r"blk\.(=CPU"], "invalid tensor pattern"),
    (["-ts", "1,1"], "-ts gives 2 proportions but llama.cpp sees 0 GPU(s)"),
    (["-ts", "a,b"], "give proportions separated by commas"),
    (["-mg", "-1"], "-mg -1"),
    (["-b", "64", "-ub", "128"], "need 1 <= -ub <= -b"),
    (["-b", "1", "-ub", "1"], "-b must be at least 2"),
    (["-sm", "tensor", "-fa", "off"], "-sm tensor needs flash attention"),
    (["--n-cpu-moe", "-1"], "--n-cpu-moe -1"),
    (["-c", "-5"], "n_ctx must be 0"),
    (["-ctkd", "q8_0", "-fa", "on"], "-ctkd q8_0: the dflash model's attention heads hold 16 values"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_invalid_combinations_fail_cleanly(moe, moe_drafter, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's errors exit; ours return 2
        sys.exit(main(["generate", "-m", str(moe), "-d", str(moe_drafter), "-p", "Hi", "-n", "2", *flags]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_tui_model_panel_says_what_is_where(moe, moe_drafter):
    e = Engine(moe, moe_drafter, n_ctx=256, placement=placement(
        "--n-cpu-moe", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"))

    async def main_():
        app = ChatApp(e)
        async with app.run_test(size=(80, 40)) as pilot:
            await pilot.pause()
            return str(app.query_one(ModelPanel).render())

    text = asyncio.run(main_())
    assert "experts CPU in 2/4 layers" in text
    assert "kv      q8_0/q8_0 draft f32/f32 fa on" in text
    assert "CPU_Mapped" in text and "MiB" in text


def test_gemma_q8_0_cache_with_flash_attention_is_lossless(gemma_target, gemma_drafter, gemma_engine):
    e = Engine(gemma_target, gemma_drafter, n_ctx=2048, draft_policy="fixed",
               placement=placement("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"))
    assert kv_bytes(e) * 64 == kv_bytes(gemma_engine) * 34  # the target's cache is q8_0
    for p in make_prompts(3, seed=4) + ["The history of the printing press"]:
        assert_lossless(e, p, max_tokens=32, drafted=False)
        assert_scripted_lossless(e, p, max_tokens=32)


def test_gemma_cli_q8_0_cache(gemma_target, gemma_drafter, tmp_path):
    out = {}
    flags = ["-ctk", "q8_0", "-ctv", "q8_0", "-c", "512"]
    for mode in ("draft", "no-draft"):  # flash attention on by default on the CPU, where it is exact
        cmd = [sys.executable, "-m", "dflash_local", "generate", "-m", str(gemma_target), "-p", "The sky is",
               "-n", "24", "--json", *flags]
        cmd += ["-d", str(gemma_drafter)] if mode == "draft" else ["--no-draft"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=True)
        out[mode] = json.loads(r.stdout)
    assert out["draft"]["token_ids"] == out["no-draft"]["token_ids"] and out["draft"]["steps"] > 0
    # without flash attention llama.cpp cannot store V quantized: refused before any model loads
    r = subprocess.run([sys.executable, "-m", "dflash_local", "generate", "-m", str(gemma_target), "-d",
                        str(gemma_drafter), "-p", "The sky is", *flags, "-fa", "off"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == (
        "dflash-local: error: a quantized V cache (-ctv) needs flash attention: add -fa on (or auto)")


# -- where the weights land: ggml's extra buffer types (CPU_REPACK, AMX) only when --repack asks ----------------------


@pytest.fixture(scope="module")
def q4_0_drafter(models_dir, gemma_target, gemma_drafter):
    """The gemma-shaped drafter quantized to q4_0 by llama.cpp's quantizer: q4_0 weights are what ggml repacks on
    x86 (AVX2) and Arm CPUs, so an unasked repack shows on any CI machine, not only on AMX ones."""
    from dflash_local.convert.llama_quantize import quantize_gguf

    out = models_dir / "gemma-drafter-q4_0.gguf"
    quantize_gguf(gemma_drafter, out, 2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    return out


def extra_weight_bytes(engine, which):
    """Bytes of the model's weights in ggml's extra buffer types, read back from llama.cpp's memory report."""
    extra = set(_native.extra_buffer_types())
    return sum(row["model"] for row in engine.model_info()["memory"][which] if row["buffer_type"] in extra)


@pytest.mark.parametrize("flags", [[], ["--repack"], ["--repack", "draft"], ["--repack", "all"]],
                         ids=["default", "target", "draft", "all"])
def test_weights_go_to_extra_buffers_only_when_asked(gemma_target, q4_0_drafter, flags):
    pl = placement(*flags)
    e = Engine(gemma_target, q4_0_drafter, n_ctx=256, placement=pl)
    asked = {"target": pl.repack, "drafter": pl.repack_draft}
    assert (e.target.repack, e.draft_model.repack) == (asked["target"], asked["drafter"])  # the params llama.cpp got
    assert e.model_info()["placement"]["repack"] == [w for w, on in (("target", pl.repack),
                                                                       ("draft", pl.repack_draft)) if on]
    for which, on in asked.items():
        if not on:
            assert extra_weight_bytes(e, which) == 0, which
        elif _native.extra_buffer_types():  # a build without any (no repack for this CPU) has nothing to show
            assert extra_weight_bytes(e, which) > 0, which


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_the_builtin_pairs_load_no_weights_in_extra_buffers(name):
    from dflash_local import models

    e = Engine(models.target(name), models.drafter(name), n_ctx=256)
    assert not e.target.repack and not e.draft_model.repack
    assert extra_weight_bytes(e, "target") == extra_weight_bytes(e, "drafter") == 0


def test_weights_in_unasked_extra_buffers_are_refused():
    extra = _native.extra_buffer_types() or pytest.skip("this build has no extra buffer types on this CPU")
    memory = {"target": [{"buffer_type": "CPU_Mapped", "model": 10}],
              "drafter": [{"buffer_type": extra[0], "model": 10}, {"buffer_type": "CPU_Mapped", "model": 10}]}
    with pytest.raises(PlacementError, match=f"the drafter's weights went to {extra[0]}"):
        placement().check_weights(memory)
    placement("--repack", "draft").check_weights(memory)
    with pytest.raises(PlacementError, match="the target's weights"):
        placement("--repack", "draft").check_weights({"target": memory["drafter"]})


def test_repack_is_refused_on_amx_cpus(moe, monkeypatch, capsys):
    # ggml's AMX matmul crashes the process (README, "CPUs"); this CPU may have no AMX, so its list is given
    monkeypatch.setattr(_native, "extra_buffer_types", lambda: ["AMX", "CPU_REPACK"])
    placement().check(drafting=True)
    for which in ("target", "draft", "all"):
        assert main(["generate", "-m", str(moe), "-p", "Hi", "-n", "2", "--repack", which]) == 2
        err = capsys.readouterr().err
        assert "this CPU has AMX" in err and "ggml-org/llama.cpp#20824" in err and "Traceback" not in err
