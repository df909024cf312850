"""A qwen35 target this project did not write: a tiny Hugging Face Qwen3.5 checkpoint (tests/hf_qwen35.py) converted
by upstream llama.cpp's own converter (its Qwen3_5TextModel, run by tests/upstream_convert.py), MTP layer included as
upstream writes it. Every other hybrid test runs on write_tiny_qwen35's GGUF, so a mistake shared by that writer and
the engine would go unseen there.

The drafter is a real one, trained on this target by `dflash-local train` for a few steps: enough for partial
acceptances, so rejected drafts are rolled back through the CLI too. Engines with 7 snapshots roll back by snapshot,
engines with 2 by checkpoint and replay.
"""

import json
import subprocess
import sys

import gguf
import pytest
from conftest import UPSTREAM_ONLY, make_prompts, upstream_convert
from fixtures import write_tiny_qwen35
from hf_qwen35 import write_qwen35_checkpoint
from rollback import check_logits_after_rollbacks, generate_steps, scripted_run
from zlab import write_checkpoint, zlab_config

pytest.importorskip("torch")  # upstream's converter and `dflash-local train`

from dflash_local import Engine  # noqa: E402
from dflash_local.bench import run_bench  # noqa: E402
from dflash_local.cli import main  # noqa: E402
from dflash_local.convert.hf_to_gguf import ConvertError, convert_drafter  # noqa: E402
from dflash_local.convert.init_drafter import init_drafter  # noqa: E402
from dflash_local.gguf_file import read_gguf  # noqa: E402
from dflash_local.engine.placement import Placement  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module")
def target(models_dir, tiny_target, llama_cpp_src):
    """The checkpoint has the tiny target's vocabulary, whose tokenizer upstream_convert copies; its LM head never
    picks a control token, so generations run to their token limit."""
    types = read_gguf(tiny_target).kv["tokenizer.ggml.token_type"].values
    control = [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]
    ckpt = write_qwen35_checkpoint(models_dir / "qwen35-hf", vocab_size=len(types), silent=control)
    return upstream_convert(llama_cpp_src, ckpt, tiny_target, models_dir / "qwen35-upstream.gguf")


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("train-qwen35") / "run"
    corpus = out.parent / "prompts.txt"
    corpus.write_text("\n\n".join(make_prompts(120, seed=7)) + "\n")  # not the prompts the tests run
    assert main(["train", "-m", str(target), "-o", str(out), "--corpus", str(corpus), "--samples", "100",
                 "--max-new", "64", "--block-size", str(BLOCK), "--layers", "1", "--target-layers", "1,3",
                 "--steps", "300", "--lr", "3e-3", "--eval-every", "0", "--save-every", "300", "--outtype", "f32",
                 "--threads", "1"]) == 0
    return out / "drafter-f32.gguf"


def _engine(target, drafter, **kw):
    return Engine(target, drafter, n_ctx=1024, draft_policy="fixed", placement=Placement(n_threads=1), **kw)


@pytest.fixture(scope="module")
def snap(target, drafter):
    """Snapshots for the longest draft (7): every rollback uses them."""
    return _engine(target, drafter)


@pytest.fixture(scope="module")
def ckpt(target, drafter):
    """Two snapshots: rolling back more than two tokens restores the checkpoint and replays."""
    return _engine(target, drafter, n_rs_seq=2)


def test_upstream_wrote_a_qwen35_with_an_mtp_layer(target, snap):
    info = read_gguf(target)
    assert info.arch == "qwen35" and info.get("block_count") == 5 and info.get("nextn_predict_layers") == 1
    assert "blk.4.nextn.eh_proj.weight" in info.tensors
    # llama.cpp runs the 4 trunk layers; the MTP layer is not part of the target's graph, but -ngl counts its slot
    assert snap.target.n_layer == 4 and snap.session.recurrent and snap.session.uses_layer_api
    assert snap.model_info()["placement"]["target_layer_slots"] == 6
    assert snap.session.n_rs_seq == BLOCK - 1


def _partial(steps) -> int:
    return sum(1 for s in steps if 0 < s.n_accepted < s.n_drafted)


def test_cli_generate_is_lossless_with_partial_acceptances(target, drafter, tmp_path):
    def generate(*extra):
        run = subprocess.run([sys.executable, "-m", "dflash_local", "generate", "-m", str(target), "-p",
                              "def total(values):\n", "-n", "96", "--temp", "0", "--json", "-t", "1", *extra],
                             capture_output=True, text=True, cwd=tmp_path, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout)

    plain = generate("--no-draft")
    spec = generate("-d", str(drafter), "--draft-policy", "fixed")
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert len(plain["token_ids"]) == 96
    assert spec["drafting"] and spec["n_rollbacks"] > 0 and spec["n_checkpoint_rollbacks"] == 0
    assert spec["rollback_ms"] > 0
    # more steps accepted exactly k drafts than drafted exactly k: some of them drafted more, and rolled back the rest
    acc, dft = spec["accepted_at"], spec["drafted_at"]
    assert any(_exactly(acc, k) > _exactly(dft, k) for k in range(1, BLOCK - 1)), (acc, dft)


def _exactly(at: list[int], k: int) -> int:
    """Steps whose count (accepted or drafted) is exactly k, from the per-position counts (steps reaching k)."""
    return at[k - 1] - (at[k] if k < len(at) else 0)


@pytest.mark.parametrize("which,kinds", [("snap", {"snapshot"}), ("ckpt", {"snapshot", "checkpoint"})])
def test_greedy_dflash_is_token_identical_with_each_rollback(request, which, kinds):
    engine = request.getfixturevalue(which)
    partial, used = 0, set()
    for p in make_prompts(55):
        base = engine.complete(p, max_tokens=24, draft=False)
        done, steps = generate_steps(engine, p, 24)
        assert done.token_ids == base.token_ids, p
        assert done.text == base.text
        partial += _partial(steps)
        used |= {s.rollback for s in steps if s.rollback}
    assert partial > 0 and used == kinds


@pytest.mark.parametrize("which,kinds", [("snap", {"snapshot"}), ("ckpt", {"snapshot", "checkpoint"})])
def test_every_acceptance_length_with_each_rollback(request, which, kinds):
    engine = request.getfixturevalue(which)
    base, done, steps = scripted_run(engine, "The quick brown fox", 200)
    assert done.token_ids == base.token_ids and done.text == base.text
    full = [s for s in steps if s.n_drafted == BLOCK - 1]
    assert {s.n_accepted for s in full} == set(range(BLOCK))
    assert {s.rollback for s in steps if s.rollback} == kinds


@pytest.mark.parametrize("which,kind", [("snap", "snapshot"), ("ckpt", "checkpoint")])
def test_logits_after_a_rollback_equal_plain_decoding(request, target, which, kind):
    check_logits_after_rollbacks(request.getfixturevalue(which), target, kind)


def test_bench_reports_the_rollback_cost(target, drafter, ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(3, seed=5)))
    run = subprocess.run([sys.executable, "-m", "dflash_local", "bench", "-m", str(target), "-d", str(drafter),
                          "--prompts", str(prompts), "-n", "32", "--no-peer", "-t", "1",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    o = json.loads((tmp_path / "out" / "bench.json").read_text())["overall"]
    assert o["lossless"] and o["rollbacks"] > 0 and o["rollback_ms_per_rollback"] > 0
    assert o["checkpoint_rollbacks"] == 0  # snapshots for every draft
    assert "Rollback" in run.stdout
    # by checkpoint and replay (the bench command has no n_rs_seq flag: the same report from the engine)
    o = run_bench(ckpt, [{"prompt": "The quick brown fox"}], 24, peer=False, log=lambda *_: None)["overall"]
    assert o["lossless"] and o["checkpoint_rollbacks"] > 0 and o["rollback_ms_per_rollback"] > 0


def test_the_mtp_layer_is_no_feature_layer(target, drafter, tiny_target, tmp_path):
    """block_count counts the MTP layer, which the target's graph does not run: drafters, their conversion and
    training see the 4 layers llama.cpp runs (layer inputs 1..3). A z-lab drafter made for them converts without a
    warning that it was trained on another depth, and one reading past them is refused."""
    assert read_gguf(target).n_layer == 4
    assert json.loads((drafter.parent / "zlab" / "config.json").read_text())["num_target_layers"] == 4
    with pytest.raises(ValueError, match=r"target layers \[4\] outside the target's layer inputs 1..3"):
        init_drafter(tmp_path / "d.gguf", target, target_layers=[1, 4], block_size=4)
    cfg = zlab_config(hidden=64, n_layer=1, n_head=4, n_kv=2, head_dim=16, n_ff=128, target_layer_ids=[0, 2],
                      num_target_layers=4, vocab_size=read_gguf(target).n_vocab, block_size=BLOCK,
                      mask_token_id=read_gguf(tiny_target).kv["tokenizer.ggml.mask_token_id"])
    r = convert_drafter(write_checkpoint(tmp_path / "zlab", cfg, n_shards=1), target, tmp_path / "zlab.gguf", "f32")
    assert r.warnings == []
    e = _engine(target, r.path)
    assert e.complete("Hello", max_tokens=16).token_ids == e.complete("Hello", max_tokens=16, draft=False).token_ids
    cfg["dflash_config"]["target_layer_ids"] = [0, 3]
    with pytest.raises(ConvertError, match=r"target_layer_ids \[3\] do not exist .* 4 layers give features 0..2"):
        convert_drafter(write_checkpoint(tmp_path / "zlab-deep", cfg, n_shards=1), target, tmp_path / "x.gguf", "f32")


def test_our_writer_matches_upstreams_layout(target, models_dir):
    """write_tiny_qwen35 at the checkpoint's shapes against upstream's GGUF: the same tensors with the same shapes
    (upstream adds the MTP layer's) and the same hyperparameters, but for the RoPE (ours rotates whole heads at base
    1e4, Qwen3.5 a quarter of each head at base 1e7) and the MTP layer in the count. Upstream also lists the
    recurrent layers (ours: the loader derives them from full_attention_interval) and general.* provenance; ours
    has the tiny tokenizer's mask token, which upstream_convert does not copy."""
    ours = read_gguf(write_tiny_qwen35(models_dir / "qwen35-same-shapes.gguf", head_dim=32))
    theirs = read_gguf(target)
    assert set(theirs.kv) - set(ours.kv) - UPSTREAM_ONLY == {"qwen35.attention.recurrent_layers",
                                                            "qwen35.nextn_predict_layers"}
    assert set(ours.kv) - set(theirs.kv) == {"tokenizer.ggml.mask_token_id"}
    differ = {k for k in set(ours.kv) & set(theirs.kv) if ours.kv[k] != theirs.kv[k]}
    assert differ == {"general.name", "qwen35.block_count", "qwen35.rope.dimension_count",
                      "qwen35.rope.dimension_sections", "qwen35.rope.freq_base"}
    assert theirs.kv["qwen35.attention.recurrent_layers"].values == [True, False, True, False, False]
    trunk = {n: t.shape for n, t in theirs.tensors.items() if not n.startswith("blk.4.")}
    assert trunk == {n: t.shape for n, t in ours.tensors.items()}
