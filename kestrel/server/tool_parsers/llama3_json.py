"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is `{"name": "f", "parameters": {...}}` (several joined
by `;`), possibly after `<|python_tag|>`; text before `<|python_tag|>` is content. An answer that starts with `{` but
is not a call (a JSON answer of the model's own) stays content."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, Scan, ToolParser, call_from_object, held_back, \
    skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    markers = (PYTHON_TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        tag = text.find(PYTHON_TAG)
        if tag != -1:
            content, i = text[:tag], skip_ws(text, tag + len(PYTHON_TAG))
        else:
            i = skip_ws(text, 0)
            if i == len(text) or text[i] != "{":
                # not (yet) a call: content, holding back what could start the tag or a leading `{`
                if final:
                    return Scan(text)
                settled = text[:len(text) - held_back(text, (PYTHON_TAG,))]
                return Scan("" if not settled.strip() else settled)
            content = text[:i]
        try:
            calls = self._calls(text, i, final)
        except Invalid:
            return Scan(text if final else "")
        return Scan(content, calls)

    @staticmethod
    def _calls(text: str, i: int, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        while i < len(text):
            if text[i] != "{":
                raise Invalid(f"expected a call object at {i}")
            call, end = call_from_object(text, i, final)
            if end is None:
                if call is not None:
                    calls.append(call)
                break
            if call is None:
                raise Invalid("a JSON object that is not a call")
            calls.append(call)
            i = skip_ws(text, end)
            if i < len(text):
                if text[i] != ";":
                    raise Invalid(f"expected ';' between calls at {i}")
                i = skip_ws(text, i + 1)
        if final and not calls:
            raise Invalid("no call")
        return calls
