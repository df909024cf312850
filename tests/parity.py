"""llama.cpp's drafter graph against the torch drafter (the reference) on the same target features, shared by the
parity tests of every drafter variant (test_dflash2.py, test_dspark.py)."""

import numpy as np

from dflash_local import _native


def drafts_side_by_side(target, drafter_gguf, torch_source, prompts, *, layer_ids, n_draft, steps=6, n_threads=1,
                        with_probs=False):
    """Draft with the native session and with the torch drafter from the same target features, step after step, the
    target accepting greedily; yield (native draft, native session, torch drafter, last token) before each step, so
    the caller reads the session's draft_logits() / draft_lattice() of that draft."""
    from dflash_local.engine.torch_drafter import TorchDraftBackend

    tm, dm = _native.Model(str(target)), _native.Model(str(drafter_gguf))
    session = _native.Session(tm, dm, [i + 1 for i in layer_ids], 512, n_threads, True, False)
    session.keep_draft_logits(True)
    greedy = _native.Sampling()
    ref = TorchDraftBackend.load(torch_source, target)
    for prompt in prompts:
        session.truncate(0)
        ref.crop(0)
        last = session.prefill(tm.tokenize(prompt, True, False), greedy, 0)
        ref.add(session.features(), 0)
        for k in range(steps):
            d = session.draft(last, n_draft, with_probs)
            yield d, session, ref, last
            r = session.step(last, d.tokens, greedy, 1 + k)
            ref.add(session.features()[: r.n_accepted + 1], ref.n)
            last = r.tokens[-1]


def top1_agreement(logits, want):
    """(hit, clear) per row: whether the top-1 tokens agree, and whether the row has a clear winner (want's top-2 gap
    over 3x the row's RMS error). Asserts that every disagreement is a near-tie (a row without a clear winner), the
    only place where a quantized matmul's rounding may decide."""
    top2 = np.sort(want, axis=1)[:, -2:]
    rms = np.sqrt(np.mean((logits - want) ** 2, axis=1))
    clear = top2[:, 1] - top2[:, 0] > 3 * rms
    hit = logits.argmax(1) == want.argmax(1)
    assert np.all(hit | ~clear)
    return hit, clear
