"""FP8 block-scaled matmuls at batch (M = 32 .. 2048 rows) against bf16 on the Llama-3.1-8B's layers (issue #51:
FP8 at 128 concurrent >= 1.25x Kestrel bf16).

    python3 -m benchmarks.fp8_gemm_bench --out fp8_gemm.json          # a CUDA GPU, ~2 minutes with compiles
    python3 -m benchmarks.fp8_gemm_bench --no-sweep --out quick.json   # the roads' defaults only

Per layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and rows M:

    bf16 cublas        F.linear on the bf16 weight: the bf16 engine's road above 16 rows
    w8a16 triton       kernels/triton/fp8_block_gemm.py as before issue 51: FP8 tiles widened to bf16 in registers
    w8a8 triton        the same kernel with quantize_x: x quantized per row and 128-column group in registers,
                       FP8 x FP8 wgmma, both scales on each step's partial sums
    w8a8 scaled_mm     torch._scaled_mm with DeepSeek's 1 x 128 / 128 x 128 block scales (cuBLASLt, CUDA >= 12.9
                       on sm90), x quantized per group by a few torch ops first (their time counted); each of the
                       scale layouts torch might expect is tried, the first whose result matches is timed
    sweep              W8A8 Triton configs around the table's (rows a tile, columns a tile, warps, stages, split-K)

Times as benchmarks/fp8_gemv_bench.py's: a CUDA graph cycling through weight copies larger than twice the L2. The
JSON at --out holds every timing, the errors against a float32 reference, the best W8A8 config per shape and the
per-layer totals (a decode step's matmuls, per M).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import write_json
from benchmarks.fp8_gemv_bench import LAYERS, ROTATE_BYTES, time_us

ROWS = (32, 64, 128, 256, 512, 2048)
SWEEP_ROWS = (64, 128, 256)
BLOCK = (128, 128)


@dataclasses.dataclass
class Operands:
    bf16: list[torch.Tensor]
    fp8: list[torch.Tensor]
    scale: list[torch.Tensor]   # [N / 128, K / 128]


def make_operands(k: int, n: int, seed: int = 0) -> Operands:
    from kestrel.kernels.fp8_quant import quantize_per_block

    g = torch.Generator(device="cuda").manual_seed(seed)
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    bf16 = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            for _ in range(max(2, -(-ROTATE_BYTES // (2 * n * k))))]
    fp8, scale = [], []
    for i in range(copies):
        w8, s = quantize_per_block(bf16[i % len(bf16)].float(), BLOCK)
        fp8.append(w8)
        scale.append(s.contiguous())
    return Operands(bf16, fp8, scale)


def quantize_x_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8, scale [M, K / 128]) per row and 128-column group, in torch ops."""
    m, k = x.shape
    xg = x.float().view(m, k // 128, 128)
    s = xg.abs().amax(-1).clamp(min=1e-12) / 448.0
    return (xg / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k), s


SCALE_LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    # (x_scale [M, K/128], w_scale [N/128, K/128]) -> (scale_a, scale_b) as torch._scaled_mm might want them
    "a_colmajor_b_t": lambda xs, ws: (xs.t().contiguous().t(), ws.t()),
    "a_colmajor_b_t_contig": lambda xs, ws: (xs.t().contiguous().t(), ws.t().contiguous()),
    "a_rowmajor_b_t": lambda xs, ws: (xs.contiguous(), ws.t()),
    "a_colmajor_b": lambda xs, ws: (xs.t().contiguous().t(), ws),
}


def scaled_mm_block(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, layout: str) -> torch.Tensor:
    x8, xs = quantize_x_groups(x)
    a_scale, b_scale = SCALE_LAYOUTS[layout](xs, ws)
    return torch._scaled_mm(x8, w8.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def w8a8_candidates(m: int, n: int, k: int) -> list:
    from kestrel.kernels.triton.fp8_block_gemm import w8a8_config

    base = w8a8_config(m, n, k, BLOCK)
    out = [base]
    for block_m in (32, 64, 128):
        for block_n in (64, 128):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                out.append(dataclasses.replace(base, block_m=block_m, block_n=block_n, num_warps=warps,
                                               num_stages=stages))
    out += [dataclasses.replace(base, split_k=max(1, base.split_k * 2)), dataclasses.replace(base, split_k=1)]
    return list(dict.fromkeys(out))


def describe(cfg) -> str:
    return ",".join(f"{key}={value}" for key, value in dataclasses.asdict(cfg).items())


def bench_shape(name: str, ops: Operands, m: int, sweep: bool, deadline: float) -> dict:
    from kestrel.kernels.fp8_quant import fp8_w8a8_ref
    from kestrel.kernels.triton.fp8_block_gemm import default_config, fp8_block_gemm, w8a8_config

    n, k = ops.fp8[0].shape
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    rec: dict = {"layer": name, "K": k, "N": n, "M": m, "timings": {}, "errors": {}}
    exact = x.float() @ ops.bf16[0].float().T
    w8a8_want = fp8_w8a8_ref(x, ops.fp8[0], ops.scale[0], BLOCK).float()
    rec["errors"]["w8a8_quantization_vs_bf16"] = rel_err(w8a8_want, exact)
    rec["timings"]["bf16_cublas"] = time_us([lambda w=w: F.linear(x, w) for w in ops.bf16])
    rec["errors"]["bf16_cublas"] = rel_err(F.linear(x, ops.bf16[0]), exact)
    rec["timings"]["w8a16_triton"] = time_us([lambda w=w, s=s: fp8_block_gemm(x, w, s, BLOCK)
                                              for w, s in zip(ops.fp8, ops.scale)])
    rec["errors"]["w8a16_triton"] = rel_err(fp8_block_gemm(x, ops.fp8[0], ops.scale[0], BLOCK), exact)
    rec["configs"] = {"w8a16_triton": describe(default_config(m, n, k, BLOCK)),
                      "w8a8_triton": describe(w8a8_config(m, n, k, BLOCK))}
    rec["timings"]["w8a8_triton"] = time_us([lambda w=w, s=s: fp8_block_gemm(x, w, s, BLOCK, quantize_x=True)
                                             for w, s in zip(ops.fp8, ops.scale)])
    got = fp8_block_gemm(x, ops.fp8[0], ops.scale[0], BLOCK, quantize_x=True)
    rec["errors"]["w8a8_triton"] = rel_err(got, exact)
    rec["errors"]["w8a8_triton_vs_its_ref"] = rel_err(got, w8a8_want)
    for layout in SCALE_LAYOUTS:
        try:
            got = scaled_mm_block(x, ops.fp8[0], ops.scale[0], layout)
        except Exception as error:   # noqa: BLE001 - a layout torch refuses
            rec.setdefault("scaled_mm_refused", {})[layout] = str(error).splitlines()[0][:200]
            continue
        err = rel_err(got, w8a8_want)
        rec["errors"][f"scaled_mm_{layout}_vs_w8a8_ref"] = err
        if err < 0.02:
            rec["timings"]["w8a8_scaled_mm"] = time_us([lambda w=w, s=s: scaled_mm_block(x, w, s, layout)
                                                        for w, s in zip(ops.fp8, ops.scale)])
            x8, xs = quantize_x_groups(x)
            a_s, b_s = SCALE_LAYOUTS[layout](xs, ops.scale[0])
            rec["timings"]["w8a8_scaled_mm_gemm_only"] = time_us(
                [lambda w=w, s=s: torch._scaled_mm(x8, w.t(), scale_a=a_s, scale_b=SCALE_LAYOUTS[layout](xs, s)[1],
                                                   out_dtype=torch.bfloat16) for w, s in zip(ops.fp8, ops.scale)])
            rec["scaled_mm_layout"] = layout
            break
    if sweep:
        best = (rec["timings"]["w8a8_triton"], rec["configs"]["w8a8_triton"])
        for cfg in w8a8_candidates(m, n, k)[1:]:
            if time.monotonic() > deadline:
                rec["sweep_cut"] = True
                break
            try:
                us = time_us([lambda w=w, s=s, c=cfg: fp8_block_gemm(x, w, s, BLOCK, config=c, quantize_x=True)
                              for w, s in zip(ops.fp8, ops.scale)])
            except Exception as error:   # noqa: BLE001 - registers / shared memory
                print(f"  {name} M={m} [{describe(cfg)}] failed: {str(error)[:120]}", file=sys.stderr)
                continue
            rec.setdefault("sweep", []).append({"config": describe(cfg), "us": us})
            if us < best[0]:
                best = (us, describe(cfg))
        rec["best_w8a8_triton"] = {"us": best[0], "config": best[1]}
    t = rec["timings"]
    print(f"{name:8s} M={m:4d}  " + "  ".join(f"{road} {us:7.1f}" for road, us in t.items())
          + (f"  best w8a8 {rec['best_w8a8_triton']['us']:.1f} [{rec['best_w8a8_triton']['config']}]"
             if "best_w8a8_triton" in rec else ""), flush=True)
    return rec


def totals(rows: list[dict]) -> dict:
    out: dict = {}
    for rec in rows:
        per_m = out.setdefault(str(rec["M"]), {})
        for road, us in rec["timings"].items():
            per_m[road] = per_m.get(road, 0.0) + us
        if "best_w8a8_triton" in rec:
            per_m["best_w8a8_triton"] = per_m.get("best_w8a8_triton", 0.0) + rec["best_w8a8_triton"]["us"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--no-sweep", action="store_true", help="the default configs only")
    parser.add_argument("--budget-s", type=float, default=150.0, help="no new sweep candidate after this many s")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    rows = []
    for name, (k, n) in LAYERS.items():
        ops = make_operands(k, n)
        for m in map(int, args.rows.split(",")):
            rows.append(bench_shape(name, ops, m, not args.no_sweep and m in SWEEP_ROWS, deadline))
        del ops
        torch.cuda.empty_cache()
    sums = totals(rows)
    for m, roads in sums.items():
        print(f"4 layers M={m}: " + "  ".join(f"{road} {us:.1f} us" for road, us in roads.items()))
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "triton": __import__("triton").__version__,
                          "rows": rows, "layer_totals_us": sums})
    return 0


if __name__ == "__main__":
    sys.exit(main())
