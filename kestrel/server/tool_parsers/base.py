"""What every tool-call parser shares: the shapes of a parse, the JSON scanning helpers, and the parser base.

A parser reads the model's whole text so far and says what is settled: the content outside calls, and each call's
name (once it is complete) and its arguments (the prefix known so far). Streaming re-scans the growing text and sends
what grew (stream.py); the final answer is the same scan with `final=True`. Each parser's scan is monotone for
well-formed output: a scan of a prefix of the text gives prefixes of the content and of each call's arguments of the
full text's scan, so the streamed deltas add up to the non-streamed answer.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass
class PartialCall:
    name: str | None          # None until the whole name is known
    arguments: str = ""       # the arguments' JSON text known so far: a prefix of the final arguments
    done: bool = False        # the call's text is complete


@dataclass
class Scan:
    content: str = ""                                            # settled text outside the calls
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str            # a JSON object, as text


@dataclass(frozen=True)
class Parsed:
    content: str | None       # None when calls were found and no text besides them (OpenAI's shape)
    calls: list[ToolCall]


class ToolParser:
    """One model family's tool-call format. A parser is made per choice of a request (`tools`: the request's tool
    definitions, as dicts in OpenAI's shape) and holds no state between scans but a cache of settled work."""

    # strings of the format that may be special tokens: when the tokenizer has them as such, the request's
    # detokenization keeps special tokens, or the parser would never see them (vLLM's adjust_request does the same)
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str) -> Parsed:
        """The whole output's content and calls (the non-streamed answer)."""
        scan = self.scan(text, final=True)
        calls = [ToolCall(self.new_call_id(), c.name, c.arguments) for c in scan.calls if c.name is not None]
        return Parsed(content_of(scan.content, bool(calls)), calls)

    def param_types(self, tool_name: str) -> dict[str, object]:
        """A tool's parameters' JSON-schema `type`s by name (empty for an unknown tool)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == tool_name:
                props = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def content_of(content: str, has_calls: bool) -> str | None:
    """The message's content: None when there are calls and only whitespace besides them."""
    return None if has_calls and not content.strip() else content


def mistral_call_id() -> str:
    """Mistral's chat templates refuse a tool call id that is not 9 letters or digits, so a call sent back in the
    next turn's messages must carry one of those."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


# ---- JSON scanning ------------------------------------------------------------------------------------------------

def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def complete_value(text: str, i: int) -> int | None:
    """The end of the complete JSON value starting at text[i], or None when it is incomplete or invalid."""
    try:
        return _DECODER.raw_decode(text, i)[1]
    except json.JSONDecodeError:
        return None


def string_end(text: str, i: int) -> int | None:
    """text[i] is `"`: the index after the closing quote, or None while the string is open."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


class Invalid(Exception):
    """The text cannot be the format's JSON (as opposed to incomplete: more text could still make it valid)."""


def object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Scan the JSON object opening at text[i] (`{`) member by member, as far as the text goes.

    Returns {key: (value start, value end or None while the value is incomplete)} and the index after the closing
    `}` (None while the object is open). Raises Invalid on text no continuation could make a JSON object."""
    members: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return members, j + 1
    while j < len(text):
        if text[j] != '"':
            raise Invalid(f"expected a key at {j}")
        k_end = string_end(text, j)
        if k_end is None:
            return members, None
        key = json.loads(text[j:k_end])
        j = skip_ws(text, k_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise Invalid(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end = complete_value(text, j)
        members[key] = (j, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
        if j >= len(text):
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise Invalid(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return members, None


def call_from_object(text: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[PartialCall | None, int | None]:
    """A `{"name": ..., "arguments": {...}}` object at text[i] as a call, and the index after it (None while open).

    (None, end) when the object is complete but not a call (no name or no arguments); raises Invalid when it cannot
    become a call's JSON (keys a call does not have, a name that is not a string, arguments that are not an object
    or a string holding one). A partial call carries its name once the name's string
    is complete, and the raw text of an arguments object as far as it goes."""
    members, end = object_members(text, i)
    if set(members) - {"name", *args_keys}:
        raise Invalid("an object with keys a call does not have")
    name = None
    if "name" in members and members["name"][1] is not None:
        value = json.loads(text[members["name"][0]:members["name"][1]])
        if not isinstance(value, str):
            raise Invalid("the name is not a string")
        name = value
    key = next((k for k in args_keys if k in members), None)
    arguments = ""
    if key is not None:
        start, stop = members[key]
        if stop is not None:
            arguments = arguments_text(text[start:stop])
            if arguments is None:
                raise Invalid("the arguments are not a JSON object")
        elif text[start] == "{":
            arguments = text[start:]   # raw, as far as it goes: a prefix of the value's text
        elif text[start] != '"':
            raise Invalid("the arguments are not a JSON object")
    if end is None:
        if final:
            raise Invalid("the call's JSON is incomplete")
        return PartialCall(name, arguments), None
    if name is None or key is None:
        return None, end
    return PartialCall(name, arguments, done=True), end


def arguments_text(value: str) -> str | None:
    """The arguments of a call as JSON text: an object's own text, or the object a JSON string holds (some models
    write the arguments as an encoded string); None for anything else."""
    parsed = json.loads(value)
    if isinstance(parsed, dict):
        return value
    if isinstance(parsed, str):
        try:
            inner = json.loads(parsed)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(inner, dict) else None
    return None


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the beginning of one of `markers` (held from content
    until the next text decides)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def calls_from_list(text: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")
                    ) -> tuple[list[PartialCall], int | None]:
    """A JSON list of call objects opening at text[i] (`[`): its calls as far as the text goes and the index after
    the closing `]` (None while open). Raises Invalid when it cannot become such a list."""
    calls: list[PartialCall] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "]":
        return calls, j + 1
    while j < len(text):
        if text[j] != "{":
            raise Invalid(f"expected a call object at {j}")
        call, end = call_from_object(text, j, final, args_keys)
        if end is None:
            if call is not None:
                calls.append(call)
            break
        if call is None:
            raise Invalid("an object of the list is not a call")
        calls.append(call)
        j = skip_ws(text, end)
        if j >= len(text):
            break
        if text[j] == "]":
            return calls, j + 1
        if text[j] != ",":
            raise Invalid(f"expected ',' or ']' at {j}")
        j = skip_ws(text, j + 1)
    if final:
        raise Invalid("the list of calls is incomplete")
    return calls, None
