"""Generation that stops at a deadline: the engine's step loop, kept fed from a stream of jobs.

`LLM.generate` runs a list of prompts to the end. Training data needs more: each answer handed back the moment it
is complete (so it can be written to disk before the next one), the engine kept full as answers finish (a straggler
does not hold back a whole chunk), follow-up jobs (an unconditional opening, then its answer), and a stop before an
engine step that would end past the deadline, aborting what is in flight and handing back its tokens so far.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kestrel.sampling_params import SamplingParams
from kestrel.train.budget import Pacer


@dataclass(slots=True)
class Job:
    key: Any                        # the caller's name for it (a prompt index)
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[list[int]] = field(default_factory=list)   # per sample, filled as the engine produces them


def generate_until(engine, jobs: Iterable[Job], window: int, pacer: Pacer,
                   on_done: Callable[[Job], Job | None]) -> list[Job]:
    """Run `jobs` through `engine` (at most `window` requests in flight) until they are all done or `pacer` says
    the next step would not fit. `on_done(job)` gets each finished job (its `tokens` complete) and may return a
    follow-up job, which runs next. Returns the jobs cut by the deadline, their tokens so far in `tokens`."""
    pending = iter(jobs)
    inflight: dict[str, tuple[Job, set[int]]] = {}   # request id -> (job, indices of its finished samples)
    exhausted = False

    def submit(job: Job) -> None:
        job.tokens = [[] for _ in range(job.params.n)]
        rid = uuid.uuid4().hex
        engine.add_request(rid, job.prompt_ids, job.params)
        inflight[rid] = (job, set())

    while True:
        while not exhausted and len(inflight) < window:
            job = next(pending, None)
            if job is None:
                exhausted = True
            else:
                submit(job)
        if not inflight or not pacer.fits():
            break
        pacer.start()
        updates = engine.step()
        pacer.stop()
        for up in updates:
            entry = inflight.get(up.request_id)
            if entry is None:
                continue
            job, done = entry
            job.tokens[up.index] += up.new_token_ids
            if up.finished:
                done.add(up.index)
            if len(done) == job.params.n:
                del inflight[up.request_id]
                follow = on_done(job)
                if follow is not None:
                    submit(follow)
    cut = [job for job, _ in inflight.values()]
    for rid in list(inflight):
        engine.abort_request(rid)
    while engine.has_unfinished():   # the aborts' last updates (and an overlapped step in flight) drain here
        engine.step()
    return cut
