"""The fused MoE Triton kernel equals the torch reference (layers/moe.py) on fresh random inputs, run on the CPU by
Triton's interpreter in a child pytest (tests/triton_interpreter.py says why): random routing, experts that
receive no tokens, every token sent to the same experts, one token; plus the row alignment's invariants, and the
routing functions against HF's formulas written out."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.moe import fused_experts_torch, grouped_sigmoid_topk, softmax_topk
from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

TOL = dict(atol=1e-5, rtol=1e-5)   # float32; atol for values of order one, scaled() grows it with the reference

interpreted_only = interpreted_only_marker("test_fused_moe_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fused_moe_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=53)   # all but the ones that skip in the child


def random_problem(tokens: int, experts: int, topk: int, hidden: int, inter: int, dtype: torch.dtype,
                   gen: torch.Generator, pick: list[int] | None = None):
    """pick: the experts routing may choose from (others receive no tokens)."""
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype)
    allowed = torch.tensor(pick if pick is not None else list(range(experts)))
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:topk]] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)
    return x, w13, w2, ids, weights


CASES = [  # (tokens, experts, topk, hidden, inter, pick, dtype)
    (37, 8, 2, 64, 32, None, torch.float32),            # random routing, odd token count
    (1, 8, 2, 64, 32, None, torch.float32),             # one decode token
    (20, 8, 2, 48, 40, [1, 6], torch.float32),          # all tokens on experts 1 and 6; the rest get none
    (24, 6, 1, 64, 32, [3], torch.float32),             # every token picks expert 3
    (33, 16, 4, 64, 48, [0, 2, 5, 9, 15], torch.float32),   # most experts idle, shapes off the block sizes
    (17, 8, 2, 64, 32, None, torch.bfloat16),
]


@interpreted_only
@pytest.mark.parametrize("path", ["tiles", "rows", None])
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_kernel_equals_torch_reference(case, path):
    """Both paths on every case (None: the one the row count picks: rows for decode-sized batches)."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    tokens, experts, topk, hidden, inter, pick, dtype = case
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    x, w13, w2, ids, weights = random_problem(tokens, experts, topk, hidden, inter, dtype, gen, pick)
    ours = fused_experts_triton(x, w13, w2, ids, weights, path=path)
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours, ref, **scaled(tol, ref))


@interpreted_only
@pytest.mark.parametrize("tiles", ["m32-n16-k16-down-n32-k64", "m64-n32-k32-down-n16-k16"])
def test_tiles_path_equals_the_reference_with_other_tiles(tiles):
    """A tuned table's other row tiles (the alignment pads each expert's run to BLOCK_M) and down tiles unlike
    gate|up's give the reference's result."""
    from kestrel.kernels.triton.fused_moe import MoeTiles, fused_experts_triton

    m, n, k, dn, dk = (int(part[1:]) for part in tiles.split("-") if part != "down")
    cfg = MoeTiles(block_m=m, block_n=n, block_k=k, down_block_n=dn, down_block_k=dk)
    gen = torch.Generator().manual_seed(m)
    x, w13, w2, ids, weights = random_problem(33, 16, 4, 64, 48, torch.float32, gen, [0, 2, 5, 9, 15])
    ours = fused_experts_triton(x, w13, w2, ids, weights, path="tiles", tiles=cfg)
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    torch.testing.assert_close(ours, ref, **scaled(dict(atol=2e-5, rtol=2e-5), ref))


def test_tuned_tables_pick_the_nearest_bucket_and_parse():
    """The table lookup: the bucket nearest the batch (the smaller on a tie), the untuned default without a table;
    every shipped table (kernels/triton/moe_configs/*.json) parses into tiles that divide nothing wrongly."""
    from kestrel.kernels.triton.fused_moe import CONFIG_DIR, DEFAULT_TILES, MoeTiles, nearest, tuned_table

    a, b, c = MoeTiles(block_m=16), MoeTiles(block_m=32), MoeTiles(block_m=64)
    table = ((1, a), (64, b), (256, c))
    assert [nearest(table, t) for t in (1, 32, 33, 100, 160, 161, 4096)] == [a, a, b, b, b, c, c]
    assert nearest((), 128) == DEFAULT_TILES
    for path in CONFIG_DIR.glob("*.json"):
        for tokens, tiles in tuned_table(path.name):
            assert tokens >= 1 and all(v & (v - 1) == 0 for v in (tiles.block_m, tiles.block_n, tiles.block_k,
                                                                 tiles.down_block_n, tiles.down_block_k))


def rank_experts(w13: torch.Tensor, w2: torch.Tensor, rank: int, size: int):
    """Rank `rank` of `size`'s stacked experts, loaded through their weight_loaders from per-expert checkpoint
    tensors (gate, up: [I, H]; down: [H, I]), as the model loader puts them."""
    from kestrel.distributed.comm import TPGroup
    from kestrel.layers.linear import silu_and_mul_torch
    from kestrel.layers.moe import FusedExperts

    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    layer = FusedExperts(experts, hidden, inter, fused_experts_torch, silu_and_mul_torch, TPGroup(rank=rank, size=size))
    layer.to(w13.dtype)
    for e in range(experts):
        for part, rows in enumerate((w13[e, :inter], w13[e, inter:])):
            layer.w13.weight.weight_loader(layer.w13.weight, rows, f"experts.{e}.w13", (e, part))
        layer.w2.weight.weight_loader(layer.w2.weight, w2[e], f"experts.{e}.w2", (e, 0))
    return layer.w13.weight.data, layer.w2.weight.data


def ranks_summed(impl, x, w13, w2, ids, weights, size: int) -> torch.Tensor:
    """What the all-reduce of a MoE layer returns: every rank's partial sum over its slice of each expert."""
    return sum(impl(x, *rank_experts(w13, w2, r, size), ids, weights).float() for r in range(size))


@pytest.mark.parametrize("size", [2, 4])
def test_expert_width_split_over_ranks_sums_to_the_whole(size):
    """Tensor parallelism of the experts: rank r holds rows [r I/N, (r+1) I/N) of each expert's gate and of its
    up (aligned, so silu(gate) * up stays per rank) and the same columns of down; the partial sums add up."""
    gen = torch.Generator().manual_seed(size)
    x, w13, w2, ids, weights = random_problem(29, 8, 2, 64, 40, torch.float32, gen)
    w13_r, w2_r = rank_experts(w13, w2, 1, size)
    inter = 40 // size
    assert w13_r.shape == (8, 2 * inter, 64) and w2_r.shape == (8, 64, inter)
    torch.testing.assert_close(w13_r[:, :inter], w13[:, inter:2 * inter])          # gate rows of rank 1
    torch.testing.assert_close(w13_r[:, inter:], w13[:, 40 + inter:40 + 2 * inter])  # its up rows
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    torch.testing.assert_close(ranks_summed(fused_experts_torch, x, w13, w2, ids, weights, size), ref,
                               **scaled(TOL, ref))


@interpreted_only
@pytest.mark.parametrize("path", ["tiles", "rows"])
def test_fused_moe_kernel_on_a_ranks_slice_sums_to_the_whole(path):
    """The kernel on each rank's narrower stacked weights (I / N = 10: off the block sizes)."""
    from functools import partial

    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    gen = torch.Generator().manual_seed(7)
    x, w13, w2, ids, weights = random_problem(21, 8, 2, 64, 40, torch.float32, gen)
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    torch.testing.assert_close(ranks_summed(partial(fused_experts_triton, path=path), x, w13, w2, ids, weights, 4),
                               ref, **scaled(dict(atol=2e-5, rtol=2e-5), ref))


@pytest.mark.parametrize("tokens,experts,topk", [(37, 8, 2), (1, 4, 1), (64, 16, 6)])
def test_alignment_puts_each_row_once_in_tiles_of_one_expert(tokens, experts, topk):
    from kestrel.kernels.triton.fused_moe import BLOCK_M, align_by_expert

    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    sorted_rows, tile_expert = align_by_expert(ids, experts)
    num_rows = tokens * topk
    real = sorted_rows[sorted_rows < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = sorted_rows[tile * BLOCK_M:(tile + 1) * BLOCK_M]
        rows = rows[rows < num_rows]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())


def test_capture_safe_dense_experts_equal_the_sparse_loop():
    """The road taken while a CUDA graph is captured (no host reads) computes the same sums."""
    from kestrel.layers.moe import _experts_dense
    from kestrel.layers.linear import silu_and_mul_torch

    gen = torch.Generator().manual_seed(7)
    x, w13, w2, ids, weights = random_problem(19, 8, 2, 64, 32, torch.float32, gen, pick=[0, 3, 4])
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    torch.testing.assert_close(_experts_dense(x, w13, w2, ids, weights, silu_and_mul_torch), ref, **scaled(TOL, ref))


def test_softmax_topk_renormalised_equals_topk_then_softmax():
    """Mixtral's definition (top-k of the logits, softmax over those) is the renormalised softmax top-k."""
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    routing = softmax_topk(logits, 2, renormalize=True)
    top_logits, top_ids = logits.topk(2, dim=-1)
    assert torch.equal(routing.topk_ids, top_ids)
    torch.testing.assert_close(routing.topk_weights, torch.softmax(top_logits, dim=-1))


def test_grouped_sigmoid_topk_chooses_with_the_bias_and_weighs_without_it():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 8, generator=gen)
    bias = torch.zeros(8)
    bias[5] = 10.0          # expert 5 (group 1 of 2) always wins a slot, but its weight stays its own score
    routing = grouped_sigmoid_topk(logits, 2, bias, n_group=2, topk_group=1, renormalize=False, scaling=2.0)
    assert bool((routing.topk_ids == 5).any(dim=-1).all())
    assert bool((routing.topk_ids >= 4).all())          # only group 1's experts: the chosen group
    torch.testing.assert_close(routing.topk_weights, 2.0 * logits.sigmoid().gather(1, routing.topk_ids))


@interpreted_only
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_model_built_with_the_kernel_as_its_moe_op_gives_the_reference_logits(tmp_path, name):
    """The seam: LayerOps.fused_moe and .softmax_topk swapped for the kernels, nothing else changed, same
    logits."""
    from dataclasses import replace

    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.batch import build_forward_batch
    from kestrel.forward.runner import ModelRunner
    from kestrel.kernels.triton.fused_moe import fused_experts_triton
    from kestrel.layers.ops import TORCH_OPS
    from kestrel.models.loader import load_safetensors_weights
    from kestrel.models.model_config import hf_model_config
    from kestrel.models.registry import model_class
    from tests.test_moe_models import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path, name)
    cfg = hf_model_config(path)
    prompts = [[5, 9, 31, 2, 77, 100, 4], [8, 8, 3]]
    logits = []
    from kestrel.kernels.triton.moe_routing import softmax_topk_triton
    fused = replace(TORCH_OPS, fused_moe=fused_experts_triton, softmax_topk=softmax_topk_triton)
    for ops in (TORCH_OPS, fused):
        model = model_class(cfg)(cfg, ops)
        load_safetensors_weights(model, path)
        runner = ModelRunner(model.eval(), cfg, TorchAttentionBackend(), torch.device("cpu"), torch.float32, 4)
        runner.allocate_kv_cache(8)
        logits.append(runner.forward(build_forward_batch(prompts, [0, 0], [[0, 1], [2]], 4)).logits)
    torch.testing.assert_close(logits[1], logits[0], **scaled(dict(atol=1e-4, rtol=1e-4), logits[0]))


def test_the_kernel_is_chosen_on_cuda_unless_switched_off():
    from kestrel.envs import DevSwitches
    from kestrel.kernels.triton.fused_moe import fused_experts_triton
    from kestrel.layers.ops import choose_layer_ops

    class Backend:
        name = "any"

        def supports_prewritten_kv(self) -> bool:
            return True

    cuda = torch.device("cuda")
    assert choose_layer_ops(torch.device("cpu"), Backend(), DevSwitches(fused_moe=True)).fused_moe \
        is fused_experts_torch
    assert choose_layer_ops(cuda, Backend(), DevSwitches(fused_moe=False)).fused_moe is fused_experts_torch
    assert choose_layer_ops(cuda, Backend(), DevSwitches()).fused_moe is fused_experts_triton
    from kestrel.kernels.triton.moe_routing import softmax_topk_triton
    assert choose_layer_ops(cuda, Backend(), DevSwitches(fused_moe=False)).softmax_topk is softmax_topk
    assert choose_layer_ops(cuda, Backend(), DevSwitches()).softmax_topk is softmax_topk_triton


@interpreted_only
@pytest.mark.parametrize("tokens,experts,k,renormalize", [(1, 128, 8, True), (5, 128, 8, False), (7, 8, 2, True),
                                                           (3, 60, 4, True), (4, 6, 1, False)])
def test_softmax_topk_kernel_equals_the_reference(tokens, experts, k, renormalize):
    """One launch: the same experts in the same (descending) order, weights to float32 rounding; E not a power of
    two (60, 6) and k = 1 included."""
    from kestrel.kernels.triton.moe_routing import softmax_topk_triton

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts)) * 2
    ours, ref = softmax_topk_triton(logits, k, renormalize), softmax_topk(logits, k, renormalize)
    assert torch.equal(ours.topk_ids, ref.topk_ids)
    torch.testing.assert_close(ours.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6)


DECODE_CASES = [  # (tokens, experts, topk, hidden, inter, pick): the rows path's decode shapes, Qwen3-MoE-like
    (1, 16, 8, 128, 48, None),                          # bs1 top-8: 8 of 16 experts busy, I off the blocks
    (3, 16, 8, 96, 40, None),                           # H off the K step too
    (8, 16, 8, 128, 48, [0, 2, 3, 5, 7, 11, 13, 15]),   # bs8 (64 rows, ROWS_PATH_MAX): all tokens, same 8
    (5, 12, 1, 64, 32, [9]),                            # top-1, every token on expert 9 (others idle)
    (2, 8, 3, 64, 32, None),                            # k not a power of two: padded slots
]


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_rows_path_sums_the_slots_with_the_reference_roundings(case, dtype):
    """The rows path's down kernel writes each token's weighted sum over its k slots itself (no rows_out buffer,
    no torch sum): to float32 rounding of the reference in float32, and in bf16 the same roundings at the same
    points (F.linear's gate, up, silu(gate) * up and each expert's output, the one cast at the end), so only the
    float32 sums' order (slots, not experts) separates the two: a bf16 ulp at the most."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    tokens, experts, topk, hidden, inter, pick = case
    gen = torch.Generator().manual_seed(tokens * 7 + topk)
    x, w13, w2, ids, weights = random_problem(tokens, experts, topk, hidden, inter, dtype, gen, pick)
    ours = fused_experts_triton(x, w13, w2, ids, weights, path="rows")
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, **scaled(dict(atol=2e-5, rtol=2e-5), ref))
    else:
        torch.testing.assert_close(ours.float(), ref.float(), atol=2 ** -8 * ref.float().abs().max().item(),
                                   rtol=2 ** -7)


@interpreted_only
@pytest.mark.parametrize("tokens,experts,hidden,k,renormalize", [(1, 128, 256, 8, True), (3, 60, 96, 4, False),
                                                                  (16, 8, 64, 2, True), (17, 8, 64, 2, True)])
def test_router_gemv_kernel_then_softmax_topk_equals_router_then_reference(tokens, experts, hidden, k,
                                                                            renormalize):
    """The router GEMV folded into the Triton routing (two launches at decode): bf16 hidden states against the
    float32 router weight give Router's float32 logits (F.linear(x.float(), W)) to float32 rounding, and the same
    experts in the same order as the reference routing; E not a multiple of the block (60), H off the step (96);
    17 tokens: past ROUTER_GEMV_MAX_TOKENS, the cuBLAS road."""
    from kestrel.kernels.triton.moe_routing import router_logits_triton, router_softmax_topk_triton

    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weight = torch.randn(experts, hidden, generator=gen) * 0.2
    ref_logits = torch.nn.functional.linear(x.float(), weight)
    torch.testing.assert_close(router_logits_triton(x, weight), ref_logits, **scaled(TOL, ref_logits))
    ours, ref = router_softmax_topk_triton(x, weight, k, renormalize), softmax_topk(ref_logits, k, renormalize)
    assert torch.equal(ours.topk_ids, ref.topk_ids)
    torch.testing.assert_close(ours.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6)


def test_softmax_models_route_from_the_hidden_states_only_with_the_triton_routing():
    """Qwen3-MoE / Mixtral layers take route_hidden (router GEMV folded into the routing) from
    LayerOps.softmax_topk's `from_hidden`: the Triton routing offers it, the torch routing does not."""
    from dataclasses import replace

    from kestrel.kernels.triton.moe_routing import router_softmax_topk_triton, softmax_topk_triton
    from kestrel.layers.ops import TORCH_OPS
    from kestrel.models.llama_moe import _softmax_route_hidden

    assert softmax_topk_triton.from_hidden is router_softmax_topk_triton
    cfg = type("Cfg", (), {"num_experts_per_tok": 2, "norm_topk_prob": True})()
    assert _softmax_route_hidden(cfg, TORCH_OPS) is None
    assert _softmax_route_hidden(cfg, replace(TORCH_OPS, softmax_topk=softmax_topk_triton)) is not None
