"""The draft-length policy: its choice from costs and acceptance, and its effect in the engine."""


from scripted import CPU, ScriptedDrafter, SteadyCosts

from dflash_local import Engine, StepStats
from dflash_local.convert.init_drafter import init_drafter
from dflash_local.engine.policy import BatchCosts, DraftPolicy


def trained(acceptance: float, verify: dict[int, float], draft: dict[int, float], n: int = 7) -> DraftPolicy:
    p = DraftPolicy(n)
    p.verify_ms, p.draft_ms = dict(verify), dict(draft)
    p.tried = [100.0] * n
    p.accepted = [100.0 * acceptance] * n
    return p


GPU = {k: 10.0 + 0.2 * k for k in range(1, 9)}  # nearly flat
DRAFT = {k: 2.0 for k in range(1, 8)}


def test_choice_follows_costs_and_acceptance():
    assert trained(0.05, CPU, DRAFT).choose() == 0  # drafts rarely right and verifying is dear: decode plainly
    assert trained(0.95, GPU, DRAFT).choose() == 7  # cheap verify, good drafts: the whole block
    assert 0 < trained(0.8, CPU, DRAFT).choose() < 7  # in between: a shorter block
    assert trained(0.05, CPU, DRAFT).expected_tokens(3) < trained(0.9, CPU, DRAFT).expected_tokens(3)


def test_sampling_cost_counts_once_per_token_made():
    p = DraftPolicy(7)
    p.update(3, 2, CPU[4], 2.0, sample_ms=6.0)  # three rows sampled for the three tokens the step made
    assert p.sample_ms == 2.0
    p = trained(0.8, CPU, DRAFT)
    assert p.choose() > 0
    # a sampler as dear as the old full sort of a big vocabulary on a slow machine: drafting saves too little
    p.sample_ms = 100.0
    assert p.choose() == 0


def test_the_lm_head_on_demand_is_paid_per_token_made():
    p = DraftPolicy(7)
    # 3 drafts, 2 accepted: 60 ms of target time, 30 of them the LM head of the 3 rows read
    p.update(3, 2, 60.0, 2.0, sample_ms=3.0, head_ms=30.0, head_rows=3)
    assert p.head_ms == 10.0 and p.verify_ms[4] == 40.0  # T holds one row's head, as a plain step's
    # rows past a rejection cost no head: drafts accepted 7 times in 10 pay where every row's head made them dear
    on_demand = {k: 7.5 + 2.5 * k + 4.0 for k in range(1, 10)}  # CPU's rows with the head (4 ms) of one
    q = trained(0.7, on_demand, DRAFT)
    q.head_ms = 4.0
    assert trained(0.7, CPU, DRAFT).choose() == 0 and q.choose() > 0
    q.head_ms = 40.0  # a head this dear makes every token made dear: plain decoding again
    assert q.choose() == 0
    # the head's first batch: the rows a step likely reads (its own token's, and each draft likelier kept than not)
    assert trained(0.3, CPU, DRAFT).likely_rows(7) == 1
    assert trained(0.9, CPU, DRAFT).likely_rows(3) == 4 and trained(0.9, CPU, DRAFT).likely_rows(7) == 7  # 0.9^7 < 0.5


def test_probes_unknown_sizes_and_after_long_plain_runs():
    p = DraftPolicy(7)
    assert p.choose() == 7  # nothing measured yet
    p = trained(0.0, {1: 10.0, 8: 60.0}, {7: 5.0})
    assert p.choose() == 0  # sizes in between are estimated from a line through the measured ones
    for _ in range(p.probe_every):
        p.update(0, 0, 10.0, 0.0)
    assert p.choose() == 1 and p.probing  # no draft was ever accepted: a probe drafts one token
    before = p.acceptance()[0]
    p.update(1, 1, 20.0, 5.0)  # a probe that was accepted raises the estimate it tested
    assert p.acceptance()[0] > before
    # and longer drafts next, twice as far while every draft is accepted, up to the full block
    for n in (2, 4, 7):
        assert p.choose() == n
        p.update(n, n, 10.0 + 3 * n, 5.0)  # cheaper per token than plain decoding
    assert p.acceptance()[6] > 0.0


def test_a_long_draft_grows_while_all_is_accepted_and_shrinks_to_what_pays():
    """An n-gram lookup drafts up to 48 tokens: verified in full after a repeat paid off, a long draft whose repeat
    has ended costs almost a plain step per token on CPUs."""
    cpu = {k: 10.0 * k for k in range(1, 50)}
    p = trained(0.95, cpu, {k: 0.01 for k in range(1, 49)}, n=48)
    p.steps_since_draft = p.interval
    first = p.choose()
    assert p.probing and 0 < first < 48
    lengths = [first]
    while lengths[-1] < 48:
        p.update(lengths[-1], lengths[-1], 7.0 * lengths[-1], 0.01)  # all accepted, and cheaper than plain
        lengths.append(p.choose())
    assert lengths == [first] + [min(first * 2 ** i, 48) for i in range(1, len(lengths))]
    p.update(48, 3, 300.0, 0.01)  # the repeat ended: 4 tokens for 30 plain steps' time
    assert p.choose() < 48


def test_probes_back_off_while_they_do_not_pay_and_return_when_one_does():
    p = trained(0.0, {1: 10.0, 8: 60.0}, {7: 5.0})
    waits = []
    for _ in range(6):
        n = 0
        while p.choose() == 0:
            p.update(0, 0, 10.0, 0.0)
            n += 1
        waits.append(n)
        p.update(7, 0, 60.0, 5.0)  # a probe that got nothing accepted
    assert waits == [16, 32, 64, 128, 256, 256]
    while p.choose() == 0:
        p.update(0, 0, 10.0, 0.0)
    p.update(7, 7, 60.0, 5.0)  # 8 tokens in 65 ms beat plain decoding's 10 ms per token
    assert p.paid_off and p.interval == p.probe_every and p.choose() == 7


def test_probes_draft_as_far_as_drafts_are_likely_to_reach():
    # draft n is reached when the n - 1 before it are accepted: 0.3 ** 2 < 0.1 <= 0.3; 0.6 ** 5 < 0.1 <= 0.6 ** 4
    for acceptance, length in ((0.0, 1), (0.3, 2), (0.6, 5)):
        p = trained(acceptance, CPU, DRAFT)
        assert p.choose() == 0
        p.steps_since_draft = p.interval
        assert p.choose() == length and p.probing
    p.update(5, 5, CPU[6], 2.0)  # a short probe, all accepted: twice as far (the full block) is worth a try
    assert p.choose() == 7
    p.update(7, 0, CPU[8], 2.0)  # that did not pay: back to plain decoding, waiting twice as long
    assert p.choose() == 0 and p.interval == 2 * p.probe_every


def test_a_new_generation_halves_the_wait_for_the_next_probe():
    p = trained(0.0, CPU, DRAFT)
    p.interval = p.max_probe_every
    p.new_text()
    assert p.interval == p.max_probe_every // 2
    for _ in range(8):
        p.new_text()
    assert p.interval == p.probe_every


def test_tiny_or_extrapolated_costs_never_divide_by_zero():
    p = DraftPolicy(3)
    p.update(3, 1, 0.0, 0.0)  # a step too fast for the clock
    p.update(1, 0, 0.0, 0.0)
    assert 0 <= p.choose() <= 3
    p = trained(0.5, {2: 1.0, 4: 5.0}, {1: 0.0, 3: 0.0}, n=3)  # the line through them is below zero at k = 1
    p.update(3, 3, 5.0, 0.0)
    assert 0 <= p.choose() <= 3


def test_in_a_shared_decode_a_row_is_priced_at_what_it_adds():
    """With other slots' rows in its decode (serve -np N), a slot's draft costs what its rows add to the batch, and
    the batch's tokens are what a step makes: drafts that pay alone may not pay there, and the other way round."""
    p = trained(0.8, CPU, DRAFT)
    alone = p.choose()
    assert 0 < alone < 7  # alone, a CPU step's fixed cost makes a few drafts worth their rows
    p.batch = BatchCosts({4: 26.0, 8: 52.0, 12: 78.0})  # a CPU past a few rows: every row as dear as a plain one
    p.beside = (3, 3.0)  # three other slots' plain rows in its last decode
    assert p.choose() == 0
    p.batch = BatchCosts({4: 10.4, 8: 10.8, 12: 11.2})  # a GPU: a batch costs little more than one row
    assert p.choose() == 7
    p.beside = (0, 0.0)  # alone again: its own costs
    assert p.choose() == alone


def test_a_step_in_a_shared_decode_is_judged_on_the_batchs_costs():
    costs = BatchCosts({4: 10.4, 8: 10.8, 12: 11.2})
    p = DraftPolicy(7, batch=costs)
    p.update(0, 0, 2.6, 0.0, beside=(3, 3.0))  # a plain step: its share of a batch is not what it costs alone
    assert p.verify_ms == {} and p.beside == (3, 3.0)
    p.update(4, 4, 5.4, 2.0, beside=(3, 3.0))  # 5 tokens for what 4 rows add to a batch: it paid off
    assert p.verify_ms == {} and p.paid_off and p.choose() == 7  # all accepted: twice as far
    p.batch = BatchCosts({4: 26.0, 8: 52.0, 12: 78.0})
    p.update(4, 2, 52 * 5 / 8, 2.0, beside=(3, 3.0))
    assert not p.paid_off and p.choose() == 0
    p.update(0, 0, 13.0, 0.0)  # alone: its own costs again
    assert p.verify_ms == {1: 13.0} and p.beside == (0, 0.0)


def test_fixed_mode_always_drafts_the_block():
    p = DraftPolicy(5, adaptive=False)
    p.update(5, 0, 100.0, 50.0)
    assert p.choose() == 5


def test_adaptive_engine_follows_its_drafter_and_stays_lossless(tmp_path, gemma_target):
    # on gemma-3-270m verifying 2 tokens costs about twice one (docs/measurements.md): a useless drafter must stop;
    # block 8, where a fully accepted block clearly pays (8 tokens for about 4.5 single-token times)
    drafter = init_drafter(tmp_path / "d8.gguf", gemma_target, n_target_layers=3, block_size=8, head_dim=64, n_ff=512)
    e = Engine(gemma_target, drafter, n_ctx=1024, draft_policy="auto")
    e._policies["drafter"] = SteadyCosts(7)
    p = "The history of the printing press"
    base = e.complete(p, max_tokens=120, draft=False)
    n_prompt = len(e.prompt_tokens(p))

    def continuation(tokens, n):
        return (base.token_ids[len(tokens) - n_prompt :] + [0] * n)[:n]

    wrong = e.complete(p, max_tokens=120, external_drafter=lambda t, n: [(x + 1) % 262144 for x in continuation(t, n)])
    assert wrong.token_ids == base.token_ids
    assert wrong.summary.n_drafted < 120  # full blocks would draft 7 per step, about 830
    assert wrong.summary.steps > 100  # mostly plain steps
    # an always-right drafter: the next probe (half the back-off away) finds out, then full blocks while they pay
    policy = e._policies["drafter"]
    wait = max(policy.probe_every, policy.interval // 2) - policy.steps_since_draft
    events = list(e.generate(p, max_tokens=120, external_drafter=continuation))
    steps = [ev for ev in events if isinstance(ev, StepStats)]
    assert events[-1].token_ids == base.token_ids
    first = next(i for i, s in enumerate(steps) if s.n_drafted)
    assert first <= max(wait, 0)
    assert all(s.n_drafted for s in steps[first:-1])  # the last may have had no room left to draft
    assert all(s.n_accepted == s.n_drafted for s in steps)
    assert sum(s.n_drafted == 7 for s in steps) >= 5


def test_ratings_cut_the_draft_where_acceptance_stops_paying():
    p = trained(0.8, CPU, DRAFT)
    assert p.choose() > 0 and not p.probing
    assert p.cut([0.95, 0.95, 0.05, 0.95, 0.95], 2.0) == 2  # the third draft is unlikely: verifying it costs more
    assert p.cut([0.95] * 5, 2.0) == 5
    assert p.cut([0.02] * 5, 2.0) == 0  # nothing worth a verify: a plain step
    assert DraftPolicy(7, adaptive=False).cut([0.02] * 5, 2.0) == 5  # fixed: the whole block
    probe = DraftPolicy(7)
    assert probe.choose() == 7 and probe.probing  # probes verify everything, so the calibration keeps learning
    assert probe.cut([0.02] * 7, 2.0) == 7


def test_ratings_are_calibrated_by_what_is_accepted():
    p = trained(0.8, CPU, DRAFT)
    assert p.calibrated(0.95) > 0.9  # nothing seen yet: the drafter's word
    for _ in range(20):  # an overconfident drafter: its 0.95s are always rejected
        p.update(3, 0, CPU[4], 2.0, ratings=[0.95, 0.95, 0.95])
    assert p.calibrated(0.95) < 0.2 and p.calibrated(0.5) == 0.5  # (the decayed counts hold about 10 steps)
    p.choose()
    assert p.cut([0.95] * 5, 2.0) == 0


def test_nan_and_infinite_ratings_count_as_no_confidence():
    """A drafter whose activations overflowed rates its drafts NaN (an f16 DFlash2 drafter, test_dflash2.py): such a
    rating is the least confident tenth, never an error."""
    broken = [float("nan"), float("inf"), float("-inf")]
    p = trained(0.8, CPU, DRAFT)
    p.choose()
    assert [p.calibrated(r) for r in broken] == [p.calibrated(0.0)] * 3
    assert p.cut(broken, 2.0) == 0 and p.cut([0.95, 0.95] + broken, 2.0) == 2
    for _ in range(3):
        p.update(3, 1, CPU[4], 2.0, ratings=broken)
    assert p.rated_tried[0] > 2.5 and sum(p.rated_tried) == p.rated_tried[0]  # all three in the lowest tenth
    assert DraftPolicy(7, adaptive=False).cut(broken, 2.0) == 3  # fixed: the whole block, verified as ever


def test_engine_cuts_rated_drafts_and_stays_lossless(tiny_target, tiny_drafter):
    """A scripted drafter that rates its planted errors low: the adaptive engine verifies up to them and no further
    (fewer rejected drafts per step than the same drafts unrated), and the output stays plain decoding's."""
    e = Engine(tiny_target, tiny_drafter, n_ctx=1024, n_threads=1, draft_policy="auto")
    rejected = {}
    for rated in (False, True):
        e._policies["drafter"] = SteadyCosts(7)
        steps = []
        for p in ["The history of the printing press", "def f(x):\n    return"]:
            base = e.complete(p, max_tokens=80, draft=False)
            drafter = ScriptedDrafter(len(e.prompt_tokens(p)), base.token_ids, e.target.n_vocab, seed=3, rated=rated)
            events = list(e.generate(p, max_tokens=80, external_drafter=drafter))
            assert events[-1].token_ids == base.token_ids
            steps += [ev for ev in events if isinstance(ev, StepStats) and ev.n_drafted]
        rejected[rated] = sum(s.n_accepted < s.n_drafted for s in steps) / len(steps)
    assert rejected[False] > 0.5 and rejected[True] < 0.25, rejected
