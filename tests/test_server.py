"""The OpenAI-compatible server, as a real HTTP server on 127.0.0.1 with the tiny fixture pair."""

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from conftest import make_prompts
from scripted import Wrapping

from dflash_local import Engine
from dflash_local.chat.templates import read_template, render
from dflash_local.engine.drafter import Drafter
from dflash_local.llama_server import free_port
from dflash_local.server.app import create_app

KEY = "sk-test-key"


@contextmanager
def serve_command(*args):
    """`dflash-local serve ARGS` on a free port, started as a user starts it; yields its URL once /health is 200."""
    with serve_process(*args) as (url, _):
        yield url


@contextmanager
def serve_process(*args):
    """serve_command's server, yielding its URL and its process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_local", "serve", *map(str, args), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.time() + 120
        while time.time() < end:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(10)


class ServerThread:
    """uvicorn serving an app on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            if httpx.get(self.url + "/health").status_code == 200:
                return
            time.sleep(0.05)
        raise TimeoutError("server never became healthy")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafter):
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    s = ServerThread(create_app(lambda: engine, "tiny", api_key=KEY, max_queue=20))
    s.wait_healthy()
    s.engine = engine
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_target, tiny_drafter):
    """A separate engine on the same files, to compute the expected greedy outputs."""
    return Engine(tiny_target, tiny_drafter, n_ctx=1024)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny_vocab(tiny_target):
    """llama-cpp-python's own view of the tiny target: an independent tokenizer and parameter count."""
    import llama_cpp

    return llama_cpp.Llama(str(tiny_target), vocab_only=True, verbose=False)


def test_models_list_and_retrieve(client, server, tiny_target):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.retrieve(tiny_target.name).id == "tiny"  # the file name also selects it
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    meta = models.data[0].model_extra["meta"]
    target = server.engine.target
    assert meta["n_ctx"] == 1024 and meta["n_ctx_train"] == 2048 and meta["n_vocab"] == target.n_vocab
    assert meta["n_embd"] == target.n_embd and meta["size"] == target.size
    assert meta["target"]["file"] == tiny_target.name and meta["drafter"]["file"] == "tiny-drafter.gguf"
    r = httpx.get(server.url + "/v1/models", headers=auth())
    assert str(tiny_target.parent) not in r.text and '"path"' not in r.text  # no file system paths


def test_model_meta_counts_parameters_as_llama_cpp(server, tiny_target):
    import llama_cpp

    model = llama_cpp.Llama(str(tiny_target), n_ctx=64, verbose=False)
    want = llama_cpp.llama_model_n_params(model._model.model)
    meta = httpx.get(server.url + "/v1/models/tiny", headers=auth()).json()["meta"]
    assert meta["n_params"] == want > 0


def test_props(server, tiny_target):
    r = httpx.get(server.url + "/props", headers=auth())
    assert r.status_code == 200
    p = r.json()
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == 1024
    assert settings["params"]["n_predict"] == settings["params"]["max_tokens"] == 2048
    # llama-server's defaults for a field left out: its chain of top-k 40, top-p 0.95, min-p 0.05, temperature 0.8
    assert [settings["params"][k] for k in ("temperature", "top_k", "top_p", "min_p")] == [0.8, 40, 0.95, 0.05]
    assert settings["params"]["speculative.n_max"] == 7  # block size 8: the anchor and 7 drafted tokens
    assert settings["params"]["speculative.types"] == "dflash"  # an Engine made without n-gram drafts
    assert p["model_path"] == tiny_target.name and p["model_alias"] == "tiny" and p["total_slots"] == 1
    assert p["chat_template"] == server.engine.chat_template and "<|im_start|>" in p["chat_template"]
    assert p["eos_token"] == "<|endoftext|>" and p["modalities"]["vision"] is False
    assert "llama-cpp-python 0.3.36" in p["build_info"]
    assert p["speculative"] == {"drafter": "tiny-drafter.gguf", "draft_backend": "ggml", "block_size": 8,
                                "draft_policy": "fixed", "bit_exact_verify": server.engine.bit_exact, "ngram": None,
                                "drafter_error": None}
    assert str(tiny_target.parent) not in r.text
    assert httpx.get(server.url + "/props").status_code == 401


def test_tokenize_and_detokenize(server, tiny_vocab):
    def post(path, body):
        r = httpx.post(server.url + path, json=body, headers=auth())
        assert r.status_code == 200, r.text
        return r.json()

    text = "Hello world <|im_start|>user"
    want = tiny_vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert post("/tokenize", {"content": text})["tokens"] == want
    assert post("/tokenize", {"content": text, "parse_special": False})["tokens"] == tiny_vocab.tokenize(
        text.encode(), add_bos=False, special=False)
    assert post("/detokenize", {"tokens": want})["content"] == text
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == want and "".join(p["piece"] for p in pieces) == text
    # a character split over byte tokens: each piece is its bytes, as llama-server gives them
    pieces = post("/tokenize", {"content": "\u00e9", "with_pieces": True})["tokens"]
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in pieces) == "\u00e9".encode()
    # text and token ids mixed
    assert post("/tokenize", {"content": ["Hello", want[1], " x"]})["tokens"] == (
        tiny_vocab.tokenize(b"Hello", add_bos=False, special=True) + [want[1]]
        + tiny_vocab.tokenize(b" x", add_bos=False, special=True))
    for path, body in [("/detokenize", {"tokens": [1, 10**12]}), ("/detokenize", {"tokens": [-1]}),
                       ("/tokenize", {"content": ["a", 10**6]}), ("/detokenize", {"tokens": "abc"})]:
        r = httpx.post(server.url + path, json=body, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] in ("tokens", "content"), r.text


def test_apply_template(server, qwen3_server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = httpx.post(server.url + "/apply-template", json={"messages": msgs}, headers=auth())
    eot = "<|endoftext|>"  # the tiny GGUF's BOS and EOS
    assert r.json() == {"prompt": render(msgs, server.engine.chat_template, "qwen3", eot, eot)}
    assert r.json()["prompt"].endswith("<|im_start|>assistant\n")
    # tools and chat_template_kwargs render as in a chat request
    body = {"messages": msgs, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": True}}
    r = httpx.post(qwen3_server.url + "/apply-template", json=body)
    want = render(msgs, qwen3_server.template, "qwen3", variables={"tools": [WEATHER], "enable_thinking": True})
    assert r.json()["prompt"] == want and '"name": "get_weather"' in want
    r = httpx.post(qwen3_server.url + "/apply-template", json={"messages": msgs})
    assert r.json()["prompt"].endswith("<think>\n\n</think>\n\n")  # the server's enable_thinking=false
    r = httpx.post(qwen3_server.url + "/apply-template", json={"messages": [{"role": "developer", "content": "x"}]})
    assert r.status_code == 400 and "Unexpected message role: developer" in r.json()["error"]["message"]


def test_n_predict_caps_requests_without_max_tokens(tiny_target, tiny_drafter, reference):
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024)
    s = ServerThread(create_app(lambda: engine, "tiny", n_predict=9))
    try:
        s.wait_healthy()
        want = reference.complete("Once upon", max_tokens=9)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon", "temperature": 0}).json()
        assert r["choices"][0]["text"] == want.text and r["usage"]["completion_tokens"] == len(want.token_ids)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon", "temperature": 0, "max_tokens": 12})
        assert r.json()["usage"]["completion_tokens"] == len(reference.complete("Once upon", max_tokens=12).token_ids)
        assert httpx.get(s.url + "/props").json()["default_generation_settings"]["params"]["n_predict"] == 9
    finally:
        s.stop()


def test_chat_completion_with_the_openai_client(client, reference):
    msgs = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    want = reference.complete(messages=msgs, max_tokens=20)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == want.summary.n_prompt
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == 20 and timings["draft_n"] > 0
    assert {"prompt_n", "prompt_ms", "predicted_ms", "predicted_per_second", "draft_n_accepted",
            "mean_acceptance_length"} <= set(timings)


def test_chat_stream_with_usage(client, reference):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    want = reference.complete(messages=msgs, max_tokens=24)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    n = len(want.token_ids)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason == ("length" if want.summary.finish_reason == "length" else "stop")
    assert finishing[0].model_extra["timings"]["predicted_n"] == n
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_not(client, reference):
    want = reference.complete("The quick brown fox", max_tokens=16)
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0)
    assert r.choices[0].text == want.text and r.object == "text_completion"
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


def test_stop_and_sampling_fields_are_honoured(client, reference):
    kw = dict(max_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    want = reference.complete("Hello", top_k=5, min_p=0.05, **kw)
    r = client.completions.create(model="tiny", prompt="Hello", extra_body={"top_k": 5, "min_p": 0.05}, **kw)
    assert r.choices[0].text == want.text
    stop = want.text[5:8]
    r = client.completions.create(model="tiny", prompt="Hello", stop=[stop], extra_body={"top_k": 5, "min_p": 0.05},
                                  **kw)
    assert r.choices[0].text == want.text[: want.text.find(stop)] and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_sse_framing(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    events = [f for f in frames[:-2] if not f.startswith(":")]
    assert all(f.startswith("data: ") and "\n" not in f for f in events)
    assert "\nid:" not in "\n" + raw and "\nevent:" not in "\n" + raw
    objs = [json.loads(f[6:]) for f in events]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["choices"][0]["finish_reason"] for o in objs[:-1]].count("length") == 1
    assert objs[-2]["choices"][0]["finish_reason"] == "length" and "timings" in objs[-2]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 101}, 400, "temperature"),
        ({"messages": "hi"}, 400, "messages"),
        ({}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, 404, "model"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "messages"),
        ({"messages": [{"role": "narrator", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "21"}]}, 400, "messages.1"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
         "response_format"),
    ],
)
def test_bad_requests_get_openai_error_bodies(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert param in (err["param"] or "")


def test_malformed_json_and_unknown_fields(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', headers=auth() | {
        "content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"].startswith("the request body is not valid JSON") and err["param"] is None
    body = {"messages": [{"role": "user", "content": "hi", "name": "x"}], "max_tokens": 2, "frequency_penalty": 0,
            "logit_bias": {}, "user": "u", "whatever": [1, 2]}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth()).status_code == 200


TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen3_server(tiny_target, tiny_drafter):
    """As `serve --chat-template-file qwen3-like.jinja --chat-template-kwargs '{"enable_thinking": false}'`."""
    template = read_template(TEMPLATES / "qwen3-like.jinja")
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024, chat_template=template,
                    chat_template_kwargs={"enable_thinking": False})
    s = ServerThread(create_app(lambda: engine, "tiny"))
    s.wait_healthy()
    s.template = template
    yield s
    s.stop()


def test_chat_template_kwargs_and_tools_reach_the_template(qwen3_server, reference):
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]

    def n_prompt(variables):
        return len(reference.tokenize(render(msgs, qwen3_server.template, "qwen3", variables=variables), special=True))

    def ask(**kw):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0, **kw)
        return r.usage.prompt_tokens

    assert n_prompt({"enable_thinking": False}) != n_prompt({})
    assert ask() == n_prompt({"enable_thinking": False})  # the server's default kwargs
    assert ask(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == n_prompt({})  # the request's win
    assert ask(extra_body={"chat_template_kwargs": {"other": 1}}) == n_prompt({"enable_thinking": False})  # merged
    with_tools = n_prompt({"enable_thinking": False, "tools": [WEATHER]})
    assert with_tools > n_prompt({"enable_thinking": False}) + 50
    assert ask(tools=[WEATHER]) == with_tools

    # a whole tool-call round trip: the assistant's tool_calls and the tool's answer are rendered
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    rendered = render([msgs[0], {**msgs[1], "content": ""}, msgs[2]], qwen3_server.template, "qwen3",
                      variables={"tools": [WEATHER], "enable_thinking": False})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in rendered
    assert ask(tools=[WEATHER]) == len(reference.tokenize(rendered, special=True))


def test_template_errors_are_400_with_the_templates_message(qwen3_server, server):
    body = {"messages": [{"role": "developer", "content": "x"}], "max_tokens": 2}  # an OpenAI role it lacks
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the chat template refused the messages: Unexpected message role: developer"
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "cannot replace 'messages'" in r.json()["error"]["message"]
    # the tiny GGUF's own ChatML template does not render tools: refused, not dropped
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth())
    assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]


def test_serve_takes_chat_template_options(tiny_target, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ greeting }}, {{ messages[-1].content }} ->")
    with serve_command("-m", tiny_target, "--chat-template-file", template,
                       "--chat-template-kwargs", '{"greeting": "Hello"}', "-n", "3") as url:
        body = {"messages": [{"role": "user", "content": "world"}], "max_tokens": 2}
        engine = Engine(tiny_target, n_ctx=256)
        for kwargs, text in [({}, "Hello, world ->"), ({"greeting": "Bye"}, "Bye, world ->")]:
            r = httpx.post(url + "/v1/chat/completions", json=body | {"chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenize(text, special=True))
        # -n caps a request without max_tokens
        body = {"messages": [{"role": "user", "content": "world"}], "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        served = Engine(tiny_target, n_ctx=256, chat_template=template.read_text(),
                        chat_template_kwargs={"greeting": "Hello"})
        want = served.complete(messages=body["messages"], max_tokens=3)
        assert len(want.token_ids) == 3
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert httpx.get(url + "/props").json()["default_generation_settings"]["params"]["n_predict"] == 3


def test_prompt_beyond_the_context(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 2000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"


def test_api_keys(server):
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=auth("wrong")).status_code == 401
    assert httpx.get(url, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url, headers=auth()).status_code == 200
    assert httpx.get(url, headers=auth("wrong")).json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_no_key_configured_accepts_any(tiny_target):
    engine = Engine(tiny_target, n_ctx=256)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        assert httpx.get(s.url + "/v1/models").status_code == 200
        assert httpx.get(s.url + "/v1/models", headers=auth("anything")).status_code == 200
    finally:
        s.stop()


def test_cors_preflight(tiny_engine):
    # an app such as Jan calling from its own web view: refused unless its origin is allowed (cors_origins, the
    # command's --cors-origin); tests/test_hostile.py has the rest
    pre = {"Origin": "http://localhost:1337", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    for origins, status in (((), 403), (("http://localhost:1337",), 200), (("*",), 200)):
        s = ServerThread(create_app(lambda: tiny_engine, "tiny", cors_origins=origins))
        try:
            r = httpx.options(s.url + "/v1/chat/completions", headers=pre)
            assert r.status_code == status
            if status == 200:
                assert r.headers["access-control-allow-origin"] in ("*", "http://localhost:1337")
        finally:
            s.stop()


def test_health_is_503_while_loading(tiny_target):
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return Engine(tiny_target, n_ctx=256)

    s = ServerThread(create_app(slow_load, "tiny"))
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["meta"] is None  # as llama-server while loading
        assert httpx.get(s.url + "/props").status_code == 503
        gate.set()
        s.wait_healthy()
    finally:
        gate.set()
        s.stop()


def test_concurrent_requests_all_get_their_own_outputs(server, reference):
    prompts = make_prompts(16, seed=5)
    want = [reference.complete(p, max_tokens=20).text for p in prompts]

    def one(p):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        return c.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == want


def test_queue_bound_gives_429(tiny_target):
    engine = Engine(tiny_target, n_ctx=1024)
    s = ServerThread(create_app(lambda: engine, "tiny", max_queue=1))
    try:
        s.wait_healthy()
        body = {"prompt": "Hello", "max_tokens": 600, "temperature": 0}

        def one(_):
            return httpx.post(s.url + "/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(4) as pool:
            statuses = [r.status_code for r in pool.map(one, range(4))]
        assert statuses.count(200) >= 2 and 429 in statuses
        r = next(r for r in ThreadPoolExecutor(4).map(one, range(4)) if r.status_code == 429)
        assert r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        s.stop()


class PausedDrafter(Wrapping):
    """The engine's own drafter, made to wait at its `at`-th draft until the test lets it go on: the engine is then
    inside a step, at a known token count."""

    def __init__(self, inner: Drafter, at: int):
        super().__init__(inner)
        self.at = at
        self.calls = 0
        self.n_tokens_at_pause = 0  # prompt + generated tokens when the engine reached the pause
        self.reached, self.go = threading.Event(), threading.Event()

    def draft(self, tokens, k):
        self.calls += 1
        if self.calls == self.at:
            self.n_tokens_at_pause = len(tokens)
            self.reached.set()
            self.go.wait(60)
        return self.inner.draft(tokens, k)


def test_disconnect_mid_stream_stops_the_generation_within_a_step(tiny_target, tiny_drafter):
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    paused = engine.drafter = PausedDrafter(engine.drafter, at=3)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        body = {"prompt": "Once", "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert paused.reached.wait(60)  # the engine is inside its third step
            assert next(r.iter_lines()).startswith("data: ")
        # the client is gone; the server notices while the engine is still inside that step
        end = time.time() + 30
        while "dflash_cancelled_requests_total 1" not in httpx.get(s.url + "/metrics").text:
            assert time.time() < end, "the server never noticed the disconnect"
            time.sleep(0.02)
        paused.go.set()
        while engine.slots[0].busy.locked():
            assert time.time() < end, "the abandoned generation never stopped"
            time.sleep(0.005)
        # it finished the step it was in and drafted no other: one step's tokens (1 .. block size) past the pause
        n_prompt = len(engine.prompt_tokens("Once"))
        n_generated = len(engine.cache.tokens) + 1 - n_prompt  # the newest token is not in the cache yet
        assert paused.calls == 3
        assert 1 <= n_generated - (paused.n_tokens_at_pause - n_prompt) <= engine.block_size
        # and the engine serves the next request
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        paused.go.set()
        s.stop()


def test_slots_show_the_running_task_and_its_progress(tiny_target, tiny_drafter):
    """GET /slots in llama-server's shape: idle before any request, the running task mid-generation (and 503 with
    ?fail_on_no_slot=1 then), the finished task's counts after; /props says there is one slot."""
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    paused = engine.drafter = PausedDrafter(engine.drafter, at=3)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        assert httpx.get(s.url + "/props").json()["total_slots"] == 1
        idle = httpx.get(s.url + "/slots").json()
        assert idle == [{"id": 0, "n_ctx": 1024, "speculative": True, "is_processing": False}]
        assert httpx.get(s.url + "/slots?fail_on_no_slot=1").status_code == 200
        n_prompt = len(engine.prompt_tokens("Once"))
        done = []
        t = threading.Thread(target=lambda: done.append(httpx.post(
            s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 60, "temperature": 0}, timeout=60)))
        t.start()
        assert paused.reached.wait(60)  # inside the third step: two steps' tokens decoded
        busy = httpx.get(s.url + "/slots").json()[0]
        decoded = busy["next_token"][0]["n_decoded"]
        assert busy["is_processing"] and busy["id_task"] == 1 and busy["n_prompt_tokens"] == n_prompt
        assert decoded == paused.n_tokens_at_pause - n_prompt  # the prefill's token and two steps' tokens
        assert busy["next_token"][0]["n_remain"] == 60 - decoded and busy["next_token"][0]["has_next_token"]
        r = httpx.get(s.url + "/slots?fail_on_no_slot=1")
        assert r.status_code == 503 and r.json()["error"]["message"] == "no slot available"
        paused.go.set()
        t.join(60)
        assert done[0].status_code == 200
        n = done[0].json()["usage"]["completion_tokens"]
        after = httpx.get(s.url + "/slots").json()[0]
        assert not after["is_processing"] and after["id_task"] == 1
        assert after["next_token"][0] == {"has_next_token": False, "n_remain": 60 - n, "n_decoded": n}
    finally:
        paused.go.set()
        s.stop()


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="count", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    for name in ("requests", "prompt_tokens", "generated_tokens", "generation_seconds", "drafts", "draft_tokens",
                 "accepted_tokens"):
        assert f"dflash_{name}_total" in values
    assert values["dflash_requests_total"] >= 1 and values["dflash_generated_tokens_total"] >= 5
    assert values["dflash_draft_tokens_total"] > 0
    assert 'dflash_accepted_tokens_by_position_total{position="1"}' in values
    assert "# TYPE dflash_requests_total counter" in text


def test_serve_command_on_gemma(gemma_target, gemma_drafter):
    with serve_command("-m", gemma_target, "-d", gemma_drafter, "--alias", "gemma") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Say hello."}],
                                      max_tokens=12, temperature=0)
        assert r.usage.completion_tokens <= 12 and r.model_extra["timings"]["draft_n"] > 0
        assert c.models.list().data[0].model_extra["meta"]["target"]["arch"] == "gemma3"
        # the command's default speculative types: n-gram drafts first, then the drafter (llama.cpp's names)
        params = httpx.get(url + "/props").json()["default_generation_settings"]["params"]
        assert params["speculative.types"] == "ngram-simple,dflash" and params["speculative.n_max"] == 48
        # gemma wants a BOS: /tokenize adds it only with add_special, as llama.cpp's own tokenizer does
        import llama_cpp

        vocab = llama_cpp.Llama(str(gemma_target), vocab_only=True, verbose=False)
        for add in (False, True):
            r = httpx.post(url + "/tokenize", json={"content": "Say hello.", "add_special": add})
            assert r.json()["tokens"] == vocab.tokenize(b"Say hello.", add_bos=add, special=True)
        assert r.json()["tokens"][0] == vocab.token_bos()


def test_serve_exits_with_an_error_for_a_bad_model(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk" * 100)
    r = subprocess.run([sys.executable, "-m", "dflash_local", "serve", "-m", str(bad), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a GGUF" in r.stderr


def test_huge_top_k_is_a_client_error(server):
    body = {"prompt": "x", "max_tokens": 2, "top_k": 36028797018963968}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_waiting_streams_get_sse_comment_keepalives(tiny_target, monkeypatch):
    from dflash_local.server import stream as api_stream

    monkeypatch.setattr(api_stream, "KEEPALIVE_SECONDS", 0.02)
    engine = Engine(tiny_target, n_ctx=1024)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        long = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "Hello", "max_tokens": 900, "temperature": 0}))
        long.start()
        while not engine.slots[0].busy.locked():  # the long generation holds the engine before the stream asks
            time.sleep(0.005)
        body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            raw = "".join(r.iter_text())
        long.join()
        assert ": keep-alive\n\n" in raw and raw.endswith("data: [DONE]\n\n")
        frames = [f for f in raw.split("\n\n") if f]
        assert all(f.startswith("data: ") or f == ": keep-alive" for f in frames)
    finally:
        s.stop()


def test_serve_stays_up_without_a_drafter_that_fails_to_load(tiny_target, tiny_drafter, tmp_path):
    # a drafter whose tensor data is cut short: its header reads, llama.cpp fails to load it
    broken = tmp_path / "broken-drafter.gguf"
    data = tiny_drafter.read_bytes()
    broken.write_bytes(data[:len(data) - 4096])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_local", "serve", "-m", str(tiny_target), "-d", str(broken),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 120
        while time.time() < end and proc.poll() is None:
            try:
                health = httpx.get(url + "/health", timeout=30)
                if health.status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        assert "broken-drafter.gguf" in health.json()["drafter_error"]
        props = httpx.get(url + "/props", timeout=30)
        spec = props.json()["speculative"]
        assert spec["drafter"] is None and "broken-drafter.gguf" in spec["drafter_error"]
        # clients see the file's name, not where it is on the server (/health needs no key)
        assert str(tmp_path) not in health.text and str(tmp_path) not in props.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello world", "max_tokens": 12, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200
        plain = Engine(tiny_target, n_ctx=1024).complete("Hello world", max_tokens=12)
        assert r.json()["choices"][0]["text"] == plain.text
    finally:
        proc.terminate()
        proc.wait(10)
    log = proc.stderr.read()
    assert "warning: the drafter failed to load" in log and str(tmp_path) in log  # the log has the whole path


def test_a_chat_request_is_prepared_once(server, monkeypatch):
    """One chat request renders its template once, tokenizes its prompt once and builds one sampler, which is the
    one that samples (Engine.prepare -> Generation -> the runner -> Engine.run)."""
    from dflash_local.chat import templates
    from dflash_local.engine.sampling import SamplingParams

    calls = {"render": 0, "tokenize": 0, "sampler": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(templates, "render", counted("render", templates.render))
    monkeypatch.setattr(SamplingParams, "sampler", counted("sampler", SamplingParams.sampler))
    monkeypatch.setattr(Engine, "tokenize", counted("tokenize", Engine.tokenize))
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(), json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert calls == {"render": 1, "tokenize": 1, "sampler": 1}
