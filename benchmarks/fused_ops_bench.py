"""Fused elementwise ops: our Triton kernels vs torch.compile of the same torch references (the issue's "Triton or
torch.compile — measure which"), and the plain eager references for scale.

Ops, at the shapes a decode step (1 and 128 tokens) and a prefill chunk (512 tokens) give them, for the Qwen3-0.6B
and Llama-3.1-8B shapes in bf16:
  add_rms_norm   fused_ops.rms_norm(x, w, eps, residual)        vs rms_norm_ref
  silu_and_mul   fused_ops.silu_and_mul(gate_up)                vs silu_and_mul_ref
  rotary         fused_ops.apply_rotary(q, k, positions, cache) vs apply_rotary_ref
  qk_prologue    attention_prologue.qk_norm_rope_store (q/k norm + rotary + K/V write, one kernel) vs its reference
Times come from CUDA-graph replays of back-to-back calls (gemv_bench.graph_time_us), as in the engine, where every
decode step is a graph. torch.compile runs with default options on fixed shapes, compiled before the timing. Each
compiled result is checked against the Triton one first. Prints a markdown table, writes JSON (--out).

    python -m benchmarks.fused_ops_bench --out /tmp/fused_ops.json
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from benchmarks import write_json
from benchmarks.gemv_bench import graph_time_us
from kestrel.attention import torch_ref
from kestrel.layers import fused_ops
from kestrel.layers.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref

MODELS = {  # hidden, intermediate, q heads, kv heads, head_dim
    "qwen3-0.6b": (1024, 3072, 16, 8, 128),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128),
}
TOKENS = (1, 128, 512)
EPS = 1e-6
BLOCK_SIZE = 16


def make_ops(model: str, tokens: int, device: torch.device, dtype: torch.dtype
             ) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """op name -> (Triton call, reference call) on fresh random inputs of one shape."""
    hidden, inter, hq, hkv, d = MODELS[model]
    gen = torch.Generator(device=device).manual_seed(tokens)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    x, residual, norm_w = rand(tokens, hidden), rand(tokens, hidden), 1 + rand(hidden, scale=0.1)
    gate_up = rand(tokens, 2 * inter)
    positions = torch.arange(100, 100 + tokens, device=device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.arange(4096, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)          # [max_pos, D] = [cos | sin] fp32
    qkv = rand(tokens, (hq + 2 * hkv) * d)
    q, k = qkv[:, :hq * d].reshape(tokens, hq, d), qkv[:, hq * d:(hq + hkv) * d].reshape(tokens, hkv, d)
    q_rot, k_rot = q.clone(), k.clone()
    q_norm_w, k_norm_w = 1 + rand(d, scale=0.1), 1 + rand(d, scale=0.1)
    blocks = -(-tokens // BLOCK_SIZE)
    caches = [torch.zeros(blocks, BLOCK_SIZE, hkv, d, device=device, dtype=dtype) for _ in range(4)]
    slots = torch.arange(tokens, device=device)
    prologue_args = (q_norm_w, k_norm_w, EPS, positions, cos_sin)
    heads = (hq, hkv, d)
    return {
        "add_rms_norm": (lambda: fused_ops.rms_norm(x, norm_w, EPS, residual),
                         lambda: fused_ops.rms_norm_ref(x, norm_w, EPS, residual)),
        "silu_and_mul": (lambda: fused_ops.silu_and_mul(gate_up), lambda: fused_ops.silu_and_mul_ref(gate_up)),
        # The Triton rotary works in place on its own copies (rotated again at every timed call: the same work,
        # and no copy kernels in its time); the first call, the one checked, sees the original values.
        "rotary": (lambda: fused_ops.apply_rotary(q_rot, k_rot, positions, cos_sin),
                   lambda: fused_ops.apply_rotary_ref(q, k, positions, cos_sin)),
        # The reference's K/V write without the padding filter (boolean indexing syncs, so it cannot be captured).
        "qk_prologue": (lambda: qk_norm_rope_store(qkv, *prologue_args, caches[0], caches[1], slots, *heads),
                        lambda: qk_norm_rope_store_ref(qkv, *prologue_args, caches[2], caches[3], slots, *heads,
                                                       store_kv=torch_ref.store_kv_unpadded)),
    }


def first_tensors(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def bench(models: list[str], tokens: tuple[int, ...], save: Callable[[list[dict]], None],
          ops: set[str] | None = None) -> list[dict]:
    """ops: the names of make_ops to time (None: all)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for model in models:
        for t in tokens:
            for name, (triton_call, ref_call) in make_ops(model, t, device, dtype).items():
                if ops is not None and name not in ops:
                    continue
                compiled = torch.compile(ref_call, dynamic=False)   # one compiled object per shape: no recompiles
                for got, want in zip(first_tensors(compiled()), first_tensors(triton_call())):
                    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
                row = {"model": model, "tokens": t, "op": name,
                       "triton_us": graph_time_us(lambda i: triton_call()),
                       "compiled_us": graph_time_us(lambda i: compiled()),
                       "eager_us": graph_time_us(lambda i: ref_call())}
                rows.append(row)
                save(rows)   # after every row: a run cut short by its time limit still leaves what it measured
                print(f"| {model} | {t} | {name} | {row['triton_us']:.2f} | {row['compiled_us']:.2f} | "
                      f"{row['eager_us']:.2f} | {row['compiled_us'] / row['triton_us']:.2f}x |", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--out", default=None)
    ap.add_argument("--ops", default=None, help="comma-separated op names to time (default: all), e.g. "
                    "rotary,qk_prologue: the rows session 5's run did not reach or timed unfairly")
    args = ap.parse_args()
    print("| model | tokens | op | Triton us | torch.compile us | eager us | compile / Triton |")
    print("|---|---|---|---|---|---|---|")

    def save(rows: list[dict]) -> None:
        write_json(args.out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})

    bench(args.models.split(","), tuple(int(t) for t in args.tokens.split(",")), save,
          set(args.ops.split(",")) if args.ops else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
