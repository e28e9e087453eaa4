"""How well a drafter drafts for its target, measured through the serving path (the engine with speculation on,
greedy), on prompts it was not trained on.

    acceptance rate       accepted drafts / drafted tokens
    acceptance length     tokens a verify step yields: 1 + accepted drafts per verify step (SGLang's
                          "accept length", vLLM's "mean acceptance length")
    per position          the share of verify steps whose draft at position i was accepted (i = 1 .. K)
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams
from kestrel.train.budget import Pacer
from kestrel.train.data import Prompt
from kestrel.train.generation import Job, generate_until


@dataclass(slots=True)
class DraftEvaluation:
    method: str
    num_speculative_tokens: int
    topk: int
    prompts: int
    output_tokens: int
    verify_steps: int
    acceptance_rate: float
    acceptance_length: float
    per_position: list[float]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        positions = " ".join(f"{p:.2f}" for p in self.per_position)
        return (f"{self.method} K={self.num_speculative_tokens} topk={self.topk}: acceptance length "
                f"{self.acceptance_length:.2f}, rate {self.acceptance_rate:.2f}, per position [{positions}] over "
                f"{self.verify_steps} verify steps, {self.output_tokens} tokens, {self.prompts} prompts")


def evaluate_drafter(target: str | None, prompts: list[Prompt], drafter: str | None = None, method: str = "eagle3",
                     num_speculative_tokens: int = 3, topk: int = 1, max_new_tokens: int = 256,
                     deadline: float | None = None, **engine_kwargs: Any) -> DraftEvaluation:
    """Greedy generation of every prompt with speculation at a fixed depth (adaptive depth off, so every verify
    step drafts K and the figures describe the drafter, not the policy). `deadline` (time.monotonic()): stop
    before a step that would end past it; the figures then cover the steps that ran."""
    from kestrel.llm import LLM
    from kestrel.train.target import Target

    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": num_speculative_tokens, "topk": topk,
                            "adaptive": False}
    if method == "eagle3":
        spec["model"] = drafter
    llm = LLM(target, speculative_config=spec, **engine_kwargs)
    try:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        tokenized = Target(llm)
        jobs = [Job(i, tokenized.prompt_ids(p), params) for i, p in enumerate(prompts)]
        done: list[Job] = []
        progress = Progress(log_interval_s=5.0, log=logging.getLogger("kestrel.train"))
        progress.begin("held_out_measurement", total=len(jobs), unit="prompts")

        def finished(job: Job) -> None:
            done.append(job)
            progress.update(len(done))

        cut = generate_until(llm._require_engine(), jobs, len(jobs), Pacer(deadline), finished)
        stats = llm._require_engine().stats()
    finally:
        llm.shutdown()
    steps, drafted, accepted = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    per_pos = list(stats.spec_accepted_per_pos) + [0] * max(0, num_speculative_tokens -
                                                             len(stats.spec_accepted_per_pos))
    return DraftEvaluation(
        method=method, num_speculative_tokens=num_speculative_tokens, topk=topk, prompts=len(prompts),
        output_tokens=sum(len(j.tokens[0]) for j in done + cut), verify_steps=steps,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        acceptance_length=1 + accepted / steps if steps else 1.0,
        per_position=[a / steps if steps else 0.0 for a in per_pos[:num_speculative_tokens]])
