"""POST /v1/chat/completions: messages through the tokenizer's chat template, an assistant message out."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from kestrel.errors import KestrelError
from kestrel.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatTokenLogprob, ResponseFunctionCall, ResponseToolCall,
                                     TopLogprob)
from kestrel.server.serving import APIError, Generation, TokenText, framed_stream, sse
from kestrel.server.tool_parsers.stream import ToolCallStream
from kestrel.server.tools import NO_TOOLS, ToolPlan, without_suffix


def prompt_token_ids(req: ChatCompletionRequest, tokenizer, tools: list[dict] | None = None) -> list[int]:
    messages = [template_message(i, m) for i, m in enumerate(req.messages)]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except KestrelError as exc:
        raise APIError(400, str(exc), param="messages") from None


def template_message(i: int, m) -> dict:
    """A message as chat templates read it. An assistant message's calls carry their arguments as a dict, as
    transformers' templates expect (Llama 3.1's and Qwen2.5's write `arguments | tojson`); vLLM does the same."""
    content = m.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}]: content part of type {part.type!r} is not supported "
                                    "(only text)", param="messages")
        content = "\n".join(part.text for part in content)
    # no content: "" as before, but None beside calls (DeepSeek's template tests `content is none` there)
    message = {"role": m.role, "content": content if content is not None else (None if m.tool_calls else "")}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON ({exc}): "
                               "send the arguments the call was made with, a JSON object as text",
                               param="messages") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        message["tool_calls"] = calls
    return message


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


class ChatFormat:
    """The answer's shape for one request: plain content, or content and tool calls read by the plan's parser.
    `app._respond` calls `response` (non-streamed) or `stream`."""

    def __init__(self, plan: ToolPlan = NO_TOOLS, eos_texts: tuple[str, ...] = ()) -> None:
        self.plan = plan
        self.eos_texts = eos_texts   # special tokens kept for the parser: the EOS text that ended a choice goes

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        if self.plan.make_parser is None:
            return AssistantMessage(content=text), finish_reason
        parsed = self.plan.make_parser().parse(without_suffix(text, self.eos_texts))
        calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        if calls and finish_reason != "abort":
            finish_reason = self.plan.finish_reason
        return AssistantMessage(content=parsed.content, tool_calls=calls), finish_reason

    def response(self, gen: Generation, model: str, token_text: TokenText,
                 want_logprobs: bool) -> ChatCompletionResponse:
        choices = []
        for c in gen.choices:
            message, finish_reason = self.message("".join(c.text), c.finish_reason)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                      logprobs=logprobs_block(c.logprobs, token_text) if want_logprobs else None))
        return ChatCompletionResponse(id=gen.id, created=gen.created, model=model, choices=choices,
                                      usage=gen.usage())

    async def stream(self, gen: Generation, model: str, token_text: TokenText, want_logprobs: bool,
                     include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        head = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": model}

        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
            body = dict(head, choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish_reason}])
            if include_usage:
                body["usage"] = gen.usage().model_dump() if continuous_usage else None
            return sse(json.dumps(body))

        parsing = self.plan.make_parser is not None
        calls = {c.index: ToolCallStream(self.plan.make_parser()) for c in gen.choices} if parsing else {}

        async def chunks() -> AsyncIterator[str]:
            for c in gen.choices:   # OpenAI opens every choice with the role
                yield chunk(c.index, {"role": "assistant", "content": ""})
            async for choice, delta in gen.events():
                if not parsing:
                    if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.logprobs):
                        continue   # text held back (partial UTF-8 or a possible stop string): nothing to say yet
                    logprobs = logprobs_block(delta.logprobs or [], token_text).model_dump() if want_logprobs \
                        else None
                    yield chunk(choice.index, {"content": delta.text} if delta.text else {}, delta.finish_reason,
                                logprobs)
                    continue
                logprobs = (logprobs_block(delta.logprobs, token_text).model_dump()
                            if want_logprobs and delta.logprobs else None)
                stream = calls[choice.index]
                final = delta.finish_reason is not None
                text = without_suffix(stream.text + delta.text, self.eos_texts)[len(stream.text):] if final \
                    else delta.text
                content, fragments = stream.feed(text, final)
                if content:
                    yield chunk(choice.index, {"content": content}, logprobs=logprobs)
                    logprobs = None
                if fragments:
                    yield chunk(choice.index, {"tool_calls": fragments}, logprobs=logprobs)
                    logprobs = None
                if final:
                    reason = delta.finish_reason
                    if stream.called and reason != "abort":
                        reason = self.plan.finish_reason
                    yield chunk(choice.index, {}, reason, logprobs)
                elif logprobs is not None:
                    yield chunk(choice.index, {}, None, logprobs)

        async for frame in framed_stream(gen, head, include_usage, chunks()):
            yield frame
