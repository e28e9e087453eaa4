"""Fp8LinearMethod: linear layers whose weights stay FP8 (E4M3) in memory, with float32 scales.

The method owns the layer's weights (`create_weights`): `weight` [out, in] float8_e4m3fn and one scale tensor in
one of two layouts (W ≈ weight.float() * scale, kestrel/kernels/fp8_quant.py):

    row    [out, 1]                          per-channel checkpoints as they are; a per-tensor checkpoint's scalar
                                             is written into the rows of its tensor. A merged layer (q|k|v,
                                             gate|up) whose checkpoint tensors each carry their own scalar so keeps
                                             every one exactly: no requantization to a common scale (which would
                                             round every shard's values again), and the one epilogue (a per-row
                                             multiply) serves per-tensor and per-channel alike.
    block  [ceil(out / bn), ceil(in / bk)]   one scale per bn x bk tile (HF "fp8" with weight_block_size).
                                             The last tile of a tensor may be short (HF's scales are ceil-sized).
    rows   [out, ceil(in / bk)]              block scales whose row tiles do not line up with the layer's rows
                                             (a merged q|k|v or gate|up whose parts are not multiples of bn, e.g.
                                             q 576 rows in 128-row tiles, or a rank's rows starting mid-tile):
                                             each tile's scale repeated over its rows, the layer's block (1, bk)
                                             (`layer.fp8_block`). Exact; CUDA runs it through the dequantizing
                                             reference.

Scales are cut for tensor parallelism by the layer's own `Placement` (layers/linear.py), in units of their tile:
a rank's rows (column-parallel) or columns (row-parallel) of the weight take the same rows or columns of the
scales. Rows never cut a tile (a misaligned layer takes the `rows` layout); a row-parallel split of the input
columns must start each rank on a column tile, which is checked at load, naming the rank counts that would do.

How a call runs:

    CPU                  dequantize per call into x's dtype, then F.linear: the reference, correctness only
    CUDA, M <= 16, row   `skinny`: kernels/triton/gemv.py's kernels read the FP8 bytes (half of bf16's), the scales
                         in their epilogue, with the add + RMSNorm before qkv / gate_up and the SiLU-mul before
                         down folded in as for bf16 (apply_norm, apply_silu)
    CUDA, M <= 16, block `small`: kernels/triton/fp8_gemv.py (split-K over scale-tile segments), with the add +
                         RMSNorm and the SiLU-mul folded in (`small_folds`) as on the row road
    CUDA, M > 16, row    `large`: activations quantized per token on the fly, torch._scaled_mm with row scales
    CUDA, M > 16, block  `block_large`: kernels/triton/fp8_block_gemm.py. On Hopper W8A8: x quantized per row and
                         bk-column group in registers, FP8 x FP8 on the tensor cores, both scales on each step's
                         partial sums; below Hopper (or KESTREL_FP8_BLOCK_GEMM=w8a16) FP8 tiles widened to bf16
                         in registers. Split-K when the output tiles are under one wave (decode's o and down at
                         128 rows)
    CUDA, float32 x      dequantize per call (the block GEMM needs bf16/fp16 tensor-core inputs)
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.envs import switches
from kestrel.errors import ModelLoadError
from kestrel.kernels.fp8_quant import (FP8, dequantize, quantize_activations_per_token, quantize_per_row,
                                      quantize_per_tensor)
from kestrel.layers.ops import LayerOps
from kestrel.layers.linear import (PLAIN, LinearBase, LinearMethod, Norm, Placement, _copy_checked, place_slice,
                                   take_slice)


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """What an FP8 model's linear layers hold, read from its checkpoint (models/quantization.py) or the flag."""
    method: str                           # for messages: "fp8", "compressed-tensors", "--quantization fp8"
    block: tuple[int, int] | None = None  # (bn, bk) tile of the scales; None: one scale per row
    scale_name: str = "weight_scale"      # the checkpoint's tensor name: weight_scale_inv (HF fp8) or weight_scale
    online: bool = False                  # the checkpoint is float: quantize each tensor as it loads
    per_tensor: bool = False              # online: one scale per checkpoint tensor (else one per row)
    ignore: tuple[str, ...] = ()          # checkpoint module names left in the float dtype ("re:" a regex)

    def ignores(self, module: str) -> bool:
        """Whether a checkpoint module (model.layers.0.mlp.down_proj) stays float: the name itself, a dotted
        suffix or prefix of it (HF's modules_to_not_convert: lm_head, model.layers.0.mlp), or `re:` a regex."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry) or module.startswith(entry + "."):
                return True
        return False


def scaled_mm_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x @ (w8 * scale).T with row scales through torch._scaled_mm: x quantized per token (dynamic), both scales
    applied in the GEMM's epilogue; bf16 out (what the row-wise kernel writes), cast to x's dtype."""
    x8, x_scale = quantize_activations_per_token(x)
    out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=torch.bfloat16)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def scaled_mm_usable(x: torch.Tensor, w8: torch.Tensor) -> bool:
    """torch._scaled_mm wants both GEMM dims of the weight in multiples of 16."""
    return w8.shape[0] % 16 == 0 and w8.shape[1] % 16 == 0


@dataclass(frozen=True)
class Fp8LinearMethod(LinearMethod):
    scheme: Fp8Scheme
    dense: LinearMethod = PLAIN   # what the layers the checkpoint leaves float run (`Fp8Scheme.ignore`)
    # Block scales, x of at most `small_max_rows` rows: (x, w8, scale, block, bias) -> [M, N]; None: the reference
    small: Callable[..., torch.Tensor] | None = None
    small_max_rows: int = 16
    # Block scales, x of at most `small_max_rows` rows: fp8_gemv.py's folded launchers (norm, SiLU-mul)
    small_folds: "SmallFp8Folds | None" = None
    # Row scales, x of at most `small_max_rows` rows: kernels/triton/gemv.py's three kernels (taking w_scale=)
    skinny: "SkinnyFp8 | None" = None
    # (x, w8, row scale, bias) -> [M, N]; None: the reference. Row scales only.
    large: Callable[..., torch.Tensor] | None = None
    # Block scales, x of more than `small_max_rows` rows, bf16/fp16: (x, w8, scale, block, bias) -> [M, N]
    block_large: Callable[..., torch.Tensor] | None = None

    # -- weights ------------------------------------------------------------------------------------------------
    def create_weights(self, layer: LinearBase) -> None:
        # created under the model's device (torch.device context), never as float first: an FP8 model
        # that fits only in FP8 never holds its float weights
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=FP8), requires_grad=False)
        weight.weight_loader = lambda p, t, name="?", shard_id=None: self.load_weight(layer, t, name, shard_id)
        weight.casts_itself = True   # the placer must not cast: an FP8 tensor stays FP8, a float one is checked
        layer.weight = weight
        shape = (layer.out_features, 1)
        layer.fp8_block = self._layer_block(layer)
        if layer.fp8_block is not None:
            bn, bk = layer.fp8_block
            shape = (-(-layer.out_features // bn), -(-layer.in_features // bk))
        scale = torch.ones(shape, dtype=torch.float32)
        if self.scheme.online:   # filled by the weight's loader, not a checkpoint tensor: a buffer
            layer.register_buffer(self.scheme.scale_name, scale)
        else:
            param = nn.Parameter(scale, requires_grad=False)
            param.weight_loader = lambda p, t, name="?", shard_id=None: self.load_scale(layer, t, name, shard_id)
            param.casts_itself = True
            layer.register_parameter(self.scheme.scale_name, param)

    def _layer_block(self, layer: LinearBase) -> tuple[int, int] | None:
        """The scheme's block, or (1, bk) where a checkpoint tensor's row tiles would not line up with the
        layer's rows (module docstring: the `rows` layout)."""
        if self.scheme.block is None:
            return None
        bn, bk = self.scheme.block
        if getattr(layer, "tp_dim", 0) == 1:
            return self.scheme.block   # all the checkpoint's rows, in order
        if hasattr(layer, "output_sizes"):
            shards = range(len(layer.output_sizes))
        elif hasattr(layer, "num_kv_heads") and hasattr(layer, "kv_shard"):
            shards = ("q", "k", "v")
        else:
            shards = (None,)
        for shard in shards:
            place = layer.placement() if shard is None else layer.placement(shard)
            if place.dim != 0:
                continue
            ends = place.src + place.size == place.full and place.dst + place.size == layer.out_features
            if place.dst % bn or place.src % bn or (place.size % bn and not ends):
                return (1, bk)
        return self.scheme.block

    def block(self, layer: LinearBase) -> tuple[int, int] | None:
        """The tile of this layer's scales: the scheme's, or (1, bk) in the `rows` layout."""
        return getattr(layer, "fp8_block", self.scheme.block)

    def scale(self, layer: LinearBase) -> torch.Tensor:
        return getattr(layer, self.scheme.scale_name)

    def load_weight(self, layer: LinearBase, loaded: torch.Tensor, name: str, shard_id: object) -> None:
        if self.scheme.online:
            if not loaded.is_floating_point() or loaded.dtype == FP8:
                raise ModelLoadError(f"tensor {name}: --quantization fp8 quantizes a float checkpoint, got "
                                     f"{loaded.dtype}")
            # The whole checkpoint tensor is quantized (then cut), so every rank gets the same scales; on the
            # layer's device, where the amax and the cast are cheap (a GPU, for a model of any size).
            loaded = loaded.to(layer.weight.device)
            w8, scale = quantize_per_tensor(loaded) if self.scheme.per_tensor else quantize_per_row(loaded)
            self._place_weight(layer, w8, name, shard_id)
            self._place_scale(layer, scale, name, shard_id)
            return
        if loaded.dtype != FP8:
            raise ModelLoadError(f"tensor {name}: the {self.scheme.method} checkpoint's weight is {loaded.dtype}, "
                                 "expected float8_e4m3fn (is the module missing from the quantization config's "
                                 "ignore list?)")
        self._place_weight(layer, loaded, name, shard_id)

    def load_scale(self, layer: LinearBase, loaded: torch.Tensor, name: str, shard_id: object) -> None:
        self._place_scale(layer, loaded.float(), name, shard_id)

    def _place_weight(self, layer: LinearBase, w8: torch.Tensor, name: str, shard_id: object) -> None:
        place = layer.placement() if shard_id is None else layer.placement(shard_id)
        _copy_checked(place_slice(layer.weight.data, place), take_slice(w8, place, name), name)

    def _place_scale(self, layer: LinearBase, scale: torch.Tensor, name: str, shard_id: object) -> None:
        """This rank's scales of one checkpoint tensor into the layer's (module docstring: the layouts)."""
        place = layer.placement() if shard_id is None else layer.placement(shard_id)
        target = self.scale(layer).data
        if self.scheme.block is None:
            rows = place_slice(target, place) if place.dim == 0 else target
            if scale.numel() == 1:   # per tensor: every row of this tensor (this shard of a merged layer)
                rows.fill_(scale.reshape(()).item())
                return
            scale = scale.reshape(-1, 1)
            if place.dim == 0:
                scale = take_slice(scale, place, name)
            _copy_checked(rows, scale, name)
            return
        block = self.block(layer)
        if block != self.scheme.block:   # the rows layout: each row tile's scale over its rows
            rows = place.full if place.dim == 0 else layer.out_features
            scale = scale.repeat_interleave(self.scheme.block[0], dim=0)[:rows]
        tile = block[place.dim]
        at_end = (place.dst + place.size == (layer.out_features if place.dim == 0 else layer.in_features)
                  and place.src + place.size == place.full)
        if place.dst % tile or place.src % tile or (place.size % tile and not at_end):
            what = "rows" if place.dim == 0 else "input columns"
            ranks = place.full // place.size if place.size else 1
            fits = [n for n in range(1, 9) if place.full % n == 0 and (n == 1 or (place.full // n) % tile == 0)]
            raise ModelLoadError(
                f"tensor {name}: FP8 block scales of {list(self.scheme.block)} do not line up with this shard "
                f"({what} {place.src}..{place.src + place.size} of {place.full}): splitting it over {ranks} ranks "
                f"cuts a {tile}-wide tile; this tensor splits on tile boundaries over "
                f"{' or '.join(map(str, fits))} rank{'s' if fits != [1] else ''} (tensor parallelism needs shards "
                "that start on a tile boundary)")
        tiles = Placement(place.dim, place.dst // tile, place.src // tile, -(-place.size // tile),
                          -(-place.full // tile))
        _copy_checked(place_slice(target, tiles), take_slice(scale, tiles, name), name)

    # -- the matmul ---------------------------------------------------------------------------------------------
    def _skinny(self, x: torch.Tensor) -> bool:
        return self.skinny is not None and self.scheme.block is None and x.shape[0] <= self.small_max_rows

    def _small_folded(self, x: torch.Tensor, layer: LinearBase) -> bool:
        return (self.small_folds is not None and self.scheme.block is not None
                and self.block(layer) == self.scheme.block and x.shape[0] <= self.small_max_rows)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale(layer)
        block = self.block(layer)
        if block != self.scheme.block:   # the rows layout: the reference (module docstring)
            return F.linear(x, dequantize(layer.weight, scale, block).to(x.dtype), layer.bias)
        if self._skinny(x):
            return self.skinny.gemv(x, layer.weight, layer.bias, w_scale=scale)
        if self.small is not None and block is not None and x.shape[0] <= self.small_max_rows:
            return self.small(x, layer.weight, scale, block, layer.bias)
        if self.large is not None and block is None and scaled_mm_usable(x, layer.weight):
            return self.large(x, layer.weight, scale, layer.bias)
        if self.block_large is not None and block is not None and x.dtype in (torch.bfloat16, torch.float16):
            return self.block_large(x, layer.weight, scale, block, layer.bias)
        return F.linear(x, dequantize(layer.weight, scale, block).to(x.dtype), layer.bias)

    def apply_norm(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._skinny(x):
            return self.skinny.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias,
                                                 w_scale=self.scale(layer))
        if self._small_folded(x, layer):
            return self.small_folds.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight,
                                                      self.scale(layer), self.scheme.block, layer.bias)
        return super().apply_norm(layer, x, residual, norm)

    def apply_silu(self, layer: LinearBase, gate_up: torch.Tensor,
                   silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self._skinny(gate_up):
            return self.skinny.silu_mul_gemv(gate_up, layer.weight, layer.bias, w_scale=self.scale(layer))
        if self._small_folded(gate_up, layer):
            return self.small_folds.silu_mul_gemv(gate_up, layer.weight, self.scale(layer), self.scheme.block,
                                                  layer.bias)
        return super().apply_silu(layer, gate_up, silu_and_mul)


@dataclass(frozen=True, slots=True)
class SmallFp8Folds:
    """kernels/triton/fp8_gemv.py's folded launchers for tile scales: (x, residual, norm weight, eps, w8, scale,
    block, bias) -> (out, x + residual) and (gate_up, w8, scale, block, bias) -> out."""
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul_gemv: Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class SkinnyFp8:
    """kernels/triton/gemv.py's launchers, each taking FP8 weights with `w_scale=` row scales."""
    gemv: Callable[..., torch.Tensor]
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul_gemv: Callable[..., torch.Tensor]


def fp8_method(scheme: Fp8Scheme, device: torch.device, dense: LinearMethod = PLAIN) -> Fp8LinearMethod:
    """The FP8 kernels on CUDA (the Triton skinny matmul for decode sizes; above them torch._scaled_mm for row
    scales and the Triton block GEMM for tile scales), the dequantizing reference elsewhere."""
    if device.type != "cuda":
        return Fp8LinearMethod(scheme, dense)
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm
    from kestrel.kernels.triton.fp8_gemv import MAX_M, fp8_add_rms_norm_gemv, fp8_gemv, fp8_silu_mul_gemv

    # _scaled_mm's row-wise scaling needs Hopper (sm90) or newer; below it the reference runs.
    large = scaled_mm_linear if torch.cuda.get_device_capability(device) >= (9, 0) else None
    # the kernel's K step divides the tile width, and is at least 16
    small = fp8_gemv if scheme.block is None or scheme.block[1] % 16 == 0 else None
    # the block GEMM's tiles divide the scale tile, and tl.dot wants them >= 16
    tiles_fit = scheme.block is not None and all((d & -d) >= 16 for d in scheme.block)
    skinny = SkinnyFp8(gemv.gemv, gemv.add_rms_norm_gemv, gemv.silu_mul_gemv)
    folds = SmallFp8Folds(fp8_add_rms_norm_gemv, fp8_silu_mul_gemv) if small is not None else None
    block_large = None
    if tiles_fit:
        # W8A8 (FP8 tensor cores, activations quantized per 1 x bk group in the kernel) on Hopper and newer, where
        # wgmma multiplies E4M3 at twice bf16's rate; W8A16 below it or when the switch asks for the A/B.
        w8a8 = switches().fp8_block_gemm == "w8a8" and torch.cuda.get_device_capability(device) >= (9, 0)
        block_large = functools.partial(fp8_block_gemm, quantize_x=True) if w8a8 else fp8_block_gemm
    return Fp8LinearMethod(scheme, dense, small=small, small_max_rows=min(MAX_M, gemv.MAX_M), small_folds=folds,
                           skinny=skinny, large=large, block_large=block_large)


def keep_float(model: nn.Module, scheme: Fp8Scheme, checkpoint_names: Callable[[str], list[str]]) -> list[str]:
    """Give the layers the checkpoint leaves float (`scheme.ignore`) their dense method and float weights again;
    returns their names. `checkpoint_names(module)`: the checkpoint modules a layer holds (q|k|v: three). Call it
    under the model's device and default dtype, before any weight is loaded."""
    kept = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or not isinstance(module.method, Fp8LinearMethod):
            continue
        sources = checkpoint_names(name)
        ignored = [s for s in sources if scheme.ignores(s)]
        if not ignored:
            continue
        if len(ignored) != len(sources):
            raise ModelLoadError(f"the {scheme.method} config leaves {', '.join(ignored)} unquantized but not "
                                 f"{', '.join(s for s in sources if s not in ignored)}, which Kestrel merges "
                                 "into one matmul with it")
        delattr(module, scheme.scale_name)
        module.set_method(module.method.dense)
        kept.append(name)
    return kept


def with_fp8(ops: LayerOps, scheme: Fp8Scheme, device: torch.device) -> LayerOps:
    """`ops` (a LayerOps) whose linear layers are FP8; the float ones keep ops' method."""
    return replace(ops, linear_method=fp8_method(scheme, device, ops.linear_method))
