"""`dflash-local train` on the tiny target: data from the native export, training, resume, validation, export."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_prompts

torch = pytest.importorskip("torch")

from dflash_local import Engine, _native  # noqa: E402
from dflash_local.cli import main  # noqa: E402
from dflash_local.convert.init_drafter import init_drafter  # noqa: E402
from dflash_local.train.corpus import read_corpus, training_prompts  # noqa: E402
from dflash_local.gguf_file import read_gguf  # noqa: E402
from dflash_local.engine.placement import FLASH_ATTN, Placement  # noqa: E402
from dflash_local.engine.sampling import SamplingParams  # noqa: E402
from dflash_local.engine.torch_drafter import TorchDraftBackend  # noqa: E402
from dflash_local.train.run import Trainer, TrainConfig, draft_vocabulary, label_index, sequence_loss  # noqa: E402
from dflash_local.train.data import Sample, load_sample, make_data  # noqa: E402

ARGS = ["--samples", "10", "--max-new", "40", "--draft-vocab", "300", "--block-size", "6", "--layers", "1",
        "--target-layers", "1,3", "--eval-every", "20", "--eval-prompts", "2", "--eval-tokens", "24",
        "--save-every", "10", "--outtype", "f16", "--threads", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "prompts.txt"
    path.write_text("\n\n".join(make_prompts(20, seed=7)) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_target, corpus):
    """40 steps in two sittings: 20, then the same command resumed to 40."""
    out = tmp_path_factory.mktemp("train") / "run"
    base = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus)] + ARGS
    assert main(base + ["--steps", "20"]) == 0
    first = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.npz")}
    args = base + ["--steps", "40"]
    args[args.index("--samples") + 1] = "12"  # more data in the second sitting: the vocabulary stays
    assert main(args) == 0
    return out, first


def load_run(out):
    cfg = TrainConfig(**json.loads((out / "train.json").read_text()))
    tr = Trainer(cfg, log=lambda m: None)
    tr.device = torch.device("cpu")
    samples = [load_sample(p) for p in sorted((out / "data").glob("sample-*.npz"))]
    model, emb, row_of, _ = tr.build(samples, np.random.default_rng(0))
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    best = out / "best.pt"  # the weights exported: the best validated step's
    model.load_state_dict(torch.load(best, weights_only=False)["model"] if best.exists() else state["model"])
    label_of = label_index(model, tr.target_info.n_vocab)
    return tr, model.eval(), emb, row_of, label_of, state["scale"], samples, state["step"]


def test_data_is_the_targets_greedy_continuation_with_its_features(run, tiny_target, corpus):
    out, _ = run
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["layers"] == [1, 3] and meta["max_new"] == 40
    e = Engine(tiny_target, None, n_ctx=512)
    for i, prompt in enumerate(training_prompts(corpus, seed=0)[:3]):  # sample i comes from prompt i
        s = load_sample(out / "data" / f"sample-{i:06d}.npz")
        assert s.tokens[: s.n_prompt].tolist() == e.prompt_tokens(prompt)
        plain = e.complete(prompt, max_tokens=40).token_ids
        assert s.tokens[s.n_prompt :].tolist() == plain[: len(s.tokens) - s.n_prompt]
        assert len(s.features) == len(s.tokens) - 1
    # the features are the target's at those positions, as the engine captures them while drafting (in bfloat16),
    # and the stored distributions its own: the best token after each position is the next token
    sess = _native.Session(e.target, None, [1, 3], 512, 2, _native.arch_records_layer_inputs(e.target.arch), False,
                           FLASH_ATTN[e.placement.fa])
    sess.prefill([int(t) for t in s.tokens[:-1]], SamplingParams().native(), 0)
    # (stored in bfloat16, 8 bits of mantissa, from a batch of several sequences, which rounds a little differently)
    f = sess.features()
    np.testing.assert_allclose(s.features_f32(), f, rtol=2**-8, atol=1e-3 * np.abs(f).max())
    assert s.top_ids[s.n_prompt - 1 :, 0].tolist() == s.tokens[s.n_prompt :].tolist()
    for row in (s.n_prompt - 1, len(s.tokens) - 2):
        sess.truncate(0)
        sess.prefill([int(t) for t in s.tokens[: row + 1]], SamplingParams().native(), 0)
        logits = sess.logits(-1).astype(np.float64)
        lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        top = np.argsort(-lp, kind="stable")[: s.top_ids.shape[1]]
        assert s.top_ids[row].tolist() == top.tolist()
        # float16 (half a unit in the last place: 5e-4 here) from the batch of several sequences, whose shared cache
        # puts a sequence's cells among the others', so flash attention's blocks of cells group them differently
        np.testing.assert_allclose(s.top_logprobs[row], lp[top], atol=4e-3)


def test_resume_keeps_data_and_continues_the_step_count(run, tiny_target):
    out, first = run
    now = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.npz")}
    assert len(first) == 10 and len(now) == 12
    assert {k: now[k] for k in first} == first  # not regenerated
    # the reduced vocabulary chosen from the first 10 samples is kept by the resumed run and exported
    first_ten = [load_sample(out / "data" / f"sample-{i:06d}.npz") for i in range(10)]
    d2t = TorchDraftBackend.load(out / "drafter-f16.gguf", tiny_target).model.d2t.numpy()
    assert np.array_equal(d2t, draft_vocabulary(first_ten, 488, 300))
    log = [json.loads(x) for x in (out / "train.log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [10, 20, 30, 40]
    assert [r["step"] for r in log if "eval" in r] == [20, 40]
    assert log[-1]["eval"]["mean_acceptance_length"] >= 1.0 and log[-1]["eval"]["drafted"] > 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 40
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0]


def test_data_from_other_prompts_is_refused(run, tiny_target, corpus):
    out, _ = run
    prompts = training_prompts(corpus, seed=0)
    with pytest.raises(ValueError, match="sample-000000.npz was made from another prompt"):
        make_data(tiny_target, out / "data", [1, 3], prompts[::-1], 12, 40)
    assert len(make_data(tiny_target, out / "data", [1, 3], prompts, 12, 40)) == 12  # the same ones are reused


def test_a_run_keeps_its_own_prompts_when_the_corpus_changes_between_sittings(tmp_path, tiny_target):
    """The default corpora are built from the installed packages, so one installed between two sittings reorders
    them: the first sitting records the run's prompts and the next reads them back, so its samples stay its own."""
    corpus = tmp_path / "prompts.txt"
    texts = make_prompts(12, seed=3)
    corpus.write_text("\n\n".join(texts) + "\n")
    out = tmp_path / "run"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus)] + ARGS
    args[args.index("--samples") + 1] = "3"
    args[args.index("--eval-every") + 1] = "0"
    assert main(args + ["--steps", "2"]) == 0
    order = training_prompts(corpus, seed=0)
    assert json.loads((out / "prompts.json").read_text()) == order
    corpus.write_text("\n\n".join(make_prompts(2, seed=4) + texts) + "\n")  # the corpus grew between sittings
    assert training_prompts(corpus, seed=0)[:4] != order[:4]
    args[args.index("--samples") + 1] = "4"
    assert main(args + ["--steps", "4"]) == 0
    for i in range(4):  # the first sitting's samples and the new one, all from the recorded order
        assert str(load_sample(out / "data" / f"sample-{i:06d}.npz").prompt) == order[i]


def test_a_run_with_other_shapes_is_refused(run, tiny_target, corpus, capsys):
    out, _ = run
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus)] + ARGS + ["--steps", "50"]
    args[args.index("--block-size") + 1] = "4"
    assert main(args) == 2
    assert "block_size" in capsys.readouterr().err
    for flag, value, message in (("--soft-labels", "1.5", "--soft-labels must be between 0 and 1"),
                                 ("-np", "0", "-np/--parallel must be between 1 and 256"),
                                 ("--samples", "0", "--samples must be 1 or more"),
                                 ("--samples", "19", "too few for 19 samples and 2 held-out prompts")):
        assert main(args[:3] + ["-o", str(out.parent / "other"), "--corpus", str(corpus)] + ARGS + [flag, value]) == 2
        assert message in capsys.readouterr().err
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 40  # nothing lost


def test_export_is_a_zlab_checkpoint_and_a_reduced_vocab_gguf(run, tiny_target):
    out, _ = run
    cfg = json.loads((out / "zlab" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 6
    assert cfg["draft_vocab_size"] == 300
    info = read_gguf(out / "drafter-f16.gguf")
    assert tuple(info.tensors["d2t"].shape) == (300,) and "output.weight" in info.tensors
    assert [int(v) for v in info.get("target_layers").values] == [1, 3]
    # the default window: the drafter sees the context's last 512 positions, every layer
    assert cfg["use_sliding_window"] and cfg["sliding_window"] == 512
    assert info.get("attention.sliding_window") == 512 and list(info.get("attention.sliding_window_pattern").values) == [True]


def check_drafts_agree(out, target, n_samples=4, backends=("zlab", "gguf")):
    """The training forward, the torch backend on the exported checkpoint and on the GGUF, and llama.cpp's graph on
    the GGUF propose the same tokens."""
    tr, model, emb, row_of, _, scale, samples, _ = load_run(out)
    B = model.shape.block_size
    gguf = next(out.glob("drafter-*.gguf"))
    torch_backends = [TorchDraftBackend.load(out / "zlab" if b == "zlab" else gguf, target) for b in backends]
    tm = _native.Model(str(target), 0, False)
    dm = _native.Model(str(gguf), 0, True)
    layers = model.shape.target_layers
    greedy = SamplingParams().native()
    checked = 0
    for s in [s for s in samples if len(s.tokens) > s.n_prompt + 4][:n_samples]:
        a = s.n_prompt + 3
        with torch.no_grad():
            ctx = model.context_kv(torch.from_numpy(s.features_f32(a)) / scale, torch.arange(a))
            noise = torch.tensor([int(s.tokens[a])] + [model.shape.mask_token] * (B - 1))
            h = model(emb[row_of[noise]], torch.arange(a, a + B), ctx)[1:]
            logits = h @ tr.head(model).T
            if model.selector is None:
                trained = model.d2t[logits.argmax(-1)].tolist()
            else:  # DFlash2: the walk through the selector lattice, over the full vocabulary
                full = torch.full((B - 1, tr.target_info.n_vocab), -torch.inf)
                full[:, model.d2t] = logits
                lattice = model.selector_lattice(h, full, int(s.tokens[a]), model.shape.selector_top_k)
                trained = model.walk(*lattice)[0]
        for backend in torch_backends:
            backend.crop(0)
            backend.add(s.features_f32(a), 0)
            assert backend.draft([int(s.tokens[a])], B - 1) == trained
        sess = _native.Session(tm, dm, layers, 512, 2, _native.arch_records_layer_inputs(tm.arch), False,
                               FLASH_ATTN[Placement().fa])  # as the data was made
        sess.prefill([int(t) for t in s.tokens[:a]], greedy, 0)
        assert list(sess.draft(int(s.tokens[a]), B - 1).tokens) == trained
        checked += 1
    assert checked == n_samples


def test_trained_drafts_are_the_same_in_training_torch_and_llama_cpp(run, tiny_target):
    """The feature scale folded into fc and the d2t map survive the export."""
    check_drafts_agree(run[0], tiny_target)


def test_train_on_gemma(gemma_target, tmp_path):
    """gemma3 runs the eval-callback capture, has hidden states beyond float16's range and a 262k vocabulary."""
    (tmp_path / "c.txt").write_text("The river\n\ndef main():\n\nOnce upon a time\n\nThe best way to\n")
    out = tmp_path / "run"
    assert main(["train", "-m", str(gemma_target), "-o", str(out), "--corpus", str(tmp_path / "c.txt"),
                 "--samples", "2", "--max-new", "16", "--steps", "3", "--eval-every", "3", "--eval-prompts", "1",
                 "--eval-tokens", "8", "--block-size", "4", "--draft-vocab", "2048", "--outtype", "q8_0"]) == 0
    info = read_gguf(out / "drafter-q8_0.gguf")
    assert tuple(info.tensors["d2t"].shape) == (2048,) and info.tensors["fc.weight"].type == "Q8_0"
    assert [int(v) for v in info.get("target_layers").values] == [10]  # one layer: the middle of 18
    check_drafts_agree(out, gemma_target, n_samples=2, backends=("zlab",))


class Pick:
    """rng stand-in for sequence_loss: choose these anchors."""

    def __init__(self, anchors):
        self.anchors = anchors

    def choice(self, cand, size, replace):
        return np.array(self.anchors)


def logits_alone(tr, model, emb, row_of, scale, s, anchors):
    """Each anchor's block drafted alone over its context, as the drafter drafts (no training mask)."""
    B = model.shape.block_size
    alone = []
    with torch.no_grad():
        for a in anchors:
            ctx = model.context_kv(torch.from_numpy(s.features_f32(a)) / scale, torch.arange(a))
            noise = torch.tensor([int(s.tokens[a])] + [model.shape.mask_token] * (B - 1))
            alone.append(model(emb[row_of[noise]], torch.arange(a, a + B), ctx)[1:] @ tr.head(model).T)
    return torch.cat(alone)


def greedy_labels(s, anchors, B, label_of):
    """The target's greedy continuation of each anchor: its next token after each position, for as long as the
    tokens in between are its own (in the continuation always; in the prompt only where it agrees); -1 past that."""
    labels = []
    for a in anchors:
        own = True
        for k in range(1, B):
            labels.append(int(label_of[int(s.top_ids[a + k - 1, 0])]) if own else -1)
            own = own and int(s.tokens[a + k]) == int(s.top_ids[a + k - 1, 0])
    return torch.tensor(labels)


def test_blocks_trained_together_see_only_their_own_block_and_earlier_context(run):
    """The block mask: a batch of blocks gives each block the hidden states it gets alone (its context before the
    anchor, bidirectional inside the block, nothing from the other blocks)."""
    out, _ = run
    tr, model, emb, row_of, label_of, scale, samples, _ = load_run(out)
    s = samples[1]
    B = model.shape.block_size
    anchors = [1, s.n_prompt, s.n_prompt + 4, s.n_prompt + 11]  # the first in the prompt
    logits = logits_alone(tr, model, emb, row_of, scale, s, anchors)
    with torch.no_grad():
        weights = torch.ones(B - 1)
        b = sequence_loss(model, tr.head(model), emb, row_of, label_of, s, scale, 4, Pick(anchors), weights)
        labels = greedy_labels(s, anchors, B, label_of)
        assert (labels[: B - 1] < 0).any() and (labels[B - 1 :] >= 0).sum() > 0  # this prompt strays from the target
        ok = labels >= 0
        ce = torch.nn.functional.cross_entropy(logits[ok], labels[ok], reduction="sum")
    assert float(b.loss) == pytest.approx(float(ce), rel=1e-4)
    right = (logits.argmax(-1) == labels).view(4, B - 1).int()
    assert b.accepted == torch.cumprod(right, 1).sum(1).tolist()
    # soft labels: the target's top tokens after the position before each label, renormalised over the draft
    # vocabulary, mixed in at the given share
    with torch.no_grad():
        soft = sequence_loss(model, tr.head(model), emb, row_of, label_of, s, scale, 4, Pick(anchors), weights, 0.25)
        rows = [a + k - 1 for a in anchors for k in range(1, B)]
        d = label_of[torch.from_numpy(s.top_ids[rows]).long()]
        p = torch.softmax(torch.from_numpy(s.top_logprobs[rows].astype(np.float32)).masked_fill(d < 0, -torch.inf), -1)
        target = torch.zeros_like(logits).scatter_add_(1, d.clamp(min=0), p.nan_to_num(0.0))
        soft_ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
        hard = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        expect = ((0.75 * hard + 0.25 * soft_ce) * ok).sum()
    assert float(soft.loss) == pytest.approx(float(expect), rel=1e-4)


def test_a_window_limits_the_context_in_training_as_in_drafting(run):
    """With a window of w positions, a batch of blocks gives each block the hidden states it gets alone when the
    drafter drafts with that window (keys at least w before a query unseen), and a window shorter than the context
    changes them."""
    import dataclasses

    out, _ = run
    tr, model, emb, row_of, label_of, scale, samples, _ = load_run(out)
    s = samples[1]
    B = model.shape.block_size
    anchors = [s.n_prompt, s.n_prompt + 9]

    def losses():
        with torch.no_grad():
            b = sequence_loss(model, tr.head(model), emb, row_of, label_of, s, scale, 2, Pick(anchors),
                              torch.ones(B - 1))
        return float(b.loss), logits_alone(tr, model, emb, row_of, scale, s, anchors)

    assert model.shape.sliding_window == 512 > len(s.tokens)  # the run's: longer than its samples
    full_loss, full = losses()
    model.shape = dataclasses.replace(model.shape, sliding_window=5)
    loss, logits = losses()
    assert not torch.allclose(logits, full)
    labels = greedy_labels(s, anchors, B, label_of)
    ok = labels >= 0
    assert ok.any()
    ce = torch.nn.functional.cross_entropy(logits[ok], labels[ok], reduction="sum")
    assert loss == pytest.approx(float(ce), rel=1e-4) and loss != pytest.approx(full_loss, rel=1e-4)


def test_a_short_window_drafts_the_same_in_training_torch_and_llama_cpp(tmp_path, tiny_target, corpus):
    """--window 3: the exported GGUF's sliding window is llama.cpp's mask too (its dflash graph), so the three agree
    where the window hides most of the context."""
    out = tmp_path / "run"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus), "--steps", "6", "--window", "3"]
    assert main(args + ARGS) == 0
    assert read_gguf(out / "drafter-f16.gguf").get("attention.sliding_window") == 3
    check_drafts_agree(out, tiny_target, n_samples=3)
    assert main(["train", "-m", str(tiny_target), "-o", str(tmp_path / "bad"), "--window", "-1"] + ARGS) == 2


def test_a_best_step_validated_on_other_prompts_is_set_aside(tmp_path, tiny_target, corpus, capsys):
    out = tmp_path / "run"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus)] + ARGS
    args[args.index("--samples") + 1] = "4"
    args[args.index("--eval-every") + 1] = "10"
    assert main(args + ["--steps", "10"]) == 0
    assert torch.load(out / "best.pt", weights_only=False)["held_out"] == training_prompts(corpus, seed=0)[-2:]
    args[args.index("--eval-prompts") + 1] = "3"  # another held-out set: its acceptance does not compare
    capsys.readouterr()
    assert main(args + ["--steps", "20"]) == 0
    assert "kept as best.previous.pt" in capsys.readouterr().err
    assert torch.load(out / "best.previous.pt", weights_only=False)["step"] == 10
    best = torch.load(out / "best.pt", weights_only=False)
    assert best["step"] == 20 and best["held_out"] == training_prompts(corpus, seed=0)[-3:]


def test_passages_are_read_by_the_target_and_the_best_validated_drafter_is_exported(tmp_path, tiny_target, corpus):
    out = tmp_path / "run"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus)] + ARGS + ["--steps", "30"]
    args[args.index("--samples") + 1] = "4"
    args[args.index("--eval-every") + 1] = "10"
    assert main(args + ["--text-samples", "12"]) == 0
    # validation reads the corpus's last prompts (2 here), and no data is made from them, continued or read
    held = training_prompts(corpus, seed=0)[-2:]
    unfiltered = training_prompts(corpus, seed=0, passages=True)
    assert unfiltered != training_prompts(corpus, seed=0)  # another order than the continued prompts
    assert any(unfiltered.index(h) < 12 for h in held)  # (so one would have been read)
    made = [load_sample(f).prompt for f in sorted(out.glob("data*/sample-*.npz"))]
    assert len(made) == 4 + 12 and not set(made) & set(held)
    passages = [p for p in unfiltered if p not in held]
    # a passage is the text itself, read in one batch: features and the target's next tokens after every position
    e = Engine(tiny_target, None, n_ctx=512)
    sess = _native.Session(e.target, None, [1, 3], 512, 2, _native.arch_records_layer_inputs(e.target.arch), False,
                           FLASH_ATTN[e.placement.fa])
    for i in range(12):
        s = load_sample(out / "data-text" / f"sample-{i:06d}.npz")
        assert s.tokens.tolist() == e.prompt_tokens(passages[i])[:512] and s.n_prompt == len(s.tokens)
        assert len(s.features) == len(s.top_ids) == len(s.tokens) - 1
        sess.truncate(0)
        sess.prefill([int(t) for t in s.tokens[:-1]], SamplingParams().native(), 0)
        f = sess.features()
        np.testing.assert_allclose(s.features_f32(), f, rtol=2**-8, atol=1e-3 * np.abs(f).max())
        assert s.top_ids[-1, 0] == int(np.argmax(sess.logits(-1)))
    assert json.loads((out / "data-text" / "meta.json").read_text())["max_new"] == 0
    # validated at steps 10, 20 and 30; the export holds the weights of the best of them
    log = [json.loads(x) for x in (out / "train.log.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval"]["mean_acceptance_length"] for r in log if "eval" in r}
    assert list(evals) == [10, 20, 30]
    best = torch.load(out / "best.pt", weights_only=False)
    assert best["tau"] == max(evals.values()) and best["step"] == min(k for k, v in evals.items() if v == best["tau"])
    exported = TorchDraftBackend.load(out / "drafter-f16.gguf", tiny_target).model.state_dict()
    for name in ("lm_head", *sorted(k for k in best["model"] if k.startswith("layers.0."))):
        np.testing.assert_allclose(exported[name].float(), best["model"][name].float(), rtol=2e-3, atol=2e-3)
    assert main(args + ["--text-samples", "-1", "-o", str(tmp_path / "bad")]) == 2


def test_training_goes_on_from_an_existing_drafter(run, tiny_target, gemma_target, corpus, tmp_path, capsys):
    init = run[0] / "drafter-f16.gguf"
    out = tmp_path / "on"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus), "--init", str(init),
            "--samples", "4", "--max-new", "40", "--steps", "1", "--lr", "1e-12", "--eval-every", "0",
            "--outtype", "f32", "--threads", "2"]
    assert main(args) == 0
    cfg = json.loads((out / "train.json").read_text())
    # its shape is the drafter's (ARGS: 1 layer, block 6, features of layers 1 and 3, 300 draft tokens)
    assert (cfg["n_layer"], cfg["block_size"], cfg["target_layers"], cfg["draft_vocab"]) == (1, 6, [1, 3], 300)
    # and a step this small changes nothing: the export holds the drafter's weights (fc too: its scale round-trips)
    before = TorchDraftBackend.load(init, tiny_target).model.gguf_tensors()
    after = TorchDraftBackend.load(out / "drafter-f32.gguf", tiny_target).model.gguf_tensors()
    assert before.keys() == after.keys() and "fc.weight" in after and "d2t" in after
    for name, w in before.items():
        np.testing.assert_allclose(after[name], w, rtol=1e-4, atol=1e-6, err_msg=name)
    # a drafter for another target is refused before any work
    other = init_drafter(tmp_path / "gemma-drafter.gguf", gemma_target, n_layer=1, n_target_layers=2, block_size=4)
    args[args.index("--init") + 1], args[args.index("-o") + 1] = str(other), str(tmp_path / "bad")
    capsys.readouterr()
    assert main(args) == 2
    assert "gemma-drafter.gguf" in capsys.readouterr().err and not (tmp_path / "bad" / "data").exists()


def test_draft_vocabulary_keeps_the_tokens_the_target_predicts_most():
    tokens = np.array([9, 9, 1, 1, 1, 2, 3, 3], dtype=np.int32)
    greedy = np.array([[5], [1], [1], [1], [2], [3], [3]], dtype=np.int32)  # its next token after each position
    s = [Sample(tokens, 2, np.zeros((7, 4), np.uint16), top_ids=greedy)]
    assert draft_vocabulary(s, 10, 2).tolist() == [1, 3]  # what the text holds (9) does not count, only the labels
    assert draft_vocabulary(s, 10, 5).tolist() == [0, 1, 2, 3, 5]  # then the lowest ids
    prior = np.array([0, 0, 0, 0, 0, 0, 0, 0, 5, 9], dtype=float)
    assert draft_vocabulary(s, 10, 5, prior).tolist() == [1, 2, 3, 5, 9]  # or the tokenizer's scores


def test_default_corpus_has_many_languages_provenance_and_licences_and_is_reproducible(tmp_path):
    assert main(["corpus", "-o", str(tmp_path / "corpus.jsonl")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert all(set(r) == {"prompt", "source", "license", "kind"} and r["license"] and r["source"] for r in rows)
    assert len({" ".join(r["prompt"].split()) for r in rows}) == len(rows)  # deduplicated
    # code and prose alternate, and any prefix mixes the sources: the first 40 hold Python from the standard library
    # and from installed packages, prose from package descriptions, and (on a Debian machine) man pages
    head = rows[:40]
    assert [r["kind"] for r in head[:6]] == ["code", "prose"] * 3
    assert any(r["license"] == "PSF-2.0" for r in head) and any(r["source"].endswith("/METADATA") for r in head)
    assert any(r["prompt"].lstrip().startswith(("def ", "class ", "async def ")) and r["license"] != "PSF-2.0"
               for r in head)
    if Path("/usr/share/man").is_dir():
        assert any("/usr/share/man/" in r["source"] for r in head)
    assert [r["prompt"] for r in rows[:200]] == training_prompts(seed=0)[:200]  # the order training uses


def test_corpus_files_are_read_as_prompts(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"prompt": "one"}\n\n{"text": "two"}\n')
    assert read_corpus(tmp_path / "c.jsonl") == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_corpus(tmp_path / "bad.jsonl")


def test_a_dflash2_drafter_trains_exports_and_drafts_the_same_everywhere(tmp_path, tiny_target, corpus):
    """`train --variant dflash2`: convolutions and candidate selector trained with the rest, exported as a z-lab
    DFlash2DraftModel checkpoint and a GGUF that `inspect` names DFlash2, drafting the same walk through the selector
    lattice in training, the torch backend and llama.cpp's graph; the engine drafts with it losslessly."""
    out = tmp_path / "run2"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--corpus", str(corpus), "--variant", "dflash2"] + ARGS
    assert main(args + ["--steps", "30"]) == 0
    cfg = json.loads((out / "zlab" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 4
    info = read_gguf(out / "drafter-f16.gguf")
    assert "selector_hidden.weight" in info.tensors and "blk.0.attn_conv_base" in info.tensors
    log = [json.loads(x) for x in (out / "train.log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0]
    check_drafts_agree(out, tiny_target, backends=("gguf",))
    prompts = make_prompts(6, seed=3)
    e = Engine(tiny_target, out / "drafter-f16.gguf", n_ctx=512, draft_policy="fixed")
    plain = [e.complete(p, max_tokens=40, draft=False).token_ids for p in prompts]
    fast = [e.complete(p, max_tokens=40) for p in prompts]
    assert [r.token_ids for r in fast] == plain
    assert sum(r.summary.n_drafted for r in fast) > 0
