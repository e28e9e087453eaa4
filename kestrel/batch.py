"""What one forward pass takes and gives.

    SequenceChunk (host)  one sequence's query tokens for this step, as the engine hands them to the runner
    ForwardBatch (device) the tensors the model and the attention backend read; every road through the runner
                          (eager, decode graphs, prefill graphs) builds one and runs the same model forward on it
    ForwardOutput         logits at the asked positions, argmax tokens where a graph computed them, and the
                          hidden states entering chosen layers
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


PREVIOUS_TOKEN = -1   # a query token -1 - i is token i of the previous launch's output, still on the device


def previous_token(index: int) -> int:
    """The query-token value that stands for token `index` of the previous graph launch's output."""
    return -1 - index


@dataclass(slots=True)   # not frozen: built for every sequence of every step, and a frozen init costs more
class SequenceChunk:
    """One sequence's part of a step: query tokens at positions start, start + 1, ...; its blocks hold them."""
    seq_id: int
    tokens: list[int]          # a negative entry is previous_token(i): only the decode graphs take those
    start: int
    block_ids: list[int]       # the sequence's block list (not copied: read before the step returns)
    generation: int = 0        # the sequence's preemption count: its blocks were replaced when it changes
    wants_logits: bool = True  # the last token's logits (a prompt chunk that does not finish its prompt: no)
    all_logits: bool = False   # logits at every query token (a speculative verify step: the last token + drafts)
    # A tree verify step (forward/draft_tree.py): query token i sits at cache index start + i but rotary position
    # start + depths[i], and sees the keys tree_mask[i] allows among the step's tokens (attention/base.py)
    depths: list[int] | None = None
    tree_mask: torch.Tensor | None = None   # [len(tokens), len(tokens)] bool


@dataclass(slots=True)
class ForwardBatch:
    # Sequences are laid out back to back: sequence s owns query tokens
    #   input_ids[query_start_loc[s] : query_start_loc[s + 1]]
    # and its K/V for position p lives in the paged cache at
    #   block_table[s, p // block_size], offset p % block_size.
    input_ids: torch.Tensor        # [T] int64, all query tokens of all sequences, concatenated
    positions: torch.Tensor        # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    kv_lens: torch.Tensor          # [S] int32, tokens in the cache after this step (new ones included)
    block_table: torch.Tensor      # [S, max_blocks] int32, physical block ids, -1 padded
    slot_mapping: torch.Tensor     # [T] int64, flat cache slot of each new token; -1 means do not write
    logits_at: torch.Tensor | None  # [num_outputs] int64, token indices whose logits are wanted; None: every
                                    # token in order (graph runners: no gather kernel in the step)
    max_query_len: int             # host-side copies so kernels need no device->host sync
    max_kv_len: int
    capture_hidden_layers: tuple[int, ...] = ()  # layers whose *input* hidden states are returned (EAGLE-3)
    input_embeds: torch.Tensor | None = None     # [T, hidden] when the caller already looked the tokens up
                                                 # (the decode graphs' fused head, kestrel/kernels/triton/step_inputs.py)
    tree_mask: torch.Tensor | None = None        # [S, max_query_len, max_query_len] bool, a tree verify step's
                                                 # step-key visibility (attention/base.py draws it); None: causal

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token (the shape CUDA graphs capture)."""
        return self.max_query_len == 1

    def to(self, device: torch.device) -> "ForwardBatch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=move(self.input_ids), positions=move(self.positions),
            query_start_loc=move(self.query_start_loc), kv_lens=move(self.kv_lens),
            block_table=move(self.block_table), slot_mapping=move(self.slot_mapping),
            logits_at=move(self.logits_at), max_query_len=self.max_query_len, max_kv_len=self.max_kv_len,
            capture_hidden_layers=self.capture_hidden_layers, input_embeds=move(self.input_embeds),
            tree_mask=move(self.tree_mask),
        )


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor                       # [num_outputs, vocab] float32
    hidden_states: dict[int, torch.Tensor]     # layer -> [T, hidden], for capture_hidden_layers
    tokens: torch.Tensor | None = None         # [num_outputs] int64 argmax on the device (graph roads), or None
    # (graphs, bucket) when a DecodeGraphs launch made this output: its full-bucket tensors are graphs.outputs[bucket]
    replayed: tuple[object, int] | None = None


def chunks_to_batch(chunks: list[SequenceChunk], block_size: int,
                    capture_hidden_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """The eager road's ForwardBatch (on the CPU) for a step's chunks."""
    batch = build_forward_batch([c.tokens for c in chunks], [c.start for c in chunks],
                                [c.block_ids for c in chunks], block_size, [c.wants_logits for c in chunks],
                                capture_hidden_layers, [c.all_logits for c in chunks])
    if any(c.depths is not None for c in chunks):
        batch.positions = torch.tensor([c.start + (c.depths[i] if c.depths is not None else i)
                                        for c in chunks for i in range(len(c.tokens))], dtype=torch.int64)
        q = batch.max_query_len
        mask = torch.ones(len(chunks), q, q, dtype=torch.bool).tril()   # a chunk without a tree: causal
        for s, c in enumerate(chunks):
            if c.tree_mask is not None:
                n = len(c.tokens)
                mask[s, :n, :n] = c.tree_mask
        batch.tree_mask = mask
    return batch


def build_forward_batch(
    token_ids: list[list[int]],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    want_logits: list[bool] | None = None,
    capture_hidden_layers: tuple[int, ...] = (),
    all_logits: list[bool] | None = None,
) -> ForwardBatch:
    """Assemble a ForwardBatch on the CPU from per-sequence query tokens.

    token_ids[s] are the new tokens of sequence s, at positions start_positions[s] + i. When want_logits is
    given, only sequences with True contribute their last token's logits; a sequence with all_logits[s] True
    contributes every token's, in order.
    """
    num_seqs = len(token_ids)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    kv_lens: list[int] = []
    logits_at: list[int] = []
    for s in range(num_seqs):
        toks, start, blocks = token_ids[s], start_positions[s], block_tables[s]
        assert len(toks) > 0, "a sequence in a batch needs at least one query token"
        for i, tok in enumerate(toks):
            pos = start + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        query_start.append(len(input_ids))
        kv_lens.append(start + len(toks))
        if all_logits is not None and all_logits[s]:
            logits_at.extend(range(len(input_ids) - len(toks), len(input_ids)))
        elif want_logits is None or want_logits[s]:
            logits_at.append(len(input_ids) - 1)
    max_blocks = max(len(b) for b in block_tables)
    table = torch.full((num_seqs, max(max_blocks, 1)), -1, dtype=torch.int32)
    for s, blocks in enumerate(block_tables):
        if blocks:
            table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_at=torch.tensor(logits_at, dtype=torch.int64),
        max_query_len=max(len(t) for t in token_ids),
        max_kv_len=max(kv_lens),
        capture_hidden_layers=capture_hidden_layers,
    )


@dataclass(slots=True)
class ComputedRows:
    """One sequence's part of a finished target step: positions start .. start + count - 1 were computed (their
    K/V are in the cache), and `next_tokens[i]` is the token that now follows position start + i. The step's
    hidden-state rows for them are hidden_offset .. hidden_offset + count - 1."""
    seq_id: int
    start: int
    count: int
    next_tokens: list[int]
    block_ids: list[int]
    hidden_offset: int
    draft: int   # drafts to propose for the sequence's next verify step (0: none; its blocks cover them)
    hidden_rows: list[int] | None = None   # the step's hidden-state row of each position when they are not
                                           # consecutive from hidden_offset (a tree's accepted path)

    def rows(self) -> list[int]:
        """The step's hidden-state row of each computed position."""
        if self.hidden_rows is not None:
            return self.hidden_rows
        return list(range(self.hidden_offset, self.hidden_offset + self.count))
