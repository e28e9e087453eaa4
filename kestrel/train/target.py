"""The target model during training, served by Kestrel itself: it writes the answers (through the engine, with
its chat template and sampler) and gives the states the drafter learns from (through the model runner, the same
forward that serving runs, so the drafter trains on exactly the hidden states it will read when serving).

Per training sequence of T tokens, kept on the training device:

    input_ids     [T]          int64
    loss_mask     [T]          bool: token p is part of the target's answer
    aux           [T, 3 Ht]    the hidden states entering the aux layers (the drafter's fc input)
    final         [T, Ht]      the final-norm hidden state; final @ lm_head[draft_ids].T = the target's logits
                               over the draft vocabulary, computed per batch instead of stored ([T, 49k] a token)
    best          [T]          int64: the target's argmax over its whole vocabulary (the loss mask needs it)
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel.batch import build_forward_batch
from kestrel.forward.runner import kv_layout
from kestrel.llm import LLM
from kestrel.sampling_params import SamplingParams
from kestrel.train.data import Prompt, Sample

logger = logging.getLogger("kestrel.train")

# prompts handed to the engine at once: enough to fill a batch, few enough that progress shows every few seconds
# (a CPU step of 256 sequences takes seconds)
GENERATE_CHUNK = {"cuda": 256, "cpu": 64}


@dataclass(slots=True)
class SequenceFeatures:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    best: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


class Target:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        engine = llm._require_engine()
        self.runner = engine.runner
        self.config = self.runner.cfg
        self.tokenizer = llm.tokenizer
        self.max_model_len = engine.max_model_len

    # ---- answers --------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.messages is not None:
            if not self.tokenizer.has_chat_template:   # a base model: the messages' text, completed as is
                return self.tokenizer.encode("\n\n".join(str(m["content"]) for m in prompt.messages))
            return self.tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True)
        return self.tokenizer.encode(prompt.text or "")

    def unconditional_prompts(self, n: int, seed: int, min_len: int = 8, max_len: int = 48) -> list[Prompt]:
        """n openings sampled from the target itself (temperature 1 from BOS): data for a model with no chat
        template and no dataset at hand."""
        rng = random.Random(seed)
        bos = [] if self.tokenizer.bos_token_id is None else [int(self.tokenizer.bos_token_id)]
        params = [SamplingParams(max_tokens=rng.randint(min_len, max_len), temperature=1.0, seed=seed + i,
                                 ignore_eos=True) for i in range(n)]
        outs = self.llm.generate([list(bos) or [0]] * n, params)
        return [Prompt(token_ids=tuple((bos or [0]) + o.outputs[0].token_ids)) for o in outs]

    def answer(self, prompts: list[Prompt], max_new_tokens: int, temperature: float, samples_per_prompt: int,
               seed: int, max_len: int, on_progress: Callable[[int], None] | None = None) -> list[Sample]:
        """The target's own answers: each prompt's tokens then up to max_new_tokens generated ones (its EOS kept:
        the drafter learns where answers end too). Prompts that leave no room for a whole answer within max_len
        training tokens (or the context) are skipped: their answer would be cut, and one very long prompt slows
        every step of the batch it joins."""
        samples: list[Sample] = []
        room = min(self.max_model_len, max_len) - max_new_tokens
        todo = [(i, ids) for i, ids in enumerate(self.prompt_ids(p) for p in prompts) if 0 < len(ids) <= room]
        size = GENERATE_CHUNK.get(self.runner.device.type, 64)
        for start in range(0, len(todo), size):
            chunk = todo[start:start + size]
            params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, n=samples_per_prompt,
                                     seed=None if temperature == 0 else seed + i) for i, _ in chunk]
            for (_, ids), out in zip(chunk, self.llm.generate([ids for _, ids in chunk], params)):
                for completion in out.outputs:
                    if completion.token_ids:
                        samples.append(Sample(tuple(ids) + tuple(completion.token_ids), len(ids)))
            if on_progress is not None:
                on_progress(len(chunk))
        if len(todo) < len(prompts):
            logger.info("skipped %d of %d prompts longer than %d tokens", len(prompts) - len(todo), len(prompts),
                        room)
        return samples

    # ---- states ---------------------------------------------------------------------------------------------
    def embedding(self) -> torch.Tensor:
        return self.runner.model.embed_tokens.weight.detach()

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), Ht]: the target's output projection for those ids."""
        return self.runner.model.lm_head.weight.detach().index_select(0, ids.to(self.runner.device))

    @torch.inference_mode()
    def features(self, sample: Sample, aux_layer_ids: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype) -> SequenceFeatures:
        """One forward of the sequence through the runner on a KV cache of its own (the engine's blocks may hold
        prefix-cache entries), capturing the aux layers' inputs."""
        runner = self.runner
        cfg, bs = self.config, runner.block_size
        ids = list(sample.token_ids)
        blocks = -(-len(ids) // bs)
        planes, heads, width = kv_layout(cfg)
        kv = torch.zeros(cfg.num_layers, planes, blocks, bs, heads, width, dtype=runner.dtype, device=runner.device)
        batch = build_forward_batch([ids], [0], [list(range(blocks))], bs,
                                    capture_hidden_layers=tuple(aux_layer_ids)).to(runner.device)
        batch.logits_at = None   # every position
        runner.backend.prepare(batch)
        final, captured = runner.model(batch, runner.backend, [tuple(kv[i].unbind(0)) for i in range(cfg.num_layers)])
        best = runner.model.compute_logits(final, to_float=False).argmax(dim=-1)
        aux = torch.cat([captured[j] for j in aux_layer_ids], dim=-1)
        loss_mask = torch.zeros(len(ids), dtype=torch.bool)
        loss_mask[sample.num_prompt_tokens:] = True
        return SequenceFeatures(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device), loss_mask=loss_mask.to(device),
            aux=aux.to(device=device, dtype=dtype), final=final.to(device=device, dtype=dtype),
            best=best.to(device))
