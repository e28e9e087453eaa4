"""Structured outputs over HTTP (issue 54), a real server on loopback with the default model: every accepted field
form (OpenAI's response_format, vLLM's guided_* and structured_outputs, SGLang's regex / ebnf / json_schema) on
chat and completions, streamed too; the official openai client's `beta.chat.completions.parse` with a pydantic
model; 400s in OpenAI's format for a bad schema, regex or EBNF and for more than one constraint."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig
from tests.structured_cases import CHOICES, REGEX, Paint, Person, check
from tests.test_server import LiveServer

PAINT = Paint.model_json_schema()
PERSON = Person.model_json_schema()
EBNF = 'root ::= "(" [0-9] [0-9]? " + " [0-9] ")"'


@pytest.fixture(scope="module")
def server():
    with LiveServer(EngineConfig(model=str(DEFAULT_MODEL_DIR), device="cpu")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ebnf_ok(text: str) -> None:
    import re

    assert re.fullmatch(r"\([0-9][0-9]? \+ [0-9]\)", text), text


# (request fields, the check the output must pass)
FORMS = {
    "response_format json_object": ({"response_format": {"type": "json_object"}}, lambda t: check("json_object", t)),
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "paint", "schema": PAINT, "strict": True}}}, lambda t: check("paint", t)),
    "guided_json": ({"guided_json": PERSON}, lambda t: check("person", t)),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: check("regex", t)),
    "guided_choice": ({"guided_choice": list(CHOICES)}, lambda t: check("choice", t)),
    "guided_grammar": ({"guided_grammar": EBNF}, _ebnf_ok),
    "structured_outputs json": ({"structured_outputs": {"json": PAINT}}, lambda t: check("paint", t)),
    "structured_outputs regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: check("regex", t)),
    "structured_outputs choice": ({"structured_outputs": {"choice": list(CHOICES)}}, lambda t: check("choice", t)),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": EBNF}}, _ebnf_ok),
    "sglang json_schema": ({"json_schema": json.dumps(PERSON)}, lambda t: check("person", t)),
    "sglang regex": ({"regex": REGEX}, lambda t: check("regex", t)),
    "sglang ebnf": ({"ebnf": EBNF}, _ebnf_ok),
}


@pytest.mark.parametrize("form", [pytest.param(f, marks=[] if f in ("guided_choice", "sglang regex")
                                               else [pytest.mark.slow]) for f in FORMS])
def test_every_field_form_constrains_chat_and_completions(server, form):
    fields, ok = FORMS[form]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Answer in the requested format."}], "max_tokens": 96, "seed": 1,
        **fields})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    if choice["finish_reason"] == "stop" or "json_object" not in form:
        assert choice["finish_reason"] == "stop"
        ok(choice["message"]["content"])
    cmpl = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "The answer:", "max_tokens": 96, "seed": 2, **fields})
    assert cmpl.status_code == 200, cmpl.text
    choice = cmpl.json()["choices"][0]
    if choice["finish_reason"] == "stop" or "json_object" not in form:
        assert choice["finish_reason"] == "stop"
        ok(choice["text"])


def test_response_format_text_is_unconstrained(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_openai_client_parse_returns_the_pydantic_model(client):
    completion = client.beta.chat.completions.parse(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Describe a paint."}],
        response_format=Paint, max_completion_tokens=64, seed=4)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Paint)
    assert message.parsed == Paint.model_validate_json(message.content)


@pytest.mark.slow
def test_a_constrained_stream_parses_once_joined(client):
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=96, stream=True, seed=7, extra_body={"guided_json": PERSON})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    check("person", text)


@pytest.mark.slow
def test_a_batch_of_constrained_requests_at_once(server):
    """Many requests in flight together through the HTTP path (continuous batching, n > 1)."""
    import concurrent.futures

    def one(i: int) -> list[str]:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Paint number {i}"}], "max_tokens": 64, "seed": i, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PAINT}}})
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for texts in pool.map(one, range(16)):
            for t in texts:
                check("paint", t)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "JSON schema"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}, "type": "object"}}, "guided_json", "JSON schema"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "regex"),
    ({"regex": "[z-a]"}, "regex", "regex"),
    ({"ebnf": 'root ::= missing_rule'}, "ebnf", "EBNF"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs", "EBNF"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "more than one"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "more than one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, None, None),
])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_bad_constraints_are_400s_in_openai_format(server, fields, param, words, route):
    body = {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{server.url}/v1/{route}", timeout=60, json={**body, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if words is not None:
        assert words in error["message"], error
        assert error["param"] == param, error
