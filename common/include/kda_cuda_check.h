// kda_cuda_check.h -- error checking shared by the CUDA stages.
//
// Kernel launchers (.cu, no torch headers) return cudaError_t:
//   kernel<<<grid, block, smem, stream>>>(...);
//   KDA_RETURN_IF_ERROR(cudaGetLastError());
// The torch binding (.cpp) turns a failure into a Python RuntimeError:
//   kda_check(kda_fwd_launch(params, stream), "kda forward");
#pragma once

#include <cuda_runtime.h>

#define KDA_RETURN_IF_ERROR(expr)          \
  do {                                     \
    cudaError_t _kda_err = (expr);         \
    if (_kda_err != cudaSuccess) return _kda_err; \
  } while (0)

#ifdef KDA_WITH_TORCH
#include <c10/util/Exception.h>
inline void kda_check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
}
#endif

// ---------------------------------------------------------------------------
// Launch configurations, as the launchers chose them.
//
// A launcher notes each kernel it starts, next to the launch:
//   kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V>, grid, block, smem);
//   kda_prepare_kernel<K, V><<<grid, block, smem, stream>>>(p);
// The binding clears the log before a call (kda_launch_log().clear()) and
// exposes it to Python as ext.launches(): the grid, block and *dynamic* shared
// memory of the last call's kernels, which ptxas's static report cannot know,
// with the registers and static shared memory of the instantiation launched.
#include <vector>

struct KdaLaunch {
  const char* kernel;
  const void* func;   // for cudaFuncGetAttributes, looked up only when asked
  long long grid;     // blocks (x * y * z)
  int block;          // threads per block
  size_t dynamic_smem;
};

inline std::vector<KdaLaunch>& kda_launch_log() {
  static std::vector<KdaLaunch> log;  // one per extension (.so): both TUs share it
  return log;
}

inline void kda_note_launch(const char* kernel, const void* func, dim3 grid, dim3 block, size_t dynamic_smem) {
  kda_launch_log().push_back({kernel, func, (long long)grid.x * grid.y * grid.z,
                              (int)(block.x * block.y * block.z), dynamic_smem});
}

// Opt a kernel in to more than the default 48 KiB of dynamic shared memory, after
// checking that the device has it (cudaErrorInvalidValue when it does not).
template <class Kernel>
cudaError_t kda_allow_smem(Kernel* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0, optin = 0;
  KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (bytes > (size_t)optin) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}
