"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call,
text before, between and after them is content."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, call_from_object, skip_ws
from kestrel.server.tool_parsers.tagged import TaggedParser


class HermesParser(TaggedParser):
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end)

    def body_call(self, body: str, complete: bool) -> PartialCall | None:
        i = skip_ws(body, 0)
        if i == len(body):
            if complete:
                raise Invalid("an empty tool call")
            return None
        if body[i] != "{":
            raise Invalid("a tool call that is not a JSON object")
        call, end = call_from_object(body, i, complete)
        if end is not None:
            if call is None:
                raise Invalid("a JSON object without a name")
            if complete and body[end:].strip():
                raise Invalid("text after the call's JSON")
        return call
