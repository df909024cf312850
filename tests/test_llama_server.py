"""`dflash-local bench --llama-server`: upstream llama-server's rows (dflash_local/peers.py, llama_server.py), against
the real binary where there is one ($DFLASH_LLAMA_SERVER, else the repository's .llama-server/bin/llama-server, built
by scripts/build-llama-server.sh), and against small stand-ins for the ways a server fails."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_local import peers
from dflash_local import Engine
from dflash_local.llama_server import Server, ServerError, free_port

BINARY = Path(os.environ.get("DFLASH_LLAMA_SERVER") or Path(__file__).parents[1] / ".llama-server/bin/llama-server")

PEER_KEYS = {"name", "type", "n_max", "p_min", "command", "upstream_defaults", "best_of_sweep", "error", "prompts",
             "tokens", "tokens_per_second", "mean_tokens_per_second", "wall_tokens_per_second",
             "speedup_vs_our_plain", "drafted", "accepted", "acceptance", "identical_to_our_plain",
             "identical_to_its_plain", "prompt_tokens_per_second", "first_token_s", "end_to_end_s"}


@pytest.fixture(scope="module")
def llama_server():
    if not (BINARY.is_file() and os.access(BINARY, os.X_OK)):
        pytest.skip(f"no llama-server at {BINARY} (set DFLASH_LLAMA_SERVER, or run scripts/build-llama-server.sh)")
    return BINARY


def run_bench(args, cwd):
    return subprocess.run([sys.executable, "-m", "dflash_local", "bench", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_bench_runs_every_configuration_of_the_real_llama_server(tiny_target, tiny_drafter, llama_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def total(values):\n"}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "Hello there"}]}) + "\n")
    out = tmp_path / "out"
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(prompts), "-n", "16", "-t", "2",
                   "--no-peer", "--out", str(out), "--llama-server", str(llama_server), "--llama-server-args",
                   "-fa off"], tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "bench.json").read_text())
    got = result["overall"]["peers"]
    assert [p["name"] for p in got] == [c["name"] for c in peers.configurations(str(tiny_drafter))]
    assert len(got) == 15
    for p in got:
        assert set(p) == PEER_KEYS, p["name"]
        assert (out / f"llama-server-{p['name'].replace(',', '+').replace(' ', '_')}.log").is_file()
        # whatever upstream does with this target and drafter, each configuration is a row: figures, or one line
        if p["error"] is not None:
            assert "\n" not in p["error"] and p["tokens_per_second"] is None
            continue
        assert p["prompts"] == 2 and 0 < p["tokens"] <= 32 and p["tokens_per_second"] > 0
        assert p["mean_tokens_per_second"] > 0 and p["wall_tokens_per_second"] > 0 and p["speedup_vs_our_plain"] > 0
        assert p["prompt_tokens_per_second"] > 0 and p["end_to_end_s"] > 0
        assert 0 <= p["identical_to_our_plain"] <= 2 and 0 <= p["identical_to_its_plain"] <= 2
        assert "--host 127.0.0.1" in p["command"] and "-np 1" in p["command"] and "-t 2" in p["command"]
        assert p["command"].endswith(" -fa off")
    plain = got[0]
    assert plain["error"] is None and plain["type"] is None and plain["drafted"] == 0 and plain["acceptance"] is None
    # the same prompt tokens, greedy, without flash attention (upstream's default is auto: on, on this CPU, which
    # rounds differently): upstream's plain decoding of this f32 model is ours
    assert plain["identical_to_our_plain"] == 2 and plain["identical_to_its_plain"] == 2
    assert [p["upstream_defaults"] for p in got[:4]] == [False, True, True, True]
    dflash = [p for p in got if p["type"] == "draft-dflash"]
    assert [(p["n_max"], p["p_min"]) for p in dflash] == peers.SWEEP
    assert f"-md {tiny_drafter}" in dflash[0]["command"] and "--spec-draft-n-max 3" in dflash[0]["command"]
    for kind in ("draft-dflash", "draft-dflash,ngram-simple"):
        ran = [p for p in got if p["type"] == kind and p["error"] is None]
        assert sum(p["best_of_sweep"] for p in got if p["type"] == kind) == (1 if ran else 0)
        # a high p_min can leave this untrained drafter with no draft at all
        assert all(0 <= p["acceptance"] <= 1 if p["drafted"] else p["acceptance"] is None for p in ran)
    md = (out / "bench.md").read_text()
    assert "| llama-server | tok/s |" in md and "| plain |" in md and "(upstream defaults)" in md
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "llama-server draft-dflash n_max=7 p_min=0.75:" in r.stderr  # progress


def test_a_bad_llama_server_flag_is_a_row_per_configuration(tiny_target, tiny_drafter, llama_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello world"}) + "\n")
    out = tmp_path / "out"
    r = run_bench(["-m", str(tiny_target), "-d", str(tiny_drafter), "--prompts", str(prompts), "-n", "8", "--no-peer",
                   "--out", str(out), "--llama-server", str(llama_server), "--llama-server-args", "--no-such-flag"],
                  tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    got = json.loads((out / "bench.json").read_text())["overall"]["peers"]
    assert len(got) == 15
    for p in got:
        assert p["error"].startswith("failed to start: exited with code 1: ") and "--no-such-flag" in p["error"]
        assert "\n" not in p["error"] and p["command"].endswith(" --no-such-flag")
    assert "| plain | failed to start: exited with code 1: " in (out / "bench.md").read_text()


def test_sampled_rows_send_the_benchs_sampling_to_llama_server(tiny_target, llama_server, tmp_path):
    """bench --temp: llama-server's rows sample with the bench's chain and each prompt's seed (peers.run_configuration
    with `sampling`): a seed gives the same tokens twice, another seed others, and without sampling its output is our
    greedy plain decoding's."""
    e = Engine(tiny_target, n_ctx=256)
    ids = e.prompt_tokens("def total(values):\n")
    base = ["-m", str(tiny_target), "-c", "256", "-np", "1", "-t", "2", "-fa", "off"]
    plain = peers.configurations("unused")[0]

    def run(sampling):
        done, _, error = peers.run_configuration(str(llama_server), base, plain, [], [ids, ids], 24,
                                                 tmp_path / "plain.log", sampling)
        assert error is None
        return [d["tokens"] for d in done]

    chain = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    same, other = run([chain | {"seed": 5}, chain | {"seed": 5}]), run([chain | {"seed": 6}, chain | {"seed": 7}])
    assert same[0] == same[1] and other[0] != same[0] and other[1] != same[0]
    assert run(None) == [e.complete(ids, max_tokens=24, draft=False).token_ids] * 2


def test_a_chat_turn_goes_to_llama_server_after_its_cache(tiny_target, llama_server, tmp_path):
    """A multi-turn row's later turn (run_configuration's reuse) is sent with cache_prompt: llama-server decodes only
    what its cache does not hold; a row's first prompt is decoded whole."""
    e = Engine(tiny_target, n_ctx=256)
    ids = e.prompt_tokens("def total(values):\n")
    answer = e.complete(ids, max_tokens=16, draft=False).token_ids
    turn = ids + answer + ids[1:]  # the history and a next message
    base = ["-m", str(tiny_target), "-c", "256", "-np", "1", "-t", "2", "-fa", "off"]
    plain = peers.configurations("unused")[0]
    for reuse in ([False, True], [False, False]):
        done, _, error = peers.run_configuration(str(llama_server), base, plain, [], [ids, turn], 16,
                                                 tmp_path / "plain.log", reuse=reuse)
        assert error is None and done[0]["prompt_n"] == len(ids) and done[0]["tokens"] == answer
        if reuse[1]:  # its cache holds the first prompt and all of its answer but the last token
            assert done[1]["prompt_n"] == len(turn) - (len(ids) + len(answer) - 1)
        else:
            assert done[1]["prompt_n"] == len(turn)
    row = peers.peer_row(plain, "cmd", done, None, [answer, done[1]["tokens"]], None, 100.0)
    assert row["first_token_s"] == (done[0]["prompt_ms"] + done[1]["prompt_ms"]) / 2000


def test_bench_refuses_bad_llama_server_options(tiny_target, tiny_drafter, tmp_path):
    base = ["-m", str(tiny_target), "-d", str(tiny_drafter), "--no-peer", "--out", str(tmp_path / "out")]
    r = run_bench(base + ["--llama-server", str(tmp_path / "nothing")], tmp_path)
    assert r.returncode == 2 and f"--llama-server {tmp_path / 'nothing'}: not an executable file" in r.stderr
    r = run_bench(base + ["--llama-server-args", "--no-repack"], tmp_path)
    assert r.returncode == 2 and "--llama-server-args goes with --llama-server PATH" in r.stderr
    r = run_bench(base + ["--llama-server", sys.executable, "--llama-server-args", "'open"], tmp_path)
    assert r.returncode == 2 and "--llama-server-args \"'open\": No closing quotation" in r.stderr


def test_upstream_draft_dflash_on_gemma3_is_a_row(gemma_target, gemma_drafter, llama_server, tmp_path):
    # upstream's draft-dflash takes the target's layer inputs from its graph, which its gemma3 graph does not give:
    # it aborts on the first request with a GGML_ASSERT
    config = peers.configurations(str(gemma_drafter))[3]
    assert config["name"] == "draft-dflash n_max=3 p_min=0"
    done, command, error = peers.run_configuration(str(llama_server), ["-m", str(gemma_target), "-c", "512", "-np",
                                                                       "1", "-t", "2"], config, [], [[2, 651, 3925]],
                                                   8, tmp_path / "dflash.log")
    assert done is None and "--spec-type draft-dflash" in command
    assert error.startswith("prompt 1 of 1: crashed (SIGABRT): ") and "GGML_ASSERT(t_layer_inp[il] != nullptr" in error
    assert error.endswith("(log: dflash.log)") and "\n" not in error
    row = peers.peer_row(config, command, done, error, [[1]], None, 100.0)
    assert row["error"] == error and row["tokens_per_second"] is None and row["identical_to_our_plain"] is None


# -- stand-ins for a llama-server, where the real one does not fail on demand ------------------------------------------

FAKE = textwrap.dedent("""
    import http.server, os, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    mode = sys.argv[sys.argv.index("--mode") + 1]
    if mode == "never-ready":
        time.sleep(60)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status":"ok"}')

        def do_POST(self):
            print("0.01.000.000 E some: failed to do something harmless", file=sys.stderr)
            print("/src/llama-graph.cpp:1384: GGML_ASSERT(x != nullptr) failed", file=sys.stderr, flush=True)
            os.abort()

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def fake_server(tmp_path, mode, start_timeout=30.0):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    port = free_port()
    return Server([sys.executable, str(script), "--port", str(port), "--mode", mode], port, tmp_path / "fake.log",
                  start_timeout)


def test_a_server_that_aborts_on_a_request_says_so_in_one_line(tmp_path):
    with fake_server(tmp_path, "abort") as s, pytest.raises(ServerError) as e:
        s.complete([1, 2, 3], 4)
    assert str(e.value) == "crashed (SIGABRT): /src/llama-graph.cpp:1384: GGML_ASSERT(x != nullptr) failed"


def test_a_server_that_is_never_ready_times_out(tmp_path):
    with pytest.raises(ServerError, match=r"^not ready within 0.5 s$"):
        with fake_server(tmp_path, "never-ready", start_timeout=0.5):
            pass


def test_a_server_that_cannot_run_says_so(tmp_path):
    with pytest.raises(ServerError, match=r"^could not run .*nothing: No such file or directory$"):
        with Server([str(tmp_path / "nothing")], free_port(), tmp_path / "x.log"):
            pass
