import torch
from kestrel.layers import cuda_gemv
from kestrel.layers.attention_prologue import qk_norm_rope_store
from kestrel.layers.rotary import RotaryEmbedding
from tests.gpu.test_gemv_gpu import cuda_inputs

for (k, heads, kv, dim) in [(256, 4, 2, 64), (4096, 32, 8, 128)]:
    n = (heads + 2 * kv) * dim
    for m in (1, 2, 3, 4):
        for with_res in (False, True):
            t = cuda_inputs(m, k, n, torch.bfloat16, seed=m, with_bias=False)
            rot = RotaryEmbedding(dim, 256, 10000.0, None).cuda()
            pos = torch.randint(0, 256, (m,), device="cuda")
            slots = torch.randperm(64, device="cuda")[:m]
            kc = torch.zeros(4, 16, kv, dim, device="cuda", dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            kc2, vc2 = kc.clone(), vc.clone()
            res = t["residual"] if with_res else None
            q, r = cuda_gemv.add_rms_norm_gemv_rope(t["x"], res, t["norm_weight"], 1e-6, t["w"], None, pos,
                                                   rot.cos_sin_cache, kc, vc, slots, heads, kv, dim)
            qkv, r2 = cuda_gemv.add_rms_norm_gemv(t["x"], res, t["norm_weight"], 1e-6, t["w"])
            q2 = qk_norm_rope_store(qkv, None, None, 1e-6, pos, rot.cos_sin_cache, kc2, vc2, slots, heads, kv, dim)
            torch.cuda.synchronize()
            bad = (q != q2).nonzero()
            print(k, m, with_res, "q mismatches", bad.shape[0], bad[:6].tolist(), "k eq", torch.equal(kc, kc2),
                  "v eq", torch.equal(vc, vc2), "res eq", torch.equal(r, r2))
