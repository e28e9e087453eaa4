// A one-row matmul whose weight is already in shared memory when its input arrives: the matmul after decode
// attention (o_proj), compiled by NVRTC at first use (resident_gemv.py). Hopper, bf16.
//
// While decode attention runs, HBM idles: its K/V are a few MB and most of its time is latency. o_proj, launched
// with PDL as soon as attention has passed its own wait, copies most of its weight into shared memory with bulk
// copies (TMA, no registers) before its griddepcontrol.wait, and asks L2 for the rest. One block an SM, every
// block resident at once (one wave, 4 warps, <= 80 registers, so a block fits beside a cluster decode program).
//
//   block b owns output rows n0 = b * ROWS .. n0 + ROWS - 1; warp v of it rows n0 + v * RW .. + RW - 1.
//
//   shared memory   ws [ROWS][SMEM_K] bf16          row r: its first SMEM_K elements of K, copied before the wait
//                   xs [K] bf16                     x, staged after the wait
//
//   K of a row:     | chunk 0 | chunk 1 | ... | chunk SMEM_CHUNKS-1 || streamed chunks (STREAM_K elements) |
//                   |<--------------- ws[r] (before the wait) ------->||<- L2 prefetch before the wait;      |
//                                                                         bulk-copied after it into ws[r]'s
//                                                                         first STREAM_CHUNKS chunks, once the
//                                                                         block has used them (phase A) ->|
//   after the wait: phase A  chunks [0, STREAM_CHUNKS) of ws, then one thread bulk-copies the streamed part over
//                            them (mbarrier phase 1);
//                   phase B  chunks [STREAM_CHUNKS, SMEM_CHUNKS) of ws while that copy flies;
//                   phase C  the streamed part, from ws once phase 1 completes.
//   A chunk is 256 elements: lane t reads 8 of them (16 bytes) at t * 8; x's matching 8 come from xs.
//
// Compile-time parameters (-D): K, ROWS (rows a block), WARPS, SMEM_K (a multiple of 256), MIN_BLOCKS (launch
// bounds: caps the registers), PREFETCH_L2 (1: the streamed part is prefetched into L2 before the wait).
// PDL: before griddepcontrol.wait only the weight is read (bulk copies and an L2 prefetch); x after it, and all
// writes after it.

#include "kestrel_cuda.cuh"

#define THREADS (WARPS * 32)
#define RW (ROWS / WARPS)                     // rows a warp
#define SMEM_CHUNKS (SMEM_K / 256)
#define STREAM_K (K - SMEM_K)
#define STREAM_CHUNKS (STREAM_K / 256)

#if ROWS % WARPS || SMEM_K % 256 || K % 256 || STREAM_CHUNKS > SMEM_CHUNKS
#error "ROWS a multiple of WARPS; SMEM_K and K multiples of 256; the streamed part must fit in the staged part"
#endif

__device__ __forceinline__ u32 shared_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

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

__device__ __forceinline__ void prefetch_l2(const bf16_t* src, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ float dot8(const Vec& a, const Vec& b) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) s += lo(a.w[i]) * lo(b.w[i]) + hi(a.w[i]) * hi(b.w[i]);
  return s;
}

// acc[r] += ws[row r][chunks c0 .. c1) . x[x0 + (c - c0) * 256 ..]
__device__ __forceinline__ void accumulate(float (&acc)[RW], const bf16_t* ws_rows, const bf16_t* xs, int c0,
                                           int c1, int x0, int lane) {
#pragma unroll 1
  for (int c = c0; c < c1; ++c) {
    const Vec xv = *reinterpret_cast<const Vec*>(xs + x0 + (c - c0) * 256 + lane * 8);
#pragma unroll
    for (int r = 0; r < RW; ++r)
      acc[r] += dot8(*reinterpret_cast<const Vec*>(ws_rows + r * SMEM_K + c * 256 + lane * 8), xv);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) resident_gemv(
    const bf16_t* x,                                      // [1, K]
    const bf16_t* __restrict__ w, long long stride_w,     // [N, K]
    const bf16_t* bias,                                   // [N] or null
    bf16_t* out,                                          // [1, N]
    int N) {
  extern __shared__ __align__(128) unsigned char shared[];
  bf16_t* ws = reinterpret_cast<bf16_t*>(shared);        // [ROWS][SMEM_K]
  bf16_t* xs = ws + ROWS * SMEM_K;                       // [K]
  __shared__ __align__(8) unsigned long long bar_storage;
  const u32 bar = shared_u32(&bar_storage);
  const int n0 = blockIdx.x * ROWS;
  const int rows_here = min(ROWS, N - n0);               // the last block may own fewer rows

  if (threadIdx.x == 0) {
    barrier_init(bar);
    barrier_expect(bar, rows_here * SMEM_K * 2);
    for (int r = 0; r < rows_here; ++r) {
      bulk_copy(shared_u32(ws + r * SMEM_K), w + (n0 + r) * stride_w, SMEM_K * 2, bar);
#if PREFETCH_L2 && STREAM_K
      prefetch_l2(w + (n0 + r) * stride_w + SMEM_K, STREAM_K * 2);
#endif
    }
  }
  pdl_wait_then_signal();

  for (int k = threadIdx.x * 8; k < K; k += THREADS * 8)
    *reinterpret_cast<Vec*>(xs + k) = *reinterpret_cast<const Vec*>(x + k);
  __syncthreads();             // xs staged; the barrier's init is visible to every thread
  barrier_wait(bar, 0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bf16_t* my_rows = ws + warp * RW * SMEM_K;
  float acc[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) acc[r] = 0.f;

#if STREAM_K
  accumulate(acc, my_rows, xs, 0, STREAM_CHUNKS, 0, lane);                         // phase A
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // these reads before the copy's writes
  __syncthreads();
  if (threadIdx.x == 0) {
    barrier_expect(bar, rows_here * STREAM_K * 2);
    for (int r = 0; r < rows_here; ++r)
      bulk_copy(shared_u32(ws + r * SMEM_K), w + (n0 + r) * stride_w + SMEM_K, STREAM_K * 2, bar);
  }
  accumulate(acc, my_rows, xs, STREAM_CHUNKS, SMEM_CHUNKS, STREAM_CHUNKS * 256, lane);   // phase B
  barrier_wait(bar, 1);
  accumulate(acc, my_rows, xs, 0, STREAM_CHUNKS, SMEM_K, lane);                   // phase C
#else
  accumulate(acc, my_rows, xs, 0, SMEM_CHUNKS, 0, lane);
#endif

#pragma unroll
  for (int r = 0; r < RW; ++r) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int n = n0 + warp * RW + r;
    if (lane == 0 && n < N) out[n] = to_bf16(v + (bias != nullptr ? lo((u32)bias[n]) : 0.f));
  }
}
