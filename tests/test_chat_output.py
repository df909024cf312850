"""Reading a chat model's output: reasoning apart from the answer, and tool calls, whole and streamed in arbitrary
pieces. The outputs are what the templates in tests/templates/ write for an assistant turn (what the models are
trained to produce), cut where the generation prompt ends and the end-of-generation token begins."""

import json
import random
from pathlib import Path

import pytest

from dflash_local.chat import tool_calls
from dflash_local.chat.templates import read_template, render
from dflash_local.chat.output import Stream, finish, syntax_for
from dflash_local.chat.reasoning import budget_kwargs
from dflash_local.chat.tool_calls import ToolChoiceError

TEMPLATES = Path(__file__).parent / "templates"
QWEN35 = read_template(TEMPLATES / "qwen35-like.jinja")
QWEN3 = read_template(TEMPLATES / "qwen3-like.jinja")
LLAMA31 = read_template(TEMPLATES / "llama31-like.jinja")
GPT_OSS = read_template(TEMPLATES / "gpt-oss-like.jinja")
GEMMA = read_template(TEMPLATES / "gemma-like.jinja")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"},
                                                "units": {"type": "object"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
USER = {"role": "user", "content": "Weather in Zürich?"}


def call(name, args, id_="call_1"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def assistant_output(template, arch, message):
    """The prompt for USER, and what the model writes after it for `message`: the template's rendering of the
    assistant turn past the generation prompt, up to the template's next turn."""
    prompt = render([USER], template, arch, variables={"tools": TOOLS})
    full = render(tool_calls.template_messages([USER, message]), template, arch, variables={"tools": TOOLS})
    assert full.startswith(prompt)
    return prompt, full[len(prompt):]


def stream_all(syntax, text, pieces):
    s, deltas, i = Stream(syntax), [], 0
    for n in pieces:
        deltas += s.feed(text[i:i + n])
        i += n
    deltas += s.feed(text[i:])
    deltas += s.close()
    return deltas


def joined(deltas, key):
    return "".join(d.get(key, "") for d in deltas)


def splits(text, seed):
    """Cuts of `text` into pieces: one character each, fixed sizes, and random sizes."""
    rng = random.Random(seed)
    yield [1] * len(text)
    for n in (2, 3, 5, 7):
        yield [n] * (len(text) // n)
    yield [rng.randint(1, 9) for _ in range(len(text) // 3)]


def check_streams_agree(syntax, text):
    """Every cut of the text streams the same message as the whole text parses to."""
    whole = finish(syntax, text)
    for i, pieces in enumerate(splits(text, 0)):
        deltas = stream_all(syntax, text, pieces)
        assert joined(deltas, "reasoning_content") == whole.reasoning, pieces
        assert joined(deltas, "content") == whole.content, pieces
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(j, c.name, c.arguments) for j, c in enumerate(whole.calls)]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return whole


# -- reasoning ------------------------------------------------------------------------------------------------------


def test_qwen35_output_starts_inside_the_thinking_the_prompt_opened():
    prompt = render([USER], QWEN35, "qwen35")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    text = "The user asks about Zürich.\nI know it.\n</think>\n\nIt is sunny in Zürich."
    syntax = syntax_for(QWEN35, prompt, "auto", None, None)
    assert syntax.inside and syntax.tools is None
    msg = check_streams_agree(syntax, text)
    assert msg.reasoning == "The user asks about Zürich.\nI know it." and msg.content == "It is sunny in Zürich."
    assert msg.wire() == {"role": "assistant", "content": "It is sunny in Zürich.",
                          "reasoning_content": "The user asks about Zürich.\nI know it."}
    # thinking off: the prompt closes the block, the output is the answer
    off = render([USER], QWEN35, "qwen35", variables={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    assert finish(syntax_for(QWEN35, off, "auto", None, None), "It is sunny.").wire() == \
        {"role": "assistant", "content": "It is sunny."}
    # cut short while thinking: all of it is reasoning
    assert finish(syntax, "Still thinking about").reasoning == "Still thinking about"


def test_think_block_the_model_opens_itself_and_format_none():
    prompt = render([USER], QWEN3, "qwen3")
    syntax = syntax_for(QWEN3, prompt, "auto", None, None)
    assert not syntax.inside
    msg = check_streams_agree(syntax, "<think>\nweather, so sun\n</think>\n\nSunny.")
    assert (msg.reasoning, msg.content) == ("weather, so sun", "Sunny.")
    msg = check_streams_agree(syntax, "No thinking <think> here.")
    assert (msg.reasoning, msg.content) == ("", "No thinking <think> here.")
    raw = "<think>\nweather\n</think>\n\nSunny."
    none = syntax_for(QWEN3, prompt, "none", None, None)
    assert check_streams_agree(none, raw).content == raw
    legacy = check_streams_agree(syntax_for(QWEN3, prompt, "deepseek-legacy", None, None), raw)
    assert (legacy.reasoning, legacy.content) == ("weather", raw)
    with pytest.raises(ValueError, match="reasoning_format must be one of auto, deepseek, deepseek-legacy, none"):
        syntax_for(QWEN3, prompt, "deepseek-v2", None, None)


def test_a_stream_holds_back_a_tag_cut_across_pieces():
    syntax = syntax_for(QWEN3, "", "auto", None, None)
    s = Stream(syntax)
    assert s.feed("<th") == []  # may be the start tag
    assert s.feed("ink>Hm") == [{"reasoning_content": "Hm"}]
    assert s.feed("m </thi") == [{"reasoning_content": "m"}]  # trailing blanks and a partial end tag wait
    assert s.feed("nk>\n\nYes") == [{"content": "Yes"}]
    assert s.feed(" <") == [{"content": " <"}]  # no tag to wait for in the answer
    assert s.close() == []


def test_gpt_oss_analysis_channel_is_the_reasoning():
    prompt = render([USER], GPT_OSS, "gpt-oss")
    assert prompt.endswith("<|start|>assistant")
    text = "<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    syntax = syntax_for(GPT_OSS, prompt, "auto", None, None)
    assert syntax.reasoning == "harmony" and "<|channel|>" in syntax.preserved
    msg = check_streams_agree(syntax, text)
    assert (msg.reasoning, msg.content) == ("Simple question.", "Sunny.")
    none = check_streams_agree(syntax_for(GPT_OSS, prompt, "none", None, None), text)
    assert (none.reasoning, none.content) == ("", text)
    legacy = check_streams_agree(syntax_for(GPT_OSS, prompt, "deepseek-legacy", None, None), text)
    assert (legacy.reasoning, legacy.content) == ("Simple question.", text)


def test_reasoning_budget_follows_llama_server():
    assert budget_kwargs(-1) == {} and budget_kwargs(None) == {}
    assert budget_kwargs(0) == {"enable_thinking": False}
    with pytest.raises(ValueError, match="reasoning budget 512 is not supported"):
        budget_kwargs(512)


# -- tool calls -----------------------------------------------------------------------------------------------------


def test_formats_are_found_from_the_template():
    assert [tool_calls.detect(t) for t in (QWEN35, QWEN3, LLAMA31, GPT_OSS, GEMMA, None)] == \
        ["qwen3-coder", "hermes", "llama3", "harmony", None, None]
    gemma4 = "{{- '<|tool_call>call:' + tool_call.function.name -}}"
    assert tool_calls.detect(gemma4) == "gemma4"


def test_qwen35_xml_calls_as_its_template_writes_them():
    msg = {"role": "assistant", "content": "Let me look.", "reasoning_content": "Needs the tool.",
           "tool_calls": [call("get_weather", {"city": "Zürich", "days": 3, "units": {"t": "c"}}),
                          call("get_time", {"city": "Zürich"}, "call_2")]}
    prompt, turn = assistant_output(QWEN35, "qwen35", msg)
    assert turn.startswith("Needs the tool.\n</think>\n\nLet me look.\n\n<tool_call>")  # the prompt opened <think>
    text = turn[:turn.index("<|im_end|>")]
    assert "<parameter=days>\n3\n</parameter>" in text and '<parameter=units>\n{"t": "c"}\n</parameter>' in text
    syntax = syntax_for(QWEN35, prompt, "auto", TOOLS, None)
    assert syntax.tools == "qwen3-coder" and syntax.inside
    msg = check_streams_agree(syntax, text)
    assert (msg.reasoning, msg.content) == ("Needs the tool.", "Let me look.")
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == [
        ("get_weather", {"city": "Zürich", "days": 3, "units": {"t": "c"}}), ("get_time", {"city": "Zürich"})]
    assert msg.wire()["tool_calls"][0]["type"] == "function"
    # a string parameter stays a string even when it reads as JSON
    out = finish(syntax, "x</think><tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
                         "</function>\n</tool_call>")
    assert json.loads(out.calls[0].arguments) == {"city": "42"}
    # cut short inside a call (max_tokens): no call, the text stays in the content
    cut_short = finish(syntax, "x</think><tool_call>\n<function=get_weather>\n<parameter=city>\nZür")
    assert cut_short.calls == [] and cut_short.content.startswith("<tool_call>\n<function=get_weather>")


def test_hermes_calls_as_the_qwen3_template_writes_them():
    msg = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Zürich"})]}
    prompt, turn = assistant_output(QWEN3, "qwen3", msg)
    text = turn[:turn.index("<|im_end|>")]
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    syntax = syntax_for(QWEN3, prompt, "auto", TOOLS, None)
    out = check_streams_agree(syntax, "<think>\nuse the tool\n</think>\n\n" + text + "\n" + text)
    assert out.reasoning == "use the tool" and out.content == ""
    assert [c.name for c in out.calls] == ["get_weather", "get_weather"]
    assert out.wire()["content"] is None and len({c.id for c in out.calls}) == 2
    # not JSON inside the tags: left in the content as it came
    bad = check_streams_agree(syntax, "Sure: <tool_call>get_weather(Zürich)</tool_call> done")
    assert bad.calls == [] and bad.content == "Sure: <tool_call>get_weather(Zürich)</tool_call> done"


def test_llama31_json_calls_as_its_template_writes_them():
    msg = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Zürich"})]}
    prompt, turn = assistant_output(LLAMA31, "llama", msg)
    text = turn[:turn.index("<|eom_id|>")]
    assert text == '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
    syntax = syntax_for(LLAMA31, prompt, "auto", TOOLS, None)
    assert syntax.tools == "llama3" and "<|python_tag|>" in syntax.preserved
    out = check_streams_agree(syntax, text)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Zürich"})]
    assert check_streams_agree(syntax, "<|python_tag|>" + text).calls[0].name == "get_weather"
    plain = check_streams_agree(syntax, '{"not": "a call"} and more')
    assert plain.calls == [] and plain.content == '{"not": "a call"} and more'
    assert check_streams_agree(syntax, "It is sunny.").content == "It is sunny."


def test_gpt_oss_calls_as_its_template_writes_them():
    msg = {"role": "assistant", "content": "", "thinking": "call the tool",
           "tool_calls": [call("get_weather", {"city": "Zürich"})]}
    prompt, turn = assistant_output(GPT_OSS, "gpt-oss", msg)
    text = turn[:turn.index("<|call|>")]
    assert text == ('<|channel|>analysis<|message|>call the tool<|end|><|start|>assistant to=functions.get_weather'
                    '<|channel|>commentary json<|message|>{"city":"Zürich"}')
    syntax = syntax_for(GPT_OSS, prompt, "auto", TOOLS, None)
    out = check_streams_agree(syntax, text)
    assert out.reasoning == "call the tool" and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Zürich"})]
    # the recipient after the channel, as gpt-oss also writes it
    other = ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
             '{"city": "Bern"}')
    assert check_streams_agree(syntax, other).calls[0].name == "get_time"


def test_gemma4_calls():
    template = "{{ messages }}{{ tools }}{{- '<|tool_call>call:' -}}<|channel>thought"
    syntax = syntax_for(template, "<start_of_turn>model\n", "auto", TOOLS, None)
    assert syntax.tools == "gemma4" and syntax.tags == ("<|channel>thought", "<channel|>")
    assert {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>"} <= set(syntax.preserved)
    text = ('<|channel>thought\nThe tool knows.<channel|><|tool_call>call:get_weather{city:<|"|>Zürich, CH<|"|>,'
            'days:3,units:{t:<|"|>c<|"|>,list:[1,-2.5,true,null]}}<tool_call|>')
    out = check_streams_agree(syntax, text)
    assert out.reasoning == "The tool knows."
    assert json.loads(out.calls[0].arguments) == {"city": "Zürich, CH", "days": 3,
                                                  "units": {"t": "c", "list": [1, -2.5, True, None]}}


def test_tool_choice():
    prompt = render([USER], QWEN3, "qwen3", variables={"tools": TOOLS})
    text = '<tool_call>{"name": "get_time", "arguments": {"city": "Bern"}}</tool_call>'
    two = text + text.replace("Bern", "Chur")
    auto = syntax_for(QWEN3, prompt, "auto", TOOLS, "auto")
    assert [json.loads(c.arguments)["city"] for c in finish(auto, two).calls] == ["Bern", "Chur"]
    single = syntax_for(QWEN3, prompt, "auto", TOOLS, "auto", parallel=False)
    assert [json.loads(c.arguments)["city"] for c in check_streams_agree(single, two).calls] == ["Bern"]
    named = syntax_for(QWEN3, prompt, "auto", TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert finish(named, text).calls[0].name == "get_time"
    with pytest.raises(ToolChoiceError, match="required a call to 'get_weather' but the model called 'get_time'"):
        finish(syntax_for(QWEN3, prompt, "auto", TOOLS, {"type": "function", "function": {"name": "get_weather"}}),
               text)
    required = syntax_for(QWEN3, prompt, "auto", TOOLS, "required")
    with pytest.raises(ToolChoiceError, match="'required' but the model called no tool"):
        finish(required, "It is sunny.")
    with pytest.raises(ToolChoiceError):
        Stream(required).close()
    none = syntax_for(QWEN3, prompt, "auto", TOOLS, "none")
    assert finish(none, text).calls == [] and finish(none, text).content == text
    # requests that cannot be served
    for choice, message in [("sometimes", "tool_choice must be"),
                            ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not in tools")]:
        with pytest.raises(ValueError, match=message):
            syntax_for(QWEN3, prompt, "auto", TOOLS, choice)
    with pytest.raises(ValueError, match="needs tools"):
        syntax_for(QWEN3, prompt, "auto", None, "required")
    with pytest.raises(ValueError, match="no tool-call format dflash-local can read"):
        syntax_for("{{ tools }}{{ messages }}", prompt, "auto", TOOLS, None)
    assert syntax_for("{{ tools }}{{ messages }}", prompt, "auto", TOOLS, "none").tools is None


def test_messages_are_handed_to_templates_as_llama_cpp_does():
    msgs = [USER, {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Zürich"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    out = tool_calls.template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert out[2]["name"] == "get_weather"
    # gpt-oss's template reads an earlier answer's reasoning as `thinking`
    thought = tool_calls.template_messages([{"role": "assistant", "content": "4", "reasoning_content": "add"}])
    assert thought[0]["thinking"] == "add"
    assert "<|start|>assistant<|channel|>analysis<|message|>add<|end|>" in render(
        tool_calls.template_messages([USER, {"role": "assistant", "content": "4", "reasoning_content": "add"}]),
        GPT_OSS, "gpt-oss")
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Z\\u00fcrich"}'  # the caller's untouched
