"""Reasoning and tool calls through the server, with the real openai client on 127.0.0.1.

The tiny models never write a tool call, so most of these plant the generated text at the engine boundary
(planted.py: the prompt path is the real one); the gemma tests at the end run the real generation."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from planted import PlantedEngine, cut
from test_server import ServerThread, serve_command

from dflash_local import Engine
from dflash_local.chat.templates import read_template, render
from dflash_local.server.app import create_app
from dflash_local.chat.textstream import Output

TEMPLATES = Path(__file__).parent / "templates"
QWEN35 = read_template(TEMPLATES / "qwen35-like.jinja")
GPT_OSS = read_template(TEMPLATES / "gpt-oss-like.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_OUTPUT = ("The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
               "</parameter>\n</function>\n</tool_call>")


def serve(engine, **kw):
    s = ServerThread(create_app(lambda: engine, "tiny", **kw))
    s.wait_healthy()
    return s


@pytest.fixture(scope="module")
def planted(tiny_target, tiny_drafter):
    """As `serve --chat-template-file qwen35-like.jinja` with the generated text planted."""
    engine = PlantedEngine(Engine(tiny_target, tiny_drafter, n_ctx=1024, chat_template=QWEN35))
    s = serve(engine)
    s.engine = engine
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    yield s
    s.stop()


def post(server, body):
    return httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8} | body, timeout=60)


def test_tool_call_round_trip_with_the_openai_client(planted):
    engine, client = planted.engine, planted.client
    engine.pieces = cut(CALL_OUTPUT, 3)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert {"<think>", "</think>", "<tool_call>", "</tool_call>"} <= set(engine.preserved)
    prompt = engine.last_prompt()
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")

    # the call and the tool's answer go back to the model, rendered as its template writes them
    msgs = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    engine.pieces = ["Warm", ".\n</th", "ink>\n\nIt is 21 °C in Paris."]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=64, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "It is 21 °C in Paris."
    assert r.choices[0].message.model_extra["reasoning_content"] == "Warm."
    prompt = engine.last_prompt()
    assert prompt.endswith(
        "<|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n')
    assert r.usage.prompt_tokens == len(engine.tokenize(prompt, special=True))


@pytest.mark.parametrize("n", [1, 4])
def test_streamed_tool_call_and_reasoning_with_the_openai_client(planted, n):
    planted.engine.pieces = cut(CALL_OUTPUT, n)
    chunks = list(planted.client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=64,
                                                         stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage is not None


def test_tool_choice_through_the_server(planted):
    engine = planted.engine
    engine.pieces = ["x</think>", "It is sunny."]
    r = post(planted, {"tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "tool_choice_not_met"
    assert "'required' but the model called no tool" in r.json()["error"]["message"]
    r = post(planted, {"tools": [WEATHER], "tool_choice": "required", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "tool_choice_not_met" and r.text.endswith("data: [DONE]\n\n")
    r = post(planted, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(planted, {"tool_choice": "required"})
    assert r.status_code == 400 and "needs tools" in r.json()["error"]["message"]
    # parallel_tool_calls=false keeps the first call; tool_choice none reads no calls
    engine.pieces = [CALL_OUTPUT, CALL_OUTPUT[CALL_OUTPUT.index("<tool_call>"):].replace("Paris", "Rome")]
    r = post(planted, {"tools": [WEATHER]})
    assert [json.loads(c["function"]["arguments"])["city"] for c in r.json()["choices"][0]["message"]["tool_calls"]] \
        == ["Paris", "Rome"]
    r = post(planted, {"tools": [WEATHER], "parallel_tool_calls": False})
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1
    r = post(planted, {"tools": [WEATHER], "tool_choice": "none"})
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"].startswith("<tool_call>\n<function=get_weather>")
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_reasoning_format_and_budget_per_request(planted):
    engine = planted.engine
    engine.pieces = cut("Hm.\n</think>\n\nYes.", 2)
    r = post(planted, {})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Yes.", "reasoning_content": "Hm."}
    r = post(planted, {"reasoning_format": "none"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hm.\n</think>\n\nYes."}
    r = post(planted, {"reasoning_format": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
    # budget 0: enable_thinking=false, as llama-server; the prompt closes the thinking block, the output is the answer
    engine.pieces = ["Yes."]
    r = post(planted, {"reasoning_budget_tokens": 0})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Yes."}
    prompt = engine.last_prompt()
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenize(prompt, special=True))
    r = post(planted, {"thinking_budget_tokens": 100})
    assert r.status_code == 400 and "reasoning budget 100 is not supported" in r.json()["error"]["message"]


def test_server_reasoning_format_none(tiny_target):
    engine = PlantedEngine(Engine(tiny_target, n_ctx=512, chat_template=QWEN35))
    s = serve(engine, reasoning_format="none")
    try:
        engine.pieces = ["Hm.\n</think>\n\nYes."]
        assert post(s, {}).json()["choices"][0]["message"]["content"] == "Hm.\n</think>\n\nYes."
        assert post(s, {"reasoning_format": "deepseek"}).json()["choices"][0]["message"]["content"] == "Yes."
    finally:
        s.stop()


def test_gpt_oss_channels_through_the_server(tiny_target):
    engine = PlantedEngine(Engine(tiny_target, n_ctx=1024, chat_template=GPT_OSS))
    s = serve(engine)
    try:
        engine.pieces = cut('<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary '
                            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', 5)
        r = post(s, {"tools": [WEATHER], "stream": True})
        data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [d["choices"][0]["delta"] for d in data if d["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Use the tool."
        (call,) = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert data[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert {"<|channel|>", "<|message|>", "<|start|>"} <= set(engine.preserved)
    finally:
        s.stop()


def test_tools_for_a_model_whose_call_format_is_unknown_are_refused(tiny_target):
    template = "{% for t in tools %}{{ t.function.name }}\n{% endfor %}{{ messages[-1].content }}"
    engine = Engine(tiny_target, n_ctx=512, chat_template=template)
    s = serve(engine)
    try:
        r = post(s, {"tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "no tool-call format dflash-local can read" in r.json()["error"]["message"]
        r = post(s, {"tools": [WEATHER], "tool_choice": "none"})  # rendered, no calls read: served
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            engine.tokenize("get_weather\nWeather in Paris?", special=True))
    finally:
        s.stop()


# -- the real generation --------------------------------------------------------------------------------------------


def test_preserved_control_tokens_show_as_text(gemma_engine):
    vocab = gemma_engine.target
    (turn,) = vocab.tokenize("<start_of_turn>", False, True)
    assert Output(vocab, [], 8).add([turn]) == ""  # a control token is no text, as in llama.cpp
    assert Output(vocab, [], 8, frozenset([turn])).add([turn]) == "<start_of_turn>"


def test_done_when_serve_a_qwen35_like_template_on_gemma(gemma_target, gemma_drafter, gemma_engine):
    """`serve --chat-template-file qwen35-like.jinja` on gemma: tools are rendered, enable_thinking=false changes the
    prompt, and the streamed thinking (the template opens <think>) arrives in reasoning_content."""
    with serve_command("-m", gemma_target, "-d", gemma_drafter, "--alias", "gemma",
                       "--chat-template-file", TEMPLATES / "qwen35-like.jinja") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def n_prompt(variables):
            text = render(ASK, QWEN35, "gemma3", "<bos>", "<eos>", variables=variables)
            return len(gemma_engine.tokenize(text, special=True))

        # tools rendered; gemma writes no call, and its answer comes back (as reasoning: the prompt opened <think>)
        r = c.chat.completions.create(model="gemma", messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0)
        assert r.usage.prompt_tokens == n_prompt({"tools": [WEATHER]}) > n_prompt({}) + 50
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
        thought = r.choices[0].message.model_extra["reasoning_content"]
        assert thought and r.choices[0].message.content == ""
        # thinking off: another prompt, and the output is the content
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        r = c.chat.completions.create(model="gemma", messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0,
                                      extra_body=off)
        assert r.usage.prompt_tokens == n_prompt({"tools": [WEATHER], "enable_thinking": False}) != n_prompt(
            {"tools": [WEATHER]})
        assert r.choices[0].message.content and "reasoning_content" not in r.choices[0].message.model_extra
        # streamed: the thinking arrives in reasoning_content, the same as the whole response's (greedy, lossless)
        chunks = list(c.chat.completions.create(model="gemma", messages=ASK, tools=[WEATHER], max_tokens=12,
                                                temperature=0, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == ""


def test_serve_refuses_a_reasoning_budget_it_cannot_keep(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash_local", "serve", "--reasoning-budget", "256"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert "reasoning budget 256 is not supported: use -1 (unrestricted) or 0 (no thinking)" in r.stderr
