"""A StructuredOutput as an xgrammar Grammar, without a tokenizer: the check that a request's schema, regex or EBNF
is usable, run where the request arrives (the server, off its event loop; `LLM.generate`), so a bad one is a 400
naming the problem instead of a failure inside the engine."""
from __future__ import annotations

import json
import re
from functools import lru_cache

from kestrel.errors import KestrelError
from kestrel.sampling_params import StructuredOutput

# `json_object` is any JSON object, as vLLM compiles it (not any JSON value: OpenAI's JSON mode returns an object).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors read "[18:03:17] /project/cpp/regex_converter.cc:94: Regex parsing error ...": keep the message.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.(?:cc|h):\d+:\s*")


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """`choice` as EBNF: one string literal per option. JSON string escapes are EBNF's (quotes, backslashes,
    control characters, \\uXXXX), so any text is written exactly."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def describe(so: StructuredOutput) -> str:
    """The request field the constraint came as, for error messages."""
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(so, name) is not None:
            return name
    return "json_object"


def xgrammar_error(exc: Exception) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


@lru_cache(maxsize=256)
def validate(so: StructuredOutput) -> None:
    """Raise KestrelError when xgrammar cannot build the constraint's grammar (cached: a schema sent again costs
    nothing; only successes are cached, an exception is raised each time)."""
    import xgrammar as xgr   # imported on first use: a server without structured requests never loads it

    kind = describe(so)
    if so.choice is not None:
        if not so.choice or any(not isinstance(c, str) or not c for c in so.choice):
            raise KestrelError(f"choice={list(so.choice)!r} is invalid: expected a non-empty list of non-empty "
                               "strings")
    if so.json_schema is not None:
        try:
            schema = json.loads(so.json_schema)
        except ValueError as exc:
            raise KestrelError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise KestrelError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    try:
        if so.json_schema is not None:
            xgr.Grammar.from_json_schema(so.json_schema)
        elif so.regex is not None:
            xgr.Grammar.from_regex(so.regex)
        elif so.choice is not None:
            xgr.Grammar.from_ebnf(choice_ebnf(so.choice))
        elif so.grammar is not None:
            xgr.Grammar.from_ebnf(so.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice",
                "grammar": "EBNF grammar"}[kind]
        raise KestrelError(f"the {what} cannot be used for structured output: {xgrammar_error(exc)}") from None
