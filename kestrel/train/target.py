"""The target model during training, served by Kestrel itself: it writes the answers (through the engine, with
its chat template and sampler, into the answer store as they come: answers.py) and gives the states the drafter
learns from (through the model runner, the same forward that serving runs, so the drafter trains on exactly the
hidden states it will read when serving).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kestrel.batch import build_forward_batch
from kestrel.forward.runner import kv_layout
from kestrel.llm import LLM
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams
from kestrel.train.answers import Answered, AnswerStore, prompt_hash
from kestrel.train.budget import Pacer
from kestrel.train.data import Prompt, Sample
from kestrel.train.generation import Job, generate_until

logger = logging.getLogger("kestrel.train")

# prompts in the engine at once (--gen-batch-size): enough to fill a batch, few enough that a step stays short
# (a CPU step of 256 sequences takes seconds, and the deadline is judged step by step)
GENERATE_CHUNK = {"cuda": 256, "cpu": 64}
OPENING = "opening"                # the prompt hash of an opening the target samples itself
OPENING_MIN, OPENING_MAX = 8, 48   # its length in tokens


@dataclass(frozen=True, slots=True)
class AnswerSettings:
    max_new_tokens: int
    temperature: float
    samples_per_prompt: int
    seed: int
    max_len: int                   # training tokens kept per sequence: prompts leaving no room are skipped


@dataclass(slots=True)
class AnswerReport:
    total: int                     # prompts to answer (those that fit)
    reused: int                    # answered by an earlier run (read from the store)
    skipped: int                   # too long for an answer within max_len
    generated: int = 0             # answered by this run
    cut: int = 0                   # cut by the deadline: trained on now, answered again by the next run
    samples: list[Sample] = field(default_factory=list)
    path: Path | None = None       # the store's file

    @property
    def answered(self) -> int:
        return self.reused + self.generated

    @property
    def complete(self) -> bool:
        return self.answered >= self.total


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

    def answer(self, source: list[Prompt] | int, store: AnswerStore, settings: AnswerSettings, pacer: Pacer,
               progress: Progress, window: int | None = None) -> AnswerReport:
        """The target's own answers: each prompt's tokens then up to max_new_tokens generated ones (its EOS kept:
        the drafter learns where answers end too), written to `store` one prompt at a time and read back from it
        by a rerun. `source`: the prompts, or a count of openings the target samples itself (temperature 1 from
        BOS, for a target with no chat template and no dataset). Prompts that leave no room for a whole answer
        within max_len training tokens (or the context) are skipped: their answer would be cut, and one very long
        prompt slows every step of the batch it joins. Stops when `pacer` says the next engine step would end past
        its deadline; answers cut there are trained on by this run but not stored (the next run answers them
        whole)."""
        room = min(self.max_model_len, settings.max_len) - settings.max_new_tokens
        if isinstance(source, int):
            count, ids_of = source, None
            expected = [OPENING] * count   # an opening is decided by its index and the seed (in the store's key)
        else:
            count, ids_of = len(source), [self.prompt_ids(p) for p in source]
            expected = [prompt_hash(ids) for ids in ids_of]
        on_disk = store.load()
        done = {i: a for i, a in on_disk.items()
                if i < count and a.prompt_hash == expected[i] and 0 < len(a.prompt) <= room}
        todo = [i for i in range(count) if i not in done and (ids_of is None or 0 < len(ids_of[i]) <= room)]
        report = AnswerReport(total=len(done) + len(todo), reused=len(done), skipped=count - len(done) - len(todo),
                              path=store.path)
        if done:
            logger.info("%d of %d prompts already answered in %s", len(done), report.total, store.path)

        def answer_job(i: int, ids: list[int]) -> Job:
            params = SamplingParams(max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    n=settings.samples_per_prompt,
                                    seed=None if settings.temperature == 0 else settings.seed + i)
            return Job(("answer", i), ids, params)

        bos = [0] if self.tokenizer.bos_token_id is None else [int(self.tokenizer.bos_token_id)]
        rng = random.Random(settings.seed)
        opening_lens = [rng.randint(OPENING_MIN, OPENING_MAX) for _ in range(count)] if ids_of is None else []

        def jobs():
            for i in todo:
                if ids_of is not None:
                    yield answer_job(i, ids_of[i])
                else:
                    yield Job(("opening", i), bos, SamplingParams(max_tokens=opening_lens[i], temperature=1.0,
                                                                  seed=settings.seed + i, ignore_eos=True))

        def on_done(job: Job) -> Job | None:
            kind, i = job.key
            if kind == "opening":
                ids = bos + job.tokens[0]
                if 0 < len(ids) <= room:
                    return answer_job(i, ids)
                report.skipped += 1
                report.total -= 1
                return None
            answered = Answered(i, expected[i], tuple(job.prompt_ids), tuple(tuple(t) for t in job.tokens))
            store.append(answered)
            done[i] = answered
            report.generated += 1
            progress.update(report.generated)
            return None

        progress.begin("target_answers", total=len(todo), unit="prompts")
        window = window or GENERATE_CHUNK.get(self.runner.device.type, 64)
        try:
            cut = generate_until(self.llm._require_engine(), jobs(), window, pacer, on_done)
        finally:
            store.close()
        for i in sorted(done):
            prompt = done[i].prompt
            report.samples += [Sample(prompt + a, len(prompt)) for a in done[i].answers if a]
        for job in cut:
            if job.key[0] == "answer" and any(job.tokens):
                report.cut += 1
                report.samples += [Sample(tuple(job.prompt_ids) + tuple(t), len(job.prompt_ids))
                                   for t in job.tokens if t]
        if report.skipped:
            logger.info("skipped %d of %d prompts longer than %d tokens", report.skipped, count, room)
        return report

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
