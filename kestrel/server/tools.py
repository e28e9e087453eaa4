"""A chat request's `tools` and `tool_choice`: validated, turned into what the template, the sampler and the answer
need (a `ToolPlan`).

    tool_choice    template gets tools   constraint (StructuredOutput)          output read by
    "none"         yes                   none                                   nothing: all content
    "auto"         yes                   none                                   --tool-call-parser's family parser
    "required"     yes                   JSON list of {"name", "parameters"}    forced.RequiredParser
    {function}     yes                   that function's parameters schema      forced.NamedParser

"required" and a named function are enforced through the grammar, not by hoping: the output is JSON of the calls
whatever the family (vLLM's road), so they need no --tool-call-parser. "auto" needs one: without a parser the calls
would come back as text, so it is a 400 that names the flag (vLLM answers the same way).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from kestrel.errors import KestrelError
from kestrel.sampling_params import SamplingParams, StructuredOutput
from kestrel.server.protocol import ChatCompletionRequest
from kestrel.server.serving import APIError
from kestrel.server.tool_parsers import PARSERS, ToolParser, parser_class
from kestrel.server.tool_parsers.forced import NamedParser, RequiredParser
from kestrel.structured.grammar import validate

# OpenAI's rule for a function name (letters, digits, underscores, dashes, at most 64), with dots as vLLM lets
# through (MCP tools are often named `server.tool`)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None                     # the template's `tools`
    make_parser: Callable[[], ToolParser] | None          # one per choice; None: the output is content
    structured_output: StructuredOutput | None            # the constraint "required" / a named function need
    finish_reason: str = "tool_calls"                     # a choice that called: OpenAI's "stop" for a named one
    constrained: tuple[int, ...] = ()                     # indexes into `tools` whose parameters the grammar uses


NO_TOOLS = ToolPlan(None, None, None)


def plan(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """The request's tools as a plan; 400 for bad definitions, a choice naming no given tool, or "auto" without a
    parser."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    check_tools(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice in ("none", "auto"):
            return NO_TOOLS
        raise APIError(400, f"tool_choice {_show(choice)} needs `tools`: the request gives none", param="tool_choice")
    if choice == "none":
        return ToolPlan(tools, None, None)
    if choice == "auto":
        if parser_name is None:
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a tool-call parser: '
                           "start the server with --tool-call-parser NAME (one of "
                           f"{', '.join(PARSERS)}), or send tool_choice \"none\", \"required\" or a named function",
                           param="tool_choice")
        family = parser_class(parser_name)
        return ToolPlan(tools, lambda: family(tools), None)
    if choice == "required":
        schema = required_schema(tools, one=req.parallel_tool_calls is False)
        return ToolPlan(tools, lambda: RequiredParser(tools), StructuredOutput(json_schema=json.dumps(schema)),
                        constrained=tuple(range(len(tools))))
    name = choice.function.name
    index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
    if index is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the request's tools "
                       f"({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
    schema = tools[index]["function"].get("parameters") or EMPTY_PARAMETERS
    return ToolPlan(tools, lambda: NamedParser(name, tools), StructuredOutput(json_schema=json.dumps(schema)),
                    finish_reason="stop", constrained=(index,))


def check_tools(tools: list[dict]) -> None:
    seen = set()
    for i, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name={name!r} is invalid: expected 1 to 64 letters, digits, "
                           "underscores, dashes or dots", param="tools")
        if name in seen:
            raise APIError(400, f"tools[{i}].function.name={name!r} is given twice: tool names must be unique",
                           param="tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and parameters.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of type \"object\" (the "
                           f"arguments are a JSON object), got type {parameters.get('type')!r}", param="tools")


def required_schema(tools: list[dict], one: bool = False) -> dict:
    """A JSON list of one or more calls, each {"name": one of the tools, "parameters": its arguments}."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if one:
        schema["maxItems"] = 1
    return schema


def check_constraint(tool_plan: ToolPlan) -> None:
    """400 naming `tools` when a parameters schema the grammar uses is one xgrammar cannot build. Each tool's
    schema is checked alone first, so the message names the tool; then the combined schema. Cached by schema
    (structured.grammar.validate), and run off the event loop by the server: a large schema takes milliseconds."""
    if tool_plan.structured_output is None:
        return
    for i in tool_plan.constrained:
        function = tool_plan.template_tools[i]["function"]
        schema = function.get("parameters") or EMPTY_PARAMETERS
        try:
            validate(StructuredOutput(json_schema=json.dumps(schema)))
        except KestrelError as exc:
            raise APIError(400, f"tools[{i}].function.parameters ({function['name']!r}) cannot constrain the "
                           f"call: {exc}", param="tools") from None
    try:
        validate(tool_plan.structured_output)
    except KestrelError as exc:
        raise APIError(400, f"tools: the schema of the calls cannot constrain the output: {exc}",
                       param="tools") from None


def apply(tool_plan: ToolPlan, params: SamplingParams, tokenizer) -> tuple[str, ...]:
    """The plan's constraint on the request's sampling, checked (check_constraint); special tokens kept where the
    family's tags are special tokens of this tokenizer (skipped, the parser would never see them). Returns the
    end-of-sequence texts the answer must then drop from its end (the EOS token that ended it is detokenized
    too)."""
    if tool_plan.structured_output is not None:
        if params.structured_output is not None:
            raise APIError(400, 'tool_choice "required" or a named function constrains the output to the call\'s '
                           "JSON: it cannot be combined with response_format or another structured output",
                           param="tool_choice")
        check_constraint(tool_plan)
        params.structured_output = tool_plan.structured_output
    if tool_plan.make_parser is None or not params.skip_special_tokens:
        return ()
    markers = set(tool_plan.make_parser().markers)
    if not markers or not markers & special_texts(tokenizer):
        return ()
    params.skip_special_tokens = False
    return tuple(tokenizer.decode([i], skip_special_tokens=False) for i in sorted(tokenizer.eos_token_ids))


@lru_cache(maxsize=4)
def special_texts(tokenizer) -> frozenset[str]:
    """The added tokens decoding skips (those marked special), by their text; one tokenizer per server."""
    hf = tokenizer.hf
    decoder = getattr(hf, "added_tokens_decoder", None)
    if decoder is None and hasattr(hf, "backend"):   # kestrel's FastTokenizer over `tokenizers`
        decoder = hf.backend.get_added_tokens_decoder()
    return frozenset(t.content for t in (decoder or {}).values() if getattr(t, "special", False))


def without_suffix(text: str, suffixes: tuple[str, ...]) -> str:
    for suffix in suffixes:
        if suffix and text.endswith(suffix):
            return text[:-len(suffix)]
    return text


def _show(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())
