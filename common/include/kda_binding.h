// kda_binding.h -- checks and helpers that every CUDA stage's torch binding uses
// unchanged. Include after <torch/extension.h>.
//
// KDA_STAGE is the stage's name as a string ("05_cute_bf16"): the build passes
// -DKDA_STAGE_NAME=<SPEC.name>, so error messages name the stage without a
// string edited by hand in each copy.
#pragma once

#include <torch/extension.h>

#include "kda_cuda_check.h"

#define KDA_XSTR_(x) #x
#define KDA_XSTR(x) KDA_XSTR_(x)
#ifdef KDA_STAGE_NAME
#define KDA_STAGE KDA_XSTR(KDA_STAGE_NAME)
#else
#define KDA_STAGE "(unnamed stage)"
#endif

namespace kda_binding {

using OptTensor = c10::optional<torch::Tensor>;

// A defined, contiguous CUDA tensor of `dtype` on q's device; the error names it.
inline void check_tensor(const torch::Tensor& t, const char* name, const torch::Tensor& q,
                         c10::ScalarType dtype = torch::kFloat32) {
  TORCH_CHECK(t.defined(), name, " is undefined");
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == q.device(), name, " must be on ", q.device(), " (like q), got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_shape(const torch::Tensor& t, const char* name, c10::IntArrayRef want) {
  TORCH_CHECK(t.sizes() == want, name, " must have shape ", want, ", got ", t.sizes());
}

inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// The kernels the last call launched (kda_note_launch): a list of dicts with
// grid, block, dynamic shared memory, and the symbol, registers and static
// shared memory of the instantiation launched (cudaFuncGetName,
// cudaFuncGetAttributes).
inline pybind11::list launches() {
  pybind11::list out;
  for (const KdaLaunch& l : kda_launch_log()) {
    cudaFuncAttributes attr{};
    kda_check(cudaFuncGetAttributes(&attr, l.func), "cudaFuncGetAttributes");
    const char* symbol = nullptr;  // the mangled name of the instantiation launched
    kda_check(cudaFuncGetName(&symbol, l.func), "cudaFuncGetName");
    pybind11::dict d;
    d["kernel"] = l.kernel;
    d["symbol"] = symbol != nullptr ? symbol : "";
    d["grid"] = l.grid;
    d["block"] = l.block;
    d["dynamic_smem"] = l.dynamic_smem;
    d["static_smem"] = attr.sharedSizeBytes;
    d["registers"] = attr.numRegs;
    d["local_bytes"] = attr.localSizeBytes;
    out.append(d);
  }
  return out;
}

}  // namespace kda_binding
