"""Formats that wrap each call in a start and an end tag, with text allowed around the calls (Hermes/Qwen,
GLM-4.5, DeepSeek-V3): one scan loop over the tags; each family reads the text between them."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Invalid, PartialCall, Scan, ToolParser, held_back


class TaggedParser(ToolParser):
    start: str
    end: str
    dropped: tuple[str, ...] = ()   # wrapper tags around a run of calls: not content, not part of a call

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._closed: dict[tuple[int, int], PartialCall | None] = {}   # (start, end) of a closed call -> its parse

    def body_call(self, body: str, complete: bool) -> PartialCall | None:
        """The call between the tags (`complete`: no more of it will come); None while too little is known.
        Raises Invalid for a body that is not a call."""
        raise NotImplementedError

    def _closed_call(self, s: int, e: int, body: str) -> PartialCall | None:
        if (s, e) not in self._closed:
            try:
                self._closed[(s, e)] = self.body_call(body, complete=True)
            except Invalid:
                self._closed[(s, e)] = None
        return self._closed[(s, e)]

    def _content(self, piece: str, final: bool) -> str:
        if not final:
            piece = piece[:len(piece) - held_back(piece, (self.start, *self.dropped))]
        for tag in self.dropped:
            piece = piece.replace(tag, "")
        return piece

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            s = text.find(self.start, pos)
            piece = self._content(text[pos:] if s == -1 else text[pos:s], final or s != -1)
            if not calls or piece.strip():   # whitespace between and after calls is not content
                content.append(piece)
            if s == -1:
                break
            b = s + len(self.start)
            e = text.find(self.end, b)
            if e != -1:
                call = self._closed_call(s, e, text[b:e])
                if call is None:   # malformed: the whole block is text
                    content.append(text[s:e + len(self.end)])
                else:
                    calls.append(call)
                pos = e + len(self.end)
                continue
            # the last call is still open (or, at the end, was never closed: a model stopped on the end tag)
            try:
                call = self.body_call(text[b:], complete=final)
            except Invalid:
                content.append(self._content(text[s:], final))
                break
            if call is not None:
                calls.append(call)
            break
        return Scan("".join(content), calls)
