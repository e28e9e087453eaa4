"""MLA's absorbed decode through the split-K Triton decode kernel (kernels/triton/latent_decode.py, reached by the
triton backend's latent_decode) equals the torch absorbed form (attention/mla.py LatentAttention.absorbed, the
oracle), under Triton's interpreter on the CPU: fresh random latent caches with shuffled blocks, several sequences
whose contexts end inside and on block boundaries, a padded row of no context, 576-wide-like non-power-of-two
latent rows, and head groups of 16 up to all the heads in one program."""
from __future__ import annotations

import pytest
import torch

from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

TOL = dict(atol=1e-4, rtol=1e-4)   # float32; atol for values of order one, scaled() grows it with the reference

interpreted_only = interpreted_only_marker("test_mla_triton_decode_under_triton_interpreter")

BLOCK, NOPE, V = 4, 16, 12


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="the launcher itself")
def test_mla_triton_decode_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=21)   # all but the ones that skip in the child


def decode_problem(kv_lens: list[int], heads: int, rank: int, rope: int, table_dtype: torch.dtype, seed: int):
    """A decode batch over a random latent cache (blocks shuffled, unwritten slots noise) and random weights. A
    kv_len of 0 is a padded row, built as the decode graphs build one: no blocks, table row -1."""
    from kestrel.batch import build_forward_batch
    from tests.test_mla import shuffled_block_tables

    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(kv_lens, BLOCK, 2, gen)
    real = [i for i, n in enumerate(kv_lens) if n]
    batch = build_forward_batch([[0]] * len(real), [kv_lens[i] - 1 for i in real], [tables[i] for i in real], BLOCK)
    batch = pad_rows(batch, kv_lens, table_dtype)
    cache = torch.randn(num_blocks, BLOCK, 1, rank + rope, generator=gen)
    q_nope = torch.randn(len(kv_lens), heads, NOPE, generator=gen)
    q_pe = torch.randn(len(kv_lens), heads, rope, generator=gen)
    w_uk = 0.3 * torch.randn(heads, NOPE, rank, generator=gen)
    w_uv = 0.3 * torch.randn(heads, V, rank, generator=gen)
    return batch, cache, q_nope, q_pe, w_uk, w_uv


def pad_rows(batch, kv_lens: list[int], table_dtype: torch.dtype):
    """The batch of the real rows, with a row of kv_len 0 (table -1) wherever kv_lens has one."""
    import dataclasses

    rows = len(kv_lens)
    table = torch.full((rows, batch.block_table.shape[1]), -1, dtype=table_dtype)
    real = torch.tensor([i for i, n in enumerate(kv_lens) if n])
    table[real] = batch.block_table.to(table_dtype)
    lens = torch.tensor(kv_lens, dtype=batch.kv_lens.dtype)
    slots = torch.full((rows,), -1, dtype=batch.slot_mapping.dtype)
    slots[real] = batch.slot_mapping
    return dataclasses.replace(batch, block_table=table, kv_lens=lens, slot_mapping=slots,
                               query_start_loc=torch.arange(rows + 1, dtype=batch.query_start_loc.dtype),
                               positions=torch.zeros(rows, dtype=batch.positions.dtype), logits_at=None,
                               input_ids=torch.zeros(rows, dtype=batch.input_ids.dtype))


def absorbed_both_ways(batch, cache, q_nope, q_pe, w_uk, w_uv, rank: int, rope: int, heads_per_program: int,
                       num_splits: int | None):
    from kestrel.attention.mla import LatentAttention
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.kernels.triton import latent_decode

    class OnTheCpu(TritonAttentionBackend):   # the engine keeps the CPU on torch; here the kernel is under test
        def latent_decode(self, q, latent_cache, batch, scale, latent_scale=1.0):
            return latent_decode.latent_decode_attention(q, latent_cache, batch.block_table, batch.kv_lens, scale,
                                                         num_splits=num_splits, heads_per_program=heads_per_program,
                                                         latent_scale=latent_scale)

    attn = LatentAttention(rank, (NOPE + rope) ** -0.5)
    ours = attn.absorbed(q_nope, q_pe, w_uk, w_uv, cache, batch, OnTheCpu())
    return ours, attn.absorbed(q_nope, q_pe, w_uk, w_uv, cache, batch)


@interpreted_only
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,heads_per_program,rank,rope", [
    (16, 16, 64, 16), (16, 16, 96, 32), (16, 16, 512, 64),   # DeepSeek's 512 + 64 = 576: BLOCK_D 1024, masked
    (48, 16, 96, 32),                                        # the latent as 3 kv heads of 16 query heads
    (128, 16, 64, 16), (128, 128, 64, 16),                   # GROUP 128: every head in one program
    (64, 64, 128, 64),
])
def test_triton_absorbed_decode_equals_the_torch_absorbed_form(heads, heads_per_program, rank, rope, num_splits):
    """Contexts ending mid-block and on a block edge, long enough for several 16-key tiles and splits, and a
    padded row (kv_len 0)."""
    kv_lens = [1, 4, 37, 0, 64]
    problem = decode_problem(kv_lens, heads, rank, rope, torch.int32, seed=rank + heads)
    ours, ref = absorbed_both_ways(*problem, rank, rope, heads_per_program, num_splits)
    assert not ours[3].any(), "a padded row's output is 0"
    real = [i for i, n in enumerate(kv_lens) if n]
    torch.testing.assert_close(ours[real], ref[real], **scaled(TOL, ref[real]))


@interpreted_only
def test_triton_absorbed_decode_reads_int64_block_tables_and_static_scratch_like_a_graph_replay():
    """The decode graphs' tables and lengths are int64 views, and the scratch is the backend's static one: two
    launches of different lengths through the same scratch (the counters come back to zero in between)."""
    from kestrel.kernels.triton import latent_decode

    rank, rope, heads = 64, 16, 32
    scratch = latent_decode.alloc_latent_partials(8, heads, rank + rope, torch.device("cpu"))
    for seed, kv_lens in enumerate(([50, 3, 0], [9, 70, 17, 33])):
        batch, cache, q_nope, q_pe, w_uk, w_uv = decode_problem(kv_lens, heads, rank, rope, torch.int64, seed)
        batch.kv_lens = batch.kv_lens.to(torch.int64)
        q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
        scale = (NOPE + rope) ** -0.5
        ours = latent_decode.latent_decode_attention(q, cache, batch.block_table, batch.kv_lens, scale,
                                                     partials=scratch, num_splits=4)
        from kestrel.attention.torch_ref import TorchAttentionBackend
        ref = TorchAttentionBackend().forward(q, None, None, cache, cache, batch, scale)
        real = [i for i, n in enumerate(kv_lens) if n]
        torch.testing.assert_close(ours[real, :, :rank], ref[real, :, :rank], **scaled(TOL, ref[real, :, :rank]))
        assert not scratch[2].any(), "every launch leaves the split counters at zero"


@interpreted_only
@pytest.mark.parametrize("width", [80, 576])
def test_latent_write_kernel_equals_the_torch_write_and_skips_padding(width):
    """The CUDA road's latent write (no host sync) against the torch one, slot -1 rows skipped."""
    from kestrel.attention.mla import write_latent, write_latent_by_kernel

    gen = torch.Generator().manual_seed(width)
    cache = torch.randn(6, BLOCK, 1, width, generator=gen)
    expected = cache.clone()
    entry = torch.randn(5, width, generator=gen)
    slots = torch.tensor([7, -1, 0, 23, -1])
    write_latent(entry, expected, slots)
    write_latent_by_kernel(entry, cache, slots)
    assert torch.equal(cache, expected)


@interpreted_only
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_q_lora"])
def test_deepseek_decode_steps_through_the_kernel_keep_the_torch_logits(tmp_path, name):
    """The model's decode road wired to the kernel (the runner's backend hands MLA its latent_decode): a batch of
    two sequences prefilled, then decode steps whose logits equal the torch road's on the same cache."""
    from kestrel import LLM
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.batch import build_forward_batch
    from kestrel.kernels.triton import latent_decode
    from tests.test_moe_models import make_moe_checkpoint

    class KernelOnTheCpu(TorchAttentionBackend):
        def latent_decode(self, q, latent_cache, batch, scale, latent_scale=1.0):
            calls.append(q.shape)
            return latent_decode.latent_decode_attention(q, latent_cache, batch.block_table, batch.kv_lens, scale,
                                                         num_splits=2, latent_scale=latent_scale)

    calls: list[torch.Size] = []
    llm = LLM(model=str(make_moe_checkpoint(tmp_path, name)), device="cpu", block_size=BLOCK)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28]]
    tables = [engine.pool.allocate(4) for _ in prompts]
    runner.forward(build_forward_batch(prompts, [0, 0], tables, BLOCK))
    lens = [len(p) for p in prompts]
    torch_road = runner.backend
    for step, toks in enumerate(([5, 17], [200, 3], [99, 42], [7, 8], [1, 2])):
        batch = build_forward_batch([[t] for t in toks], lens, tables, BLOCK)
        runner.backend = KernelOnTheCpu()
        ours = runner.forward(batch).logits
        runner.backend = torch_road
        ref = runner.forward(batch).logits   # rewrites the same latents
        torch.testing.assert_close(ours, ref, **scaled(TOL, ref))
        lens = [n + 1 for n in lens]
    assert len(calls) == 5 * runner.cfg.num_layers, "every layer of every decode step took the kernel"
    for t in tables:
        engine.pool.release(t)
    llm.shutdown()


def test_head_groups_divide_the_heads_into_equal_programs():
    from kestrel.kernels.triton.latent_decode import head_groups

    assert [head_groups(h) for h in (16, 32, 128, 20, 8)] == [1, 2, 8, 2, 1]
    assert head_groups(128, heads_per_program=128) == 1


def test_the_cpu_road_stays_torch():
    """The triton backend offers its latent kernel only on CUDA: on CPU tensors LatentAttention runs torch."""
    from kestrel.attention.triton_backend import TritonAttentionBackend

    batch, cache, q_nope, *_ = decode_problem([5, 2], 16, 64, 16, torch.int32, seed=0)
    q = torch.randn(2, 16, 80)
    assert TritonAttentionBackend().latent_decode(q, cache, batch, 0.1) is None
