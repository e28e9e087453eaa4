"""Pydantic models of the OpenAI HTTP schema (the parts Kestrel serves).

Requests are strict about types (a string where a number belongs is a 400, as with OpenAI) and ignore fields they
do not know, so clients written for OpenAI or vLLM keep working. Value ranges are checked once, by SamplingParams,
so the error messages name the same rules whether a request comes over HTTP or through `LLM.generate`.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM extension: running usage on every chunk (with include_usage)


class JsonSchemaFormat(_Request):
    """response_format.json_schema (OpenAI): the schema under `schema`; `strict` is accepted (decoding under the
    schema is always strict)."""
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` object: exactly one of these."""
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, then vLLM extensions)."""
    model: str | None = None               # None: the served model (vLLM accepts this too)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None       # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0          # accepted only as 0: no penalties yet (a clear 400 beats ignoring)
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured outputs (server/structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs,
    # SGLang's regex / ebnf / json_schema; at most one
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None


class CompletionRequest(_SamplingFields):
    # Token ids first, tried left to right: under strict=True the four types are disjoint, so the order changes no
    # outcome, but pydantic's smart mode took 23 us to validate a 128-id prompt and this order takes 4.5 us.
    prompt: list[int] | str | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = 16            # OpenAI's default for completions (null too: completions.max_tokens)
    logprobs: int | None = None            # top-k logprobs per token (OpenAI caps at 5; we allow 20 like vLLM)
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str                         # a JSON object, as text (OpenAI's shape)


class MessageToolCall(_Request):
    """A call an assistant message made, sent back in the next turn's messages."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None   # assistant messages
    tool_call_id: str | None = None                   # tool messages: the call they answer


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None          # deprecated name; None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # None: "auto" when tools are given, "none" without (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # False: "required" makes exactly one call


# ---- responses --------------------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: OpenAI's error envelope."""
    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
