"""DeepSeek-V3 (and R1-0528):
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>`. DeepSeek-V3.1's shape, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, is read
too: the text before the separator is the call's type ("function") in V3 and its name in V3.1."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, complete_value, skip_ws
from kestrel.server.tool_parsers.tagged import TaggedParser

SEP = "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(TaggedParser):
    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    dropped = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    markers = (start, end, SEP, *dropped)

    def body_call(self, body: str, complete: bool) -> PartialCall | None:
        sep = body.find(SEP)
        if sep == -1:
            if complete:
                raise Invalid("a tool call without a separator")
            return None
        kind = body[:sep].strip()
        j = sep + len(SEP)
        if kind == "function":   # V3: the name, a newline, then the arguments in a ```json fence
            nl = body.find("\n", j)
            if nl == -1:
                if complete:
                    raise Invalid("a tool call without arguments")
                return None
            name = body[j:nl].strip()
            j = skip_ws(body, nl)
            if not body.startswith(FENCE, j):
                if not complete and FENCE.startswith(body[j:]):
                    return PartialCall(name or None)
                raise Invalid("a tool call without a ```json block")
            j += len(FENCE)
            closing = "```"
        else:                    # V3.1: the name before the separator, the arguments' JSON after it
            name, closing = kind, ""
        if not name:
            raise Invalid("a tool call without a name")
        j = skip_ws(body, j)
        if j >= len(body):
            if complete:
                raise Invalid("a tool call without arguments")
            return PartialCall(name)
        if body[j] != "{":
            raise Invalid("arguments that are not a JSON object")
        end = complete_value(body, j)
        if end is None:
            if complete:
                raise Invalid("arguments that are not JSON")
            return PartialCall(name, body[j:])
        rest = body[end:].strip()
        if complete and rest != closing:
            raise Invalid("text after the arguments")
        return PartialCall(name, body[j:end], done=complete)
