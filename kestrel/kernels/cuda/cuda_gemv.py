"""Skinny matmuls in CUDA C++ (skinny_gemv.cu) for weights too large for the Triton kernels of gemv.py.

At one to four rows a matmul is a weight read. On the Llama-3.1-8B's bs1 step cuBLAS streams qkv and o_proj at
~72% of copy bandwidth plus a split-K reduce kernel each, and the RMSNorms and the SiLU-mul are kernels of their own;
the Triton skinny kernel lost to cuBLAS there. This kernel gives each weight row to one
warp, issues its first loads before the PDL wait, and folds the ops around the matmul in:

    add + RMSNorm -> qkv_proj                        add_rms_norm_gemv
    o_proj, down_proj                                gemv
    add + RMSNorm -> gate_up_proj -> SiLU-mul        add_rms_norm_gemv_silu (gate and up rows of one output in
                                                     one warp, so down_proj reads the activation directly)
    add + RMSNorm -> qkv_proj -> rotary, K/V write   add_rms_norm_gemv_rope (a decode step's attention prologue,
                                                     models without q/k norm: the pair rows of a rotation in one
                                                     block, q out, k and v into the paged caches)

At one row of x the activation reaches shared memory by one bulk copy after the wait (use_bulk_copy, TMA_X): read
through the L1 path, it queued behind the weight loads issued before the wait.

Numerics are those of gemv.py's references (fp32 accumulation, the same bf16 roundings); the sum order differs,
so outputs match the references to about an ulp. Hopper and bf16 only (`usable`); NVRTC compiles each shape at
first use, which the CUDA-graph warm-up does before capture.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kestrel.kernels.cuda import cuda_rtc
from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store_ref
from kestrel.kernels.triton.gemv import add_rms_norm_gemv_ref
from kestrel.kernels.triton.pdl import device_index, hopper_or_later, pdl_enabled, sm_count

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("skinny_gemv.cu")
MAX_M = 4                   # rows of x served; M_TILE builds 1, 2 and 4
WARPS = 8
LOADS_PER_LANE = 16         # 16-byte weight loads a lane keeps in flight per step (64 registers); 8 for 2-4 rows
                            # of x, whose activation loads would otherwise spill under 128 registers
BLOCKS_PER_SM = 2           # __launch_bounds__(256, 2)
NORM_SHARED_BYTES = 48 * 1024   # the staged activation [M_TILE, K] bf16 must fit static shared memory


@dataclass(frozen=True)
class RopeShape:
    """The attention heads of a fused QKV weight whose prologue the kernel runs (compile-time: ROPE)."""
    head_dim: int
    num_heads: int
    num_kv_heads: int


class RopeArgs(ctypes.Structure):   # skinny_gemv.cu's struct RopeArgs, field for field
    _fields_ = [("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
                ("stride_cos_sin", ctypes.c_longlong), ("q_out", ctypes.c_void_p), ("stride_q", ctypes.c_longlong),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)] + \
               [(name, ctypes.c_longlong) for name in ("stride_kb", "stride_ko", "stride_kh", "stride_vb",
                                                        "stride_vo", "stride_vh", "block_size")]


@dataclass(frozen=True)
class CudaGemvConfig:
    rows: int               # output rows a warp owns (SILU: and as many up rows)
    u: int                  # 16-byte loads a lane per weight row per step: a step covers 256 * u of K
    warps: int = WARPS


def default_config(n: int, k: int, silu: bool = False, sm_count: int = 132, m_tile: int = 1) -> CudaGemvConfig:
    """Rows a warp such that the grid fills whole waves of resident blocks (every block streams the same bytes,
    so a half-empty last wave idles half the GPU), then the widest step within LOADS_PER_LANE loads.

    H200 (132 SMs, 264 resident blocks), 8B shapes: qkv N=6144 -> 3 rows (256 blocks); o_proj N=4096 -> 2 rows
    (256); gate_up N=14336 with SiLU -> 1 row + its up row (1,792 blocks, 6.8 waves); down N=4096 K=14336 -> 1 row
    (512 blocks), u 8: the long-row rule below.
    """
    halves = 2 if silu else 1
    if m_tile == 1 and not silu and k >= 8192 and (k // 256) % 8 == 0:
        # A long row (the 8B's down): one row a warp, 8 loads a step, rather than the 2 rows (256 blocks) the
        # wave rule picks. Measured on the 8B bs1 step in six same-call A/Bs: -0.3% to -0.6%. 512 blocks, one
        # wave at the 4 blocks an SM its 60 registers allow. Not measured at other shapes.
        return CudaGemvConfig(rows=1, u=8)
    capacity = sm_count * BLOCKS_PER_SM

    def fill(rows: int) -> float:
        waves = math.ceil(n / (WARPS * rows)) / capacity
        return waves / math.ceil(waves)

    rows = max((r for r in (1, 2, 3, 4) if r * halves <= 4), key=lambda r: (round(fill(r), 2), r))
    per_row = k // 256
    loads = LOADS_PER_LANE if m_tile == 1 else LOADS_PER_LANE // 2
    u = max(d for d in range(1, max(1, loads // (rows * halves)) + 1) if per_row % d == 0)
    return CudaGemvConfig(rows=rows, u=u)


@functools.lru_cache(maxsize=None)
def _config(device: int, n: int, k: int, silu: bool, m_tile: int) -> CudaGemvConfig:
    """The launch's config, once per shape (eager decode launches 4 a layer)."""
    return default_config(n, k, silu, sm_count(device), m_tile)


def usable(x: torch.Tensor, w: torch.Tensor, norm: bool = False) -> bool:
    """Whether this kernel serves x @ w.T here: a Hopper GPU, bf16, at most MAX_M rows, K a multiple of 256,
    16-byte aligned rows, and (norm) the staged activation fits shared memory."""
    if x.device.type != "cuda" or x.dim() != 2 or x.shape[0] > MAX_M or x.shape[0] == 0:
        return False
    if not (x.dtype == w.dtype == torch.bfloat16) or not hopper_or_later(device_index(x.device)):
        return False
    k = w.shape[1]
    if k % 256 or (norm and k * MAX_M * 2 > NORM_SHARED_BYTES):
        return False
    aligned = all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (x, w))
    return aligned and _builds(device_index(x.device))


@functools.lru_cache(maxsize=None)
def _builds(device: int) -> bool:
    """Whether NVRTC and the driver build and load this kernel here (once); if not, say why once and leave the
    matmuls to the other paths."""
    try:
        _kernel(device, 256, CudaGemvConfig(rows=1, u=1), 1, True, True)
        return True
    except (OSError, RuntimeError) as error:
        log.warning("CUDA skinny matmuls unavailable, decode matmuls stay on cuBLAS / Triton: %s", error)
        return False


def use_bulk_copy(m_tile: int, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the launch takes the TMA_X build: one row of x, whose row (and the residual's) arrives by one bulk
    copy into shared memory, which needs 16-byte aligned rows. Against reading x through L1 after the weight loads
    issued before the wait: the Llama-3.1-8B bs1 step -3.7%."""
    return m_tile == 1 and all(t.data_ptr() % 16 == 0 for t in (x, residual) if t is not None)


def compile_kernel(k: int, config: CudaGemvConfig, m_tile: int, norm: bool, silu: bool,
                   arch: str = "sm_90", rope: RopeShape | None = None, tma_x: bool = False) -> cuda_rtc.Compiled:
    """tma_x: the build whose one row of x arrives by bulk copy (use_bulk_copy)."""
    assert not tma_x or m_tile == 1, "TMA_X stages one row of x"
    defines = dict(K=k, ROWS=config.rows, WARPS=config.warps, U=config.u, M_TILE=m_tile, NORM=int(norm),
                   SILU=int(silu), TMA_X=int(tma_x))
    if rope is not None:
        defines |= dict(ROPE=1, HEAD_DIM=rope.head_dim, NUM_HEADS=rope.num_heads, NUM_KV_HEADS=rope.num_kv_heads)
    return cuda_rtc.compile_cubin(SOURCE.read_text(), "skinny_gemv", arch, defines)


@functools.lru_cache(maxsize=None)
def _kernel(device: int, k: int, config: CudaGemvConfig, m_tile: int, norm: bool, silu: bool,
            rope: RopeShape | None = None, tma_x: bool = False) -> cuda_rtc.Kernel:
    compiled = compile_kernel(k, config, m_tile, norm, silu, cuda_rtc.device_arch(device), rope, tma_x)
    return cuda_rtc.Kernel(compiled, "skinny_gemv", torch.device("cuda", device))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: CudaGemvConfig | None = None) -> torch.Tensor:
    """gemv_ref: x [M <= 4, K] @ w [N, K].T (+ bias) -> [M, N]."""
    return _launch(x, None, None, 0.0, w, bias, False, False, config)[0]


def add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor, bias: torch.Tensor | None = None, config: CudaGemvConfig | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_gemv_ref: (rms_norm(x + residual) @ w.T (+ bias), x + residual); residual None: x itself."""
    return _launch(x, residual, norm_weight, eps, w, bias, True, False, config)


def add_rms_norm_gemv_silu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           w: torch.Tensor, bias: torch.Tensor | None = None, config: CudaGemvConfig | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_gemv_silu_ref: w = [gate | up] [2I, K] -> (silu(gate) * up [M, I], x + residual)."""
    return _launch(x, residual, norm_weight, eps, w, bias, True, True, config)


def add_rms_norm_gemv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                           config: CudaGemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_gemv_rope_ref: the fused QKV projection of a decode step and its attention prologue (no q/k
    norm) -> (rotated q [M, num_heads, head_dim], x + residual); k and v go into the caches at slot_mapping."""
    m = x.shape[0]
    assert w.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    assert positions.dtype == slot_mapping.dtype == torch.int64 and positions.shape[0] >= m <= slot_mapping.shape[0]
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == head_dim \
        and cos_sin_cache.stride(-1) == 1, "cos_sin_cache: [max_position, head_dim] fp32, full rotary"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim) \
        and k_cache.dtype == v_cache.dtype == torch.bfloat16 and k_cache.stride(-1) == v_cache.stride(-1) == 1
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    args = RopeArgs(positions.data_ptr(), slot_mapping.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.stride(0),
                    q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
                    *v_cache.stride()[:3], k_cache.shape[1])
    _, res_out = _launch(x, residual, norm_weight, eps, w, bias, True, False, config,
                         RopeShape(head_dim, num_heads, num_kv_heads), args)
    return q, res_out


def add_rms_norm_gemv_rope_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                               eps: float, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    qkv, h = add_rms_norm_gemv_ref(x, residual, norm_weight, eps, w, bias)
    q = qk_norm_rope_store_ref(qkv, None, None, eps, positions[: x.shape[0]], cos_sin_cache, k_cache, v_cache,
                               slot_mapping[: x.shape[0]], num_heads, num_kv_heads, head_dim)
    return q, h


def add_rms_norm_gemv_silu_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                               eps: float, w: torch.Tensor, bias: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, h = add_rms_norm_gemv_ref(x, residual, norm_weight, eps, w, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up, h


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
            w: torch.Tensor, bias: torch.Tensor | None, norm: bool, silu: bool, config: CudaGemvConfig | None,
            rope: RopeShape | None = None, rope_args: RopeArgs | None = None
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
    m, k = x.shape
    assert w.shape[1] == k and m <= MAX_M, f"x {tuple(x.shape)}, w {tuple(w.shape)}: K must match, M <= {MAX_M}"
    assert k % 256 == 0 and x.dtype == w.dtype == torch.bfloat16, "bf16, K a multiple of 256"
    n = w.shape[0] // (2 if silu else 1)
    if bias is not None:
        assert bias.shape == (w.shape[0],) and bias.dtype == x.dtype and bias.stride(0) == 1
    if norm:
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if rope is None else None   # ROPE writes elsewhere
    res_out = torch.empty_like(x) if residual is not None else x
    device = device_index(x.device)
    m_tile = 1 if m == 1 else 2 if m == 2 else 4
    cfg = config or _config(device, n, k, silu, m_tile)
    assert (k // 256) % cfg.u == 0, f"{cfg}: a step of 256 * u must divide K={k}"
    kernel = _kernel(device, k, cfg, m_tile, norm, silu, rope, use_bulk_copy(m_tile, x, residual))
    null = ctypes.c_void_p(0)

    def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr()) if t is not None else null

    args = [ptr(x), ctypes.c_longlong(x.stride(0)),
            ptr(residual), ctypes.c_longlong(residual.stride(0) if residual is not None else 0),
            ptr(res_out if residual is not None else None), ctypes.c_longlong(res_out.stride(0)),
            ptr(norm_weight), ctypes.c_float(eps),
            ptr(w), ctypes.c_longlong(w.stride(0)), ptr(bias),
            ptr(out), ctypes.c_longlong(out.stride(0) if out is not None else 0),
            ctypes.c_int(m), ctypes.c_int(n), rope_args if rope_args is not None else RopeArgs()]
    grid = math.ceil(n / (cfg.warps * cfg.rows))
    kernel.launch((grid, 1, 1), cfg.warps * 32, args, torch.cuda.current_stream(x.device),
                  pdl=pdl_enabled(x.device))
    return out, res_out
