// kda_emu.h -- run a kernel's CUDA source on the CPU, for the tests of a machine without a GPU.
//
// Each CUDA thread of a block is a std::thread; the blocks of a grid run one after another.
// __syncthreads is a barrier of the block's threads, __shfl_xor_sync an exchange through a
// slot per lane between two barriers of the warp's threads, and the dynamic shared memory a
// buffer per block, filled with NaN bytes first so that a read before any write shows. What it
// checks: the indexing, the synchronisation and the arithmetic of the source as written (fp32 on
// the host: expf and friends, not the GPU's MUFU). What it cannot: a race that the barriers here
// happen to order, timing, or anything the GPU build's compiler changes.
//
// Use: include this, then the kernel files (which declare their dynamic shared memory through
// KDA_DYNAMIC_SMEM), and launch with kda_emu::launch(grid, threads, smem_bytes, [&] { kernel(p); }).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>  // dim3; __global__, __device__ are empty in a host compiler's pass

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace kda_emu {

struct Block {
  std::barrier<>* block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>>* warp_barriers;
  float* lanes;  // one slot per thread, for the shuffles
  uint32_t* words;  // kWords per thread, for the warp-wide register exchanges (warp_exchange)
  unsigned char* smem;
};

constexpr int kWords = 8;

inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block;

// Run `kernel` (a callable that calls the kernel function) over a 1-D grid of 1-D blocks of
// `threads` threads (a multiple of 32), each block with `smem_bytes` of dynamic shared memory.
template <class Kernel>
void launch(unsigned grid, unsigned threads, size_t smem_bytes, Kernel&& kernel) {
  for (unsigned bx = 0; bx < grid; ++bx) {
    std::barrier<> bar((std::ptrdiff_t)threads);
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < threads / 32; ++w) warps.emplace_back(std::make_unique<std::barrier<>>(32));
    std::vector<float> lanes(threads);
    std::vector<uint32_t> words((size_t)threads * kWords);
    std::unique_ptr<float[]> smem(new float[smem_bytes / sizeof(float) + 4]);
    std::memset(smem.get(), 0xff, smem_bytes);  // NaN in every float
    Block b{&bar, &warps, lanes.data(), words.data(), reinterpret_cast<unsigned char*>(smem.get())};
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        thread_idx = dim3(t);
        block_idx = dim3(bx);
        block_dim = dim3(threads);
        grid_dim = dim3(grid);
        block = &b;
        kernel();
      });
    }
    for (auto& th : pool) th.join();
  }
}

// A warp-wide exchange of registers, as mma.sync and movmatrix make one: each lane of the calling warp puts
// its n (<= kWords) words, then every lane may read the warp's table (lane l's words at l * kWords) until it
// calls warp_exchange_end.
inline const uint32_t* warp_exchange(const uint32_t* mine, int n);
inline void warp_exchange_end();

}  // namespace kda_emu

#define threadIdx (kda_emu::thread_idx)
#define blockIdx (kda_emu::block_idx)
#define blockDim (kda_emu::block_dim)
#define gridDim (kda_emu::grid_dim)
#define KDA_DYNAMIC_SMEM(name) unsigned char* name = kda_emu::block->smem
#define KDA_EMULATED 1  // kernels take their host forms of what has none here (cp.async: a copy at once)

inline void __syncthreads() { kda_emu::block->block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned /*mask: every lane*/, float v, int lane_mask) {
  kda_emu::Block& b = *kda_emu::block;
  const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
  b.lanes[t] = v;
  (*b.warp_barriers)[w]->arrive_and_wait();
  const float r = b.lanes[w * 32 + (lane ^ (unsigned)lane_mask)];
  (*b.warp_barriers)[w]->arrive_and_wait();
  return r;
}

inline const uint32_t* kda_emu::warp_exchange(const uint32_t* mine, int n) {
  kda_emu::Block& b = *kda_emu::block;
  const unsigned t = threadIdx.x, w = t / 32;
  std::memcpy(b.words + (size_t)t * kWords, mine, sizeof(uint32_t) * n);
  (*b.warp_barriers)[w]->arrive_and_wait();
  return b.words + (size_t)w * 32 * kWords;
}
inline void kda_emu::warp_exchange_end() {
  kda_emu::Block& b = *kda_emu::block;
  (*b.warp_barriers)[threadIdx.x / 32]->arrive_and_wait();
}
