"""Kestrel: an LLM inference engine with an OpenAI-compatible server and a serving benchmark."""
from kestrel.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from kestrel.llm import LLM

        return LLM
    raise AttributeError(name)
