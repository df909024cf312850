"""The server's sampling controls through the real openai client: response_format, grammar, json_schema, logit_bias,
penalties and logprobs honoured (equal to the engine's plain decoding), and fields it cannot honour refused."""

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import KEY, ServerThread

from dflash_local import Engine
from dflash_local.server.app import create_app

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
# The tiny target's byte tokens can spell invalid UTF-8, which the grammar counts as one character and Python's
# decoder as several: its outputs are checked without the length limits
LOOSE = {**PERSON, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
MSGS = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafter):
    engine = Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")
    s = ServerThread(create_app(lambda: engine, "tiny", api_key=KEY))
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain decoding on the same target: what every drafted answer must equal."""
    return Engine(tiny_target, n_ctx=1024)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def plain(reference, **kw):
    # the server's chain for the fields a request leaves out: llama-server's top-k 40, top-p 0.95, min-p 0.05
    done = reference.complete(draft=False, **dict(top_k=40, top_p=0.95, min_p=0.05) | kw)
    done.pieces = [reference.target.piece(t) for t in done.token_ids]
    return done


def test_response_format_json_schema_and_json_object(client, reference):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=200, response_format=rf, **sampling)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), LOOSE)
        assert text == plain(reference, messages=MSGS, max_tokens=200, json_schema=PERSON, **sampling).text
    data = [{"role": "user", "content": "data"}]  # a prompt the tiny target closes its object for, greedily
    r = client.chat.completions.create(model="tiny", messages=data, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_llama_server_grammar_and_json_schema_fields(client, reference):
    r = client.completions.create(model="tiny", prompt="Count:", max_tokens=30, temperature=0,
                                  extra_body={"grammar": 'root ::= [a-z ]+'})
    assert r.choices[0].text == plain(reference, prompt="Count:", max_tokens=30, grammar='root ::= [a-z ]+').text
    assert set(r.choices[0].text) <= set("abcdefghijklmnopqrstuvwxyz ")
    r = client.completions.create(model="tiny", prompt="Person:", max_tokens=200, temperature=0,
                                  extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), LOOSE)


def test_logit_bias_and_penalties(client, reference):
    first = plain(reference, messages=MSGS, max_tokens=30)
    banned = first.token_ids[0]
    kw = dict(max_tokens=30, temperature=0.7, seed=3, presence_penalty=0.8, frequency_penalty=0.5)
    extra = {"repeat_penalty": 1.3, "repeat_last_n": 32}
    r = client.chat.completions.create(model="tiny", messages=MSGS, logit_bias={str(banned): -100}, extra_body=extra,
                                       **kw)
    want = plain(reference, messages=MSGS, logit_bias={banned: -100}, **kw, **extra)
    assert r.choices[0].message.content == want.text and banned not in want.token_ids[:1]
    # llama-server's list form, with false banning
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=30, temperature=0,
                                       extra_body={"logit_bias": [[banned, False]]})
    assert r.choices[0].message.content == plain(reference, messages=MSGS, max_tokens=30,
                                                  logit_bias={banned: False}).text != first.text


def check_chat_logprobs(content, want, n_top):
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    assert [bytes(c.bytes) for c in content] == want.pieces
    for c, e in zip(content, want.logprobs):
        assert len(c.top_logprobs) == n_top
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in e.top], abs=1e-6)
        assert bytes(c.bytes).decode(errors="replace") == c.token


def test_chat_logprobs_stream_and_not(client, reference):
    want = plain(reference, messages=MSGS, max_tokens=20, logprobs=3)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0, logprobs=True,
                                       top_logprobs=3)
    check_chat_logprobs(r.choices[0].logprobs.content, want, 3)
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    check_chat_logprobs(streamed, want, 3)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
    assert r.choices[0].logprobs is None


def test_completions_logprobs_stream_and_not(client, reference):
    want = plain(reference, prompt="def add(a, b):", max_tokens=16, logprobs=2)
    r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=16, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [p.decode(errors="replace") for p in want.pieces]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    assert all(len(t) <= 2 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=16, temperature=0,
                                            logprobs=2, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((g.token_logprobs for g in got), []) == lp.token_logprobs
    assert sum((g.text_offset for g in got), []) == lp.text_offset


CHAT = {"messages": MSGS, "max_tokens": 2}
TEXT = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("path,body,param", [
    ("chat", CHAT | {"n": 2}, "n"),
    ("text", TEXT | {"best_of": 3}, "best_of"),
    ("text", TEXT | {"echo": True}, "echo"),
    ("text", TEXT | {"suffix": "end"}, "suffix"),
    ("chat", CHAT | {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", CHAT | {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", CHAT | {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", CHAT | {"mirostat": 2}, "mirostat"),
    ("chat", CHAT | {"dry_multiplier": 0.8}, "dry_multiplier"),
    ("chat", CHAT | {"logprobs": 3}, "logprobs"),
    ("text", TEXT | {"logprobs": True}, "logprobs"),
    ("text", TEXT | {"top_logprobs": 2}, "top_logprobs"),
    ("chat", CHAT | {"top_logprobs": 2}, "top_logprobs"),
    ("chat", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", CHAT | {"grammar": "root ::= nothing"}, "grammar"),
    ("chat", CHAT | {"grammar": "root ::= [a]", "json_schema": {}}, "json_schema"),
    ("chat", CHAT | {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", CHAT | {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
    ("text", TEXT | {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("text", TEXT | {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("text", TEXT | {"repeat_penalty": -1}, "repeat_penalty"),
    ("text", TEXT | {"repeat_last_n": -5}, "repeat_last_n"),
])
def test_fields_the_server_cannot_honour_are_400s_naming_them(server, path, body, param):
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_neutral_values_and_unknown_vendor_fields_pass(server, client):
    body = CHAT | {"n": 1, "echo": False, "modalities": ["text"], "mirostat": 0, "service_tier": "auto",
                   "store": False, "metadata": {"a": "b"}, "some_vendor_field": {"x": 1}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, n=2)
    assert e.value.body["param"] == "n"
