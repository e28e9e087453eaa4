# Which rotary is HF's: the fold, the Triton prologue, or both? Same unrotated qkv into all three.
import torch
from kestrel.layers import cuda_gemv
from kestrel.layers.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
from kestrel.layers.rotary import RotaryEmbedding
from tests.gpu.test_gemv_gpu import cuda_inputs

k, heads, kv, dim = 4096, 32, 8, 128
n = (heads + 2 * kv) * dim
for m in (1, 4):
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=m)
    rot = RotaryEmbedding(dim, 4096, 500000.0, None).cuda()
    pos = torch.randint(0, 4096, (m,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:m]
    caches = [torch.zeros(4, 16, kv, dim, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    fold, _ = cuda_gemv.add_rms_norm_gemv_rope(t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"], None, pos,
                                               rot.cos_sin_cache, caches[0], caches[1], slots, heads, kv, dim)
    qkv, _ = cuda_gemv.add_rms_norm_gemv(t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])
    tri = qk_norm_rope_store(qkv, None, None, 1e-6, pos, rot.cos_sin_cache, caches[2], caches[3], slots, heads, kv, dim)
    ref = qk_norm_rope_store_ref(qkv, None, None, 1e-6, pos, rot.cos_sin_cache, caches[4], caches[5], slots, heads, kv, dim)
    torch.cuda.synchronize()
    share = lambda a, b: f"{(a == b).float().mean().item():.4f}"
    print(f"m={m} q equal share: fold~ref {share(fold, ref)}  triton~ref {share(tri, ref)}  fold~triton {share(fold, tri)}"
          f"  k: fold~ref {torch.equal(caches[0], caches[4])} triton~ref {torch.equal(caches[2], caches[4])}")
