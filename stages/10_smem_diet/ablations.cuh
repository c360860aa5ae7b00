// ablations.cuh -- the ablation builds of this stage (stage.py ABLATIONS, common/ablation.py).
//
// Each switch turns ONE of the stage's four ideas off and does there what the
// previous stage (stages/09_fused: stage 09 below and in the switches' names)
// did instead; the other three stay on. This file holds only the switches and
// stage 09's code they choose: the stage's own code is in the other files
// (kda.cu and the .cuh files it includes). In the default build every flag below
// is false and nothing of this file reaches a kernel: each use is a discarded
// `if constexpr` branch, one line at each place where an idea lives.
//
//   KDA_FRAG_STAGE09 (frag_stage09)  the fragments moved as in stage 09: c_to_b
//       writes each movmatrix result as two bf16 halves (the compiler splits and
//       re-packs every word: two PRMT and a SHF per MOVM), and the operands in
//       shared memory -- the A fragments of every product, and both operands of
//       the prepare's products -- come by per-element copies (32-bit shared loads)
//       instead of ldmatrix.
//   KDA_SMEM_STAGE09 (smem_stage09)  exp(glast) stored at d (a compute lane's K/8
//       decay factors are K/8 single loads instead of K/32 16-byte ones), and each
//       16 x 16 product of the prepare by two warps side by side (TiledMma2, 8
//       columns each, both loading the whole A operand).
//   KDA_ROWS_STAGE09 (rows_stage09)  the fused prepare's rows in K1's layout
//       (RawRows: a lane across the 4 rows of its warp) with stage 09's fast
//       stage_rows: 5 butterfly levels for each of 4 rows and 2 tensors, 40
//       shuffles per lane and chunk instead of 6. The fused path then has stage
//       09's roundings (its sums of squares in stage 09's order).
//   KDA_REGS_STAGE09 (regs_stage09)  setmaxnreg as in stage 09: with 8 compute
//       warps (16 warps, 128 registers each at launch) the prepare warps drop to
//       104 registers and the compute warps take 152. setmaxnreg needs sm_90a:
//       stage.py builds this ablation (only this one) for sm_90a.
//
// common.cuh includes this file (only there) after the constants, the MMA types
// and the small helpers, and before the MMA helpers that call it. The prepare's
// types that the rows_stage09 code reads (RawRows, GateParams: prepare.cuh) come
// later, so that code takes them as template parameters.

#pragma once

namespace kda_stage {

#ifdef KDA_FRAG_STAGE09
constexpr bool kFragStage09 = true;
#else
constexpr bool kFragStage09 = false;
#endif
#ifdef KDA_SMEM_STAGE09
constexpr bool kSmemStage09 = true;
#else
constexpr bool kSmemStage09 = false;
#endif
#ifdef KDA_ROWS_STAGE09
constexpr bool kRowsStage09 = true;
#else
constexpr bool kRowsStage09 = false;
#endif
#ifdef KDA_REGS_STAGE09
constexpr bool kRegsStage09 = true;
#else
constexpr bool kRegsStage09 = false;
#endif

// defined with the MMA helpers in common.cuh (the two-warp products below call it)
template <class BAtom, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void mma_smem(TiledMma const& mma, int idx, TensorA const& sA, TensorB const& sB,
                                         TensorC& acc);

namespace ablation {

// ---------------------------------------------------------------------------
// frag_stage09: stage 09's mma_smem, mma_smem_reg and c_to_b
// ---------------------------------------------------------------------------

// acc += sA * sB^T with both operands copied element-wise (cute's default copy of
// the MMA partition: 32-bit shared loads), instead of ldmatrix.
template <class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void mma_smem_by_elements(TiledMma const& mma, int idx, TensorA const& sA,
                                                     TensorB const& sB, TensorC& acc) {
  auto thr_mma = mma.get_slice(idx);
  Tensor tCsA = thr_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K)
  Tensor tCsB = thr_mma.partition_B(sB);           // (MMA, MMA_N, MMA_K)
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  Tensor tCrB = thr_mma.partition_fragment_B(sB);  // (MMA, MMA_N, MMA_K) bf16 registers
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(tCsA(_, _, kb), tCrA(_, _, kb));
    copy(tCsB(_, _, kb), tCrB(_, _, kb));
    gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), acc);  // acc += A_kb * B_kb^T
  }
}

// acc += sA * rB with A copied element-wise, instead of ldmatrix.
template <class TiledMma, class TensorA, class FragB, class TensorC>
__device__ __forceinline__ void mma_smem_reg_by_elements(TiledMma const& mma, int idx, TensorA const& sA,
                                                         FragB const& rB, TensorC& acc) {
  auto thr_mma = mma.get_slice(idx);
  Tensor tCsA = thr_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K)
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(tCsA(_, _, kb), tCrA(_, _, kb));
    gemm(mma, tCrA(_, _, kb), rB(_, _, kb), acc);  // acc += A_kb * B_kb
  }
}

// c_to_b with each movmatrix result written as two bf16 halves of the B fragment.
template <class FragC, class FragB>
__device__ __forceinline__ void c_to_b_by_halves(FragC const& c, FragB& b) {
  CUTE_UNROLL
  for (int mt = 0; mt < size<1>(c); ++mt) {
    CUTE_UNROLL
    for (int nt = 0; nt < size<2>(c); ++nt) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __nv_bfloat162 x = __floats2bfloat162_rn(c(2 * h, mt, nt), c(2 * h + 1, mt, nt));
        uint32_t y;
        SM75_U32x1_MOVM_T::copy(reinterpret_cast<const uint32_t&>(x), y);
        b(2 * h, nt, mt) = bf16::bitcast(static_cast<uint16_t>(y & 0xffffu));
        b(2 * h + 1, nt, mt) = bf16::bitcast(static_cast<uint16_t>(y >> 16));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// smem_stage09: exp(glast) at d (el_index in prepare.cuh returns d), the decay by
// single loads, and stage 09's two-warp products
// ---------------------------------------------------------------------------

// S = diag(exp(glast)) S in place, element by element: el[d] for each of the lane's
// state rows d (K/8 single shared loads).
template <class FragS, class Coords>
__device__ __forceinline__ void decay_by_elements(FragS& rS, Coords const& tCcS, const float* el) {
  CUTE_UNROLL
  for (int e = 0; e < size(rS); ++e) rS(e) *= el[get<0>(tCcS(e))];
}

// 2 warps along N: a 16 x 16 x 16 tile, 64 threads (stage 09's products).
using TiledMma2 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _2, _1>>{}));

// Phase 3, L/Aqk products, two 64-thread tiled MMAs side by side (both read ki as B):
//   warps 0-1:  L   = strict_lower(beta[:, None] * (kd @ ki^T))  -> shared, fp32
//   warps 2-3:  Aqk = lower_incl_diag(qd @ ki^T)                 -> out_Aqk (rows LDA apart), bf16
// (Smem: K1Smem<K, V>.)
template <int K, int V, int LDA, class Smem>
__device__ __forceinline__ void products_two_warps(Smem& sm, int tid, const bf16* qd, bf16* out_Aqk) {
  TiledMma2 mma;
  const int idx = tid % 64;  // thread index inside its 64-thread MMA
  auto thr_mma = mma.get_slice(idx);
  Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (i, d)
  Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, i)
  Tensor tCcC = thr_mma.partition_C(cC);                          // (MMA,MMA_M,MMA_N)
  Tensor acc = thr_mma.partition_fragment_C(cC);                  // (MMA,MMA_M,MMA_N) fp32
  clear(acc);
  if (tid < 64) {
    Tensor sKd = smem_rows<BT, K, K + kPad>(&sm.kd[0][0]);        // (BT,K)   (c, d)
    mma_smem<SM75_U32x2_LDSM_N>(mma, idx, sKd, sKi, acc);         // kd @ ki^T
    Tensor sL = smem_rows<BT, BT, BT>(&sm.L[0][0]);               // (BT,BT)  (c, i)
    Tensor tCsL = thr_mma.partition_C(sL);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), i = get<1>(tCcC(e));
      tCsL(e) = (c > i) ? sm.beta[c] * acc(e) : 0.f;
    }
  } else {
    Tensor sQd = smem_rows<BT, K, K + kPad>(qd);                  // (BT,K)   (c, d)
    mma_smem<SM75_U32x2_LDSM_N>(mma, idx, sQd, sKi, acc);         // qd @ ki^T
    Tensor gA = make_tensor(make_gmem_ptr(out_Aqk),
                            make_layout(Shape<Int<BT>, Int<BT>>{}, make_stride(Int<LDA>{}, _1{})));  // (BT,BT)
    Tensor tCgA = thr_mma.partition_C(gA);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), j = get<1>(tCcC(e));
      tCgA(e) = bf16((j <= c) ? acc(e) : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------
// rows_stage09: the fused prepare's rows in K1's layout
// ---------------------------------------------------------------------------

// T in the rows_stage09 build, nothing elsewhere: the member of RowSlices (GateSlices)
// that holds the rows (gate parameters) in K1's layout there.
struct Nothing {};
template <class T>
using IfRowsStage09 = std::conditional_t<kRowsStage09, T, Nothing>;

// Stage 09's stage_rows<kFast = true> for one chunk (Rows: K1's RawRows<K, V>, Gate:
// GateParams<K>, Smem: K1Smem<K, V>): the sums of squares of the warp's 4 rows, their
// warp sums (warp_sum's butterfly, every row side by side: 40 shuffles per lane),
// then each row's normalisation and gate with the fast approximations: qn with the
// scale folded in, a in log2 units (a log2 e), the sigmoid's exponent as one FMA.
template <class Smem, class Gate, class Rows>
__device__ __forceinline__ void stage_rows_fast(Smem& sm, const KdaFwdParams& p, const Gate& gp, int n, int warp,
                                                int lane, const Rows& r) {
  constexpr int kRows = Rows::kRows, QV = Rows::QV, VV = Rows::VV;
  const float aexp = gp.aexp;
  const float* dtb = gp.dtb;
  float c0[QV];  // 2^(g c1 + c0[j]) = exp(-aexp (g + dt_bias)), c1 = -aexp log2 e
#pragma unroll
  for (int j = 0; j < QV; ++j) c0[j] = -aexp * kLog2e * dtb[j];
  float sq[kRows], sk[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    sq[i] = sk[i] = 0.f;
#pragma unroll
    for (int j = 0; j < QV; ++j) {
      const float qf = static_cast<float>(r.q[i][j]), kf = static_cast<float>(r.k[i][j]);
      sq[i] += qf * qf;
      sk[i] += kf * kf;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {  // warp_sum's butterfly, every row side by side
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      sq[i] += __shfl_xor_sync(kFullMask, sq[i], off);
      sk[i] += __shfl_xor_sync(kFullMask, sk[i], off);
    }
  }
  const int len = min(BT, p.T - n * BT);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int c = warp * kRows + i;
    const bool real = c < len;
    const float rq = rsqrtf(sq[i] + kL2Eps) * p.scale;
    const float rk = rsqrtf(sk[i] + kL2Eps);
    const float lb2 = real ? p.lower_bound * kLog2e : 0.f;  // padded rows get a = 0
    float qn[QV], kn[QV], av[QV];
#pragma unroll
    for (int j = 0; j < QV; ++j) {
      qn[j] = static_cast<float>(r.q[i][j]) * rq;
      kn[j] = static_cast<float>(r.k[i][j]) * rk;
      const float t = ex2_approx(fmaf(static_cast<float>(r.g[i][j]), -aexp * kLog2e, c0[j]));
      av[j] = lb2 * rcp_approx(1.0f + t);
    }
    store_vec(&sm.qn[c][lane * QV], qn);
    store_vec(&sm.kn[c][lane * QV], kn);
    store_vec(&sm.a[c][lane * QV], av);
    store_vec(&sm.v[c][lane * VV], r.v[i]);
    const float braw = static_cast<float>(r.beta[i]);
    if (lane == 0) sm.beta[c] = real ? sigmoid_approx(braw) : 0.f;
  }
}

// ---------------------------------------------------------------------------
// regs_stage09: setmaxnreg in the fused kernel
// ---------------------------------------------------------------------------

// Registers per thread after the block is running, where the fused kernel's warps
// outnumber what 168 registers each allow (8 compute warps: 16 warps, 128 each at
// launch): the prepare warps hand their spare registers to the compute warps (the
// sum is the register file, 8 x 32 x (104 + 152) = 65536). sm_90a only: elsewhere
// these compile to nothing.
constexpr int kPrepRegs = 104, kComputeRegs = 152;

template <int kPrepWarps, int NCW>
__device__ __forceinline__ void setmaxnreg_prepare() {
  static_assert(kPrepWarps % 4 == 0, "the compute warps start a warpgroup (setmaxnreg acts per warpgroup)");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kPrepWarps + NCW > 12) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kPrepRegs));
#endif
}

template <int kPrepWarps, int NCW>
__device__ __forceinline__ void setmaxnreg_compute() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kPrepWarps + NCW > 12) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kComputeRegs));
#endif
}

}  // namespace ablation
}  // namespace kda_stage
