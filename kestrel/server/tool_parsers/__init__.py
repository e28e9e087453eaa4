"""Tool-call parsers, one module per model family, chosen by `--tool-call-parser NAME` (vLLM's names).

Each reads a choice's text and returns its content and its calls, whole (`ToolParser.parse`) or as a stream
(`stream.ToolCallStream`). `forced.py` reads the output of tool_choice "required" or a named function, which the
grammar shapes the same way for every family."""
from __future__ import annotations

from kestrel.server.tool_parsers.base import Parsed, ToolCall, ToolParser
from kestrel.server.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from kestrel.server.tool_parsers.glm45 import Glm45Parser
from kestrel.server.tool_parsers.hermes import HermesParser
from kestrel.server.tool_parsers.llama3_json import Llama3JsonParser
from kestrel.server.tool_parsers.mistral import MistralParser

# name -> (parser, the model families whose chat templates write that format)
PARSERS: dict[str, tuple[type[ToolParser], str]] = {
    "hermes": (HermesParser, "Qwen2.5, Qwen3, QwQ, Hermes 2 Pro / 3 (<tool_call>{json}</tool_call>)"),
    "llama3_json": (Llama3JsonParser, "Llama 3.1, 3.2, 3.3 ({\"name\", \"parameters\"}, <|python_tag|>)"),
    "mistral": (MistralParser, "Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Mistral Small / Magistral "
                               "([TOOL_CALLS])"),
    "deepseek_v3": (DeepSeekV3Parser, "DeepSeek-V3, DeepSeek-R1-0528, DeepSeek-V3.1 "
                                      "(<｜tool▁calls▁begin｜>)"),
    "glm45": (Glm45Parser, "GLM-4.5, GLM-4.6 (<tool_call>name<arg_key>...)"),
}

__all__ = ["PARSERS", "Parsed", "ToolCall", "ToolParser", "parser_class"]


def parser_class(name: str) -> type[ToolParser]:
    return PARSERS[name][0]
