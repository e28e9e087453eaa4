"""The cluster decode kernel (kestrel/kernels/cuda/cluster_decode.cu, KESTREL_CLUSTER_DECODE) against the torch reference on
fresh random inputs, on CUDA cores and on tensor cores (KESTREL_CLUSTER_DECODE_MMA): ragged contexts (a padded row,
slices shorter than the cluster, contexts past the keys read before the PDL wait), GQA ratios 1/2/4/8, head dims
64/128, block sizes 2/16; under CUDA-graph replay with new lengths and tables; and whole engines with the kernel on
and off (same greedy tokens)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import routed_tokens_on_and_off
from tests.test_triton_kernels import TOLERANCE, random_paged_cache, start_locs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [  # (num_kv_heads, group, head_dim, block_size)
    (8, 2, 128, 16),    # Qwen3-0.6B
    (8, 4, 128, 16),    # Llama-3.1-8B
    (4, 1, 64, 2),
    (2, 8, 128, 16),
]
KV_LENS = [1, 7, 0, 300, 511, 513, 1100, 2049]   # < cluster, a padded row, past the keys read before the wait


def _reference(q, k_cache, v_cache, table, lens):
    from kestrel.attention import torch_ref
    return torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1] * q.shape[0]).cuda(), lens, 1,
                                     int(lens.max()), q.shape[2] ** -0.5)


def _inputs(kv_lens, num_kv_heads, group, head_dim, block_size, seed, index=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = random_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, torch.bfloat16, gen)
    q = torch.randn(len(kv_lens), num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(kv_lens, dtype=index)
    return [t.cuda() for t in (q, k_cache, v_cache, table.to(index), lens)]


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_the_kernel_loads_without_local_memory_on_this_gpu(tensor_cores):
    """This machine's NVRTC may print no ptxas log, so the loaded function's attributes are asked instead."""
    from kestrel.kernels.cuda import cuda_rtc
    from kestrel.kernels.cuda import cluster_decode
    compiled = cluster_decode.compile_kernel(4, 128, 8, 16, cuda_rtc.device_arch(0), tensor_cores=tensor_cores)
    kernel = cuda_rtc.Kernel(compiled, "cluster_decode", torch.device("cuda", 0))
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, CU_FUNC_ATTRIBUTE_NUM_REGS = 3, 4
    assert kernel.attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) == 0
    assert 0 < kernel.attribute(CU_FUNC_ATTRIBUTE_NUM_REGS) <= 255


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("cluster,index", [(8, torch.int32), (16, torch.int32), (2, torch.int32), (8, torch.int64)])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", CASES)
def test_decode_matches_reference(num_kv_heads, group, head_dim, block_size, cluster, index, tensor_cores):
    from kestrel.kernels.cuda import cluster_decode
    q, k_cache, v_cache, table, lens = _inputs(KV_LENS, num_kv_heads, group, head_dim, block_size,
                                               seed=group * head_dim + cluster, index=index)
    out = cluster_decode.decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, cluster=cluster,
                                          tensor_cores=tensor_cores)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, table, lens).float(),
                               **TOLERANCE[torch.bfloat16])
    assert torch.count_nonzero(out[2]) == 0   # the padded row


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_decode_captured_in_a_cuda_graph_replays_new_lengths_and_tables(tensor_cores):
    from kestrel.kernels.cuda import cluster_decode
    q, k_cache, v_cache, table, lens = _inputs(KV_LENS[:4], 8, 2, 128, 16, seed=3, index=torch.int64)
    kw = dict(cluster=8, tensor_cores=tensor_cores)
    cluster_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.088, **kw)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cluster_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.088, **kw)
    gen = torch.Generator().manual_seed(4)
    num_blocks = k_cache.shape[0]
    for step in range(3):
        new_lens = torch.randint(0, 16 * table.shape[1] + 1, (4,), generator=gen, dtype=torch.int32)
        new_lens[step] = 0
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        lens.copy_(new_lens)
        table.copy_(torch.randint(0, num_blocks, table.shape, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        want = _reference(q, k_cache, v_cache, table, lens) if int(lens.max()) > 0 else torch.zeros_like(out)
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[torch.bfloat16])
        assert torch.count_nonzero(out[step]) == 0


def _identical_share(path: str, monkeypatch, switch: str, on: str, off: str) -> float:
    """The share of greedy tokens identical with env `switch` at `on` and at `off` (bf16, decode graphs); with
    it on, decode must go through the cluster kernel."""
    from kestrel.kernels.cuda import cluster_decode
    tokens_on, tokens_off = routed_tokens_on_and_off(path, monkeypatch, cluster_decode, "decode_attention", switch,
                                                     on, off, dtype="bfloat16", attention_backend="triton")
    return sum(a == b for x, y in zip(tokens_on, tokens_off) for a, b in zip(x, y)) / sum(len(x) for x in tokens_off)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_tokens_with_the_kernel_on_and_off(checkpoint_factory, monkeypatch, arch):
    """bf16 random checkpoints (head_dim 64: the kernel's smallest) with decode graphs: the share of identical
    greedy tokens (bf16 near-ties aside)."""
    same = _identical_share(str(checkpoint_factory(arch, head_dim=64)), monkeypatch, "KESTREL_CLUSTER_DECODE", "1", "0")
    print(f"cluster decode {arch}: {same:.1%} of greedy tokens identical")
    assert same > 0.5


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_tokens_with_the_tensor_core_build_on_and_off(checkpoint_factory, monkeypatch, arch):
    """KESTREL_CLUSTER_DECODE_MMA=1 against the CUDA-core build, whole engines (head_dim 64 and 128)."""
    for head_dim in (64, 128):
        same = _identical_share(str(checkpoint_factory(arch, head_dim=head_dim)), monkeypatch,
                                "KESTREL_CLUSTER_DECODE_MMA", "1", "0")
        print(f"tensor-core cluster decode {arch} head_dim {head_dim}: {same:.1%} of greedy tokens identical")
        assert same > 0.5
