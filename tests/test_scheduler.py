"""Scheduler budget rules: token budget per step, decodes before new prefills, max_num_seqs, preemption."""
from __future__ import annotations

import pytest

from kestrel.cache.block_pool import BlockPool
from kestrel.cache.radix import NoPrefixCache
from kestrel.engine.request import Sequence, SeqStatus
from kestrel.engine.scheduler import Scheduler
from kestrel.sampling_params import SamplingParams


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), SamplingParams(max_tokens=8))


def run_step(s: Scheduler):
    """Pretend the model ran: mark computed tokens, and give sequences that finished a prompt one output token."""
    plan = s.schedule()
    for item in plan.scheduled:
        item.seq.num_computed_tokens = item.start + item.num_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_token_ids.append(1)
    return plan


def test_step_never_exceeds_token_budget_and_chunks_long_prompts():
    s = Scheduler(BlockPool(100, 4), NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=10)
    s.add(seq(0, 25))
    sizes = [run_step(s).num_tokens for _ in range(3)]
    assert sizes == [10, 10, 5 + 0]        # 25-token prompt in chunks of 10, 10, 5
    assert run_step(s).scheduled[0].num_tokens == 1   # then decode


def test_decodes_are_scheduled_before_new_prefills():
    s = Scheduler(BlockPool(100, 4), NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=8)
    s.add(seq(0, 4))
    run_step(s)                                # seq 0 prefilled, now decoding
    s.add(seq(1, 20))
    plan = run_step(s)
    assert [(p.seq.seq_id, p.num_tokens) for p in plan.scheduled] == [(0, 1), (1, 7)]


def test_max_num_seqs_caps_running():
    s = Scheduler(BlockPool(100, 4), NoPrefixCache(), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(seq(i, 3))
    plan = run_step(s)
    assert len(plan.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_out_of_blocks_preempts_the_latest_running_sequence():
    pool = BlockPool(4, 4)                     # 16 tokens in all
    s = Scheduler(pool, NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq(0, 8), seq(1, 8)                # each fills 2 blocks exactly
    s.add(a)
    s.add(b)
    run_step(s)
    plan = run_step(s)                         # both need a third block: b is preempted so a can grow
    assert b in plan.preempted and b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert a.status is SeqStatus.RUNNING and len(a.block_ids) == 3
    pool.check_invariants()


def test_finish_returns_blocks():
    pool = BlockPool(10, 4)
    s = Scheduler(pool, NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=100)
    a = seq(0, 9)
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    assert pool.num_free == 10 and a.finish_reason == "stop" and not s.has_work()


def test_rollback_shortens_a_sequence_and_frees_trailing_blocks():
    pool = BlockPool(10, 4)
    s = Scheduler(pool, NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=100)
    a = seq(0, 6)
    s.add(a)
    run_step(s)                                 # 6 prompt tokens computed, 1 output token
    for _ in range(4):                          # decode to 11 tokens: 3 blocks
        run_step(s)
    assert a.num_tokens == 11 and len(a.block_ids) == 3
    s.rollback(a, 4)                            # 7 tokens left: 2 blocks; the 7th is fed again next step
    assert a.num_tokens == 7 and a.num_computed_tokens == 6 and len(a.block_ids) == 2
    assert pool.num_free == 8
    plan = run_step(s)                          # decoding resumes from the shortened sequence
    assert plan.scheduled[0].start == 6 and a.num_computed_tokens == 7 and a.num_tokens == 8
    pool.check_invariants()


def test_a_waiting_sequence_that_cannot_be_admitted_gives_its_prefix_match_back():
    """A prefix match lends cached blocks; admission failing for the rest of the chunk must give them back, or the
    waiting sequence pins blocks the running ones need (the livelock of 8 sequences on 40 blocks)."""
    from kestrel.cache.radix import RadixPrefixCache

    pool = BlockPool(8, 4)                          # 32 tokens in all
    s = Scheduler(pool, RadixPrefixCache(pool), max_num_seqs=8, max_num_batched_tokens=100)
    cached = seq(0, 16)
    s.add(cached)
    run_step(s)
    s.finish(cached, "stop")                        # its 4 prompt blocks stay in the cache, held only by the tree
    lent = list(range(4))
    assert [pool.ref_counts[b] for b in lent] == [1] * 4
    b, c = seq(1, 16), seq(2, 20)
    b.prompt_token_ids = [1000 + t for t in range(16)]   # shares nothing: takes the 4 free blocks
    c.prompt_token_ids = list(range(16)) + [500, 501, 502, 503]   # matches the cached 4, needs a 5th: none free
    s.add(b)
    s.add(c)
    plan = run_step(s)
    assert [p.seq for p in plan.scheduled] == [b] and c.status is SeqStatus.WAITING
    assert c.block_ids == [] and c.num_computed_tokens == 0, "a waiting sequence holds blocks"
    assert [pool.ref_counts[x] for x in lent] == [1] * 4
    plan = run_step(s)                              # b's decode needs a 5th block: the cache gives one up
    assert plan.preempted == [] and b.status is SeqStatus.RUNNING and len(b.block_ids) == 5
    pool.check_invariants()


@pytest.mark.slow
def test_eight_sequences_on_a_small_cache_all_finish(checkpoint_factory):
    """The livelock's own setting: more sequences than the cache holds at once, a prefix cache, chunked prefill;
    preemptions happen, every sequence finishes, and each gets the tokens it gets alone."""
    from kestrel import LLM

    path = str(checkpoint_factory("llama"))
    prompts = ["# A helper module.\nimport os\nimport sys\nimport json\n\n\ndef load(path):\n" * 2, "import os",
               "class Stack:\n    def __init__(self):\n        self.items = []\n", "x = 1\n" * 9] * 2
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    alone = [LLM(model=path, device="cpu").generate([p], params)[0].outputs[0].token_ids for p in prompts[:4]] * 2
    llm = LLM(model=path, device="cpu", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=40)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == alone
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
