"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11: Mistral-7B-Instruct-v0.3,
Mixtral-8x22B-Instruct, Mistral-Small-24B-2501), or `[TOOL_CALLS]f[ARGS]{...}` once per call (v11 and later:
Mistral-Small-3.2, Magistral, Devstral). Text before the first `[TOOL_CALLS]` is content. Call ids are 9 letters or
digits: Mistral's chat templates refuse any other id when the call comes back in the next turn."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, Scan, ToolParser, calls_from_list, \
    complete_value, held_back, mistral_call_id, skip_ws

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser(ToolParser):
    markers = (TOOL_CALLS, ARGS)

    def new_call_id(self) -> str:
        return mistral_call_id()

    def scan(self, text: str, final: bool) -> Scan:
        k = text.find(TOOL_CALLS)
        if k == -1:
            return Scan(text if final else text[:len(text) - held_back(text, (TOOL_CALLS,))])
        content = text[:k]
        i = skip_ws(text, k + len(TOOL_CALLS))
        try:
            if i < len(text) and text[i] == "[":
                calls, end = calls_from_list(text, i, final)
                trailing = text[end:] if end is not None else ""
            else:
                calls, trailing = self._named_calls(text, k + len(TOOL_CALLS), final)
        except Invalid:
            return Scan(text if final else content)
        if final and not calls:
            return Scan(text)
        return Scan(content + trailing, calls)

    @staticmethod
    def _named_calls(text: str, i: int, final: bool) -> tuple[list[PartialCall], str]:
        """`name[ARGS]{...}`, repeated after each `[TOOL_CALLS]`; returns the calls and the text after the last."""
        calls: list[PartialCall] = []
        while True:
            a = text.find(ARGS, i)
            if a == -1:
                if final:
                    raise Invalid("a call without [ARGS]")
                return calls, ""
            name = text[i:a].strip()
            if not name:
                raise Invalid("a call without a name")
            j = skip_ws(text, a + len(ARGS))
            if j >= len(text):
                if final:
                    raise Invalid("a call without arguments")
                calls.append(PartialCall(name))
                return calls, ""
            if text[j] != "{":
                raise Invalid("arguments that are not a JSON object")
            end = complete_value(text, j)
            if end is None:
                if final:
                    raise Invalid("arguments that are not JSON")
                calls.append(PartialCall(name, text[j:]))
                return calls, ""
            calls.append(PartialCall(name, text[j:end], done=True))
            r = skip_ws(text, end)
            if text.startswith(TOOL_CALLS, r):
                i = r + len(TOOL_CALLS)
                continue
            rest = text[end:]
            if not final and (r == len(text) or TOOL_CALLS.startswith(text[r:])):
                return calls, ""   # a next call may be starting
            return calls, rest
