"""Tool calls through the server, end to end: a real uvicorn on loopback, the real engine, the official openai
client and raw HTTP.

A random-weight model never writes a tool call, so the "auto" server serves a scripted model: the tiny checkpoint
with a few added tokens (pieces of a Hermes answer) and its weights set so that greedy decoding walks a fixed chain,
the last prompt token -> "Sure." -> "\n<tool_call>\n" -> ... -> EOS (attention and MLP outputs zeroed, so each
logit row reads only the current token). The engine, the detokenizer, the parser, the stream and the client are all
real; only the text is known in advance. Its chat template renders the tools, the calls of assistant messages and
the tool messages, and the prompt's token count is checked against transformers' own rendering.

"required" and a named function go through the grammar (kestrel/structured, xgrammar): on the random model the
calls come back parseable because the sampler cannot write anything else.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from kestrel.config import EngineConfig
from kestrel.sampling_params import SamplingParams
from kestrel.server.app import ServerConfig
from kestrel.server.tool_parsers.forced import RequiredParser
from kestrel.server.protocol import ChatCompletionRequest
from kestrel.server.tools import apply, plan, required_schema
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
                                                     "properties": {"city": {"type": "string",
                                                                             "enum": ["Paris", "Rome"]},
                                                                    "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}},
                                                     "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# The scripted answer: two Hermes calls after some text. Each piece is an added token, so the chain of greedy
# successors never meets a token twice.
PIECES = ["Sure.", "\n<tool_call>\n", '{"name": "get_time", "arguments": ', '{"tz": "UTC"}', "}\n</tool_call>",
          "\n<tool_call>\n ", '{"name": "get_weather", "arguments": ', '{"city": "Paris", "days": 2}',
          "}\n</tool_call> "]
SCRIPTED_TEXT = "".join(PIECES)


def with_template(src: Path, out: Path) -> Path:
    if src != out:
        shutil.copytree(src, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tool_checkpoint(checkpoint_factory, tmp_path_factory) -> Path:
    """The tiny random model with the tool-rendering template."""
    return with_template(checkpoint_factory("llama", max_position_embeddings=1024), tmp_path_factory.mktemp("tools"))


def make_scripted(out: Path, pieces: list[str], special: tuple[str, ...] = ()) -> Path:
    """The tiny model whose greedy answer to a prompt of TOOL_TEMPLATE is "".join(pieces), then EOS; `special`:
    pieces added as special tokens (decoding skips them unless asked not to)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kestrel.models.tokenizer import Tokenizer
    from tests.conftest import make_checkpoint, make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_tokens([p for p in pieces if p not in special])
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    make_checkpoint(out, vocab_size=len(tokenizer), max_position_embeddings=1024)
    tokenizer.save_pretrained(str(out))
    with_template(out, out)
    last_prompt_token = Tokenizer(out).apply_chat_template(USER, tools=TOOLS)[-1]   # "<|assistant|>"'s last token
    chain = [last_prompt_token, *tokenizer.convert_tokens_to_ids(pieces), tokenizer.eos_token_id]
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()   # the residual stream stays the current token's embedding
    weights["model.norm.weight"].fill_(1.0)
    weights["lm_head.weight"].zero_()
    for i, (token, successor) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token] = torch.nn.functional.one_hot(torch.tensor(i), 64).float()
        weights["lm_head.weight"][successor, i] = 50.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def scripted_checkpoint(tmp_path_factory) -> Path:
    return make_scripted(tmp_path_factory.mktemp("scripted"), PIECES)


@pytest.fixture(scope="module")
def server(scripted_checkpoint):
    with LiveServer(EngineConfig(model=str(scripted_checkpoint), device="cpu"),
                    ServerConfig(tool_call_parser="hermes")) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(tool_checkpoint):
    """The random model, no --tool-call-parser."""
    with LiveServer(EngineConfig(model=str(tool_checkpoint), device="cpu")) as s:
        yield s


@pytest.fixture(scope="module")
def plain_client(plain_server):
    return openai.OpenAI(base_url=f"{plain_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(scripted_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(scripted_checkpoint))


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


EXPECTED_CALLS = [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Paris", "days": 2}')]


def test_auto_reads_the_models_calls(client):
    raw = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                         tool_choice="none", max_tokens=40, temperature=0).choices[0]
    assert raw.message.content == SCRIPTED_TEXT and raw.finish_reason == "stop"   # the script, as text
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                         max_tokens=40, temperature=0).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Sure.\n"
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == EXPECTED_CALLS
    ids = [c.id for c in got.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" for c in got.message.tool_calls)


def test_auto_streams_calls_in_openais_delta_shape(client):
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                                 max_tokens=40, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    content, calls, finish = accumulate(chunks)
    assert (content, finish) == ("Sure.\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == EXPECTED_CALLS
    assert all(c["id"].startswith("call_") for c in calls.values())
    firsts = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or [] if t.id]
    assert [t.function.name for t in firsts] == ["get_time", "get_weather"]
    assert chunks[-1].usage.completion_tokens == len(PIECES) + 1   # and the EOS
    # the raw SSE chunks: a call's later deltas carry only its index and an arguments fragment
    with httpx.stream("POST", f"{client.base_url}chat/completions", timeout=60, json={
            "messages": USER, "tools": TOOLS, "max_tokens": 40, "temperature": 0, "stream": True}) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    fragments = [t for d in deltas for t in d.get("tool_calls", [])]
    assert fragments[0].keys() == {"index", "id", "type", "function"}
    assert any(f.keys() == {"index", "function"} and f["function"].keys() == {"arguments"} for f in fragments)


def test_auto_without_a_call_answers_content(client):
    """Cut before any call (max_tokens) or in the middle of one: what came is content, finish_reason "length"."""
    for max_tokens, text in ((1, "Sure."), (3, "".join(PIECES[:3]))):
        got = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                             max_tokens=max_tokens, temperature=0).choices[0]
        assert (got.message.content, got.message.tool_calls, got.finish_reason) == (text, [], "length")
        content, calls, finish = accumulate(client.chat.completions.create(
            model=client.models.list().data[0].id, messages=USER, tools=TOOLS, max_tokens=max_tokens,
            temperature=0, stream=True))
        assert (content, calls, finish) == (text, {}, "length")


def test_a_call_cut_at_its_end_tag_by_a_stop_string_is_still_a_call(client):
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=USER, tools=TOOLS,
                                         max_tokens=40, temperature=0, stop=["</tool_call>"]).choices[0]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == EXPECTED_CALLS[:1]
    assert got.finish_reason == "tool_calls"


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


def test_auto_on_a_server_without_a_parser_is_a_400_naming_the_flag(plain_server):
    r = post(plain_server, {"tools": TOOLS})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"
    assert post(plain_server, {"tools": TOOLS, "tool_choice": "none"}).status_code == 200


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

def test_required_round_trip_returns_parseable_calls(plain_client):
    """On the random model and a server without --tool-call-parser: the grammar alone makes the calls."""
    client = plain_client
    model = client.models.list().data[0].id
    for stream in (False, True):
        # one call: the random model would otherwise go on adding calls to the list until max_tokens
        got = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=80, temperature=0, stream=stream)
        if stream:
            _, calls, finish = accumulate(got)
            calls = [calls[i] for i in sorted(calls)]
        else:
            finish = got.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in got.choices[0].message.tool_calls]
        assert finish == "tool_calls" and len(calls) == 1
        for call in calls:
            assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["arguments"]), dict)


def test_named_function_round_trip(plain_client):
    client = plain_client
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


def test_a_tool_schema_the_grammar_cannot_compile_is_a_400(plain_server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[[["}}}}}]
    two = [TOOLS[1], *bad]   # the message names the tool at fault, and its place in `tools`
    for tools, choice in ((bad, "required"), (bad, {"type": "function", "function": {"name": "f"}}),
                          (two, "required")):
        r = post(plain_server, {"tools": tools, "tool_choice": choice})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "tools", error
        assert f"tools[{len(tools) - 1}].function.parameters ('f')" in error["message"], error
        assert "Unclosed '['" in error["message"], error   # xgrammar's reason, without its source location
    # the same tool under "auto" or "none" constrains nothing: the schema is the model's to read, not a grammar
    assert post(plain_server, {"tools": two, "tool_choice": "none"}).status_code == 200


def test_mistral_tags_that_are_special_tokens_reach_the_parser(tmp_path_factory):
    """[TOOL_CALLS] is a special token of Mistral's tokenizers: the request keeps special tokens so the parser sees
    it, and the EOS text that ends the answer (now detokenized too) is not content."""
    calls = '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    ckpt = make_scripted(tmp_path_factory.mktemp("scripted_mistral"), ["OK", "[TOOL_CALLS]", calls],
                         special=("[TOOL_CALLS]",))
    with LiveServer(EngineConfig(model=str(ckpt), device="cpu"), ServerConfig(tool_call_parser="mistral")) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        common = dict(model=client.models.list().data[0].id, messages=USER, tools=TOOLS, max_tokens=20,
                      temperature=0)
        raw = client.chat.completions.create(tool_choice="none", **common).choices[0]
        assert raw.message.content == "OK" + calls   # no parser: special tokens skipped as always
        got = client.chat.completions.create(**common).choices[0]
        assert (got.message.content, got.finish_reason) == ("OK", "tool_calls")
        (call,) = got.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_time", '{"tz": "UTC"}')
        assert len(call.id) == 9 and call.id.isalnum()
        content, streamed, finish = accumulate(client.chat.completions.create(stream=True, **common))
        assert (content, finish) == ("OK", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [("get_time", '{"tz": "UTC"}')]
