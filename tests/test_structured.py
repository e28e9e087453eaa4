"""Structured outputs through the engine (issue 54) on the embedded default model (random weights: whatever it
draws, the grammar keeps it inside the constraint): every mode's outputs parse or match, alone and batched with
unconstrained rows; n > 1; preemption and the prefix cache; greedy constrained output is token-identical with
n-gram and EAGLE-3 speculation; a schema is compiled once; bad constraints are errors naming the problem.

A JSON value cut by max_tokens (finish_reason "length") need not parse: json_object's strings are unbounded, so its
checks accept a cut-off output when the grammar still accepts it as a prefix."""
from __future__ import annotations

import json

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import KestrelError
from kestrel.forward.sampler import apply_token_bitmask
from kestrel.sampling_params import StructuredOutput
from tests.structured_cases import SCHEMAS, check, check_completion, modes
from tests.test_speculative import drafter_dir, spec_configs  # noqa: F401 - the random EAGLE-3 drafter fixture

MODES = modes()
MAX_TOKENS = {"json_object": 96}   # others finish well within 64 on the default model
BOUNDED = [m for m in MODES if m != "json_object"]


def params(mode: str, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS.get(mode, 64), seed=seed, structured_output=MODES[mode], **kw)


def run_modes(llm: LLM, per_mode: int, **kw) -> dict[str, list]:
    """per_mode requests of every mode in one batch (seeded, sampled at temperature 1): outputs by mode."""
    prompts, plist, names = [], [], []
    for mode in MODES:
        for i in range(per_mode):
            prompts.append(f"Request {i}: answer as {mode}.")
            plist.append(params(mode, seed=i, **kw))
            names.append(mode)
    by_mode: dict[str, list] = {m: [] for m in MODES}
    for mode, out in zip(names, llm.generate(prompts, plist)):
        by_mode[mode].append(out.outputs[0])
    for mode, outs in by_mode.items():
        for c in outs:
            check_completion(llm, mode, c)
    return by_mode


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def test_bitmask_masks_exactly_the_forbidden_tokens_of_the_named_rows():
    """The sampler's unpacking against xgrammar's own kernel (the reference), rows without a mask untouched."""
    import xgrammar as xgr

    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32)
    full = torch.full((4, bitmask.shape[1]), -1, dtype=torch.int32)   # xgrammar's: one bitmask row per logits row
    full[[1, 3]] = bitmask
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab, indices=[1, 3])
    got = logits.clone()
    apply_token_bitmask(got, bitmask, [1, 3])
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert torch.isinf(got[1]).any() and torch.isinf(got[3]).any()


def test_a_steps_masks_filled_in_parallel_equal_those_filled_row_by_row(llm):
    """plain_bitmask through xgrammar's BatchGrammarMatcher against one fill per row: the same words, rows without a
    grammar not in the mask, a terminated grammar's row all-allowed."""
    from kestrel.structured.matcher import SequenceGrammar, plain_bitmask

    compiler = llm.engine.grammar_compiler
    vocab = llm.engine.model_config.vocab_size
    grammars = [SequenceGrammar(compiler.compile_async(so)) for so in MODES.values()]
    ended = SequenceGrammar(compiler.compile_async(StructuredOutput(choice=("a",))))
    for token in llm.engine.tokenizer.encode("a", add_special_tokens=False) + [min(llm.engine.eos_token_ids)]:
        assert ended.accept(token)
    assert ended.is_terminated
    rows: list[SequenceGrammar | None] = [None, *grammars, ended, None]
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):   # walk each grammar along random allowed tokens, comparing the masks at every step
        one_by_one = plain_bitmask(rows, vocab)
        batched = plain_bitmask(rows, vocab, compiler.batch)
        assert batched[1] == one_by_one[1] == list(range(1, len(rows) - 1))
        assert torch.equal(batched[0], one_by_one[0])
        assert (batched[0][-1] == -1).all()
        allowed = ((batched[0][:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :vocab]
        for k, g in enumerate(grammars):
            if not g.is_terminated:
                choices = allowed[k].nonzero().flatten()
                assert g.accept(int(choices[torch.randint(len(choices), (1,), generator=gen)]))


@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.slow] if m in SCHEMAS or m == "json_object"
                                               else []) for m in MODES])
def test_each_mode_alone(llm, mode):
    for seed in range(3):
        out = llm.generate("Give me an answer:", params(mode, seed=seed))[0].outputs[0]
        check_completion(llm, mode, out)


@pytest.mark.slow
def test_every_mode_batched_with_unconstrained_rows_leaves_those_rows_alone(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, [plain] * 2)]
    batch_prompts = prompts + [f"Answer {m}:" for m in MODES]
    outs = llm.generate(batch_prompts, [plain] * 2 + [params(m, seed=1) for m in MODES])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for mode, out in zip(MODES, outs[2:]):
        check_completion(llm, mode, out.outputs[0])


def test_finishes_with_stop_when_the_grammar_ends_even_with_ignore_eos(llm):
    out = llm.generate("Pick:", SamplingParams(max_tokens=50, seed=3, ignore_eos=True,
                                               structured_output=StructuredOutput(choice=("alpha", "beta"))))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in ("alpha", "beta")


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate("Paint:", params("paint", seed=5, n=6))[0]
    assert len(out.outputs) == 6
    for c in out.outputs:
        check("paint", c.text)
    assert len({c.text for c in out.outputs}) > 1   # sampled: the samples differ


def test_a_schema_is_compiled_once(llm):
    compiler = llm.engine.grammar_compiler
    llm.generate("x", params("readings", seed=0))
    before = compiler.num_compiled
    llm.generate(["a", "b", "c"], [params("readings", seed=s) for s in range(3)])
    so = StructuredOutput(json_schema=json.dumps(SCHEMAS["readings"].model_json_schema()))   # an equal, new object
    llm.generate("d", SamplingParams(max_tokens=64, structured_output=so))
    assert compiler.num_compiled == before


@pytest.mark.parametrize("so, words", [
    (StructuredOutput(json_schema='{"type": "wat"}'), "JSON schema"),
    (StructuredOutput(json_schema='{"type": "object"'), "not valid JSON"),
    (StructuredOutput(regex="a(b"), "regex"),
    (StructuredOutput(grammar='root ::= item\n'), "EBNF"),
    (StructuredOutput(choice=()), "choice"),
])
def test_a_bad_constraint_is_an_error_naming_it(llm, so, words):
    good = SamplingParams(max_tokens=4)
    with pytest.raises(KestrelError, match=words):   # nothing queued, not even the good request before it
        llm.generate(["x", "y"], [good, SamplingParams(max_tokens=4, structured_output=so)])
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_preemption_and_the_prefix_cache_keep_greedy_constrained_output():
    """A tiny KV cache preempts (recompute: the grammar keeps its place, the output tokens stay); a shared prompt
    prefix hits the cache. Same tokens as a roomy engine."""
    prompt = "A shared prefix that fills a block or two of the cache before the question. Q:"
    prompts = [prompt + f" {i}" for i in range(6)]
    plist = [params(m, temperature=0) for m in ("person", "paint", "readings", "regex", "choice", "person")]
    want = [o.outputs[0].token_ids for o in LLM(device="cpu").generate(prompts, plist)]
    small = LLM(device="cpu", num_gpu_blocks_override=12, block_size=16)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, plist)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want
    for mode, out in zip(("person", "paint", "readings", "regex", "choice", "person"),
                         small.generate(prompts, plist)):
        check(mode, out.outputs[0].text)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_constrained_output_is_identical_with_speculation(method, drafter_dir, llm):
    prompts = [f"Answer {i} as {m}:" for i, m in enumerate(BOUNDED)] * 2
    plist = [params(m, temperature=0) for m in BOUNDED] * 2
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plist)]
    spec = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)[method])
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, plist)]
    assert got == want
    assert spec.engine.spec.counters.num_draft_tokens > 0, "nothing was speculated"


@pytest.mark.slow
def test_fifty_requests_per_mode_batched(llm):
    by_mode = run_modes(llm, 50)
    for mode in BOUNDED:
        assert all(c.finish_reason == "stop" for c in by_mode[mode]), mode
    # random weights draw unbounded JSON strings: most objects still close within max_tokens
    assert sum(c.finish_reason == "stop" for c in by_mode["json_object"]) >= 35


@pytest.mark.slow
def test_fifty_requests_per_mode_one_at_a_time(llm):
    closed = 0
    for mode in MODES:
        for i in range(50):
            c = llm.generate(f"Request {i}: answer as {mode}.", params(mode, seed=i))[0].outputs[0]
            check_completion(llm, mode, c)
            closed += mode == "json_object" and c.finish_reason == "stop"
    assert closed >= 35


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_fifty_requests_per_mode_with_speculation(method, drafter_dir):
    spec = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)[method])
    by_mode = run_modes(spec, 50)
    for mode in BOUNDED:
        assert all(c.finish_reason == "stop" for c in by_mode[mode]), mode
    assert spec.engine.spec.counters.num_draft_tokens > 0


def _greedy_constrained_runs(llm: LLM) -> tuple[list[str], list[SamplingParams], list]:
    prompts = [f"Answer {i} as {m}:" for i, m in enumerate(BOUNDED)]
    plist = [params(m, temperature=0) for m in BOUNDED]
    return prompts, plist, llm.generate(prompts, plist)


@pytest.mark.slow
def test_drafts_of_the_constrained_continuation_are_all_accepted(llm):
    """A drafter that knows the constrained greedy output: every draft passes the masks computed along the drafts
    (a mask from a wrong grammar state would reject one, or change the output)."""
    from tests.test_speculative import K, OracleProposer

    prompts, plist, plain = _greedy_constrained_runs(llm)
    spec = LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
    spec.engine.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in plain])
    got = spec.generate(prompts, plist)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    c = spec.engine.spec.counters
    assert c.num_draft_tokens > 20 and c.num_accepted_tokens == c.num_draft_tokens, c


@pytest.mark.slow
def test_tree_drafts_are_masked_along_each_path(llm, drafter_dir):
    """EAGLE-3 trees: the true token at rank 1 of each step, wrong ones beside it; each node's row is masked after
    its own path from the root, and the output is the constrained greedy output."""
    from tests.test_spec_tree import RunnerUpOracle, tree_config

    prompts, plist, plain = _greedy_constrained_runs(llm)
    spec = LLM(device="cpu", speculative_config=tree_config(drafter_dir))
    vocab = spec.engine.model_config.vocab_size
    spec.engine.spec.proposer = RunnerUpOracle([o.prompt_token_ids + o.outputs[0].token_ids for o in plain], 1,
                                               vocab)
    got = spec.generate(prompts, plist)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    c = spec.engine.spec.counters
    assert c.num_drafts > 0 and c.accepted_per_pos[0] == c.num_drafts, c
