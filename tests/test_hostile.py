"""Hostile and careless clients against a real `dflash-local serve` process (the tiny pair, with an API key): no
request takes the server down, stalls the others, or is silently half-honoured; every error is OpenAI-shaped JSON
naming its field."""

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import serve_process

from dflash_local import Engine
from fixtures import write_tiny_target
from dflash_local.engine.grammar import MAX_NESTING, MAX_REPETITION
from dflash_local.engine.grammar_guard import GrammarGuard
from dflash_local.llama_server import free_port

KEY = "sk-hostile"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(tiny_target, tiny_drafter):
    with serve_process("-m", tiny_target, "-d", tiny_drafter, "-c", 1024, "-np", 2, "--api-key", KEY,
                       "--cors-origin", "http://allowed.example") as (url, proc):
        yield url, proc


@pytest.fixture()
def url(srv):
    url, proc = srv
    yield url
    # after every case: the process alive and a normal request served within a second
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}, headers=H,
                   timeout=10)
    assert r.status_code == 200 and time.perf_counter() - t0 < 1.0, r.text


def post(url, path, body, headers=H, **kw):
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kw)


def error_of(r, status=400):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def rss_mb(proc) -> float:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# -- 1. grammars and schemas that crashed llama.cpp's parser ----------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"json_schema": {"type": "string", "maxLength": 20000}}, "json_schema"),
    ({"json_schema": {"type": "string", "maxLength": 100000}}, "json_schema"),
    ({"json_schema": {"type": "array", "minItems": 5000}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "maxLength": 20000}}}},
     "response_format"),
    ({"grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "grammar"),
    ({"grammar": "root ::= " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1)}, "grammar"),
])
def test_deep_grammars_and_schemas_are_400s_naming_the_limit(url, body, param):
    err = error_of(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2} | body))
    assert err["param"] == param and "limit" in err["message"]


def test_grammars_at_the_limits_still_work(url):
    # a string of up to MAX_REPETITION characters, and a grammar nested as deep as allowed
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "json_schema": {
        "type": "string", "maxLength": MAX_REPETITION}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith('"')
    deep = "root ::= " + "(" * MAX_NESTING + '"a"' + ")" * MAX_NESTING
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "grammar": deep})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a", r.text


def test_the_guard_survives_a_grammar_that_crashes_the_parser(tiny_target):
    # past the static limits (here skipped), the child process takes the crash and the caller gets an error
    guard = GrammarGuard(tiny_target)
    try:
        with pytest.raises(ValueError, match="crashed"):
            guard.check("root ::= " + "(" * 200000 + '"a"' + ")" * 200000)
        guard.check('root ::= "a"')  # a fresh child answers the next one
        with pytest.raises(ValueError, match="crashed"):  # remembered: not tried again
            guard.check("root ::= " + "(" * 200000 + '"a"' + ")" * 200000)
    finally:
        guard.close()


# -- 2. huge requests: refused before tokenizing, off the event loop --------------------------------------------------

def test_huge_requests_never_stall_health(srv, url):
    _, proc = srv
    rss0 = rss_mb(proc)
    small = json.dumps({"role": "user", "content": "hi"})
    bodies = [
        ('{"messages": [' + ",".join([small] * 20000) + "]}", 400, "messages"),  # 700 KB
        ('{"messages": [' + ",".join([small] * 200000) + "]}", 413, None),  # 7 MB
        (json.dumps({"prompt": "word " * 200000}), 400, "prompt"),  # 1 MB of text: more bytes than the context holds
        (json.dumps({"messages": [{"role": "user", "content": "word " * 200000}]}), 400, "messages"),
    ]
    worst = 0.0
    for raw, status, param in bodies:
        done = threading.Event()
        result = {}

        def send():
            result["r"] = httpx.post(url + "/v1/chat/completions" if "messages" in raw[:20] else
                                     url + "/v1/completions", content=raw, headers=H | {"content-type":
                                                                                       "application/json"},
                                     timeout=120)
            done.set()

        threading.Thread(target=send).start()
        while not done.is_set():
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.02)
        err = error_of(result["r"], status)
        assert err["param"] == param
        if param:
            assert err["code"] == "context_length_exceeded"
    assert worst < 0.5, f"/health took {worst:.2f} s while a huge request was refused"
    assert rss_mb(proc) - rss0 < 100


# -- 3. invalid Unicode ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2},
     "messages.0.content"),
    ("/v1/completions", {"prompt": "a\udfffb", "max_tokens": 2}, "prompt"),
    ("/tokenize", {"content": "\ud800"}, "content"),
    ("/apply-template", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "grammar": 'root ::= "\ud800"'}, "grammar"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": "\ud800"}, "model"),
])
def test_a_lone_surrogate_is_a_400_and_the_connection_lives_on(url, path, body, param):
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as its \\u escape, as a client sends it
    assert "\\ud8" in raw or "\\udf" in raw
    with httpx.Client(headers=H | {"content-type": "application/json"}, timeout=60) as c:
        err = error_of(c.post(url + path, content=raw))
        assert err["param"] == param and "Unicode" in err["message"]
        # the same keep-alive connection serves the next request
        assert c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


# -- 5. llama-server's fields: honoured or refused by name -------------------------------------------------------------

def test_n_predict_is_honoured(url):
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "n_predict": 3, "max_tokens": 50,
                                      "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert r.json()["timings"]["predicted_n"] <= 3
    err = error_of(post(url, "/v1/completions", {"prompt": "hi", "n_predict": 0}))
    assert err["param"] == "n_predict"


@pytest.mark.parametrize("field,value", [("min_tokens", 5), ("n_indent", 4), ("lora", [{"id": 0, "scale": 1}]),
                                         ("samplers", ["temperature", "top_k"]), ("samplers", "tk"),
                                         ("samplers", ["dry", "mirostat"]), ("samplers", ["infill"]),
                                         ("id_slot", 7), ("id_slot", -2), ("n_keep", -2), ("cache_prompt", "no")])
def test_llama_server_fields_that_cannot_be_honoured_are_refused_by_name(url, field, value):
    err = error_of(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value}))
    assert err["param"] == field


def test_samplers_leave_out_what_they_do_not_list(url):
    base = {"prompt": "The cat", "max_tokens": 8, "temperature": 1.0, "seed": 5}

    def text(extra):
        r = post(url, "/v1/completions", base | extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # top_k=1 makes it greedy; a chain without top_k leaves it out, as llama.cpp's chain does (the fields a request
    # leaves out are llama-server's defaults: top-k 40, top-p 0.95, min-p 0.05)
    assert text({"top_k": 1, "samplers": ["penalties", "top_p", "temperature"]}) == text({"top_k": 0, "min_p": 0})
    assert text({"top_k": 1, "samplers": "kt"}) == text({"top_k": 1})
    assert text({"temperature": 0, "samplers": ["top_k", "min_p"]}) == text({"temperature": 1.0, "top_p": 1.0})
    assert text({}) != text({"top_k": 0, "top_p": 1.0, "min_p": 0})  # the defaults are a chain, not pure sampling


def test_cache_prompt_false_decodes_the_whole_prompt(url):
    body = {"prompt": "A long enough prompt to be cached " * 4, "max_tokens": 4, "temperature": 0, "id_slot": 1}
    first = post(url, "/v1/completions", body).json()
    cached = post(url, "/v1/completions", body).json()
    fresh = post(url, "/v1/completions", body | {"cache_prompt": False}).json()
    n_prompt = first["usage"]["prompt_tokens"]
    assert cached["timings"]["prompt_n"] < n_prompt and fresh["timings"]["prompt_n"] == n_prompt
    assert first["choices"][0]["text"] == cached["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert post(url, "/v1/completions", body | {"n_keep": 16, "n_discard": 0}).status_code == 200


def test_id_slot_picks_the_slot(url):
    for slot in (0, 1):
        prompt = f"slot {slot} prompt"
        assert post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "id_slot": slot}).status_code == 200
        rows = httpx.get(url + "/slots", headers=H).json()
        n = len(httpx.post(url + "/tokenize", json={"content": prompt, "add_special": True}, headers=H)
                .json()["tokens"])
        assert rows[slot]["n_prompt_tokens"] == n


# -- 6. the key before anything ----------------------------------------------------------------------------------------

def test_the_key_comes_before_the_body_and_the_docs(url):
    for path in ("/docs", "/redoc"):
        assert httpx.get(url + path).status_code == 404
    assert httpx.get(url + "/openapi.json").status_code == 401
    assert httpx.get(url + "/openapi.json", headers=H).json()["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    for body in ("not json", '{"messages": 5}', '{"prompt": "hi"}'):
        r = httpx.post(url + "/v1/completions", content=body)
        assert error_of(r, 401)["code"] == "invalid_api_key"


# -- 7. and 8. errors name the right field; strict types ---------------------------------------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 1e300}, "presence_penalty"),
    ({"frequency_penalty": -1e39}, "frequency_penalty"),
    ({"logit_bias": {"5": 1e308}}, "logit_bias"),
    ({"temperature": True}, "temperature"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": False}, "seed"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_errors_name_the_field_and_types_are_strict(url, extra, param):
    err = error_of(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2} | extra))
    assert err["param"] == param


def test_a_nested_field_error_names_the_path_without_type_tags(url):
    err = error_of(post(url, "/v1/completions", {"prompt": "hi", "logit_bias": {"5": "much"}}))
    assert err["param"].split(".")[0] == "logit_bias" and "[" not in err["param"]
    err = error_of(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}))
    assert err["param"] == "messages.0.content"


def test_a_body_without_a_json_content_type_is_read_as_json(url):
    # as `curl -d '{...}'` sends it
    r = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                   headers=H | {"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200, r.text
    assert error_of(httpx.post(url + "/v1/completions", content=b"\xff\xfe", headers=H))["message"]


# -- 9. idle connections and clients that stop reading -----------------------------------------------------------------

def test_an_idle_connection_is_closed(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(30)
        t0 = time.time()
        assert s.recv(1) == b""  # closed by the server without a request
        assert time.time() - t0 < 15


def test_a_client_that_stops_reading_frees_its_slot(tmp_path):
    # a stream whose client reads nothing: once the sockets' buffers (megabytes) are full its events pile up unread,
    # and after the server's -to (0.5 s here) the generation is cancelled; with -to 600 the same request runs to its
    # 12,000 tokens (the end tokens banned), some 25 MB of logprobs
    target = write_tiny_target(tmp_path / "long-context.gguf", n_ctx_train=16384)
    with serve_process("-m", target, "--no-draft", "-c", 16384, "-np", 1, "-to", 0.5) as (url, _):
        eog = [t for text in ("<|im_end|>", "<|endoftext|>") for t in
               httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]]
        body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
                           "max_tokens": 12000, "logprobs": True, "top_logprobs": 20, "temperature": 1, "seed": 1,
                           "id_slot": 0, "logit_bias": [[t, False] for t in eog]}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            end = time.time() + 60
            busy_seen = busy = False
            while time.time() < end:
                busy = httpx.get(url + "/slots").json()[0]["is_processing"]
                busy_seen |= busy
                if busy_seen and not busy:
                    break
                time.sleep(0.05)
            assert busy_seen and not busy, "the slot of a client that stopped reading stayed busy"
            assert httpx.get(url + "/slots").json()[0]["next_token"][0]["n_decoded"] < 12000
        finally:
            s.close()


# -- 10. CORS ----------------------------------------------------------------------------------------------------------

def test_web_pages_need_to_be_allowed(url):
    body = {"prompt": "hi", "max_tokens": 1}
    evil = {"Origin": "http://evil.example"}
    # a simple cross-site POST (no preflight: text/plain) is refused, as is the preflight of a JSON one
    r = httpx.post(url + "/v1/completions", content=json.dumps(body), headers=H | evil | {"content-type": "text/plain"})
    assert error_of(r, 403)["code"] == "origin_not_allowed"
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/completions", headers=evil | pre)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # the server's own page, and a page allowed with --cors-origin
    own = {"Origin": url}
    assert post(url, "/v1/completions", body, headers=H | own).status_code == 200
    ok = {"Origin": "http://allowed.example"}
    r = httpx.options(url + "/v1/completions", headers=ok | pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://allowed.example"
    assert post(url, "/v1/completions", body, headers=H | ok).headers["access-control-allow-origin"] == \
        "http://allowed.example"


# -- 11. the command line ----------------------------------------------------------------------------------------------

def test_cli_checks_before_loading(tmp_path):
    missing = tmp_path / "missing.gguf"
    r = subprocess.run([sys.executable, "-m", "dflash_local", "generate", "-m", str(missing), "-n", "-2", "-p", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "-n/--max-tokens" in r.stderr and "missing.gguf" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "dflash_local", "serve", "-m", str(missing), "-t", "1000",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert "1000 threads on a machine with" in r.stderr and r.returncode != 0


# -- 7. a fuzzer over the request schema -------------------------------------------------------------------------------

def test_fuzzed_requests_get_no_server_error(srv, url, tmp_path):
    _, proc = srv
    schema = tmp_path / "openapi.json"
    schema.write_text(httpx.get(url + "/openapi.json", headers=H).text)
    rss0 = rss_mb(proc)
    exe = str(__import__("pathlib").Path(sys.executable).parent / "schemathesis")
    r = subprocess.run(
        [exe, "run", str(schema), "--url", url, "--checks", "not_a_server_error", "--max-examples", "15",
         "--header", f"Authorization: Bearer {KEY}", "--workers", "1", "--request-timeout", "60",
         "--suppress-health-check", "all", "--seed", "7", "--mode", "all"],
        capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert proc.poll() is None
    assert rss_mb(proc) - rss0 < 150


def test_an_engine_refuses_a_prompt_past_the_context_before_tokenizing(tiny_target):
    engine = Engine(tiny_target, n_ctx=64)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="bytes"):
        engine.prepare("x" * (engine.n_ctx * engine.longest_token + 1))
    assert time.perf_counter() - t0 < 5
