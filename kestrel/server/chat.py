"""POST /v1/chat/completions: messages through the tokenizer's chat template, an assistant message out."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from kestrel.errors import KestrelError
from kestrel.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatTokenLogprob, TopLogprob)
from kestrel.server.serving import APIError, Generation, TokenText, framed_stream, sse


def prompt_token_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: content part of type {part.type!r} is not supported "
                                        "(only text)", param="messages")
            content = "\n".join(part.text for part in content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except KestrelError as exc:
        raise APIError(400, str(exc), param="messages") from None


def field_names(req: ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams names -> the fields this request sent them as, for error messages."""
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def top_logprobs(req: ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs: None when not asked; top_logprobs (0..20) alternatives per token otherwise."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def logprobs_block(logprobs: list, token_text: TokenText) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                                                  top_logprobs=[entry(t, v) for t, v in lp.top])
                                 for lp in logprobs])


def response(gen: Generation, model: str, token_text: TokenText, want_logprobs: bool) -> ChatCompletionResponse:
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content="".join(c.text)),
                          finish_reason=c.finish_reason,
                          logprobs=logprobs_block(c.logprobs, token_text) if want_logprobs else None)
               for c in gen.choices]
    return ChatCompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices, usage=gen.usage())


async def stream(gen: Generation, model: str, token_text: TokenText, want_logprobs: bool,
                 include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    head = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": model}

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
        body = dict(head, choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish_reason}])
        if include_usage:
            body["usage"] = gen.usage().model_dump() if continuous_usage else None
        return sse(json.dumps(body))

    async def chunks() -> AsyncIterator[str]:
        for c in gen.choices:   # OpenAI opens every choice with the role
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for choice, delta in gen.events():
            if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.logprobs):
                continue   # text held back (partial UTF-8 or a possible stop string): nothing to say yet
            logprobs = logprobs_block(delta.logprobs or [], token_text).model_dump() if want_logprobs else None
            yield chunk(choice.index, {"content": delta.text} if delta.text else {}, delta.finish_reason, logprobs)

    async for frame in framed_stream(gen, head, include_usage, chunks()):
        yield frame
