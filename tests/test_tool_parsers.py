"""Tool-call parsers on real-format text of every family: whole answers, several calls, text around them, malformed
calls read as content, and streams in random chunkings adding up to the whole answer."""
from __future__ import annotations

import json
import random

import pytest

from kestrel.server.tool_parsers import PARSERS, parser_class
from kestrel.server.tool_parsers.forced import NamedParser, RequiredParser
from kestrel.server.tool_parsers.stream import ToolCallStream

WEATHER = {"city": "Paris", "days": 3, "units": ["c", "f"], "note": "a \"quoted\" ; <tag> } ]"}
WEATHER_JSON = json.dumps(WEATHER)
TIME_JSON = json.dumps({"tz": "Europe/Paris"})
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                             "units": {"type": "array"}, "note": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}}}]


def hermes_call(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def deepseek_call(name, args):
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def glm_call(name, args):
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in json.loads(args).items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


# family -> (text of one call with text before it, text of two calls, expected content of the first)
CASES = {
    "hermes": ("I'll check the weather.\n" + hermes_call("get_weather", WEATHER_JSON),
               hermes_call("get_weather", WEATHER_JSON) + "\n" + hermes_call("get_time", TIME_JSON),
               "I'll check the weather.\n"),
    "llama3_json": ("Let me look.<|python_tag|>" + f'{{"name": "get_weather", "parameters": {WEATHER_JSON}}}',
                    f'{{"name": "get_weather", "parameters": {WEATHER_JSON}}}; '
                    f'{{"name": "get_time", "parameters": {TIME_JSON}}}',
                    "Let me look."),
    "mistral": ("Sure. [TOOL_CALLS]" + f'[{{"name": "get_weather", "arguments": {WEATHER_JSON}}}]',
                f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
                f'{{"name": "get_time", "arguments": {TIME_JSON}}}]',
                "Sure. "),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜>" + deepseek_call("get_weather", WEATHER_JSON)
                    + "<｜tool▁calls▁end｜>",
                    "<｜tool▁calls▁begin｜>" + deepseek_call("get_weather", WEATHER_JSON) + "\n"
                    + deepseek_call("get_time", TIME_JSON) + "<｜tool▁calls▁end｜>",
                    "Checking."),
    "glm45": ("Checking.\n" + glm_call("get_weather", WEATHER_JSON),
              glm_call("get_weather", WEATHER_JSON) + "\n" + glm_call("get_time", TIME_JSON),
              "Checking.\n"),
}


def streamed(parser, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Feed `text` in random pieces; the content and the calls the fragments add up to, and the fragments."""
    stream = ToolCallStream(parser)
    content, calls, fragments, i = "", {}, [], 0
    while True:
        n = rng.randint(1, 12)
        piece, i = text[i:i + n], i + n
        got, frags = stream.feed(piece, final=i >= len(text))
        content += got
        fragments += frags
        for f in frags:
            if "id" in f:
                assert f["index"] == len(calls) and f["type"] == "function"
                calls[f["index"]] = [f["function"]["name"], ""]
            calls[f["index"]][1] += f["function"]["arguments"]
        if i >= len(text):
            return content, [tuple(c) for _, c in sorted(calls.items())], fragments


@pytest.mark.parametrize("family", list(CASES))
def test_one_call_after_text(family):
    text, _, content = CASES[family]
    parsed = parser_class(family)(TOOLS).parse(text)
    assert parsed.content == content
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert json.loads(parsed.calls[0].arguments) == WEATHER


@pytest.mark.parametrize("family", list(CASES))
def test_two_calls_and_no_content(family):
    _, text, _ = CASES[family]
    parsed = parser_class(family)(TOOLS).parse(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", WEATHER),
                                                                        ("get_time", json.loads(TIME_JSON))]
    ids = [c.id for c in parsed.calls]
    assert len(set(ids)) == 2
    if family == "mistral":   # Mistral's templates take back only 9 letters or digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") and len(i) > 10 for i in ids)


@pytest.mark.parametrize("family", list(CASES))
def test_plain_text_is_content(family):
    text = "The weather in Paris is mild; bring a coat {maybe}."
    parsed = parser_class(family)(TOOLS).parse(text)
    assert parsed.content == text and parsed.calls == []


MALFORMED = {
    "hermes": 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": Paris}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city" "Paris"}}]',
    "deepseek_v3": "<｜tool▁calls▁begin｜>" + deepseek_call("get_weather", '{"city": }') + "<｜tool▁calls▁end｜>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis</tool_call>",
}


@pytest.mark.parametrize("family", list(MALFORMED))
def test_malformed_call_is_content(family):
    text = MALFORMED[family]
    parsed = parser_class(family)(TOOLS).parse(text)
    assert parsed.calls == []
    assert parsed.content is not None and "get_weather" in parsed.content


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("which", [0, 1])
def test_stream_in_random_chunks_equals_the_whole_parse(family, which):
    text = CASES[family][which]
    whole = parser_class(family)(TOOLS).parse(text)
    rng = random.Random(f"{family}{which}")
    for _ in range(60):
        content, calls, fragments = streamed(parser_class(family)(TOOLS), text, rng)
        assert content == (whole.content or "")
        assert calls == [(c.name, c.arguments) for c in whole.calls]
        assert any("id" not in f for f in fragments)   # arguments do come in pieces after the first fragment


@pytest.mark.parametrize("family", list(CASES))
def test_stream_of_plain_text_is_content_only(family):
    text = "No tools needed: it is 12 degrees.\n"
    for seed in range(10):
        content, calls, _ = streamed(parser_class(family)(TOOLS), text, random.Random(seed))
        assert (content, calls) == (text, [])


def test_llama3_json_answer_that_is_not_a_call_stays_content():
    text = '{"answer": 42, "name": "Bob"}'
    parsed = parser_class("llama3_json")(TOOLS).parse(text)
    assert (parsed.content, parsed.calls) == (text, [])
    content, calls, _ = streamed(parser_class("llama3_json")(TOOLS), text, random.Random(0))
    assert (content, calls) == (text, [])


def test_llama3_json_without_the_python_tag():
    parsed = parser_class("llama3_json")(TOOLS).parse(f' {{"name": "get_time", "parameters": {TIME_JSON}}}')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_time", TIME_JSON)]


def test_hermes_call_whose_end_tag_never_came_is_still_a_call():
    """A model stopped on </tool_call> (a stop string) or at EOS right after the JSON."""
    parsed = parser_class("hermes")(TOOLS).parse(f'<tool_call>\n{{"name": "get_time", "arguments": {TIME_JSON}}}\n')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_time", TIME_JSON)]
    cut = parser_class("hermes")(TOOLS).parse('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eu')
    assert cut.calls == [] and cut.content.startswith("<tool_call>")


def test_hermes_arguments_written_as_a_json_string():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    parsed = parser_class("hermes")(TOOLS).parse(text)
    assert json.loads(parsed.calls[0].arguments) == {"tz": "UTC"}
    content, calls, _ = streamed(parser_class("hermes")(TOOLS), text, random.Random(1))
    assert calls == [("get_time", parsed.calls[0].arguments)]


def test_mistral_v11_name_args_form():
    text = f"[TOOL_CALLS]get_weather[ARGS]{WEATHER_JSON}[TOOL_CALLS]get_time[ARGS]{TIME_JSON}"
    parsed = parser_class("mistral")(TOOLS).parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", WEATHER_JSON), ("get_time", TIME_JSON)]
    for seed in range(20):
        content, calls, _ = streamed(parser_class("mistral")(TOOLS), text, random.Random(seed))
        assert content == "" and calls == [(c.name, c.arguments) for c in parsed.calls]


def test_deepseek_v31_form():
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>" + TIME_JSON
            + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    parsed = parser_class("deepseek_v3")(TOOLS).parse(text)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [("get_time", TIME_JSON)]


def test_glm45_values_follow_the_tool_schema():
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>[\"c\"]"
            "</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>not json</arg_value>\n</tool_call>")
    parsed = parser_class("glm45")(TOOLS).parse(text)
    assert json.loads(parsed.calls[0].arguments) == {"city": "123", "days": 3, "units": ["c"], "extra": "not json"}
    no_args = parser_class("glm45")(TOOLS).parse("<tool_call>get_time\n</tool_call>")
    assert [(c.name, c.arguments) for c in no_args.calls] == [("get_time", "{}")]


def test_required_output_is_a_list_of_calls():
    text = (f'[{{"name": "get_weather", "parameters": {WEATHER_JSON}}}, '
            f'{{"name": "get_time", "parameters": {TIME_JSON}}}]')
    parsed = RequiredParser(TOOLS).parse(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", WEATHER_JSON), ("get_time", TIME_JSON)]
    for seed in range(20):
        assert streamed(RequiredParser(TOOLS), text, random.Random(seed))[:2] == (
            "", [(c.name, c.arguments) for c in parsed.calls])
    unconstrained = RequiredParser(TOOLS).parse("plain words")
    assert unconstrained.calls == [] and unconstrained.content == "plain words"


def test_named_output_is_the_arguments():
    parsed = NamedParser("get_time", TOOLS).parse(f" {TIME_JSON}\n")
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [("get_time", TIME_JSON)]
    content, calls, fragments = streamed(NamedParser("get_time", TOOLS), f" {TIME_JSON}\n", random.Random(3))
    assert calls == [("get_time", TIME_JSON)] and fragments[0]["function"]["name"] == "get_time"


def test_every_vllm_name_is_registered():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3", "glm45"}
