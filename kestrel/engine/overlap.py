"""The overlap schedule: launch decode step N+1 before reading step N's tokens back (SGLang's overlap scheduler,
vLLM's async scheduling), so the host's per-step work (scheduling, bookkeeping, detokenizing, sending) runs while
the GPU computes instead of between GPU steps.

It applies to decode steps on the CUDA-graph path whose next tokens need no host-side work on the logits (no
logprobs, no stop tokens to mask under min_tokens), the steady state of bs1 and batched decoding. Greedy rows take
the graph's argmax; when any row samples (temperature, top-k, top-p, min-p), the sampler runs on the device right
after the graph and its tokens overwrite the argmax before they are read back or fed to the next launch:

    host:  launch N | resolve N-1 | launch N+1 | resolve N | launch N+2 | ...
    GPU:        [ step N          ][ step N+1        ][ step N+2 ...

A launched step's new token is not known on the host yet, so each row gets a placeholder token (PLACEHOLDER) at
the end of `output_token_ids`: lengths, block allocation and positions stay exact, and the next launch feeds
that row from the previous step's on-device token (see cuda_graphs.py, `input_src`). Resolving writes the real
token over the placeholder and applies the stop checks one step late; a row that stopped has its extra,
already-launched step discarded (its KV write lands in blocks that are freed after it, on the same stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.engine.request import Sequence

PLACEHOLDER = -1   # a token still being produced on the device


@dataclass(slots=True)
class InflightDecode:
    seqs: list[Sequence]            # rows of the launched step, in row order
    positions: list[int]            # index into each seq's output_token_ids of its placeholder
    host_tokens: torch.Tensor       # [>= len(seqs)] int64, pinned on CUDA: the step's tokens once `done` fired
    done: torch.cuda.Event | None   # recorded after the device-to-host copy (None on the CPU: already done)

    @property
    def rows(self) -> dict[int, int]:
        return {seq.seq_id: i for i, seq in enumerate(self.seqs)}

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens[: len(self.seqs)].tolist()


def steps_to_length_stop(seq: Sequence, max_model_len: int) -> int:
    """Output tokens the sequence may still receive before max_tokens or the context ends it."""
    left = max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - seq.num_output_tokens)
    return left


def overlap_eligible(seq: Sequence, eos_banned: bool) -> bool:
    """Whether this sequence's next token can be produced on the device alone: no logprobs to return, and no stop
    token to mask for min_tokens (`eos_banned`: the engine has tokens it would mask). Greedy or sampled."""
    p = seq.params
    if p.logprobs is not None:
        return False
    return not (p.min_tokens and seq.num_output_tokens < p.min_tokens and eos_banned)


def drop_tokens_from(seq: Sequence, index: int) -> None:
    """Forget output tokens from `index` on (placeholders of launched steps); their KV slots are simply never
    read."""
    del seq.output_token_ids[index:]
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)


def blocks_to_grow(seq: Sequence, block_size: int) -> int:
    """Blocks the sequence needs before its next single-token step."""
    return max(0, -(-seq.num_tokens // block_size) - len(seq.block_ids))
