"""The structured-output modes the tests run (issue 54), each with the check its outputs must pass: JSON schemas
of several shapes (nested objects through $ref, enums, arrays; written as pydantic models, which also validate
the output), any JSON object, a regex, a choice. Bounded lengths keep a random-weight model's outputs short."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kestrel.sampling_params import StructuredOutput


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=10)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):          # nested: the address is a $ref into $defs
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    address: Address


class Paint(BaseModel):           # enums and booleans
    model_config = ConfigDict(extra="forbid")
    color: Literal["red", "green", "blue"]
    glossy: bool


class Readings(BaseModel):        # an array of bounded integers
    model_config = ConfigDict(extra="forbid")
    values: list[Annotated[int, Field(ge=-50, le=150)]] = Field(min_length=1, max_length=4)
    unit: Literal["C", "F"]


REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)"
CHOICES = ("yes", "no", 'maybe "so"', "ünï\ncode")
SCHEMAS = {"person": Person, "paint": Paint, "readings": Readings}


def modes() -> dict[str, StructuredOutput]:
    out = {name: StructuredOutput(json_schema=json.dumps(model.model_json_schema())) for name, model in SCHEMAS.items()}
    out["json_object"] = StructuredOutput(json_object=True)
    out["regex"] = StructuredOutput(regex=REGEX)
    out["choice"] = StructuredOutput(choice=CHOICES)
    return out


def check(mode: str, text: str) -> None:
    """Raise (with the text) unless `text` is what `mode` allows."""
    if mode in SCHEMAS:
        SCHEMAS[mode].model_validate_json(text, strict=True)
    elif mode == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif mode == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def check_completion(llm, mode: str, completion) -> None:
    """A finished output is what its mode allows. An output cut by max_tokens ("length") is allowed only for
    json_object (its strings and members are unbounded), and must still be a prefix the grammar accepts."""
    if completion.finish_reason == "stop":
        check(mode, completion.text)
        return
    assert completion.finish_reason == "length" and mode == "json_object", (mode, completion.text)
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(llm.engine.grammar_compiler.compile(modes()[mode]))
    assert all(matcher.accept_token(t) for t in completion.token_ids), completion.text
