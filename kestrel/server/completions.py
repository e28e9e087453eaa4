"""POST /v1/completions: prompt(s) in, text out (whole, or streamed as server-sent events)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from kestrel.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from kestrel.server.serving import APIError, Generation, TokenText, framed_stream, sse


def prompt_token_ids(req: CompletionRequest, tokenizer) -> list[list[int]]:
    """`prompt` may be text, a list of texts, token ids, or a list of token id lists."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise APIError(400, "prompt is empty: send a string, a list of strings or a list of token ids",
                       param="prompt")
    else:
        prompts = prompt if isinstance(prompt[0], (str, list)) else [prompt]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


def max_tokens(req: CompletionRequest) -> int:
    """`max_tokens` absent or null: OpenAI's default, 16 (not the rest of the context, as chat's null means)."""
    return DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def has_text(req: CompletionRequest) -> bool:
    """Whether `prompt` holds text to tokenize (else only token ids)."""
    prompt = req.prompt
    return isinstance(prompt, str) or bool(prompt) and isinstance(prompt[0], str)


def num_prompts(req: CompletionRequest) -> int:
    prompt = req.prompt
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def check_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")


def logprobs_block(logprobs: list, token_text: TokenText, offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in logprobs:
        text = token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({token_text(t): v for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def response(gen: Generation, model: str, token_text: TokenText, want_logprobs: bool) -> CompletionResponse:
    choices = [CompletionChoice(index=c.index, text="".join(c.text), finish_reason=c.finish_reason,
                                logprobs=logprobs_block(c.logprobs, token_text, 0) if want_logprobs else None)
               for c in gen.choices]
    return CompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices, usage=gen.usage())


async def stream(gen: Generation, model: str, token_text: TokenText, want_logprobs: bool,
                 include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    offsets = [0] * len(gen.choices)
    head = {"id": gen.id, "object": "text_completion", "created": gen.created, "model": model}

    async def chunks() -> AsyncIterator[str]:
        async for choice, delta in gen.events():
            if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.logprobs):
                continue   # text held back (partial UTF-8 or a possible stop string): nothing to say yet
            logprobs = None
            if want_logprobs:
                block = logprobs_block(delta.logprobs or [], token_text, offsets[choice.index])
                logprobs = block.model_dump()
            offsets[choice.index] += len(delta.text)
            chunk = dict(head, choices=[{"index": choice.index, "text": delta.text, "logprobs": logprobs,
                                         "finish_reason": delta.finish_reason}])
            if include_usage:
                chunk["usage"] = gen.usage().model_dump() if continuous_usage else None
            yield sse(json.dumps(chunk))

    async for frame in framed_stream(gen, head, include_usage, chunks()):
        yield frame
