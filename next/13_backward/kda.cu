// kda.cu -- stage 12: stage 11's kernels with the softplus gate on the tensor cores.
//
// Kimi Linear was trained with the softplus gate, a = -exp(A_log) softplus(g + dt_bias),
// which has no lower bound: at A_log = 3 a token can decay by 400. Stages 05-11 form
// the chunk's two 16 x 16 products factored, kd @ ki^T with ki = kn exp(-gc), which
// holds only while a chunk decays by less than about 88 (fp32's exponent): hence the
// bounded gate (lower_bound >= -5: at most 80 per chunk). Every other operand of the
// chunk is kn, qn or v times a decay <= 1 and was never at risk.
//
//   * pairwise products (prepare.cuh, products_pairwise): L and Aqk pair by pair in
//     fp32 with exp(gc_i - gc_j) <= 1, off-diagonal 4 x 4 tiles through a reference
//     row inside the pair's span, so nothing overflows for any a <= 0. kr takes
//     exp(glast - gc) as an exponential of its own instead of e^glast / e^gc.
//   * the softplus gate (gate_id 0) in both pre-stages: softplus(x) = max(x, 0) +
//     ln(1 + e^-|x|) (the fused prepare: two MUFU, ex2 and lg2).
//   * the log decay without a bound (gate_id 3, lower_bound 0: FLA's safe_gate=False).
//
//   * pairwise only where needed: the factored products are cheaper (two MMAs against
//     10 tiles of fp32 work), and most chunks of the softplus gate decay by far less
//     than 80. So an unbounded gate's chunk checks its own decay glast after the
//     cumsum (one barrier with an OR over its key dimensions) and takes the factored
//     products when every dimension decays by at most kFactoredRange = 80 (what the
//     bounded gate guarantees), the pairwise ones otherwise.
//
//   * u in two halves (prepare.cuh, invert and w_u): u = Af @ v with Af = X * beta
//     split into two bf16, Af_hi + Af_lo, one more MMA per tile of u; u, from which
//     every state update is built, no longer carries Af's bf16 rounding (the largest
//     error of the state after vcorr's own rounding, which is on the serial chain).
//
// The variants are template parameters of the prepare kernels (common.cuh Prep), picked
// once per call by with_prep below from KdaFwdParams::products and u_halves, which the
// binding sets from the gate: a bounded gate runs the factored products with u rounded
// once, stage 11's instantiation (its bits and its code: no pairwise code is compiled
// into it); a gate without a bound runs the products as needed with u in two halves.
// The caller may pin either (the binding's `pairwise` and `u_halves`): with pairwise
// in every chunk a call computes the same L and Aqk pair by pair, which is how the
// scheme's cost is measured.
//
// Files (one translation unit: kda.cu includes the kernel files):
//   common.cuh      constants, MMA helpers and fragment moves, vector accesses,
//                   mbarriers, the shared-memory layouts two kernels share
//   ablations.cuh   no switches in this stage (stage.py ABLATIONS is empty: why there)
//   prepare.cuh     the prepare's phases and kda_prepare_kernel (K1)
//   recurrence.cuh  recurrence_warp and kda_recurrence_kernel (K2)
//   fused.cuh       kda_fused_kernel (prepare teams and compute warps in one block)
//   frag_check.cuh  kda_frag_check_kernel (the tests' fragment identity)
//   kda.cu          the plan (kda_fwd_plan: the path rule) and the launches

#include <cuda_runtime.h>

#include <algorithm>

#include "kda.h"
#include "kda_cuda_check.h"

#include "common.cuh"
#include "prepare.cuh"
#include "recurrence.cuh"
#include "fused.cuh"
#include "frag_check.cuh"
#include "backward.cuh"

namespace kda_stage {

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------


template <int K, int V, int NCW, int S>
cudaError_t launch_recurrence_ring(const KdaFwdParams& p, long long blocks, cudaStream_t stream) {
  const size_t smem = sizeof(K2Smem<K, NCW, S>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recurrence_kernel<K, V, NCW, S>, smem));
  kda_note_launch("kda_recurrence_kernel", (const void*)kda_recurrence_kernel<K, V, NCW, S>, dim3((unsigned)blocks), dim3(32 * (NCW + 1)), smem);
  kda_recurrence_kernel<K, V, NCW, S><<<(unsigned)blocks, 32 * (NCW + 1), smem, stream>>>(p);
  return cudaGetLastError();
}

// K2 with the ring of kStagesFor<K> slots, or at K = 64, where every block has an SM to
// itself (blocks <= SMs) and the deeper ring fits a block's shared memory (86,144 bytes at
// NCW = 2: not on parts with less per block), kLoneStages64. p.deep_ring pins either
// (0: kStagesFor everywhere; 1: kLoneStages64 at K = 64, an error where it does not fit).
template <int K, int V, int NCW>
cudaError_t launch_recurrence(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.N * p.H * (V / (VW * NCW));
  if constexpr (K == 64) {
    if (p.deep_ring != 0) {
      int dev = 0, sms = 0, optin = 0;
      KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
      KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      const bool fits = sizeof(K2Smem<K, NCW, kLoneStages64>) <= (size_t)optin;
      if (p.deep_ring == 1 && !fits) return cudaErrorInvalidConfiguration;
      if (fits && (p.deep_ring == 1 || blocks <= sms))
        return launch_recurrence_ring<K, V, NCW, kLoneStages64>(p, blocks, stream);
    }
  }
  return launch_recurrence_ring<K, V, NCW, kStagesFor<K>>(p, blocks, stream);
}

template <int K, int V, int NCW, class Pv>
cudaError_t launch_fused(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.N * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(FusedSmem<K, V, NCW>);
  const int threads = kPrepThreads + 32 * NCW;
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_fused_kernel<K, V, NCW, Pv>, smem));
  kda_note_launch("kda_fused_kernel", (const void*)kda_fused_kernel<K, V, NCW, Pv>, dim3((unsigned)blocks), dim3(threads), smem);
  kda_fused_kernel<K, V, NCW, Pv><<<(unsigned)blocks, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

// The prepare's variant of a call (KdaFwdParams::products, u_halves) as the type Prep<...>,
// handed to f: the launcher's one switch over the variants (FlashKDA's launch_fwd picks its
// template arguments the same way). Each case is an instantiation of K1 and the fused kernel.
template <class F>
cudaError_t with_prep(const KdaFwdParams& p, F&& f) {
  switch (p.products * 2 + p.u_halves) {
    case KDA_PRODUCTS_FACTORED * 2 + 0: return f(Prep<KDA_PRODUCTS_FACTORED, false>{});    // the bounded gate's
    case KDA_PRODUCTS_FACTORED * 2 + 1: return f(Prep<KDA_PRODUCTS_FACTORED, true>{});
    case KDA_PRODUCTS_AS_NEEDED * 2 + 1: return f(Prep<KDA_PRODUCTS_AS_NEEDED, true>{});  // an unbounded gate's
    case KDA_PRODUCTS_AS_NEEDED * 2 + 0: return f(Prep<KDA_PRODUCTS_AS_NEEDED, false>{});
    case KDA_PRODUCTS_PAIRWISE * 2 + 1: return f(Prep<KDA_PRODUCTS_PAIRWISE, true>{});
    case KDA_PRODUCTS_PAIRWISE * 2 + 0: return f(Prep<KDA_PRODUCTS_PAIRWISE, false>{});
    default: return cudaErrorInvalidValue;
  }
}

template <int K, int V>
cudaError_t launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (plan.fused) {
    return with_prep(p, [&](auto pv) -> cudaError_t {
      using Pv = decltype(pv);
      switch (plan.ncw) {
        case 1: return launch_fused<K, V, 1, Pv>(p, stream);
        case 2: return launch_fused<K, V, 2, Pv>(p, stream);
        case 4: return launch_fused<K, V, 4, Pv>(p, stream);
        case 8: if constexpr (V >= 128) return launch_fused<K, V, 8, Pv>(p, stream);
                return cudaErrorInvalidValue;
        default: return cudaErrorInvalidValue;
      }
    });
  }
  const long long bhs = (long long)p.N * p.H;  // N*H*NT and N*H*V/16 <= INT_MAX (checked by the binding)
  if (kernels & KDA_LAUNCH_K1) {
    KDA_RETURN_IF_ERROR(with_prep(p, [&](auto pv) -> cudaError_t {
      using Pv = decltype(pv);
      const size_t smem1 = sizeof(K1Smem<K, V>);
      KDA_RETURN_IF_ERROR(kda_allow_smem(kda_prepare_kernel<K, V, Pv>, smem1));
      kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V, Pv>, dim3((unsigned)(bhs * p.NC)), dim3(kThreads), smem1);
      kda_prepare_kernel<K, V, Pv><<<(unsigned)(bhs * p.NC), kThreads, smem1, stream>>>(p);
      return cudaGetLastError();
    }));
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
  if (p.N < 1 || p.T < 1 || p.H < 1 || p.K != p.V || (p.K != 64 && p.K != 128)) return cudaErrorInvalidValue;
  const int max_ncw = p.V / kda_stage::VW;
  if (want_fused >= 0 && !(want_fused == 0 && want_ncw == 0)) {  // a path asked for by name (the tests' knob)
    const bool ok = want_fused ? (want_ncw == 1 || want_ncw == 2 || want_ncw == 4 || want_ncw == 8) && want_ncw <= max_ncw
                               : (want_ncw == 1 || want_ncw == 2);
    if (!ok) return cudaErrorInvalidValue;
    *plan = KdaPlan{want_fused != 0, want_ncw};
    return cudaSuccess;
  }
  int dev = 0, sms = 0;
  KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const long long bhs = (long long)p.N * p.H;  // (sequence, head) pairs: a block each (fused8)
  // At V = 128 the fused kernel where its blocks fill the SMs (a "head" below is
  // a (sequence, head) pair, N*H of them): eight compute warps (one block per
  // head) once the heads fill about two thirds of the SMs, four (two blocks per
  // head, each preparing every chunk) where that doubling fills one to two thirds
  // without a second wave. Measured (paths table): fused8
  // 0.72 against 1.16 ms for the split path at 512 heads and 1.41 against 1.72 ms
  // at 96 heads; fused4 0.133 against 0.163 ms and 1.01 against 1.18 ms at 64
  // heads (there fused8, with half the SMs idle, is slower than the split path).
  // Below that, and at V = 64 (not measured fused at many heads), the split
  // path: two compute warps per K2 block as soon as those blocks still cover the
  // SMs once (stage 07 asked for twice: measured 1.2-1.3x slower at 64 and 96
  // heads). docs/PERF_NOTES.md, results/h200/stage08/. Stage 12 re-measured the
  // split width at V = 128 where the serial chain binds (few heads, long
  // sequences; results/h200/stage12/softplus_paths_call2.json): two compute warps there
  // too, though their blocks do not cover the SMs (10.02 against 12.01 ms at
  // B1 T131072 H32, 0.750 against 0.776 ms at B1 T8192 H32, 0.215 against
  // 0.223 ms at B1 T4096 H16), as long as one-warp blocks would cover half the SMs:
  // with fewer heads the wider blocks leave most SMs idle (results/h200/stage12/
  // summit_c8a9662.json: 2.31 against 2.22 ms at B1 T65536 H4, 0.270 against
  // 0.250 ms at B1 T8192 H1). So at V = 128 two where 2 * B*H*V/16 >= SMs.
  if (want_fused < 0 && p.V == 128 && 3 * bhs >= 2LL * sms) {
    *plan = KdaPlan{true, 8};
    return cudaSuccess;
  }
  if (want_fused < 0 && p.V == 128 && 3 * bhs >= (long long)sms && 2 * bhs <= (long long)sms) {
    *plan = KdaPlan{true, 4};
    return cudaSuccess;
  }
  const bool two = p.V == 128 ? 2 * bhs * (p.V / kda_stage::VW) >= sms : bhs * (p.V / (2 * kda_stage::VW)) >= sms;
  *plan = KdaPlan{false, two ? 2 : 1};
  return cudaSuccess;
}

// The hybrid's rule: a fused block carries its sequence's whole chain of chunks, each
// chunk prepared in the block (about 2.5x the split path's time per chunk on the H200),
// so a sequence whose chain is longer than an SM's share of all the work (H * total / SMs
// tokens, one fused block per SM) sets the fused kernel's time alone; below that share
// the fused kernel is bound by its work, which the split path does less efficiently
// (measured: four sequences of 4096 among 60 of 128-1024 tokens at H = 32 ran 1.33x
// slower split off). Such a sequence, if it also has 2048 tokens (two segments) and 4x
// the mean length, runs on the split path beside the fused kernel. results/h200/stage11/.
int kda_hybrid_long_from(const KdaFwdParams& p, const KdaPlan& plan, long long total_tokens, int max_len) {
  constexpr long long kMinTokens = 2048, kMeanFactor = 4;
  int dev = 0, sms = 0;
  if (!plan.fused || p.N < 2 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1)
    return 0;
  const long long share = ((long long)p.H * total_tokens + sms - 1) / sms;
  const long long from = std::max({kMinTokens, kMeanFactor * ((total_tokens + p.N - 1) / p.N), share});
  return max_len >= from ? (int)from : 0;
}

cudaError_t kda_fwd_launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (kernels < KDA_LAUNCH_K1 || kernels > KDA_LAUNCH_ALL) return cudaErrorInvalidValue;
  const int nt_max = (p.T + kda_stage::BT - 1) / kda_stage::BT;
  if (p.N < 1 || p.T < 1 || p.H < 1 || p.K != p.V) return cudaErrorInvalidValue;
  if (p.cu_seqlens == nullptr ? (p.N != p.B || p.NT != nt_max) : (p.B != 1 || p.NT < 1 || p.NT > nt_max))
    return cudaErrorInvalidValue;  // batch rows, or packed sequences no longer than the packed tokens
  const bool raw_gate = p.gate_id == KDA_GATE_SOFTPLUS || p.gate_id == KDA_GATE_BOUNDED;
  if (!(raw_gate && p.g != nullptr) && !(p.gate_id == KDA_GATE_LOG && p.g_log != nullptr))
    return cudaErrorInvalidValue;  // the gate and its input
  const bool bounded = p.gate_id == KDA_GATE_BOUNDED || (p.gate_id == KDA_GATE_LOG && p.lower_bound < 0.f);
  if (p.products < KDA_PRODUCTS_FACTORED || p.products > KDA_PRODUCTS_AS_NEEDED ||
      (!bounded && p.products == KDA_PRODUCTS_FACTORED))
    return cudaErrorInvalidValue;  // the factored products in every chunk need a bounded gate
  if (p.beta_mode < 0 || p.beta_mode > 2 || (p.u_halves != 0 && p.u_halves != 1)) return cudaErrorInvalidValue;
  if (p.deep_ring < -1 || p.deep_ring > 1 || (p.deep_ring == 1 && p.K != 64)) return cudaErrorInvalidValue;
  if (p.n_skip < 0 || p.n_skip > KDA_MAX_SKIP || (p.n_skip > 0 && !plan.fused)) return cudaErrorInvalidValue;
  for (int r = 0; r < p.n_skip; ++r)
    if (p.skip_lo[r] < 0 || p.skip_lo[r] >= p.skip_hi[r] || p.skip_hi[r] > p.N) return cudaErrorInvalidValue;
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

namespace kda_stage {
namespace bwd {

template <int D, class Smem, class Kernel>
cudaError_t launch_one(const char* name, Kernel* kernel, long long blocks, int threads, const KdaBwdParams& p,
                       cudaStream_t stream) {
  const size_t smem = sizeof(Smem);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kernel, smem));
  kda_note_launch(name, (const void*)kernel, dim3((unsigned)blocks), dim3(threads), smem);
  kernel<<<(unsigned)blocks, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_all(const KdaBwdParams& p, cudaStream_t stream) {
  const long long chunks = (long long)p.N * p.H * p.NT, chains = (long long)p.N * p.H * (D / kVTile);
  KDA_RETURN_IF_ERROR((launch_one<D, PrepSmem<D>>("kda_bwd_prepare_kernel", kda_bwd_prepare_kernel<D>, chunks,
                                                   kPrepThreads, p, stream)));
#ifdef KDA_BWD_FP32_CHAINS  // the variant build: the chains on the CUDA cores, in fp32
  KDA_RETURN_IF_ERROR((launch_one<D, ChainSmem<D>>("kda_bwd_chains_kernel", kda_bwd_chains_kernel<D>, 2 * chains,
                                                   kChainThreads, p, stream)));
#else
  KDA_RETURN_IF_ERROR((launch_one<D, MmaChainSmem<D>>("kda_bwd_chains_mma_kernel", kda_bwd_chains_mma_kernel<D>,
                                                      2 * chains, kMmaChainThreads, p, stream)));
#endif
  return launch_one<D, AdjSmem<D>>("kda_bwd_adjoint_kernel", kda_bwd_adjoint_kernel<D>, chunks, kAdjThreads, p,
                                   stream);
}

}  // namespace bwd
}  // namespace kda_stage

cudaError_t kda_bwd_launch(const KdaBwdParams& p, cudaStream_t stream) {
  const int nt_max = (p.T + kda_stage::BT - 1) / kda_stage::BT;
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.N < 1) return cudaErrorInvalidValue;
  if (p.cu_seqlens == nullptr ? (p.N != p.B || p.NT != nt_max) : (p.B != 1 || p.NT < 1 || p.NT > nt_max))
    return cudaErrorInvalidValue;
  if (p.gate_id != KDA_GATE_SOFTPLUS && p.gate_id != KDA_GATE_BOUNDED) return cudaErrorInvalidValue;
  if (p.D == 64) return kda_stage::bwd::launch_all<64>(p, stream);
  if (p.D == 128) return kda_stage::bwd::launch_all<128>(p, stream);
  return cudaErrorInvalidValue;
}
