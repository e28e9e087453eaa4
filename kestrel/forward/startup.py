"""Startup: resolve the model, load weights, size and allocate the KV cache, capture graphs, warm up.

Each phase reports through Progress, so /health and the log always say what is happening.

With tensor parallelism every rank runs this same function on its own process (rank 0 inside the Engine, the
others in ranks/worker.py), with its TPGroup: each builds and loads its shard, and every forward here
(activation profiling, kernel compilation, graph capture, warm-up) meets the other ranks' in the same order.
Where a rank decides something alone (how many KV blocks fit, whether a graph family captured), the ranks agree
on the smallest answer, so they keep taking the same roads.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.config import EngineConfig
from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.forward.compile_ahead import start_compile_ahead
from kestrel.batch import ForwardBatch, build_forward_batch
from kestrel.forward.runner import ModelRunner, kv_bytes_per_block
from kestrel.forward.warm_up import warm_up
from kestrel.errors import KestrelError, ModelLoadError
from kestrel.layers.fp8 import keep_float, with_fp8
from kestrel.kernels.kv_store import FP8_KV_DTYPE
from kestrel.layers.ops import LayerOps, choose_layer_ops
from kestrel.models.checkpoint import load_model_config, load_weights
from kestrel.models.dummy_weights import init_dummy_weights
from kestrel.models.kv_scales import load_kv_scales
from kestrel.models.model_config import ModelConfig
from kestrel.models.quantization import checkpoint_modules, fp8_scheme
from kestrel.models.registry import model_class
from kestrel.models.tokenizer import BackgroundTokenizer, Tokenizer
from kestrel.progress import Progress, child_cpu_progress

logger = logging.getLogger("kestrel.loading")   # kestrel.startup is the phase tracker (progress.py)

CPU_DEFAULT_KV_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class RunnerSetup:
    runner: ModelRunner
    model_config: ModelConfig
    tokenizer: Tokenizer
    num_blocks: int
    max_model_len: int
    drafter: torch.nn.Module | None = None      # the EAGLE-3 drafter (speculative decoding), on the device
    drafter_kv: torch.Tensor | None = None      # its one-layer KV cache, in the target's blocks
    drafter_graphs: object | None = None        # DrafterGraphs (forward/drafter_graphs.py), when captured


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KestrelError(f"--device {name!r} is invalid: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KestrelError(f"--device {name} asked for CUDA, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise KestrelError(f"--device {name!r} is not supported: expected cpu or cuda")
    return device


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    # Like vLLM: half-precision checkpoints keep their dtype; fp32 checkpoints run in bf16 on the GPU.
    return DTYPES.get(str(cfg.torch_dtype), torch.bfloat16) if cfg.torch_dtype not in (None, "float32") \
        else torch.bfloat16


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model dtype; fp8 / fp8_e4m3 is float8_e4m3fn (EngineConfig validated it)."""
    return FP8_KV_DTYPE if name in ("fp8", "fp8_e4m3") else dtype


def build_runner(config: EngineConfig, progress: Progress, tp: TPGroup = SINGLE) -> RunnerSetup:
    progress.begin("resolving_model")
    path = config.model_path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():   # a GGUF checkpoint is one file (kestrel/models/gguf)
            raise ModelLoadError(f"GGUF file {path} does not exist")
    elif not path.is_dir():
        if config.model is None:
            raise ModelLoadError(f"the embedded default model is missing at {path}; pass --model DIR")
        raise ModelLoadError(f"model directory {path} does not exist (Kestrel loads local HF checkpoints "
                             "and .gguf files)")
    cfg = load_model_config(path)
    tokenizer = BackgroundTokenizer(config.tokenizer_path, cfg.eos_token_ids)
    device = resolve_device(config.device)
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.local_rank)
    dtype = resolve_dtype(config.dtype, cfg, device)
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < max_model_len:
        # No sliding-window attention yet: within the window, full attention is exact.
        logger.warning("model uses sliding-window attention (%d); capping max_model_len to it", cfg.sliding_window)
        max_model_len = cfg.sliding_window
    if max_model_len > cfg.max_position_embeddings:
        raise KestrelError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                           f"({cfg.max_position_embeddings})")
    logger.info("model %s (%s), %d layers, device %s, dtype %s%s", path, cfg.architecture, cfg.num_layers, device,
                str(dtype).removeprefix("torch."), f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1
                else "")

    ahead = start_compile_ahead(config, cfg, device, tp, max_model_len)
    torch.manual_seed(config.seed)
    model, backend, ops = build_model(config, cfg, device, dtype, tp)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed, progress)
    else:
        load_weights(model, path, progress)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    if config.kv_cache_fp8 and config.load_format != "dummy":
        load_kv_scales(model, path)   # before any graph is captured: the scales are constants of its kernels
    model.eval()
    runner = ModelRunner(model, cfg, backend, device, dtype, config.block_size, tp=tp, kv_dtype=kv_dtype)
    spec = config.speculative
    drafter = None
    if spec is not None and spec.method == "eagle3":
        progress.begin("loading_drafter")
        from kestrel.models.eagle3_loader import load_eagle3_drafter
        drafter = load_eagle3_drafter(spec.model, cfg, model, device, dtype, ops)
        runner.capture_hidden_layers = tuple(drafter.config.aux_layer_ids)   # before any graph is captured
        logger.info("EAGLE-3 drafter %s: reads the hidden states entering target layers %s", spec.model,
                    list(runner.capture_hidden_layers))
    if backend.compiles_at_first_use:
        progress.begin("compiling_kernels", unit="CPU s")
        with child_cpu_progress(progress):
            compile_backend_kernels(runner, config.block_size)

    if ahead is not None:   # their GPU memory must be free before the KV cache takes what is left
        ahead.finish(progress)
    progress.begin("allocating_kv_cache")
    drafter_block_bytes = 0
    if drafter is not None:
        drafter_block_bytes = math.prod(drafter.kv_cache_shape(1, config.block_size)) * dtype.itemsize
    num_blocks = tp.min_int(size_kv_cache(config, cfg, runner, max_model_len, drafter_block_bytes))
    runner.allocate_kv_cache(num_blocks)
    drafter_kv = None
    if drafter is not None:
        drafter_kv = torch.zeros(drafter.kv_cache_shape(num_blocks, config.block_size), dtype=dtype, device=device)
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GB, %s)", num_blocks, config.block_size,
                num_blocks * config.block_size,
                num_blocks * kv_bytes_per_block(cfg, config.block_size, kv_dtype, tp.size) / 1e9,
                str(kv_dtype).removeprefix("torch."))

    drafter_graphs = None
    graphs = device.type == "cuda" and not config.disable_cuda_graph
    if graphs and cfg.kv_lora_rank and not backend.supports_latent_decode():
        logger.warning("%s: CUDA graphs off (attention backend %s has no latent-attention decode kernel; MLA runs "
                       "as torch code, which reads lengths on the host)", cfg.architecture, backend.name)
        graphs = False
    if graphs:
        from kestrel.forward.decode_graphs import capture_graphs
        capture_graphs(runner, latent_graph_config(config, cfg), max_model_len, progress)
        if tp.min_int(runner.graphs is not None) == 0:   # a rank fell back to eager decode: every rank does
            runner.graphs = runner.prefill_graphs = None
        elif tp.min_int(runner.prefill_graphs is not None) == 0:
            runner.prefill_graphs = None
        if spec is not None and runner.graphs is not None and cfg.kv_lora_rank:
            logger.warning("%s: speculative verify steps run eagerly (latent attention's multi-token form reads "
                           "block ids on the host)", cfg.architecture)
        elif spec is not None and runner.graphs is not None:
            from kestrel.forward.decode_graphs import capture_verify_graphs
            tree = None
            if spec.is_tree:
                from kestrel.forward.draft_tree import draft_tree
                shape = draft_tree(spec.num_speculative_tokens, spec.topk, spec.num_draft_nodes)
                tree = (shape.depths, shape.mask())
            capture_verify_graphs(runner, config, max_model_len, spec.num_draft_nodes + 1, progress, tree)
            if drafter is not None and runner.verify_graphs is not None:
                from kestrel.forward.drafter_graphs import capture_drafter_graphs
                drafter_graphs = capture_drafter_graphs(drafter, (drafter_kv[0], drafter_kv[1]), runner,
                                                        spec.num_speculative_tokens, spec.topk, progress)

    progress.begin("warming_up")
    warm_up(runner, config.block_size, config.max_num_batched_tokens, max_model_len)
    if not tokenizer.done:   # it loads on a thread from the start; said when startup waits for it
        progress.begin("loading_tokenizer")
    return RunnerSetup(runner, cfg, tokenizer.result(), num_blocks, max_model_len, drafter, drafter_kv, drafter_graphs)


def latent_graph_config(config: EngineConfig, cfg: ModelConfig) -> EngineConfig:
    """The config decode graphs are captured with. Latent attention (attention/mla.py) decodes through the triton
    backend's kernel, which graphs capture, but its multi-token form (prefill chunks, verify steps) is torch code
    that reads block ids on the host, so an MLA model's prefill graphs stay off (and startup skips its verify
    graphs)."""
    if not cfg.kv_lora_rank or config.disable_prefill_cuda_graph:
        return config
    logger.warning("%s: prefill CUDA graphs off (latent attention prefills eagerly: its up-projected form reads "
                   "block ids on the host); decode graphs on", cfg.architecture)
    return dataclasses.replace(config, disable_prefill_cuda_graph=True)


def build_model(config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                tp: TPGroup = SINGLE) -> tuple[torch.nn.Module, AttentionBackend, LayerOps]:
    """The model's modules on the device, weights not loaded yet; the attention backend and the layer ops it
    runs with."""
    backend = select_attention_backend(config, device)
    ops = choose_layer_ops(device, backend)
    fp8 = fp8_scheme(cfg.quantization_config, config.quantization, config.model_path)
    with torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            # An FP8 model's linear layers are built FP8 (never float first); those its checkpoint leaves float
            # get their float weights back before loading.
            model = model_class(cfg)(cfg, with_fp8(ops, fp8, device) if fp8 else ops, tp)
            if fp8 is not None:
                kept = keep_float(model, fp8, checkpoint_modules(model))
                logger.info("FP8 weights (%s%s)%s", fp8.method, f", {fp8.block[0]}x{fp8.block[1]} blocks"
                            if fp8.block else "", f"; left float: {', '.join(kept)}" if kept else "")
        finally:
            torch.set_default_dtype(default_dtype)
    model.rotary.cos_sin_cache = model.rotary.cos_sin_cache.float()   # keep rotary tables in fp32
    return model, backend, ops


def select_attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    try:
        from kestrel.attention.select import select_backend
    except ImportError:
        select_backend = None
    if select_backend is not None:
        return select_backend(config.attention_backend, device)
    if config.attention_backend not in (None, "torch"):
        raise KestrelError(f"--attention-backend {config.attention_backend} is not available in this build")
    from kestrel.attention.torch_ref import TorchAttentionBackend
    return TorchAttentionBackend()


def size_kv_cache(config: EngineConfig, cfg: ModelConfig, runner: ModelRunner, max_model_len: int,
                  extra_bytes_per_block: int = 0) -> int:
    """Blocks of KV cache; extra_bytes_per_block: a drafter's cache, which lives in the same blocks."""
    # an FP8 cache counts one byte an element: the same budget holds twice the blocks of a 16-bit one
    per_block = kv_bytes_per_block(cfg, config.block_size, runner.kv_dtype, runner.tp.size) + extra_bytes_per_block
    # More blocks than every sequence at full length (times 2, for cached prefixes) would never be used.
    useful = 2 * config.max_num_seqs * -(-max_model_len // config.block_size)
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if runner.device.type == "cpu":
        budget = config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        return max(1, min(budget // per_block, useful))
    if config.kv_cache_memory is not None:
        return max(1, min(config.kv_cache_memory // per_block, useful))
    peak = profile_activation_peak(runner, config, max_model_len)
    total = torch.cuda.get_device_properties(runner.device).total_memory
    graph_reserve = 0 if config.disable_cuda_graph else 512 << 20
    budget = int(total * config.gpu_memory_utilization) - peak - graph_reserve
    if budget < per_block:
        raise KestrelError(f"no memory left for the KV cache: weights + activations take {peak / 1e9:.1f} GB of "
                           f"{total / 1e9:.1f} GB; raise --gpu-memory-utilization or lower "
                           "--max-num-batched-tokens")
    return max(1, min(budget // per_block, useful))


def activation_profile_batch(tokens: int, max_model_len: int, block_size: int) -> tuple[ForwardBatch, int]:
    """The largest step (a prefill of `tokens` tokens) as sequences of at most max_model_len tokens, so every
    position has a rotary row: one 8192-token sequence on a 2048-position model read past the cos/sin cache
    (an illegal memory access). Returns (batch, blocks it writes)."""
    lengths = [min(max_model_len, tokens - start) for start in range(0, tokens, max_model_len)]
    tables, next_block = [], 0
    for n in lengths:
        used = -(-n // block_size)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    return build_forward_batch([[0] * n for n in lengths], [0] * len(lengths), tables, block_size), next_block


@torch.inference_mode()   # as every other forward: a backend may keep tensors made under it (FlashInfer's plan)
def profile_activation_peak(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> int:
    """Peak device memory (weights included) of the largest step: max_num_batched_tokens prompt tokens."""
    batch, blocks = activation_profile_batch(config.max_num_batched_tokens, max_model_len, config.block_size)
    runner.allocate_kv_cache(blocks)
    torch.cuda.reset_peak_memory_stats(runner.device)
    runner.forward(batch.to(runner.device))
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device)
    runner.free_kv_cache()
    torch.cuda.empty_cache()
    return peak


def compile_backend_kernels(runner: ModelRunner, block_size: int) -> None:
    """A prefill and a decode step on a scratch two-block KV cache, so a JIT-compiling backend builds its kernels
    in a phase of its own (whose progress is the compiler's CPU time) rather than inside KV-cache sizing."""
    runner.allocate_kv_cache(2)
    try:
        runner.forward(build_forward_batch([[0, 0]], [0], [[0]], block_size))
        runner.forward(build_forward_batch([[0]], [2], [[0]], block_size))
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    finally:
        runner.free_kv_cache()
