// kda.cu -- stage 10: stage 09 with less work around each MMA.
//
// Stage 09's fused kernel is as fast as its two prepare teams can stream chunks
// and its compute warps can run the chain on them. What bounds both is the work
// that moves operands, not the MMAs: the SASS of the chain and Nsight Compute's
// source counters of the prepare (shuffles, shared loads) said so, and after the
// first two changes below ncu put the kernel at 85% of its L1/shared throughput
// (fused8, B = 8, T = 1024, H = 64). This stage keeps every path, the rule and
// the bits of the split path, and cuts that work, each change measured on its
// own (docs/PERF_NOTES.md, outcomes 10 and 11; a switch each, stage.py ABLATIONS):
//
//   * The chain's B fragments as words: c_to_b writes each movmatrix result as
//     one 32-bit word (as two bf16 halves the compiler split and re-packed every
//     word: 2 PRMT + 1 SHF per MOVM), and the A fragments come by ldmatrix
//     (mma_smem, mma_smem_reg) instead of four 32-bit shared loads each. The
//     compute warps' loop: 832 -> 560 instructions per chunk, K2 too.
//
//   * Eight lanes per token in the fused prepare (stage_row_slices): the
//     L2-norm sums of a row need 3 butterfly levels, 6 shuffles per lane and
//     chunk, where K1's layout (4 warps x 4 rows) needs 40. K1 keeps stage 07's
//     layout and arithmetic (the split path stays bitwise stage 07's).
//
//   * exp(glast) stored at el_index(d), so that a lane's 16 decay factors are
//     four 16-byte loads instead of 16 four-byte ones, and one warp per 16 x 16
//     product of the prepare (its A operand loaded once); both operands of the
//     prepare's products by ldmatrix (LDSM_T for the N-major B).
//
//   * With those the compute warps fit in 128 registers: no setmaxnreg, and no
//     sm_90a build (128 for all 16 warps of fused8 beat 104/152).
//
// Numerics: the split path has stage 07's roundings (bitwise equal outputs).
// The fused path sums each row's squares in another order than stage 09's
// (eight lanes, then a butterfly): its outputs differ from stage 09's by
// rounding (the paths table of results/h200/stage10/ gives the figure), not
// measurably against fp64. Both bitwise deterministic.
//
// Files (one translation unit: kda.cu includes the kernel files):
//   common.cuh      constants, MMA helpers and fragment moves, vector accesses,
//                   mbarriers, the shared-memory layouts two kernels share
//   ablations.cuh   the ablation switches (stage.py ABLATIONS) and, for each, the
//                   previous stage's code; included by common.cuh
//   prepare.cuh     the prepare's phases and kda_prepare_kernel (K1)
//   recurrence.cuh  recurrence_warp and kda_recurrence_kernel (K2)
//   fused.cuh       kda_fused_kernel (prepare teams and compute warps in one block)
//   frag_check.cuh  kda_frag_check_kernel (the tests' fragment identity)
//   kda.cu          the plan (kda_fwd_plan: the path rule) and the launches

#include <cuda_runtime.h>

#include "kda.h"
#include "kda_cuda_check.h"

#include "common.cuh"
#include "prepare.cuh"
#include "recurrence.cuh"
#include "fused.cuh"
#include "frag_check.cuh"

namespace kda_stage {

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------


template <int K, int V, int NCW>
cudaError_t launch_recurrence(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.B * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(K2Smem<K, NCW>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recurrence_kernel<K, V, NCW>, smem));
  kda_note_launch("kda_recurrence_kernel", (const void*)kda_recurrence_kernel<K, V, NCW>, dim3((unsigned)blocks), dim3(32 * (NCW + 1)), smem);
  kda_recurrence_kernel<K, V, NCW><<<(unsigned)blocks, 32 * (NCW + 1), smem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, int V, int NCW>
cudaError_t launch_fused(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.B * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(FusedSmem<K, V, NCW>);
  const int threads = kPrepThreads + 32 * NCW;
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_fused_kernel<K, V, NCW>, smem));
  kda_note_launch("kda_fused_kernel", (const void*)kda_fused_kernel<K, V, NCW>, dim3((unsigned)blocks), dim3(threads), smem);
  kda_fused_kernel<K, V, NCW><<<(unsigned)blocks, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, int V>
cudaError_t launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (plan.fused) {
    switch (plan.ncw) {
      case 1: return launch_fused<K, V, 1>(p, stream);
      case 2: return launch_fused<K, V, 2>(p, stream);
      case 4: return launch_fused<K, V, 4>(p, stream);
      case 8: if constexpr (V >= 128) return launch_fused<K, V, 8>(p, stream);
              return cudaErrorInvalidValue;
      default: return cudaErrorInvalidValue;
    }
  }
  const long long bhs = (long long)p.B * p.H;  // B*H*NT and B*H*V/16 <= INT_MAX (checked by the binding)
  if (kernels & KDA_LAUNCH_K1) {
    const size_t smem1 = sizeof(K1Smem<K, V>);
    KDA_RETURN_IF_ERROR(kda_allow_smem(kda_prepare_kernel<K, V>, smem1));
    kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V>, dim3((unsigned)(bhs * p.NC)), dim3(kThreads), smem1);
    kda_prepare_kernel<K, V><<<(unsigned)(bhs * p.NC), kThreads, smem1, stream>>>(p);
    KDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (!(kernels & KDA_LAUNCH_K2)) return cudaSuccess;
  if (plan.ncw == 2) return launch_recurrence<K, V, 2>(p, stream);
  if (plan.ncw == 1) return launch_recurrence<K, V, 1>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kda_stage

// ---------------------------------------------------------------------------
// launcher
// ---------------------------------------------------------------------------

cudaError_t kda_fwd_plan(const KdaFwdParams& p, int want_fused, int want_ncw, KdaPlan* plan) {
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.K != p.V || (p.K != 64 && p.K != 128)) return cudaErrorInvalidValue;
  const int max_ncw = p.V / kda_stage::VW;
  if (want_fused >= 0) {  // a path asked for by name (the benchmark's and the tests' knob)
    const bool ok = want_fused ? (want_ncw == 1 || want_ncw == 2 || want_ncw == 4 || want_ncw == 8) && want_ncw <= max_ncw
                               : (want_ncw == 1 || want_ncw == 2);
    if (!ok) return cudaErrorInvalidValue;
    *plan = KdaPlan{want_fused != 0, want_ncw};
    return cudaSuccess;
  }
  int dev = 0, sms = 0;
  KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const long long bhs = (long long)p.B * p.H;
  // At V = 128 the fused kernel where its blocks fill the SMs: eight compute
  // warps (one block per head) once the heads fill about two thirds of the SMs,
  // four (two blocks per head, each preparing every chunk) where that doubling
  // fills one to two thirds without a second wave. Measured (paths table): fused8
  // 0.72 against 1.16 ms for the split path at 512 heads and 1.41 against 1.72 ms
  // at 96 heads; fused4 0.133 against 0.163 ms and 1.01 against 1.18 ms at 64
  // heads (there fused8, with half the SMs idle, is slower than the split path).
  // Below that, and at V = 64 (not measured fused at many heads), the split
  // path: two compute warps per K2 block as soon as those blocks still cover the
  // SMs once (stage 07 asked for twice: measured 1.2-1.3x slower at 64 and 96
  // heads). docs/PERF_NOTES.md, results/h200/stage08/.
  if (p.V == 128 && 3 * bhs >= 2LL * sms) {
    *plan = KdaPlan{true, 8};
    return cudaSuccess;
  }
  if (p.V == 128 && 3 * bhs >= (long long)sms && 2 * bhs <= (long long)sms) {
    *plan = KdaPlan{true, 4};
    return cudaSuccess;
  }
  *plan = KdaPlan{false, bhs * (p.V / (2 * kda_stage::VW)) >= sms ? 2 : 1};
  return cudaSuccess;
}

cudaError_t kda_fwd_launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (kernels < KDA_LAUNCH_K1 || kernels > KDA_LAUNCH_ALL) return cudaErrorInvalidValue;
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.NT != (p.T + kda_stage::BT - 1) / kda_stage::BT || p.K != p.V)
    return cudaErrorInvalidValue;
  if (!plan.fused && (p.qd == nullptr || p.w == nullptr || p.krT == nullptr || p.Aqk == nullptr ||
                      p.u == nullptr || p.el == nullptr))
    return cudaErrorInvalidValue;  // the split path needs the workspace
  if (!plan.fused && (p.n0 < 0 || p.NC < 1 || p.n0 + p.NC > p.NT))
    return cudaErrorInvalidValue;  // a segment of the sequence's chunks
  if (p.K == 64) return kda_stage::launch<64, 64>(p, plan, stream, kernels);
  if (p.K == 128) return kda_stage::launch<128, 128>(p, plan, stream, kernels);
  return cudaErrorInvalidValue;
}

cudaError_t kda_frag_check_launch(const __nv_bfloat16* A, const float* X, float* out, int kd, cudaStream_t stream) {
  const auto* a = reinterpret_cast<const kda_stage::bf16*>(A);
  switch (kd) {
    case 16: kda_stage::kda_frag_check_kernel<16><<<1, 32, 0, stream>>>(a, X, out); break;
    case 64: kda_stage::kda_frag_check_kernel<64><<<1, 32, 0, stream>>>(a, X, out); break;
    case 128: kda_stage::kda_frag_check_kernel<128><<<1, 32, 0, stream>>>(a, X, out); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
