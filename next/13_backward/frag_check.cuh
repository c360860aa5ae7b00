// frag_check.cuh -- kda_frag_check_kernel: the fragment identity that the
// recurrence relies on (c_to_b), tested on its own (stage.frag_check).
#pragma once

#include "common.cuh"

namespace kda_stage {

// ---------------------------------------------------------------------------
// kda_frag_check_kernel -- the fragment identity behind this stage, tested on
// its own: one warp loads X (KD x 16, fp32) as an ACCUMULATOR fragment, turns it
// into a B fragment with c_to_b (movmatrix), multiplies A (16 x KD, bf16) by it
// and writes out = A @ bf16(X) (16 x 16, fp32). KD = 16 is vcorr's case (one
// k-tile), KD = K the state's (K/16 k-tiles). grid = 1, block = 32.
// ---------------------------------------------------------------------------
template <int KD>
__global__ void __launch_bounds__(32) kda_frag_check_kernel(const bf16* A, const float* X, float* out) {
  const int lane = threadIdx.x;
  WarpMma mma;
  auto thr_mma = mma.get_slice(lane);
  Tensor cX = make_identity_tensor(Shape<Int<KD>, Int<VW>>{});    // X as an (M = KD, N = 16) C tile
  Tensor tCcX = thr_mma.partition_C(cX);
  Tensor rX = thr_mma.partition_fragment_C(cX);
  CUTE_UNROLL
  for (int e = 0; e < size(rX); ++e) rX(e) = X[get<0>(tCcX(e)) * VW + get<1>(tCcX(e))];
  Tensor rXb = b_fragment<VW, KD>(thr_mma);
  c_to_b(rX, rXb);

  Tensor gA = make_tensor(make_gmem_ptr(A), make_layout(Shape<Int<BT>, Int<KD>>{}, LayoutRight{}));
  Tensor tCgA = thr_mma.partition_A(gA);
  Tensor tCrA = thr_mma.partition_fragment_A(gA);
  copy(tCgA, tCrA);
  Tensor cO = make_identity_tensor(Shape<Int<BT>, Int<VW>>{});
  Tensor tCcO = thr_mma.partition_C(cO);
  Tensor acc = thr_mma.partition_fragment_C(cO);
  clear(acc);
  gemm(mma, tCrA, rXb, acc);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) out[get<0>(tCcO(e)) * VW + get<1>(tCcO(e))] = acc(e);
}

}  // namespace kda_stage
