"""Clients others wrote, from PyPI, against the real server on 127.0.0.1: the `llm` CLI configured as an
OpenAI-compatible model, and the openai SDK stopping a stream midway."""

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_server import KEY, TEMPLATES, ServerThread

from dflash_local import Engine
from dflash_local.chat.templates import read_template
from dflash_local.server.app import create_app

N_PREDICT = 16  # as `serve -n 16`: llm sends no max_tokens


@pytest.fixture(scope="module")
def qwen_engine(tiny_target, tiny_drafter):
    # a template that renders tools, so that `llm -T` has something to render them with
    return Engine(tiny_target, tiny_drafter, n_ctx=1024, chat_template=read_template(TEMPLATES / "qwen3-like.jinja"))


@pytest.fixture(scope="module")
def llm_server(qwen_engine):
    s = ServerThread(create_app(lambda: qwen_engine, "tiny", api_key=KEY, n_predict=N_PREDICT))
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(llm_server, tmp_path_factory):
    """Runs the llm CLI with its own user folder: the server as an extra OpenAI model, its key in keys.json."""
    home = tmp_path_factory.mktemp("llm-user")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: tiny\n  model_name: tiny\n  api_base: {llm_server.url}/v1\n  api_key_name: dflash\n"
        f"  supports_tools: true\n  supports_schema: true\n")
    (home / "keys.json").write_text(json.dumps({"dflash": KEY}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")} | {"LLM_USER_PATH": str(home)}

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "llm", *args], capture_output=True, text=True, env=env, timeout=300)
        logs = subprocess.run([sys.executable, "-m", "llm", "logs", "-n", "1", "--json"], capture_output=True,
                              text=True, env=env, timeout=60)
        entries = json.loads(logs.stdout)
        return r, entries[0] if entries else None  # the newest logged response

    return run


def n_prompt(engine, messages, **variables):
    return len(engine.prompt_tokens(messages=messages, chat_template_kwargs=variables))


def test_llm_plain_prompt_system_and_continue(llm, qwen_engine):
    r, log = llm("-m", "tiny", "Say hi")
    assert r.returncode == 0, r.stderr
    assert log["response"] and log["response"] in r.stdout
    assert 1 <= log["output_tokens"] <= N_PREDICT  # the server's -n, since llm sets no max_tokens
    assert log["input_tokens"] == n_prompt(qwen_engine, [{"role": "user", "content": "Say hi"}])

    r, first = llm("-m", "tiny", "-s", "Be brief.", "Say hi")
    assert r.returncode == 0, r.stderr
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert first["input_tokens"] == n_prompt(qwen_engine, history)

    r, log = llm("-c", "And again")  # the whole conversation goes back to the server
    assert r.returncode == 0, r.stderr
    assert log["conversation_id"] == first["conversation_id"]
    history += [{"role": "assistant", "content": first["response"]}, {"role": "user", "content": "And again"}]
    assert log["input_tokens"] == n_prompt(qwen_engine, history)


def test_llm_schema_constrains_the_output(llm):
    # llm sends response_format json_schema: the grammar holds the output to the schema
    r, log = llm("-m", "tiny", "--schema", "name, age int", "-o", "temperature", "0", "-o", "max_tokens", "300",
                 "Invent a person")
    assert r.returncode == 0, r.stderr
    person = json.loads(log["response"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)


def test_llm_tools_reach_the_template(llm, qwen_engine):
    r, log = llm("-m", "tiny", "-T", "llm_time", "What time is it?")
    assert r.returncode == 0, r.stderr
    (tool,) = log["tools"]
    sent = {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}
    msgs = [{"role": "user", "content": "What time is it?"}]
    assert log["input_tokens"] == n_prompt(qwen_engine, msgs, tools=[sent]) > n_prompt(qwen_engine, msgs) + 50


def test_openai_client_stops_a_stream_midway(llm_server, qwen_engine):
    client = openai.OpenAI(base_url=llm_server.url + "/v1", api_key=KEY, max_retries=0)

    def count(name):
        text = httpx.get(llm_server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    cancelled = count("dflash_cancelled_requests_total")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Once"}],
                                            max_tokens=1000, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = [next(stream) for _ in range(3)]
    stream.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    end = time.time() + 30
    while count("dflash_cancelled_requests_total") != cancelled + 1:
        assert time.time() < end, "the server never noticed the client stop"
        time.sleep(0.05)
    # the engine is free for the next request
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == qwen_engine.complete(messages=msgs, max_tokens=3).text
