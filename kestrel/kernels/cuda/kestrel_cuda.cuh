// What the NVRTC-compiled kernels share (kestrel/kernels/cuda/cuda_rtc.py hands it to every compile as "kestrel_cuda.cuh"): bf16 bits
// as 16-bit integers, 16-byte vectors of 8 of them, torch's rounding, and the PDL wait.

typedef unsigned int u32;
typedef unsigned short bf16_t;

struct __align__(16) Vec { u32 w[4]; };   // 8 bf16 values: one 16-byte load

__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }         // the first bf16 of v
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }  // the second

__device__ __forceinline__ void unpack(const Vec& v, float* f) {   // 8 floats, in memory order
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo(v.w[i]);
    f[2 * i + 1] = hi(v.w[i]);
  }
}

__device__ __forceinline__ bf16_t to_bf16(float f) {   // round to nearest even, as torch does
  u32 u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float((u32)to_bf16(f) << 16); }

__device__ __forceinline__ u32 pack(float a, float b) {   // two bf16 in one word, a in the low half
  return (u32)to_bf16(a) | ((u32)to_bf16(b) << 16);
}

// Wait for the kernel before this one (its writes visible), then let the next kernel launch (kestrel/kernels/triton/pdl.py).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_signal() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait_then_signal() {
  pdl_wait();
  pdl_signal();
}
