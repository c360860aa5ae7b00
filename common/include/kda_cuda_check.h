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
