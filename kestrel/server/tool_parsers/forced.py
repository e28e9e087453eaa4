"""The output of a request whose tool_choice is "required" or a named function, which the grammar constrains
(tools.py builds the schema) rather than a family's format: vLLM's choice, so one road serves every model.

"required": a JSON list of `{"name": ..., "parameters": {...}}`, one or more calls. A named function: the output is
its arguments object."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, Scan, ToolParser, calls_from_list, skip_ws


class RequiredParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i == len(text):
            return Scan(text if final else "")
        try:
            if text[i] != "[":
                raise Invalid("not a list of calls")
            calls, end = calls_from_list(text, i, final, args_keys=("parameters", "arguments"))
            if final and (not calls or text[end:].strip()):
                raise Invalid("no call, or text after the calls")
        except Invalid:   # the constraint was not applied, or the output was cut short: what came is text
            return Scan(text if final else "")
        return Scan("", calls)


class NamedParser(ToolParser):
    def __init__(self, name: str, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        # trailing whitespace waits for what follows, so a stream never sends what the final strip drops
        arguments = text.strip() if final else text.lstrip().rstrip()
        return Scan("", [PartialCall(self.name, arguments or ("{}" if final else ""), done=final)])
