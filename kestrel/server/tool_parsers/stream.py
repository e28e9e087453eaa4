"""One choice's output as a stream of OpenAI deltas: content fragments and tool-call fragments.

    first fragment of call i:  {"index": i, "id": "call_...", "type": "function",
                                "function": {"name": "f", "arguments": "" or a prefix}}
    later fragments:           {"index": i, "function": {"arguments": "...more..."}}

The parser re-scans the text so far on every delta and the stream sends what grew. Trailing whitespace of the content
waits for what follows it: when only calls follow, the non-streamed answer has no content (None), and the stream
must not have sent the whitespace either."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.arguments_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content and the tool-call fragments that `delta` settles (`final`: the output ended)."""
        self.text += delta
        if not delta and not final:
            return "", []
        scan = self.parser.scan(self.text, final)
        has_calls = self.called or any(c.name is not None for c in scan.calls)
        if final:
            visible = scan.content if scan.content.strip() or not has_calls else ""
        else:
            visible = scan.content.rstrip()
        content = visible[self.content_sent:]
        self.content_sent = max(self.content_sent, len(visible))
        fragments = []
        for i, call in enumerate(scan.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(self.parser.new_call_id())
                self.arguments_sent.append(len(call.arguments))
                fragments.append({"index": i, "id": self.ids[i], "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.arguments_sent[i]:
                fragments.append({"index": i, "function": {"arguments": call.arguments[self.arguments_sent[i]:]}})
                self.arguments_sent[i] = len(call.arguments)
        return content, fragments
