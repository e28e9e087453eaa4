"""Where one request's time to first token goes: a stamp at each point of its path, always on.

    server process                                          engine process
    received ─ parsed ─ tokenized ─ sent ──── pipe ────────► engine_received ─ scheduled ─ forward_done ─ emitted
                                                                                                             │
    written ◄─ detokenized ◄─ delivered ◄──────── pipe ──────────────────────────────────────────────────────┘

Every stamp is time.monotonic() seconds: CLOCK_MONOTONIC on Linux, one clock for the whole host, so stamps taken
in the engine process subtract from stamps taken here. A stamp costs one clock read (~50 ns) and nothing waits
for the device to take one: `forward_done` is the moment the step's tokens were read back to the host, the sync
the engine does anyway.

The stages are consecutive intervals between those stamps, so they add up to `written - received`: the server's
own view of TTFT, which the client sees plus the connection's and its own parsing time. The engine-side stamps
are the first token's; `written` is the first chunk after it, so a first token whose text is held back (part of a
UTF-8 character, a possible stop string) puts the wait for the token that releases it in `sse_write`.
"""
from __future__ import annotations

from dataclasses import dataclass

# (stage, from stamp, to stamp); the metric's `stage` label, in path order
STAGES: tuple[tuple[str, str, str], ...] = (
    ("http_parse", "received", "parsed"),            # body read, JSON validated, sampling params built
    ("tokenize", "parsed", "tokenized"),
    ("submit", "tokenized", "sent"),                 # prompt checked against the limits, its stream made
    ("ipc_to_engine", "sent", "engine_received"),    # "add" pickled and written, the engine's command thread, the core
                                                     # taking it
    ("schedule", "engine_received", "scheduled"),    # waiting for the step that admits it
    ("prefill", "scheduled", "forward_done"),        # the forward pass(es) and sampling, tokens read back
    ("emit", "forward_done", "emitted"),             # stop checks, the step's updates and stats built
    ("ipc_to_server", "emitted", "delivered"),       # pickled, pipe, read by the event loop, routed to the stream
    ("detokenize", "delivered", "detokenized"),      # the handler's task woken, tokens turned into text
    ("sse_write", "detokenized", "written"),         # the chunk's JSON built and handed over to be written
)
STAGE_NAMES = tuple(name for name, _, _ in STAGES)


@dataclass(slots=True)
class FirstTokenTrace:
    """One HTTP request's stamps (time.monotonic() seconds); None until reached. With several prompts or
    samples, the first one to produce a token fills the engine-side stamps."""
    received: float                          # the ASGI app was called: request line and headers parsed
    parsed: float | None = None
    tokenized: float | None = None
    sent: float | None = None                # the "add" command is about to be written to the engine's pipe
    engine_received: float | None = None     # the engine core took it (Sequence.arrival_time)
    scheduled: float | None = None           # first scheduled (Sequence.first_scheduled_time)
    forward_done: float | None = None        # first token read back to the host (Sequence.first_token_time)
    emitted: float | None = None             # the step's event about to be sent
    delivered: float | None = None           # the event loop read that event
    detokenized: float | None = None         # the first Delta was assembled
    written: float | None = None             # the first chunk carrying text was handed to the transport

    def engine_reached(self, engine_stamps: tuple[float, float, float | None], emitted: float,
                       delivered: float) -> None:
        """The first step event that carries this request's first update."""
        self.engine_received, self.scheduled, self.forward_done = engine_stamps
        self.emitted, self.delivered = emitted, delivered

    def stages(self) -> dict[str, float]:
        """Seconds per stage, for the stages whose both ends were stamped."""
        out = {}
        for name, start, end in STAGES:
            a, b = getattr(self, start), getattr(self, end)
            if a is not None and b is not None:
                out[name] = b - a
        return out
