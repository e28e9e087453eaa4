"""A request's structured-output fields as one StructuredOutput (issue 54), validated off the event loop.

Accepted, at most one per request (more is a 400 naming them):
    response_format       OpenAI: {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
                          ({"type": "text"}: no constraint)
    guided_json, guided_regex, guided_choice, guided_grammar          vLLM's extra fields (before v0.10)
    structured_outputs    vLLM's current object: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    json_schema (a string), regex, ebnf                               SGLang's fields
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from kestrel.errors import KestrelError
from kestrel.sampling_params import StructuredOutput
from kestrel.server.serving import APIError
from kestrel.structured.grammar import validate


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, bool):   # JSON Schema's true (anything) and false (nothing)
        return json.dumps(schema)
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{param}: the schema cannot be serialized: {exc}", param=param) from None


def _given(req) -> list[tuple[str, StructuredOutput]]:
    """Every structured-output field the request sent, as (field name, constraint)."""
    given: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", StructuredOutput(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, 'response_format of type "json_schema" needs json_schema.schema',
                               param="response_format")
            given.append(("response_format", StructuredOutput(
                json_schema=_schema_text(rf.json_schema.schema_, "response_format"))))
    if req.guided_json is not None:
        given.append(("guided_json", StructuredOutput(json_schema=_schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        given.append(("guided_regex", StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        given.append(("guided_choice", StructuredOutput(choice=tuple(req.guided_choice))))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", StructuredOutput(grammar=req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        inner = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object or None}
        named = [k for k, v in inner.items() if v is not None]
        if len(named) != 1:
            raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar and "
                                f"json_object ({', '.join(named) or 'none'} given)", param="structured_outputs")
        key = named[0]
        value = inner[key]
        given.append(("structured_outputs", StructuredOutput(
            json_schema=_schema_text(value, "structured_outputs") if key == "json" else None,
            json_object=key == "json_object", regex=value if key == "regex" else None,
            choice=tuple(value) if key == "choice" else None, grammar=value if key == "grammar" else None)))
    if req.json_schema is not None:
        given.append(("json_schema", StructuredOutput(json_schema=req.json_schema)))
    if req.regex is not None:
        given.append(("regex", StructuredOutput(regex=req.regex)))
    if req.ebnf is not None:
        given.append(("ebnf", StructuredOutput(grammar=req.ebnf)))
    return given


async def structured_output(req) -> StructuredOutput | None:
    """The request's constraint (None: unconstrained), its grammar checked on a worker thread: a schema, regex or
    EBNF xgrammar cannot use is a 400 before the request is queued."""
    given = _given(req)
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"more than one structured output was given ({names}): send one",
                       param=given[1][0])
    param, so = given[0]
    try:
        await asyncio.to_thread(validate, so)
    except KestrelError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return so
