"""Text side of a sample: incremental detokenization and stop strings, kept off the step path."""
from __future__ import annotations

from kestrel.models.tokenizer import IncrementalDetokenizer, Tokenizer
from kestrel.sampling_params import SamplingParams


class TextAssembler:
    """Feeds a sample's new tokens; yields text deltas and says when a stop string appeared.

    With stop strings, the last (longest stop - 1) characters are held back until they can no longer start a
    stop string, so a streamed client never sees text that is cut off afterwards.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""          # all text so far (truncated at a stop string once one matched)
        self.emitted = 0        # characters of self.text already returned as deltas
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if token_ids:
            search_from = max(0, len(self.text) - self.hold)
            self.text += self.detok.add(token_ids)
            for stop in self.stops:
                at = self.text.find(stop, search_from)
                if at != -1:
                    self.text = self.text[:at]
                    self.stopped = True
        upto = len(self.text) if self.stopped else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta, self.stopped

    def flush(self) -> str:
        """At the end of the sample: whatever was held back."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
