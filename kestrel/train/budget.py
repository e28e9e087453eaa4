"""`--time-limit` as a budget for the whole run of `kestrel train-eagle3`, split between its phases.

The limit counts from the moment the command starts working (before the target loads) and covers everything:

    load the target | answers (the target generates)   | states (forward)  | training            | save | eval
    0               ...  ANSWER_SHARE x limit (default)  ... half of what is left ... limit - save reserve ... limit

    answers   stop at ANSWER_SHARE of the limit (or --max-gen-time after they start, capped at MAX_ANSWER_SHARE of
              the limit), yet run for at least MIN_ANSWER_SHARE of it (within MAX_ANSWER_SHARE) when the loading
              took longer; with --data-only they may use the whole limit. Prompts already answered on disk cost
              nothing, so a rerun spends its time on new answers and on training.
    states    the target's hidden states for the answers: at most half of what is left after the answers.
    training  until the save reserve (the checkpoint and the drafter, sized from the drafter's parameters).
    eval      (the CLI) only after a finished schedule, with what is left.

Every phase stops before starting a unit of work (an engine step, one sequence's forward, an optimizer step) that
would end past its deadline, judged by the last such unit's duration; so the run ends within the limit plus at most
one unit that ran longer than the one before it (MARGIN_NOTE). Loading the target is one unit too: it is not cut.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ANSWER_SHARE = 0.5        # answers stop here unless --max-gen-time asks for another length
MAX_ANSWER_SHARE = 0.9    # --max-gen-time never takes more of the limit: states, training and the save need the rest
MIN_ANSWER_SHARE = 0.1    # but answers get at least this much from their start (a load that took half the limit)
SAVE_FIXED_S = 2.0        # the save reserve: this, plus the bytes written at SAVE_BYTES_PER_S
SAVE_BYTES_PER_S = 200e6  # a slow disk; checkpoints are written whole (tmp file, then renamed)
MARGIN_NOTE = "one engine step, forward or optimizer step longer than the one measured before it"


@dataclass(slots=True)
class Budget:
    """Deadlines (clock seconds) for the phases of one run; None everywhere when there is no limit."""
    limit_s: float | None
    max_answer_s: float | None = None     # --max-gen-time: the answers' own cap, counted from their start
    started: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = time.monotonic

    @property
    def end(self) -> float | None:
        return None if self.limit_s is None else self.started + self.limit_s

    def elapsed(self) -> float:
        return self.clock() - self.started

    def answers_deadline(self, data_only: bool = False) -> float | None:
        """Called as the answers start."""
        now = self.clock()
        ends = []
        if self.max_answer_s is not None:
            ends.append(now + self.max_answer_s)
        if self.limit_s is not None:
            if data_only:
                ends.append(self.end)
            else:
                share = MAX_ANSWER_SHARE if self.max_answer_s is not None else ANSWER_SHARE
                latest = self.started + MAX_ANSWER_SHARE * self.limit_s
                ends.append(min(latest, max(self.started + share * self.limit_s,
                                            now + MIN_ANSWER_SHARE * self.limit_s)))
        return min(ends) if ends else None

    def states_deadline(self) -> float | None:
        """Called as the states start: half of what is left."""
        if self.limit_s is None:
            return None
        now = self.clock()
        return now + max(0.0, self.end - now) / 2

    def train_deadline(self, save_reserve_s: float) -> float | None:
        return None if self.limit_s is None else self.end - save_reserve_s

    def left(self) -> float:
        return math.inf if self.limit_s is None else self.end - self.clock()

    def describe(self, answers_deadline: float | None) -> str:
        limit = "no time limit" if self.limit_s is None else \
            f"time limit {self.limit_s / 60:.1f} min (from the start, loading included)"
        if answers_deadline is None:
            return limit
        return f"{limit}; answers until {(answers_deadline - self.started) / 60:.1f} min into the run"


def save_reserve_s(num_parameters: int) -> float:
    """Seconds kept for the last save: the checkpoint (fp32 weights and AdamW's two moments) and the bf16 drafter."""
    return SAVE_FIXED_S + num_parameters * (3 * 4 + 2) / SAVE_BYTES_PER_S


class Pacer:
    """Whether one more unit of work fits before a deadline, judged by the duration of the last one."""

    def __init__(self, deadline: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline, self.clock = deadline, clock
        self.last_s = 0.0
        self._started: float | None = None
        self.cut = False   # True once fits() said no

    def fits(self) -> bool:
        if self.deadline is not None and self.clock() + self.last_s > self.deadline:
            self.cut = True
        return not self.cut

    def start(self) -> None:
        self._started = self.clock()

    def stop(self) -> None:
        assert self._started is not None
        self.last_s = self.clock() - self._started
        self._started = None
