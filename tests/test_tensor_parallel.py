"""Tensor parallelism on the CPU (gloo, float32): N ranks compute what one rank computes.

Each case builds the same model at TP=1 and TP=N through LLM(...), which starts the N - 1 worker processes: the
prompt logits agree within 1e-5 of their largest magnitude and greedy generation gives identical tokens. The shapes cover an even split of
the KV heads, KV heads replicated over ranks (fewer KV heads than ranks), a vocabulary that does not divide evenly
(padded shards), tied embeddings, Qwen2's q/k/v biases and Qwen3's q/k norms; and the MoE models (Qwen3-MoE,
Mixtral, GLM-4-MoE, DeepSeek-V3 with its latent attention) with every expert's width split over the ranks."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from kestrel.errors import KestrelError
from tests.tolerances import assert_close_relative

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "import os",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def run(model: str, tp: int, **kw) -> tuple[list[torch.Tensor], list[list[int]]]:
    """(prompt logits of each prompt, greedy tokens of each prompt) at tensor_parallel_size=tp."""
    llm = LLM(model=model, device="cpu", tensor_parallel_size=tp, **kw)
    try:
        logits = [llm.engine.prompt_logits(llm.tokenizer.encode(p)) for p in PROMPTS]
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]
        if tp > 1:
            assert llm.engine.runner.tp.size == tp
        return logits, tokens
    finally:
        llm.shutdown()


def assert_same(model: str, tp: int, **kw) -> None:
    ref_logits, ref_tokens = run(model, 1, **kw)
    logits, tokens = run(model, tp, **kw)
    for i, (ref, got) in enumerate(zip(ref_logits, logits)):
        # float32 sums split over ranks differ in the last bits: the bound scales with the logits (~12 here)
        assert_close_relative(got, ref, 1e-5, f"prompt {i}")
    assert tokens == ref_tokens


CASES = [
    (2, dict(arch="llama")),                                   # 2 KV heads: one per rank
    (2, dict(arch="llama", tie=True, shard=True)),             # tied lm_head shares the embedding's shard
    (2, dict(arch="qwen2", num_kv_heads=4)),                   # q/k/v biases
    (2, dict(arch="qwen3", num_kv_heads=1, vocab_size=389)),   # q/k norms; one KV head on both ranks; odd vocab
    (2, dict(arch="mistral")),
    (3, dict(arch="llama", num_heads=6, num_kv_heads=1, hidden_size=96, intermediate_size=96,
             vocab_size=391)),                                 # 391 = 3 * 130 + 1: the last shard padded
    (4, dict(arch="llama3", num_kv_heads=2)),                  # each KV head on two ranks
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,case", CASES, ids=[f"tp{tp}-" + "-".join(f"{k}={v}" for k, v in c.items())
                                                for tp, c in CASES])
def test_tp_logits_and_greedy_tokens_equal_one_rank(checkpoint_factory, tp, case):
    assert_same(str(checkpoint_factory(**case)), tp)


MOE_CASES = [
    (2, "qwen3_moe"),               # a dense layer between sparse ones, top-2 renormalised
    (2, "mixtral"),
    (4, "qwen3_moe_raw"),           # each KV head on two ranks, experts 8 wide a rank
    (2, "glm4_moe"),                # a shared expert, q/k/v bias, q/k norm, partial rotary
    (2, "deepseek_v3"),             # latent attention: heads split, the latent cache on every rank
    (2, "deepseek_v3_no_q_lora"),   # q_proj instead of q_a/q_b; two shared experts
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,name", MOE_CASES, ids=[f"tp{tp}-{name}" for tp, name in MOE_CASES])
def test_moe_tp_logits_and_greedy_tokens_equal_one_rank(moe_checkpoint, tp, name):
    """Every expert on every rank, each expert's width split, the router replicated, one all-reduce a MoE
    layer; DeepSeek's latent attention with its heads split."""
    assert_same(str(moe_checkpoint(name)), tp)


def test_moe_experts_width_that_does_not_split_is_refused(moe_checkpoint, tmp_path):
    """Before any rank starts (the driver), and by the model itself (a worker builds it with its TPGroup)."""
    import json
    import shutil

    from kestrel.distributed.comm import TPGroup
    from kestrel.errors import ModelLoadError
    from kestrel.models.model_config import hf_model_config
    from kestrel.models.registry import model_class

    path = tmp_path / "odd_experts"
    shutil.copytree(moe_checkpoint("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, moe_intermediate_size=33)))
    message = r"\(moe_intermediate_size\) 33 does not divide evenly over 2 ranks"
    with pytest.raises(KestrelError, match=r"--tensor-parallel-size 2: the model cannot be split, its expert width "
                                           + message):
        LLM(model=str(path), device="cpu", tensor_parallel_size=2)
    cfg = hf_model_config(path)
    with pytest.raises(ModelLoadError, match=r"--tensor-parallel-size 2: Qwen3MoeForCausalLM cannot be split, "
                                             r"its expert width " + message):
        model_class(cfg)(cfg, tp=TPGroup(rank=0, size=2))


def test_latent_attention_heads_that_do_not_split_are_refused(moe_checkpoint):
    with pytest.raises(KestrelError, match=r"--tensor-parallel-size 3: the model cannot be split, its 4 attention "
                                           r"heads do not divide evenly over 3 ranks"):
        LLM(model=str(moe_checkpoint("deepseek_v3")), device="cpu", tensor_parallel_size=3)


@pytest.mark.slow
def test_default_model_at_tp2_equals_one_rank():
    assert_same(None, 2)


@pytest.mark.slow
def test_chunked_prefill_and_preemption_at_tp2_keep_tokens(checkpoint_factory):
    # 4-token blocks, few of them, and a 16-token step budget: prompts in chunks, decodes preempted
    assert_same(str(checkpoint_factory("llama")), 2, block_size=4, num_gpu_blocks_override=24,
                max_num_batched_tokens=16, disable_prefix_cache=True)


def test_heads_that_do_not_split_are_refused_before_any_rank_starts():
    with pytest.raises(KestrelError, match=r"--tensor-parallel-size 3: the model cannot be split, its 4 attention "
                                           r"heads do not divide evenly over 3 ranks"):
        LLM(device="cpu", tensor_parallel_size=3)


def test_kv_heads_that_cannot_be_replicated_evenly_are_refused(checkpoint_factory):
    path = checkpoint_factory("llama", num_heads=6, num_kv_heads=2, hidden_size=96, intermediate_size=96)
    with pytest.raises(KestrelError, match="2 KV heads cannot be replicated evenly over 3 ranks"):
        LLM(model=str(path), device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=0), "--tensor-parallel-size 0 is invalid"),
    (dict(tensor_parallel_size=4, nnodes=3), "--nnodes 3 is invalid"),
    (dict(tensor_parallel_size=2, nnodes=2), "--nnodes > 1 needs --dist-init-addr"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank 2 is invalid"),
    (dict(tensor_parallel_size=2, dist_init_addr="nohostport"), "--dist-init-addr 'nohostport' is invalid"),
])
def test_parallel_options_are_checked_at_the_edge(kwargs, message):
    with pytest.raises(KestrelError, match=message):
        EngineConfig(**kwargs)


def test_tp_flag_and_its_alias_reach_the_config():
    from kestrel.cli import build_parser
    from kestrel.config import config_from_args

    parser, _ = build_parser()
    for flag in ("--tensor-parallel-size", "--tp"):
        args = parser.parse_args(["serve", flag, "2", "--nnodes", "2", "--node-rank", "1",
                                  "--dist-init-addr", "10.0.0.1:5000"])
        config = config_from_args(args)
        assert (config.tensor_parallel_size, config.nnodes, config.node_rank) == (2, 2, 1)
        assert config.dist_address == ("10.0.0.1", 5000)


def _worker_processes():
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if "kestrel.ranks.worker" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_a_killed_rank_fails_the_next_generate_with_its_name(checkpoint_factory):
    from kestrel.ranks.driver import RankFailure

    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", tensor_parallel_size=2)
    try:
        [worker] = _worker_processes()
        worker.kill()   # not waited for here: the engine's own watch reaps it and reads its exit code
        with pytest.raises(RankFailure, match=rf"tensor-parallel rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_hung_rank_is_named_after_the_timeout_instead_of_hanging(checkpoint_factory):
    import signal
    import time

    from kestrel.ranks.driver import RankFailure

    # the timeout covers joining too: long enough for a worker to import torch on a slow machine
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", tensor_parallel_size=2, dist_timeout=15)
    [worker] = _worker_processes()
    try:
        worker.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="a rank hangs"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 30
    finally:
        worker.kill()
        llm.shutdown()


@pytest.mark.slow
def test_shutdown_stops_every_rank(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", tensor_parallel_size=2)
    procs = dict(llm.engine.runner.ranks.procs)
    assert list(procs) == [1]
    llm.shutdown()
    assert [p.returncode for p in procs.values()] == [0]   # stopped by rank 0, not killed
