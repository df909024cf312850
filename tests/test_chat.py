"""Chat templates as frontends send them: the Jinja environment (tests/templates/ are written in the manner of the
Qwen3, Gemma, Llama 3.1 and gpt-oss templates), template variables, --chat-template-file and the fallbacks."""

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from fixtures import write_tiny_target

from dflash_local import Engine
from dflash_local.chat.templates import ChatTemplateError, read_template, render

TEMPLATES = Path(__file__).parent / "templates"
QWEN3 = read_template(TEMPLATES / "qwen3-like.jinja")
GEMMA = read_template(TEMPLATES / "gemma-like.jinja")
LLAMA31 = read_template(TEMPLATES / "llama31-like.jinja")
GPT_OSS = read_template(TEMPLATES / "gpt-oss-like.jinja")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            },
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dflash_local", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


# -- the templates --------------------------------------------------------------------------------------------------


def test_qwen3_like_renders_tools_tool_calls_and_responses():
    prompt = render(TOOL_CONVERSATION, QWEN3, "qwen3", variables={"tools": [WEATHER]})
    assert prompt == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)  # tojson as HF's: no HTML escaping, non-ASCII kept
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_qwen3_like_enable_thinking_and_reasoning_after_the_last_query():
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
    ]
    turns = (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"  # thinking before the query dropped
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(msgs, QWEN3, "qwen3") == turns
    assert render(msgs, QWEN3, "qwen3", variables={"enable_thinking": True}) == turns
    assert render(msgs, QWEN3, "qwen3", variables={"enable_thinking": False}) == turns + "<think>\n\n</think>\n\n"
    with pytest.raises(ChatTemplateError, match="Unexpected message role: narrator"):
        render([{"role": "narrator", "content": "x"}], QWEN3, "qwen3")


def test_tojson_takes_the_arguments_of_hfs():
    value = {"b": [1, 2], "a": "é <tag> & 'q'"}
    template = ("{{ v | tojson }}\n{{ v | tojson(indent=2) }}\n{{ v | tojson(ensure_ascii=true) }}\n"
                "{{ v | tojson(separators=(',', ':')) }}\n{{ v | tojson(sort_keys=true) }}")
    out = render([{"role": "user", "content": "x"}], template, "qwen3", variables={"v": value})
    expected = "\n".join([
        json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2), json.dumps(value),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        json.dumps(value, ensure_ascii=False, sort_keys=True),
    ])
    assert out == expected
    assert '"a": "é <tag> & \'q\'"' in expected  # jinja's own tojson would have escaped these for HTML


def test_gemma_like_refuses_bad_roles_with_the_templates_message():
    msgs = [
        {"role": "system", "content": "Be brief. "},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    today = datetime.now().strftime("%d %B %Y")
    assert render(msgs, GEMMA, "gemma3", "<bos>", "<eos>") == (
        f"<bos><start_of_turn>user\nToday is {today}.\n\nBe brief.\n\nAnswer in English.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    bad = {
        "Conversation roles must alternate user/assistant/user/assistant/...": [
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        "System messages must come before the conversation": [
            {"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
        "The conversation needs a user message after the system messages": [{"role": "system", "content": "a"}],
    }
    for message, msgs in bad.items():
        with pytest.raises(ChatTemplateError) as e:
            render(msgs, GEMMA, "gemma3")
        assert str(e.value) == "the chat template refused the messages: " + message


def test_llama31_like_dates_tools_and_tool_calls():
    today = datetime.now().strftime("%d %b %Y")
    prompt = render(TOOL_CONVERSATION, LLAMA31, "llama", "<|begin_of_text|>", variables={"tools": [WEATHER]})
    assert prompt.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {today}\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions"
    )
    assert "\n\n" + json.dumps(WEATHER, indent=4, ensure_ascii=False) + "\n\nWeather in Zürich?<|eot_id|>" in prompt
    assert prompt.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Zürich"}}'
        '<|eom_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # template variables: a fixed date, tools in the system message
    fixed = render(TOOL_CONVERSATION[:2], LLAMA31, "llama",
                   variables={"tools": [WEATHER], "date_string": "26 Jul 2024", "tools_in_user_message": False})
    assert "Today Date: 26 Jul 2024\n\nYou have access to the following functions." in fixed
    assert fixed.endswith("<|start_header_id|>user<|end_header_id|>\n\nWeather in Zürich?<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ChatTemplateError, match="Cannot put tools in the first user message"):
        render(TOOL_CONVERSATION[:1], LLAMA31, "llama", variables={"tools": [WEATHER]})
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}]
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        render(two_calls, LLAMA31, "llama")


def test_gpt_oss_like_loop_controls_and_reasoning_effort():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "add them"},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "thinking": "call the tool",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Zürich"}}}]},
        {"role": "tool", "name": "get_weather", "content": '{"temp": 21}'},
    ]
    prompt = render(msgs, GPT_OSS, "gpt-oss", variables={"tools": [WEATHER], "reasoning_effort": "low"})
    date = datetime.now().strftime("%Y-%m-%d")
    assert prompt == (
        "<|start|>system<|message|>You are a helpful assistant.\nKnowledge cutoff: 2024-06\n"
        f"Current date: {date}\n\nReasoning: low\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Current weather in a city\ntype get_weather = (_: {\n"
        '// the city, e.g. Zürich\ncity: string,\nunit?: "c" | "f", // default: "c"\n}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>2+2?<|end|>"  # the system message was skipped here ({% continue %})
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"  # thinking before the last user message dropped
        "<|start|>user<|message|>Weather in Zürich?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>call the tool<|end|>"  # found with {% break %}
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Zürich","unit":"c"}'
        '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
        "<|start|>assistant"
    )
    with pytest.raises(ChatTemplateError, match="not in the content with channel tags"):
        render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "<|channel|>analysis"}],
               GPT_OSS, "gpt-oss")


# -- errors ---------------------------------------------------------------------------------------------------------


def test_broken_and_unreadable_template_files_are_clear_errors(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content | }}\n{% endfor %}\n")
    with pytest.raises(ChatTemplateError, match=r"broken.jinja: the chat template has a syntax error on line 2: "
                                                r"expected token 'name', got 'end of print statement'"):
        read_template(broken)
    with pytest.raises(ChatTemplateError, match="cannot read the chat template .*missing.jinja: No such file"):
        read_template(tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="cannot read the chat template .*: Is a directory"):
        read_template(tmp_path)
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(ChatTemplateError, match="cannot read the chat template .*latin1.jinja: 'utf-8' codec"):
        read_template(latin1)


def test_template_errors_are_chat_template_errors():
    msgs = [{"role": "user", "content": "x"}]
    cases = {
        "{{ messages.append(1) }}": "the chat template failed: SecurityError: .*unsafe",  # sandboxed: no mutation
        "{{ 1 + 'a' }}": "the chat template failed: TypeError",
        "{{ messages[0].content.nope() }}": "the chat template failed: UndefinedError",
        "{{ raise_exception('line one\nline two') }}": "refused the messages: line one line two$",  # one line
    }
    for template, message in cases.items():
        with pytest.raises(ChatTemplateError, match=message):
            render(msgs, template, "qwen3")


def test_tools_and_variables_are_never_dropped_silently():
    msgs = [{"role": "user", "content": "x"}]
    chatml = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render tools"):
        render(msgs, chatml, "qwen3", variables={"tools": [WEATHER]})
    with pytest.raises(ChatTemplateError, match="no chat template to render tools"):
        render(msgs, None, "gemma3", variables={"tools": [WEATHER]})
    with pytest.raises(ChatTemplateError, match="cannot replace 'messages'"):
        render(msgs, QWEN3, "qwen3", variables={"messages": []})
    assert render(msgs, "{{ add_generation_prompt }}", "qwen3") == "True"
    assert render(msgs, "{{ add_generation_prompt }}", "qwen3", variables={"add_generation_prompt": False}) == "False"


def test_fallbacks_without_a_template():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(msgs, None, "qwen3") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(msgs, None, "gemma3") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="'llama' model has no chat template.*--chat-template-file"):
        render(msgs, None, "llama")


# -- the engine -----------------------------------------------------------------------------------------------------


def test_chatml_fallback_on_a_gguf_without_a_template(tmp_path, tiny_engine):
    path = write_tiny_target(tmp_path / "no-template.gguf", chat_template=None)
    engine = Engine(path, n_ctx=512)
    assert engine.chat_template is None and engine.target_info.kv.get("tokenizer.chat_template") is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.chat_prompt(msgs) == prompt == tiny_engine.chat_prompt(msgs)  # the same as the GGUF's template
    ids = engine.prompt_tokens(messages=msgs)
    im_start, im_end = (engine.target.tokenize(t, False, True) for t in ("<|im_start|>", "<|im_end|>"))
    assert len(im_start) == len(im_end) == 1 and ids.count(im_start[0]) == 3 and ids.count(im_end[0]) == 2
    r = engine.complete(messages=msgs, max_tokens=8)
    assert r.summary.n_prompt == len(ids) and r.summary.n_generated >= 1


def test_engine_template_override_kwargs_and_control_token_strings(tiny_target):
    engine = Engine(tiny_target, n_ctx=512, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": False})
    msgs = [{"role": "user", "content": "Hi"}]
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.chat_prompt(msgs) == base + "<think>\n\n</think>\n\n"  # the engine's default kwargs
    assert engine.chat_prompt(msgs, {"enable_thinking": True}) == base  # a call's kwargs go over them
    assert engine.chat_prompt(msgs, {"tools": [WEATHER]}).startswith("<|im_start|>system\n# Tools")
    r = engine.complete(messages=msgs, chat_template_kwargs={"enable_thinking": True}, max_tokens=4)
    assert r.summary.n_prompt == len(engine.tokenize(base, special=True))
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        engine.chat_prompt(msgs, ["enable_thinking"])
    tokens = Engine(tiny_target, n_ctx=512, chat_template="{{ bos_token }}|{{ eos_token }}")
    assert tokens.chat_prompt(msgs) == "<|endoftext|>|<|endoftext|>"  # control tokens' text, not ''


def test_gemma_bos_and_eos_are_the_control_token_strings(gemma_target):
    engine = Engine(gemma_target, n_ctx=256, chat_template="{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}")
    assert engine.chat_prompt([{"role": "user", "content": "hi"}]) == "<bos>|<eos>|hi"


# -- the command line -----------------------------------------------------------------------------------------------


def test_generate_with_a_chat_template_file_on_gemma(gemma_engine, gemma_target, gemma_drafter, tmp_path):
    """The template uses strftime_now, {% break %} and raise_exception (for roles out of order)."""
    r = cli("generate", "-m", gemma_target, "-d", gemma_drafter, "--chat", "--system", "Answer briefly.", "-p",
            "What is 2+2?", "-n", "8", "--json", "--chat-template-file", TEMPLATES / "gemma-like.jinja", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    expected = render(msgs, GEMMA, "gemma3", "<bos>", "<eos>")
    assert expected.startswith("<bos><start_of_turn>user\nToday is ")
    assert out["n_prompt"] == len(gemma_engine.tokenize(expected, special=True))
    assert out["n_prompt"] != len(gemma_engine.prompt_tokens(messages=msgs))  # not the built-in gemma format
    assert 1 <= len(out["token_ids"]) <= 8 and out["steps"] > 0

    refusing = tmp_path / "refusing.jinja"
    refusing.write_text("{% if messages[0]['role'] == 'system' %}"
                        "{{ raise_exception('This model takes no system message') }}{% endif %}")
    r = cli("generate", "-m", gemma_target, "--no-draft", "--chat", "--system", "x", "-p", "y",
            "--chat-template-file", refusing, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (
        "dflash-local: error: the chat template refused the messages: This model takes no system message"
    )
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "tui"])
def test_bad_chat_options_fail_at_startup(command, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if messages %}")
    r = cli(command, "--chat-template-file", broken)
    assert r.returncode == 2 and "argument --chat-template-file: " in r.stderr and "syntax error on line 1" in r.stderr
    r = cli(command, "--chat-template-file", tmp_path / "missing.jinja")
    assert r.returncode == 2 and "cannot read the chat template" in r.stderr and "No such file" in r.stderr
    r = cli(command, "--chat-template-kwargs", '["enable_thinking"]')
    assert r.returncode == 2 and "argument --chat-template-kwargs: must be a JSON object" in r.stderr
    r = cli(command, "--chat-template-kwargs", "{enable_thinking: false}")
    assert r.returncode == 2 and "argument --chat-template-kwargs: not valid JSON" in r.stderr
    assert "Traceback" not in r.stderr


def test_template_options_need_chat(tmp_path):
    r = cli("generate", "-p", "x", "--chat-template-kwargs", '{"enable_thinking": false}', cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "dflash-local: error: --chat-template-file and --chat-template-kwargs apply to chat messages: add --chat"
    )
