"""Proposers: where draft tokens come from. The engine asks each sequence's drafts before a verify step and
tells the proposer what every target step computed, so a model-based drafter can follow along.

    NgramProposer   (speculative/ngram.py) prompt lookup: the tokens that followed the latest earlier occurrence of the context's tail
    Eagle3Proposer  (speculative/eagle3_proposer.py) a one-layer drafter reading the target's hidden states
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from kestrel.batch import ComputedRows, ForwardOutput, SequenceChunk


class DraftSource(Protocol):
    """What a proposer may read of a sequence (the engine's Sequence)."""
    seq_id: int

    @property
    def num_tokens(self) -> int: ...

    def token_ids(self) -> list[int]: ...


class Proposer(ABC):
    # target layers whose input hidden states the proposer reads from every step (ForwardOutput.hidden_states)
    aux_layers: tuple[int, ...] = ()

    @abstractmethod
    def drafts(self, seq: DraftSource, k: int) -> list[int]:
        """Up to k draft tokens to follow the sequence's last token (fewer, or none, when it has no guess)."""

    def candidates(self, seq: DraftSource) -> list[list[int]] | None:
        """Tree drafting: each drafting step's top-k tokens (steps[d][0] the chain's), or None when it has none."""
        return None

    def observe(self, rows: list[ComputedRows], output: ForwardOutput) -> None:
        """A target step finished: `rows` say what it computed for the sequences this proposer follows."""

    def verify_greedy_and_draft(self, chunks: list[SequenceChunk], drafts: list[list[int]], output: ForwardOutput
                                ) -> list[tuple[int, list[int], list[list[int]]]] | None:
        """A greedy chain verify step that just launched (chunk b: [last token, drafts[b], padding]): verify it and
        draft the next step's tokens on the device, read back once, as each chunk's (accepted drafts n, the n + 1
        new tokens, the drafting steps' top-k tokens after them); None when this proposer cannot (the caller then
        verifies and calls observe)."""
        return None

    def keep_drafts(self, seq_id: int, num_tokens: int, steps: list[list[int]]) -> None:
        """After verify_greedy_and_draft: the drafting steps the sequence (now of num_tokens tokens) may use; []
        for none."""

    def forget(self, seq_id: int) -> None:
        """The sequence finished."""
