"""Parallel slots (`serve -np N`, Engine(n_slots=N)): every slot's output is the output of the same request run alone,
whatever the other slots run beside it; each slot keeps its own prompt cache; the server runs requests side by side."""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fixtures import write_tiny_drafter, write_tiny_qwen35
from scripted import ScriptedDrafter
from test_server import ServerThread, serve_command, serve_process

from dflash_local import Engine, EngineBusyError, Finished, StepStats
from dflash_local.engine.engine import DraftRequest, StepRequest
from dflash_local.server.app import create_app

# a mix of requests: greedy drafting, plain decoding, seeded sampling, a grammar, a stop string
REQUESTS = [
    dict(prompt="def total(values):\n", max_tokens=40),
    dict(prompt="The quick brown fox", max_tokens=30, draft=False),
    dict(prompt="Once upon a time", max_tokens=36, temperature=0.9, seed=11),
    dict(prompt="A list of numbers:", max_tokens=24, grammar='root ::= ("1" | "2" | "3" | ", ")+'),
    dict(prompt="Hello world", max_tokens=32, stop=["o"]),
]


def interleave(engine: Engine, jobs: dict[int, dict]) -> dict[int, tuple[Finished, list[StepStats]]]:
    """Run each request in its slot as the server's runner does: rounds in which every generation goes on to its
    next step, their drafts are made together (Engine.draft_many), then all their steps run together
    (Engine.step_many: one target decode where the target allows)."""
    gens = {slot: engine.generation(engine.prepare(**kw), slot) for slot, kw in jobs.items()}
    steps = {slot: [] for slot in jobs}
    results = dict.fromkeys(jobs)
    out = {}

    def advance(slot):
        while True:
            try:
                ev = gens[slot].send(results[slot])
            except StopIteration:
                del gens[slot]
                return None
            results[slot] = None
            if isinstance(ev, (StepRequest, DraftRequest)):
                return ev
            if isinstance(ev, StepStats):
                steps[slot].append(ev)
            elif isinstance(ev, Finished):
                out[slot] = (ev, steps[slot])

    while gens:
        asked = [q for q in map(advance, list(gens)) if q is not None]
        drafts = [q for q in asked if isinstance(q, DraftRequest)]
        requests = [q for q in asked if isinstance(q, StepRequest)]
        for q, r in zip(drafts, engine.draft_many(drafts) if drafts else []):
            results[q.slot] = r
            requests.append(advance(q.slot))
        for q, r in zip(requests, engine.step_many(requests) if requests else []):
            results[q.slot] = r
    return out


def tiny_or_gemma(pair: str, request) -> tuple:
    """The (target, drafter) fixtures of a test parametrized over "tiny" and "gemma"."""
    names = ("tiny_target", "tiny_drafter") if pair == "tiny" else ("gemma_target", "gemma_drafter")
    return tuple(request.getfixturevalue(n) for n in names)


def alone(target, drafter, **engine_kw):
    return Engine(target, drafter, n_ctx=512, draft_policy="fixed", **engine_kw)


@pytest.fixture(scope="module")
def qwen35_pair(models_dir):
    target = write_tiny_qwen35(models_dir / "slots-qwen35.gguf")
    return target, write_tiny_drafter(models_dir / "slots-qwen35-drafter.gguf", target, target_layers=(1, 3))


@pytest.mark.parametrize("pair,engine_kw", [
    ("tiny", {}),
    ("gemma", {}),
    ("qwen35", {}),  # snapshots cover every rollback
    ("qwen35", {"n_rs_seq": 2}),  # longer rollbacks restore the slot's checkpoint and replay
], ids=["tiny", "gemma", "hybrid-snapshots", "hybrid-checkpoints"])
def test_each_slot_gives_the_output_of_its_request_run_alone(pair, engine_kw, request, tiny_target, tiny_drafter):
    if pair == "tiny":
        target, drafter = tiny_target, tiny_drafter
    elif pair == "gemma":
        target, drafter = request.getfixturevalue("gemma_target"), request.getfixturevalue("gemma_drafter")
    else:
        target, drafter = request.getfixturevalue("qwen35_pair")
    single = alone(target, drafter, **engine_kw)
    want = [single.complete(**kw) for kw in REQUESTS]
    plain = [single.complete(**kw | {"draft": False}) for kw in REQUESTS]
    assert [w.token_ids for w in want] == [p.token_ids for p in plain]  # lossless, as ever

    multi = alone(target, drafter, n_slots=3, **engine_kw)
    assert multi.session.n_slots == 3 and multi.n_ctx == single.n_ctx == 512
    # two different mixes: each request beside others, in another slot, after other content in that slot
    for order in ([0, 1, 2], [3, 4, 0], [2, 3, 1], [4, 0, 3]):
        got = interleave(multi, {slot: REQUESTS[i] for slot, i in enumerate(order)})
        for slot, i in enumerate(order):
            assert got[slot][0].token_ids == want[i].token_ids, (order, slot, i)
            assert got[slot][0].text == want[i].text

    # planted rejections in every slot at once: every acceptance length, the slot's own rollback each time
    prompts = ["def total(values):\n", "The quick brown fox", "Once upon a time"]
    bases = [single.complete(p, max_tokens=60, draft=False) for p in prompts]
    jobs = {}
    for slot, (p, base) in enumerate(zip(prompts, bases)):
        drafter_k = ScriptedDrafter(len(single.prompt_tokens(p)), base.token_ids, single.target.n_vocab, seed=slot)
        jobs[slot] = dict(prompt=p, max_tokens=60, external_drafter=drafter_k)
    got = interleave(multi, jobs)
    for slot, base in enumerate(bases):
        done, steps = got[slot]
        assert done.token_ids == base.token_ids
        assert len({s.n_accepted for s in steps if s.n_drafted}) >= 4
        kinds = {s.rollback for s in steps if s.rollback}
        if multi.session.recurrent:
            assert kinds == ({"checkpoint", "snapshot"} if engine_kw else {"snapshot"})


def test_slots_price_their_rows_at_what_they_add_to_a_shared_decode(tiny_target, tiny_drafter):
    """The adaptive policy with several slots: every batched decode is recorded whole (Engine.batch_costs, by rows),
    each slot's policy knows the other slots' rows and tokens in its last decode (policy.py), and outputs are as ever
    those of plain decoding."""
    jobs = dict(enumerate(REQUESTS[i] for i in (0, 2, 4)))  # the drafting ones
    single = Engine(tiny_target, tiny_drafter, n_ctx=512)
    want = {k: single.complete(**kw | {"draft": False}).token_ids for k, kw in jobs.items()}
    multi = Engine(tiny_target, tiny_drafter, n_ctx=512, n_slots=3)
    got = interleave(multi, jobs)
    assert {k: done.token_ids for k, (done, _) in got.items()} == want
    costs = multi.batch_costs.verify_ms
    # two or three slots' rows: at least a row each, at most a block each
    assert costs and min(costs) >= 2 and max(costs) <= 3 * (multi.max_draft + 1)
    assert all(ms > 0 for ms in costs.values())
    policies = [sl.policies["drafter"] for sl in multi.slots]
    assert all(p.batch is multi.batch_costs for p in policies)
    # the slot that ended first had others in every decode it took part in, its last one included
    first = min(got, key=lambda k: len(got[k][1]))
    rows, tokens = multi.slots[first].beside
    assert rows >= 1 and tokens >= 1 and policies[first].beside == (rows, tokens)
    single.complete(**jobs[0])  # an engine with one slot never shares a decode
    assert single.batch_costs.verify_ms == {} and single.slots[0].beside == (0, 0.0)


def rss_mib(pid: int | str = "self") -> float:
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024


BURST = ["def total(values):\n", "The quick brown fox", "Once upon a time", "A list of numbers:"]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="trim hands pages back on Linux only")


@linux_only
def test_an_idle_engine_gives_a_bursts_memory_back(gemma_target, gemma_drafter):
    """Engine.trim: a burst of four slots' full blocks grows the per-decode buffers (a megabyte of logits per row
    of gemma's 262k vocabulary, in llama.cpp's output buffers and ours, and the compute buffers as far as the
    largest graph); trimmed, the engine is back to its size after loading, plus the greedy head its first decode
    built (a cache like the weights), and generates as before."""
    e = Engine(gemma_target, gemma_drafter, n_ctx=1024, n_slots=4, draft_policy="fixed")
    jobs = {k: dict(prompt=p, max_tokens=32) for k, p in enumerate(BURST)}
    loaded = rss_mib()
    first = interleave(e, jobs)
    grown = rss_mib()
    e.trim()
    trimmed = rss_mib()
    assert grown - loaded > 40, (loaded, grown)  # what there is to give back
    kept = e.session.greedy_head_bytes / 2**20
    assert trimmed < loaded + kept + 8, (loaded, grown, trimmed, kept)
    again = interleave(e, jobs)
    assert {k: r[0].token_ids for k, r in again.items()} == {k: r[0].token_ids for k, r in first.items()}


@pytest.mark.parametrize("pair", ["tiny", "qwen35"])
def test_a_trimmed_engine_goes_on_from_its_caches(pair, request, tiny_target, tiny_drafter):
    """Trim between generations leaves every slot's caches (KV, recurrent checkpoints, deferred features) as they
    were: requests that reuse them give plain decoding's output, on the hybrid target too."""
    target, drafter = (tiny_target, tiny_drafter) if pair == "tiny" else request.getfixturevalue("qwen35_pair")
    e = Engine(target, drafter, n_ctx=512, n_slots=2)
    want = [e.complete(**kw | {"draft": False}).token_ids for kw in REQUESTS[:2]]
    for _ in range(2):
        got = interleave(e, dict(enumerate(REQUESTS[:2])))
        e.trim()
        assert [got[k][0].token_ids for k in range(2)] == want
    longer = REQUESTS[0] | {"prompt": REQUESTS[0]["prompt"] + e.detokenize(want[0][:5])}  # extends a cached prompt
    got = e.complete(**longer)
    assert got.summary.n_cached > 0
    assert got.token_ids == Engine(target, drafter, n_ctx=512).complete(**longer | {"draft": False}).token_ids


@linux_only
def test_the_server_gives_a_bursts_memory_back_when_idle(gemma_target, gemma_drafter):
    """`serve -np 4`: its worker trims the engine when the last generation ends and nobody waits, so the server's
    memory after each burst of four requests is what it was idle (measured after four one-token requests)."""
    want = [alone(gemma_target, gemma_drafter).complete(p, max_tokens=32).text for p in BURST]
    with serve_process("-m", gemma_target, "-d", gemma_drafter, "-np", "4", "-c", "1024", "--draft-policy",
                       "fixed") as (url, proc):
        def ask(prompt, max_tokens=32):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        def settled(limit):
            end = time.time() + 30
            while (mib := rss_mib(proc.pid)) > limit and time.time() < end:  # trimmed right after the last one ends
                time.sleep(0.1)
            return mib

        with ThreadPoolExecutor(4) as pool:
            # the server's own allocations for four requests at once (connections, threads), with one-row batches
            list(pool.map(lambda p: ask(p, 1), BURST))
            idle = settled(0)
            for _ in range(2):
                assert list(pool.map(ask, BURST)) == want
                assert settled(idle + 8) < idle + 8, idle


def test_a_slot_keeps_its_own_prompt_cache(tiny_target, tiny_drafter):
    e = alone(tiny_target, tiny_drafter, n_slots=2)
    interleave(e, {0: dict(prompt="The quick brown fox", max_tokens=12),
                   1: dict(prompt="def total(values):\n", max_tokens=12)})
    # the next turn of each conversation finds its own tokens in its own slot
    for slot, p in ((1, "def total(values):\n"), (0, "The quick brown fox")):
        turn = p + " and then"
        done = next(ev for ev in e.run(e.prepare(turn, max_tokens=8), slot) if isinstance(ev, Finished))
        n_prompt = len(e.prompt_tokens(p))
        assert done.summary.n_cached >= n_prompt - 1  # (the other slot's prompt shares no token with this one)
        assert done.token_ids == alone(tiny_target, tiny_drafter).complete(turn, max_tokens=8).token_ids
    assert e.session.past(0) > 0 and e.session.past(1) > 0
    # cutting one slot's caches back leaves the other's alone
    n1 = e.session.past(1)
    e.slots[0].cache.truncate(e.session, 0)
    assert e.session.past(0) == 0 and e.session.past(1) == n1


def test_a_long_prompt_is_decoded_a_batch_per_turn(tiny_target, tiny_drafter):
    """A prompt longer than a batch yields Prefilled after each batch but the last, and the other slots step in
    between; both outputs are those of their requests run alone, and the prompt's time is its batches' only."""
    from dflash_local import Prefilled
    from dflash_local.engine.placement import Placement

    e = Engine(tiny_target, tiny_drafter, n_ctx=512, n_slots=2, placement=Placement(n_batch=16, n_ubatch=16))
    single = Engine(tiny_target, tiny_drafter, n_ctx=512, placement=Placement(n_batch=16, n_ubatch=16))
    long = "A long prompt: " + " ".join(f"word{i}" for i in range(40))
    n_prompt = len(e.prompt_tokens(long))
    assert n_prompt > 64
    gens = {0: e.run(e.prepare("Hello world", max_tokens=40), 0), 1: e.run(e.prepare(long, max_tokens=8), 1)}
    order, done = [], {}
    while gens:
        for slot in list(gens):
            try:
                ev = next(gens[slot])
            except StopIteration:
                del gens[slot]
                continue
            order.append((slot, type(ev).__name__))
            if isinstance(ev, Prefilled):
                assert ev.n_total == n_prompt and ev.n_done % 16 == 0
            if isinstance(ev, Finished):
                done[slot] = ev
    progress = [i for i, (slot, kind) in enumerate(order) if kind == "Prefilled"]
    assert len(progress) == (n_prompt - 1) // 16
    assert any(order[i][0] == 0 and order[i][1] == "StepStats" for i in range(progress[0], progress[-1]))
    assert done[0].token_ids == single.complete("Hello world", max_tokens=40).token_ids
    assert done[1].token_ids == single.complete(long, max_tokens=8).token_ids
    assert done[1].summary.prompt_ms > 0


def test_slot_arguments_are_checked(tiny_target, tiny_drafter):
    e = alone(tiny_target, tiny_drafter, n_slots=2)
    gen = e.run(e.prepare("Hello", max_tokens=40), 1)
    next(gen)
    with pytest.raises(EngineBusyError, match="slot 1"):
        next(e.run(e.prepare("Hi", max_tokens=4), 1))
    assert isinstance(next(e.run(e.prepare("Hi", max_tokens=4), 0)), object)  # another slot is free
    gen.close()
    with pytest.raises(ValueError, match="no slot 2"):
        next(e.run(e.prepare("Hi", max_tokens=4), 2))
    with pytest.raises(IndexError, match="no slot 5"):
        e.session.past(5)
    with pytest.raises(ValueError, match="n_slots must be an integer in 1..256"):
        Engine(tiny_target, tiny_drafter, n_slots=0)
    with pytest.raises(ValueError, match="torch drafter keeps one context"):
        Engine(tiny_target, tiny_drafter, n_slots=2, draft_backend="torch")


def test_server_answers_a_request_while_another_generates(tiny_target, tiny_drafter):
    """With -np 2 a short request that arrives while a long one streams is answered while the long one is still
    generating (with one slot it would wait for its end); /slots shows both, /metrics counts per slot."""
    engine = Engine(tiny_target, tiny_drafter, n_ctx=2048, n_slots=2)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        assert httpx.get(s.url + "/props").json()["total_slots"] == 2
        assert [r["id"] for r in httpx.get(s.url + "/slots").json()] == [0, 1]
        started, first = threading.Event(), []

        def long():
            body = {"prompt": "Once", "max_tokens": 2000, "temperature": 0, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    first.append(line)

        t = threading.Thread(target=long)
        t.start()
        assert started.wait(60)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        second = c.completions.create(model="tiny", prompt="Hello world", max_tokens=10, temperature=0)
        slots = httpx.get(s.url + "/slots").json()
        t.join(120)
        assert slots[0]["is_processing"] and slots[0]["next_token"][0]["n_decoded"] < 1500  # still generating
        assert not slots[1]["is_processing"] and slots[1]["next_token"][0]["n_decoded"] == 10
        single = Engine(tiny_target, tiny_drafter, n_ctx=2048)
        assert second.choices[0].text == single.complete("Hello world", max_tokens=10).text
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in first if x.startswith("data: {"))
        assert text == single.complete("Once", max_tokens=2000).text
        metrics = httpx.get(s.url + "/metrics").text
        assert 'dflash_slot_requests_total{slot="0"} 1' in metrics
        assert 'dflash_slot_requests_total{slot="1"} 1' in metrics
        assert 'dflash_slot_generated_tokens_total{slot="1"} 10' in metrics
        assert "dflash_slots_processing 0" in metrics and "dflash_requests_waiting 0" in metrics
    finally:
        s.stop()


def test_sixteen_mixed_clients_on_four_slots(tiny_target, tiny_drafter):
    """16 clients at once on 4 slots: mixed lengths, stop strings, JSON-schema requests, streams and streams the
    client drops. Every completed output is that of the request run alone, no 5xx, and all slots end idle."""
    engine = alone(tiny_target, tiny_drafter, n_slots=4)
    reference = alone(tiny_target, tiny_drafter)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = []
    for i in range(16):
        body = {"prompt": f"Request {i}: the story of", "max_tokens": 8 + 7 * (i % 5), "temperature": 0}
        if i % 4 == 1:
            body["stop"] = ["e"]
        if i % 4 == 2:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        if i % 3 == 0:
            body["stream"] = True
        bodies.append(body)
    batches, drafted = [], []  # the number of slots' steps (drafts) in each call the runner made
    step_many, draft_many = engine.step_many, engine.draft_many
    engine.step_many = lambda requests: batches.append(len(requests)) or step_many(requests)
    engine.draft_many = lambda requests: drafted.append(len(requests)) or draft_many(requests)
    s = ServerThread(create_app(lambda: engine, "tiny", max_queue=32))
    try:
        s.wait_healthy()

        def one(i):
            body = bodies[i]
            if not body.get("stream"):
                r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                text = ""
                for line in r.iter_lines():
                    if i % 2 == 1:  # a client that goes away after its first chunk
                        return r.status_code, None
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += chunk["choices"][0]["text"] if chunk["choices"] else ""
                return r.status_code, text

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        for i, (status, text) in enumerate(results):
            assert status == 200, (i, text)
            if text is None:
                continue
            kw = {k: v for k, v in bodies[i].items() if k in ("prompt", "max_tokens", "stop")}
            if "response_format" in bodies[i]:
                kw["json_schema"] = schema
            assert text == reference.complete(**kw).text, i
        end = time.time() + 30
        while any(r["is_processing"] for r in httpx.get(s.url + "/slots").json()):
            assert time.time() < end
            time.sleep(0.05)
        assert max(batches) == 4 and 1 <= min(batches)  # four slots' steps verified in one decode
        assert max(drafted) == 4  # and drafted together
    finally:
        s.stop()


def test_serve_np_splits_the_context_and_checks_its_value(tiny_target):
    import subprocess
    import sys

    from dflash_local.llama_server import free_port

    r = subprocess.run([sys.executable, "-m", "dflash_local", "serve", "-m", str(tiny_target), "-np", "0", "--port",
                        str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give a number of slots, 1 to 256" in r.stderr and "Traceback" not in r.stderr
    with serve_command("-m", tiny_target, "-np", "2", "-c", "1024") as url:
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512
        assert [(r["id"], r["n_ctx"]) for r in httpx.get(url + "/slots").json()] == [(0, 512), (1, 512)]
    with serve_command("-m", tiny_target) as url:  # llama-server's default: 4 slots; 4096 tokens each without -c
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 2048  # its trained


@pytest.mark.parametrize("pair", ["tiny", "gemma"])
def test_a_batched_step_of_several_slots_is_each_slots_own_step(pair, request):
    """Session.step_batch verifies every slot's block in one target decode (the server's runner, through
    Engine.step_many): each
    slot's tokens, acceptance and rollback are those of its own step, for blocks of equal and of mixed lengths, with
    planted errors at every offset, and the generation is plain decoding's."""
    from dflash_local import _native

    target, drafter = tiny_or_gemma(pair, request)
    single = alone(target, drafter)
    prompts = ["def total(values):\n", "The quick brown fox", "Once upon a time", "Hello world"]
    want = [single.complete(p, max_tokens=48, draft=False).token_ids for p in prompts]
    runs = {}
    for batched in (True, False):
        e = alone(target, drafter, n_slots=4)
        s = e.session
        samplers = [_native.Sampler(e.target, _native.Sampling()) for _ in prompts]
        toks = [[s.prefill(e.prompt_tokens(p), samplers[k], 0, k)] for k, p in enumerate(prompts)]
        steps, n = [], 0
        while min(len(t) for t in toks) < 48:
            reqs = []
            for k in range(4):
                j = len(toks[k])  # the plain continuation, with an error at a position that cycles through 0..L
                length = 4 if n % 2 else (n + k) % 5
                draft = list(want[k][j:j + length]) + [0] * max(0, j + length - len(want[k]))
                if (n + k) % (length + 1) < length:
                    draft[(n + k) % (length + 1)] = (draft[(n + k) % (length + 1)] + 1) % e.target.n_vocab
                reqs.append((k, toks[k][-1], draft, samplers[k], j, False, 2))
            res = s.step_batch(reqs) if batched else [s.step(last, d, sm, i, rj, hr, k)
                                                      for k, last, d, sm, i, rj, hr in reqs]
            for k, r in enumerate(res):
                toks[k].extend(r.tokens)
                steps.append((k, r.n_accepted, r.tokens, r.rollback))
            n += 1
        runs[batched] = steps
        assert [t[:48] for t in toks] == [w[:48] for w in want]
    assert runs[True] == runs[False]
    assert {a for _, a, _, _ in runs[True]} == set(range(5))
    with pytest.raises(ValueError, match="slot 1 has two steps"):
        s.step_batch([(1, toks[1][-1], [], samplers[1], 60, False, 1)] * 2)


def test_a_recurrent_target_steps_one_slot_at_a_time(qwen35_pair):
    """step() is step_batch() with one slot, on a recurrent target too (its checkpoints are per decode); two slots in
    one batch are refused before anything is decoded."""
    from dflash_local import _native

    e = Engine(*qwen35_pair, n_ctx=256, n_slots=2)
    s = e.session
    sm = [_native.Sampler(e.target, _native.Sampling()) for _ in range(2)]
    first = [s.prefill([1, 2, 3], sm[k], 0, k) for k in range(2)]
    with pytest.raises(RuntimeError, match="one slot at a time"):
        s.step_batch([(k, first[k], [], sm[k], 1, False, 1) for k in range(2)])
    assert [s.past(k) for k in range(2)] == [3, 3]
    one = s.step_batch([(0, first[0], [5, 6, 7], sm[0], 1, False, 1)])[0]
    two = s.step(first[1], [5, 6, 7], sm[1], 1, False, 1, 1)
    assert one.tokens == two.tokens and one.n_accepted == two.n_accepted
    assert s.past(0) == s.past(1) == 3 + one.n_accepted + 1


@pytest.mark.parametrize("pair", ["tiny", "gemma"])
def test_an_interrupted_batched_step_leaves_every_slot_as_it_was(pair, request):
    """Session.interrupt(): the batched step's decode stops (llama.cpp's abort callback), step_batch raises
    Interrupted with every slot's caches where they were, and the same steps then give what a batch never
    interrupted gives, up to plain decoding's output; a withdrawn request interrupts nothing."""
    from dflash_local import _native
    from dflash_local.engine.engine import Interrupted

    target, drafter = tiny_or_gemma(pair, request)
    single = alone(target, drafter)
    prompts = ["def total(values):\n", "The quick brown fox", "Once upon a time"]
    want = [single.complete(p, max_tokens=24, draft=False).token_ids for p in prompts]
    runs = {}
    for interrupted in (True, False):
        e = alone(target, drafter, n_slots=3)
        s = e.session
        samplers = [_native.Sampler(e.target, _native.Sampling()) for _ in prompts]
        toks = [[s.prefill(e.prompt_tokens(p), samplers[k], 0, k)] for k, p in enumerate(prompts)]
        steps = []
        for n in range(6):
            reqs = []
            for k in range(3):
                j = len(toks[k])  # the plain continuation with an error planted after n % 4 tokens
                draft = list(want[k][j:j + 4]) + [0] * max(0, j + 4 - len(want[k]))
                draft[n % 4] = (draft[n % 4] + 1) % e.target.n_vocab
                reqs.append((k, toks[k][-1], draft, samplers[k], j, False, 2))
            if interrupted:
                past = [s.past(k) for k in range(3)]
                s.interrupt()
                with pytest.raises(Interrupted):
                    s.step_batch(reqs)
                assert [s.past(k) for k in range(3)] == past
                s.interrupt()
                s.interrupt(False)
            for k, r in enumerate(s.step_batch(reqs)):
                toks[k].extend(r.tokens)
                steps.append((k, r.n_accepted, r.tokens, r.rollback))
        runs[interrupted] = steps
        assert [t for t in toks] == [w[: len(t)] for w, t in zip(want, toks)]
    assert runs[True] == runs[False]


def test_the_server_runs_an_interrupted_round_again(tiny_target, tiny_drafter):
    """The runner's rounds interrupted (as a new request's arrival does, here on every other batched round): every
    output is still that of its request run alone."""
    from dflash_local.engine.engine import Interrupted

    engine = alone(tiny_target, tiny_drafter, n_slots=3)
    reference = alone(tiny_target, tiny_drafter)
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0} for p in ("def total(values):\n", "Once upon a",
                                                                          "Hello world")]
    rounds, interrupted = [], []
    step_many = engine.step_many

    def interrupting(requests):
        rounds.append(len(requests))
        if len(requests) > 1 and len(rounds) % 2:
            engine.interrupt()
        try:
            return step_many(requests)
        except Interrupted:
            interrupted.append(len(requests))
            raise

    engine.step_many = interrupting
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda b: httpx.post(s.url + "/v1/completions", json=b, timeout=120).json()
                                  ["choices"][0]["text"], bodies))
        for body, text in zip(bodies, texts):
            assert text == reference.complete(body["prompt"], max_tokens=40).text
        assert len(interrupted) >= 3
        assert f"dflash_interrupted_rounds_total {len(interrupted)}" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


@pytest.mark.parametrize("pair", ["tiny", "gemma"])
def test_drafts_of_several_slots_in_one_drafter_decode_are_each_slots_own(pair, request):
    """Session.draft_batch: the slots that draft as many tokens share one drafter decode, each slot's deferred
    features injected first, and each slot's draft is the one draft() gives it alone, for drafts of one length and of
    mixed lengths (some slots not drafting)."""
    from dflash_local import _native

    target, drafter = tiny_or_gemma(pair, request)
    prompts = ["def total(values):\n", "The quick brown fox", "Once upon a time", "Hello world"]
    engines = [alone(target, drafter, n_slots=4) for _ in range(2)]
    lasts = []
    for e in engines:
        s = e.session
        lasts, waiting = [], []
        for k, p in enumerate(prompts):
            sampler = _native.Sampler(e.target, _native.Sampling())
            ids = e.prompt_tokens(p)
            last = s.prefill(ids, sampler, 0, k)
            for i in range(k + 1):  # plain steps: their features wait in the slot, to go in before its next draft
                last = s.step(last, [], sampler, i + 1, False, 1, k).tokens[-1]
            lasts.append(last)
            waiting.append(len(ids) + k + 1)
        assert [s.pending(k) for k in range(4)] == waiting  # the prompt's positions and each step's
    batched, single = engines[0].session, engines[1].session
    max_draft = engines[0].max_draft
    for lengths in ([3, 3, 3, 3], [1, max_draft, 0, max_draft], [2, 5, 2, 5]):
        got = batched.draft_batch([(k, lasts[k], n) for k, n in enumerate(lengths)])
        want = [single.draft(lasts[k], n, slot=k).tokens for k, n in enumerate(lengths)]
        assert [d.tokens for d in got] == want
        assert [len(d.tokens) for d in got] == [min(n, max_draft) for n in lengths]  # at most a block
    with pytest.raises(ValueError, match="slot 1 has two drafts"):
        batched.draft_batch([(1, lasts[1], 2)] * 2)


def test_a_closed_runner_ends_its_generations_and_takes_no_more(tiny_target, tiny_drafter):
    """Runner.close (the server's shutdown, the interpreter's exit): the generations in flight end after the round in
    flight, their callers get the end of their events, the worker stops, and a new request is refused; the engine's
    slots are free again."""
    import asyncio

    from dflash_local.server.runner import ClosedError, Runner

    engine = alone(tiny_target, tiny_drafter, n_slots=2)

    async def run():
        runner = Runner(engine)
        jobs = [runner.submit(engine.prepare(p, max_tokens=400)) for p in ("Once upon a", "Hello world")]
        for job in jobs:
            assert await job.next(60) is not None  # both are running
        runner.close()
        assert not runner._worker.is_alive()
        for job in jobs:
            events = []
            while (ev := await job.next(10)) is not None:
                events.append(ev)
            assert not any(isinstance(ev, Finished) for ev in events)  # cut short, not run to their end
        with pytest.raises(ClosedError):
            runner.submit(engine.prepare("Hello", max_tokens=4))

    asyncio.run(run())
    assert engine.complete("Hello world", max_tokens=8).text == alone(tiny_target, tiny_drafter).complete(
        "Hello world", max_tokens=8).text


def test_a_script_that_exits_while_its_runner_generates_exits_cleanly(tiny_target, tiny_drafter):
    """The interpreter's exit stops the runner first: a worker thread still inside llama.cpp when Python finalizes
    would abort the process ("terminate called without an active exception")."""
    import subprocess

    script = f"""
import asyncio
from dflash_local import Engine
from dflash_local.server.runner import Runner

engine = Engine({str(tiny_target)!r}, {str(tiny_drafter)!r}, n_ctx=4096)

async def main():
    job = Runner(engine).submit(engine.prepare("Once upon a", max_tokens=4000))
    await job.next(60)  # it runs; the script ends here

asyncio.run(main())
print("done")
"""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "done" and "terminate" not in r.stderr


def test_ctrl_c_ends_the_streams_in_flight_and_the_server(gemma_target, gemma_drafter):
    """SIGINT (or SIGTERM) while requests stream: each generation ends at its next step, its stream with `[DONE]`,
    and the server exits at once and cleanly, rather than after every generation's end (uvicorn's graceful
    shutdown) or with a worker thread still in llama.cpp."""
    import signal

    # gemma: its streams of 4000 tokens would take a minute
    with serve_process("-m", gemma_target, "-d", gemma_drafter, "-np", "2", "-c", "8192") as (url, proc):
        started = [threading.Event(), threading.Event()]
        ends, errors = [], []

        def stream(i):
            body = {"prompt": ["Once upon a", "Hello world"][i], "max_tokens": 4000, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    lines = []
                    for line in r.iter_lines():
                        started[i].set()
                        lines.append(line)
                    ends.append([x for x in lines if x][-2:])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        exit_s = time.time() - t0
        for t in threads:
            t.join(20)
        stderr = proc.stderr.read()
    assert exit_s < 5, exit_s
    assert not errors and [end[1] for end in ends] == ["data: [DONE]"] * 2
    assert all(json.loads(end[0][6:])["choices"][0]["finish_reason"] is None for end in ends)  # cut, not finished
    assert "Traceback" not in stderr and "terminate" not in stderr, stderr[-2000:]


def test_a_prompt_decoded_in_slices_is_the_same_as_in_one_batch(tiny_target, tiny_drafter):
    """Engine.prefill_chunk (what the server's runner lowers while other slots stream) cuts a prompt that fits one
    batch into slices of that many tokens; the output is the prompt's output in one batch."""
    from dflash_local import Prefilled

    e = Engine(tiny_target, tiny_drafter, n_ctx=1024)
    long = "A long prompt: " + " ".join(f"word{i}" for i in range(60))
    n_prompt = len(e.prompt_tokens(long))
    assert 48 < n_prompt < e.session.n_batch
    whole = e.complete(long, max_tokens=24, cache_prompt=False)
    e.prefill_chunk = 16
    events = list(e.generate(long, max_tokens=24, cache_prompt=False))
    assert [ev.n_done for ev in events if isinstance(ev, Prefilled)] == list(range(16, n_prompt, 16))
    assert events[-1].token_ids == whole.token_ids


def test_a_long_prompt_beside_a_stream_goes_a_slice_per_round(tiny_target, tiny_drafter):
    """While another slot streams, the runner decodes a prompt that fits one batch a slice per round (the stream
    steps in between: /slots shows the prompt's progress), without giving up the stream's round in flight for it (a
    prompt longer than a slice waits for the next round); on an idle runner it goes in one batch. Both outputs are
    their requests' run alone."""
    import asyncio

    from dflash_local.server.runner import Runner

    e = Engine(tiny_target, tiny_drafter, n_ctx=2048, n_slots=2)
    single = Engine(tiny_target, tiny_drafter, n_ctx=2048)
    long = "A long prompt: " + " ".join(f"word{i}" for i in range(90))
    n_prompt = len(e.prompt_tokens(long))
    assert n_prompt < e.session.n_batch

    async def run(streaming: bool):
        runner = Runner(e)
        events, progress = [], set()

        async def drain(job):
            while (ev := await job.next()) is not None:
                events.append(ev)

        if streaming:
            stream = asyncio.create_task(drain(runner.submit(e.prepare("Hello world", max_tokens=300))))
            while not events:
                await asyncio.sleep(0.01)
        job = runner.submit(e.prepare(long, max_tokens=8, cache_prompt=False))
        while job.slot is None:
            await asyncio.sleep(0)
        long_events = []
        while not long_events:
            progress.add(runner.slots[job.slot].n_prompt_done)
            try:
                ev = await asyncio.wait_for(job.next(), 0.0005)
            except TimeoutError:
                continue
            long_events.append(ev)
        while (ev := await job.next()) is not None:
            long_events.append(ev)
        if streaming:
            await stream
        runner.close()
        return events, long_events, progress - {0, n_prompt}, runner.interrupted

    stream_events, beside, progress, interrupted = asyncio.run(run(True))
    assert progress  # the prompt was seen part-way, a slice per round
    assert interrupted == 0
    _, alone, _, _ = asyncio.run(run(False))
    assert beside[-1].token_ids == alone[-1].token_ids == single.complete(long, max_tokens=8).token_ids
    assert stream_events[-1].token_ids == single.complete("Hello world", max_tokens=300).token_ids


def test_slices_beside_streams_take_about_their_step(tiny_target):
    """The runner sizes the next prompt slice by the last one's time against the streams' usual step (their median):
    as many tokens as that step would take at the last slice's rate, at most twice or half the last slice, never under
    MIN_SLICE; before any stream has stepped, MIN_SLICE."""
    from dflash_local.server.runner import MIN_SLICE, Runner

    runner = Runner(Engine(tiny_target, n_ctx=256, n_slots=2))
    assert runner._prompt_slice() == MIN_SLICE
    runner._resize_slice(MIN_SLICE, 5.0)  # no step timed yet: nothing to size it by
    assert runner._prompt_slice() == MIN_SLICE
    runner._step_ms.extend([30.0, 30.0, 500.0])  # one long step (a long draft verified) does not move the median
    runner._resize_slice(40, 40.0)  # 1 ms a token: the 30 ms step is 30 tokens
    assert runner._prompt_slice() == 30
    runner._resize_slice(30, 5.0)  # cheap tokens (a short context): at most twice the last slice
    assert runner._prompt_slice() == 60
    runner._resize_slice(60, 600.0)  # dear ones (a long context, or the drafter fed a batch): at most half
    assert runner._prompt_slice() == 30
    runner._resize_slice(30, 60.0)
    assert runner._prompt_slice() == MIN_SLICE  # 15 tokens would take the step: MIN_SLICE is the floor
    runner.close()
