"""FP8 experts: a block-FP8 checkpoint's (HF "fp8" with weight_block_size, e.g. Qwen3-30B-A3B-FP8) stacked expert
weights kept FP8 in memory, with their tile scales beside them, and the ExpertsImpl that runs them.

Stacked as layers/moe.py stacks the float ones, plus one float32 scale per (bn x bk) tile of each expert part:

    w13.weight            [E, 2 I_r, H]  float8_e4m3fn   gate rows | up rows (this rank's I_r of each)
    w13.weight_scale_inv  [E, 2 ceil(I_r / bn), ceil(H / bk)]   gate's row tiles | up's row tiles
    w2.weight             [E, H, I_r]    float8_e4m3fn
    w2.weight_scale_inv   [E, ceil(H / bn), ceil(I_r / bk)]

    W ≈ weight.float() * scale, the scale expanded over its tile (kernels/fp8_quant.py's convention)

The scales are stacked per part (gate's tiles, then up's), not over the merged 2 I_r rows: the two are the same
array when I_r is a multiple of bn (every real checkpoint: Qwen3-30B-A3B's I is 768), and per part a gate tile
never straddles into up when it is not (small test models). Checkpoint tensors arrive per expert
(`experts.{e}.{gate,up,down}_proj.weight` and `.weight_scale_inv`) through the model's packed_modules, as the
float ones do. The router (`mlp.gate`) is not an expert: it stays float32 (Qwen3-MoE-FP8 leaves it unquantized).

Tensor parallelism cuts each expert's intermediate dimension (layers/moe.py); a rank's slice must start on a
scale tile (I_r a multiple of bn for w13's rows, of bk for w2's columns), or loading says which rank counts fit.

How a call runs (Fp8Experts):

    CUDA, fused MoE on (default)      kernels/triton/fused_moe.py with the scales: FP8 weight tiles read in the
                                      kernel and widened to x's dtype with their tile's scale (W8A16), so the
                                      kernel multiplies exactly the dequantized weights the reference does
    ... KESTREL_FP8_MOE=w8a8, Hopper  the same kernels with quantize_x (W8A8): activations quantized per token
                                      and 1 x bk group in the K loop, FP8 x FP8 tensor-core dots, both scales per
                                      step (vLLM's block-FP8 MoE); oracle fp8_w8a8_experts_reference. Chosen once,
                                      at construction (with_fp8_experts); default w8a16 until a GPU measures it
    otherwise (CPU, KESTREL_FUSED_MOE=0)  every expert dequantized to x's dtype per call, then the float impl:
                                      the oracle (correctness only: it writes all experts' float weights a call)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.errors import ModelLoadError
from kestrel.envs import switches
from kestrel.kernels.fp8_quant import (FP8, dequantize, expand_block_scales, quantize_activation_groups,
                                       quantize_per_block)
from kestrel.layers.linear import Placement, _copy_checked, place_slice, silu_and_mul_torch, take_slice
from kestrel.layers.moe import ExpertsImpl, FusedExperts, StackedWeight, fused_experts_torch


def dequantize_stacked(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], parts: int) -> torch.Tensor:
    """[E, rows, cols] FP8 with per-part tile scales (module docstring) -> float32 [E, rows, cols]."""
    rows_per_part = w8.shape[1] // parts
    tiles_per_part = scale.shape[1] // parts
    out = torch.empty(w8.shape, dtype=torch.float32, device=w8.device)
    for e in range(w8.shape[0]):
        for p in range(parts):
            rows = slice(p * rows_per_part, (p + 1) * rows_per_part)
            tiles = scale[e, p * tiles_per_part:(p + 1) * tiles_per_part]
            out[e, rows] = w8[e, rows].float() * expand_block_scales(tiles.float(), block, (rows_per_part,
                                                                                          w8.shape[2]))
    return out


def quantize_stacked(w: torch.Tensor, block: tuple[int, int], parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] float -> (FP8 [E, rows, cols], per-part tile scales), each expert part quantized as a
    checkpoint's tensor is (kernels/fp8_quant.py: quantize_per_block): what an FP8 checkpoint's experts load as."""
    rows_per_part = w.shape[1] // parts
    w8s, scales = [], []
    for e in range(w.shape[0]):
        quantized = [quantize_per_block(w[e, p * rows_per_part:(p + 1) * rows_per_part], block) for p in range(parts)]
        w8s.append(torch.cat([q[0] for q in quantized]))
        scales.append(torch.cat([q[1] for q in quantized]))
    return torch.stack(w8s), torch.stack(scales)


class Fp8StackedWeight(StackedWeight):
    """StackedWeight in FP8 with its tile scales (`scale_name`, the checkpoint's: weight_scale_inv)."""

    def __init__(self, num_experts: int, rows: int, cols: int, parts: int, tp_dim: int, block: tuple[int, int],
                 scale_name: str, tp: TPGroup = SINGLE) -> None:
        nn.Module.__init__(self)
        self.parts, self.tp_dim, self.tp_rank, self.tp_size = parts, tp_dim, tp.rank, tp.size
        self.block, self.scale_name = block, scale_name
        shape = (rows // tp.size, cols) if tp_dim == 0 else (rows, cols // tp.size)
        # made FP8 directly (never float first): an FP8 model that fits only in FP8 never holds float experts
        self.weight = nn.Parameter(torch.empty(num_experts, *shape, dtype=FP8), requires_grad=False)
        self.weight.weight_loader = self.load_fp8
        self.weight.casts_itself = True   # the placer must not cast: FP8 stays FP8, a float tensor is refused
        bn, bk = block
        part_rows = shape[0] // parts
        scale_shape = (num_experts, parts * -(-part_rows // bn), -(-shape[1] // bk))
        scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = self.load_scale
        scale.casts_itself = True
        self.register_parameter(scale_name, scale)

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    def load_fp8(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                 shard_id: tuple[int, int] = (0, 0)) -> None:
        if loaded.dtype != FP8:
            raise ModelLoadError(f"tensor {name}: the fp8 checkpoint's expert weight is {loaded.dtype}, expected "
                                 "float8_e4m3fn (is the MoE block missing from modules_to_not_convert?)")
        self.weight_loader(param, loaded, name, shard_id)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                   shard_id: tuple[int, int] = (0, 0)) -> None:
        """This rank's tiles of one expert part's [ceil(rows / bn), ceil(cols / bk)] scales."""
        expert, part = shard_id
        place = self.placement(part)
        tile = self.block[place.dim]
        if self.tp_size > 1 and place.size % tile:
            fits = [n for n in range(1, 9) if place.full % n == 0 and (n == 1 or (place.full // n) % tile == 0)]
            what = "rows" if place.dim == 0 else "input columns"
            raise ModelLoadError(
                f"tensor {name}: FP8 block scales of {list(self.block)} do not line up with this rank's shard "
                f"({what} {place.src}..{place.src + place.size} of {place.full}): splitting the experts' width "
                f"over {self.tp_size} ranks cuts a {tile}-wide tile; it splits on tile boundaries over "
                f"{' or '.join(map(str, fits))} rank{'s' if fits != [1] else ''}")
        per_part = param.shape[1 + place.dim] // (self.parts if place.dim == 0 else 1)
        tiles = Placement(place.dim, part * per_part if place.dim == 0 else 0, place.src // tile, per_part,
                          -(-place.full // tile))
        _copy_checked(place_slice(param.data[expert], tiles), take_slice(loaded.float(), tiles, name), name)


def make_fp8_experts(experts: FusedExperts, block: tuple[int, int], scale_name: str) -> None:
    """Give `experts` FP8 stacked weights with tile scales (shapes from its float layout's arguments)."""
    e, h, i, tp = experts.num_experts, experts.hidden_size, experts.intermediate_size, experts.tp
    experts.w13 = Fp8StackedWeight(e, 2 * i, h, parts=2, tp_dim=0, block=block, scale_name=scale_name, tp=tp)
    experts.w2 = Fp8StackedWeight(e, h, i, parts=1, tp_dim=1, block=block, scale_name=scale_name, tp=tp)


@dataclass(frozen=True)
class Fp8Experts:
    """The ExpertsImpl of block-FP8 experts (module docstring: how a call runs). `float_impl` runs what the
    checkpoint leaves float (and the dequantized reference); `kernel`: fused_experts_triton, taking the scales.
    quantize_x: W8A8 (activations quantized per token group) in the kernel and the fallback reference alike."""
    block: tuple[int, int]
    scale_name: str
    float_impl: ExpertsImpl
    kernel: Callable[..., torch.Tensor] | None = None
    quantize_x: bool = False

    def create_weights(self, experts: FusedExperts) -> None:
        make_fp8_experts(experts, self.block, self.scale_name)

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
        if w13_scale is None:   # experts the checkpoint leaves float
            return self.float_impl(x, w13, w2, topk_ids, topk_weights, silu_and_mul)
        if self.kernel is not None and x.is_cuda:
            return self.kernel(x, w13, w2, topk_ids, topk_weights, silu_and_mul, w13_scale=w13_scale,
                               w2_scale=w2_scale, block=self.block, quantize_x=self.quantize_x)
        if self.quantize_x:
            return fp8_w8a8_experts_reference(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, self.block,
                                              silu_and_mul)
        return fp8_experts_reference(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, self.block,
                                     silu_and_mul, self.float_impl)


def fp8_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                          block: tuple[int, int], silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          impl: ExpertsImpl | None = None) -> torch.Tensor:
    """The oracle: every expert dequantized to x's dtype, then the float experts (fused_experts_torch)."""
    impl = impl or fused_experts_torch
    w13f = dequantize_stacked(w13, w13_scale, block, parts=2).to(x.dtype)
    w2f = dequantize_stacked(w2, w2_scale, block, parts=1).to(x.dtype)
    return impl(x, w13f, w2f, topk_ids, topk_weights, silu_and_mul or silu_and_mul_torch)


def fp8_w8a8_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                               block: tuple[int, int],
                               silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The W8A8 oracle: fused_experts_torch's loop and roundings, each expert matmul's input quantized per token
    and bk-column group (quantize_activation_groups, as kernels/fp8_quant.py's fp8_w8a8_ref) and multiplied,
    dequantized, by the dequantized weights in float32, rounded once to x's dtype."""
    silu_and_mul = silu_and_mul or silu_and_mul_torch
    w13f = dequantize_stacked(w13, w13_scale, block, parts=2)
    w2f = dequantize_stacked(w2, w2_scale, block, parts=1)

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a8, a_scale = quantize_activation_groups(a, block[1])
        return (dequantize(a8, a_scale, (1, block[1])) @ w.T).to(x.dtype)

    num_tokens, k = topk_ids.shape
    flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        rows = (flat_ids == expert).nonzero().flatten()
        if rows.numel():
            tokens = rows // k
            y = linear(silu_and_mul(linear(x[tokens], w13f[expert])), w2f[expert])
            out.index_add_(0, tokens, y.float() * flat_weights[rows, None])
    return out.to(x.dtype)


def with_fp8_experts(impl: ExpertsImpl, block: tuple[int, int] | None, scale_name: str, device: torch.device
                     ) -> ExpertsImpl:
    """The experts impl of an FP8 model: Fp8Experts for block scales (the fused kernel reads them on CUDA when
    `impl` is the fused kernel); other FP8 schemes keep the experts float (`impl`). KESTREL_FP8_MOE=w8a8 picks
    the W8A8 kernels on Hopper and newer (E4M3 wgmma), read once here: W8A16 elsewhere and by default."""
    if block is None:
        return impl
    kernel = None
    quantize_x = False
    if device.type == "cuda":
        from kestrel.kernels.triton.fused_moe import fused_experts_triton
        if impl is fused_experts_triton:
            kernel = fused_experts_triton
            bk = block[1]
            quantize_x = (switches().fp8_moe == "w8a8" and torch.cuda.get_device_capability(device) >= (9, 0)
                          and bk >= 16 and bk & (bk - 1) == 0)
    return Fp8Experts(block, scale_name, impl, kernel, quantize_x)


def keep_float_experts(model: nn.Module, ignores: Callable[[str], bool]) -> list[str]:
    """Give the FP8 experts the checkpoint leaves float (every expert module ignored: modules_to_not_convert names
    the MoE block or its experts) float stacked weights again; returns their names. An MoE block with some
    experts FP8 and some float is refused (one stacked weight holds them all)."""
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})
    fragments = [f for f, (merged, _) in packed.items() if merged in ("experts.w13", "experts.w2")]
    kept = []
    for name, module in model.named_modules():
        if not isinstance(module, FusedExperts) or not isinstance(module.w13, Fp8StackedWeight):
            continue
        prefix = name.rpartition(".")[0]
        sources = [f"model.{prefix}.{f}" if prefix else f"model.{f}" for f in fragments]
        ignored = [s for s in sources if ignores(s)]
        if not ignored:
            continue
        if len(ignored) != len(sources):
            raise ModelLoadError(f"the fp8 config leaves {ignored[0]} unquantized but not every expert of "
                                 f"{name}, which Kestrel stacks into one weight")
        module.make_float_weights()
        kept.append(name)
    return kept
