"""Speculative decoding is lossless: on the embedded default model (CPU, float32), greedy output with speculation
(EAGLE-3 with an untrained drafter, n-gram) is token-identical to the same engine without it, alone and batched
with requests of other lengths, with the prefix cache, chunked prefill and preemption; a drafter that always
guesses right is always accepted; and sampling at temperature 1 keeps the target's distribution."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_MODEL_DIR
from kestrel.models.model_config import ModelConfig  # noqa: F401 - the drafter's target config type
from kestrel.speculative.proposer import Proposer

PROMPTS = [
    "The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):", "1, 2, 3, 4, 5,",
    "The capital of France is", "Hello, my name is", "import numpy as np\nimport torch\n", "In 1492, Columbus",
    "The weather today is sunny and", "To be or not to be, that is", "SELECT * FROM users WHERE",
    "A B C D E F G", "for i in range(10):\n    print(i)\nfor i in range(10):\n", "Water boils at",
    "My favourite food is pizza. My favourite food is", "The cat sat on the mat. The cat sat on the",
    "Roses are red, violets are blue,", "class Stack:\n    def __init__(self):", "Once", "Q: What is 2+2?\nA:",
    "The first law of thermodynamics states that", "red green blue red green blue red green",
    "Dear Sir or Madam,", "It was the best of times, it was the worst of times,",
]
K = 3


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def mixed_params(n: int) -> list[SamplingParams]:
    """Requests of other lengths in the same batch."""
    return [greedy(8 + 7 * (i % 5)) for i in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> str:
    from kestrel.models.checkpoint import load_model_config
    from kestrel.models.eagle3_loader import random_eagle3_checkpoint

    target = load_model_config(DEFAULT_MODEL_DIR)
    out = tmp_path_factory.mktemp("drafter")
    return str(random_eagle3_checkpoint(out, target, draft_vocab_size=target.vocab_size // 2,
                                        seed=1, dtype=torch.float32))


def spec_configs(drafter: str) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                  "adaptive": False},
        "eagle3": {"method": "eagle3", "model": drafter, "num_speculative_tokens": K, "adaptive": False},
    }


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return token_ids(LLM(device="cpu").generate(PROMPTS, mixed_params(len(PROMPTS))))


def check_identical(llm: LLM, prompts: list[str], params: list[SamplingParams], want: list[list[int]]) -> None:
    got = token_ids(llm.generate(prompts, params))
    assert got == want
    counters = llm.engine.spec.counters
    assert counters.num_drafts > 0 and counters.num_draft_tokens > 0, "nothing was speculated"


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_batched_with_other_lengths_is_token_identical(method, drafter_dir, reference):
    llm = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)[method])
    check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_alone_is_token_identical(method, drafter_dir, reference):
    llm = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)[method])
    params = mixed_params(len(PROMPTS))
    for i in (0, 12, 15, 21):
        check_identical(llm, [PROMPTS[i]], [params[i]], [reference[i]])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_prefix_cache_chunked_prefill_and_preemption(method, drafter_dir):
    """Twice through the same prompts (the second run hits the prefix cache), in 16-token prefill chunks, with a
    KV cache so small that sequences are preempted and recomputed."""
    prompts = [p * 3 for p in PROMPTS[:12]]   # longer prompts: several chunks each
    params = [greedy(40)] * len(prompts)
    kw = dict(device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=24)
    want = token_ids(LLM(**kw).generate(prompts, params))
    llm = LLM(speculative_config=spec_configs(drafter_dir)[method], **kw)
    for _ in range(2):
        check_identical(llm, prompts, params, want)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert llm.engine.prefix_cache.stats.hit_tokens > 0


@pytest.mark.slow
def test_adaptive_policy_stays_token_identical(drafter_dir, reference):
    config = dict(spec_configs(drafter_dir)["eagle3"], adaptive=True)
    llm = LLM(device="cpu", speculative_config=config)
    assert token_ids(llm.generate(PROMPTS, mixed_params(len(PROMPTS)))) == reference


class OracleProposer(Proposer):
    """Drafts the continuation a run without speculation produced: a drafter identical in effect to the target."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def drafts(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids()
        for full in self.sequences:
            if full[:len(tokens)] == tokens:
                return full[len(tokens):len(tokens) + k]
        return []


@pytest.mark.slow
def test_a_drafter_identical_to_the_target_is_always_accepted():
    prompts = PROMPTS[:8]
    params = greedy(1 + 4 * (K + 1))   # after the prefill's token, every verify step has room for K drafts
    plain = LLM(device="cpu").generate(prompts, params)
    llm = LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
    llm.engine.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in plain])
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
    c = llm.engine.spec.counters
    acceptance_rate = c.num_accepted_tokens / c.num_draft_tokens
    acceptance_length = 1 + c.num_accepted_tokens / c.num_drafts
    assert acceptance_rate >= 0.98 and acceptance_length >= 0.98 * (K + 1), (acceptance_rate, acceptance_length)
    assert c.accepted_per_pos == [c.num_drafts] * K


@pytest.mark.slow
def test_synthetic_acceptance_mode(drafter_dir):
    """The benchmark mode accepts each draft position with the given probability, whatever the tokens: the first
    draft passes with probability p, and each later one with p given the ones before it passed."""
    for rate, tolerance in ((1.0, 0.0), (0.5, 0.12)):
        llm = LLM(device="cpu", speculative_config={"method": "eagle3", "model": drafter_dir, "adaptive": False,
                                                    "num_speculative_tokens": K, "synthetic_acceptance_rate": rate})
        llm.generate(PROMPTS[:8], greedy(1 + 8 * (K + 1)))
        c = llm.engine.spec.counters
        first, second = c.accepted_per_pos[0] / c.num_drafts, c.accepted_per_pos[1] / c.accepted_per_pos[0]
        assert abs(first - rate) <= tolerance and abs(second - rate) <= tolerance, c


def chi_squared_p_value(a: Counter, b: Counter) -> float:
    """Homogeneity of two samples over categories (rare ones pooled so each expected count is >= 5)."""
    na, nb = sum(a.values()), sum(b.values())
    pooled, other = [], [0, 0]
    for key in set(a) | set(b):
        ea, eb = (a[key] + b[key]) * na / (na + nb), (a[key] + b[key]) * nb / (na + nb)
        if min(ea, eb) < 5:
            other[0] += a[key]
            other[1] += b[key]
        else:
            pooled.append((a[key], b[key]))
    if sum(other):
        pooled.append(tuple(other))
    stat = 0.0
    for xa, xb in pooled:
        total = xa + xb
        for x, n in ((xa, na), (xb, nb)):
            e = total * n / (na + nb)
            stat += (x - e) ** 2 / e
    dof = max(len(pooled) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_sampling_keeps_the_target_distribution(method, drafter_dir):
    """2,000 samples of the first 3 tokens at temperature 1, with and without speculation: each position's token
    distribution (and the first two tokens jointly) pass a chi-squared homogeneity test at p > 0.001, and each
    position's total-variation distance over its 20 commonest tokens plus the rest stays under 0.08 (two
    2,000-sample draws of one distribution sit at 0.025-0.04 on this model)."""
    prompt = "red green blue red green blue red green"   # repetitive: the n-gram proposer drafts at every step
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
    kw = dict(device="cpu", max_num_seqs=256)
    plain = token_ids(LLM(**kw).generate([prompt] * n, params))
    llm = LLM(speculative_config=spec_configs(drafter_dir)[method], **kw)
    spec = token_ids(llm.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True,
                                                                seed=10_000 + i) for i in range(n)]))
    c = llm.engine.spec.counters
    assert c.num_draft_tokens > 0
    for pos in range(3):
        a, b = Counter(t[pos] for t in plain), Counter(t[pos] for t in spec)
        assert chi_squared_p_value(a, b) > 1e-3, f"position {pos}"
    joint_p = chi_squared_p_value(Counter(tuple(t[:2]) for t in plain), Counter(tuple(t[:2]) for t in spec))
    assert joint_p > 1e-3
    for pos in range(3):
        assert bucketed_tv(Counter(t[pos] for t in plain), Counter(t[pos] for t in spec)) < 0.08, f"position {pos}"


def bucketed_tv(a: Counter, b: Counter, top: int = 20) -> float:
    """Total variation over the `top` most frequent tokens and one bucket for the rest (this model spreads its
    temperature-1 mass over hundreds of tokens, where a per-token TV of 2,000 samples is mostly noise)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k, _ in (a + b).most_common(top)]
    fa = [a[k] / na for k in keys] + [1 - sum(a[k] for k in keys) / na]
    fb = [b[k] / nb for k in keys] + [1 - sum(b[k] for k in keys) / nb]
    return 0.5 * sum(abs(x - y) for x, y in zip(fa, fb))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_verify_graph_road_pads_every_row_to_k_drafts(method, drafter_dir, reference):
    """The GPU's road on the CPU: a verify runner of K + 1 query tokens a sequence (forward/decode_graphs.py, its
    body run eagerly), so every row is padded to K drafts; the output stays token-identical."""
    from kestrel.forward.decode_graphs import DecodeGraphs

    llm = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)[method])
    runner = llm.engine.runner
    runner.verify_graphs = DecodeGraphs(runner, max_bs=32, max_blocks_per_seq=128, max_rows=256, query_len=K + 1)
    launches = []
    original = runner.verify_graphs.launch
    runner.verify_graphs.launch = lambda chunks: launches.append(len(chunks)) or original(chunks)
    check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)
    assert launches, "no verify step took the graph road"


@pytest.mark.slow
def test_drafter_graph_road_drafts_what_the_eager_drafter_drafts(drafter_dir, reference):
    """The GPU's drafter road on the CPU (forward/drafter_graphs.py, its body run eagerly): after every
    verify-graph step the drafter extends and drafts in one launch over padded rows. Output stays token-identical,
    and every draft equals the eager drafter's."""
    from kestrel.forward.decode_graphs import DecodeGraphs
    from kestrel.forward.drafter_graphs import DrafterGraphs

    drafted = []
    for graph_drafter in (False, True):
        llm = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)["eagle3"])
        runner = llm.engine.runner
        runner.verify_graphs = DecodeGraphs(runner, max_bs=32, max_blocks_per_seq=128, max_rows=256,
                                            query_len=K + 1)
        proposer = llm.engine.spec.proposer
        drafts, asked = [], proposer.drafts
        proposer.drafts = lambda seq, k: drafts.append(asked(seq, k)) or drafts[-1]
        runs = []
        if graph_drafter:
            proposer.graphs = DrafterGraphs(proposer.drafter, type(runner.backend)(), proposer.kv,
                                            runner.verify_graphs, K)
            original, chain = proposer.graphs.run, proposer.graphs.run_chain
            proposer.graphs.run = lambda rows, output: runs.append(len(rows)) or original(rows, output)
            # greedy chain steps verify on the device and draft in the same launch
            proposer.graphs.run_chain = lambda chunks, d, output: runs.append(len(chunks)) or chain(chunks, d, output)
        check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)
        assert runs or not graph_drafter, "the drafter never took the graph road"
        drafted.append(drafts)
    assert sum(len(d) for d in drafted[0]) > 100
    assert drafted[0] == drafted[1]


def on_graph_roads(llm: LLM) -> list[int]:
    """The GPU's verify and drafter roads on the CPU (bodies run eagerly); returns the list each greedy chain step
    that verified on the device appends its batch size to."""
    from kestrel.forward.decode_graphs import DecodeGraphs
    from kestrel.forward.drafter_graphs import DrafterGraphs

    runner, proposer = llm.engine.runner, llm.engine.spec.proposer
    runner.verify_graphs = DecodeGraphs(runner, max_bs=32, max_blocks_per_seq=128, max_rows=256, query_len=K + 1)
    proposer.graphs = DrafterGraphs(proposer.drafter, type(runner.backend)(), proposer.kv, runner.verify_graphs, K)
    fused, chain = [], proposer.graphs.run_chain
    proposer.graphs.run_chain = lambda chunks, d, output: fused.append(len(chunks)) or chain(chunks, d, output)
    return fused


@pytest.mark.slow
def test_device_verified_chain_with_preemption_and_the_prefix_cache(drafter_dir):
    """Greedy chain steps verified inside the drafter's launch (one read-back a step), with 16-token prefill
    chunks, a cache small enough to preempt and a second pass on the prefix cache: token-identical."""
    prompts = [p * 3 for p in PROMPTS[:12]]
    params = [greedy(40)] * len(prompts)
    kw = dict(device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=24)
    want = token_ids(LLM(**kw).generate(prompts, params))
    llm = LLM(speculative_config=spec_configs(drafter_dir)["eagle3"], **kw)
    fused = on_graph_roads(llm)
    for _ in range(2):
        check_identical(llm, prompts, params, want)
    assert fused and llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_device_verified_chain_with_stops_min_tokens_and_sampled_rows(drafter_dir):
    """Stops inside an accepted run (EOS, stop tokens, max_tokens), min_tokens (verified on the host while a stop
    is banned) and a sampled row in the batch (the host's verification for those steps): the greedy rows stay
    token-identical to decoding without speculation."""
    prompts = PROMPTS[:10]
    plain_llm = LLM(device="cpu")
    free = token_ids(plain_llm.generate(prompts, greedy(24)))
    # stop on a token each greedy continuation really produces, at some point inside the output
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0,
                                                                           stop_token_ids=[free[1][9]]),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=12, stop_token_ids=[free[2][5], free[2][13]]),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    params += [SamplingParams(max_tokens=5 + 3 * i, temperature=0, stop_token_ids=[free[i][4 + i]])
               for i in range(4, len(prompts))]
    want = token_ids(plain_llm.generate(prompts, params))
    for sampled in (False, True):
        llm = LLM(device="cpu", speculative_config=spec_configs(drafter_dir)["eagle3"])
        fused = on_graph_roads(llm)
        batch, batch_params = list(prompts), list(params)
        if sampled:
            batch.append(PROMPTS[11])
            batch_params.append(SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True))
        got = token_ids(llm.generate(batch, batch_params))
        assert got[:len(prompts)] == want
        assert fused
