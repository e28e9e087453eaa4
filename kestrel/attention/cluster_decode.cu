// Decode attention whose context splits meet in a thread-block cluster (Hopper), compiled by NVRTC at first use
// (cluster_decode.py). The Triton decode kernel merges its splits through global memory: partial stores, a
// release fence, a counter atomic and a round of L2 loads by the last split (2.25 us a layer on the Qwen3-0.6B
// bs1 step, BENCHMARKS.md session 10). Here the CLUSTER programs of one (sequence, kv head) each hold their
// partial in shared memory, and after one cluster barrier each reads its share of the output's elements from
// every peer's shared memory (distributed shared memory): no global scratch, no atomics, no fence to L2.
//
// Compile-time parameters (-D): GROUP (query heads per kv head), HEAD_DIM, CLUSTER (programs per kv head),
// NUM_WARPS, PREFETCH (keys per slot read before the PDL wait), BLOCK_SIZE (cache page), DIMS_PER_LANE (8 or 16),
// INDEX64 (block table and kv_lens are int64, as in the CUDA-graph step's buffers; else int32); MERGE=0 is a
// probe for benchmarks/profile_decode.py (KESTREL_PROFILE_ABLATE=cluster_merge): each program writes its own
// partial's share of the output, no cluster barrier, no peer reads (wrong output; what the merge costs).
//
// Grid (num_kv_heads * CLUSTER, num_seqs), clusters of (CLUSTER, 1, 1); program `rank` of a cluster owns keys
// [rank * per, min((rank + 1) * per, kv_len)), per = cdiv(kv_len, CLUSTER). Inside a program:
//
//   warp w, lane t:  slot = w * SLOTS_PER_WARP + t / LANES_PER_KEY   (a slot = the lanes that share one key)
//                    dims [(t % LANES_PER_KEY) * DIMS_PER_LANE, +DIMS_PER_LANE) of the head
//   slot j attends to keys start + j, start + j + SLOTS, start + j + 2 * SLOTS, ...  with its own online softmax
//   (m, l per query head; acc = its lanes' dims), PREFETCH keys at a time; a key's score is the sum over its
//   slot's lanes (xor shuffles inside the slot).
//
// Merges, all in base-2 log units (q carries scale * log2(e)):
//   slots -> program:   slot_m / slot_l / slot_acc in shared memory, then cta_m / cta_l / cta_acc (unnormalised)
//   programs -> output: cluster barrier; program `rank` writes elements [rank * E, (rank + 1) * E) of the
//                       [GROUP, HEAD_DIM] output, E = GROUP * HEAD_DIM / CLUSTER, reading cta_* of every peer
//                       (mapa + ld.shared::cluster); a second barrier keeps every program's shared memory alive
//                       until all peers have read it.
// kv_len == 0 (a padded graph row): every program is empty and the output is 0, as in the Triton kernel.
//
// PDL: before griddepcontrol.wait only what no kernel of this step writes is read (kv_lens, the block table, the
// K/V of every key but the newest, which the attention prologue writes just before this kernel). q and the caches
// are not __restrict__: the kernel before this one writes q and the newest K/V while this one runs, so their
// loads must not take the read-only (ld.global.nc) path; the block table and kv_lens are copied in before the step.

#ifndef MERGE
#define MERGE 1
#endif
#ifndef STAMPS
#define STAMPS 0
#endif
// STAMPS=1 (benchmarks/decode_timeline.py only): thread 0 of each program records clock64() at NUM_STAMPS points
// (entry, after the wait, after the first attend step, after the later chunks, after the slot merge, after the
// first cluster barrier, after the output stores, at the end) and %globaltimer at entry and end, into the extra
// last argument stamps[program][NUM_STAMPS + 2].
#define NUM_STAMPS 8
#if STAMPS
#define STAMP(i) do { if (threadIdx.x == 0) clocks[i] = clock64(); } while (0)
#else
#define STAMP(i) do { } while (0)
#endif

#include "kestrel_cuda.cuh"

#if INDEX64
typedef long long index_t;
#else
typedef int index_t;
#endif

#define LANES_PER_KEY (HEAD_DIM / DIMS_PER_LANE)
#define SLOTS_PER_WARP (32 / LANES_PER_KEY)
#define SLOTS (NUM_WARPS * SLOTS_PER_WARP)
#define THREADS (NUM_WARPS * 32)
#define ROWS (DIMS_PER_LANE / 8)              // 16-byte loads per lane per key row
#define OUT_PER_PROGRAM (GROUP * HEAD_DIM / CLUSTER)
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive_relaxed() {   // no memory ordering: only "I am done reading"
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ float peer_load(u32 local_address, u32 peer) {   // a float in peer's shared memory
  u32 remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_address), "r"(peer));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// K and V of the key at pos (this lane's dims) into k, v; zeros where !valid.
__device__ __forceinline__ void load_key(const index_t* table, const bf16_t* k_head, const bf16_t* v_head,
                                         long long stride_kb, long long stride_ko, long long stride_vb,
                                         long long stride_vo, int pos, bool valid, Vec* k, Vec* v) {
  if (valid) {
    const long long block = table[pos / BLOCK_SIZE];
    const int offset = pos % BLOCK_SIZE;
    const Vec* kp = reinterpret_cast<const Vec*>(k_head + block * stride_kb + offset * stride_ko);
    const Vec* vp = reinterpret_cast<const Vec*>(v_head + block * stride_vb + offset * stride_vo);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) { k[r] = kp[r]; v[r] = vp[r]; }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) { k[r].w[i] = 0u; v[r].w[i] = 0u; }
  }
}

// One online-softmax step of a slot over PREFETCH keys (key i at pos0 + i * SLOTS, counted if < end).
__device__ __forceinline__ void attend(const float (&q)[GROUP][DIMS_PER_LANE], const Vec (&k)[PREFETCH][ROWS],
                                       const Vec (&v)[PREFETCH][ROWS], int pos0, int end,
                                       float (&m)[GROUP], float (&l)[GROUP], float (&acc)[GROUP][DIMS_PER_LANE]) {
  float s[PREFETCH][GROUP];
#pragma unroll
  for (int i = 0; i < PREFETCH; ++i) {
    float kf[DIMS_PER_LANE];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) unpack(k[i][r], kf + 8 * r);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < DIMS_PER_LANE; ++e) dot = fmaf(q[g][e], kf[e], dot);
      s[i][g] = dot;
    }
  }
#pragma unroll
  for (int off = LANES_PER_KEY / 2; off > 0; off /= 2)
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i)
#pragma unroll
      for (int g = 0; g < GROUP; ++g) s[i][g] += __shfl_xor_sync(0xffffffffu, s[i][g], off);

#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float m_new = m[g];
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i)
      if (pos0 + i * SLOTS < end) m_new = fmaxf(m_new, s[i][g]);
    if (m_new == NEG_INF) continue;            // no key yet in this slot
    const float alpha = exp2f(m[g] - m_new);   // 0 while m is -inf
    l[g] *= alpha;
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] *= alpha;
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i) {
      const float p = (pos0 + i * SLOTS < end) ? exp2f(s[i][g] - m_new) : 0.f;
      l[g] += p;
      float vf[DIMS_PER_LANE];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) unpack(v[i][r], vf + 8 * r);
#pragma unroll
      for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
    }
    m[g] = m_new;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS)
cluster_decode(const bf16_t* q_ptr, const bf16_t* k_cache, const bf16_t* v_cache,
               const index_t* __restrict__ block_table, const index_t* __restrict__ kv_lens, bf16_t* out_ptr,
               float scale_log2,
               long long stride_qs, long long stride_qh,
               long long stride_kb, long long stride_ko, long long stride_kh,
               long long stride_vb, long long stride_vo, long long stride_vh,
               long long stride_bt, long long stride_os, long long stride_oh
#if STAMPS
               , long long* stamps
#endif
               ) {
#if STAMPS
  long long clocks[NUM_STAMPS];
  unsigned long long wall_start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(wall_start));
#endif
  STAMP(0);
  __shared__ float slot_acc[SLOTS][GROUP][HEAD_DIM];
  __shared__ float slot_m[SLOTS][GROUP];
  __shared__ float slot_l[SLOTS][GROUP];
  __shared__ float cta_acc[GROUP][HEAD_DIM];
  __shared__ float cta_m[GROUP];
  __shared__ float cta_l[GROUP];

  const int rank = (int)cluster_rank();
  const int kv_head = blockIdx.x / CLUSTER;
  const int seq = blockIdx.y;
  const int lane = threadIdx.x % 32;
  const int slot = (threadIdx.x / 32) * SLOTS_PER_WARP + lane / LANES_PER_KEY;
  const int dim0 = (lane % LANES_PER_KEY) * DIMS_PER_LANE;

  // Before the wait: this program's slice and the K/V of its first PREFETCH keys a slot, the newest key excepted.
  const int kv_len = (int)kv_lens[seq];
  const int per = (kv_len + CLUSTER - 1) / CLUSTER;
  const int start = rank * per;
  const int end = min(start + per, kv_len);
  const int newest = kv_len - 1;
  const index_t* table = block_table + seq * stride_bt;
  const bf16_t* k_head = k_cache + kv_head * stride_kh + dim0;
  const bf16_t* v_head = v_cache + kv_head * stride_vh + dim0;
  Vec k[PREFETCH][ROWS], v[PREFETCH][ROWS];
#pragma unroll
  for (int i = 0; i < PREFETCH; ++i) {
    const int pos = start + slot + i * SLOTS;
    load_key(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo, pos, pos < end && pos < newest,
             k[i], v[i]);
  }

  pdl_wait_then_signal();
  STAMP(1);

  float q[GROUP][DIMS_PER_LANE];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const Vec* qp = reinterpret_cast<const Vec*>(q_ptr + seq * stride_qs + (kv_head * GROUP + g) * stride_qh + dim0);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      Vec row = qp[r];
      unpack(row, q[g] + 8 * r);
    }
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) q[g][e] *= scale_log2;
  }
#pragma unroll
  for (int i = 0; i < PREFETCH; ++i) {   // the newest key, written by the kernel before this one
    const int pos = start + slot + i * SLOTS;
    if (pos == newest && pos < end)
      load_key(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo, pos, true, k[i], v[i]);
  }

  float m[GROUP], l[GROUP], acc[GROUP][DIMS_PER_LANE];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] = 0.f;
  }
  attend(q, k, v, start + slot, end, m, l, acc);
  STAMP(2);
  // Longer slices: PREFETCH keys a slot at a time, read after the wait (the loop bound is the same for the whole
  // program, so every lane of a slot reaches the shuffles).
  for (int base = start + PREFETCH * SLOTS; base < end; base += PREFETCH * SLOTS) {
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i) {
      const int pos = base + slot + i * SLOTS;
      load_key(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo, pos, pos < end, k[i], v[i]);
    }
    attend(q, k, v, base + slot, end, m, l, acc);
  }
  STAMP(3);

  // Slots -> program.
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) slot_acc[slot][g][dim0 + e] = acc[g][e];
    if (dim0 == 0) { slot_m[slot][g] = m[g]; slot_l[slot][g] = l[g]; }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += THREADS) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) mx = fmaxf(mx, slot_m[j][g]);
    float a = 0.f, total = 0.f;
    if (mx != NEG_INF) {
#pragma unroll
      for (int j = 0; j < SLOTS; ++j) {
        const float w = exp2f(slot_m[j][g] - mx);
        a = fmaf(w, slot_acc[j][g][d], a);
        total = fmaf(w, slot_l[j][g], total);
      }
    }
    cta_acc[g][d] = a;
    if (d == 0) { cta_m[g] = mx; cta_l[g] = total; }
  }

#if !MERGE
  __syncthreads();
  for (int idx = threadIdx.x; idx < OUT_PER_PROGRAM; idx += THREADS) {
    const int e = rank * OUT_PER_PROGRAM + idx;
    const int g = e / HEAD_DIM, d = e % HEAD_DIM;
    out_ptr[seq * stride_os + (kv_head * GROUP + g) * stride_oh + d] =
        to_bf16(cta_m[g] == NEG_INF ? 0.f : cta_acc[g][d] / cta_l[g]);
  }
  return;
#endif
  // Programs -> output, through the peers' shared memory.
  STAMP(4);
  cluster_arrive();
  cluster_wait();
  STAMP(5);
  for (int idx = threadIdx.x; idx < OUT_PER_PROGRAM; idx += THREADS) {
    const int e = rank * OUT_PER_PROGRAM + idx;
    const int g = e / HEAD_DIM, d = e % HEAD_DIM;
    const u32 m_addr = shared_address(&cta_m[g]);
    const u32 l_addr = shared_address(&cta_l[g]);
    const u32 a_addr = shared_address(&cta_acc[g][d]);
    float pm[CLUSTER], pl[CLUSTER], pa[CLUSTER];
#pragma unroll
    for (int p = 0; p < CLUSTER; ++p) {
      pm[p] = peer_load(m_addr, p);
      pl[p] = peer_load(l_addr, p);
      pa[p] = peer_load(a_addr, p);
    }
    float mx = NEG_INF;
#pragma unroll
    for (int p = 0; p < CLUSTER; ++p) mx = fmaxf(mx, pm[p]);
    float result = 0.f;
    if (mx != NEG_INF) {
      float a = 0.f, total = 0.f;
#pragma unroll
      for (int p = 0; p < CLUSTER; ++p) {
        const float w = exp2f(pm[p] - mx);
        a = fmaf(w, pa[p], a);
        total = fmaf(w, pl[p], total);
      }
      result = a / total;
    }
    out_ptr[seq * stride_os + (kv_head * GROUP + g) * stride_oh + d] = to_bf16(result);
  }
  STAMP(6);
  // No program leaves while a peer may still read its shared memory. Every peer value was used above, so every
  // read has completed; a relaxed arrive does not make the output stores wait to become visible first.
  cluster_arrive_relaxed();
  cluster_wait();
  STAMP(7);
#if STAMPS
  if (threadIdx.x == 0) {
    unsigned long long wall_end;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(wall_end));
    long long* row = stamps + (blockIdx.y * gridDim.x + blockIdx.x) * (NUM_STAMPS + 2);
    for (int i = 0; i < NUM_STAMPS; ++i) row[i] = clocks[i];
    row[NUM_STAMPS] = (long long)wall_start;
    row[NUM_STAMPS + 1] = (long long)wall_end;
  }
#endif
}
