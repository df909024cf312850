"""Failures inside the native session are Python exceptions that leave it usable; llama.cpp's log is per engine."""

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dflash_local import Engine, _native

GREEDY = _native.Sampling()


def _session(model, drafter=None, layers=(), n_ctx=128, capture=True, n_batch=512):
    s = _native.Session(model, drafter, list(layers), n_ctx, 2, True, False, n_batch=n_batch, n_ubatch=n_batch)
    s.set_capture(capture)
    return s


@pytest.fixture(scope="module")
def models(tiny_target, tiny_drafter):
    return _native.Model(str(tiny_target)), _native.Model(str(tiny_drafter), 0, True)


@pytest.fixture(scope="module")
def prompt(models):
    return models[0].tokenize("The quick brown fox jumps over", True, False)


def test_out_of_range_token_ids_raise_before_llama_cpp(models, prompt):
    tgt, dft = models
    n_vocab = tgt.n_vocab
    s = _session(tgt, dft, [1, 3])
    for bad in (-1, n_vocab, 2**31 - 1):
        with pytest.raises(IndexError, match=f"token id {bad} outside the vocabulary"):
            s.prefill(prompt[:3] + [bad], GREEDY, 0)
        assert s.n_past == 0
        with pytest.raises(IndexError, match="outside the vocabulary"):
            tgt.piece(bad)
    last = s.prefill(prompt, GREEDY, 0)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        s.draft(n_vocab, 3)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        s.step(n_vocab, [], GREEDY, 1)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        s.step(last, [1, -5, 2], GREEDY, 1)
    assert s.n_past == len(prompt)
    # nothing was decoded: the session goes on exactly as a fresh one
    ref = _session(tgt, dft, [1, 3])
    assert ref.prefill(prompt, GREEDY, 0) == last
    d, rd = s.draft(last, 7), ref.draft(last, 7)
    assert d.tokens == rd.tokens
    assert s.step(last, d.tokens, GREEDY, 1).tokens == ref.step(last, rd.tokens, GREEDY, 1).tokens


def test_engine_survives_a_drafter_proposing_bad_ids(tiny_engine):
    prompt = "def total(values):\n"
    base = tiny_engine.complete(prompt, max_tokens=24, draft=False)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        tiny_engine.complete(prompt, max_tokens=24, external_drafter=lambda toks, n: [10**9] * n)
    # its record of the cached prefix stayed true: a run that reuses it gives the baseline's tokens
    again = tiny_engine.complete(prompt, max_tokens=24)
    assert again.summary.n_cached > 0
    assert again.token_ids == base.token_ids


def test_llama_cpp_failure_mid_prefill_rolls_the_target_back(models, prompt):
    """A drafter given three feature layers where it was trained on two rejects the features after the target
    decoded the chunk: a real llama.cpp error, raised with its log, and the target's cache is rolled back. (The
    features go to the drafter once a drafter batch of them is pending: batches of 8 here, the prompt longer.)"""
    tgt, dft = models
    s = _session(tgt, dft, [1, 2, 3], n_batch=8)
    assert len(prompt) > 8
    with pytest.raises(_native.NativeError, match=r"rejected the target features.*embedding size mismatch"):
        s.prefill(prompt, GREEDY, 0)
    assert isinstance(_native.NativeError("x"), RuntimeError)
    assert s.n_past == 0
    assert s.features().shape[0] == 0
    with pytest.raises(IndexError, match="0 output rows"):
        s.logits(0)
    # a target cache still holding the failed prefill would hold every position twice and change the logits
    s.set_capture(False)
    ref = _session(tgt, n_batch=8)
    assert s.prefill(prompt, GREEDY, 0) == ref.prefill(prompt, GREEDY, 0)
    np.testing.assert_array_equal(s.logits(-1), ref.logits(-1))


def test_llama_cpp_failure_mid_step_rolls_both_caches_back(models, prompt):
    tgt, dft = models
    s, ref = _session(tgt, dft, [1, 2, 3], capture=False, n_batch=8), _session(tgt, n_batch=8)
    last = s.prefill(prompt, GREEDY, 0)
    assert ref.prefill(prompt, GREEDY, 0) == last
    # six plain steps with capture on: their features wait for the drafter's next batch (of 8)
    s.set_capture(True)
    for i in range(6):
        r, rr = s.step(last, [], GREEDY, 1 + i), ref.step(last, [], GREEDY, 1 + i)
        assert r.tokens == rr.tokens
        last = r.tokens[0]
    assert s.n_pending == 6
    n_past = s.n_past
    # a failed flush before a draft changes nothing
    with pytest.raises(_native.NativeError, match="rejected the target features"):
        s.draft(last, 3)
    assert (s.n_past, s.n_pending) == (n_past, 6)
    # the verify batch succeeds and accepts a draft token, which fills the drafter's batch, then the injection fails
    draft = [ref.step(last, [], GREEDY, 7).tokens[0], 0, 0]  # its first token is right
    ref.truncate(n_past)
    with pytest.raises(_native.NativeError, match="rejected the target features"):
        s.step(last, draft, GREEDY, 7)
    assert (s.n_past, s.n_pending) == (n_past, 6)
    s.set_capture(False)
    r, rr = s.step(last, draft, GREEDY, 7), ref.step(last, draft, GREEDY, 7)
    assert r.n_accepted >= 1
    assert r.tokens == rr.tokens and s.n_past == ref.n_past
    np.testing.assert_array_equal(s.logits(0), ref.logits(0))


def test_verify_blocks_are_clipped_to_the_context(models, prompt):
    tgt, _ = models
    s = _session(tgt, n_ctx=64)
    n_ctx = s.n_ctx  # llama.cpp rounds it up
    ids = (prompt * n_ctx)[: n_ctx - 3]
    with pytest.raises(ValueError, match="does not fit"):
        s.prefill(ids + prompt[:3], GREEDY, 0)
    assert s.n_past == 0
    last = s.prefill(ids, GREEDY, 0)
    r = s.step(last, [1] * 10, GREEDY, 1)  # room for 2 drafts only (1 where the last cell is decoded alone)
    assert len(r.draft) == 2 - s.pads_rows
    while s.n_past < n_ctx:
        r = s.step(r.tokens[-1], [1] * 10, GREEDY, 9)
    assert s.n_past == n_ctx
    with pytest.raises(ValueError, match="context is full"):
        s.step(r.tokens[-1], [], GREEDY, 9)
    s.truncate(0)
    assert s.prefill(ids, GREEDY, 0) == last


def test_bad_session_arguments_are_value_errors(models, tiny_target):
    tgt, dft = models
    with pytest.raises(ValueError, match="listed twice"):
        _session(tgt, dft, [1, 1])
    with pytest.raises(ValueError, match="not 'dflash'"):
        _session(tgt, tgt, [1, 3])
    with pytest.raises(ValueError, match="needs target feature layers"):
        _session(tgt, dft)
    with pytest.raises(ValueError, match="outside the target's"):
        _session(tgt, None, [0])
    with pytest.raises(ValueError, match="n_ctx"):
        _session(tgt, n_ctx=1)
    with pytest.raises(IndexError, match="truncate position 5"):
        _session(tgt).truncate(5)
    with pytest.raises(_native.NativeError, match="failed to load model"):
        _native.Model(str(tiny_target) + ".missing")


def test_sampler_arguments_and_nan_logits():
    with pytest.raises(ValueError, match="min_p"):
        _native.Sampling(1.0, 0, 1.0, 2.0)
    with pytest.raises(ValueError, match="top_p"):
        _native.Sampling(1.0, 0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        _native.Sampling(float("nan"))
    with pytest.raises(ValueError, match="logits"):
        _native.sample(np.zeros(0, np.float32), GREEDY, 0)
    with pytest.raises(_native.NativeError, match="NaN"):
        _native.sample(np.full(10, np.nan, np.float32), _native.Sampling(1.0, 0, 1.0, 0.1), 0)


def test_verbosity_is_per_engine(tiny_target, tiny_drafter, capfd):
    capfd.readouterr()
    loud = Engine(tiny_target, tiny_drafter, n_ctx=256, verbose=True)
    assert "llama_model_loader" in capfd.readouterr().err
    quiet = Engine(tiny_target, tiny_drafter, n_ctx=256)
    assert capfd.readouterr().err == ""
    # an engine's first decode reserves the scheduler's graphs, and logs it: only the verbose engine shows it
    loud.complete("Hello", max_tokens=4)
    assert "sched_reserve" in capfd.readouterr().err
    quiet.complete("Hello", max_tokens=4)
    assert capfd.readouterr().err == ""
    # and it can be changed afterwards, for one engine only
    hushed = Engine(tiny_target, tiny_drafter, n_ctx=256, verbose=True)
    raised = Engine(tiny_target, tiny_drafter, n_ctx=256)
    capfd.readouterr()
    hushed.set_verbose(False)
    raised.set_verbose(True)
    hushed.complete("Hello", max_tokens=2)
    assert capfd.readouterr().err == ""
    raised.complete("Hello", max_tokens=2)
    assert "sched_reserve" in capfd.readouterr().err
    # freeing a context logs its buffers
    del quiet, hushed
    gc.collect()
    assert capfd.readouterr().err == ""
    del loud, raised
    gc.collect()
    assert "~llama_context" in capfd.readouterr().err


def test_importing_and_using_dflash_local_leaves_llama_cpp_python_logging_alone(tiny_target):
    """llama-cpp-python installs its own log callback; ours only handles lines logged during our engines' calls."""
    script = textwrap.dedent(f"""
        import sys
        def mark(s):
            print("@@" + s, file=sys.stderr, flush=True)
        mark("import")
        from dflash_local import Engine
        mark("quiet engine before llama_cpp")
        Engine({str(tiny_target)!r}, n_ctx=64).complete("Hi", max_tokens=2)
        import llama_cpp
        mark("verbose llama_cpp model")
        llama_cpp.Llama({str(tiny_target)!r}, n_ctx=64, verbose=True)
        mark("quiet engine after llama_cpp")
        Engine({str(tiny_target)!r}, n_ctx=64).complete("Hi", max_tokens=2)
        mark("verbose llama_cpp model again")
        llama_cpp.Llama({str(tiny_target)!r}, n_ctx=64, verbose=True)
        mark("end")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    parts = dict(part.split("\n", 1) for part in p.stderr.split("@@")[1:])
    assert parts["import"] == ""
    assert parts["quiet engine before llama_cpp"] == ""
    assert "llama_model_loader" in parts["verbose llama_cpp model"]
    assert parts["quiet engine after llama_cpp"] == ""
    assert "llama_model_loader" in parts["verbose llama_cpp model again"]


def test_decode_rows_checks_its_rows_before_llama_cpp(models, prompt):
    """The training-data decode of several sequences side by side refuses what llama.cpp would abort on."""
    tgt, dft = models
    with pytest.raises(ValueError, match="n_seq must be 1..256"):
        _native.Session(tgt, None, [1, 3], 128, 2, True, False, n_seq=257)
    with pytest.raises(ValueError, match="slots that draft need a cache per sequence"):
        _native.Session(tgt, dft, [1, 3], 128, 2, True, False, n_seq=2, kv_unified=True)
    # without a unified cache llama.cpp would regroup the rows by sequence
    with pytest.raises(ValueError, match="several sequences in one batch need a unified cache"):
        _native.Session(tgt, None, [1, 3], 128, 2, True, False, n_seq=2).decode_rows(prompt[:2], [0, 0], [0, 1])
    s = _native.Session(tgt, None, [1, 3], 128, 2, True, False, n_seq=2, kv_unified=True)
    with pytest.raises(IndexError, match="row 1: sequence 2 position 0 outside 2 sequences"):
        s.decode_rows(prompt[:2], [0, 0], [0, 2])
    with pytest.raises(IndexError, match=f"position {s.n_ctx} outside"):
        s.decode_rows(prompt[:1], [s.n_ctx], [0])
    with pytest.raises(ValueError, match="a position and a sequence each"):
        s.decode_rows(prompt[:2], [0], [0, 0])
    with pytest.raises(ValueError, match="top_k must be"):
        s.decode_rows(prompt[:1], [0], [0], 0)
    # two sequences in one batch decode as each alone: the same best tokens, features to rounding
    ids, lp = s.decode_rows(prompt[:3] + prompt[:5], [0, 1, 2, 0, 1, 2, 3, 4], [0] * 3 + [1] * 5, 4)
    both = s.features()
    assert ids.shape == (8, 4) and (np.diff(lp, axis=1) <= 0).all() and (lp < 0).all()
    s.drop_sequence(0)
    s.drop_sequence(1)
    alone, _ = s.decode_rows(prompt[:5], list(range(5)), [1] * 5, 4)
    assert alone.tolist() == ids[3:].tolist()
    np.testing.assert_allclose(s.features(), both[3:], rtol=1e-3, atol=1e-3 * np.abs(both).max())


def test_decode_rows_ranks_every_row_as_its_logits_do(models, prompt):
    """The rows of a batch are ranked by several threads (24 rows, 2 threads here): each row's top tokens and
    log-probabilities are its own logits' (ties to the lower id), whichever thread ranked it."""
    tgt, _ = models
    s = _native.Session(tgt, None, [1, 3], 256, 2, True, False, n_seq=3, kv_unified=True)
    assert s.n_threads_batch == 2
    tokens = [t for k in range(3) for t in (prompt[k:] * 8)[:8]]  # three different sequences of 8 tokens
    ids, lp = s.decode_rows(tokens, list(range(8)) * 3, [0] * 8 + [1] * 8 + [2] * 8, 5)
    assert len({tuple(ids[i]) for i in range(24)}) > 8
    assert ids.shape == (24, 5)
    for i in range(24):
        logits = s.logits(i).astype(np.float64)
        best = sorted(range(len(logits)), key=lambda t: (-logits[t], t))[:5]
        assert ids[i].tolist() == best
        ref = logits[best] - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        np.testing.assert_allclose(lp[i], ref, atol=1e-4)
