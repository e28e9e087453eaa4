"""GGUF -> an HF-format directory (config.json, model.safetensors, tokenizer, generation_config.json), so tools
that only read HF checkpoints (transformers, vLLM, this repo's scripts) can use the model too."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from kestrel.errors import KestrelError
from kestrel.models.gguf.reader import hf_config, open_gguf
from kestrel.models.gguf.tensors import hf_tensors
from kestrel.models.gguf.tokenizer import load_gguf_tokenizer

logger = logging.getLogger("kestrel.gguf")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def convert(path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise KestrelError(f"--dtype {dtype!r} is invalid: expected {', '.join(DTYPES)}")
    if (out_dir / "config.json").exists() or (out_dir / "model.safetensors").exists():
        raise KestrelError(f"{out_dir} already holds a checkpoint; pick an empty or new directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise KestrelError(f"{out_dir} exists and is not a directory")
    start = time.monotonic()
    reader = open_gguf(path)
    config = hf_config(reader)
    # Build everything before writing anything: a bad file leaves no half-written directory behind.
    tokenizer = load_gguf_tokenizer(path)
    tensors = {}
    for name, tensor, _ in hf_tensors(path):
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        tensors[name] = tensor.to(DTYPES[dtype]).contiguous()

    out_dir.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # eos from the GGUF's own eos (SmolLM2: 2, <|im_end|>), which generate() and servers stop on.
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 names its class TokenizersBackend, which 4.x readers (vLLM's pins) lack; the fast class
    # name works in both, and the template also goes into tokenizer_config.json for readers that ignore
    # chat_template.jinja.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        tok_cfg["chat_template"] = tokenizer.chat_template
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    logger.info("wrote %s (%d tensors, %s) in %.1f s", out_dir, len(tensors), dtype, time.monotonic() - start)
    return out_dir
