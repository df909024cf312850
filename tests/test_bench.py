import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from dflash_local import Engine


def run_bench(args, cwd):
    return subprocess.run([sys.executable, "-m", "dflash_local", "bench", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_bench_writes_json_markdown_and_plot(tiny_target, tiny_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello world"}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "def f(x):"}]}) + "\n")
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(prompts), "-n", "16",
                   "--out", str(tmp_path / "out"), "--reasoning", "off"], tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    o = result["overall"]
    for key in ("baseline_tokens_per_second", "dflash_tokens_per_second", "dflash_fixed_tokens_per_second",
                "speedup", "speedup_fixed", "mean_acceptance_length",
                "lossless", "verify_ms", "draft_ms_per_step", "ideal_speedup", "prompt_lookup_tokens_per_second"):
        assert key in o
    assert o["lossless"] is True and o["prompts"] == 2 and o["reasoning"] == "off"
    assert o["prompt_lookup_tokens_per_second"] > 0 and o["prompt_lookup_errors"] == 0
    assert sorted(int(k) for k in o["verify_ms"]) == list(range(1, 9))
    assert len(result["rows"]) == 2 and all(row["lossless"] for row in result["rows"])
    # prompt processing (each prompt afresh) and the end-to-end times, prompt processing included
    assert all(row["prompt_tokens"] > 0 and row["prompt_ms"] > 0 for row in result["rows"])
    assert o["prompt_tokens_per_second"] > 0
    assert o["baseline_end_to_end_s"] > sum(row["prompt_ms"] for row in result["rows"]) / 1000
    assert o["ngram_end_to_end_s"] > 0
    assert (tmp_path / "out" / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "| **overall** |" in (tmp_path / "out" / "bench.md").read_text()
    assert "[2/2]" in r.stderr  # progress


def test_a_sampled_bench_is_lossless_and_reports_rejection_sampling(tiny_target, tiny_drafter, tmp_path):
    """--temp: every row samples with llama.cpp's default chain and prompt i's seed; the DFlash rows (verifying by
    matching the target's sample) give the sampled baseline's tokens, and rejection sampling is a row of its own."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello world"}) + "\n" + json.dumps({"prompt": "def f(x):"}) + "\n")
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(prompts), "-n", "24",
                   "--temp", "0.8", "--seed", "9", "--out", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    o = result["overall"]
    assert o["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 9}
    assert o["lossless"] is True and all(row["lossless"] for row in result["rows"])
    assert o["rejection_tokens_per_second"] > 0 and o["rejection_mean_acceptance_length"] >= 1
    assert "prompt_lookup_tokens_per_second" not in o  # a greedy peer: left out of sampled runs
    # the rows sampled: prompt 0 at seed 9 gives what a sampled generation with that seed gives
    e = Engine(tiny_target, tiny_drafter, n_ctx=4096)
    want = e.complete("Hello world", max_tokens=24, draft=False, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                      seed=9)
    assert want.token_ids != e.complete("Hello world", max_tokens=24, draft=False).token_ids
    assert result["rows"][0]["tokens"] == len(want.token_ids)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "rejection sampling tok/s" in md and "Sampled: temperature 0.8, top-k 40" in md


def test_a_multi_turn_row_is_a_chat_whose_later_turns_reuse_the_cache(tiny_target, tiny_drafter, tmp_path):
    """A 'turns' row: each user turn after the conversation so far (the run's own answers), a later turn decoding only
    what the previous turn did not leave in the cache; every mode gives plain decoding's tokens, and each turn has its
    time to first token."""
    from dflash_local.bench import converse

    row = {"turns": ["Tell me a story about a fox.", "Go on.", "And then what happened?"]}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "Hello world"}) + "\n")
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(prompts), "-n", "12",
                   "--no-peer", "--out", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    o, chat = result["overall"], result["rows"][0]
    assert o["lossless"] is True and o["prompts"] == 2 and o["requests"] == 4
    assert chat["turns"] == 3 and len(chat["first_token_s"]) == len(chat["ngram_first_token_s"]) == 3
    # the same conversation, plain: its prompts hold the earlier answers, and the bench decoded fewer prompt tokens
    # than the three prompts hold (the later turns reused the cache), the first one whole
    e = Engine(tiny_target, n_ctx=4096)
    done, requests = converse(e, row, 12, True, draft=False)
    lengths = [len(e.prompt_tokens(**q)) for q in requests]
    assert requests[2]["messages"][1] == {"role": "assistant", "content": done[0].text}
    assert chat["tokens"] == sum(len(d.token_ids) for d in done)
    assert chat["context_tokens"] == lengths[2] + len(done[2].token_ids)
    assert lengths[0] + 2 <= chat["prompt_tokens"] < sum(lengths)
    assert done[1].summary.n_cached > 0 and done[2].summary.n_cached > lengths[0]
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "(3 turns)" in md and "first token s" in md and "all 4 requests" in md


def test_bench_rejects_bad_prompt_files(tiny_target, tiny_drafter, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(bad)], tmp_path)
    assert r.returncode == 2 and "exactly one of 'prompt', 'messages' or 'turns'" in r.stderr
    bad.write_text('{"turns": ["fine", ""]}\n')
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(bad)], tmp_path)
    assert r.returncode == 2 and "'turns' is a list of user messages (non-empty strings)" in r.stderr
    r = run_bench(["-m", str(tiny_target), "--prompts", str(bad)], tmp_path)
    assert r.returncode == 2 and "give a drafter" in r.stderr
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--reasoning", "on"], tmp_path)
    assert r.returncode == 2
    assert "--reasoning sets enable_thinking in the chat template: it needs chat prompts" in r.stderr


def test_reasoning_flags_become_template_variables():
    from argparse import Namespace

    from dflash_local.cli import _template_kwargs

    def kwargs(**kw):
        return _template_kwargs(Namespace(**{"reasoning": "auto", "chat_template_kwargs": None} | kw))

    assert kwargs() == {}
    assert kwargs(reasoning="off") == {"enable_thinking": False}
    assert kwargs(reasoning="on") == {"enable_thinking": True}
    assert kwargs(reasoning_budget=0) == {"enable_thinking": False}
    assert kwargs(reasoning_budget=-1) == {}
    # --chat-template-kwargs has the last word
    assert kwargs(reasoning="off", chat_template_kwargs={"enable_thinking": True, "x": 1}) == \
        {"enable_thinking": True, "x": 1}


def test_a_peer_that_crashes_is_a_row_and_the_bench_goes_on(tiny_target, tiny_drafter, monkeypatch):
    from dflash_local import bench

    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024)  # the bench sets its engine's draft policy per row

    # the peer process dies as llama.cpp's AMX matmul kills it on Intel CPUs with AMX
    monkeypatch.setattr(bench, "PEER_CHILD", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                                                                    "signal.SIGSEGV)"])
    result = bench.run_bench(engine, [{"prompt": "Hello world"}, {"prompt": "def f(x):"}], 12, log=lambda m: None)
    o = result["overall"]
    assert o["lossless"] and o["prompt_lookup_errors"] == 2 and o["prompt_lookup_tokens_per_second"] is None
    assert all(r["prompt_lookup_error"] == "crashed (SIGSEGV)" for r in result["rows"])
    md = bench.markdown(result)
    assert "| crashed (SIGSEGV) |" in md and "failed on 2 of 2 prompts (crashed (SIGSEGV))" in md


def test_a_peer_that_fails_says_why():
    from dflash_local.bench import run_peer

    fail = [sys.executable, "-c", "import sys; print('no such model', file=sys.stderr); sys.exit(3)"]
    assert run_peer(fail, {}) == (None, "failed (exit 3): no such model")
    echo = [sys.executable, "-c", "import json, sys; print(json.dumps({'got': json.load(sys.stdin)}))"]
    assert run_peer(echo, {"a": 1}) == ({"got": {"a": 1}}, None)
    assert run_peer([sys.executable, "-c", "import time; time.sleep(5)"], {}, timeout=0.5) == (
        None, "timed out after 0.5 s")



def test_sampling_speed_script_runs_on_the_tiny_target(tiny_target, tmp_path, monkeypatch):
    path = Path(__file__).parents[1] / "bench" / "sampling_speed.py"
    spec = importlib.util.spec_from_file_location("sampling_speed", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    engines = []
    monkeypatch.setattr(script, "Engine", lambda *a, **kw: engines.append(Engine(*a, **kw)) or engines[-1])
    out = tmp_path / "speed.json"
    assert script.main(["-m", str(tiny_target), "-n", "4", "--prompts", "2", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report) == list(script.SETTINGS)
    assert all(r["tokens_per_second"] > 0 and r["sampler_ms_per_row"] > 0 for r in report.values())
    # it drove the session by hand last, past the engine's prompt cache, which therefore claims none of it
    assert engines[0].cache.tokens == []


def test_the_prompt_lookup_peer_runs_from_the_repository_root(tiny_target, monkeypatch):
    from dflash_local.bench import prompt_lookup_speed

    # there `python -c` would import the source tree's dflash_local, which has no built native module
    monkeypatch.chdir(Path(__file__).parents[1])
    speed, error = prompt_lookup_speed(tiny_target, {"prompt": "Hello world"}, 8, 2, 512)
    assert error is None and speed > 0


def test_serve_chat_script_sends_from_several_clients_at_once(tiny_target, tiny_drafter, capsys):
    """bench/serve_chat.py --clients K against the real server, with and without the drafter: every request answered,
    the table's figures from the streams (tokens from the usage chunk, the first token's time)."""
    path = Path(__file__).parents[1] / "bench" / "serve_chat.py"
    spec = importlib.util.spec_from_file_location("serve_chat", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["-m", str(tiny_target), "-d", str(tiny_drafter), "-n", "5", "--max-tokens", "8",
                        "--clients", "1,3"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["dflash -np 1", "no drafter -np 1", "dflash -np 3", "no drafter -np 3"]
    for r, k in zip(rows, (1, 1, 3, 3)):
        clients, requests, tokens = (int(x) for x in r[1:4])
        first_mean, first_worst = (float(x) for x in r[7].split(","))
        assert clients == k and requests == 5 and 1 <= tokens <= 40 and 0 < first_mean <= first_worst



def test_serve_mixed_script_checks_sixteen_mixed_clients(tiny_target, tiny_drafter, capsys):
    """bench/serve_mixed.py against the real server with 2 slots, twice: 8 mixed clients (two drop their streams),
    every completed output equal to the same request sent alone, no 5xx, the slots idle again, the memory read before
    and after each round."""
    path = Path(__file__).parents[1] / "bench" / "serve_mixed.py"
    spec = importlib.util.spec_from_file_location("serve_mixed", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["-m", str(tiny_target), "-d", str(tiny_drafter), "--clients", "8", "-np", "2", "--rounds", "2"]
    assert script.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    for i, line in enumerate(lines[2:], 1):
        row = [x.strip() for x in line.split("|")[1:-1]]
        assert row[:3] == [str(i), "8", "2"] and row[4:8] == ["6", "2", "0", "6 of 6"] and row[8] == "True"
        before, after = (float(x) for x in row[9].split(","))
        assert before > 0 and after > 0
