"""What a speculative verify step costs besides its model forwards: device->host syncs, eager torch ops (kernel
launches outside graph replays) and host-to-device copies per step, and the step's pure-Python time.

On a small target (SmolLM2-135M: a 0.46 ms decode step on an H100) these fixed costs decide whether speculation
pays; this counts them on any device, so a CPU run predicts the GPU's overhead. The default: the default model
(kestrel-tiny) and its shipped drafter, greedy, a K = 3 EAGLE-3 chain at a fixed depth, one sequence.

The CPU has no graphs, so the script installs the GPU's roads (the verify graphs' and the drafter graphs' bodies,
run eagerly) and counts nothing inside those bodies: on CUDA each is one replay. On CUDA it also reports the
per-phase wall time of SpeculativeDecoding.timing (synchronized laps).

    python -m benchmarks.spec_step_overhead [--model DIR --drafter DIR] [--k 3] [--out overhead.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def fibonacci(n):\n",
           "Once upon a time, in a land far away,"]
# ops that read a device value on the host (each a sync on CUDA)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave"}
# no kernel: an allocation or metadata
NO_KERNEL_OPS = {"empty", "empty_strided", "empty_like", "detach", "alias", "detach_", "lift_fresh", "lift_fresh_copy",
                 "_unsafe_view", "set_", "resize_", "record_stream", "_to_copy_no_op"}


class StepCounter(TorchDispatchMode):
    """Counts, outside `paused` regions (graph bodies: one replay on CUDA), the torch ops the host launches."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.paused = 0
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.h2d = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs[name] += 1
        if name in ("lift_fresh", "lift_fresh_copy"):   # torch.tensor(host list): one copy to the device
            self.h2d += 1
        elif name == "copy_" and self.device.type != "cuda":   # the CPU's only copies: graph inputs, H2D on CUDA
            self.h2d += 1
        elif name in ("_to_copy", "copy_") and self._host_to_device(args, out):
            self.h2d += 1
        elif name in ("_to_copy", "copy_") and self.device.type == "cuda" and self._device_to_host(args, out):
            self.syncs["copy_to_host"] += 1
        elif not func.is_view and name not in NO_KERNEL_OPS and self._on_device(args, out):
            self.ops[name] += 1
        return out

    def _tensors(self, args, out) -> list[torch.Tensor]:
        flat = list(args) + (list(out) if isinstance(out, (tuple, list)) else [out])
        return [t for t in flat if isinstance(t, torch.Tensor)]

    def _on_device(self, args, out) -> bool:
        return any(t.device.type == self.device.type for t in self._tensors(args, out))

    def _host_to_device(self, args, out) -> bool:
        if self.device.type != "cuda":
            return False
        src = [t for t in args if isinstance(t, torch.Tensor)]
        dst = out if isinstance(out, torch.Tensor) else None
        return bool(src) and dst is not None and src[-1].device.type == "cpu" and dst.device.type == "cuda"

    def _device_to_host(self, args, out) -> bool:
        src = [t for t in args if isinstance(t, torch.Tensor)]
        dst = out if isinstance(out, torch.Tensor) else None
        return bool(src) and dst is not None and src[-1].device.type == "cuda" and dst.device.type == "cpu"

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def install_graph_roads(llm: LLM, k: int) -> None:
    """On the CPU: the verify graphs' and drafter graphs' bodies, run eagerly (the GPU road's host side)."""
    from kestrel.forward.decode_graphs import DecodeGraphs
    from kestrel.forward.drafter_graphs import DrafterGraphs

    runner, spec = llm.engine.runner, llm.engine.spec
    if runner.verify_graphs is None:
        runner.verify_graphs = DecodeGraphs(runner, max_bs=8, max_blocks_per_seq=128, max_rows=64, query_len=k + 1)
    proposer = spec.proposer
    if getattr(proposer, "drafter", None) is not None and proposer.graphs is None:
        proposer.graphs = DrafterGraphs(proposer.drafter, type(runner.backend)(), proposer.kv, runner.verify_graphs,
                                        k)


def wrap(obj: Any, name: str, around: Callable[[Callable, tuple, dict], Any]) -> None:
    original = getattr(obj, name)
    setattr(obj, name, lambda *a, **kw: around(original, a, kw))


class Probe:
    """Patches the engine so each verify step's syncs, ops and host time can be read: graph bodies (one replay on
    CUDA) are paused and timed apart; tolist() on a device tensor counts as a sync."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.device = self.engine.device
        self.counter: StepCounter | None = None
        self.body_s = 0.0
        self.tolists = 0
        runner, proposer = self.engine.runner, self.engine.spec.proposer
        bodies = [(runner.verify_graphs, "_graph_body")]
        if getattr(proposer, "graphs", None) is not None:
            bodies.append((proposer.graphs, "_body"))
        for obj, name in bodies:
            if self.device.type != "cuda":   # on CUDA the bodies are replays: nothing to exclude
                wrap(obj, name, self._body)
        self._tolist = torch.Tensor.tolist

    def _body(self, fn, args, kwargs):
        t0 = time.perf_counter()
        if self.counter is None:
            out = fn(*args, **kwargs)
        else:
            with self.counter.pause():
                out = fn(*args, **kwargs)
        self.body_s += time.perf_counter() - t0
        return out

    @contextmanager
    def counting(self) -> Iterator[StepCounter]:
        probe, tolist = self, self._tolist

        def counted_tolist(t: torch.Tensor):
            if probe.counter is not None and not probe.counter.paused and t.device.type == probe.device.type:
                probe.tolists += 1
                with probe.counter.pause():   # its copy to the host is this one sync
                    return tolist(t)
            return tolist(t)

        self.counter = StepCounter(self.device)
        torch.Tensor.tolist = counted_tolist
        try:
            with self.counter:
                yield self.counter
        finally:
            torch.Tensor.tolist = tolist
            self.counter = None


def run_steps(llm: LLM, prompt: str, max_tokens: int, per_step: Callable[[], None] | None = None) -> int:
    """Generate greedily step by step; per_step() wraps each verify step's engine.step(). Returns verify steps."""
    engine = llm.engine
    ids = engine.tokenizer.encode(prompt)
    engine.add_request(f"probe-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                            ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        verify = engine.spec.wants_step() if engine.spec is not None else False
        if verify and per_step is not None and not engine.scheduler.waiting:
            steps += 1
            per_step()
        else:
            engine.step()
    return steps


def measure(llm: LLM, max_tokens: int) -> dict:
    engine, spec = llm.engine, llm.engine.spec
    probe = Probe(llm)
    for p in PROMPTS[:1]:   # warm
        run_steps(llm, p, 16)

    # counts: each verify step under the dispatch counter
    totals: Counter[str] = Counter()
    syncs: Counter[str] = Counter()
    h2d = 0
    probe.tolists = 0

    def counted() -> None:
        nonlocal h2d
        with probe.counting() as c:
            engine.step()
        totals.update(c.ops)
        syncs.update(c.syncs)
        h2d += c.h2d

    before = (spec.counters.num_drafts, spec.counters.num_accepted_tokens)
    steps = sum(run_steps(llm, p, max_tokens, counted) for p in PROMPTS)
    drafts = spec.counters.num_drafts - before[0]
    accepted = spec.counters.num_accepted_tokens - before[1]

    # host time: each verify step's wall time less its model forwards (graph bodies), no counter attached
    host_s, wall_s = 0.0, 0.0

    def timed() -> None:
        nonlocal host_s, wall_s
        probe.body_s = 0.0
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        wall_s += dt
        host_s += dt - probe.body_s

    timed_steps = sum(run_steps(llm, p, max_tokens, timed) for p in PROMPTS)
    result = {
        "verify_steps": steps,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_step": {
            "syncs": (sum(syncs.values()) + probe.tolists) / steps,
            "sync_kinds": {"tolist": probe.tolists / steps, **{k: v / steps for k, v in syncs.items()}},
            "eager_ops": sum(totals.values()) / steps,
            "h2d_copies": h2d / steps,
            "ops": {k: round(v / steps, 2) for k, v in totals.most_common()},
            "wall_ms": 1000 * wall_s / timed_steps,
        },
    }
    if engine.device.type != "cuda":   # on CUDA the forwards are replays inside the wall time: not separable here
        result["per_step"]["host_ms"] = 1000 * host_s / timed_steps
    if engine.device.type == "cuda":   # the existing synchronized laps
        spec.timing = {}
        run_steps(llm, PROMPTS[0], max_tokens, engine.step)
        n = spec.timing.pop("steps", 1)
        result["phase_ms"] = {k: 1000 * v / n for k, v in spec.timing.items()}
        spec.timing = None
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (kestrel-tiny)")
    ap.add_argument("--drafter", default=None, help="default: the default model's shipped drafter")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kestrel.config import DEFAULT_DRAFTER_DIR

    spec = {"method": "eagle3", "model": args.drafter or str(DEFAULT_DRAFTER_DIR),
            "num_speculative_tokens": args.k, "adaptive": False}
    kw: dict[str, Any] = {"speculative_config": spec}
    if args.device:
        kw["device"] = args.device
    llm = LLM(args.model, **kw)
    install_graph_roads(llm, args.k)
    result = {"device": str(llm.engine.device), "model": args.model or "kestrel-tiny", "k": args.k,
              "date": time.strftime("%Y-%m-%d %H:%M"), **measure(llm, args.max_tokens)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
