// Skinny matmuls for decode batches (1..M_TILE rows of x) that stream the weight at HBM bandwidth, compiled by
// NVRTC at first use (cuda_gemv.py). Hopper, bf16. cuBLAS runs the Llama-3.1-8B's qkv and o_proj at one row at
// ~72% of copy bandwidth with a split-K reduce kernel after each; the Triton skinny
// kernel (gemv.py) lost to cuBLAS at those sizes. Here every weight row is read by one warp, 16-byte loads, the
// first step's loads issued before the PDL wait, and the RMSNorm / SiLU-mul around the matmul folded in:
//
//   warp (block b, warp v) owns output rows n0 .. n0 + ROWS - 1, n0 = (b * WARPS + v) * ROWS; SILU: also the
//   matching up rows N + n0 .. (gate_up = [gate | up], N = intermediate size), and it writes silu(gate) * up.
//
//             K (contiguous) ->        step 0              step 1
//   row n0    | lane 0 | lane 1 | .. | lane 31 | (x U)  |  ...         lane t reads 8 elements at
//   row n0+1  |  16 B  |  16 B  |    |  16 B   |        |              s * CHUNK + u * 256 + t * 8, u < U:
//                                                                      a warp load is 512 contiguous bytes
//   acc[row][m] (fp32, per lane) += w . a[m]; then xor shuffles sum the 32 lanes; lane 0 stores.
//
// Compile-time parameters (-D): K (in features), ROWS (output rows a warp), WARPS, U (16-byte loads a lane per
// weight row per step; CHUNK = 256 * U divides K), M_TILE (rows of x the build serves, 1, 2 or 4; the launch
// passes M <= M_TILE), NORM (1: a = norm_w * rms_norm(x + residual) staged in shared memory, rounded to bf16 at
// each step as torch does, block 0 writes the residual stream; 0: a = x read from global), SILU (see above),
// ROPE (the fused QKV projection of a decode step with the attention prologue folded in, models without q/k norm:
// see below; HEAD_DIM, NUM_HEADS, NUM_KV_HEADS).
//
// ROPE: rotary pairs element i of a head with element i + HEAD_DIM / 2, so a block owns PAIRS = WARPS * ROWS / 2
// pairs of rows instead of consecutive rows: pair p = head * HALF + i is rows head * HEAD_DIM + i and + HALF, and
// the block's j-th row (warp j / ROWS, its row j % ROWS) is the (j % 2)-th row of its pair j / 2. The warps leave
// their row sums in shared memory; one thread a (pair, token) then rotates the pair at the token's position (q and
// k heads; HF's roundings, as attention_prologue.py) and writes q into rope.q_out and k, v into the paged caches
// at the token's slot (-1: nothing written), so no prologue kernel runs between this matmul and decode attention.
// Positions, slots and cos/sin are read right after the wait (the step's bookkeeping kernels write positions and
// slots), so their round trips hide under the matmul.
//
// PDL: before griddepcontrol.wait only weights are read (no kernel of the step writes them: the read-only path,
// L1-bypassing for the matmul weight, L1-cached for the norm weight); x, the residual and the bias after it, and
// nothing is written before it.
//
// TMA_X=1 (one row of x, 16-byte aligned rows; cuda_gemv.use_bulk_copy): thread 0 bulk-copies x (and the
// residual) into shared memory right after the wait (cp.async.bulk, an mbarrier counts the bytes), and the norm
// stages in place there / the dot products read x from there. Read through the L1 path instead, each matmul's first
// activation read after the wait took 2.7-4.6 us, against ~0.7 for an L2 round trip: the loads queue behind the
// weight loads issued before the wait. The bulk copy takes the TMA's path instead: the Llama-3.1-8B bs1 step -3.7%.

#include "kestrel_cuda.cuh"

#ifndef TMA_X
#define TMA_X 0
#endif
#if TMA_X && M_TILE != 1
#error "TMA_X stages one row of x"
#endif

#define THREADS (WARPS * 32)
#define HALVES (SILU ? 2 : 1)
#define WROWS (ROWS * HALVES)        // weight rows a warp reads
#define CHUNK (256 * U)              // K elements a warp covers per weight row per step
#define STEPS (K / CHUNK)
#ifndef ROPE
#define ROPE 0
#endif
#if ROPE
#define HALF (HEAD_DIM / 2)
#define PAIRS (WARPS * ROWS / 2)
#if (WARPS * ROWS) % 2 || SILU || PAIRS * M_TILE > WARPS * 32
#error "ROPE needs whole pairs of rows a block, a thread a (pair, token), and no SiLU"
#endif
#endif

struct RopeArgs {                        // ROPE only (all zero otherwise); one entry per row m of x (a token)
  const long long* positions;            // [M]
  const long long* slots;                // [M] flat cache slot, -1: do not write
  const float* cos_sin;                  // [max_position, HEAD_DIM] = [cos | sin], fp32
  long long stride_cos_sin;
  bf16_t* q_out;                         // [M, NUM_HEADS * HEAD_DIM], rotated q
  long long stride_q;
  bf16_t* k_cache;                       // [blocks, block_size, NUM_KV_HEADS, HEAD_DIM]
  bf16_t* v_cache;
  long long stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh;
  long long block_size;
};

__device__ __forceinline__ Vec stream_load(const bf16_t* p) {   // read once per step: keep it out of L1
  Vec v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3]) : "l"(p));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

#if TMA_X
__device__ __forceinline__ u32 shared_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void barrier_init(u32 bar) {   // one arrival a phase (thread 0's expect_tx)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void barrier_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 phase) {
  u32 done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(phase) : "memory");
}

// bytes (a multiple of 16) from global src to shared dst, counted against bar's transaction bytes.
__device__ __forceinline__ void bulk_copy(u32 dst, const bf16_t* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
#endif

__device__ __forceinline__ void load_step(Vec (&buf)[WROWS][U], const bf16_t* const (&rows)[WROWS], int step) {
#pragma unroll
  for (int r = 0; r < WROWS; ++r)
#pragma unroll
    for (int u = 0; u < U; ++u) buf[r][u] = stream_load(rows[r] + step * CHUNK + u * 256);
}

#if NORM
#define NORM_VECS ((K + THREADS * 8 - 1) / (THREADS * 8))   // 16-byte pieces of a row a thread stages

// The norm weight is a weight: read before the PDL wait (read-only path, L1-cached: every block of an SM reads it).
__device__ __forceinline__ void load_norm_weight(Vec (&g)[NORM_VECS], const bf16_t* norm_w) {
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = threadIdx.x * 8 + i * THREADS * 8;
    if (k < K)
      asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(g[i].w[0]), "=r"(g[i].w[1]), "=r"(g[i].w[2]), "=r"(g[i].w[3]) : "l"(norm_w + k));
  }
}

// a = norm_w * rms_norm(h), h = x (+ residual), both rounded to bf16 like add_rms_norm_gemv_ref; block 0 writes h.
__device__ __forceinline__ void stage_normed(bf16_t (*act)[K], const bf16_t* x, long long stride_x,
                                             const bf16_t* res, long long stride_res, bf16_t* res_out,
                                             long long stride_res_out, const Vec (&norm_w)[NORM_VECS], float eps,
                                             int M) {
  __shared__ float partial[WARPS][M_TILE];
  float ss[M_TILE];
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) {
    ss[m] = 0.f;
    if (m >= M) continue;
#pragma unroll
    for (int i = 0; i < NORM_VECS; ++i) {
      const int k = threadIdx.x * 8 + i * THREADS * 8;
      if (k >= K) break;
      Vec h = *(const Vec*)(x + m * stride_x + k);
      if (res != nullptr) {
        Vec r = *(const Vec*)(res + m * stride_res + k);
#pragma unroll
        for (int i = 0; i < 4; ++i) h.w[i] = pack(lo(h.w[i]) + lo(r.w[i]), hi(h.w[i]) + hi(r.w[i]));
        if (blockIdx.x == 0) *(Vec*)(res_out + m * stride_res_out + k) = h;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) ss[m] += lo(h.w[i]) * lo(h.w[i]) + hi(h.w[i]) * hi(h.w[i]);
      *(Vec*)(&act[m][k]) = h;
    }
    ss[m] = warp_sum(ss[m]);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) partial[warp][m] = ss[m];
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) {
    if (m >= M) continue;
    float total = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) total += partial[v][m];
    const float rstd = rsqrtf(total / K + eps);
#pragma unroll
    for (int i = 0; i < NORM_VECS; ++i) {   // the same elements this thread staged above
      const int k = threadIdx.x * 8 + i * THREADS * 8;
      if (k >= K) break;
      Vec h = *(const Vec*)(&act[m][k]);
      const Vec g = norm_w[i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        h.w[i] = pack(lo(g.w[i]) * round_bf16(lo(h.w[i]) * rstd), hi(g.w[i]) * round_bf16(hi(h.w[i]) * rstd));
      *(Vec*)(&act[m][k]) = h;
    }
  }
  __syncthreads();
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 2) skinny_gemv(
    const bf16_t* x, long long stride_x,                   // [M, K]
    const bf16_t* res, long long stride_res,               // NORM: [M, K] or null (h = x)
    bf16_t* res_out, long long stride_res_out,             // NORM with res: h = x + res
    const bf16_t* norm_w, float eps,                       // NORM: [K]
    const bf16_t* __restrict__ w, long long stride_w,      // [N * HALVES, K]
    const bf16_t* bias,                                    // [N * HALVES] or null
    bf16_t* out, long long stride_out,                     // [M, N]; ROPE: unused (rope.q_out and the caches)
    int M, int N, RopeArgs rope) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * WARPS + warp) * ROWS;
  int row_of[ROWS];                   // the output row of each of the warp's rows (>= N: past the end)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#if ROPE
    const int j = warp * ROWS + r, pair = blockIdx.x * PAIRS + j / 2;
    row_of[r] = (pair / HALF) * HEAD_DIM + pair % HALF + (j % 2) * HALF;
#else
    row_of[r] = n0 + r;
#endif
  }
  const bf16_t* rows[WROWS];
#pragma unroll
  for (int r = 0; r < WROWS; ++r) {   // rows past N (the last block) read row N - 1 and store nothing
    const int n = min(row_of[r % ROWS], N - 1) + (r / ROWS) * N;
    rows[r] = w + n * stride_w + lane * 8;
  }
  Vec buf[WROWS][U];
  load_step(buf, rows, 0);
#if NORM
  Vec norm_weight[NORM_VECS];
  load_norm_weight(norm_weight, norm_w);
#endif
#if TMA_X
  __shared__ __align__(128) bf16_t xs[K];                   // x; NORM: the activation is staged in place
#if NORM
  __shared__ __align__(128) bf16_t rs[K];                   // the residual
#endif
  __shared__ __align__(8) unsigned long long x_bar;
  if (threadIdx.x == 0) barrier_init(shared_u32(&x_bar));
  __syncthreads();
#endif
  pdl_wait_then_signal();
#if TMA_X
  const bool copy_res = NORM && res != nullptr;
  if (threadIdx.x == 0) {
    barrier_expect(shared_u32(&x_bar), K * 2 * (copy_res ? 2 : 1));
    bulk_copy(shared_u32(xs), x, K * 2, shared_u32(&x_bar));
#if NORM
    if (copy_res) bulk_copy(shared_u32(rs), res, K * 2, shared_u32(&x_bar));
#endif
  }
#endif

#if ROPE   // the rotation's inputs, first thing after the wait: two dependent round trips under the matmul
  const int rope_pair = threadIdx.x % PAIRS, rope_m = threadIdx.x / PAIRS;   // this thread's (pair, token)
  const int rope_pair_global = blockIdx.x * PAIRS + rope_pair;
  const bool rotates = rope_m < M && rope_pair_global * 2 < N;
  float rope_cos = 0.f, rope_sin = 0.f;
  long long rope_slot = -1;
  if (rotates) {
    const float* cs = rope.cos_sin + rope.positions[rope_m] * rope.stride_cos_sin;
    const int i = rope_pair_global % HALF;
    rope_cos = round_bf16(cs[i]);
    rope_sin = round_bf16(cs[HALF + i]);
    rope_slot = rope.slots[rope_m];
  }
#endif
#if TMA_X
  barrier_wait(shared_u32(&x_bar), 0);
#endif
#if NORM && TMA_X
  bf16_t (*act)[K] = reinterpret_cast<bf16_t (*)[K]>(xs);   // each thread overwrites only what it read
  stage_normed(act, xs, K, copy_res ? rs : nullptr, K, res_out, stride_res_out, norm_weight, eps, M);
#elif NORM
  __shared__ __align__(16) bf16_t act[M_TILE][K];
  stage_normed(act, x, stride_x, res, stride_res, res_out, stride_res_out, norm_weight, eps, M);
#endif

  float acc[WROWS][M_TILE];
#pragma unroll
  for (int r = 0; r < WROWS; ++r)
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) acc[r][m] = 0.f;

#pragma unroll 1
  for (int s = 0; s < STEPS; ++s) {
    if (s > 0) load_step(buf, rows, s);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = s * CHUNK + u * 256 + lane * 8;
#pragma unroll
      for (int m = 0; m < M_TILE; ++m) {
        const int row = m < M ? m : M - 1;   // rows past M compute row M - 1 again; never stored
#if NORM
        const Vec a = *(const Vec*)(&act[row][k]);
#elif TMA_X
        const Vec a = *(const Vec*)(&xs[k]);
#else
        const Vec a = *(const Vec*)(x + row * stride_x + k);
#endif
#pragma unroll
        for (int r = 0; r < WROWS; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc[r][m] += lo(buf[r][u].w[i]) * lo(a.w[i]) + hi(buf[r][u].w[i]) * hi(a.w[i]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < WROWS; ++r)
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) acc[r][m] = warp_sum(acc[r][m]);
#if ROPE
  __shared__ float pair_sums[WARPS * ROWS][M_TILE];   // the block's row sums (+ bias), rounded to bf16
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int n = min(row_of[r], N - 1);
#pragma unroll
      for (int m = 0; m < M_TILE; ++m)
        pair_sums[warp * ROWS + r][m] = round_bf16(acc[r][m] + (bias != nullptr ? lo((u32)bias[n]) : 0.f));
    }
  }
  __syncthreads();
  if (!rotates) return;
  const int head = rope_pair_global / HALF, i = rope_pair_global % HALF;
  float x1 = pair_sums[2 * rope_pair][rope_m], x2 = pair_sums[2 * rope_pair + 1][rope_m];
  if (head < NUM_HEADS + NUM_KV_HEADS) {   // q or k: rotate (cos/sin rounded to bf16, as HF)
    const float r1 = round_bf16(x1 * rope_cos) - round_bf16(x2 * rope_sin);
    const float r2 = round_bf16(x2 * rope_cos) + round_bf16(x1 * rope_sin);
    x1 = r1;
    x2 = r2;
  }
  if (head < NUM_HEADS) {
    bf16_t* q = rope.q_out + rope_m * rope.stride_q + head * HEAD_DIM + i;
    q[0] = to_bf16(x1);
    q[HALF] = to_bf16(x2);
    return;
  }
  if (rope_slot < 0) return;
  const long long block = rope_slot / rope.block_size, offset = rope_slot % rope.block_size;
  const bool is_k = head < NUM_HEADS + NUM_KV_HEADS;
  const int kv_head = head - NUM_HEADS - (is_k ? 0 : NUM_KV_HEADS);
  bf16_t* dst = is_k ? rope.k_cache + block * rope.stride_kb + offset * rope.stride_ko + kv_head * rope.stride_kh
                     : rope.v_cache + block * rope.stride_vb + offset * rope.stride_vo + kv_head * rope.stride_vh;
  dst[i] = to_bf16(x1);
  dst[i + HALF] = to_bf16(x2);
#else
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int n = n0 + r;
    if (n >= N) break;
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) {
      if (m >= M) break;
      float y = acc[r][m] + (bias != nullptr ? lo((u32)bias[n]) : 0.f);
#if SILU
      const float gate = round_bf16(y);
      const float up = round_bf16(acc[ROWS + r][m] + (bias != nullptr ? lo((u32)bias[N + n]) : 0.f));
      y = round_bf16(gate / (1.f + expf(-gate))) * up;
#endif
      out[m * stride_out + n] = to_bf16(y);
    }
  }
#endif
}
