"""Tool calls through the server, end to end: a real uvicorn on loopback serving the tiny model with
`--tool-call-parser hermes`, the official openai client and raw HTTP.

A random-weight model never writes a tool call by itself, so the "auto" tests here check what can be seen without
one: the request is accepted, the tools and the tool messages reach the chat template (the prompt's token count
equals transformers' own rendering of the same conversation), and the text comes back as content. The tests named
`..._needs_constraint_engine` shape the output through the grammar ("required", a named function, and a regex that
writes a Hermes call for the "auto" parser); they run once a module of kestrel imports xgrammar (the constraint
engine of issue 54, built beside this), and are skipped before.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

import kestrel
from kestrel.config import EngineConfig
from kestrel.sampling_params import SamplingParams
from kestrel.server.app import ServerConfig
from kestrel.server.tool_parsers.forced import RequiredParser
from kestrel.server.tools import apply, plan, required_schema
from kestrel.server.protocol import ChatCompletionRequest
from tests.test_server import LiveServer

# Renders the tool names and schemas, the calls of assistant messages and the ids tool messages answer.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }}:"
    "{{ t['function']['parameters'] | tojson }};{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}]{% endif %}"
    "{{ m['content'] or '' }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                                    "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}},
                                                     "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _constraint_engine_present() -> bool:
    """True once a module of kestrel (other than the shared StructuredOutput) imports xgrammar: the grammar is then
    honoured, and the output of "required" / a named function is the call's JSON."""
    root = Path(kestrel.__file__).parent
    return any("import xgrammar" in p.read_text() for p in root.rglob("*.py") if p.name != "sampling_params.py")


needs_constraint_engine = pytest.mark.skipif(not _constraint_engine_present(),
                                             reason="the constraint engine (issue 54, built beside this) is not here")


@pytest.fixture(scope="module")
def tool_checkpoint(checkpoint_factory, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_tools")
    shutil.copytree(checkpoint_factory("llama", max_position_embeddings=1024), out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(tool_checkpoint):
    with LiveServer(EngineConfig(model=str(tool_checkpoint), device="cpu"),
                    ServerConfig(tool_call_parser="hermes")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tool_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tool_checkpoint))


def rendered_tokens(hf_tokenizer, messages, tools=None) -> int:
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def post(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body},
                      timeout=60)


# ---- auto: accepted, tools in the prompt, content back ------------------------------------------------------------

def test_tools_reach_the_chat_template(client, hf_tokenizer):
    plain = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER,
                                           max_tokens=2, temperature=0)
    with_tools = client.chat.completions.create(model=plain.model, messages=USER, tools=TOOLS, max_tokens=2,
                                                temperature=0)
    assert plain.usage.prompt_tokens == rendered_tokens(hf_tokenizer, USER)
    assert with_tools.usage.prompt_tokens == rendered_tokens(hf_tokenizer, USER, TOOLS)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_messages_and_assistant_calls_pass_through_the_template(client, hf_tokenizer):
    arguments = json.dumps({"city": "Paris", "days": 2})
    conversation = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"},
    ]
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=conversation, tools=TOOLS,
                                         max_tokens=2, temperature=0)
    # transformers' rendering of the same conversation, the arguments as the dict templates expect
    oracle = [USER[0], {**conversation[1], "tool_calls": [{"id": "call_abc", "type": "function", "function": {
        "name": "get_weather", "arguments": json.loads(arguments)}}]}, conversation[2]]
    text = hf_tokenizer.apply_chat_template(oracle, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in text
    assert "[call_abc]18 C, sunny" in text
    assert got.usage.prompt_tokens == rendered_tokens(hf_tokenizer, oracle, TOOLS)


def test_auto_without_a_call_answers_content_streamed_and_not(client):
    """No call in the text: the parser hands all of it back as content, as tool_choice "none" (no parser) does."""
    model = client.models.list().data[0].id
    common = dict(model=model, messages=USER, tools=TOOLS, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    raw = client.chat.completions.create(tool_choice="none", **common).choices[0]
    whole = client.chat.completions.create(**common).choices[0]
    assert "<tool_call>" not in raw.message.content and raw.message.content
    assert whole.message.tool_calls in (None, [])
    assert (whole.message.content, whole.finish_reason) == (raw.message.content, raw.finish_reason) == \
        (raw.message.content, "length")
    chunks = list(client.chat.completions.create(tool_choice="auto", stream=True, **common))
    content, calls, finish = accumulate(chunks)
    assert (content, calls, finish) == (raw.message.content, {}, "length")


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client, hf_tokenizer):
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                         tool_choice="none", max_tokens=4, temperature=0)
    assert got.usage.prompt_tokens == rendered_tokens(hf_tokenizer, USER, TOOLS)
    assert got.choices[0].message.tool_calls in (None, []) and got.choices[0].message.content is not None


# ---- 400s -------------------------------------------------------------------------------------------------------

BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "get_stock"),
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "needs `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "bad name!"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "arguments is not JSON"),
]


@pytest.mark.parametrize("body,says", BAD)
def test_bad_tool_requests_are_400_in_openai_format(server, body, says):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]


def test_auto_on_a_server_without_a_parser_is_a_400_naming_the_flag(tool_checkpoint):
    with LiveServer(EngineConfig(model=str(tool_checkpoint), device="cpu")) as plain:
        r = post(plain, {"tools": TOOLS})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "tool_choice"
        assert post(plain, {"tools": TOOLS, "tool_choice": "none"}).status_code == 200


# ---- the constraint the plan hands the sampler -----------------------------------------------------------------

def test_required_and_named_choices_constrain_the_sampler_to_the_calls_json():
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    tool_plan = plan(req, None)   # no --tool-call-parser needed: the grammar shapes the output
    assert json.loads(tool_plan.structured_output.json_schema) == required_schema(TOOLS)
    params = SamplingParams()
    apply(tool_plan, params, tokenizer=None)
    assert params.structured_output == tool_plan.structured_output
    named = plan(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}), None)
    assert json.loads(named.structured_output.json_schema) == TOOLS[1]["function"]["parameters"]
    one = plan(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                                     "parallel_tool_calls": False}), None)
    assert json.loads(one.structured_output.json_schema)["maxItems"] == 1


def test_output_the_required_schema_admits_parses_as_calls():
    schema = required_schema(TOOLS)
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": ' \
           '{"city": "Rome", "days": 3}}]'
    calls = json.loads(text)
    assert schema["type"] == "array" and [c["name"] for c in calls] == ["get_time", "get_weather"]
    for call in calls:   # each call is one branch of the schema: that tool's name and its parameters
        branch = next(b for b in schema["items"]["anyOf"] if b["properties"]["name"]["enum"] == [call["name"]])
        assert set(call) == set(branch["required"])
    parsed = RequiredParser(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(c["name"], c["parameters"]) for c in calls]


def test_special_tags_keep_special_tokens_and_drop_the_eos_text(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: skipped, the parser would never see it."""
    from kestrel.models.tokenizer import Tokenizer
    from tests.conftest import make_tokenizer

    hf = make_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    hf.save_pretrained(str(tmp_path))
    tokenizer = Tokenizer(tmp_path)
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS})
    params = SamplingParams()
    assert apply(plan(req, "mistral"), params, tokenizer) == ("</s>",) and params.skip_special_tokens is False
    params = SamplingParams()
    assert apply(plan(req, "hermes"), params, tokenizer) == () and params.skip_special_tokens is True


# ---- through the grammar --------------------------------------------------------------------------------------

def accumulate(chunks) -> tuple[str, dict[int, dict], str | None]:
    """What a client builds from streamed tool-call deltas: content, calls by index, the last finish reason."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            if t.id:
                assert call["id"] is None, "a call's id comes once, on its first delta"
                call["id"] = t.id
                assert t.type == "function"
            if t.function and t.function.name:
                call["name"] += t.function.name
            if t.function and t.function.arguments:
                call["arguments"] += t.function.arguments
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


@needs_constraint_engine
def test_required_round_trip_returns_parseable_calls_needs_constraint_engine(client):
    model = client.models.list().data[0].id
    for stream in (False, True):
        got = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                             max_tokens=80, temperature=0, stream=stream)
        if stream:
            _, calls, finish = accumulate(got)
            calls = [calls[i] for i in sorted(calls)]
        else:
            finish = got.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in got.choices[0].message.tool_calls]
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["arguments"]), dict)


@needs_constraint_engine
def test_named_function_round_trip_needs_constraint_engine(client):
    model = client.models.list().data[0].id
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice=choice,
                                         max_tokens=40, temperature=0)
    (call,) = got.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    _, calls, finish = accumulate(client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", arguments)]
    assert finish == got.choices[0].finish_reason == "stop"   # OpenAI's finish reason for a named function


@needs_constraint_engine
def test_auto_reads_a_hermes_call_the_grammar_wrote_needs_constraint_engine(client):
    """The family parser end to end: a regex makes the random model write a Hermes call, with text before it."""
    model = client.models.list().data[0].id
    regex = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
             r'"days": [1-7]\}\}\n</tool_call>')
    whole = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, max_tokens=80, temperature=0,
                                           extra_body={"guided_regex": regex})
    message = whole.choices[0].message
    assert message.content == "Sure.\n" and whole.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    content, calls, finish = accumulate(client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, max_tokens=80, temperature=0, stream=True,
        extra_body={"guided_regex": regex}))
    assert (content, finish) == ("Sure.\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
