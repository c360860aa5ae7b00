// kda_device.cuh -- small device functions that every CUDA stage uses unchanged.
//
// They live here, not in each stage, so that the diff between two neighbouring
// stages shows only what the later stage changed.
#pragma once

#include <cuda_runtime.h>

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// softplus with the usual cut-off: for x > 20, log1p(exp(x)) == x in fp32.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Sum over the 32 lanes of a warp by a butterfly of __shfl_xor_sync. Every lane
// gets the same (bitwise) result, because each step adds the same two numbers on
// both partner lanes. All 32 lanes must call it (keep it out of lane-divergent
// branches).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
