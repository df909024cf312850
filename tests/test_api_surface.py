"""The endpoints beyond OpenAI's chat and text completions, each driven by its real client against a real server on
127.0.0.1 (a tiny target with fill-in-the-middle tokens, drafting on): llama-server's /completion and /infill (httpx),
with outputs equal to plain decoding."""

import json

import httpx
import pytest
from fixtures import write_tiny_drafter, write_tiny_target
from test_server import ServerThread

from dflash_local import Engine
from dflash_local.server.app import create_app

KEY = "sk-surface"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fim_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("fim")
    target = write_tiny_target(d / "fim-target.gguf", fim=True)
    return target, write_tiny_drafter(d / "fim-drafter.gguf", target, target_layers=(1, 3))


@pytest.fixture(scope="module")
def plain(fim_pair):
    """Plain decoding of the same target: what every drafted answer must equal."""
    return Engine(fim_pair[0], n_ctx=1024)


@pytest.fixture(scope="module")
def url(fim_pair):
    engine = Engine(*fim_pair, n_ctx=1024, draft_policy="fixed")
    s = ServerThread(create_app(lambda: engine, "fim", api_key=KEY))
    s.wait_healthy()
    yield s.url
    s.stop()


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=H, timeout=120, **kw)


def sse(url, path, body) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, headers=H, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f.startswith("data: ")]
    return [json.loads(f[6:]) for f in frames]


# -- /completion ----------------------------------------------------------------------------------------------------

def test_completion_equals_plain_decoding(url, plain):
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
    want = plain.complete(prompt=[prompt], max_tokens=24)
    r = post(url, "/completion", {"prompt": prompt, "n_predict": 24, "temperature": 0, "return_tokens": True,
                                  "n_probs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == want.text and body["tokens"] == want.token_ids
    assert body["stop"] is True and body["stop_type"] in ("limit", "eos") and body["tokens_predicted"] == 24
    assert body["tokens_evaluated"] == len(plain.prepare([prompt]).ids) and body["prompt"] == prompt
    assert body["timings"]["predicted_n"] == 24 and body["generation_settings"]["n_predict"] == 24
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == want.token_ids and all(len(p["top_logprobs"]) == 2 for p in probs)
    assert probs[0]["top_logprobs"][0]["logprob"] >= probs[0]["top_logprobs"][1]["logprob"]


def test_completion_streams_native_chunks(url, plain):
    prompt = "x = [1, 2, 3]\ny = [1, 2, 3]\nz ="
    want = plain.complete(prompt=[prompt], max_tokens=20)
    chunks = sse(url, "/completion", {"prompt": prompt, "n_predict": 20, "temperature": 0, "stream": True,
                                      "timings_per_token": True})
    assert "".join(c["content"] for c in chunks) == want.text
    assert all(c["stop"] is False and "timings" in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["stop"] is True and last["tokens_predicted"] == 20 and last["timings"]["draft_n"] > 0


def test_completion_takes_token_ids_and_mixed_prompts(url, plain):
    ids = plain.prepare(["Hello world"]).ids
    want = plain.complete(prompt=ids, max_tokens=8)
    assert post(url, "/completion", {"prompt": ids, "n_predict": 8, "temperature": 0}).json()["content"] == want.text
    mixed = [ids[0], " again"]
    want = plain.complete(prompt=mixed, max_tokens=8)
    assert post(url, "/completion", {"prompt": mixed, "n_predict": 8, "temperature": 0}).json()["content"] == \
        want.text
    r = post(url, "/completion", {"prompt": [10**7], "n_predict": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_completion_stop_words(url, plain):
    prompt = "a b c d e f g"
    text = plain.complete(prompt=[prompt], max_tokens=30).text
    word = text[5:7]
    body = post(url, "/completion", {"prompt": prompt, "n_predict": 30, "temperature": 0, "stop": [word]}).json()
    assert body["stop_type"] == "word" and body["stopping_word"] == word
    assert body["content"] == text[:text.index(word)]


# -- /infill --------------------------------------------------------------------------------------------------------

def fim_ids(engine, prefix, suffix, extra):
    """llama-server's infill layout, written out independently of the server's code."""
    fim = engine.target.fim

    def tok(text):
        return engine.target.tokenize(text, False, False)

    ids = [fim["rep"], *tok("myproject\n")]
    for name, text in extra:
        ids += [fim["sep"], *tok(name + "\n"), *tok(text)]
    ids += [fim["sep"], *tok("filename\n")]
    return [*ids, fim["pre"], *tok(prefix), fim["suf"], *tok(suffix), fim["mid"]]


def test_infill_builds_the_fim_prompt_and_equals_plain_decoding(url, plain):
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    extra = [("util.py", "def helper():\n    pass\n")]
    want = plain.complete(prompt=fim_ids(plain, prefix, suffix, extra), max_tokens=16)
    body = {"input_prefix": prefix, "input_suffix": suffix,
            "input_extra": [{"filename": n, "text": t} for n, t in extra], "n_predict": 16, "temperature": 0}
    r = post(url, "/infill", body)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == want.text and r.json()["timings"]["draft_n"] > 0
    chunks = sse(url, "/infill", body | {"stream": True})
    assert "".join(c["content"] for c in chunks) == want.text and chunks[-1]["stop"] is True


def test_infill_without_fim_tokens_says_so(tiny_target):
    engine = Engine(tiny_target, n_ctx=256)
    s = ServerThread(create_app(lambda: engine, "tiny"))
    try:
        s.wait_healthy()
        r = httpx.post(s.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert "fill-in-the-middle" in err["message"] and err["type"] == "not_supported_error"
        r = httpx.post(s.url + "/infill", json={"input_prefix": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
    finally:
        s.stop()


# -- every POST endpoint as `curl -d` sends it ------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "hi", "n_predict": 2}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/tokenize", {"content": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_form_typed_json_body_is_read_as_json(url, path, body):
    r = httpx.post(url + path, content=json.dumps(body), timeout=120,
                   headers=H | {"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


# -- Anthropic's Messages API ------------------------------------------------------------------------------------------

SYSTEM = "You are terse."
ASK_TEXT = "Write a function that adds two numbers."


def test_messages_with_the_anthropic_client(url, plain):
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    want = plain.complete(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK_TEXT}],
                          max_tokens=24)
    # the SDK of late 2026 has no temperature (Anthropic's models sample): sent as an extra field, as clients do
    greedy = {"extra_body": {"temperature": 0}}
    r = client.messages.create(model="fim", system=SYSTEM, max_tokens=24, **greedy,
                               messages=[{"role": "user", "content": [{"type": "text", "text": ASK_TEXT}]}])
    assert r.type == "message" and r.role == "assistant" and r.model == "fim"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.stop_reason in ("max_tokens", "end_turn") and r.usage.output_tokens == want.summary.n_generated
    with client.messages.stream(model="fim", system=SYSTEM, max_tokens=24, **greedy,
                                messages=[{"role": "user", "content": ASK_TEXT}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.text and final.content[0].text == want.text
    assert final.stop_reason == r.stop_reason
    n = client.messages.count_tokens(model="fim", system=SYSTEM, messages=[{"role": "user", "content": ASK_TEXT}])
    assert n.input_tokens == want.summary.n_prompt


def test_messages_stop_sequences_and_errors(url, plain):
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    text = plain.complete(messages=[{"role": "user", "content": ASK_TEXT}], max_tokens=30).text
    word = text[6:8]
    r = client.messages.create(model="fim", max_tokens=30, extra_body={"temperature": 0}, stop_sequences=[word],
                               messages=[{"role": "user", "content": ASK_TEXT}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == text[:text.index(word)]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="fim", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["param"] == "messages.0.content.0"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="fim", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def planted(tiny_target, tiny_drafter):
    """A server whose answers are planted (planted.py): tool calls the tiny models never write."""
    from planted import PlantedEngine
    from test_server_tools import QWEN35

    engine = PlantedEngine(Engine(tiny_target, tiny_drafter, n_ctx=1024, chat_template=QWEN35))
    s = ServerThread(create_app(lambda: engine, "tiny"))
    s.wait_healthy()
    s.engine = engine
    yield s
    s.stop()


def test_messages_tool_use_round_trip(planted):
    import anthropic
    from planted import cut
    from test_server_tools import CALL_OUTPUT, WEATHER

    client = anthropic.Anthropic(base_url=planted.url, api_key="none", max_retries=0)
    fn = WEATHER["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    planted.engine.pieces = cut(CALL_OUTPUT, 3)
    r = client.messages.create(model="tiny", max_tokens=64, tools=tools, messages=ask)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    call = r.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert '"name": "get_weather"' in planted.engine.last_prompt()
    # streamed: the same blocks, the call's input as JSON deltas
    planted.engine.pieces = cut(CALL_OUTPUT, 4)
    with client.messages.stream(model="tiny", max_tokens=64, tools=tools, messages=ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    # the call and its result go back to the model as its template writes them
    planted.engine.pieces = ["Warm.\n</think>\n\nIt is 21 °C in Paris."]
    msgs = ask + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": '{"temp": 21}'}]}]
    r = client.messages.create(model="tiny", max_tokens=64, tools=tools, messages=msgs)
    assert r.stop_reason == "end_turn" and r.content[-1].text == "It is 21 °C in Paris."
    assert planted.engine.last_prompt().endswith(
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n')


# -- OpenAI's Responses API ------------------------------------------------------------------------------------------

def test_responses_with_the_openai_client(url, plain):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    want = plain.complete(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK_TEXT}],
                          max_tokens=24)
    r = client.responses.create(model="fim", instructions=SYSTEM, input=ASK_TEXT, max_output_tokens=24,
                                temperature=0)
    assert r.object == "response" and r.output_text == want.text
    assert r.status == ("incomplete" if want.summary.finish_reason == "length" else "completed")
    assert r.usage.output_tokens == want.summary.n_generated and r.usage.input_tokens == want.summary.n_prompt
    # the same as items, streamed
    items = [{"role": "system", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK_TEXT}]}]
    events = list(client.responses.create(model="fim", input=items, max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == want.text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fim", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"


def test_responses_function_calls_round_trip(planted):
    import openai
    from planted import cut
    from test_server_tools import CALL_OUTPUT, WEATHER

    client = openai.OpenAI(base_url=planted.url + "/v1", api_key="none", max_retries=0)
    fn = WEATHER["function"]
    tools = [{"type": "function", "name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}]
    planted.engine.pieces = cut(CALL_OUTPUT, 3)
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=64)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # streamed, with the SDK's own event accumulation
    planted.engine.pieces = cut(CALL_OUTPUT, 5)
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=64) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    # the call and its output go back as items
    planted.engine.pieces = ["Warm.\n</think>\n\nIt is 21 °C in Paris."]
    items = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    r = client.responses.create(model="tiny", input=items, tools=tools, max_output_tokens=64)
    assert r.output_text == "It is 21 °C in Paris."
    assert planted.engine.last_prompt().endswith(
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n')


# -- the chat page ---------------------------------------------------------------------------------------------------

def test_chat_page_streams_in_a_real_browser(fim_pair):
    import shutil

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    engine = Engine(*fim_pair, n_ctx=1024)
    s = ServerThread(create_app(lambda: engine, "fim", api_key=KEY, n_predict=300))
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(chromedriver), options=opts)
    try:
        s.wait_healthy()
        page = httpx.get(s.url + "/")
        assert page.status_code == 200 and "<script>" in page.text and "http" not in page.text.split("<script>")[1]
        browser.get(s.url + "/")
        wait = WebDriverWait(browser, 60, poll_frequency=0.02)
        # the server has a key: the page asks for it, then shows the model
        wait.until(lambda b: b.find_element(By.ID, "key-form").is_displayed())
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "key-save").click()
        wait.until(lambda b: b.find_element(By.ID, "model").text == "fim")
        temperature = browser.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        # every change of the answer and of the figures, recorded in the page as it happens (polling from here is
        # too slow for a tiny model's 300 tokens)
        browser.execute_script("""
            window.seen = [];
            new MutationObserver(() => {
                const answer = [...document.querySelectorAll('.msg.assistant')].pop();
                const stats = document.getElementById('stats').textContent;
                window.seen.push([answer ? answer.textContent.length : 0, stats]);
            }).observe(document.body, {subtree: true, childList: true, characterData: true});""")
        browser.find_element(By.ID, "prompt").send_keys("hi\n")

        def finished(b):
            stats = b.find_element(By.ID, "stats").text
            return b.find_elements(By.CSS_SELECTOR, ".msg.assistant") and stats and not stats.endswith("...")

        wait.until(finished)
        seen = browser.execute_script("return window.seen")
        # the text as the page set it (Selenium's .text is the rendering, blanks folded)
        answer = browser.execute_script("return [...document.querySelectorAll('.msg.assistant')].pop().textContent")
        stats = browser.find_element(By.ID, "stats").text
        want = Engine(fim_pair[0], n_ctx=1024).complete(messages=[{"role": "user", "content": "hi"}], max_tokens=300)
        assert want.summary.n_generated == 300 and answer == want.text
        assert "300 tokens" in stats and "tokens/s" in stats and "drafts accepted" in stats and "tokens a step" in stats
        # tokens came in while it ran, with the figures so far beside them
        assert len({n for n, stats in seen if stats.endswith("...") and 0 < n < len(answer)}) >= 2, seen
        assert any("tokens/s" in stats and stats.endswith("...") for _, stats in seen)
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    finally:
        browser.quit()
        s.stop()
