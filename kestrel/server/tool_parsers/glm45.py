"""GLM-4.5 / GLM-4.6: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`.

Values are text: a parameter the tool's schema types as a string stays the text as written; any other value is read
as JSON where it parses (numbers, booleans, objects, arrays) and kept as text where not (as vLLM's glm45 parser).
The arguments are built as JSON one pair at a time, so a stream sends each pair as soon as its </arg_value> came."""
from __future__ import annotations

import json
import re

from kestrel.server.tool_parsers.base import Invalid, PartialCall
from kestrel.server.tool_parsers.tagged import TaggedParser

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(TaggedParser):
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def body_call(self, body: str, complete: bool) -> PartialCall | None:
        cuts = [i for i in (body.find("\n"), body.find("<arg_key>")) if i != -1]
        if not cuts:
            if not complete:
                return None
            name, j = body.strip(), len(body)
        else:
            name, j = body[:min(cuts)].strip(), min(cuts)
        if not name or "<" in name:
            raise Invalid("a tool call without a name")
        types = self.param_types(name)
        pairs = []
        while (m := _PAIR.match(body, j)) is not None:
            key = m.group(1).strip()
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(self._value(m.group(2), types.get(key)), ensure_ascii=False)}")
            j = m.end()
        if complete:
            if body[j:].strip():
                raise Invalid("text in a tool call that is not an argument")
            return PartialCall(name, "{" + ", ".join(pairs) + "}", done=True)
        return PartialCall(name, "{" + ", ".join(pairs) if pairs else "")

    @staticmethod
    def _value(text: str, schema_type: object) -> object:
        if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
