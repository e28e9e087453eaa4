// Decode attention whose context splits meet in a thread-block cluster (Hopper), compiled by NVRTC at first use
// (cluster_decode.py). The Triton decode kernel merges its splits through global memory: partial stores, a
// release fence, a counter atomic and a round of L2 loads by the last split (2.25 us a layer on the Qwen3-0.6B
// bs1 step). Here the CLUSTER programs of one (sequence, kv head) each hold their
// partial in shared memory, and after one cluster barrier each reads its share of the output's elements from
// every peer's shared memory (distributed shared memory): no global scratch, no atomics, no fence to L2.
//
// Compile-time parameters (-D): GROUP (query heads per kv head), HEAD_DIM, CLUSTER (programs per kv head),
// NUM_WARPS, PREFETCH (keys per slot read before the PDL wait), BLOCK_SIZE (cache page), DIMS_PER_LANE (8 or 16),
// INDEX64 (block table and kv_lens are int64, as in the CUDA-graph step's buffers; else int32).
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
// MMA=1 (tensor cores) replaces the slots above: each warp is one slot that attends to 16-key tiles with
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate), TILES tiles a warp at a time (the first TILES read before the
// wait). Lane = 4 * r + c. Per tile:
//
//   scores  S^T[16 heads x 8 keys] = q[16 heads x HEAD_DIM] . K^T, one n-tile per 8 keys (2 a tile); heads
//           past GROUP are zero rows. Lane (r, c) reads key base + 8 * nt + r, dims 32 * j + 8 * c .. + 7
//           (16 bytes), which are k-steps 2j (words 0, 1) and 2j + 1 (words 2, 3): the contraction's order is
//           free, so q's fragment takes the same dims and no shuffle or shared memory is needed.
//   output  O^T[HEAD_DIM x 8 heads] += V^T[HEAD_DIM x 16 keys] . P^T[16 keys x 8 heads], one m-tile per 16
//           dims. S's accumulator (row = head r, columns = keys 2c, 2c + 1) is P^T's B fragment once rounded
//           to bf16. Lane (r, c) reads keys 2c, 2c + 1, 2c + 8, 2c + 9 at dims 2 * MT * r .. + 2 * MT (MT =
//           HEAD_DIM / 16), and byte permutes pair two keys' values of one dim into a fragment register; m-tile
//           i's rows r and r + 8 are dims 2 * MT * r + i and 2 * MT * r + MT + i.
//
// The CUDA-core path spends most of its time on arithmetic at bs1 (3.2 us of q . k, shuffles and p . v after the
// wait at a group of 4, against 1.8 us at 2); the tensor cores take it.
//
// PDL: before griddepcontrol.wait only what no kernel of this step writes is read (kv_lens, the block table, the
// K/V of every key but the newest, which the attention prologue writes just before this kernel). q and the caches
// are not __restrict__: the kernel before this one writes q and the newest K/V while this one runs, so their
// loads must not take the read-only (ld.global.nc) path; the block table and kv_lens are copied in before the step.

#ifndef MMA
#define MMA 0
#endif

#include "kestrel_cuda.cuh"

#if INDEX64
typedef long long index_t;
#else
typedef int index_t;
#endif

#if MMA
#define SLOTS NUM_WARPS                 // a warp is a slot
#define MT (HEAD_DIM / 16)              // m-tiles of O^T (16 dims each) = k-steps of S
#define K_VECS (HEAD_DIM / 32)          // 16-byte K loads a lane per key (dims 32 j + 8 c)
#define V_VECS (HEAD_DIM / 64)          // 16-byte V loads a lane per key (dims 2 MT r + 8 v)
#define TILE_KEYS 16
// slot_acc rows get a float of padding per lane chunk (2 MT dims of a head), so that a warp's fragment stores
// (lanes r = 0..7 at dims 2 MT r + i) fall in distinct banks instead of two (16-way conflicts unpadded).
#define ACC_ROW (HEAD_DIM + HEAD_DIM / (2 * MT))
#define ACC_AT(d) ((d) + (d) / (2 * MT))
#else
#define ACC_ROW HEAD_DIM
#define ACC_AT(d) (d)
#define LANES_PER_KEY (HEAD_DIM / DIMS_PER_LANE)
#define SLOTS_PER_WARP (32 / LANES_PER_KEY)
#define SLOTS (NUM_WARPS * SLOTS_PER_WARP)
#define ROWS (DIMS_PER_LANE / 8)              // 16-byte loads per lane per key row
#endif
#define THREADS (NUM_WARPS * 32)
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

#if !MMA
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

#endif

#if MMA
struct Tile {                  // one lane's share of a 16-key tile: K of keys 8 nt + r, V of keys 2c, 2c+1, 2c+8, 2c+9
  Vec k[2][K_VECS];
  Vec v[4][V_VECS];
};

// n 16-byte vectors of the key at pos, dims dim0 + i * dim_step; zeros where !valid.
template <int N>
__device__ __forceinline__ void load_row(const index_t* table, const bf16_t* head, long long stride_b,
                                         long long stride_o, int pos, bool valid, int dim0, int dim_step,
                                         Vec (&out)[N]) {
  if (valid) {
    const bf16_t* row = head + table[pos / BLOCK_SIZE] * stride_b + (pos % BLOCK_SIZE) * stride_o + dim0;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = *reinterpret_cast<const Vec*>(row + i * dim_step);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int w = 0; w < 4; ++w) out[i].w[w] = 0u;
  }
}

// The tile whose first key is base; keys past end, and the newest unless `newest_too`, read as zeros.
__device__ __forceinline__ void load_tile(const index_t* table, const bf16_t* k_head, const bf16_t* v_head,
                                          long long stride_kb, long long stride_ko, long long stride_vb,
                                          long long stride_vo, int base, int end, int newest, bool newest_too,
                                          int r, int c, Tile& t) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int pos = base + 8 * nt + r;
    load_row(table, k_head, stride_kb, stride_ko, pos, pos < end && (newest_too || pos != newest), 8 * c, 32,
             t.k[nt]);
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int pos = base + 2 * c + (kk & 1) + 8 * (kk >> 1);
    load_row(table, v_head, stride_vb, stride_vo, pos, pos < end && (newest_too || pos != newest), 2 * MT * r, 8,
             t.v[kk]);
  }
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Element e of a lane's V dims for keys x and y, as one fragment register (x's value in the low half).
__device__ __forceinline__ u32 key_pair(const Vec (&x)[V_VECS], const Vec (&y)[V_VECS], int e) {
  const u32 wx = x[e / 8].w[(e % 8) / 2], wy = y[e / 8].w[(e % 8) / 2];
  return __byte_perm(wx, wy, (e % 2) ? 0x7632 : 0x5410);
}

// One online-softmax step of a warp over TILES tiles (tile t's first key at base0 + t * stride; keys < end count).
// m, l: head r's running max and this lane's share of its sum; acc: O^T's fragments (heads 2c, 2c + 1).
__device__ __forceinline__ void attend_tiles(const Vec (&q)[K_VECS], const Tile (&tiles)[TILES], int base0,
                                             int stride, int end, float scale_log2, int c, float& m, float& l,
                                             float (&acc)[MT][4]) {
  float s[TILES][2][4];
  float mx = NEG_INF;
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    const int base = base0 + t * stride;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[t][nt][i] = 0.f;
    if (base < end) {   // warp-uniform
#pragma unroll
      for (int step = 0; step < MT; ++step)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          mma_bf16(s[t][nt], q[step / 2].w[2 * (step % 2)], 0u, q[step / 2].w[2 * (step % 2) + 1], 0u,
                   tiles[t].k[nt][step / 2].w[2 * (step % 2)], tiles[t].k[nt][step / 2].w[2 * (step % 2) + 1]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = (base + 8 * nt + 2 * c + e < end) ? s[t][nt][e] * scale_log2 : NEG_INF;
        s[t][nt][e] = v;
        mx = fmaxf(mx, v);
      }
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == NEG_INF ? 0.f : m_new;   // no key yet: every p and alpha is exp2(-inf) = 0
  const float alpha = exp2f(m - m_use);
  m = m_new;
  l *= alpha;
  // O^T's columns are heads 2c and 2c + 1, whose softmax state lives in lanes 4 * head.
  const float alpha_lo = __shfl_sync(0xffffffffu, alpha, 8 * c);
  const float alpha_hi = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    acc[i][0] *= alpha_lo; acc[i][1] *= alpha_hi; acc[i][2] *= alpha_lo; acc[i][3] *= alpha_hi;
  }
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    if (base0 + t * stride >= end) continue;   // warp-uniform
    float p[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[nt][e] = round_bf16(exp2f(s[t][nt][e] - m_use));   // the weights the tensor cores see
        l += p[nt][e];
      }
    const u32 b0 = pack(p[0][0], p[0][1]), b1 = pack(p[1][0], p[1][1]);
    const Tile& tile = tiles[t];
#pragma unroll
    for (int i = 0; i < MT; ++i)
      mma_bf16(acc[i], key_pair(tile.v[0], tile.v[1], i), key_pair(tile.v[0], tile.v[1], MT + i),
               key_pair(tile.v[2], tile.v[3], i), key_pair(tile.v[2], tile.v[3], MT + i), b0, b1);
  }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS)
cluster_decode(const bf16_t* q_ptr, const bf16_t* k_cache, const bf16_t* v_cache,
               const index_t* __restrict__ block_table, const index_t* __restrict__ kv_lens, bf16_t* out_ptr,
               float scale_log2,
               long long stride_qs, long long stride_qh,
               long long stride_kb, long long stride_ko, long long stride_kh,
               long long stride_vb, long long stride_vo, long long stride_vh,
               long long stride_bt, long long stride_os, long long stride_oh) {
  __shared__ float slot_acc[SLOTS][GROUP][ACC_ROW];
  __shared__ float slot_m[SLOTS][GROUP];
  __shared__ float slot_l[SLOTS][GROUP];
  __shared__ float cta_acc[GROUP][HEAD_DIM];
  __shared__ float cta_m[GROUP];
  __shared__ float cta_l[GROUP];

  const int rank = (int)cluster_rank();
  const int kv_head = blockIdx.x / CLUSTER;
  const int seq = blockIdx.y;
  const int lane = threadIdx.x % 32;
  // This program's slice of the context; before the wait only what no kernel of the step writes is read.
  const int kv_len = (int)kv_lens[seq];
  const int per = (kv_len + CLUSTER - 1) / CLUSTER;
  const int start = rank * per;
  const int end = min(start + per, kv_len);
  const int newest = kv_len - 1;
  const index_t* table = block_table + seq * stride_bt;
#if MMA
  const int warp = threadIdx.x / 32, r = lane / 4, c = lane % 4;
  const bf16_t* k_head = k_cache + kv_head * stride_kh;
  const bf16_t* v_head = v_cache + kv_head * stride_vh;
  const int stride = TILE_KEYS * NUM_WARPS;            // keys between a warp's consecutive tiles
  const int first = start + TILE_KEYS * warp;          // the warp's first tile
  Tile tiles[TILES];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
    load_tile(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo, first + t * stride, end, newest,
              false, r, c, tiles[t]);

  pdl_wait_then_signal();

  Vec q[K_VECS];   // head r (zeros past GROUP), dims 32 j + 8 c
  {
    const Vec* qp = reinterpret_cast<const Vec*>(q_ptr + seq * stride_qs + (kv_head * GROUP + r) * stride_qh + 8 * c);
#pragma unroll
    for (int j = 0; j < K_VECS; ++j) {
      if (r < GROUP) q[j] = qp[4 * j];
      else for (int w = 0; w < 4; ++w) q[j].w[w] = 0u;
    }
  }
#pragma unroll
  for (int t = 0; t < TILES; ++t) {   // the newest key, written by the kernel before this one
    const int base = first + t * stride;
    if (newest >= base && newest < base + TILE_KEYS && newest < end)
      load_tile(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo, base, end, newest, true, r, c,
                tiles[t]);
  }
  float m = NEG_INF, l = 0.f, acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  attend_tiles(q, tiles, first, stride, end, scale_log2, c, m, l, acc);
  // Longer slices: TILES tiles a warp at a time, read after the wait (program-uniform bound).
  for (int chunk = start + TILES * stride; chunk < end; chunk += TILES * stride) {
#pragma unroll
    for (int t = 0; t < TILES; ++t)
      load_tile(table, k_head, v_head, stride_kb, stride_ko, stride_vb, stride_vo,
                chunk + TILE_KEYS * warp + t * stride, end, newest, true, r, c, tiles[t]);
    attend_tiles(q, tiles, chunk + TILE_KEYS * warp, stride, end, scale_log2, c, m, l, acc);
  }

  // Warps -> program: the warp's partial into its slot. Lane (r, c) holds heads 2c, 2c + 1 at dims
  // 2 MT r + i (acc[i][0], [1]) and 2 MT r + MT + i (acc[i][2], [3]); head r's sum is spread over its quad.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (2 * c + h < GROUP) {
        slot_acc[warp][2 * c + h][ACC_AT(2 * MT * r + i)] = acc[i][h];
        slot_acc[warp][2 * c + h][ACC_AT(2 * MT * r + MT + i)] = acc[i][2 + h];
      }
  if (c == 0 && r < GROUP) { slot_m[warp][r] = m; slot_l[warp][r] = l; }
#else
  const int slot = (threadIdx.x / 32) * SLOTS_PER_WARP + lane / LANES_PER_KEY;
  const int dim0 = (lane % LANES_PER_KEY) * DIMS_PER_LANE;
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

  // Slots -> program.
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) slot_acc[slot][g][dim0 + e] = acc[g][e];
    if (dim0 == 0) { slot_m[slot][g] = m[g]; slot_l[slot][g] = l[g]; }
  }
#endif
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
        a = fmaf(w, slot_acc[j][g][ACC_AT(d)], a);
        total = fmaf(w, slot_l[j][g], total);
      }
    }
    cta_acc[g][d] = a;
    if (d == 0) { cta_m[g] = mx; cta_l[g] = total; }
  }

  // Programs -> output, through the peers' shared memory.
  cluster_arrive();
  cluster_wait();
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
  // No program leaves while a peer may still read its shared memory. Every peer value was used above, so every
  // read has completed; a relaxed arrive does not make the output stores wait to become visible first.
  cluster_arrive_relaxed();
  cluster_wait();
}
